"""Time to quality: async and FP8 rollouts against the synchronous reference, over seeds.

Command (CPU; results and timings: docs/results/main_job.md):

    python -m opd_jax.bench.async_vs_sync                          # readable table
    python -m opd_jax.bench.async_vs_sync --json                   # the JSON result only
    python -m opd_jax.bench.async_vs_sync --runs=sync_bf16,async_fp8 --seeds=3
    python -m opd_jax.bench.async_vs_sync --variant=tiny --steps=4   # the wiring, in seconds

Runs of `configs/bf16_sync.py` on the embedded task, each a separate process (so no run
inherits another's compiled programs), with the same warm-started student and one cached
teacher, for each of `--seeds` OPD seeds (`train.seed`: the data order and the rollout keys):

    sync_bf16        rollout.mode=sync, weights=trainer, kv_cache=auto   (the reference)
    async_bf16       rollout.mode=async, max_lag=1, score_teacher, weights=trainer
    sync_fp8         rollout.mode=sync, fp8 weights + fp8 KV (the fp8_async.py recipe)
    async_fp8        configs/fp8_async.py's rollout settings (the main job)
    async_fp8_apart  the main job with the rollouts on a device of their own: 2 CPU devices
                     (XLA's forced host devices), rollout.devices=1, inline dispatch

The async runs also move the teacher's forward pass to the rollout side
(`rollout.score_teacher`, as verl's and slime's rollout side scores the teacher), so it
overlaps training with the sampling.

"bf16" names the study's reference: the engine runs at the trainer's own precision
(f32 on a CPU, bf16 with `--dtype=bfloat16` on an accelerator).

Target. The quality level is `--target` × the teacher's held-out accuracy (default 0.9, the
bar `configs/fp8_async.py` is held to): the first evaluation at or above it is the time to
target. Evaluations run every `--eval-every` steps (default 10) on a fixed set of
`--eval-size` held-out prompts (default 128), so steps and seconds to target are resolved to
10 steps; the final quality is that set's accuracy at the last step.

Time. `wall_s_to_target` is `perf/train_wall_seconds` at that evaluation: seconds since the OPD
loop started, minus the time spent evaluating and checkpointing, so every run pays the same
for those. The train step's compilation is included in every run. Each row reports the mean and
the sample standard deviation over seeds, and the speed-up is mean(reference) / mean(row).

The split. Wall clocks do not split a step under asynchronous dispatch, so after the runs each
row's programs are timed once more in a serialized pass (one process, each program waited
for, medians over `--split-batches` batches after a warm-up): sampling, the teacher's
scoring of a batch, and the train step (for sync rows the train step includes the teacher's
forward pass; for async rows the rollout side does it). `waiting_s` is the run's own measured
wait for a batch per step (`rollout/queue_wait_seconds`), `step_s` its loop seconds per
step (compilation included), and `steady_step_s` the loop seconds per step from the first
logged step on (`train.log_every`), once the programs are compiled. With the sampling side
r = sampling + scoring and the train side s, a loop that overlaps them perfectly takes
max(r, s) per step against r + s, so (r + s) / max(r, s) bounds the per-step speed-up of
overlap on free hardware; on a CPU the two sides share the same cores, so a run gets less.

FP8 on a CPU is emulated (XLA converts e4m3 to f32 for the matmuls), so the FP8 rows
measure the mismatch's effect on learning, not an FP8 speed-up.
"""

from __future__ import annotations

import ast
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile

from absl import flags

from opd_jax.bench import timing
from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file, metrics_writer

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
  "async_fp8_apart": {"rollout.devices": 1, "rollout.dispatch": "inline"},  # on fp8_async.py
}
CONFIG_FILES = {name: "bf16_sync.py" for name in RUNS} | {
  "async_fp8": "fp8_async.py",
  "async_fp8_apart": "fp8_async.py",
}
DEVICES = {"async_fp8_apart": 2}  # forced host devices: one trains, one samples


def _settings(name: str, seed: int, args) -> dict[str, object]:
  """The `--config.<key>=value` overrides of run `name` with OPD seed `seed`."""
  return {
    **(RUNS[name] or {}),
    "teacher.cache_dir": args.teacher_cache,
    "train.steps": args.steps,
    "train.eval_every": args.eval_every,
    "train.checkpoint_every": args.steps,
    "train.seed": seed,
    "data.eval_size": args.eval_size,
    "student.dtype": args.dtype,
    "teacher.dtype": args.dtype,
  }


def _config_arg(name: str, args) -> str:
  """`configs/<file>.py[:variant]` of run `name` (`--variant`: "" or a config variant)."""
  variant = getattr(args, "variant", "")
  return CONFIG_FILES[name] + (f":{variant}" if variant else "")


