"""Exporting a training run's student as a Hugging Face checkpoint (`python -m opd_jax.export`).

`export_run(workdir, out, step)` restores the student params of the run's orbax checkpoint at
`step` (default: the latest) as `io.run_history.RunHistory` restores them, and
writes `out` with `export_student`, as a finished run exports itself: model.safetensors (or
shards and their index, over 4 GiB), config.json and generation_config.json with the
bos/eos/pad ids, and the tokenizer (the run's Hugging Face tokenizer files copied, or the
built-in character tokenizer as a `transformers` fast tokenizer; `hf_export.export_student`),
and `run_history.EXPORT_RECORD`, the step and the run's config it holds. `out` loads with
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.

A padded student (an embedding table with more rows than its tokenizer has ids; the run
trained it with logits cut to the tokenizer's V_real, `ModelConfig.logical_vocab_size`) is
written with every row, so the export has its source checkpoint's shapes and `vocab_size`. The
padded rows get no gradient: they keep the source's values (weight decay, when set, shrinks
them).

The config defaults to the one the run saved: every checkpoint's extra data holds the run's
`run_history.run_fingerprint` (each config value's repr, less the
`run_history.RESUMABLE_KEYS`), which
`config_from_fingerprint` lays over `configs/base.py`. A config given instead must describe the
run's student (`STUDENT_KEYS`); `RunHistory` then also refuses another teacher or task. Only
the student is built (abstract params, no teacher), so an export allocates the restored train
state and nothing else.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
from collections.abc import Callable

import jax
import ml_collections
import orbax.checkpoint as ocp

from opd_jax.config import check as config_check
from opd_jax.config.spec import RunSpec
from opd_jax.io import build, hf, hf_export, provenance, run_history
from opd_jax.io.run_history import EXPORT_RECORD, run_fingerprint
from opd_jax.model import sharding, tokenizer
from opd_jax.model import transformer as model
from opd_jax.train import setup as setup_lib

CHECKPOINTS = "checkpoints"  # <workdir>/checkpoints: the trainer's orbax checkpoints
BASE_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "base.py"


def run_steps(workdir: str) -> list[int]:
  """The steps of the finished trainer checkpoints under `workdir/checkpoints`, ascending.

  Raises:
    ValueError: no such workdir, no checkpoints directory, or no finished checkpoint in it.
  """
  if not os.path.isdir(workdir):
    raise ValueError(f"run directory {workdir!r} does not exist")
  directory = os.path.join(workdir, CHECKPOINTS)
  if not os.path.isdir(directory):
    raise ValueError(
      f"{workdir!r} holds no checkpoints directory ({directory}): not a training run's "
      "--workdir, or the run saved no checkpoint yet"
    )
  steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
  if not steps:
    raise ValueError(f"{directory} holds no finished checkpoint: the run saved none yet")
  return steps


def saved_fingerprint(workdir: str, step: int) -> dict[str, str]:
  """The config fingerprint (`run_history.run_fingerprint`) stored with checkpoint `step`."""
  manager = ocp.CheckpointManager(
    os.path.join(os.path.abspath(workdir), CHECKPOINTS),
    options=ocp.CheckpointManagerOptions(create=False),
  )
  try:
    extra = manager.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))["extra"]
  finally:
    manager.close()
  if not isinstance(extra.get("config"), dict):
    raise ValueError(f"checkpoint {step} in {workdir} saved no config; pass --config")
  return extra["config"]


def base_config() -> ml_collections.ConfigDict:
  """`configs/base.py`'s `get_config()`."""
  spec = importlib.util.spec_from_file_location("opd_jax_export_base_config", BASE_CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def config_from_fingerprint(fingerprint: dict[str, str]) -> ml_collections.ConfigDict:
  """The run config a fingerprint describes: each `key: repr(value)` parsed with
  `ast.literal_eval` and set over `configs/base.py` (which gives the `RESUMABLE_KEYS` the
  fingerprint leaves out: they change how long a run is, not its student).

  Raises:
    ValueError: a key `configs/base.py` does not have, or a value that is not a literal.
  """
  config = base_config()
  known = dict(config_check.flatten(config))
  unknown = sorted(k for k in fingerprint if k not in known)
  if unknown:
    raise ValueError(
      f"the run's saved config has keys that configs/base.py lacks ({', '.join(unknown[:5])}); "
      "pass the run's config with --config"
    )
  for key, text in fingerprint.items():
    try:
      value = ast.literal_eval(text)
    except (SyntaxError, ValueError) as e:
      raise ValueError(f"the run's saved config.{key}={text} does not parse: {e}") from e
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    try:
      node[leaf] = value
    except TypeError as e:
      raise ValueError(f"the run's saved config.{key}={text}: {e}") from e
  return config


# Settings that decide the student's shapes and meaning: a --config must agree with the run here
# before anything is restored (RunHistory then checks the teacher and task as well).
STUDENT_KEYS = ("student.", "tokenizer")


def _refuse_other_student(saved: dict[str, str], spec: RunSpec, workdir: str) -> None:
  current = run_history.run_fingerprint(spec)
  changed = sorted(
    k for k in set(saved) & set(current) if k.startswith(STUDENT_KEYS) and saved[k] != current[k]
  )
  if changed:
    details = ", ".join(f"{k}: {saved[k]} (run) vs {current[k]} (--config)" for k in changed[:5])
    raise ValueError(
      f"--config describes another student than the run in {workdir} trained ({details}); "
      "leave --config out to use the run's own config"
    )


def student_setup(spec: RunSpec) -> setup_lib.Setup:
  """The `setup_lib.Setup` that `RunHistory` needs: the mesh, the tokenizer and the student's
  config with abstract params (shapes only, nothing allocated); no teacher is built."""
  # An unset tokenizer ("") is the student checkpoint's, else the built-in one.
  tok = tokenizer.load_tokenizer(build.tokenizer_path(spec))
  dtype = build.DTYPES[spec.student.dtype]
  if spec.student.checkpoint:
    student_cfg = hf.load_config(spec.student.checkpoint)
  else:
    student_cfg = build.arch_config(spec.student.arch, tok.vocab_size)
  abstract = jax.eval_shape(lambda: model.init_params(jax.random.key(0), student_cfg, dtype))
  models = build.Models(build.build_mesh(spec), tok, student_cfg, abstract, None, None)
  return setup_lib.Setup(models, setup_lib.task_config(spec), teacher_info={}, eval_set=None)


def export_run(
  workdir: str,
  out: str,
  step: int | None = None,
  config: ml_collections.ConfigDict | None = None,
  log: Callable[..., None] = print,
) -> dict:
  """Exports the student of `workdir`'s checkpoint `step` to `out` (module docstring).

  Args:
    workdir: a training run's --workdir (read only).
    out: the output directory (created if needed; earlier weights and tokenizer files in it
      are replaced).
    step: the checkpoint step; None takes the latest.
    config: the run's config; None reads it from the checkpoint.
    log: where progress lines go.

  Returns:
    {"out", "step", "config" (where the config came from), "files"}.

  Raises:
    ValueError: no checkpoint in `workdir`, a `step` it does not hold, a config that differs
      from the run's, or an unusable saved config.
    FileNotFoundError: the run's HF student or tokenizer directory is gone.
  """
  steps = run_steps(workdir)
  if step is None:
    step = steps[-1]
  if step not in steps:
    raise ValueError(f"{workdir} has no checkpoint at step {step} (has steps {steps})")
  saved = saved_fingerprint(workdir, step)
  source = "--config"
  if config is None:
    config, source = config_from_fingerprint(saved), "the run"
  config_check.validate(config)
  spec = setup_lib.run_spec(config)
  _refuse_other_student(saved, spec, workdir)
  setup = student_setup(spec)
  params = run_history.RunHistory(spec, setup, workdir).params(step)
  log(f"restored the student of {workdir} step {step} (config from {source})")
  files = export_student(spec, setup.models, params, out, log, step=step)
  return {"out": os.path.abspath(out), "step": step, "config": source, "files": files}


def export_student(
  spec: RunSpec, models: build.Models, params, out: str, log=print, *, step: int
) -> list[str]:
  """Writes the student `params` as a Hugging Face checkpoint in `out` (`hf_export.export_student`):
  the files of the run's tokenizer (`build.tokenizer_path`; the built-in character tokenizer
  when "char"), and the generation defaults of the HF checkpoint the student came from, if any.

  `params` are those of the run's checkpoint `step`: `out` also gets the `EXPORT_RECORD` of
  that step, the run's config and its provenance (`io.provenance`), which lands with the
  weights or not at all (`hf_export.export_student`'s `finish`).

  Every process must call it (params are gathered across processes); process 0 writes.
  Returns the names of the files in `out` (on other processes: []).
  """
  params = sharding.to_host(params)  # every process: params may span them
  if jax.process_index() != 0:
    return []
  tokenizer_path = build.tokenizer_path(spec)
  record = {"step": step, "config": run_fingerprint(spec)}
  record[provenance.KEY] = provenance.provenance(spec)  # the code that wrote the export

  def write_record(directory: str) -> None:
    with open(os.path.join(directory, EXPORT_RECORD), "w", encoding="utf-8") as f:
      json.dump(record, f, indent=1, sort_keys=True)

  files = hf_export.export_student(
    out,
    models.student_cfg,
    params,
    models.tokenizer,
    tokenizer_dir=None if tokenizer_path == "char" else tokenizer_path,
    source_dir=spec.student.checkpoint or None,
    finish=write_record,
  )
  log(f"student exported as a Hugging Face checkpoint to {out}: {', '.join(files)}")
  return files
