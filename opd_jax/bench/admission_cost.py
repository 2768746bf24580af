"""Cost of the admission check as a fraction of one training run of the same config.

Command (CPU; results and timings: docs/results/benchmarks.md):

    python -m opd_jax.bench.admission_cost --params-from=/tmp/runs/bf16_sync \\
        --config.teacher.cache_dir=/tmp/tcache              # readable
    python -m opd_jax.bench.admission_cost ... --json      # the JSON result only

The check. `python -m opd_jax.admit` is run as a separate process (a user pays its imports
and compilations too) for one candidate (`--candidate`, default the fp8_async recipe's FP8
weights and tensor-scaled FP8 KV) on N calibration prompts (`--prompts`, default the check's
64); its cost is the wall time of the whole process, the median of `--repeats` processes, in
two states:

  cold  a fresh workdir: every XLA program is compiled (and, with --student=initial, the
        student warm-started); what the first check of a config on a machine costs;
  warm  the first cold check's workdir again: the programs come from its persistent
        compilation cache (`<workdir>/jax_cache`) and the warm-started student from
        `<workdir>/student_cache`; what every later check of that config costs (the study's
        records, re-checks, other candidates of the same KV format).

The check's own JSON splits the time into setup (models, cached teacher, the student and, with
--params-from, the compiles that run beside its restore; imports excluded) and the measurement.
The student is `--student`: "run" reads the run's latest checkpoint (`--params-from`; from the
run's export when it holds that step, as a finished run's does, else with orbax),
"initial" warm-starts the built-in student as a run does (250 supervised steps on the default
config). The budget is a placeholder fitted on hand-made
records with an empty fingerprint and checked with `--force` and `--extrapolate=pooled` (it
calibrates no real source): the verdict does not change the cost.

The training run. `--params-from=RUN` reads a finished run's `metrics.jsonl`: its
`perf/wall_seconds` (the whole `run`: model build, the teacher bootstrap if that run made one,
the warm start, the OPD loop, evaluations and checkpoints) and `perf/train_wall_seconds` when
the run logged it (the loop without evaluations and checkpoints). A run that bootstrapped its
teacher counts that time: pass `--measure-run` to time a fresh run of the same config with the
cached teacher instead (a subprocess `python -m opd_jax.main`),
whose whole process is timed as the check's is (`process_wall_seconds`). Given both, the result
has both and `fraction_of_run` (check process / run process wall time; the target is at most 2%)
uses the measured run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

DEFAULT_CANDIDATE = "rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor"
TARGET = 0.02
# Placeholder records: the budget's value does not change what the check costs.
_RECORDS = [
  {"source": "placeholder", "mismatch/kl": x, "quality_drop": y}
  for x, y in [(0.0, 0.0), (0.01, 0.0), (0.1, 1.0)]
]


def run_wall_seconds(run_dir: str) -> dict:
  """The run's last `perf/wall_seconds` and `perf/train_wall_seconds` (None when not logged)."""
  from opd_jax.io import metrics_writer

  rows = metrics_writer.read_jsonl(run_dir)

  def last(name):
    values = [r[name] for _, r in sorted(rows.items()) if name in r]
    return values[-1] if values else None

  wall = last("perf/wall_seconds")
  if wall is None:
    raise SystemExit(f"{run_dir}/metrics.jsonl has no perf/wall_seconds: is the run finished?")
  return {"wall_seconds": wall, "train_wall_seconds": last("perf/train_wall_seconds")}


def _config_args(args) -> list[str]:
  out = [f"--config={args.config}"]
  if args.teacher_cache:
    out.append(f"--config.teacher.cache_dir={args.teacher_cache}")
  return out


