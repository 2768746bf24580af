"""Builds the run's mesh, tokenizer, student and teacher from its spec (`config.spec.RunSpec`).

Models come from local Hugging Face checkpoints (`hf.load_checkpoint`, each tensor
placed straight onto its sharding) or, for the built-in task, from the architecture
in the config, initialised directly into their shardings with
`jit(init, out_shardings=tree_shardings(eval_shape(init)))`.

A built-in model's random init is deferred: `build_models` gives its abstract params
(ShapeDtypeStructs carrying their shardings) and `materialize` runs the init the first time
a concrete value is needed. Most runs never need it: the teacher comes from its cache, the
warm-started student from its cache or a checkpoint, and the admission check restores a
run's student; each skipped init is one XLA compilation (seconds) not paid.

Building happens in two stages so that mistakes surface before any weights load:
`plan_models` reads only config.json files and tokenizer files (mesh, tokenizer,
both ModelConfigs, the vocabulary checks); `build_models` then loads or initialises
the weights of that plan.

The tokenizer (`tokenizer_path`): `spec.tokenizer` when set; unset (""), the student
checkpoint's own tokenizer, or the built-in character tokenizer without a checkpoint.

Padded vocabularies: the student and teacher must share one tokenizer, not one table size
(`tokenizer.check_vocabularies`: the teacher checkpoint's own tokenizer, when it has one,
must be identical to the run's; the tokenizer's V_real ids must fit both tables). Both
ModelConfigs then carry `logical_vocab_size` = V_real whenever their table has more rows
(`with_real_vocab`), so both models' logits are [..., V_real] and the padded rows take no
part in any softmax, loss, metric or sample; the weights (and an export) keep every row.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from opd_jax.config import spec as spec_lib
from opd_jax.config.spec import ArchSpec, RunSpec, StudentSpec, TeacherSpec
from opd_jax.io import hf
from opd_jax.model import sharding, sharding_checks, tokenizer
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build_mesh(spec: RunSpec) -> jax.sharding.Mesh:
  """The trainer's (data, fsdp, tensor) mesh: over all devices, or over those that
  `rollout.devices` leaves (`sharding.split_devices`) when rollouts run on their own."""
  apart = spec.rollout.devices
  devices = sharding.split_devices(apart)[0] if apart else None
  return sharding.make_mesh((spec.mesh.data, spec.mesh.fsdp, spec.mesh.tensor), devices)


def arch_config(arch: ArchSpec, vocab_size: int) -> ModelConfig:
  """ModelConfig of a built-in architecture: `arch`'s fields, and the biases and norms its
  `model_type` implies."""
  return spec_lib.derive(
    ModelConfig,
    arch,
    vocab_size=vocab_size,
    qkv_bias=arch.model_type == "qwen2",
    qk_norm=arch.model_type == "qwen3",
  )


def param_shardings(cfg: ModelConfig, mesh, dtype):
  """NamedShardings of a `cfg` params pytree, from its abstract shapes and the rules."""
  abstract = jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg, dtype))
  return sharding.tree_shardings(abstract, mesh)


def init_sharded(cfg: ModelConfig, mesh, rng, dtype):
  """Random params created directly in their shardings (never whole on one host)."""
  init = lambda rng: model.init_params(rng, cfg, dtype)
  return jax.jit(init, out_shardings=param_shardings(cfg, mesh, dtype))(rng)


def abstract_params(cfg: ModelConfig, mesh, dtype):
  """The params pytree of `cfg` as ShapeDtypeStructs with their shardings (no memory)."""
  abstract = jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg, dtype))
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    abstract,
    sharding.tree_shardings(abstract, mesh),
  )


def load_or_init(block: StudentSpec | TeacherSpec, vocab_size: int, mesh, init_key: Callable):
  """(ModelConfig, params, pending init or None) for a student/teacher config block.

  A non-empty `block.checkpoint` loads that HF directory (no pending init); otherwise the
  params are the built-in architecture's abstract params and the pending init is the
  zero-argument function that creates them at random (`init_sharded` with `init_key()`),
  which `materialize` runs when a value is needed (the trainer warm-starts or bootstraps it).
  """
  dtype = DTYPES[block.dtype]
  if block.checkpoint:
    shardings = lambda cfg: param_shardings(cfg, mesh, dtype)
    return (*hf.load_checkpoint(block.checkpoint, dtype, shardings=shardings), None)
  cfg = arch_config(block.arch, vocab_size)
  return cfg, abstract_params(cfg, mesh, dtype), lambda: init_sharded(cfg, mesh, init_key(), dtype)


def tokenizer_path(spec: RunSpec) -> str:
  """The run's tokenizer: `spec.tokenizer`, or when that is "" the student checkpoint's
  directory, or "char" for a built-in student (`tokenizer.resolve_name`)."""
  return tokenizer.resolve_name(spec.tokenizer, spec.student.checkpoint)


def checkpoint_config(directory: str, who: str) -> ModelConfig:
  """The ModelConfig of an HF checkpoint directory from its config.json alone, after checking
  that its weight files are there (without opening them)."""
  try:
    cfg = hf.load_config(directory)
  except (ValueError, FileNotFoundError) as e:
    raise type(e)(f"{who} checkpoint: {e}") from e
  names = (hf.SINGLE_FILE, hf.INDEX_FILE)
  if not any(os.path.isfile(os.path.join(directory, n)) for n in names):
    raise FileNotFoundError(
      f"{who} checkpoint {directory!r} has a {hf.CONFIG_FILE} but no weights ({' or '.join(names)})"
    )
  return cfg


@dataclasses.dataclass
class Plan:
  """What the run's models will be, known before any weights load (`plan_models`)."""

  mesh: jax.sharding.Mesh
  tokenizer: object
  tokenizer_path: str  # "char" or the tokenizer's directory
  student_cfg: ModelConfig
  teacher_cfg: ModelConfig
  vocab_note: str = ""  # what the vocabulary check compared (runs with a checkpoint), logged


