"""The run-length check: how well a study's drops at its run length predict the drops of the
same settings trained to full length. Pure functions of two finished `study.json` results
(`experiments.study`): the short study (the ladders, 600 steps) and the full-length one
(`configs/ladders.py:length`, 1,000 steps); nothing trains.

Pairing. The settings present in both (the same `spec`, the reference left out). Under each
label (`ladders.LABELS`) and in each study, a setting's drop is d = mean(q_ref) − mean(q) over
its runs, each study against its own reference, and τ is that study's own for the label
(`ladders.label_tolerance`).

Over the n paired settings, x_i the short drop and y_i the full-length one:

  Spearman ρ and Pearson r of (x, y) (`stats.spearman`, `stats.pearson`), each with a
    percentile bootstrap interval over settings (n settings resampled with replacement,
    resamples whose correlation is undefined left out);
  slope b = Σ(x − x̄)(y − ȳ) / Σ(x − x̄)² of the least-squares line y ≈ a + b·x (b = 1 and
    a = 0: the short drop is the full-length one), with its bootstrap interval;
  verdict agreement: the share of settings with (x_i > τ_short) = (y_i > τ_full), each length
    judged by its own τ, with its Wilson interval (`stats.wilson`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opd_jax.experiments import ladders, stats
from opd_jax.io import table_cells

NUM_BOOTSTRAP = 2000


def setting_drops(result: Mapping, label: str) -> dict[str, dict[str, Any]] | None:
  """spec → {name, drop, runs} of every non-reference row with runs under `label` (module
  docstring); None when the reference lacks the label."""
  floor = ladders.label_tolerance(result, label)
  if floor is None:
    return None
  out = {}
  for r in result["rows"]:
    q = ladders.label_runs(r, label) if r["role"] != "reference" else None
    if q:
      out[r["spec"]] = {
        "name": r["name"],
        "drop": floor["mean"] - float(np.mean(q)),
        "runs": len(q),
      }
  return out


def slope(x: Sequence[float], y: Sequence[float]) -> float:
  """The least-squares slope b = Σ(x − x̄)(y − ȳ) / Σ(x − x̄)²; nan with fewer than 2 points
  or a constant x."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.size < 2 or np.ptp(x) == 0:
    return math.nan
  dx = x - x.mean()
  return float(np.dot(dx, y - y.mean()) / np.dot(dx, dx))


