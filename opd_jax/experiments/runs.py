"""Training runs recorded once: the unit the study, the OPD-against-RL comparison and the guard
demo are made of.

`run_once(config, run_dir)` trains `config` into `run_dir` with `mismatch.live_guard.run` (the
trainer, guarded when `budget.file` is set) and writes
`run_dir/result.json`: the trainer's result, the held-out curve and the run's training-time
`mismatch/*` means. A second call with the same directory reads the file instead of training,
so a study restarted on its workdir recomputes nothing it finished; a run that was stopped
midway resumes from its last checkpoint (the trainer's own resume). A result written for a
different configuration is refused rather than reused.

`run_many(jobs, workers)` trains several runs, `workers` at a time in processes of their own,
with the same numbers. One small run does not keep every core busy, so runs side by side
finish a sweep sooner (`python -m opd_jax.bench.parallel_runs` measures by how much).
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from opd_jax.config import check as config_check
from opd_jax.io import json_file, metrics_writer
from opd_jax.mismatch import live_guard
from opd_jax.train import setup as setup_lib

RESULT_FILE = "result.json"
TRAIN_LOG = "train.log"  # a run's log when it trains in a worker process (run_many)
TRAIN_MEANS = ("mismatch/kl", "mismatch/kl_p95", "mismatch/abs_logp_diff", "perf/grad_norm")


def with_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]):
  """A validated copy of `config` with dotted-key overrides applied ({"train.lr": 3e-4}).

  Raises:
    ValueError: an unknown key (with the path that is missing) or a value the config check
      refuses.
  """
  out = ml_collections.ConfigDict(config.to_dict())
  for key, value in overrides.items():
    *path, leaf = key.split(".")
    node = out
    for part in path:
      if part not in node:
        raise ValueError(f"override {key!r}: the config has no section {part!r}")
      node = node[part]
    if leaf not in node:
      raise ValueError(f"override {key!r}: the config has no key {leaf!r} under {'.'.join(path)}")
    node[leaf] = tuple(value) if isinstance(value, list) else value
  config_check.validate(out)
  return out


def config_repr(config: ml_collections.ConfigDict) -> dict[str, str]:
  """Every leaf of the config as `repr` text: what a result is keyed by."""
  return {k: repr(v) for k, v in config_check.flatten(config)}


def training_summary(run_dir: str) -> dict[str, Any]:
  """From `run_dir/metrics.jsonl`: the held-out curve and the training-time means.

  Returns:
    {"curve": [[step, accuracy, kl], ...], "train/<key>_mean": mean over the logged steps,
     "train/<key>_max": max, for each key of TRAIN_MEANS the run logged}.
  """
  rows = metrics_writer.read_jsonl(run_dir)
  curve = [
    [step, r["quality/student_accuracy"], r.get("quality/student_teacher_kl", math.nan)]
    for step, r in sorted(rows.items())
    if "quality/student_accuracy" in r
  ]
  out: dict[str, Any] = {"curve": curve}
  for key in TRAIN_MEANS:
    values = np.asarray([r[key] for _, r in sorted(rows.items()) if key in r], np.float64)
    if values.size:
      out[f"train/{key}_mean"] = float(values.mean())
      out[f"train/{key}_max"] = float(values.max())
  return out


def read_result(run_dir: str) -> dict[str, Any] | None:
  """The recorded result of `run_dir`, or None when it has not finished."""
  return json_file.read_json(os.path.join(run_dir, RESULT_FILE), None)


def recorded_differences(config: ml_collections.ConfigDict, done: Mapping[str, Any]):
  """(keys the config has that a recorded result's config lacks, keys whose values differ),
  each sorted: a result with no differing key is this config's run (`run_once` reuses it)."""
  wanted, saved = config_repr(config), done["config"]
  added = sorted(set(wanted) - set(saved))
  changed = sorted(k for k in set(saved) if wanted.get(k) != saved[k])
  return added, changed


def run_once(config: ml_collections.ConfigDict, run_dir: str, log: Callable = print) -> dict:
  """Trains `config` into `run_dir` unless a result for this exact config is there already.

  Returns:
    The trainer's result dict plus `training_summary(run_dir)` and the config ("config").

  Raises:
    ValueError: `run_dir` holds a result of another configuration (the differing keys named;
      keys added to the config after the result was recorded are logged, not compared),
      or a run stopped before its last step (a signal): rerun to resume it.
  """
  wanted = config_repr(config)
  done = read_result(run_dir)
  if done is not None:
    added, changed = recorded_differences(config, done)
    if added and not changed:
      log(f"{run_dir}: recorded before the config had {', '.join(added)}; not compared")
    if changed:
      raise ValueError(
        f"{run_dir} holds a finished run of another configuration (differs in: "
        f"{', '.join(changed[:8])}); use another workdir or remove it"
      )
    return done
  result = live_guard.run(config, run_dir, log)
  if result["end_step"] < config.train.steps:
    raise ValueError(
      f"run {run_dir} stopped at step {result['end_step']} of {config.train.steps} "
      f"({result['stopped_by']}); run again to resume it"
    )
  result.update(training_summary(run_dir))
  result["config"] = wanted
  json_file.write_json(os.path.join(run_dir, RESULT_FILE), result)
  return result


def fill_teacher_cache(config: ml_collections.ConfigDict, workdir: str, log: Callable = print):
  """Makes the teacher and the warm-started student that `config`'s runs load from its
  `teacher.cache_dir`, unless they are there: before runs start side by side, each of which
  would otherwise make them at once (safely, the first copy wins, but each paying for it)."""
  spec = setup_lib.run_spec(config)
  setup = setup_lib.prepare_models(spec, workdir, log)
  setup_lib.warm_started_student(spec, setup, log, setup.cache_dir or None)


def _train_in_child(config_dict: dict, run_dir: str, compilation_cache: str | None) -> dict:
  """`run_once` in a worker process, its log in `run_dir/TRAIN_LOG`, with the parent's
  persistent compilation cache (a `jax.config` setting, which a spawned process does not
  inherit)."""
  if compilation_cache:
    from opd_jax.io import compile_cache

    compile_cache.enable_compilation_cache(compilation_cache)
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, TRAIN_LOG), "a", encoding="utf-8") as f:

    def log(*args, **kwargs):
      print(*args, **kwargs, file=f, flush=True)

    return run_once(ml_collections.ConfigDict(config_dict), run_dir, log)


