"""The experiments' PNG plots, each from the dict its report module writes.

The study (`study_plots`, from the `study.json` dict):
- `quality_vs_mismatch.png`: quality drop d against the check's mismatch/kl (log axis), one
  marker per source, calibration filled and held-out hollow; the isotonic fit, the budget
  max_kl with its bootstrap interval, each source's own crossing of τ (dotted, in the source's
  colour) and the tolerance τ;
- `training_curves.png`: held-out accuracy against step for the reference seeds and the
  worst run of each source;
- `check_vs_training.png`: the check's mismatch/kl against each run's training-time mean;
- the sensitivity bar chart is written by the scan itself (`sensitivity.png`).

The admission check (`kl_by_position`, from its rows): the KL by token position per candidate
(`python -m opd_jax.admit --plot=PATH`).

OPD against RL (`opd_vs_rl_mismatch`, `opd_vs_rl_curves`, from its rows and cells):
`opd_vs_rl.png` and `opd_vs_rl_curves.png`.

A sweep (`sweep_curves`, from its run rows): `sweep_curves.png`. matplotlib is imported only
when a plot is drawn.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

KL_FLOOR = 1e-8  # exact engines read ~1e-9 (f32 rounding); drawn at this floor on log axes
F32_ROUNDING_KL = 1e-7  # opd_vs_rl's mismatch/kl below this is f32 rounding: drawn at 0
REFERENCE = "reference"  # the reference engine's setting in opd_vs_rl's rows
MARKERS = "osD^v<>pXhP"


def _plt():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def _x(kl: float) -> float:
  return max(kl, KL_FLOOR)


def study_quality(result: dict, path: str) -> str:
  """Quality drop against the check's mismatch/kl with the fit and the budget. A held-out
  setting is drawn at the drop it was judged by (`label_drop`: the mean of its runs when it was
  borderline)."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(7.5, 4.6))
  sources = sorted({r["source"] for r in result["rows"]})
  for i, source in enumerate(sources):
    for role, fill in (("reference", True), ("calibration", True), ("held_out", False)):
      rs = [r for r in result["rows"] if r["source"] == source and r["role"] == role]
      if not rs:
        continue
      ax.scatter(
        [_x(r["mismatch/kl"]) for r in rs],
        [100 * r.get("label_drop", r["quality_drop"]) for r in rs],
        marker=MARKERS[i % len(MARKERS)],
        facecolors=f"C{i}" if fill else "none",
        edgecolors=f"C{i}",
        label=f"{source}{' (held out)' if not fill else ''}",
        s=36,
      )
  b = result["budget"]
  ax.plot(
    [_x(x) for x in b["curve_kl"]],
    [100 * d for d in b["curve_drop"]],
    "k-",
    lw=1,
    label="isotonic fit",
  )
  for i, source in enumerate(sources):
    own = b.get("sources", {}).get(source)
    if own and own["censored"] == "none":
      ax.axvline(_x(own["max_kl"]), color=f"C{i}", ls=":", lw=1.2, label=f"{source} limit")
  ax.axhline(100 * result["tolerance"], color="gray", ls=":", lw=1, label="tolerance τ")
  if b["max_kl"] > 0:
    ax.axvline(_x(b["max_kl"]), color="r", ls="--", lw=1, label=f"budget {b['max_kl']:.3g}")
  low, high = b["interval"]
  if high > 0:
    ax.axvspan(_x(low), _x(high), color="r", alpha=0.1, label="95% interval")
  ax.set_xscale("log")
  ax.set_xlabel("mismatch/kl measured by the admission check (nats/token)")
  ax.set_ylabel(
    "quality drop (KL to the teacher, nats/token × 100)"
    if result.get("label") == "teacher_kl"
    else "quality drop (accuracy points)"
  )
  ax.set_title(f"OPD quality against mismatch ({result['run_steps']} steps per run)", fontsize=10)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _worst_per_source(rows: list[dict]) -> list[dict]:
  worst: dict[str, dict] = {}
  for r in rows:
    if r["role"] == "reference":
      continue
    if r["source"] not in worst or r["quality_drop"] > worst[r["source"]]["quality_drop"]:
      worst[r["source"]] = r
  return list(worst.values())


