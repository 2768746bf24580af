"""Draws the docs' pictures from committed data.

    python tools/plot_docs.py            # every picture into docs/images/
    python tools/plot_docs.py quality    # one of them: quality | main_job | async

* `docs/images/quality_vs_mismatch.png`: held-out quality drop against the admission check's
  `mismatch/kl`, one point per run setting of the current study round
  (`docs/study/round9/study.json`), by source and role, with the tolerance τ and the pooled
  budget's limit and interval. The drop is in the round's label: accuracy points, or the rise
  of the held-out KL to the teacher (`label: teacher_kl`, nats/token).
* `docs/images/main_job_scalars.png`: the main job's `mismatch/*` and `rollout/*` scalars
  against the step, from its `metrics.jsonl` (`docs/results/main_job_metrics.jsonl`, a copy of
  `runs/fp8_async/metrics.jsonl`; `--metrics=PATH` reads another run's).
* `docs/images/async_timeline.png`: one step of each row of the time-to-quality benchmark
  (`docs/results/async_vs_sync.json`, the JSON of `python -m opd_jax.bench.async_vs_sync`): the
  serialized pass's sampling, teacher scoring and train step laid out as the loop runs them
  (one after the other in a sync row; the rollout side beside the train side in an async row),
  with the measured loop seconds per step and wait per step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "docs" / "images"
STUDY = REPO / "docs" / "study" / "round9" / "study.json"
MAIN_JOB_METRICS = REPO / "docs" / "results" / "main_job_metrics.jsonl"
ASYNC_BENCH = REPO / "docs" / "results" / "async_vs_sync.json"

MARKERS = {"reference": "o", "calibration": "s", "held_out": "^"}


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 100, "font.size": 9})
  return plt


def read_jsonl(path: Path) -> list[dict]:
  """The JSON lines of a metrics.jsonl, skipping a line cut off by a kill."""
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def plot_quality(study_path: Path, out: Path) -> Path:
  """Quality drop (points) against the check's mismatch/kl for every row of a study."""
  study = json.loads(study_path.read_text())
  rows = [r for r in study["rows"] if r.get("mismatch/kl") is not None]
  if not rows:
    raise ValueError(f"{study_path} has no rows with a mismatch/kl")
  if study.get("label", "accuracy") == "accuracy":  # rounds before 9 have no label: accuracy
    scale, unit, drop = 100, "points", "held-out accuracy drop vs reference (points)"
  else:
    scale, unit = 1, "nats/token"
    drop = "held-out KL to the teacher, rise vs reference (nats/token)"
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  sources = sorted(
    {r["source"].split("+")[0] if r["role"] != "held_out" else "combination" for r in rows}
  )
  colors = dict(zip(sources, plt.cm.tab10.colors, strict=False))
  floor = 1e-7
  for role, marker in MARKERS.items():
    for source in sources:
      pts = [
        r
        for r in rows
        if r["role"] == role
        and (r["source"].split("+")[0] if role != "held_out" else "combination") == source
      ]
      if not pts:
        continue
      ax.scatter(
        [max(r["mismatch/kl"], floor) for r in pts],
        [scale * r["quality_drop"] for r in pts],
        marker=marker,
        color=colors[source],
        label=f"{role.replace('_', '-')}: {source}",
        edgecolors="black" if role == "held_out" else "none",
        linewidths=0.5,
        s=30,
      )
  budget = study["budget"]
  tau = scale * study["tolerance"]
  ax.axhline(tau, color="gray", linestyle="--", linewidth=1)
  ax.text(floor * 1.5, tau * 1.05, f"τ = {tau:.3g} {unit}", color="gray")
  lo, hi = budget["interval"]
  ax.axvspan(lo, hi, color="tab:red", alpha=0.08)
  ax.axvline(budget["max_kl"], color="tab:red", linewidth=1)
  ax.text(
    budget["max_kl"] * 1.1,
    ax.get_ylim()[1] * 0.9,
    f"max_kl {budget['max_kl']:.3g}",
    color="tab:red",
  )
  ax.set_xscale("log")
  ax.set_xlabel("admission check's mismatch/kl (nats/token, log scale)")
  ax.set_ylabel(drop)
  round_name = study_path.parent.name.replace("round", "round ")
  ax.set_title(f"Quality against mismatch: study {round_name} ({study['run_steps']}-step runs)")
  ax.legend(fontsize=7, loc="upper left", ncol=2)
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, metadata={"Software": None})
  plt.close(fig)
  return out


