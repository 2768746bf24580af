"""The RL baselines' estimators on the task's reward: REINFORCE (`train.loss="reinforce"`) and
GRPO (`train.loss="grpo"`), on arrays.

The distillation losses learn from a dense per-token teacher signal; these learn from one
scalar per sequence, the task's verdict on the decoded completion (`Rollout.reward_b`, scored by
the rollout engine with `data.rewards`), so the two can be compared under the same rollout
mismatch. Notation: y_bt the sampled token of row b at position t, m_bt the completion mask, r_b
the reward, π_θ the student, π_b the engine that sampled, π_old the student at the start of a
GRPO step, π_ref the student at step 0, sg the stop-gradient. Each estimator's equation is in its
function's docstring (`reinforce`, `group_advantages` and its per-step form
`step_group_advantages`, `mismatch_weights`, `ppo_clip_loss`,
`grpo` and its form on log-probs `grpo_from_logprobs`, `k3_kl_to_reference`);
docs/rl_baseline.md derives them and lists the config keys. The loss of a rollout and GRPO's
K updates per batch are in `train.rl_step`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.train import losses

LOSS_NAME = "reinforce"
GRPO = "grpo"
RL_LOSSES = (LOSS_NAME, GRPO)  # the losses that read Rollout.reward_b and no teacher
MISMATCH_CORRECTIONS = ("none", "tis", "mis", "seq_tis", "seq_mis")
STD_EPS = 1e-6  # ε of the group-std normalisation


def needs_reward(loss_name: str) -> bool:
  """Whether the loss `loss_name` reads `Rollout.reward_b` (the engine must fill it)."""
  return loss_name in RL_LOSSES


def leave_one_out_baseline(reward_b):
  """b_i = (Σ_j r_j − r_i) / (B − 1): the mean reward of the other sequences; f32 [B].

  Raises:
    ValueError: fewer than two sequences (there are no others to average).
  """
  if reward_b.ndim != 1 or reward_b.shape[0] < 2:
    raise ValueError(f"the leave-one-out baseline needs a [B] reward, B >= 2; got {reward_b.shape}")
  reward_b = reward_b.astype(jnp.float32)
  return (jnp.sum(reward_b) - reward_b) / (reward_b.shape[0] - 1)


def _check_token_shapes(student_logits, tokens, behaviour_logprobs, mask) -> None:
  """ValueError unless the logits are [B, T, V] and the tokens, behaviour log-probs and mask
  are all [B, T] (both RL losses take these four)."""
  if student_logits.ndim != 3 or student_logits.shape[:2] != mask.shape:
    raise ValueError(
      f"student logits {student_logits.shape} must be [B, T, V] over mask {mask.shape}"
    )
  if tokens.shape != mask.shape or behaviour_logprobs.shape != mask.shape:
    raise ValueError(
      f"tokens {tokens.shape}, behaviour_logprobs {behaviour_logprobs.shape} and mask "
      f"{mask.shape} must all be [B, T]"
    )


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
  """REINFORCE with a leave-one-out baseline and optional truncated IS:

      A_b  = r_b − (Σ_{j≠b} r_j) / (B − 1)                      leave-one-out baseline
      ρ_bt = sg(min(exp(log π_θ(y_bt) − log π_b(y_bt)), C))     truncated IS ratio, or 1
      loss = −Σ_bt m_bt · ρ_bt · A_b · log π_θ(y_bt) / Σ_bt m_bt

  The baseline does not depend on y_b, so the gradient stays unbiased; ρ = 1 exactly when the
  engine equals the trainer.

  Args:
    student_logits: [B, T, V] π_θ's logits at the sampler's temperature and filter
      (`policy.student_policy_logits`).
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
  _check_token_shapes(student_logits, tokens, behaviour_logprobs, mask)
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