def study_curves(result: dict, path: str) -> str:
  """Held-out accuracy against step: the reference seeds and each source's worst run."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(7, 4.2))
  shown = [r for r in result["rows"] if r["role"] == "reference"] + _worst_per_source(
    result["rows"]
  )
  for r in shown:
    curve = result["curves"].get(r["name"], [])
    if curve:
      ref = r["role"] == "reference"
      ax.plot(
        [c[0] for c in curve],
        [100 * c[1] for c in curve],
        color="k" if ref else None,
        alpha=0.5 if ref else 1.0,
        lw=1,
        marker=".",
        label=r["name"],
      )
  ax.axhline(100 * result["teacher_accuracy"], color="gray", ls=":", lw=1, label="teacher")
  ax.set_xlabel("OPD step")
  ax.set_ylabel("held-out accuracy (%)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def study_agreement(result: dict, path: str) -> str:
  """The check's mismatch/kl against the run's training-time mean, log-log, with y = x."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(5, 4.4))
  rs = [r for r in result["rows"] if r["role"] != "reference" and "train/mismatch/kl_mean" in r]
  for i, source in enumerate(sorted({r["source"] for r in rs})):
    pts = [r for r in rs if r["source"] == source]
    ax.scatter(
      [_x(r["mismatch/kl"]) for r in pts],
      [_x(r["train/mismatch/kl_mean"]) for r in pts],
      marker=MARKERS[i % len(MARKERS)],
      label=source,
      s=30,
    )
  if rs:
    values = [_x(r["mismatch/kl"]) for r in rs] + [_x(r["train/mismatch/kl_mean"]) for r in rs]
    lo, hi = min(values), max(values)
    ax.plot([lo, hi], [lo, hi], "k:", lw=1, label="y = x")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("admission check, before training")
  ax.set_ylabel("training-time mean")
  ax.set_title("mismatch/kl (nats/token)", fontsize=10)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def study_plots(result: dict, workdir: str) -> list[str]:
  """Writes every plot into `workdir`; returns their paths (empty without matplotlib)."""
  try:
    _plt()
  except ImportError:
    return []
  paths = [
    study_quality(result, os.path.join(workdir, "quality_vs_mismatch.png")),
    study_curves(result, os.path.join(workdir, "training_curves.png")),
    study_agreement(result, os.path.join(workdir, "check_vs_training.png")),
  ]
  sens = result.get("sensitivity") or {}
  if sens.get("png"):
    paths.append(sens["png"])
  return paths