def _command(name: str, seed: int, workdir: str, args) -> tuple[list[str], dict]:
  """The run's command line and its environment."""
  cmd = [
    sys.executable,
    "-m",
    "opd_jax.main",
    f"--config={_config_arg(name, args)}",
    f"--workdir={workdir}",
  ]
  cmd += [f"--config.{key}={value}" for key, value in _settings(name, seed, args).items()]
  env = dict(os.environ)
  if name in DEVICES:
    flag = f"--xla_force_host_platform_device_count={DEVICES[name]}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
  return cmd, env


def _run_row(name: str, seed: int, workdir: str, target_fraction: float, steps: int) -> dict:
  """One finished run's time to target, final quality and measured waiting."""
  rows = metrics_writer.read_jsonl(workdir)
  evals = sorted(s for s, r in rows.items() if "quality/student_accuracy" in r)
  teacher = rows[evals[0]]["quality/teacher_accuracy"]
  target = target_fraction * teacher
  reached = [s for s in evals if s > 0 and rows[s]["quality/student_accuracy"] >= target]
  last = evals[-1]
  lag_rows = [r for r in rows.values() if "rollout/version_lag_mean" in r]
  first = reached[0] if reached else None
  loop_s = rows[last]["perf/train_wall_seconds"]
  logged = sorted(s for s, r in rows.items() if s > 0 and "perf/train_wall_seconds" in r)
  steady = None
  if len(logged) > 1:  # from the first logged step on: the programs are compiled
    span = rows[logged[-1]]["perf/train_wall_seconds"] - rows[logged[0]]["perf/train_wall_seconds"]
    steady = span / (logged[-1] - logged[0])
  return {
    "name": name,
    "seed": seed,
    "target_accuracy": round(target, 4),
    "wall_s_to_target": None if first is None else round(rows[first]["perf/train_wall_seconds"], 1),
    "steps_to_target": first,
    "final_quality": rows[last]["quality/student_accuracy"],
    "final_kl": rows[last]["quality/student_teacher_kl"],
    "teacher_accuracy": teacher,
    "train_wall_s": round(loop_s, 1),
    "step_s": loop_s / steps,
    "steady_step_s": steady,
    "waiting_s": sum(r.get("rollout/queue_wait_seconds", 0.0) for r in lag_rows) / steps,
    "mean_lag": round(sum(r["rollout/version_lag_mean"] for r in lag_rows) / len(lag_rows), 3),
    "dropped": int(max((r.get("rollout/dropped", 0) for r in lag_rows), default=0)),
  }


def _mean_sd(values: list) -> tuple[float | None, float | None]:
  """Mean and sample standard deviation, None where a value is missing."""
  if not values or any(v is None for v in values):
    return None, None
  sd = statistics.stdev(values) if len(values) > 1 else 0.0
  return round(statistics.fmean(values), 3), round(sd, 3)


def _summary(name: str, runs: list[dict]) -> dict:
  """A row's figures over its seeds."""
  out = {
    "name": name,
    "mode": "async" if "async" in name else "sync",
    "weights": "fp8" if "fp8" in name else "trainer",
    "kv_cache": "fp8/tensor" if "fp8" in name else "auto",
    "seeds": [r["seed"] for r in runs],
  }
  keys = ("wall_s_to_target", "steps_to_target", "final_quality", "step_s", "steady_step_s")
  for key in (*keys, "waiting_s"):
    out[f"{key}_mean"], out[f"{key}_sd"] = _mean_sd([r[key] for r in runs])
  out["reached"] = sum(r["wall_s_to_target"] is not None for r in runs)
  out["mean_lag"] = round(statistics.fmean(r["mean_lag"] for r in runs), 3)
  out["dropped"] = sum(r["dropped"] for r in runs)
  out["per_seed"] = runs
  return out


def _load_config(name: str, settings: dict, variant: str = ""):
  """Run `name`'s config (its `variant`, "" for none) in this process, with `settings` applied
  as the command line would."""
  configs = str(cli_flags.CONFIGS_DIR)
  if configs not in sys.path:
    sys.path.insert(0, str(configs))
  get_config = runpy.run_path(os.path.join(configs, CONFIG_FILES[name]))["get_config"]
  config = get_config(variant or None)
  for key, value in settings.items():
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node[part]
    if isinstance(value, str) and not isinstance(node[leaf], str):
      value = ast.literal_eval(value)
    node[leaf] = value
  return config


