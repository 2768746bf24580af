"""Training runs side by side: a sweep with `--workers` processes against one run at a time.

Command (CPU; results: docs/results/benchmarks.md):

    python -m opd_jax.bench.parallel_runs --config.teacher.cache_dir=/tmp/tcache         # readable
    python -m opd_jax.bench.parallel_runs --config.teacher.cache_dir=/tmp/tcache --json  # JSON

`--runs` runs of the study's run config (`configs/study.py`: `bf16_sync.py` at 500 steps;
`--steps` shortens them), with seeds 0, 1, ..., trained twice by `runs.run_many`:

  serial    workers=1: one after another in this process, as the study trained before
            `config.workers` (later runs reuse the programs the first one compiled);
  parallel  workers=`--workers`: side by side, each in a spawned process that compiles its
            own programs.

Each sweep is timed as a whole; `speedup` = serial wall / parallel wall, and `cores_busy` is
the CPU time of the sweep's processes over its wall time: how much of the machine one run
leaves for a second. `same_numbers` says whether every run
ended at the same held-out accuracy, teacher KL and training-time mismatch/kl in both sweeps:
the run's programs, data and seeds are the same, so they must.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

RESULT_KEYS = ("student_accuracy_after", "student_teacher_kl_after", "train/mismatch/kl_mean")


CONFIGS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "configs"))


def _run_config(steps: int, seed: int, teacher_cache: str):
  if CONFIGS not in sys.path:
    sys.path.insert(0, CONFIGS)
  import study as study_config  # configs/study.py

  from opd_jax.experiments import runs

  run = study_config.get_config().run
  overrides = {"train.seed": seed, "teacher.cache_dir": teacher_cache}
  if steps:
    overrides.update({"train.steps": steps, "train.eval_every": steps})
    overrides["train.checkpoint_every"] = steps
  return runs.with_overrides(run, overrides)


def _cpu_seconds() -> float:
  """User + system CPU time of this process and its finished children."""
  own, children = (
    resource.getrusage(resource.RUSAGE_SELF),
    resource.getrusage(resource.RUSAGE_CHILDREN),
  )
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def sweep(root: str, args, workers: int, log) -> dict:
  """Trains `args.runs` runs under `root` with `workers`; their wall time and results."""
  from opd_jax.experiments import runs

  jobs = [
    (_run_config(args.steps, seed, args.teacher_cache), os.path.join(root, f"seed{seed}"))
    for seed in range(args.runs)
  ]
  start, cpu = time.perf_counter(), _cpu_seconds()
  results = runs.run_many(jobs, workers, log)
  wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
  return {
    "workers": workers,
    "wall_seconds": round(wall, 1),
    "cores_busy": round(cpu / wall, 2),
    "run_wall_seconds": [round(r["wall_seconds"], 1) for r in results],
    "results": [{k: r.get(k) for k in RESULT_KEYS} for r in results],
  }


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv)
  flags.DEFINE_integer("runs", 4, "Runs in each sweep.", flag_values=fv)
  flags.DEFINE_integer("workers", 2, "Processes of the parallel sweep.", flag_values=fv)
  flags.DEFINE_integer("steps", 0, "OPD steps per run (0: the study's).", flag_values=fv)
  flags.DEFINE_string("workdir", "", "Keep the runs here (default: a temp dir).", flag_values=fv)
  cli_flags.define_teacher_cache_flag(fv, "Teacher cache (default: the workdir's).")


def main(argv: list[str] | None = None) -> int:
  renames = {"--teacher-cache": "--config.teacher.cache_dir"}
  args = runner.parse_own_flags(define_flags, argv, __doc__, renames=renames)
  if args.runs < 1 or args.workers < 2 or args.steps < 0:
    raise SystemExit("--runs must be >= 1, --workers >= 2 and --steps >= 0")
  log = cli_flags.log_for_json(args.json)
  root = args.workdir or tempfile.mkdtemp(prefix="opd_parallel_runs_")
  args.teacher_cache = args.teacher_cache or os.path.join(root, "teacher_cache")
  # The teacher and the warm-started student go into the cache before either sweep (workers
  # would otherwise race to make them), and the parallel sweep runs first: its workers start
  # from nothing either way, while the serial sweep's process keeps what it compiles.
  from opd_jax.experiments import runs

  runs.fill_teacher_cache(_run_config(args.steps, 0, args.teacher_cache), root, log)
  parallel = sweep(os.path.join(root, "parallel"), args, args.workers, log)
  serial = sweep(os.path.join(root, "serial"), args, 1, log)
  result = {
    "runs": args.runs,
    "steps": args.steps or "the study's",
    "cpu_count": os.cpu_count(),
    "serial": serial,
    "parallel": parallel,
    "speedup": round(serial["wall_seconds"] / parallel["wall_seconds"], 3),
    "same_numbers": serial["results"] == parallel["results"],
    "workdir": root,
  }
  if args.json:
    json_file.write_text(args.json, json.dumps(result))
    if args.json == "-":
      return 0
  print(f"\n{args.runs} runs on {result['cpu_count']} CPUs ({result['steps']} steps each)")
  for name in ("serial", "parallel"):
    s = result[name]
    print(
      f"{name:<9} workers={s['workers']}  {s['wall_seconds']:>8.1f} s  runs {s['run_wall_seconds']}"
    )
  print(f"speedup {result['speedup']}x; the same numbers in both: {result['same_numbers']}")
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