def opd_vs_rl_mismatch(
  cells: Sequence[dict], path: str, methods: Sequence[str], ladder: Sequence[str] = ()
) -> bool:
  """Final accuracy and drop against training-time mismatch/kl, one series per method of
  `methods` (each its marker, by its place there).

  With `ladder` (setting names, e.g. a noise ladder) each method's line joins its reference
  and ladder cells, and every other setting is a hollow marker labelled with its name, so
  that no line crosses from one source to another; without it the line joins all cells in
  order of mismatch. The x axis is symlog so the reference sits at the left edge: a
  mismatch/kl below `F32_ROUNDING_KL` (an engine identical to the trainer reads ±1e-9) is
  drawn at 0. `cells` are `opd_vs_rl_report.summarise`'s (setting, method) means over seeds,
  drawn ± their sd. Returns False, writing nothing, when matplotlib is not installed.
  """
  try:
    plt = _plt()
  except ImportError:
    return False

  def kl(r):
    return r["mismatch_kl_mean"] if r["mismatch_kl_mean"] > F32_ROUNDING_KL else 0.0

  def on_line(r):
    return not ladder or r["setting"] == REFERENCE or r["setting"] in ladder

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
  positive = [kl(r) for r in cells if kl(r) > 0]
  linthresh = min(positive) / 2 if positive else 1e-4
  labelled: set[str] = set()
  for method, marker in zip(methods, "osDv^<>ph*", strict=True):
    mine = sorted((r for r in cells if r["method"] == method), key=kl)
    if not mine:
      continue
    for ax, key, scale in ((axes[0], "accuracy", 100.0), (axes[1], "drop_points", 1.0)):
      line = [r for r in mine if on_line(r)]
      sd = [0.0 if math.isnan(r["accuracy_sd"]) else 100 * r["accuracy_sd"] for r in line]
      drawn = ax.errorbar(
        [kl(r) for r in line],
        [scale * r[key] for r in line],
        yerr=sd,
        marker=marker,
        capsize=3,
        label=method,
      )
      for r in mine:
        if not on_line(r):
          ax.errorbar(
            kl(r),
            scale * r[key],
            yerr=0.0 if math.isnan(r["accuracy_sd"]) else 100 * r["accuracy_sd"],
            marker=marker,
            mfc="none",
            capsize=3,
            color=drawn.lines[0].get_color(),
          )
          if ax is axes[0] and r["setting"] not in labelled:
            labelled.add(r["setting"])  # each hollow setting named once, at its first arm
            ax.annotate(r["setting"], (kl(r), scale * r[key]), fontsize=6)
  for ax, ylabel in zip(
    axes, ("final held-out accuracy (%)", "drop vs own reference (points)"), strict=True
  ):
    ax.set_xscale("symlog", linthresh=linthresh)
    ax.set_xlabel("training-time mean mismatch/kl (nats/token)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  title = "OPD vs RL under rollout mismatch"
  if ladder:
    title += f": lines join the reference and {', '.join(ladder)}; hollow markers are the rest"
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def opd_vs_rl_curves(rows: Sequence[dict], path: str, methods: Sequence[str]) -> bool:
  """Held-out accuracy against training step at the reference engine, one line per method of
  `methods`
  (the mean over its seeds, the band ± one sd), the warm start dashed: the learning curves
  the comparison's drops are taken against. Returns False, writing nothing, without
  matplotlib or without a reference run that logged a curve."""
  curves: dict[str, list] = {}
  for r in rows:
    if r["setting"] == REFERENCE and r.get("curve"):
      curves.setdefault(r["method"], []).append(r)
  if not curves:
    return False
  try:
    plt = _plt()
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for method in [m for m in methods if m in curves]:
    mine = curves[method]
    steps = sorted({int(p[0]) for r in mine for p in r["curve"]})
    acc = np.asarray(
      [[dict((int(p[0]), p[1]) for p in r["curve"]).get(t, math.nan) for t in steps] for r in mine]
    )
    mean, sd = 100 * np.nanmean(acc, 0), 100 * np.nanstd(acc, 0)
    wall = np.mean([r["wall_seconds"] for r in mine])
    ax.plot(steps, mean, marker="o", label=f"{method} ({len(mine)} seeds, {wall:.0f} s/run)")
    ax.fill_between(steps, mean - sd, mean + sd, alpha=0.2)
  warm = 100 * float(np.mean([r["accuracy_before"] for rs in curves.values() for r in rs]))
  ax.axhline(warm, ls="--", c="gray", label=f"warm start {warm:.1f} %")
  ax.set_xlabel("training step")
  ax.set_ylabel("held-out greedy accuracy (%)")
  ax.set_title("Learning curves at the reference engine")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def _save(fig, path: str) -> str:
  """Writes `fig` to `path` (its directory made) at the plots' resolution and closes it."""
  plt = _plt()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def kl_by_position(rows: Sequence[dict], path: str) -> str:
  """The admission check's KL by token position, one line per candidate row that carries
  `kl_by_position` (each bucket drawn at its middle position, log y axis, empty buckets and
  values under `KL_FLOOR` at the floor), with each candidate's threshold κ dashed and its first
  crossing in the legend.

  Raises:
    ValueError: no row carries `kl_by_position`.
  """
  drawn = [r for r in rows if r.get("kl_by_position")]
  if not drawn:
    raise ValueError("no candidate row carries kl_by_position: nothing to plot")
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  thresholds = set()
  for i, row in enumerate(drawn):
    pos = row["kl_by_position"]
    mid = [(a + z) / 2 for a, z in zip(pos["first"], pos["last"], strict=True)]
    kl = [np.nan if x is None else _x(x) for x in pos["kl"]]
    cross = row.get("first_cross") or {}
    first = cross.get("pos_mean")
    label = row.get("candidate", f"row {i}")
    if cross:
      thresholds.add(cross["kl"])
      label += f" (cross {cross['crossed']}/{cross['completions']}" + (
        f", first at {first:.1f})" if first is not None else ")"
      )
    ax.plot(mid, kl, marker=MARKERS[i % len(MARKERS)], ms=4, lw=1.2, label=label)
  for kappa in sorted(thresholds):
    ax.axhline(kappa, color="k", ls="--", lw=0.8)
  ax.set_yscale("log")
  ax.set_xlabel("completion position (bucket middle)")
  ax.set_ylabel("mean KL(π_b ‖ π_θ) (nats/token)")
  ax.set_title("mismatch by token position (dashed: crossing threshold)", fontsize=10)
  ax.legend(fontsize=7)
  return _save(fig, path)


def sweep_curves(rows: Sequence[dict], arms: Sequence[str], path: str) -> bool:
  """A sweep's learning curves (`experiments.sweep`): greedy and T = 1 held-out accuracy
  against training step (left two panels) and the T = 1 accuracy against training wall
  seconds (right), one line per arm (the mean over its seeds at each evaluation step).
  Returns False, writing nothing, without matplotlib or without a curve."""
  by_arm: dict[str, list] = {}
  for r in rows:
    if r.get("curve"):
      by_arm.setdefault(r["arm"], []).append(r["curve"])
  if not by_arm:
    return False
  try:
    plt = _plt()
  except ImportError:
    return False
  fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
  for arm in [a for a in arms if a in by_arm]:
    steps = sorted({int(p[0]) for c in by_arm[arm] for p in c})
    table = np.asarray(
      [
        [dict((int(p[0]), p[1:]) for p in c).get(t, [math.nan] * 3) for t in steps]
        for c in by_arm[arm]
      ],
      np.float64,
    )  # [seeds, steps, (wall, greedy, t1)]
    mean = np.nanmean(table, 0)
    label = f"{arm} ({table.shape[0]} seed{'s' if table.shape[0] > 1 else ''})"
    axes[0].plot(steps, 100 * mean[:, 1], marker="o", label=label)
    axes[1].plot(steps, 100 * mean[:, 2], marker="o", label=label)
    axes[2].plot(mean[:, 0], 100 * mean[:, 2], marker="o", label=label)
  for ax, title, xlabel in zip(
    axes,
    ("greedy", "T = 1", "T = 1 against wall time"),
    ("training step", "training step", "training wall seconds"),
    strict=True,
  ):
    ax.set_title(f"held-out accuracy, {title}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=6)
  _save(fig, path)
  return True