def with_real_vocab(cfg: ModelConfig, real_vocab_size: int) -> ModelConfig:
  """`cfg` whose logits cover ids [0, real_vocab_size): `logical_vocab_size` set when the
  embedding table has more rows (padding), 0 when the table is exactly that size."""
  logical = 0 if real_vocab_size == cfg.vocab_size else real_vocab_size
  return dataclasses.replace(cfg, logical_vocab_size=logical)


def _load_run_tokenizer(path: str, loaded: dict):
  """The run's tokenizer; when it cannot load and the two checkpoints' tables differ in size,
  the error says so, since only a tokenizer can tell padding from another vocabulary."""
  try:
    return tokenizer.load_tokenizer(path)
  except (ValueError, FileNotFoundError) as e:
    rows = {who: cfg.vocab_size for who, cfg in loaded.items()}
    if len(rows) == 2 and rows["student"] != rows["teacher"]:
      raise ValueError(
        f"student and teacher vocabularies differ: student vocab_size={rows['student']}, "
        f"teacher vocab_size={rows['teacher']}; one tokenizer over padded tables is accepted, "
        f"but the run's tokenizer does not load: {e}"
      ) from e
    raise


def _teacher_tokenizer(spec: RunSpec, run_tokenizer_path: str):
  """The teacher checkpoint's own tokenizer when its directory holds one other than the run's
  tokenizer directory; else None."""
  directory = spec.teacher.checkpoint
  if not directory or os.path.abspath(directory) == os.path.abspath(run_tokenizer_path):
    return None
  if not any(os.path.isfile(os.path.join(directory, n)) for n in tokenizer.TOKENIZER_MAIN_FILES):
    return None
  return tokenizer.load_tokenizer(directory)


