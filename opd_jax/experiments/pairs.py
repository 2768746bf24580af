"""Calibrations of several student–teacher pairs side by side: their limits under both labels,
their layer sensitivity and FP8 recipe, and whether one pair's budget predicts another's runs.

The command is `python -m opd_jax.pairs --pair=NAME=DIR ...`. Each DIR is an `opd_jax.calibrate`
workdir (its `study.json` and `runs/`). For each pair and
each label (held-out accuracy, and the held-out KL(student ‖ teacher) as a continuous label,
both read from the same runs) the budget is refitted on its records (`label_records`,
`budget_fit.fit_budget` at the pair's own τ) on two axes:

* absolute: the check's per-token mismatch KL, nats/token;
* relative: that KL over the pair's starting student–teacher KL, KL(π_S0 ‖ π_T) per token on
  the held-out prompts at step 0 (`start_kl`): mismatch as a fraction of the distance OPD has
  to close.

Transfer (`transfer`): pair A's pooled limit, on one axis and label, is applied to pair B's
calibration settings (each setting's mean label over its runs against B's τ: kept or degraded),
and its agreement is reported beside that of B's own pooled limit on the same settings (an
in-sample figure, so an upper bound on what B's budget would score on new settings) and that
of admitting everything (the baseline a limit has to beat).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from opd_jax.experiments import runs, stats, study_setting
from opd_jax.experiments import study as study_lib
from opd_jax.io import json_file
from opd_jax.mismatch import budget, budget_fit

LABELS = ("accuracy", "teacher_kl")
AXES = ("absolute", "relative")


def load(workdir: str) -> dict:
  """A calibration's study.json, with "start_kl": the reference runs' mean held-out
  KL(student ‖ teacher) at step 0 (their runs' `student_teacher_kl_before`)."""
  result = json_file.read_json(os.path.join(workdir, study_lib.STUDY_FILE))
  before = []
  for r in result["rows"]:
    if r["role"] == study_setting.REFERENCE:
      done = runs.read_result(os.path.join(workdir, "runs", r["name"]))
      before.append(done["student_teacher_kl_before"])
  result["start_kl"] = float(np.mean(before))
  return result


def _quality_runs(row: dict, label: str) -> list[float]:
  if label == "accuracy":
    return [float(q) for q in row["accuracy_runs"]]
  return [-float(k) for k in row["teacher_kl_runs"]]


def _x(row: dict, result: dict, axis: str) -> float:
  kl = max(float(row[budget.KL_KEY]), 0.0)
  return kl if axis == "absolute" else kl / result["start_kl"]


def label_records(result: dict, label: str, axis: str = "absolute"):
  """(records, noise floor) of a calibration under `label` on `axis`: the study's records
  (`study.budget_records`: one per run of the reference and calibration rows, drop =
  mean(q_ref) − q) from its rows with their quality under `label` and x on `axis`."""
  rows = [
    {**r, "quality_runs": _quality_runs(r, label), budget.KL_KEY: _x(r, result, axis)}
    for r in result["rows"]
    if r["role"] in (study_setting.REFERENCE, "calibration")
  ]
  reference = [q for r in rows if r["role"] == study_setting.REFERENCE for q in r["quality_runs"]]
  floor = stats.noise_floor(reference, result["num_eval"], label)
  return study_lib.budget_records(rows, floor["mean"]), floor


def settings(result: dict, label: str, axis: str = "absolute") -> list[dict]:
  """The calibration settings of a pair, each with its x on `axis` and whether it kept
  quality: mean drop over its runs ≤ τ under `label`."""
  _, floor = label_records(result, label, axis)
  out = []
  for r in result["rows"]:
    if r["role"] != "calibration":
      continue
    drop = floor["mean"] - float(np.mean(_quality_runs(r, label)))
    out.append(
      {
        "name": r["name"],
        "source": r["source"],
        "x": _x(r, result, axis),
        "drop": drop,
        "kept": drop <= floor["tolerance"],
      }
    )
  return out


def fit(result: dict, label: str, axis: str = "absolute") -> budget.Budget:
  """The pair's budget refitted under `label` on `axis` (its own τ, two crossing records)."""
  records, floor = label_records(result, label, axis)
  crossing = int(result.get("min_crossing_records", 2))
  return budget_fit.fit_budget(records, floor["tolerance"], min_crossing_records=crossing)


def agreement(limit: float, rows: Sequence[dict]) -> dict[str, Any]:
  """How often "admit iff x ≤ limit" matches kept quality on `rows` (`settings`)."""
  right = sum((r["x"] <= limit) == r["kept"] for r in rows)
  return {"right": right, "n": len(rows), "rate": right / len(rows) if rows else math.nan}


def transfer(results: dict[str, dict], label: str, axis: str) -> list[dict]:
  """For each ordered pair (A, B), A ≠ B: A's pooled limit on B's settings, beside B's own."""
  out = []
  for dst, dst_result in results.items():
    rows = settings(dst_result, label, axis)
    own = fit(dst_result, label, axis).max_kl
    for src, src_result in results.items():
      if src == dst:
        continue
      limit = fit(src_result, label, axis).max_kl
      out.append(
        {
          "from": src,
          "to": dst,
          "label": label,
          "axis": axis,
          "limit": limit,
          "agreement": agreement(limit, rows),
          "own_limit": own,
          "own_agreement": agreement(own, rows),
          "admit_all": agreement(math.inf, rows),
        }
      )
  return out


def label_agreement(result: dict) -> dict[str, Any]:
  """How well the two labels predict each other on a pair's runs: the Spearman correlation of
  accuracy with −KL(student ‖ teacher) over every reference and calibration run, and on how
  many calibration settings the two labels give the same kept/degraded call."""
  rows = [r for r in result["rows"] if r["role"] in (study_setting.REFERENCE, "calibration")]
  accuracy = [q for r in rows for q in _quality_runs(r, "accuracy")]
  minus_kl = [q for r in rows for q in _quality_runs(r, "teacher_kl")]
  by_accuracy = settings(result, "accuracy")
  by_kl = settings(result, "teacher_kl")
  same = sum(a["kept"] == k["kept"] for a, k in zip(by_accuracy, by_kl, strict=True))
  return {
    "spearman": stats.spearman(accuracy, minus_kl),
    "runs": len(accuracy),
    "same_call": same,
    "settings": len(by_accuracy),
  }


def pair_summary(name: str, result: dict) -> dict[str, Any]:
  """One pair's row of the table: accuracies, τ and limits under both labels, and the
  sensitivity scan's ranking and FP8 recipe."""
  ref = [r for r in result["rows"] if r["role"] == study_setting.REFERENCE]
  out: dict[str, Any] = {
    "pair": name,
    "teacher_accuracy": result["teacher_accuracy"],
    "student_accuracy_before": result["student_accuracy_before"],
    "student_accuracy_after": float(np.mean([q for r in ref for q in r["accuracy_runs"]])),
    "start_kl": result["start_kl"],
    "run_steps": result["run_steps"],
    "num_runs": result["num_runs"],
    "cost_runs": (result.get("calibration") or {}).get("cost_runs_measured"),
    "labels": {},
    "label_agreement": label_agreement(result),
  }
  for label in LABELS:
    fitted = fit(result, label)
    _, floor = label_records(result, label)
    out["labels"][label] = {
      "tolerance": floor["tolerance"],
      "max_kl": fitted.max_kl,
      "interval": list(fitted.interval),
      "censored": fitted.censored,
      "relative_max": fit(result, label, "relative").max_kl,
      "sources": {
        s: {
          "limit": fitted.source_limit(s),
          "censored": t.censored,
          "max_kl": t.max_kl,
          "interval": list(t.interval),
          "bracket": list(budget_fit.threshold_bracket(t, fitted.tolerance)),
        }
        for s, t in sorted(fitted.sources.items())
      },
    }
  sens = result.get("sensitivity") or {}
  if sens:
    out["ranking"] = {
      source: [e["target"] for e in entries] for source, entries in sens["ranking"].items()
    }
    recipe = sens["recipe"]
    out["recipe"] = {
      "bf16_layers": recipe["bf16_layers"],
      "mismatch/kl": recipe["mismatch/kl"],
      "capacity_ratio": recipe["capacity_ratio"],
      "engine_id": recipe["engine_id"],
    }
  return out


if __name__ == "__main__":  # the command moved up, above the library it runs
  raise SystemExit("error: the command is `python -m opd_jax.pairs` (the same flags)")