def check_grpo_settings(
  group_size: int,
  clip_eps: float,
  epochs: int,
  minibatches: int,
  correction: str,
  correction_clip: float,
  kl_coef: float = 0.0,
) -> None:
  """Raises ValueError naming the first bad GRPO setting (G, ε, epochs, minibatches, the
  correction and its C, β)."""
  check_kl_coef(kl_coef, GRPO)
  if not isinstance(group_size, int) or group_size < 2:
    raise ValueError(
      f"grpo needs groups of at least 2 completions per prompt (rollout.samples_per_prompt), "
      f"got {group_size!r}: with one, every advantage r − mean(r) is 0"
    )
  if not 0 < clip_eps < 1:
    raise ValueError(f"the PPO clip ε (train.ppo_clip) must be in (0, 1), got {clip_eps!r}")
  for name, value in (("ppo_epochs", epochs), ("ppo_minibatches", minibatches)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"train.{name} must be an int >= 1, got {value!r}")
  check_correction(correction, correction_clip)


def check_kl_coef(kl_coef: float, loss_name: str) -> None:
  """Raises ValueError unless β = `kl_coef` is a finite number >= 0, and 0 for every loss but
  grpo (the only loss with a KL penalty to the initial student)."""
  if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)):
    raise ValueError(f"train.kl_coef must be a number >= 0, got {kl_coef!r}")
  if not 0 <= kl_coef < float("inf"):
    raise ValueError(f"train.kl_coef must be a finite number >= 0, got {kl_coef!r}")
  if kl_coef > 0 and loss_name != GRPO:
    raise ValueError(
      f"train.kl_coef={kl_coef!r} is GRPO's KL penalty to the initial student; loss "
      f"{loss_name!r} has none: use train.loss='grpo' or train.kl_coef=0"
    )


def k3_kl_to_reference(student_lp_bt, reference_lp_bt, mask_bt):
  """The k3 estimator of KL(π_θ ‖ π_ref) at the sampled tokens (GRPO's KL penalty, β > 0):

      d_bt = log π_ref(y_bt) − log π_θ(y_bt),   k3_bt = exp(d_bt) − d_bt − 1
      loss = loss_grpo + β · Σ_bt m_bt k3_bt / max(Σ_bt m_bt, 1)

  The penalty is a mean over every completion token (m, not the correction's keep), without
  the PPO clip or a mismatch weight. The tokens come from the engine, not from π_θ, so it is
  the usual biased surrogate of ∇KL (DeepSeekMath, TRL, verl's `low_var_kl`).

  computed as expm1(d) − d (exact near d = 0). `reference_lp_bt` carries no gradient;
  `student_lp_bt` does. Positions outside the mask read d = 0, so k3 = 0 there and padding
  (possibly -inf under a kept-set filter) never reaches the exp.

  Args:
    student_lp_bt: [B, T] log π_θ(y_bt).
    reference_lp_bt: [B, T] log π_ref(y_bt).
    mask_bt: [B, T] completion mask.

  Returns:
    (mean f32 []: Σ m k3 / max(Σ m, 1), k3_bt f32 [B, T], 0 outside the mask).
  """
  if student_lp_bt.shape != mask_bt.shape or reference_lp_bt.shape != mask_bt.shape:
    raise ValueError(
      f"student {student_lp_bt.shape} and reference {reference_lp_bt.shape} log-probs must be "
      f"[B, T] = {mask_bt.shape}"
    )
  counted = mask_bt > 0
  reference = jnp.where(counted, jax.lax.stop_gradient(reference_lp_bt).astype(jnp.float32), 0.0)
  student = jnp.where(counted, student_lp_bt.astype(jnp.float32), 0.0)
  d_bt = reference - student
  k3_bt = jnp.where(counted, jnp.expm1(d_bt) - d_bt, 0.0)
  return losses.masked_mean(k3_bt, mask_bt), k3_bt


def check_correction(correction: str, clip: float) -> None:
  """Raises ValueError for an unknown mismatch correction or a threshold C <= 1."""
  if correction not in MISMATCH_CORRECTIONS:
    raise ValueError(
      f"train.mismatch_correction must be one of {', '.join(MISMATCH_CORRECTIONS)}, "
      f"got {correction!r}"
    )
  if not clip > 1:
    raise ValueError(
      f"train.mismatch_clip C must be > 1 (the band [1/C, C] must hold ratio 1), got {clip!r}"
    )