def serialized_split(name: str, args, workdir: str) -> dict:
  """Sampling, teacher scoring and train-step seconds of run `name`'s programs, each waited for
  (the module docstring's split). Runs in this process on its default devices."""
  import jax

  from opd_jax.model import sharding
  from opd_jax.train import preflight, trainer
  from opd_jax.train import setup as setup_lib
  from opd_jax.train import state as train_state

  settings = _settings(name, 0, args) | {"rollout.devices": 0}
  config = _load_config(name, settings, getattr(args, "variant", ""))
  quiet = lambda *a, **k: None  # noqa: E731
  spec = setup_lib.run_spec(config)
  checked = preflight.check(spec, workdir, quiet)
  setup = setup_lib.prepare_models(
    spec, workdir, quiet, checked.plan, checked.eval_prompts, checked.scorer
  )
  params = setup_lib.warm_started_student(spec, setup, quiet, setup.cache_dir or None)
  m, t = setup.models, spec.train
  source = setup_lib.prompt_source(spec, setup.task_cfg)
  width = setup_lib.prompt_width(source, m.tokenizer, setup.task_cfg, False)
  prompts = iter(setup_lib.process_prompt_batches(source, config.data.batch_size, 0))
  tx = train_state.make_optimizer(t.lr, t.steps, t.warmup_steps, t.weight_decay, t.grad_clip)
  abstract = jax.eval_shape(lambda p: train_state.init_state(p, tx, 0), params)
  shardings = sharding.tree_shardings(abstract, m.mesh)  # as the trainer lays its state out
  state = jax.device_put(train_state.init_state(params, tx, 0), shardings)
  step_fn = trainer.make_step_fn(spec, setup, shardings, tx)
  scored_in_run = bool(config.rollout.score_teacher)  # where this row's teacher runs
  seconds, rollouts = {}, {}
  for scored in (False, True):
    config.rollout.score_teacher, config.rollout.mode = scored, "sync"
    rollout_spec = setup_lib.run_spec(config)
    worker = trainer.make_rollouts(rollout_spec, setup, prompts, width, state, 0).worker
    params_r = jax.block_until_ready(worker.transform(state.params, 0))
    index = iter(range(10**6))
    batches = [worker.draw_prompts() for _ in range(args.split_batches + 1)]

    def sample(worker=worker, params_r=params_r, batches=batches, index=index):
      i = next(index) % len(batches)
      return worker.sample(params_r, batches[i], i, 0)[0]

    seconds["sampled" if not scored else "sampled_and_scored"] = timing.median_seconds(
      sample, args.split_batches
    )
    rollouts[scored] = sample()
  scored = scored_in_run
  rollout = rollouts[scored]
  holder = [state]

  def step():
    holder[0], metrics = step_fn(holder[0], m.teacher_params, rollout)
    return jax.block_until_ready(metrics)

  train_s = timing.median_seconds(step, args.split_batches)
  sampling_s = seconds["sampled"]
  teacher_s = max(seconds["sampled_and_scored"] - sampling_s, 0.0)
  rollout_side = sampling_s + (teacher_s if scored else 0.0)
  train_side = train_s  # includes the teacher's forward pass when the rollout side skips it
  return {
    "sampling_s": round(sampling_s, 4),
    "teacher_scoring_s": round(teacher_s, 4),
    "teacher_on": "rollout side" if scored else "train step",
    "train_step_s": round(train_s, 4),
    "overlap_bound": round((rollout_side + train_side) / max(rollout_side, train_side, 1e-9), 3),
  }


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv)
  flags.DEFINE_integer("steps", 700, "OPD steps per run.", flag_values=fv)
  flags.DEFINE_integer("seeds", 3, "OPD seeds per row (train.seed).", flag_values=fv)
  flags.DEFINE_integer("eval-every", 10, "Steps between evaluations.", flag_values=fv)
  flags.DEFINE_integer("eval-size", 128, "Held-out prompts evaluated.", flag_values=fv)
  flags.DEFINE_float("target", 0.9, "Target, x teacher accuracy.", flag_values=fv)
  flags.DEFINE_string(
    "runs",
    "sync_bf16,async_bf16,sync_fp8,async_fp8",
    f"Rows, a subset of {', '.join(RUNS)}.",
    flag_values=fv,
  )
  flags.DEFINE_integer("split-batches", 8, "Batches timed per program.", flag_values=fv)
  flags.DEFINE_string("dtype", "float32", "Trainer dtype: float32 | bfloat16.", flag_values=fv)
  flags.DEFINE_string("workdir", "", "Keep the runs here (default: a temp dir).", flag_values=fv)
  flags.DEFINE_string(
    "variant",
    "",
    "Config variant of every run (configs/<file>.py:VARIANT); tiny = a seconds-long wiring run.",
    flag_values=fv,
  )
  cli_flags.define_teacher_cache_flag(fv, "Teacher cache (default: the workdir's).")