MAIN_JOB_PANELS = (
  ("mismatch/kl", "mismatch/kl_p95", "mismatch/kl (nats/token)"),
  ("mismatch/abs_logp_diff", "mismatch/abs_logp_diff_p95", "abs log-prob diff (nats)"),
  ("rollout/version_lag_mean", "rollout/version_lag_max", "weight-version lag"),
  ("rollout/queue_wait_seconds", "rollout/producer_wait_seconds", "waiting (s)"),
  ("rollout/tokens_per_s", None, "rollout tokens/s"),
  ("quality/student_accuracy", "quality/student_teacher_kl", "held-out accuracy; KL to teacher"),
)


def plot_main_job(metrics_path: Path, out: Path) -> Path:
  """The main job's mismatch and rollout scalars against the step, one panel per pair."""
  rows = read_jsonl(metrics_path)
  if not rows:
    raise ValueError(f"{metrics_path} holds no metrics")
  plt = _pyplot()
  fig, axes = plt.subplots(2, 3, figsize=(11, 5.5))
  for ax, (first, second, title) in zip(axes.flat, MAIN_JOB_PANELS, strict=True):
    drawn = False
    for name in (first, second):
      if name is None:
        continue
      pts = [(r["step"], r[name]) for r in rows if name in r and math.isfinite(r[name])]
      if pts:
        ax.plot(*zip(*pts, strict=True), label=name, marker="." if len(pts) < 20 else None)
        drawn = True
    ax.set_title(title)
    ax.set_xlabel("step")
    if drawn:
      ax.legend(fontsize=7)
  fig.suptitle(f"The main job ({metrics_path.name}): mismatch and rollout scalars")
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, metadata={"Software": None})
  plt.close(fig)
  return out


def plot_async(bench_path: Path, out: Path) -> Path:
  """One step per benchmark row: the serialized split as bars on a time axis, and the run's
  measured seconds per step beside it."""
  bench = json.loads(bench_path.read_text())
  rows = bench["rows"]
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 0.9 * len(rows) + 1.4))
  colours = {"sampling": "tab:blue", "teacher scoring": "tab:orange", "train step": "tab:green"}
  for i, row in enumerate(rows):
    split, y = row["split"], len(rows) - 1 - i
    sample, teacher, train = split["sampling_s"], split["teacher_scoring_s"], split["train_step_s"]
    rollout_side = [("sampling", sample)]
    if split["teacher_on"] == "rollout side":
      rollout_side.append(("teacher scoring", teacher))
    if row["mode"] == "sync":  # sample, then train: one lane
      lanes = [(y, [*rollout_side, ("train step", train)])]
    else:  # the rollout side for the next batch beside the train step
      lanes = [(y + 0.2, rollout_side), (y - 0.2, [("train step", train)])]
    for lane_y, parts in lanes:
      start = 0.0
      for name, seconds in parts:
        ax.barh(lane_y, seconds, left=start, height=0.35, color=colours[name])
        start += seconds
    ax.plot([row["step_s_mean"]] * 2, [y - 0.45, y + 0.45], color="black", lw=2)
    ax.text(
      row["step_s_mean"],
      y + 0.47,
      f" measured {1000 * row['step_s_mean']:.0f} ms/step,"
      f" wait {1000 * row['waiting_s_mean']:.0f} ms",
      fontsize=7,
      va="bottom",
    )
  ax.set_yticks(range(len(rows)), [r["name"] for r in reversed(rows)])
  ax.set_xlabel("seconds in one step")
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
  ax.legend(handles, list(colours), fontsize=7, loc="lower right")
  ax.set_title(
    "One step: the serialized pass's programs (bars) and the run's loop time (black line), "
    f"{bench['seeds']} seeds",
    fontsize=9,
  )
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, metadata={"Software": None})
  plt.close(fig)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("which", nargs="*", default=["quality", "main_job", "async"])
  parser.add_argument("--study", default=str(STUDY), help="a study.json")
  parser.add_argument("--metrics", default=str(MAIN_JOB_METRICS), help="a run's metrics.jsonl")
  parser.add_argument("--bench", default=str(ASYNC_BENCH), help="async_vs_sync's JSON")
  args = parser.parse_args(argv)
  for which in args.which:
    if which == "quality":
      path = plot_quality(Path(args.study), IMAGES / "quality_vs_mismatch.png")
    elif which == "main_job":
      path = plot_main_job(Path(args.metrics), IMAGES / "main_job_scalars.png")
    elif which == "async":
      path = plot_async(Path(args.bench), IMAGES / "async_timeline.png")
    else:
      parser.error(f"unknown picture {which!r}; known: quality, main_job, async")
    print(f"wrote {path.relative_to(REPO)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