def measure_run(args, root: str) -> dict:
  """A fresh training run of the config as a subprocess: its logged wall times and the wall
  time of the whole process (imports included, as the check's figure is)."""
  workdir = os.path.join(root, "train_run")
  cmd = [sys.executable, "-m", "opd_jax.main", *_config_args(args), f"--workdir={workdir}"]
  start = time.perf_counter()
  done = subprocess.run(cmd, capture_output=True, text=True)
  process_wall = time.perf_counter() - start
  if done.returncode:
    raise SystemExit(f"the training run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
  return {**run_wall_seconds(workdir), "process_wall_seconds": process_wall}


def time_check(args, workdir: str, budget_path: str, out: str) -> dict:
  """One `python -m opd_jax.admit` process in `workdir`: its wall time and the check's own
  breakdown (the check keeps its compiled programs in `workdir/jax_cache` and the warm-started
  student in `workdir/student_cache`)."""
  cmd = [
    sys.executable,
    "-m",
    "opd_jax.admit",
    *_config_args(args),
    f"--budget={budget_path}",
    f"--candidate={args.candidate}",
    f"--prompts={args.prompts}",
    f"--json={out}",
    f"--workdir={workdir}",
    "--force",
    "--extrapolate=pooled",  # the placeholder calibrates no real source: judge by its limit
  ]
  if args.student == "run":
    cmd.append(f"--params-from={args.run}")
  start = time.perf_counter()
  done = subprocess.run(cmd, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if done.returncode:
    raise SystemExit(f"the check failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
  with open(out, encoding="utf-8") as f:
    result = json.load(f)
  return {
    "wall_seconds": wall,
    "setup_seconds": result["seconds"]["setup"],
    "measure_seconds": result["seconds"]["measure"][0],
    "check_seconds": result["seconds"]["total"],
    "mismatch/kl": result["rows"][0]["mismatch/kl"],
    "tokens": result["rows"][0]["measure/tokens"],
    "command": " ".join(cmd[1:]),
  }


def _median(checks: list[dict]) -> dict:
  keys = [k for k in checks[0] if k != "command"]
  return {k: statistics.median(c[k] for c in checks) for k in keys}


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv)
  flags.DEFINE_string("config", "configs/bf16_sync.py", "The run's config file.", flag_values=fv)
  cli_flags.define_teacher_cache_flag(fv, "The cached teacher's directory.")
  flags.DEFINE_string(
    "params-from", "", "A finished run of the config (its workdir).", flag_values=fv
  )
  flags.DEFINE_bool("measure-run", False, "Time a fresh training run.", flag_values=fv)
  flags.DEFINE_string("candidate", DEFAULT_CANDIDATE, "One candidate spec.", flag_values=fv)
  flags.DEFINE_integer("prompts", 64, "Calibration prompts.", flag_values=fv)
  flags.DEFINE_integer("repeats", 2, "Cold and warm checks (median).", flag_values=fv)
  flags.DEFINE_enum(
    "student", "run", ["run", "initial"], "--params-from=RUN or warm start.", flag_values=fv
  )
  flags.DEFINE_string("workdir", "", "Scratch directory (default: a temp dir).", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
  renames = {"--teacher-cache": "--config.teacher.cache_dir", "--run": "--params-from"}
  args = runner.parse_own_flags(define_flags, argv, __doc__, renames=renames)
  from opd_jax.budget import fit_budget, save_budget

  args.run = args.params_from
  if not args.run and not args.measure_run:
    raise SystemExit("give --params-from=RUN (a finished run to read) or --measure-run")
  if args.student == "run" and not args.run:
    raise SystemExit(
      "--student=run needs --params-from=RUN (its checkpoints); or use --student=initial"
    )
  if args.repeats < 1:
    raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
  log = cli_flags.log_for_json(args.json)
  root = args.workdir or tempfile.mkdtemp(prefix="opd_admission_cost_")
  os.makedirs(root, exist_ok=True)
  budget_path = os.path.join(root, "placeholder_budget.json")
  save_budget(budget_path, fit_budget(_RECORDS, 0.5, num_bootstrap=10), {})

  cold, warm = [], []
  for repeat in range(args.repeats):  # a fresh workdir: nothing compiled or cached yet
    workdir = os.path.join(root, f"cold_{repeat}")
    cold.append(time_check(args, workdir, budget_path, os.path.join(root, f"cold_{repeat}.json")))
    log(f"cold check {repeat + 1}/{args.repeats}: {cold[-1]['wall_seconds']:.1f} s")
  for repeat in range(args.repeats):  # the first cold check's workdir: its caches are filled
    workdir = os.path.join(root, "cold_0")
    warm.append(time_check(args, workdir, budget_path, os.path.join(root, f"warm_{repeat}.json")))
    log(f"warm check {repeat + 1}/{args.repeats}: {warm[-1]['wall_seconds']:.1f} s")
  runs = {}  # "read" and/or "measured" -> the run's wall times
  if args.run:
    runs["read"] = {"dir": args.run, **run_wall_seconds(args.run)}
  if args.measure_run:
    log("timing a training run of the same config (cached teacher) ...")
    runs["measured"] = {"dir": os.path.join(root, "train_run"), **measure_run(args, root)}
  source = "measured" if "measured" in runs else "read"  # the fraction's denominator
  result = {
    "candidate": args.candidate,
    "prompts": args.prompts,
    "student": args.student,
    "check_command": cold[0]["command"],
    "runs": runs,
    "run_source": source,
    "target": TARGET,
  }
  for name, checks in (("cold", cold), ("warm", warm)):
    median = _median(checks)
    entry = {**median, "repeats": [c["wall_seconds"] for c in checks]}
    for src, run in runs.items():
      # Process against process when the run's process was timed; else the run's own log.
      run_wall = run.get("process_wall_seconds", run["wall_seconds"])
      entry[f"fraction_of_run_{src}"] = median["wall_seconds"] / run_wall
      if run["train_wall_seconds"]:
        entry[f"fraction_of_train_loop_{src}"] = median["wall_seconds"] / run["train_wall_seconds"]
    entry["fraction_of_run"] = entry[f"fraction_of_run_{source}"]
    entry["within_target"] = entry["fraction_of_run"] <= TARGET
    result[name] = entry
  if args.json:
    json_file.write_text(args.json, json.dumps(result))
    if args.json == "-":
      return 0
  print(f"check: {args.candidate} on {args.prompts} prompts, student={args.student}")
  for src, run in runs.items():
    print(f"run ({src}): {run['dir']}: wall {run['wall_seconds']:.1f} s")
  for name in ("cold", "warm"):
    c = result[name]
    print(
      f"  {name}: wall {c['wall_seconds']:.1f} s (median of {args.repeats}; setup "
      f"{c['setup_seconds']:.1f} s, measurement {c['measure_seconds']:.1f} s) = "
      f"{c['fraction_of_run']:.2%} of the {source} run (target <= {TARGET:.0%}: "
      f"{'met' if c['within_target'] else 'NOT met'})"
      + "".join(
        f"; {c[f'fraction_of_run_{src}']:.2%} of the {src} run" for src in runs if src != source
      )
    )
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