def check_args(args) -> list[str]:
  """The run names of `args.runs`, after checking the flags; SystemExit names a bad one."""
  names = [n for n in args.runs.split(",") if n]
  unknown = sorted(set(names) - set(RUNS))
  if unknown:
    raise SystemExit(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
  if "sync_bf16" not in names:
    raise SystemExit("the reference run sync_bf16 is needed for the speed-ups")
  if not 0 < args.target <= 1:
    raise SystemExit(f"--target must be in (0, 1], got {args.target}")
  if args.seeds < 1 or args.steps < 1 or args.eval_every < 1 or args.split_batches < 1:
    raise SystemExit("--seeds, --steps, --eval-every and --split-batches must be >= 1")
  return names


def run(args, log=print) -> dict:
  """The runs, their summaries and serialized splits (module docstring), from the parsed flags
  (`define_flags`; also `bench.device_check`'s short run of the main job)."""
  names = check_args(args)
  root = args.workdir or tempfile.mkdtemp(prefix="opd_async_vs_sync_")
  args.teacher_cache = args.teacher_cache or os.path.join(root, "teacher_cache")
  per_name: dict[str, list[dict]] = {name: [] for name in names}
  total, done = len(names) * args.seeds, 0
  for seed in range(args.seeds):  # seed-major: a slow drift of the machine hits every row
    for name in names:
      workdir = os.path.join(root, f"{name}_seed{seed}")
      cmd, env = _command(name, seed, workdir, args)
      done += 1
      log(f"[{done}/{total}] {name} seed {seed}: {' '.join(cmd[1:])}")
      finished = subprocess.run(cmd, capture_output=True, text=True, env=env)
      if finished.returncode:
        raise SystemExit(f"{name} failed:\n{finished.stdout[-2000:]}\n{finished.stderr[-3000:]}")
      per_name[name].append(_run_row(name, seed, workdir, args.target, args.steps))
      log(f"  {per_name[name][-1]}")
  rows = [_summary(name, per_name[name]) for name in names]
  ref = rows[names.index("sync_bf16")]
  for name, row in zip(names, rows, strict=True):
    log(f"serialized pass: {name}")
    row["split"] = serialized_split(name, args, os.path.join(root, f"split_{name}"))
    ok = ref["wall_s_to_target_mean"] is not None and row["wall_s_to_target_mean"] is not None
    row["speedup_vs_sync"] = (
      round(ref["wall_s_to_target_mean"] / row["wall_s_to_target_mean"], 2) if ok else None
    )
    row["step_speedup_vs_sync"] = round(ref["step_s_mean"] / row["step_s_mean"], 2)
    row["final_quality_vs_sync"] = round(row["final_quality_mean"] - ref["final_quality_mean"], 4)
  return {
    "target": f"{args.target} x teacher held-out accuracy",
    "note": "FP8 is emulated on CPU (e4m3 converted to f32 for the matmuls): no FP8 speed-up "
    "is expected there; the FP8 rows show the mismatch's effect on learning",
    "steps": args.steps,
    "seeds": args.seeds,
    "eval_every": args.eval_every,
    "eval_size": args.eval_size,
    "dtype": args.dtype,
    "variant": args.variant,
    "workdir": root,
    "rows": rows,
  }


def main(argv: list[str] | None = None) -> int:
  renames = {"--teacher-cache": "--config.teacher.cache_dir"}
  args = runner.parse_own_flags(define_flags, argv, __doc__, renames=renames)
  check_args(args)
  log = cli_flags.log_for_json(args.json)
  result = run(args, log)
  rows = result["rows"]
  if args.json:
    with cli_flags.json_output(args.json) as path:
      json_file.write_text(path, json.dumps(result))
    if args.json == "-":
      return 0
  print(f"\ntarget: {result['target']}; {args.seeds} seeds (mean ± sd); {result['note']}")
  header = (
    "run",
    "s to target",
    "steps",
    "speed-up",
    "final acc",
    "s/step",
    "wait/step",
    "sample",
    "teacher",
    "train",
    "bound",
  )
  print("{:<15} {:>13} {:>11} {:>8} {:>13} {:>7} {:>9} {:>7} {:>7} {:>7} {:>6}".format(*header))
  for r in rows:
    sp = r["split"]
    print(
      f"{r['name']:<15} {r['wall_s_to_target_mean']!s:>6}±{r['wall_s_to_target_sd']!s:<6} "
      f"{r['steps_to_target_mean']!s:>5}±{r['steps_to_target_sd']!s:<5} "
      f"{r['speedup_vs_sync']!s:>8} {r['final_quality_mean']:>6.3f}±{r['final_quality_sd']:<6.3f} "
      f"{r['step_s_mean']:>7.3f} {r['waiting_s_mean']:>9.3f} {sp['sampling_s']:>7.3f} "
      f"{sp['teacher_scoring_s']:>7.3f} {sp['train_step_s']:>7.3f} {sp['overlap_bound']:>6}"
    )
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
