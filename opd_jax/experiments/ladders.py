"""A study's dose ladders read under each label: per source, the rungs, the knee with the
rungs that bracket it, the reference against its plateau, and how many labels sit within the
noise of τ. Pure functions of a finished `study.json` (`experiments.study`); nothing trains.

Labels. Every run records its held-out accuracy and its held-out KL(student ‖ teacher) per
token; a run's quality under a label is q = accuracy, or q = −KL (`label_runs`). The
reference's seeds q_ref,1..m give τ = 2·max(sd(q_ref), resolution) (`stats.noise_floor`; the
study's own τ for the label it was run with), and a setting's drop over its n runs is
d = mean(q_ref) − mean(q).

Knees (`ladder_table`). Per source, one record per run of each single-source setting and of the
reference (x = the check's mismatch/kl, y = that run's drop), fitted by
`budget_fit.fit_budget` at the label's τ: the knee is where the isotonic fit crosses τ, its
interval the bootstrap interval widened to the bracket (a, b] between the last rung the fit
keeps and the first it does not (`budget_fit.knee_bracket`: the data place the knee no more
finely than that).

Labels near τ (`label_band`). A setting's SE of d is

    SE = sqrt(s²/n + s_ref²/m),

s the sample sd of its own runs (s_ref when it has one run), s_ref that of the reference's m
seeds (with one seed, which has no sample sd, the binomial or relative SE of one run,
`stats.noise_floor`'s se); its label is within the noise when |d − τ| ≤ 2·SE. The share of
such labels says how many verdicts a rerun could flip.

Plateau (`plateau`). The reference's mean accuracy against the full-run accuracy a config
names (`full_run_accuracy`): labels mean final quality only when the reference is near its
plateau (at least `min_plateau_share` of it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opd_jax.experiments import stats
from opd_jax.mismatch import budget, budget_fit

LABELS = ("teacher_kl", "accuracy")
BAND_SE = 2.0  # a label is within the noise when |d − τ| ≤ BAND_SE · SE
MIN_PLATEAU_SHARE = 0.85  # the reference near its plateau: this share of the full run's accuracy


def label_runs(row: Mapping[str, Any], label: str) -> list[float] | None:
  """A row's quality per run under `label` (q = accuracy, or q = −KL); None when the row did
  not record it, or recorded NaN (an eval file without answers has no accuracy).

  Raises:
    ValueError: a label not in LABELS.
  """
  if label == "accuracy":
    values = row.get("accuracy_runs", [row.get("accuracy")])
    return (
      None if any(v is None or not math.isfinite(v) for v in values) else list(map(float, values))
    )
  if label == "teacher_kl":
    values = row.get("teacher_kl_runs", [row.get("student_teacher_kl")])
    if any(v is None or not math.isfinite(v) for v in values):
      return None
    return [-float(v) for v in values]
  raise ValueError(f"label {label!r} is not one of {', '.join(LABELS)}")


def reference_runs(result: Mapping, label: str) -> list[float] | None:
  """The reference rows' quality per run under `label`, pooled; None when any lacks it."""
  out = []
  for r in result["rows"]:
    if r["role"] == "reference":
      q = label_runs(r, label)
      if q is None:
        return None
      out += q
  return out or None


def label_tolerance(result: Mapping, label: str) -> dict[str, float] | None:
  """The reference's noise floor under `label` (`stats.noise_floor`), with τ the study's own
  for the label it ran with (a configured τ included); None when the runs lack the label."""
  q_ref = reference_runs(result, label)
  if q_ref is None:
    return None
  floor = stats.noise_floor(q_ref, int(result["num_eval"]), label)
  if label == result.get("label"):
    floor["tolerance"] = float(result["tolerance"])
  return floor


def label_band(result: Mapping, label: str) -> dict[str, Any] | None:
  """How many settings' labels lie within ±BAND_SE·SE of τ (module docstring), over the
  non-reference rows; None when the runs lack the label."""
  floor = label_tolerance(result, label)
  if floor is None:
    return None
  q_ref = reference_runs(result, label)
  m, tau = len(q_ref), floor["tolerance"]
  s_ref = floor["sd"] if m > 1 else floor["se"]  # one seed: sd is unknown, not 0
  settings = []
  for r in result["rows"]:
    q = label_runs(r, label) if r["role"] != "reference" else None
    if not q:
      continue
    n = len(q)
    s = float(np.std(q, ddof=1)) if n > 1 else s_ref
    se = math.sqrt(s * s / n + s_ref * s_ref / m)
    drop = floor["mean"] - float(np.mean(q))
    settings.append(
      {"name": r["name"], "drop": drop, "se": se, "within": abs(drop - tau) <= BAND_SE * se}
    )
  within = sum(s["within"] for s in settings)
  return {
    "tolerance": tau,
    "n": len(settings),
    "within": within,
    "share": within / len(settings) if settings else math.nan,
    "settings": settings,
  }


