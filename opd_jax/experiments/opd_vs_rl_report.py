"""OPD against RL: the comparison's report from its finished rows (`write_report`).

Per (setting, method) cell over its seeds (`summarise`): the mean and sd of the accuracy, the
drop against the method's own reference with Welch's interval, the share of its gain kept with
a bootstrap interval (`stats`), greedy and, where the runs evaluated it, at T = 1; grad-norm
spikes; the drops at equal training mismatch
(`matched`); the markdown tables of those and of every run; the JSON with every number; and
the two plots (`plots.opd_vs_rl_mismatch`, `plots.opd_vs_rl_curves`). The runs themselves are
`experiments.opd_vs_rl`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from opd_jax.experiments import plots, stats
from opd_jax.io import json_file
from opd_jax.io.table_cells import MISSING, interval, number

REFERENCE = plots.REFERENCE  # the reference engine's setting name
# The arms (`opd_vs_rl_arms.method_overrides`), in the order the report draws them (a marker
# each).
METHODS = (
  "opd",
  "opd_sampled",
  "opd_sampled_tis",
  "rl",
  "rl_is",
  "grpo",
  "grpo_tis",
  "grpo_mis",
  "grpo_seq_tis",
  "grpo_seq_mis",
)
REPORT_NAME = "opd_vs_rl"  # <workdir>/opd_vs_rl.{md,json,png}


def reference_runs(rows: Sequence[dict]) -> dict[str, list[dict]]:
  """method -> its finished reference runs (one per seed)."""
  by_method: dict[str, list[dict]] = {}
  for r in rows:
    if r["setting"] == REFERENCE:
      by_method.setdefault(r["method"], []).append(r)
  return by_method


def reference_accuracy(rows: Sequence[dict]) -> dict[str, float]:
  """method -> mean accuracy of its finished reference runs (over seeds)."""
  return {
    m: float(np.mean([r["accuracy"] for r in mine])) for m, mine in reference_runs(rows).items()
  }


# The accuracies each cell is summarised in: suffix -> (row key, warm start's row key, name).
ACCURACIES = {
  "": ("accuracy", "accuracy_before", "greedy"),
  "_t1": ("accuracy_t1", "accuracy_t1_before", "T = 1"),
}


def add_drops(rows: Sequence[dict]) -> None:
  """Sets each row's `drop_points` (and `drop_t1_points` at T = 1): its method's reference
  accuracy (the mean over the reference's seeds) minus its accuracy, in points; nan while that
  reference has no finished run or the row has no such accuracy."""
  refs = reference_runs(rows)
  for suffix, (key, _, _) in ACCURACIES.items():
    for r in rows:
      ref = [x.get(key, math.nan) for x in refs.get(r["method"], [])]
      value = r.get(key, math.nan)
      r[f"drop{suffix}_points"] = 100.0 * (float(np.mean(ref)) - value) if ref else math.nan


SPIKE_FACTOR = 3.0  # a logged grad-norm above this times its method's reference median spikes
LEVEL = 0.95  # of every interval in the summary


def spike_count(values: Sequence[float], reference_median: float) -> int:
  """Logged steps whose grad-norm exceeds SPIKE_FACTOR × the method's reference median."""
  if not math.isfinite(reference_median):
    return 0
  return int(np.sum(np.asarray(values, np.float64) > SPIKE_FACTOR * reference_median))


def _accuracy_summary(mine, ref_rows, setting: str, suffix: str) -> dict[str, Any]:
  """`summarise`'s accuracy entries of one cell for one accuracy of ACCURACIES (keys with
  `suffix`); nan where a run lacks that accuracy."""
  key, before, _ = ACCURACIES[suffix]
  q = np.asarray([r.get(key, math.nan) for r in mine], np.float64)
  ref = np.asarray([r.get(key, math.nan) for r in ref_rows], np.float64)
  warm = float(np.mean([r.get(before, math.nan) for r in mine]))
  known = bool(q.size and ref.size and np.all(np.isfinite(q)) and np.all(np.isfinite(ref)))
  lo = hi = math.nan
  kept, kept_ci, fieller = math.nan, (math.nan, math.nan), (math.nan, math.nan)
  gained = known and math.isfinite(warm) and float(ref.mean()) - warm >= stats.MIN_GAIN
  if setting == REFERENCE:
    if gained:
      kept, kept_ci, fieller = 1.0, (1.0, 1.0), (1.0, 1.0)
  elif known:
    lo, hi = stats.welch_interval(ref, q)
    if math.isfinite(warm):
      kept, kept_ci = stats.gain_kept(ref, q, warm)
      if math.isfinite(kept):
        fieller = stats.fieller_share(ref, q, warm)
  return {
    f"accuracy{suffix}": float(q.mean()),
    f"accuracy{suffix}_sd": float(q.std(ddof=1)) if q.size > 1 else math.nan,
    f"warm_start{suffix}": warm,
    f"drop{suffix}_points": 100.0 * (float(ref.mean()) - float(q.mean())) if known else math.nan,
    f"drop{suffix}_ci_points": [100.0 * lo, 100.0 * hi],
    f"gain_kept{suffix}": kept,
    f"gain_kept{suffix}_ci": list(kept_ci),
    f"gain_kept{suffix}_fieller_ci": list(fieller),
  }


def summarise(rows: Sequence[dict]) -> list[dict[str, Any]]:
  """One entry per (setting, method) cell over its seeds, in the rows' order:

      accuracy = mean_s q_s,  accuracy_sd = sample sd of q_s (nan for one seed),
      drop_points = 100·(mean of the method's reference − accuracy), with Welch's interval
        (`stats.welch_interval`, reference seeds against the cell's),
      gain_kept = (accuracy − w) / (reference − w), w the warm start, with its bootstrap
        interval (`stats.gain_kept`, the one the config fixed) and Fieller's interval beside it
        (`stats.fieller_share`, gain_kept_fieller_ci: (−inf, inf) when unbounded); nan, also
        in the reference cell, when the reference gained less than `stats.MIN_GAIN`,
      the same at T = 1 (keys with "_t1": accuracy_t1, drop_t1_points, gain_kept_t1, ...; nan
        where the runs did not evaluate it),
      grad_norm_spikes = logged steps over SPIKE_FACTOR × the method's reference median
        grad-norm (of its finite logged values), summed over seeds, out of
        grad_norm_logged_steps; None while the method's reference has no grad-norm logged,

  and the seed means of the training-time mismatch/kl, the grad-norm and loss statistics.
  """
  cells: dict[tuple[str, str], list[dict]] = {}
  for r in rows:
    cells.setdefault((r["setting"], r["method"]), []).append(r)
  references = reference_runs(rows)
  out = []
  for (setting, method), mine in cells.items():
    ref_rows = references.get(method, [])
    norms = [v for r in ref_rows for v in r.get("grad_norms", []) if math.isfinite(v)]
    median = float(np.median(norms)) if norms else math.nan
    entry = {"setting": setting, "method": method, "seeds": [r.get("seed", 0) for r in mine]}
    for suffix in ACCURACIES:
      entry.update(_accuracy_summary(mine, ref_rows, setting, suffix))
    entry["grad_norm_spikes"] = (  # None: no reference median to count against
      sum(spike_count(r.get("grad_norms", []), median) for r in mine)
      if math.isfinite(median)
      else None
    )
    entry["grad_norm_logged_steps"] = sum(r.get("grad_norm_logged_steps", 0) for r in mine)
    for key in (
      "mismatch_kl_mean",
      "grad_norm_mean",
      "grad_norm_max",
      "loss_mean",
      "loss_max",
      "train_reward_last",
    ):
      entry[key] = float(np.mean([r.get(key, math.nan) for r in mine]))
    entry["mismatch_kl_sd"] = float(np.std([r["mismatch_kl_mean"] for r in mine], ddof=0))
    out.append(entry)
  return out


def has_t1(cells: Sequence[dict]) -> bool:
  """Whether any cell has a T = 1 accuracy (its runs evaluated one)."""
  return any(math.isfinite(c.get("accuracy_t1", math.nan)) for c in cells)


def matched(
  cells: Sequence[dict], family: Sequence[str], kl_values: Sequence[float]
) -> list[dict[str, Any]]:
  """Each method's drop at equal training-time mismatch: for each κ in `kl_values`, the drop
  (points) and the share of gain kept, interpolated linearly in mismatch/kl between the
  method's cells of `family` (setting names; the reference sits at mismatch/kl 0), nan
  where κ lies beyond the method's largest such mismatch (no extrapolation); greedy
  (drop_points, gain_kept) and at T = 1 (drop_t1_points, gain_kept_t1)."""
  out = []
  for method in dict.fromkeys(c["method"] for c in cells):
    mine = [
      c
      for c in cells
      if c["method"] == method and (c["setting"] in family or c["setting"] == REFERENCE)
    ]
    pts = sorted(
      ((0.0 if c["setting"] == REFERENCE else c["mismatch_kl_mean"], c) for c in mine),
      key=lambda p: p[0],
    )
    if len(pts) < 2:
      continue
    x = np.asarray([p for p, _ in pts])
    keys = [f"{k}{suffix}" for suffix in ACCURACIES for k in ("drop", "gain_kept")]
    keys = [k + "_points" if k.startswith("drop") else k for k in keys]
    ys = {key: np.asarray([c.get(key, math.nan) for _, c in pts], np.float64) for key in keys}
    for kappa in kl_values:
      entry = {"method": method, "kl": float(kappa)}
      for key, y in ys.items():
        entry[key] = float(np.interp(kappa, x, y)) if kappa <= x.max() else math.nan
      out.append(entry)
  return out


def matched_table(entries: Sequence[dict], suffix: str = "") -> str:
  """`matched` as a markdown table: one row per method, one column pair per κ; greedy, or
  at T = 1 with `suffix` "_t1"."""
  kls = sorted({e["kl"] for e in entries})
  head = "| method | " + " | ".join(f"drop at KL {k:g} / share kept" for k in kls) + " |\n"
  head += "|---|" + "---:|" * len(kls) + "\n"
  lines = []
  for method in dict.fromkeys(e["method"] for e in entries):
    by_kl = {e["kl"]: e for e in entries if e["method"] == method}
    lines.append(
      f"| {method} | "
      + " | ".join(
        f"{number(by_kl[k].get(f'drop{suffix}_points', math.nan), '+.1f')} / "
        f"{number(by_kl[k].get(f'gain_kept{suffix}', math.nan), '.2f')}"
        if k in by_kl
        else "—"
        for k in kls
      )
      + " |"
    )
  return head + "\n".join(lines) + "\n"


def summary_table(cells: Sequence[dict]) -> str:
  """The per-cell summary over seeds (greedy accuracy) as a markdown table."""
  head = (
    "| setting | method | seeds | accuracy (mean ± sd) | drop vs own ref (pts) [95 %] | "
    "share of gain kept [bootstrap 95 %; Fieller 95 %] | train mismatch/kl | "
    "grad-norm mean / max | spikes | "
    "loss max |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
  )
  lines = [
    f"| {c['setting']} | {c['method']} | {len(c['seeds'])} | {_accuracy_cells(c, '')} | "
    f"{number(c['mismatch_kl_mean'], '.2e')} | "
    f"{number(c['grad_norm_mean'], '.3g')} / {number(c['grad_norm_max'], '.3g')} | "
    f"{MISSING if c.get('grad_norm_spikes') is None else c['grad_norm_spikes']}/"
    f"{c.get('grad_norm_logged_steps', 0)} | "
    f"{number(c.get('loss_max', math.nan), '.3g')} |"
    for c in cells
  ]
  return head + "\n".join(lines) + "\n"


def summary_table_t1(cells: Sequence[dict]) -> str:
  """The per-cell summary over seeds of the T = 1 accuracy as a markdown table."""
  head = (
    "| setting | method | seeds | T = 1 accuracy (mean ± sd) | drop vs own ref (pts) [95 %] | "
    "share of gain kept [bootstrap 95 %; Fieller 95 %] | train mismatch/kl |\n"
    "|---|---|---:|---:|---:|---:|---:|\n"
  )
  lines = [
    f"| {c['setting']} | {c['method']} | {len(c['seeds'])} | {_accuracy_cells(c, '_t1')} | "
    f"{number(c['mismatch_kl_mean'], '.2e')} |"
    for c in cells
  ]
  return head + "\n".join(lines) + "\n"


def _accuracy_cells(c: dict, suffix: str) -> str:
  """ "mean ± sd % | drop [ci] | share [ci]" of one accuracy of a cell."""
  return (
    f"{number(100 * c.get(f'accuracy{suffix}', math.nan), '.1f')} ± "
    f"{number(100 * c.get(f'accuracy{suffix}_sd', math.nan), '.1f')} % | "
    f"{number(c.get(f'drop{suffix}_points', math.nan), '+.1f')} "
    f"{interval(c.get(f'drop{suffix}_ci_points'), '.1f')} | "
    f"{number(c.get(f'gain_kept{suffix}', math.nan), '.2f')} "
    f"{interval(c.get(f'gain_kept{suffix}_ci'), '.2f')}"
    f"{_fieller_cell(c.get(f'gain_kept{suffix}_fieller_ci'))}"
  )


def _fieller_cell(ci) -> str:
  """ "; [lo, hi]" or "; unbounded" for a share's Fieller interval, "" when it has none."""
  if ci and all(math.isinf(x) for x in ci):
    return "; unbounded"
  bounds = interval(ci, ".2f")
  return f"; {bounds}" if bounds else ""


def _percent(x: float) -> str:
  """A share as "61.3 %", "—" when unknown."""
  return MISSING if x is None or math.isnan(x) else f"{100 * x:.1f} %"


def markdown_table(rows: Sequence[dict]) -> str:
  """The comparison as a markdown table, one line per (setting, method)."""
  head = (
    "| setting | method | seed | accuracy | drop vs own ref (pts) | train mismatch/kl | "
    "grad-norm mean | grad-norm max | grad-norm std | last reward | T = 1 accuracy |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
  )
  lines = [
    f"| {r['setting']} | {r['method']} | {r.get('seed', 0)} | "
    f"{number(100 * r['accuracy'], '.1f')} % | "
    f"{number(r['drop_points'], '+.1f')} | {number(r['mismatch_kl_mean'], '.2e')} | "
    f"{number(r['grad_norm_mean'], '.3g')} | {number(r['grad_norm_max'], '.3g')} | "
    f"{number(r['grad_norm_std'], '.3g')} | {number(r['train_reward_last'], '.3f')} | "
    f"{_percent(r.get('accuracy_t1', math.nan))} |"
    for r in rows
  ]
  return head + "\n".join(lines) + "\n"


def write_report(rows: list[dict], workdir: str, meta: dict, log=print) -> dict:
  """Writes <workdir>/opd_vs_rl.{md,json,png} from the finished rows; returns the JSON dict."""
  add_drops(rows)
  table = markdown_table(rows)
  cells = summarise(rows)
  text = f"# OPD vs RL under rollout mismatch\n\n{meta.get('summary', '')}\n\n"
  t1 = has_t1(cells)
  if any(len(c["seeds"]) > 1 for c in cells):
    text += f"## Over seeds\n\n{summary_table(cells)}\n"
    if t1:
      text += f"## Over seeds, T = 1\n\n{summary_table_t1(cells)}\n"
  at_equal_kl = matched(cells, meta.get("matched_settings", ()), meta.get("matched_kl", ()))
  if at_equal_kl:
    text += (
      "## At equal training mismatch\n\nDrop (points) and share of gain kept, interpolated "
      f"in mismatch/kl over {', '.join(meta['matched_settings'])} and the reference (an arm "
      "trained on some of them only, over those it has)"
      + (", greedy, then at T = 1" if t1 else "")
      + ".\n\n"
      + ("Greedy:\n\n" if t1 else "")
      + f"{matched_table(at_equal_kl)}\n"
      + (f"T = 1:\n\n{matched_table(at_equal_kl, '_t1')}\n" if t1 else "")
    )
  if text.count("\n## "):
    text += "## Every run\n\n"
  base = os.path.join(workdir, REPORT_NAME)
  with open(base + ".md", "w", encoding="utf-8") as f:
    f.write(text + table)
  report = dict(meta, rows=rows, cells=cells, matched=at_equal_kl, table_markdown=table)
  json_file.write_json(base + ".json", report)
  if not plots.opd_vs_rl_mismatch(cells, base + ".png", METHODS, meta.get("matched_settings", ())):
    log("matplotlib is not installed: no PNG written")
  plots.opd_vs_rl_curves(rows, base + "_curves.png", METHODS)
  return report
