"""Held-out quality: exact-match accuracy and per-token KL to the teacher.

Quality is measured on greedy decodes of held-out prompts, so it is deterministic
for given weights:

    quality/<who>_accuracy   = mean_b 1[score(prompt_b, decode(y_b))]
    quality/student_teacher_kl = mean over completion tokens of KL(π_θ ‖ π_T) at the
                                 prefixes the student's greedy decode visits, with
                                 the student at T = 1 (the model itself).
    quality/student_teacher_kl_at_rollout_t = the same KL with π_θ under the training
                                 rollouts' transform (temperature T, top-k, top-p, as
                                 `sampler.process_logits` applies them to the
                                 student's own logits): the quantity the OPD loss
                                 trains. Reported when `evaluate` gets the training
                                 `SamplerConfig`; equal to the T = 1 value for greedy
                                 training rollouts, whose losses score T = 1.

The teacher is always at T = 1, unfiltered.

On a mesh (the params' own, `sharding.params_mesh`), the evaluation is sharded like the
training rollouts: every process holds the held-out token ids, each data·fsdp shard
decodes only its rows (`sampler.sample(..., mesh=)`), the teacher-forced forwards keep
the batch split (`completion_logits`), and each process decodes and scores only the
texts of the rows its devices hold; the hit counts are summed across shards on device.
Padding rows (the held-out set rounded up to a multiple of data·fsdp) have mask 0 and
are not counted.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax import losses, sampler, sharding, task, train_step
from opd_jax.model_config import ModelConfig


@dataclasses.dataclass
class EvalSet:
  """Held-out prompts, encoded once."""

  prompts: list[str]
  tokens_bp: np.ndarray
  lens_b: np.ndarray


def make_eval_set(source, tokenizer, prompt_len: int) -> EvalSet:
  """Encodes every prompt of a random-access `source` of {"prompt": ...} dicts."""
  prompts = [source[i]["prompt"] for i in range(len(source))]
  tokens_bp, lens_b = task.encode_prompts(prompts, tokenizer, prompt_len)
  return EvalSet(prompts, tokens_bp, lens_b)


def greedy_rollout(
  params, cfg: ModelConfig, eval_set: EvalSet, max_new_tokens: int, eos_id: int, mesh=None
):
  """Greedy completions of every held-out prompt (a `Rollout`; batch-split on `mesh`)."""
  scfg = sampler.SamplerConfig(
    max_new_tokens=max_new_tokens, temperature=0.0, stop_tokens=(eos_id,)
  )
  prompts = (eval_set.tokens_bp, eval_set.lens_b)
  return sampler.sample(params, prompts, jax.random.key(0), scfg, cfg, mesh=mesh)


def accuracy(rollout, eval_set: EvalSet, tokenizer) -> tuple[float, list[str]]:
  """Exact-match accuracy of a rollout's completions, and the decoded texts.

  Rows beyond the held-out set (a sharded rollout's padding) are not counted. Each
  process decodes and scores only the rows its devices hold, and the hits are summed on
  device, so every row counts once; texts of rows held by other processes are "".
  """
  n = len(eval_set.prompts)
  texts = [""] * n

  def hits(start, tokens_bc, mask_bc):
    out = np.zeros(len(tokens_bc), np.float32)
    for i, (row, m) in enumerate(zip(tokens_bc, mask_bc, strict=True), start):
      if i < n:
        texts[i] = tokenizer.decode(row[m > 0].tolist())
        out[i - start] = task.score(eval_set.prompts[i], texts[i])
    return out

  hits_b = sharding.map_local_rows(hits, rollout.completion_tokens, rollout.completion_mask)
  return float(jnp.sum(hits_b)) / n, texts


@jax.jit
def _masked_kl(student_bcv, teacher_bcv, mask_bc):
  return losses.masked_mean(losses.per_token_kl(student_bcv, teacher_bcv), mask_bc)


@functools.partial(jax.jit, static_argnames=("sampling", "mesh"))
def _masked_kl_transformed(student_bcv, teacher_bcv, mask_bc, sampling, mesh=None):
  b, c, v = student_bcv.shape
  z_bv = sampler.process_logits(student_bcv.reshape(b * c, v), sampling, mesh)
  z_bcv = z_bv.reshape(b, c, v)
  return losses.masked_mean(losses.per_token_kl(z_bcv, teacher_bcv), mask_bc)


def student_teacher_kl(
  student_params, student_cfg, teacher_params, teacher_cfg, rollout, sampling=None
) -> float:
  """Mean per-token KL(π_θ ‖ π_T) over the rollout's completion tokens.

  Args:
    student_params, student_cfg, teacher_params, teacher_cfg: the two models.
    rollout: the completions whose prefixes are scored.
    sampling: None scores the student at T = 1; a `sampler.SamplerConfig` with
      temperature > 0 scores π_θ = softmax(process_logits(logits, sampling)) instead
      (its temperature, top-k and top-p on the student's own logits).

  Returns:
    The mean KL as a float.
  """
  mesh = sharding.params_mesh(student_params)
  s_bcv, mask_bc = completion_logits(student_params, rollout, student_cfg, mesh)
  t_bcv, _ = completion_logits(teacher_params, rollout, teacher_cfg, mesh)
  if sampling is None or sampling.temperature == 0:
    return float(_masked_kl(s_bcv, t_bcv, mask_bc))
  return float(_masked_kl_transformed(s_bcv, t_bcv, mask_bc, sampling, mesh))


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def completion_logits(params, rollout, cfg: ModelConfig, mesh=None):
  """Teacher-forced logits at the rollout's completion positions (T = 1): (f32 [B, C, V],
  mask [B, C]), `train_step.completion_logits`.

  With a `mesh` the batch stays split over data·fsdp: the weights are gathered over fsdp
  (`sharding.DECODE_RULES`), the logits are laid out [B over data·fsdp, C, V over
  tensor], so the program never gathers the batch.
  """
  if mesh is not None:
    params = jax.lax.with_sharding_constraint(
      params, sharding.tree_shardings(params, mesh, sharding.DECODE_RULES)
    )
    rollout = jax.tree.map(
      lambda x: (
        jax.lax.with_sharding_constraint(x, sharding.batch_sharding(mesh, x.ndim)) if x.ndim else x
      ),
      rollout,
    )
  logits_bcv, _, mask_bc = train_step.completion_logits(params, rollout, cfg)
  if mesh is not None:
    logits_bcv = jax.lax.with_sharding_constraint(
      logits_bcv, sharding.logical_sharding(mesh, "btv", logits_bcv.shape)
    )
  return logits_bcv, mask_bc


def evaluate(
  student_params,
  student_cfg,
  teacher_params,
  teacher_cfg,
  eval_set,
  tokenizer,
  max_new_tokens: int,
  teacher_accuracy: float | None = None,
  train_sampling: sampler.SamplerConfig | None = None,
):
  """quality/* metrics of the student (and the teacher's accuracy when not given).

  `train_sampling`, the training rollouts' `SamplerConfig`, adds
  `quality/student_teacher_kl_at_rollout_t` (see the module docstring).

  Returns:
    (metrics dict, a few decoded student samples for the text log).
  """
  mesh = sharding.params_mesh(student_params)
  rollout = greedy_rollout(
    student_params, student_cfg, eval_set, max_new_tokens, tokenizer.eos_id, mesh
  )
  acc, texts = accuracy(rollout, eval_set, tokenizer)
  metrics = {
    "quality/student_accuracy": acc,
    "quality/student_teacher_kl": student_teacher_kl(
      student_params, student_cfg, teacher_params, teacher_cfg, rollout
    ),
  }
  if train_sampling is not None:
    metrics["quality/student_teacher_kl_at_rollout_t"] = student_teacher_kl(
      student_params, student_cfg, teacher_params, teacher_cfg, rollout, train_sampling
    )
  if teacher_accuracy is None:
    t_rollout = greedy_rollout(
      teacher_params, teacher_cfg, eval_set, max_new_tokens, tokenizer.eos_id, mesh
    )
    teacher_accuracy, _ = accuracy(t_rollout, eval_set, tokenizer)
  metrics["quality/teacher_accuracy"] = teacher_accuracy
  metrics["quality/relative_accuracy"] = acc / max(teacher_accuracy, 1e-9)
  samples = [f"{p}{t}" for p, t in zip(eval_set.prompts[:4], texts[:4], strict=True)]
  return metrics, samples
