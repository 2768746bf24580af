"""Model dependence: the same dose ladders run on two student–teacher pairs, read side by side.
Pure functions of two finished `study.json` results (`experiments.study`), pair A and pair B
(`configs/ladders.py` and `configs/ladders.py:deep`); nothing trains.

Pairing. The settings in both studies (the same `spec`, the reference left out). For a
setting and a pair, under each label (`ladders.LABELS`): the check's reading x = mismatch/kl
at that pair's probe, and the drop d = mean(q_ref) − mean(q) over its runs against that pair's
own reference, with Welch's 95 % interval over the two sets of runs (`stats.welch_interval`).
Each pair judges its own labels with its own τ (`ladders.label_tolerance`), so a drop is also
given as d/τ, the share of that pair's tolerance it uses, which puts the two pairs' quality
costs on one scale.

Over the n paired settings:

  the check's reading: Spearman ρ of (x_A, x_B), and the ratio x_B / x_A summarised by its
    geometric mean exp(mean(log x_B − log x_A)) (settings with a non-positive reading on either
    pair left out), each with a percentile bootstrap interval over settings;
  the quality cost: Spearman ρ of (d_A/τ_A, d_B/τ_B) with its bootstrap interval, and the share
    of settings whose verdicts agree, (d_A > τ_A) = (d_B > τ_B), with its Wilson interval;
  per source, both pairs' knees with their intervals and brackets (`ladders.ladder_table`).

"The budget depends on the model" is then a statement about these numbers: a ratio of
readings whose interval excludes 1 says the same recipe perturbs the two students by different
amounts; verdicts that disagree outside both pairs' noise say the same recipe costs one pair
quality and not the other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opd_jax.experiments import ladders, run_length, stats
from opd_jax.mismatch import budget

NUM_BOOTSTRAP = 2000


def _settings(result: Mapping, label: str) -> dict[str, dict[str, Any]] | None:
  """spec → {name, drop, runs, source, kl, interval} of every non-reference row with runs
  under `label` (`run_length.setting_drops`, with the check's reading and Welch's interval of
  the drop); None when the reference lacks the label."""
  out = run_length.setting_drops(result, label)
  if out is None:
    return None
  rows = {r["spec"]: r for r in result["rows"] if r["role"] != "reference"}
  q_ref = ladders.reference_runs(result, label)
  for spec, setting in out.items():
    row = rows[spec]
    setting["source"] = row["source"]
    setting["kl"] = float(row[budget.KL_KEY])
    setting["interval"] = list(stats.welch_interval(q_ref, ladders.label_runs(row, label)))
  return out


def log_ratio_mean(x: Sequence[float], y: Sequence[float]) -> float:
  """exp(mean(log y − log x)) over the pairs where both are positive; nan when none is."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  ok = (x > 0) & (y > 0)
  if not ok.any():
    return math.nan
  return float(np.exp(np.mean(np.log(y[ok]) - np.log(x[ok]))))


def label_comparison(
  a: Mapping, b: Mapping, label: str, num_bootstrap: int, level: float, seed: int
) -> dict[str, Any] | None:
  """The module docstring's numbers under one label; None when either study lacks the label
  or no setting is in both."""
  sa, sb = _settings(a, label), _settings(b, label)
  if sa is None or sb is None:
    return None
  specs = [s for s in sa if s in sb]
  if not specs:
    return None
  tau_a = ladders.label_tolerance(a, label)["tolerance"]
  tau_b = ladders.label_tolerance(b, label)["tolerance"]
  kl_a, kl_b = [sa[s]["kl"] for s in specs], [sb[s]["kl"] for s in specs]
  rel_a = [sa[s]["drop"] / tau_a for s in specs]
  rel_b = [sb[s]["drop"] / tau_b for s in specs]
  agree = sum((x > 1.0) == (y > 1.0) for x, y in zip(rel_a, rel_b, strict=True))

  def interval(statistic, x, y):
    return run_length.bootstrap_interval(statistic, x, y, num_bootstrap, level, seed)

  rows = []
  for s, ra, rb in zip(specs, rel_a, rel_b, strict=True):
    rows.append(
      {
        "spec": s,
        "name": sa[s]["name"],
        "source": sa[s]["source"],
        "kl_a": sa[s]["kl"],
        "kl_b": sb[s]["kl"],
        "kl_ratio": sb[s]["kl"] / sa[s]["kl"] if sa[s]["kl"] > 0 else math.nan,
        "drop_a": sa[s]["drop"],
        "drop_a_interval": sa[s]["interval"],
        "drop_b": sb[s]["drop"],
        "drop_b_interval": sb[s]["interval"],
        "drop_over_tau_a": ra,
        "drop_over_tau_b": rb,
        "degraded_a": ra > 1.0,
        "degraded_b": rb > 1.0,
        "runs_a": sa[s]["runs"],
        "runs_b": sb[s]["runs"],
      }
    )
  return {
    "n": len(specs),
    "tolerance_a": tau_a,
    "tolerance_b": tau_b,
    "kl_spearman": stats.spearman(kl_a, kl_b),
    "kl_spearman_interval": interval(stats.spearman, kl_a, kl_b),
    "kl_ratio_geomean": log_ratio_mean(kl_a, kl_b),
    "kl_ratio_geomean_interval": interval(log_ratio_mean, kl_a, kl_b),
    "drop_spearman": stats.spearman(rel_a, rel_b),
    "drop_spearman_interval": interval(stats.spearman, rel_a, rel_b),
    "degraded_a": sum(r["degraded_a"] for r in rows),
    "degraded_b": sum(r["degraded_b"] for r in rows),
    **run_length.agreement(agree, len(specs), level),
    "settings": rows,
  }