def group_advantages(reward_b, group_size: int, std_normalize: bool):
  """A_b = r_b − mean_{g(b)} r, ÷ (std_{g(b)} r + 1e-6) when `std_normalize`; f32 [B].

  The groups are G = `group_size` adjacent rows (the rollout worker's layout of
  `rollout.samples_per_prompt`); std is the sample standard deviation (ddof 1), as in TRL's
  and verl's GRPO. A group whose rewards are all equal gets A = 0 exactly (not the rounding
  of its f32 mean divided by 1e-6).

  Raises:
    ValueError: a reward that is not [B], G < 2, or G not dividing B.
  """
  if reward_b.ndim != 1:
    raise ValueError(f"the group baseline needs a [B] reward, got {reward_b.shape}")
  b = reward_b.shape[0]
  if group_size < 2 or b % group_size:
    raise ValueError(f"groups of {group_size} rows must be >= 2 and divide the batch ({b} rows)")
  r_gn = reward_b.astype(jnp.float32).reshape(b // group_size, group_size)
  # A flat group is zeroed exactly: its f32 mean can miss the common value by one ulp (a
  # partial credit of 1/3), and dividing that by std + 1e-6 ≈ 1e-6 would push every row alike.
  flat_g1 = jnp.all(r_gn == r_gn[:, :1], axis=1, keepdims=True)
  centred_gn = jnp.where(flat_g1, 0.0, r_gn - jnp.mean(r_gn, axis=1, keepdims=True))
  if std_normalize:
    std_g1 = jnp.std(r_gn, axis=1, keepdims=True, ddof=1)
    centred_gn = centred_gn / (std_g1 + STD_EPS)
  return centred_gn.reshape(b)


def step_group_advantages(step_reward_bs, step_index_bt, group_size: int, std_normalize: bool):
  """Per-token GRPO advantages of the step reward (`data.rewards`, `train.reward="step"`):

      A_bi = (c_bi − mean_{j∈g(b)} c_ji) / (std_{j∈g(b)} c_ji + 1e-6)    per unit i (column)
      A_bt = A_{b, i(t)}                          i(t) = step_index_bt[b, t], the token's unit

  `group_advantages` on each column of c (so the same ddof-1 std, and A = 0 for a unit the
  whole group got equally right or wrong), gathered at each token's unit; f32 [B, T].

  Raises:
    ValueError: c not [B, S + 1] or the index not [B, T] with the same B; a bad group size.
  """
  if step_reward_bs.ndim != 2 or step_index_bt.ndim != 2:
    raise ValueError(
      f"step rewards {step_reward_bs.shape} must be [B, S + 1] and step indices "
      f"{step_index_bt.shape} [B, T]"
    )
  if step_reward_bs.shape[0] != step_index_bt.shape[0]:
    raise ValueError(f"step rewards {step_reward_bs.shape} and indices {step_index_bt.shape}")
  per_unit = jax.vmap(group_advantages, in_axes=(1, None, None), out_axes=1)
  advantage_bs = per_unit(step_reward_bs, group_size, std_normalize)
  index_bt = jnp.clip(step_index_bt.astype(jnp.int32), 0, step_reward_bs.shape[1] - 1)
  return jnp.take_along_axis(advantage_bs, index_bt, axis=1)


def mismatch_weights(old_lp_bt, behaviour_lp_bt, mask_bt, correction: str, clip: float):
  """The engine-mismatch correction w_bt and keep_bt of π_old against π_b (threshold C):

      none      w = 1,                      keep = 1
      tis       w = min(e^δ_bt, C),         keep = 1        token-level truncated IS
      mis       w = 1,                      keep = [1/C ≤ e^δ_bt ≤ C]   token-level masked IS
      seq_tis   w = min(e^Δ_b, C),          keep = 1        sequence-level truncated IS
      seq_mis   w = 1,                      keep = [1/C ≤ e^Δ_b ≤ C]    sequence-level masked IS

  δ_bt = log π_old − log π_b on counted tokens (0 elsewhere, so padding reads ratio 1);
  Δ_b = Σ_t δ_bt, the log of the product of the sequence's token ratios. Comparisons are
  made in log space (|δ| ≤ log C), so a long sequence's product cannot overflow. Both
  outputs carry no gradient.

  Args:
    old_lp_bt: [B, T] log π_old(y_bt).
    behaviour_lp_bt: [B, T] log π_b(y_bt) (`Rollout.behaviour_logprobs`).
    mask_bt: [B, T] completion mask.
    correction: none | tis | mis | seq_tis | seq_mis.
    clip: C > 1.

  Returns:
    (weight_bt f32, keep_bt f32 in {0, 1}): w (1 where masking applies) and the keep flag
    (1 for every token under none/tis/seq_tis); both 0 outside the mask.
  """
  check_correction(correction, clip)
  counted = mask_bt > 0
  m = counted.astype(jnp.float32)
  delta_bt = jnp.where(
    counted,
    jax.lax.stop_gradient(old_lp_bt).astype(jnp.float32) - behaviour_lp_bt.astype(jnp.float32),
    0.0,
  )
  log_c = jnp.log(jnp.float32(clip))
  ones = jnp.ones_like(delta_bt)
  if correction == "none":
    return m, m
  if correction == "tis":
    return jnp.exp(jnp.minimum(delta_bt, log_c)) * m, m
  if correction == "mis":
    return m, (jnp.abs(delta_bt) <= log_c).astype(jnp.float32) * m
  seq_b = jnp.sum(delta_bt, axis=1)
  if correction == "seq_tis":
    return jnp.exp(jnp.minimum(seq_b, log_c))[:, None] * m, m
  keep_b = (jnp.abs(seq_b) <= log_c).astype(jnp.float32)  # seq_mis
  return ones * m, keep_b[:, None] * m


def ppo_clip_loss(student_lp_bt, old_lp_bt, advantage_b, weight_bt, keep_bt, clip_eps: float):
  """−Σ k·w·min(r A, clip(r, 1 − ε, 1 + ε) A) / max(Σ k, 1), with r = exp(log π_θ − sg(log π_old)).

  Args:
    student_lp_bt: [B, T] log π_θ(y_bt) (differentiated).
    old_lp_bt: [B, T] log π_old(y_bt) (gradient stopped here).
    advantage_b: [B] A_b, broadcast over the tokens, or [B, T] A_bt (the step reward).
    weight_bt, keep_bt: the mismatch correction (`mismatch_weights`); keep_bt also carries
      the completion mask.
    clip_eps: ε.

  Returns:
    (loss f32 [], ratio_bt f32, clip_active_bt f32: 1 where the clipped term is the min and
    passes no gradient, i.e. A > 0 with r > 1 + ε or A < 0 with r < 1 − ε).
  """
  keep_bt = jax.lax.stop_gradient(keep_bt.astype(jnp.float32))
  weight_bt = jax.lax.stop_gradient(weight_bt.astype(jnp.float32))
  counted = keep_bt > 0
  # log-ratio 0 off the kept set, so padding (possibly -inf under a kept-set filter) cannot
  # reach the exp or the gradient
  log_ratio = jnp.where(
    counted, student_lp_bt.astype(jnp.float32) - jax.lax.stop_gradient(old_lp_bt), 0.0
  )
  ratio_bt = jnp.exp(log_ratio)
  advantage = jax.lax.stop_gradient(advantage_b)
  advantage = advantage if advantage.ndim == 2 else advantage[:, None]  # A_bt, or A_b broadcast
  adv_bt = jnp.broadcast_to(advantage, ratio_bt.shape)
  unclipped = ratio_bt * adv_bt
  clipped = jnp.clip(ratio_bt, 1.0 - clip_eps, 1.0 + clip_eps) * adv_bt
  surrogate_bt = jnp.minimum(unclipped, clipped)
  loss = -losses.masked_mean(weight_bt * surrogate_bt, keep_bt)
  active = ((adv_bt > 0) & (ratio_bt > 1 + clip_eps)) | ((adv_bt < 0) & (ratio_bt < 1 - clip_eps))
  return loss, ratio_bt, active.astype(jnp.float32)


def grpo(
  student_logits,
  tokens,
  mask,
  advantage_b,
  behaviour_logprobs,
  old_logprobs=None,
  *,
  clip_eps: float = 0.2,
  correction: str = "none",
  correction_clip: float = 2.0,
  reference_logprobs=None,
  kl_coef: float = 0.0,
):
  """GRPO's clipped surrogate with the engine-mismatch correction, plus β times the k3 KL to
  the initial student when β = `kl_coef` > 0 (`k3_kl_to_reference`):

      r_bt = π_θ(y_bt) / π_old(y_bt)                   the PPO ratio (1 at the first update)
      ℓ_bt = −w_bt · min(r_bt A_b, clip(r_bt, 1 − ε, 1 + ε) A_b)
      loss = Σ_bt k_bt ℓ_bt / max(Σ_bt k_bt, 1),   k_bt = m_bt · keep_bt

  with w_bt, keep_bt the correction (`mismatch_weights`). A masked token leaves both the
  numerator and the denominator.

  Args:
    student_logits: [B, T, V] π_θ's logits at the sampler's temperature and filter.
    tokens: int [B, T] sampled completion tokens.
    mask: [B, T] completion mask.
    advantage_b: [B] group advantages (`group_advantages`, over the whole batch), or [B, T]
      per-token ones (`step_group_advantages`: A_bt in place of A_b in ℓ_bt).
    behaviour_logprobs: [B, T] log π_b(y_t).
    old_logprobs: [B, T] log π_old(y_t) from the start of the batch's updates, or None for
      the first (and only) update: π_old = sg(π_θ), so the ratio is exactly 1.
    clip_eps: ε of the PPO clip.
    correction, correction_clip: the mismatch correction and its threshold C.
    reference_logprobs: [B, T] log π_ref(y_t) of the initial student (no gradient); needed
      when `kl_coef` > 0, else unused.
    kl_coef: β >= 0 of the KL penalty; 0 adds nothing (and logs no KL).

  Returns:
    (loss f32 [], metrics): loss/grpo (the clipped surrogate alone), with β > 0 loss/kl_ref
    (β · mean k3, the penalty's share of the loss) and rl/kl_ref (mean k3 over the completion
    tokens), loss/student_logprob, loss/num_tokens (counted tokens),
    rl/ppo_ratio_mean, rl/ppo_ratio_abs_dev_max (max |r − 1| over kept tokens),
    rl/ppo_clip_frac, rl/correction_weight_mean (over kept tokens), rl/correction_masked_frac
    (the counted tokens a masked correction drops), rl/correction_clip_frac (truncated
    tokens of tis/seq_tis).

  Raises:
    ValueError: shapes that disagree, a bad setting (`check_grpo_settings`), or β > 0
      without `reference_logprobs`.
  """
  _check_token_shapes(student_logits, tokens, behaviour_logprobs, mask)
  student_lp = losses.token_logprobs(student_logits, tokens)
  return grpo_from_logprobs(
    student_lp,
    mask,
    advantage_b,
    behaviour_logprobs,
    old_logprobs,
    clip_eps=clip_eps,
    correction=correction,
    correction_clip=correction_clip,
    reference_logprobs=reference_logprobs,
    kl_coef=kl_coef,
  )


def grpo_from_logprobs(
  student_lp_bt,
  mask,
  advantage_b,
  behaviour_logprobs,
  old_logprobs=None,
  *,
  clip_eps: float = 0.2,
  correction: str = "none",
  correction_clip: float = 2.0,
  reference_logprobs=None,
  kl_coef: float = 0.0,
):
  """`grpo` on the sampled tokens' log-probs log π_θ(y_bt) = `student_lp_bt` [B, T] (the
  differentiated input) instead of the logits; the same equation, arguments (but the logits
  and tokens), metrics and errors. With correction "none", β ≥ 0 and one minibatch it is
  TRL's GRPO loss with loss_type "bnpo" (and "dapo" over one generation batch), checked in
  tests/train/test_grpo_reference.py.
  """
  if not 0 < clip_eps < 1:
    raise ValueError(f"the PPO clip ε (train.ppo_clip) must be in (0, 1), got {clip_eps!r}")
  check_correction(correction, correction_clip)
  check_kl_coef(kl_coef, GRPO)
  if kl_coef > 0 and reference_logprobs is None:
    raise ValueError(
      f"train.kl_coef={kl_coef!r} needs log π_ref of the initial student (reference_logprobs): "
      "the train step computes it from the reference params it is given"
    )
  if student_lp_bt.shape != mask.shape or behaviour_logprobs.shape != mask.shape:
    raise ValueError(
      f"student log-probs {student_lp_bt.shape}, behaviour_logprobs {behaviour_logprobs.shape} "
      f"and mask {mask.shape} must all be [B, T]"
    )
  if advantage_b.shape not in (mask.shape[:1], mask.shape):
    raise ValueError(f"advantage {advantage_b.shape} must be [B] or [B, T] = {mask.shape}")
  counted = (mask > 0).astype(jnp.float32)
  # padding may sit outside the kept set
  student_lp = jnp.where(mask > 0, student_lp_bt.astype(jnp.float32), 0.0)
  if old_logprobs is None:
    old_lp = jax.lax.stop_gradient(student_lp)
  else:
    if old_logprobs.shape != mask.shape:
      raise ValueError(f"old_logprobs {old_logprobs.shape} must be [B, T] = {mask.shape}")
    old_lp = jnp.where(mask > 0, jax.lax.stop_gradient(old_logprobs).astype(jnp.float32), 0.0)
  weight_bt, keep_bt = mismatch_weights(
    old_lp, behaviour_logprobs, mask, correction, correction_clip
  )
  loss, ratio_bt, active_bt = ppo_clip_loss(
    student_lp, old_lp, advantage_b, weight_bt, keep_bt, clip_eps
  )
  truncated = correction in ("tis", "seq_tis")
  log_c = jnp.log(jnp.float32(correction_clip))
  delta_bt = jnp.where(mask > 0, old_lp - behaviour_logprobs.astype(jnp.float32), 0.0)
  over_bt = jnp.sum(delta_bt, 1, keepdims=True) if correction == "seq_tis" else delta_bt
  sg_ratio = jax.lax.stop_gradient(ratio_bt)
  metrics = {
    "loss/grpo": loss,
    "loss/student_logprob": losses.masked_mean(jax.lax.stop_gradient(student_lp), mask),
    "loss/num_tokens": jnp.sum(counted),
    "rl/ppo_ratio_mean": losses.masked_mean(sg_ratio, keep_bt),
    "rl/ppo_ratio_abs_dev_max": jnp.max(jnp.abs(sg_ratio - 1.0) * keep_bt),
    "rl/ppo_clip_frac": losses.masked_mean(active_bt, keep_bt),
    "rl/correction_weight_mean": losses.masked_mean(weight_bt, keep_bt),
    "rl/correction_masked_frac": losses.masked_mean(1.0 - keep_bt, mask),
    "rl/correction_clip_frac": (
      losses.masked_mean((over_bt > log_c).astype(jnp.float32) * counted, mask)
      if truncated
      else jnp.zeros((), jnp.float32)
    ),
  }
  if kl_coef > 0:
    kl_ref, _ = k3_kl_to_reference(student_lp, reference_logprobs, mask)
    penalty = kl_coef * kl_ref
    metrics["rl/kl_ref"] = jax.lax.stop_gradient(kl_ref)
    metrics["loss/kl_ref"] = penalty
    loss = loss + penalty
  return loss, metrics