def plan_models(spec: RunSpec) -> Plan:
  """Mesh, tokenizer and both ModelConfigs from config.json and tokenizer files only.

  Checks, in order: the mesh fits the devices; each checkpoint's config.json (a supported
  architecture) and that its weight files exist; the tokenizer loads; a teacher checkpoint's
  own tokenizer, if it has one, is identical to the run's (every token's id, the size, the
  bos/eos/pad ids); the tokenizer's V_real ids, special ids included, fit both tables
  (`tokenizer.check_vocabularies`), which may differ in size (padding). Both
  ModelConfigs come back with `logical_vocab_size` set to V_real where their table is padded.

  Raises:
    ValueError / FileNotFoundError: naming the setting or file at fault.
  """
  mesh = build_mesh(spec)
  loaded = {
    who: checkpoint_config(getattr(spec, who).checkpoint, who)
    for who in ("student", "teacher")
    if getattr(spec, who).checkpoint
  }
  path = tokenizer_path(spec)
  tok = _load_run_tokenizer(path, loaded)
  student_cfg = loaded.get("student") or arch_config(spec.student.arch, tok.vocab_size)
  teacher_cfg = loaded.get("teacher") or arch_config(spec.teacher.arch, tok.vocab_size)
  teacher_tok = _teacher_tokenizer(spec, path)
  vocab = tokenizer.check_vocabularies(
    student_cfg.vocab_size,
    teacher_cfg.vocab_size,
    tok,
    teacher_tok,
    tokenizer_name=repr(path),
    teacher_tokenizer_name=repr(spec.teacher.checkpoint),
  )
  student_cfg = with_real_vocab(student_cfg, vocab.real_vocab_size)
  teacher_cfg = with_real_vocab(teacher_cfg, vocab.real_vocab_size)
  note = vocab.compared if loaded else ""
  return Plan(mesh, tok, path, student_cfg, teacher_cfg, note)


@dataclasses.dataclass
class Models:
  """Everything the run needs about its two models."""

  mesh: jax.sharding.Mesh
  tokenizer: object
  student_cfg: ModelConfig
  student_params: dict  # concrete, or abstract until `materialize` (a built-in model)
  teacher_cfg: ModelConfig
  teacher_params: dict  # concrete, or abstract until `materialize` (a built-in model)
  pending: dict = dataclasses.field(default_factory=dict)  # who -> deferred random init


def materialize(models: Models, who: str):
  """`models`' concrete `who` ("student" or "teacher") params: a deferred random init runs
  now, once, and its result replaces the abstract params in `models`."""
  if who not in ("student", "teacher"):
    raise ValueError(f"who must be 'student' or 'teacher', got {who!r}")
  init = models.pending.pop(who, None)
  if init is not None:
    setattr(models, f"{who}_params", init())
  return getattr(models, f"{who}_params")


def build_models(spec: RunSpec, plan: Plan | None = None) -> Models:
  """Mesh, tokenizer, student and teacher of `plan` (default `plan_models(spec)`, which
  refuses mismatched vocabularies before any weights load)."""
  plan = plan or plan_models(spec)
  mesh, tok = plan.mesh, plan.tokenizer

  def init_key(index: int) -> Callable:  # split(key(seed))[index], derived only if used
    return lambda: jax.random.split(jax.random.key(spec.seed))[index]

  student_cfg, student, init_s = load_or_init(spec.student, tok.vocab_size, mesh, init_key(0))
  teacher_cfg, teacher, init_t = load_or_init(spec.teacher, tok.vocab_size, mesh, init_key(1))
  pending = {who: f for who, f in (("student", init_s), ("teacher", init_t)) if f is not None}
  # The plan's V_real (padded tables): the weights keep every row, the logits do not.
  student_cfg = with_real_vocab(student_cfg, plan.student_cfg.real_vocab_size)
  teacher_cfg = with_real_vocab(teacher_cfg, plan.teacher_cfg.real_vocab_size)
  return Models(mesh, tok, student_cfg, student, teacher_cfg, teacher, pending)


def summary(models: Models) -> str:
  """Human-readable parameter counts, bytes and shardings of both models."""
  mesh = models.mesh
  lines = [f"mesh {dict(mesh.shape)} over {mesh.devices.size} {jax.default_backend()} device(s)"]
  for name, cfg, params in (
    ("student", models.student_cfg, models.student_params),
    ("teacher", models.teacher_cfg, models.teacher_params),
  ):
    lines.append(
      f"{name}: {cfg.model_type} L={cfg.num_layers} D={cfg.hidden_size} N={cfg.num_heads} "
      f"K={cfg.num_kv_heads} H={cfg.head_dim} F={cfg.intermediate_size} V={cfg.vocab_size}"
      + (f" (logits over the first {cfg.real_vocab_size})" if cfg.logical_vocab_size else "")
    )
    lines.append(sharding_checks.describe(params))
  return "\n".join(lines)
