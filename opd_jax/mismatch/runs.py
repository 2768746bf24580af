"""Training runs recorded once: the unit the study, the OPD-against-RL comparison and the guard
demo are made of.

`run_once(config, run_dir)` trains `config` into `run_dir` with `trainer.run` and writes
`run_dir/result.json`: the trainer's result, the held-out curve and the run's training-time
`mismatch/*` means. A second call with the same directory reads the file instead of training,
so a study restarted on its workdir recomputes nothing it finished; a run that was stopped
midway resumes from its last checkpoint (the trainer's own resume). A result written for a
different configuration is refused rather than reused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import numpy as np

from opd_jax import config_check, metrics_writer, trainer

RESULT_FILE = "result.json"
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
  path = os.path.join(run_dir, RESULT_FILE)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


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
    saved = done["config"]
    added = sorted(set(wanted) - set(saved))
    changed = sorted(k for k in set(saved) if wanted.get(k) != saved[k])
    if added and not changed:
      log(f"{run_dir}: recorded before the config had {', '.join(added)}; not compared")
    if changed:
      raise ValueError(
        f"{run_dir} holds a finished run of another configuration (differs in: "
        f"{', '.join(changed[:8])}); use another workdir or remove it"
      )
    return done
  result = trainer.run(config, run_dir, log)
  if result["end_step"] < config.train.steps:
    raise ValueError(
      f"run {run_dir} stopped at step {result['end_step']} of {config.train.steps} "
      f"({result['stopped_by']}); run again to resume it"
    )
  result.update(training_summary(run_dir))
  result["config"] = wanted
  tmp = os.path.join(run_dir, RESULT_FILE + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  os.replace(tmp, os.path.join(run_dir, RESULT_FILE))
  return result
