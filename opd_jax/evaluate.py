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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from opd_jax import losses, sampler, task, train_step
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


def greedy_rollout(params, cfg: ModelConfig, eval_set: EvalSet, max_new_tokens: int, eos_id: int):
  """Greedy completions of every held-out prompt (a `Rollout`)."""
  scfg = sampler.SamplerConfig(
    max_new_tokens=max_new_tokens, temperature=0.0, stop_tokens=(eos_id,)
  )
  return sampler.sample(params, (eval_set.tokens_bp, eval_set.lens_b), jax.random.key(0), scfg, cfg)


def accuracy(rollout, eval_set: EvalSet, tokenizer) -> tuple[float, list[str]]:
  """Exact-match accuracy of a rollout's completions, and the decoded texts."""
  tokens = np.asarray(rollout.completion_tokens)
  mask = np.asarray(rollout.completion_mask)
  texts = [tokenizer.decode(row[m > 0].tolist()) for row, m in zip(tokens, mask, strict=True)]
  hits = [task.score(p, t) for p, t in zip(eval_set.prompts, texts, strict=True)]
  return float(np.mean(hits)), texts


@jax.jit
def _masked_kl(student_bcv, teacher_bcv, mask_bc):
  return losses.masked_mean(losses.per_token_kl(student_bcv, teacher_bcv), mask_bc)


@functools.partial(jax.jit, static_argnames="sampling")
def _masked_kl_transformed(student_bcv, teacher_bcv, mask_bc, sampling):
  b, c, v = student_bcv.shape
  z_bcv = sampler.process_logits(student_bcv.reshape(b * c, v), sampling).reshape(b, c, v)
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
  s_bcv, _, mask_bc = _logits(student_params, rollout, student_cfg)
  t_bcv, _, _ = _logits(teacher_params, rollout, teacher_cfg)
  if sampling is None or sampling.temperature == 0:
    return float(_masked_kl(s_bcv, t_bcv, mask_bc))
  return float(_masked_kl_transformed(s_bcv, t_bcv, mask_bc, sampling))


_logits = jax.jit(train_step.completion_logits, static_argnums=(2, 3))


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
  rollout = greedy_rollout(student_params, student_cfg, eval_set, max_new_tokens, tokenizer.eos_id)
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
      teacher_params, teacher_cfg, eval_set, max_new_tokens, tokenizer.eos_id
    )
    teacher_accuracy, _ = accuracy(t_rollout, eval_set, tokenizer)
  metrics["quality/teacher_accuracy"] = teacher_accuracy
  metrics["quality/relative_accuracy"] = acc / max(teacher_accuracy, 1e-9)
  samples = [f"{p}{t}" for p, t in zip(eval_set.prompts[:4], texts[:4], strict=True)]
  return metrics, samples
