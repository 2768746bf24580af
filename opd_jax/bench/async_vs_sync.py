"""Time to quality: async and FP8 rollouts against the synchronous reference.

Command (CPU; about 12 minutes with a cached teacher, plus 5 to bootstrap one):

    python -m opd_jax.bench.async_vs_sync            # readable table
    python -m opd_jax.bench.async_vs_sync --json     # {"target": ..., "rows": [...]} only

Four runs of `configs/bf16_sync.py` on the embedded task, each a separate process
(so no run inherits another's compiled programs), with the same seeds, the same
warm-started student and one cached teacher:

    sync_bf16    rollout.mode=sync,  weights=trainer, kv_cache=auto   (the reference)
    async_bf16   rollout.mode=async, max_lag=1, score_teacher, weights=trainer, kv_cache=auto
    sync_fp8     rollout.mode=sync,  fp8 weights + fp8 KV (the fp8_async.py recipe)
    async_fp8    configs/fp8_async.py's rollout settings

The async runs also move the teacher's forward pass to the producer
(`rollout.score_teacher`, as verl's and slime's rollout side scores the teacher): on
this task sampling alone is about a sixth of a synchronous step, so overlapping it
could save at most that; sync runs keep the teacher in the train step (moving it
changes nothing there, the work stays sequential).

"bf16" names the study's reference: the engine runs at the trainer's own precision
(f32 on a CPU, bf16 with `--dtype=bfloat16` on an accelerator).

Target. The quality level is `--target` × the teacher's held-out accuracy (default
0.9, the bar `configs/fp8_async.py` is held to): the first evaluation at or above it
is the time to target. The reference must reach it, else the benchmark says so.
Evaluations run every `--eval-every` steps, so steps and seconds to target are
resolved to that many steps.

Time. `wall_s_to_target` is `perf/train_wall_seconds` at that evaluation: seconds since
the OPD loop started, minus the time spent evaluating and checkpointing, so every
run pays the same for those. The train step's compilation is included in every run.
In async runs the producer keeps sampling (at most `max_lag` batches ahead) while the
trainer evaluates, which hides up to one batch of sampling per evaluation; with
evaluations every 50 steps that is under 2% of the loop.

FP8 on a CPU is emulated (XLA converts e4m3 to f32 for the matmuls), so the FP8 rows
measure the mismatch's effect on learning, not an FP8 speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from opd_jax.io import metrics_writer

RUNS = {
  "sync_bf16": {"rollout.mode": "sync"},
  "async_bf16": {"rollout.mode": "async", "rollout.max_lag": 1, "rollout.score_teacher": True},
  "sync_fp8": {
    "rollout.mode": "sync",
    "rollout.weights": "fp8",
    "rollout.bf16_layers": "(0,)",
    "rollout.kv_cache": "fp8",
    "rollout.kv_granularity": "tensor",
  },
  "async_fp8": None,  # configs/fp8_async.py as it stands
}


def _command(name: str, overrides: dict | None, workdir: str, args) -> list[str]:
  config = "fp8_async.py" if overrides is None else "bf16_sync.py"
  cmd = [sys.executable, "-m", "opd_jax.main", f"--config={config}", f"--workdir={workdir}"]
  for key, value in (overrides or {}).items():
    cmd.append(f"--config.{key}={value}")
  cmd += [
    f"--config.teacher.cache_dir={args.teacher_cache}",
    f"--config.train.steps={args.steps}",
    f"--config.train.eval_every={args.eval_every}",
    f"--config.train.checkpoint_every={args.steps}",
    f"--config.student.dtype={args.dtype}",
    f"--config.teacher.dtype={args.dtype}",
  ]
  return cmd


def _row(name: str, workdir: str, target_fraction: float) -> dict:
  rows = metrics_writer.read_jsonl(workdir)
  evals = sorted(s for s, r in rows.items() if "quality/student_accuracy" in r)
  teacher = rows[evals[0]]["quality/teacher_accuracy"]
  target = target_fraction * teacher
  reached = [s for s in evals if s > 0 and rows[s]["quality/student_accuracy"] >= target]
  last = evals[-1]
  lag_rows = [r for r in rows.values() if "rollout/version_lag_mean" in r]
  first = reached[0] if reached else None
  mode = "async" if any("rollout/publish_seconds" in r for r in lag_rows) else "sync"
  return {
    "name": name,
    "mode": mode,
    "weights": "fp8" if "fp8" in name else "trainer",
    "kv_cache": "fp8/tensor" if "fp8" in name else "auto",
    "target_accuracy": round(target, 4),
    "wall_s_to_target": None if first is None else round(rows[first]["perf/train_wall_seconds"], 1),
    "steps_to_target": first,
    "final_quality": rows[last]["quality/student_accuracy"],
    "final_kl": rows[last]["quality/student_teacher_kl"],
    "teacher_accuracy": teacher,
    "train_wall_s": round(rows[last]["perf/train_wall_seconds"], 1),
    "mean_lag": round(sum(r["rollout/version_lag_mean"] for r in lag_rows) / len(lag_rows), 3),
    "dropped": int(max((r.get("rollout/dropped", 0) for r in lag_rows), default=0)),
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m opd_jax.bench.async_vs_sync")
  parser.add_argument("--json", action="store_true", help="print only the JSON result")
  parser.add_argument("--steps", type=int, default=1000, help="OPD steps per run")
  parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
  parser.add_argument("--target", type=float, default=0.9, help="target, x teacher accuracy")
  parser.add_argument("--runs", default=",".join(RUNS), help=f"subset of {', '.join(RUNS)}")
  parser.add_argument("--dtype", default="float32", help="trainer dtype: float32 | bfloat16")
  parser.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
  parser.add_argument("--teacher-cache", default="", help="teacher cache (default: workdir's)")
  args = parser.parse_args(argv)
  names = [n for n in args.runs.split(",") if n]
  unknown = sorted(set(names) - set(RUNS))
  if unknown:
    raise SystemExit(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
  if "sync_bf16" not in names:
    raise SystemExit("the reference run sync_bf16 is needed for the speed-ups")
  if not 0 < args.target <= 1:
    raise SystemExit(f"--target must be in (0, 1], got {args.target}")
  log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
  root = args.workdir or tempfile.mkdtemp(prefix="opd_async_vs_sync_")
  args.teacher_cache = args.teacher_cache or os.path.join(root, "teacher_cache")
  rows = []
  for name in names:
    workdir = os.path.join(root, name)
    cmd = _command(name, RUNS[name], workdir, args)
    log(f"{name}: {' '.join(cmd[1:])}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
      raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    rows.append(_row(name, workdir, args.target))
    log(f"  {rows[-1]}")
  ref = rows[names.index("sync_bf16")]
  if ref["wall_s_to_target"] is None:
    log(f"the reference never reached {ref['target_accuracy']}: no speed-ups")
  for row in rows:
    ok = ref["wall_s_to_target"] is not None and row["wall_s_to_target"] is not None
    row["speedup_vs_sync"] = (
      round(ref["wall_s_to_target"] / row["wall_s_to_target"], 2) if ok else None
    )
    row["final_quality_vs_sync"] = round(row["final_quality"] - ref["final_quality"], 4)
  result = {
    "target": f"{args.target} x teacher held-out accuracy",
    "note": "FP8 is emulated on CPU (e4m3 converted to f32 for the matmuls): no FP8 speed-up "
    "is expected there; the FP8 rows show the mismatch's effect on learning",
    "steps": args.steps,
    "eval_every": args.eval_every,
    "dtype": args.dtype,
    "workdir": root,
    "rows": rows,
  }
  if args.json:
    print(json.dumps(result))
    return 0
  print(f"\ntarget: {result['target']} ({ref['target_accuracy']:.3f}); {result['note']}")
  header = ("run", "mode", "s to target", "steps", "speedup", "final acc", "mean lag", "dropped")
  print("{:<11} {:<6} {:>11} {:>6} {:>8} {:>9} {:>8} {:>7}".format(*header))
  for r in rows:
    print(
      f"{r['name']:<11} {r['mode']:<6} {r['wall_s_to_target']!s:>11} {r['steps_to_target']!s:>6} "
      f"{r['speedup_vs_sync']!s:>8} {r['final_quality']:>9.3f} {r['mean_lag']:>8} {r['dropped']:>7}"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