def check_workers(workers) -> int:
  """`workers` when it is an int >= 1 (not a bool).

  Raises:
    ValueError: anything else, named.
  """
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers={workers!r} must be an int >= 1")
  return workers


def run_many(
  jobs: Sequence[tuple[ml_collections.ConfigDict, str]], workers: int = 1, log: Callable = print
) -> list[dict]:
  """`run_once(config, run_dir)` for every job, at most `workers` at a time; results in job
  order.

  With one worker every job trains in this process, in order. With more, each job whose result
  is not recorded yet trains in a spawned process of its own (a fresh JAX runtime: no device
  state is shared or forked; this process's persistent compilation cache, if set, is passed
  on), logging to `run_dir/train.log`; a recorded one is read here. A run's numbers do not
  depend on `workers`: its programs, data and seeds are the same, and on CPU two runs side by
  side end at the accuracy one run alone reaches, to every digit (`opd_jax.bench.
  parallel_runs` checks this beside the time it saves).

  Raises:
    ValueError: `workers` not an int >= 1 or two jobs sharing a run directory, before anything
      trains.
    Any exception a job raises (`run_once`'s ValueError, a missing file, ...): the first one,
      once the runs already started have finished; no further job starts after it. Every
      finished run keeps its result, so a restart resumes from there. (A worker process that
      dies, e.g. out of memory, breaks the pool: the runs beside it stop too, and resume on
      a restart from their last checkpoints.)
  """
  check_workers(workers)
  dirs = [os.path.abspath(d) for _, d in jobs]
  if len(set(dirs)) != len(dirs):
    twice = sorted({d for d in dirs if dirs.count(d) > 1})
    raise ValueError(f"two jobs share a run directory: {', '.join(twice)}")
  results: list[dict | None] = [None] * len(jobs)
  todo = []
  for i, (config, run_dir) in enumerate(jobs):
    if workers == 1 or read_result(run_dir) is not None:
      if workers == 1:
        log(f"[{i + 1}/{len(jobs)}] {run_dir}")
      results[i] = run_once(config, run_dir, log)  # trains here, or checks and reads the record
    else:
      todo.append(i)
  if todo:
    results_todo = _run_in_processes([jobs[i] for i in todo], workers, log)
    for i, result in zip(todo, results_todo, strict=True):
      results[i] = result
  return results


def held_out_score(
  result: dict, when: str = "after", who: str = "student"
) -> tuple[str, float] | None:
  """A run's held-out score as (kind, value): `<who>_accuracy_<when>` on the built-in task
  ("accuracy"), else the eval file's `<who>_score_<when>` ("score"); None when it has neither
  (an eval file without answers). `when=""` reads the key without a suffix (the teacher's)."""
  suffix = f"_{when}" if when else ""
  for kind in ("accuracy", "score"):
    value = result.get(f"{who}_{kind}{suffix}")
    if value is not None:
      return kind, float(value)
  return None


def _quality_text(result: dict) -> str:
  """ "accuracy 0.957" on the built-in task, "score 0.500" with an eval file's answers, else the
  held-out KL(student ‖ teacher)."""
  held = held_out_score(result)
  if held is not None:
    return f"{held[0]} {held[1]:.3f}"
  return f"KL(student||teacher) {result.get('student_teacher_kl_after', math.nan):.4g}"


def _run_in_processes(jobs, workers: int, log: Callable) -> list[dict]:
  """Each job in a spawned process, `workers` at a time (run_many): a job is submitted only
  when a worker is free, so none starts after a failure."""
  import jax  # the parent's compilation cache setting

  cache = jax.config.jax_compilation_cache_dir
  context = multiprocessing.get_context("spawn")
  out: list[dict | None] = [None] * len(jobs)
  error: BaseException | None = None
  start, width = time.time(), min(workers, len(jobs))
  queue = list(range(len(jobs)))
  log(f"{len(jobs)} runs, {width} at a time (each logs to <run>/{TRAIN_LOG})")
  with concurrent.futures.ProcessPoolExecutor(
    max_workers=width, mp_context=context, max_tasks_per_child=1
  ) as pool:
    running: dict[concurrent.futures.Future, int] = {}
    while running or (queue and error is None):
      while queue and error is None and len(running) < width:
        i = queue.pop(0)
        config, run_dir = jobs[i]
        running[pool.submit(_train_in_child, config.to_dict(), run_dir, cache)] = i
      finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
      for future in finished:
        i = running.pop(future)
        run_dir = jobs[i][1]
        try:
          out[i] = future.result()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the running ones end
          error = error or e
          log(f"{run_dir}: failed: {e!r}")
          continue
        done = sum(r is not None for r in out)
        log(
          f"[{done}/{len(jobs)}] {run_dir}: {_quality_text(out[i])} "
          f"({out[i]['wall_seconds']:.0f} s; {time.time() - start:.0f} s since the first started)"
        )
  if error is not None:
    raise error
  return out