def bootstrap_interval(
  statistic, x: Sequence[float], y: Sequence[float], num_bootstrap: int, level: float, seed: int
) -> list[float]:
  """The percentile interval of `statistic(x, y)` over pairs resampled with replacement;
  resamples where it is nan are left out; [nan, nan] when all are."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  rng = np.random.default_rng(seed)
  draws = []
  for _ in range(num_bootstrap):
    idx = rng.integers(0, x.size, x.size)
    draws.append(statistic(x[idx], y[idx]))
  draws = np.asarray(draws)
  draws = draws[np.isfinite(draws)]
  if not draws.size:
    return [math.nan, math.nan]
  lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
  return [float(lo), float(hi)]


def agreement(agree: int, n: int, level: float) -> dict[str, Any]:
  """Verdicts agreeing on `agree` of `n` settings: the count, the share and its Wilson interval."""
  return {
    "verdicts_agree": agree,
    "agreement": agree / n,
    "agreement_interval": list(stats.wilson(agree, n, level)),
  }


def label_check(
  short: Mapping, full: Mapping, label: str, num_bootstrap: int, level: float, seed: int
) -> dict[str, Any] | None:
  """The module docstring's numbers under one label; None when either study lacks it or no
  setting is in both."""
  a, b = setting_drops(short, label), setting_drops(full, label)
  if a is None or b is None:
    return None
  specs = [s for s in a if s in b]
  if not specs:
    return None
  x = [a[s]["drop"] for s in specs]
  y = [b[s]["drop"] for s in specs]
  tau_a, tau_b = ladders.label_tolerance(short, label), ladders.label_tolerance(full, label)
  tau_a, tau_b = tau_a["tolerance"], tau_b["tolerance"]
  agree = sum((xi > tau_a) == (yi > tau_b) for xi, yi in zip(x, y, strict=True))
  return {
    "n": len(specs),
    "tolerance_short": tau_a,
    "tolerance_full": tau_b,
    "spearman": stats.spearman(x, y),
    "spearman_interval": bootstrap_interval(stats.spearman, x, y, num_bootstrap, level, seed),
    "pearson": stats.pearson(x, y),
    "pearson_interval": bootstrap_interval(stats.pearson, x, y, num_bootstrap, level, seed),
    "slope": slope(x, y),
    "slope_interval": bootstrap_interval(slope, x, y, num_bootstrap, level, seed),
    **agreement(agree, len(specs), level),
    "settings": [
      {
        "spec": s,
        "name": a[s]["name"],
        "drop_short": a[s]["drop"],
        "drop_full": b[s]["drop"],
        "degraded_short": a[s]["drop"] > tau_a,
        "degraded_full": b[s]["drop"] > tau_b,
      }
      for s in specs
    ],
  }


def length_check(
  short: Mapping,
  full: Mapping,
  num_bootstrap: int = NUM_BOOTSTRAP,
  level: float = stats.LEVEL,
  seed: int = 0,
) -> dict[str, Any]:
  """The run-length check of two studies (module docstring), per label.

  Raises:
    ValueError: no setting is in both studies under any label.
  """
  labels = {}
  for label in ladders.LABELS:
    block = label_check(short, full, label, num_bootstrap, level, seed)
    if block is not None:
      labels[label] = block
  if not labels:
    raise ValueError("the two studies share no setting with runs under any label")
  return {
    "short_steps": short.get("run_steps"),
    "full_steps": full.get("run_steps"),
    "labels": labels,
  }


def fmt(x: float) -> str:
  """x to 3 significant digits; "n/a" for None or a non-finite x."""
  return table_cells.number(x, ".3g", missing="n/a")


def fmt_interval(x: float, interval: Sequence[float]) -> str:
  """ "x [lo, hi]", each by `fmt`."""
  return f"{fmt(x)} [{fmt(interval[0])}, {fmt(interval[1])}]"


def agreement_text(c: Mapping[str, Any]) -> str:
  """ "k/n = p [lo, hi]" of a block's verdict agreement and its interval, in percent."""
  lo, hi = c["agreement_interval"]
  return f"{c['verdicts_agree']}/{c['n']} = {c['agreement']:.0%} [{lo:.0%}, {hi:.0%}]"


def markdown_lines(check: Mapping[str, Any]) -> list[str]:
  """The check as markdown: one summary row per label, then each label's settings."""
  short, full = check["short_steps"], check["full_steps"]
  lines = [
    f"## Run length: {short} against {full} steps",
    "",
    "| label | settings | τ short | τ full | Spearman | Pearson | slope | verdicts agree |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for label, c in check["labels"].items():
    lines.append(
      f"| {label} | {c['n']} | {fmt(c['tolerance_short'])} | {fmt(c['tolerance_full'])} | "
      f"{fmt_interval(c['spearman'], c['spearman_interval'])} | "
      f"{fmt_interval(c['pearson'], c['pearson_interval'])} | "
      f"{fmt_interval(c['slope'], c['slope_interval'])} | {agreement_text(c)} |"
    )
  lines += ["", "Intervals: 95 %, bootstrap over settings (agreement: Wilson).", ""]
  for label, c in check["labels"].items():
    lines += [
      f"**{label}**",
      "",
      f"| setting | drop at {short} | degraded | drop at {full} | degraded |",
      "|---|---|---|---|---|",
      *(
        f"| {s['name']} | {fmt(s['drop_short'])} | {'yes' if s['degraded_short'] else 'no'} | "
        f"{fmt(s['drop_full'])} | {'yes' if s['degraded_full'] else 'no'} |"
        for s in c["settings"]
      ),
      "",
    ]
  return lines
