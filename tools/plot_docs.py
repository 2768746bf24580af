"""Draws the docs' pictures from committed data.

    python tools/plot_docs.py            # both pictures into docs/images/
    python tools/plot_docs.py quality    # one of them: quality | main_job

* `docs/images/quality_vs_mismatch.png`: held-out quality drop against the admission check's
  `mismatch/kl`, one point per run setting of the current study round
  (`docs/study/round7/study.json`), by source and role, with the tolerance τ and the pooled
  budget's limit and interval.
* `docs/images/main_job_scalars.png`: the main job's `mismatch/*` and `rollout/*` scalars
  against the step, from its `metrics.jsonl` (`docs/results/main_job_metrics.jsonl`, a copy of
  `runs/fp8_async/metrics.jsonl`; `--metrics=PATH` reads another run's).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "docs" / "images"
STUDY = REPO / "docs" / "study" / "round7" / "study.json"
MAIN_JOB_METRICS = REPO / "docs" / "results" / "main_job_metrics.jsonl"

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
        [100 * r["quality_drop"] for r in pts],
        marker=marker,
        color=colors[source],
        label=f"{role.replace('_', '-')}: {source}",
        edgecolors="black" if role == "held_out" else "none",
        linewidths=0.5,
        s=30,
      )
  budget = study["budget"]
  tau = 100 * study["tolerance"]
  ax.axhline(tau, color="gray", linestyle="--", linewidth=1)
  ax.text(floor * 1.5, tau + 0.5, f"τ = {tau:.1f} points", color="gray")
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
  ax.set_ylabel("held-out accuracy drop vs reference (points)")
  ax.set_title("Quality against mismatch: the current study round (500-step runs)")
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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("which", nargs="*", default=["quality", "main_job"])
  parser.add_argument("--study", default=str(STUDY), help="a study.json")
  parser.add_argument("--metrics", default=str(MAIN_JOB_METRICS), help="a run's metrics.jsonl")
  args = parser.parse_args(argv)
  for which in args.which:
    if which == "quality":
      path = plot_quality(Path(args.study), IMAGES / "quality_vs_mismatch.png")
    elif which == "main_job":
      path = plot_main_job(Path(args.metrics), IMAGES / "main_job_scalars.png")
    else:
      parser.error(f"unknown picture {which!r}; known: quality, main_job")
    print(f"wrote {path.relative_to(REPO)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
