"""A run's directory as other commands read it: its config fingerprint, its checkpoints and
its export.

- `run_fingerprint(spec)`: every config value that shapes the trajectory (less
  `RESUMABLE_KEYS`), stored in each checkpoint; `check_same_run` refuses to resume another
  config's checkpoints.
- `start_digests`: the digests of the teacher and of the student a run started from
  (`params_digest`), kept across resumptions; a resumption under another teacher is refused.
- `export_dir` and `EXPORT_RECORD`: a finished run writes its student as a Hugging Face
  checkpoint with a record of the checkpoint step and config it holds.
- `RunHistory`: the student at any checkpointed step of a run (`--params-from=RUN`), read from
  the export when it holds that step (safetensors, no orbax import), else from orbax.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from opd_jax.config.spec import RunSpec
from opd_jax.io import build, hf, params_digest
from opd_jax.model import sharding

# Keys that may change between a run and its resumption (how long and how often).
RESUMABLE_KEYS = (
  "train.steps",
  "train.stop_after",
  "train.log_every",
  "train.eval_every",
  "train.checkpoint_every",
  "train.keep_checkpoints",
  "export.dir",  # where the finished student is written, not how it is trained
  "log.wandb_project",  # where the scalars are logged as well
  "train.resume_schedule",  # what a resume with another train.steps does (schedule_length)
  "data.eval_file",  # what is evaluated; a change of the held-out slice is refused (initial_state)
  "data.eval_metric",
  "train.mismatch_bucket_tokens",  # what the position metrics report, not what is trained
  "train.mismatch_cross_kl",
)


def run_fingerprint(spec: RunSpec) -> dict[str, str]:
  """Every config value that shapes the training trajectory, as strings (the repr of each
  key's value in the run's ConfigDict: `RunSpec.values`); `tokenizer` as the tokenizer it
  resolves to (`build.tokenizer_path`), so "" and "char" agree."""
  out = {k: v for k, v in spec.values if k not in RESUMABLE_KEYS}
  return out | {"tokenizer": repr(build.tokenizer_path(spec))}


def check_same_run(
  saved: dict[str, str], current: dict[str, str], directory: str, log=print
) -> None:
  """Refuses to resume checkpoints of another config. Keys the saved config lacks (added to
  the config since the checkpoint was written) are named in the log, not compared."""
  added = sorted(set(current) - set(saved))
  if added:
    log(f"checkpoints in {directory} predate the config keys {', '.join(added)}; not compared")
  changed = sorted(k for k in saved if saved[k] != current.get(k))
  if changed:
    details = ", ".join(f"{k}: {saved.get(k)} -> {current.get(k)}" for k in changed[:5])
    raise ValueError(
      f"the checkpoints in {directory} come from a different config ({details}); "
      "resume with the same config or use a new --workdir"
    )


START_DIGESTS = "start_digests"  # the key in checkpoint extras and in a run's result


def start_digests(teacher_params, start_params, saved: dict | None, directory: str) -> dict:
  """{"teacher": digest of the teacher, "student": digest of the student the run started from}
  (`params_digest.digest`; None where unknown).

  A fresh run (`saved` None) digests `start_params`, its warm start. A resumed run passes its
  checkpoint's record as `saved` and keeps the student digest recorded there, which no longer
  matches the params it resumes with (None for checkpoints that predate the record).

  Raises:
    ValueError: the checkpoint was trained under another teacher than the one now loaded
      (a teacher rebuilt on another machine, or another teacher checkpoint).
  """
  teacher = params_digest.digest(teacher_params)
  if saved is None:
    return {"teacher": teacher, "student": params_digest.digest(start_params)}
  if saved.get("teacher") not in (None, teacher):
    raise ValueError(
      f"the checkpoints in {directory} were trained under teacher {saved['teacher']}, but the "
      f"teacher loaded now is {teacher}: a teacher bootstrapped on another machine can differ "
      "from the cached one under the same settings. Resume with the teacher cache the run "
      "started with (teacher.cache_dir), or start again in a new --workdir"
    )
  return {"teacher": teacher, "student": saved.get("student")}


def export_dir(spec: RunSpec, workdir: str) -> str | None:
  """Where a finished run writes its student (`export.dir`): "" is `<workdir>/export`,
  "none" is no export (None), anything else that directory."""
  d = spec.export.dir
  if d == "none":
    return None
  return d or os.path.join(workdir, "export")


# In an export of a run's checkpoint: {"step": the checkpoint's step, "config": the run's
# `run_fingerprint`}, which lets `RunHistory` (below) read that step's student from the
# export's safetensors instead of the orbax checkpoint.
EXPORT_RECORD = "opd_jax_run.json"


# Run-config keys that may differ between a --params-from run and the check's config: what the
# candidate changes, how the run trained, and where its teacher is cached.
# Keys a --params-from run may differ in: none changes the student's engine or the mismatch
# between engine and trainer (the teacher's temperature only shapes the loss's target).
_RUN_KEYS_FREE = (
  "rollout.",
  "train.",
  "budget.",
  "export.",
  "teacher.cache_dir",
  "teacher.temperature",
)


def checkpoint_steps(run_dir: str) -> list[int]:
  """The steps of the trainer checkpoints under `run_dir/checkpoints`, ascending."""
  directory = os.path.join(run_dir, "checkpoints")
  if not os.path.isdir(directory):
    raise ValueError(f"--params-from {run_dir}: no checkpoints directory {directory}")
  steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
  if not steps:
    raise ValueError(f"--params-from {run_dir}: {directory} holds no finished checkpoint")
  return steps


def _check_run_config(saved: dict[str, str], spec: RunSpec, run_dir: str) -> None:
  """Refuses a run whose student/teacher/task settings differ from the check's config."""
  current = run_fingerprint(spec)
  changed = sorted(
    k
    for k in set(saved) & set(current)
    if not k.startswith(_RUN_KEYS_FREE) and saved[k] != current[k]
  )
  if changed:
    details = ", ".join(f"{k}: {saved[k]} (run) vs {current[k]} (--config)" for k in changed[:5])
    raise ValueError(
      f"--params-from {run_dir} was trained with another student, teacher or task than "
      f"--config describes ({details}); pass the run's config"
    )