def ladder_records(result: Mapping, label: str, mean: float) -> list[dict]:
  """One fit record per run of the reference and of each single-source setting: x = the
  check's mismatch/kl, drop = mean(q_ref) − that run's q."""
  out = []
  for r in result["rows"]:
    if r["role"] == "held_out" or "+" in r["source"]:
      continue
    for k, q in enumerate(label_runs(r, label) or []):
      out.append(
        {
          budget.SOURCE_KEY: r["source"],
          "name": r["name"],
          "run": k,
          budget.KL_KEY: float(r[budget.KL_KEY]),
          budget.DROP_KEY: mean - q,
        }
      )
  return out


def ladder_table(result: Mapping, label: str) -> dict[str, Any] | None:
  """Per source under `label`: its rungs (name, check KL, mean drop, kept), the knee, its
  censoring, its interval (bootstrap, widened to the bracket) and the bracket (a, b]; None
  when the runs lack the label or the records span fewer than two KL values."""
  floor = label_tolerance(result, label)
  if floor is None:
    return None
  tau = floor["tolerance"]
  records = ladder_records(result, label, floor["mean"])
  if len({r[budget.KL_KEY] for r in records}) < budget.MIN_DISTINCT_KL:
    return None
  fitted = budget_fit.fit_budget(
    records, tau, min_crossing_records=int(result.get("min_crossing_records", 1))
  )
  sources = {}
  for name, t in sorted(fitted.sources.items()):
    rows = [
      r
      for r in result["rows"]
      if r["source"] == name and r["role"] != "held_out" and label_runs(r, label)
    ]
    rungs = []
    for r in sorted(rows, key=lambda r: r[budget.KL_KEY]):
      drop = floor["mean"] - float(np.mean(label_runs(r, label)))
      rungs.append(
        {"name": r["name"], "kl": float(r[budget.KL_KEY]), "drop": drop, "kept": drop <= tau}
      )
    sources[name] = {
      "knee": t.max_kl,
      "censored": t.censored,
      "interval": list(t.interval),
      "bracket": list(budget_fit.threshold_bracket(t, tau)),
      "rungs": rungs,
    }
  return {"tolerance": tau, "sources": sources}


def plateau(result: Mapping, full_run_accuracy: float | None, min_share: float) -> dict | None:
  """The reference's mean held-out accuracy as a share of `full_run_accuracy`, and whether it
  reaches `min_share`; None without a full-run accuracy or recorded accuracies."""
  q_ref = reference_runs(result, "accuracy")
  if not full_run_accuracy or q_ref is None:
    return None
  mean = float(np.mean(q_ref))
  share = mean / float(full_run_accuracy)
  return {
    "reference_accuracy": mean,
    "full_run_accuracy": float(full_run_accuracy),
    "share": share,
    "min_share": float(min_share),
    "near_plateau": share >= min_share,
  }


def ladder_report(
  result: Mapping, full_run_accuracy: float | None = None, min_share: float = MIN_PLATEAU_SHARE
) -> dict[str, Any]:
  """study.json's "ladders": per label, τ, the ladder table and the label band; and the
  plateau check."""
  labels = {}
  for label in LABELS:
    table, band = ladder_table(result, label), label_band(result, label)
    if table is not None or band is not None:
      labels[label] = {"table": table, "band": band}
  return {"labels": labels, "plateau": plateau(result, full_run_accuracy, min_share)}


def _g(x: float) -> str:
  if x is None or not math.isfinite(x):
    return "∞" if x == math.inf else "n/a"
  return f"{x:.3g}"


def bracket_text(bracket: Sequence[float]) -> str:
  """ "bracketed by (a, b]", or "(a, ∞)" when no rung degraded."""
  a, b = bracket
  return f"bracketed by ({_g(a)}, {_g(b)}" + ("]" if math.isfinite(b) else ")")


def markdown_lines(report: Mapping[str, Any]) -> list[str]:
  """The report's ladder section: the plateau check, then per label the band and the table."""
  lines = ["## Ladders", ""]
  p = report.get("plateau")
  if p:
    lines += [
      f"Reference accuracy {100 * p['reference_accuracy']:.1f} %, "
      f"{100 * p['share']:.1f} % of the full run's {100 * p['full_run_accuracy']:.1f} % "
      f"({'at or above' if p['near_plateau'] else 'below'} the "
      f"{100 * p['min_share']:.0f} % mark).",
      "",
    ]
  for label, block in report["labels"].items():
    band, table = block["band"], block["table"]
    lines.append(f"**{label}**")
    lines.append("")
    if band:
      lines += [
        f"τ = {_g(band['tolerance'])}; {band['within']} of {band['n']} labels "
        f"({_g(100 * band['share'])} %) lie within ±{BAND_SE:g} SE of τ.",
        "",
      ]
    if table:
      lines += [
        "| source | rungs: check KL → mean drop (kept) | knee | 95 % interval | bracket |",
        "|---|---|---|---|---|",
      ]
      for name, s in table["sources"].items():
        rungs = "; ".join(
          f"{_g(r['kl'])} → {_g(r['drop'])} ({'yes' if r['kept'] else 'no'})" for r in s["rungs"]
        )
        flag = "" if s["censored"] == "none" else f" ({s['censored']})"
        lo, hi = s["interval"]
        lines.append(
          f"| {name} | {rungs} | {_g(s['knee'])}{flag} | [{_g(lo)}, {_g(hi)}] | "
          f"{bracket_text(s['bracket'])} |"
        )
      lines.append("")
  return lines
