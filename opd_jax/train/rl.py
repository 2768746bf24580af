"""The RL baseline: REINFORCE on the task's exact-match reward (`train.loss="reinforce"`).

The on-policy distillation losses learn from a dense per-token teacher signal; this loss
learns from one sparse scalar per sequence, the task's verdict on the decoded completion
(`task.score`), so the two can be run under the same rollout mismatch and compared.

With B sequences in the batch, y_b the b-th sampled completion, r_b ∈ {0, 1} its reward,
m_bt its completion mask and sg the stop-gradient:

    A_b   = r_b − (Σ_{j≠b} r_j) / (B − 1)                       leave-one-out baseline
    ρ_bt  = sg(min(exp(log π_θ(y_bt) − log π_b(y_bt)), C))      truncated IS ratio, or 1
    loss  = −Σ_bt m_bt · ρ_bt · A_b · log π_θ(y_bt) / Σ_bt m_bt  token-level mean

    ∇loss = −Σ_bt m_bt ρ_bt A_b ∇log π_θ(y_bt) / Σ_bt m_bt

Without importance correction (`is_clip=None`) ρ = 1: the behaviour policy's tokens are
trained as if the trainer had sampled them. With it, each token is reweighted by the
truncated ratio against the rollout's `behaviour_logprobs` (truncated IS, as in IMPALA's
V-trace and the TIS fix for FP8/vLLM rollouts); ρ = 1 exactly when the engine equals the
trainer.

The baseline. Prompts are not repeated in a batch (the data pipeline draws B distinct
prompts), so a GRPO group mean would need the pipeline to duplicate prompts; the
leave-one-out batch mean needs nothing new. It does not depend on y_b, so the gradient
stays unbiased, and on this task every prompt has the same shape (three two-digit
operands), so prompt difficulty varies little and a batch baseline removes most of
what a per-prompt one would. The loss is normalised per token (every counted token of
the batch weighs the same), the aggregation the distillation losses use.

The reward is computed on the host from the decoded texts (`rollout_rewards`) by the
rollout engine, which holds the tokenizer, and travels in `Rollout.reward_b`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.train import losses

LOSS_NAME = "reinforce"


def needs_reward(loss_name: str) -> bool:
  """Whether the loss `loss_name` reads `Rollout.reward_b` (the engine must fill it)."""
  return loss_name == LOSS_NAME


def leave_one_out_baseline(reward_b):
  """b_i = (Σ_j r_j − r_i) / (B − 1): the mean reward of the other sequences; f32 [B].

  Raises:
    ValueError: fewer than two sequences (there are no others to average).
  """
  if reward_b.ndim != 1 or reward_b.shape[0] < 2:
    raise ValueError(f"the leave-one-out baseline needs a [B] reward, B >= 2; got {reward_b.shape}")
  reward_b = reward_b.astype(jnp.float32)
  return (jnp.sum(reward_b) - reward_b) / (reward_b.shape[0] - 1)


def truncated_is_ratio(student_lp_bt, behaviour_lp_bt, mask_bt, is_clip: float | None):
  """ρ_bt = min(exp(sg(log π_θ) − log π_b), C), or 1 when `is_clip` is None; and the clip flags.

  Masked positions read ratio 1 (their behaviour log-prob is zeroed before the exp so no
  NaN can reach the gradient).

  Returns:
    (ratio_bt f32, clipped_bt f32: 1 where the raw ratio exceeded C).

  Raises:
    ValueError: `is_clip` not None and not > 0.
  """
  if is_clip is None:
    return jnp.ones_like(student_lp_bt), jnp.zeros_like(student_lp_bt)
  if not is_clip > 0:
    raise ValueError(f"is_clip must be None or > 0, got {is_clip!r}")
  counted = mask_bt > 0
  behaviour = jnp.where(counted, behaviour_lp_bt.astype(jnp.float32), 0.0)
  student = jnp.where(counted, jax.lax.stop_gradient(student_lp_bt), 0.0)
  raw = jnp.exp(student - behaviour)
  return jnp.minimum(raw, is_clip), (raw > is_clip).astype(jnp.float32)


def reinforce(student_logits, tokens, mask, reward_b, behaviour_logprobs, is_clip=None):
  """REINFORCE with a leave-one-out baseline and optional truncated IS (module docstring).

  Args:
    student_logits: [B, T, V] π_θ's logits at the sampler's temperature and filter
      (`train_step.student_policy_logits`).
    tokens: int [B, T] sampled completion tokens.
    mask: [B, T] completion mask.
    reward_b: [B] sequence rewards (`Rollout.reward_b`); None raises.
    behaviour_logprobs: [B, T] log π_b(y_t) of the sampled tokens.
    is_clip: truncation C > 0 of the importance ratio, or None for ratio 1.

  Returns:
    (loss f32 scalar, metrics): loss/reinforce, rl/reward_mean, rl/advantage_abs_mean,
    loss/student_logprob, loss/is_ratio, loss/is_clip_frac, loss/num_tokens and
    per_token/advantage_bc (A_b on the counted tokens, 0 elsewhere).

  Raises:
    ValueError: missing reward, or shapes that disagree.
  """
  if reward_b is None:
    raise ValueError(
      "loss 'reinforce' needs Rollout.reward_b: the rollout engine fills it when built with "
      "score_rewards=True (the trainer does this for train.loss='reinforce')"
    )
  if student_logits.ndim != 3 or student_logits.shape[:2] != mask.shape:
    raise ValueError(
      f"student logits {student_logits.shape} must be [B, T, V] over mask {mask.shape}"
    )
  if tokens.shape != mask.shape or behaviour_logprobs.shape != mask.shape:
    raise ValueError(
      f"tokens {tokens.shape}, behaviour_logprobs {behaviour_logprobs.shape} and mask "
      f"{mask.shape} must all be [B, T]"
    )
  if reward_b.shape != mask.shape[:1]:
    raise ValueError(f"reward {reward_b.shape} must be [B] with B = {mask.shape[0]}")
  reward_b = reward_b.astype(jnp.float32)
  advantage_b = reward_b - leave_one_out_baseline(reward_b)
  student_lp = losses.token_logprobs(student_logits, tokens)
  student_lp = jnp.where(mask > 0, student_lp, 0.0)  # padding may sit outside the kept set
  ratio, clipped = truncated_is_ratio(student_lp, behaviour_logprobs, mask, is_clip)
  advantage_bt = jnp.broadcast_to(advantage_b[:, None], mask.shape)
  loss = -losses.masked_mean(ratio * advantage_bt * student_lp, mask)
  counted = (mask > 0).astype(jnp.float32)
  metrics = {
    "loss/reinforce": loss,
    "rl/reward_mean": jnp.mean(reward_b),
    "rl/advantage_abs_mean": jnp.mean(jnp.abs(advantage_b)),
    "loss/student_logprob": losses.masked_mean(jax.lax.stop_gradient(student_lp), mask),
    "loss/is_ratio": losses.masked_mean(ratio, mask),
    "loss/is_clip_frac": losses.masked_mean(clipped, mask),
    "loss/num_tokens": jnp.sum(counted),
    "per_token/advantage_bc": advantage_bt * counted,
  }
  return loss, metrics