def _knees(result: Mapping, label: str) -> dict[str, dict]:
  table = ladders.ladder_table(result, label)
  if table is None:
    return {}
  return {
    name: {k: s[k] for k in ("knee", "censored", "interval", "bracket")}
    for name, s in table["sources"].items()
  }


def compare(
  a: Mapping,
  b: Mapping,
  names: Sequence[str] = ("A", "B"),
  num_bootstrap: int = NUM_BOOTSTRAP,
  level: float = stats.LEVEL,
  seed: int = 0,
) -> dict[str, Any]:
  """Two pairs' ladders side by side (module docstring), per label.

  Raises:
    ValueError: two names not given, or no setting in both studies under any label.
  """
  if len(names) != 2:
    raise ValueError(f"give two pair names, not {list(names)}")
  labels = {}
  for label in ladders.LABELS:
    block = label_comparison(a, b, label, num_bootstrap, level, seed)
    if block is not None:
      ka, kb = _knees(a, label), _knees(b, label)
      block["knees"] = {
        source: {"a": ka.get(source), "b": kb.get(source)} for source in sorted({*ka, *kb})
      }
      labels[label] = block
  if not labels:
    raise ValueError("the two studies share no setting with runs under any label")
  return {"names": list(names), "labels": labels}


_g, _with = run_length.fmt, run_length.fmt_interval


def _knee_text(k: Mapping | None) -> str:
  if k is None:
    return "n/a"
  flag = "" if k["censored"] == "none" else f" ({k['censored']})"
  return f"{_g(k['knee'])}{flag} [{_g(k['interval'][0])}, {_g(k['interval'][1])}]"


def markdown_lines(comparison: Mapping[str, Any]) -> list[str]:
  """The comparison as markdown: one summary row per label, then per label the settings and
  the knees."""
  na, nb = comparison["names"]
  lines = [
    f"## Model dependence: {na} against {nb}",
    "",
    f"| label | settings | τ {na} | τ {nb} | check KL: Spearman | check KL: {nb}/{na} "
    f"(geometric mean) | drop/τ: Spearman | degraded {na} | degraded {nb} | verdicts agree |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for label, c in comparison["labels"].items():
    lines.append(
      f"| {label} | {c['n']} | {_g(c['tolerance_a'])} | {_g(c['tolerance_b'])} | "
      f"{_with(c['kl_spearman'], c['kl_spearman_interval'])} | "
      f"{_with(c['kl_ratio_geomean'], c['kl_ratio_geomean_interval'])} | "
      f"{_with(c['drop_spearman'], c['drop_spearman_interval'])} | {c['degraded_a']} | "
      f"{c['degraded_b']} | {run_length.agreement_text(c)} |"
    )
  lines += [
    "",
    "Intervals: 95 %, bootstrap over settings (agreement: Wilson; a drop: Welch over runs).",
    "",
  ]
  for label, c in comparison["labels"].items():
    lines += [
      f"**{label}**",
      "",
      f"| setting | check KL {na} | check KL {nb} | {nb}/{na} | drop {na} | drop/τ | "
      f"drop {nb} | drop/τ |",
      "|---|---|---|---|---|---|---|---|",
      *(
        f"| {s['name']} | {_g(s['kl_a'])} | {_g(s['kl_b'])} | {_g(s['kl_ratio'])} | "
        f"{_with(s['drop_a'], s['drop_a_interval'])} | {_g(s['drop_over_tau_a'])} | "
        f"{_with(s['drop_b'], s['drop_b_interval'])} | {_g(s['drop_over_tau_b'])} |"
        for s in c["settings"]
      ),
      "",
      f"| source | knee {na} [95 %] | knee {nb} [95 %] |",
      "|---|---|---|",
      *(
        f"| {source} | {_knee_text(k['a'])} | {_knee_text(k['b'])} |"
        for source, k in c["knees"].items()
      ),
      "",
    ]
  return lines
