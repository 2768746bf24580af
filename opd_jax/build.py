"""Builds the run's mesh, tokenizer, student and teacher from a validated config.

Models come from local Hugging Face checkpoints (`hf.load_checkpoint`, each tensor
placed straight onto its sharding) or, for the built-in task, from the architecture
in the config, initialised directly into their shardings with
`jit(init, out_shardings=tree_shardings(eval_shape(init)))`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from opd_jax import hf, model, sharding, tokenizer
from opd_jax.model_config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The (data, fsdp, tensor) mesh over all devices."""
  return sharding.make_mesh((config.mesh.data, config.mesh.fsdp, config.mesh.tensor))


def arch_config(arch: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
  """ModelConfig of a built-in architecture from its config block."""
  return ModelConfig(
    model_type=arch.model_type,
    vocab_size=vocab_size,
    hidden_size=arch.hidden_size,
    intermediate_size=arch.intermediate_size,
    num_layers=arch.num_layers,
    num_heads=arch.num_heads,
    num_kv_heads=arch.num_kv_heads,
    head_dim=arch.head_dim,
    tie_word_embeddings=arch.tie_word_embeddings,
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


def load_or_init(block: ml_collections.ConfigDict, vocab_size: int, mesh, rng):
  """(ModelConfig, params) for a student/teacher config block.

  A non-empty `block.checkpoint` loads that HF directory; otherwise the built-in
  architecture is initialised at random (the trainer then warm-starts or
  bootstraps it on the built-in task).
  """
  dtype = DTYPES[block.dtype]
  if block.checkpoint:
    shardings = lambda cfg: param_shardings(cfg, mesh, dtype)
    return hf.load_checkpoint(block.checkpoint, dtype, shardings=shardings)
  cfg = arch_config(block.arch, vocab_size)
  return cfg, init_sharded(cfg, mesh, rng, dtype)


@dataclasses.dataclass
class Models:
  """Everything the run needs about its two models."""

  mesh: jax.sharding.Mesh
  tokenizer: object
  student_cfg: ModelConfig
  student_params: dict
  teacher_cfg: ModelConfig
  teacher_params: dict


def build_models(config: ml_collections.ConfigDict) -> Models:
  """Mesh, tokenizer, student and teacher; refuses mismatched vocabularies."""
  mesh = build_mesh(config)
  tok = tokenizer.load_tokenizer(config.tokenizer)
  rng_s, rng_t = jax.random.split(jax.random.key(config.seed))
  student_cfg, student = load_or_init(config.student, tok.vocab_size, mesh, rng_s)
  teacher_cfg, teacher = load_or_init(config.teacher, tok.vocab_size, mesh, rng_t)
  tokenizer.check_same_vocab(student_cfg.vocab_size, teacher_cfg.vocab_size)
  if student_cfg.vocab_size < tok.vocab_size:
    raise ValueError(
      f"tokenizer has {tok.vocab_size} tokens but the models' vocabulary is "
      f"{student_cfg.vocab_size}"
    )
  return Models(mesh, tok, student_cfg, student, teacher_cfg, teacher)


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
    )
    lines.append(sharding.describe(params))
  return "\n".join(lines)