def exported_run_record(run_dir: str, step: int) -> dict | None:
  """The `EXPORT_RECORD` of `run_dir/export` when that export holds the student of
  checkpoint `step`, else None.

  A finished run exports the student of its last checkpoint with a record of the step and the
  run's config (`exporting.export_student`), after the checkpoint is written. An export whose
  record names another step, or that is older than the checkpoint (a run re-trained to the same
  step in that workdir and not finished), does not count, nor does an export without a record.
  """
  file = os.path.join(run_dir, "export", EXPORT_RECORD)
  checkpoint = os.path.join(run_dir, "checkpoints", str(step))
  try:
    if os.path.getmtime(file) < os.path.getmtime(checkpoint):
      return None
    with open(file, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(record, dict) or record.get("step") != step:
    return None
  return record


class RunHistory:
  """The student at a run's checkpointed steps, in the trainer's layout.

  A step is read from the run's export (`exported_run_record`: safetensors, `hf.
  load_checkpoint`) when the export holds it, which is the last step of a finished run; every
  other step is restored from its orbax checkpoint (the params alone: `checkpointing.
  Checkpointer.restore_params`). Both give the same params, bit for bit: the export is written
  in the params' own dtype. Reading the export leaves out orbax, whose import alone is ~0.5 s of
  CPU, a tenth of a first check.

  Args:
    spec: the check's spec (the run's config is checked against it).
    setup: from `train.setup.prepare_models` (the student's structure and mesh).
    run_dir: the run's workdir (read only).
  """

  def __init__(self, spec: RunSpec, setup, run_dir: str):
    self.run_dir = run_dir
    self.steps = checkpoint_steps(run_dir)
    self._spec, self._setup = spec, setup
    self._cache: dict[int, Any] = {}
    self.run_config: dict[str, str] = {}  # the run's config fingerprint (repr per key)
    m = setup.models
    abstract = jax.eval_shape(lambda p: p, m.student_params)
    shardings = sharding.tree_shardings(abstract, m.mesh)
    # The shapes, dtypes and shardings every restored step has.
    self.abstract_params = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )

  @property
  def latest(self) -> int:
    return self.steps[-1]

  def params(self, step: int):
    """The student params of checkpoint `step` (restored once, then kept)."""
    if step not in self._cache:
      if step not in self.steps:
        raise ValueError(f"{self.run_dir} has no checkpoint at step {step} (has {self.steps})")
      record = exported_run_record(self.run_dir, step)
      if record is not None:
        shardings = jax.tree.map(lambda a: a.sharding, self.abstract_params)
        dtype = build.DTYPES[self._spec.student.dtype]
        export = os.path.join(self.run_dir, "export")
        params = hf.load_checkpoint(export, dtype, shardings=shardings)[1]
        self.run_config = record.get("config", {})
      else:
        from opd_jax.io import checkpointing

        ckpt = checkpointing.Checkpointer(os.path.join(self.run_dir, "checkpoints"), read_only=True)
        try:
          params, extra = ckpt.restore_params(step, self.abstract_params)
        finally:
          ckpt.close()
        self.run_config = extra.get("config", {})
      _check_run_config(self.run_config, self._spec, self.run_dir)
      self._cache[step] = params
    return self._cache[step]
