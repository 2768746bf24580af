"""The RL baselines on a rollout: their loss (`rl_loss`) and GRPO's K updates per batch
(`grpo_updates`).

The estimators, on arrays, are in `train.rl` (their equations in its docstrings). Here the
student is scored under the rollout's sampling transform (`policy.student_policy_logits`), so an
engine identical to the trainer gives every ratio 1 and masks nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.data import rewards
from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import teacher_forcing
from opd_jax.train import losses, microbatch, policy, rl
from opd_jax.train import mismatch_metrics as mismatch
from opd_jax.train import state as train_state


def check_reward(reward: str, loss_name: str) -> None:
  """Raises ValueError for a reward not in `rewards.REWARDS`, or the step reward with a loss
  other than grpo (REINFORCE has no per-token advantage; the distillation losses read no
  reward, so any kind passes with them)."""
  if reward not in rewards.REWARDS:
    known = ", ".join(rewards.REWARDS)
    raise ValueError(f"unknown reward {reward!r} (train.reward); known: {known}")
  if reward == rewards.STEP and loss_name == rl.LOSS_NAME:
    raise ValueError(
      "train.reward='step' gives each step's tokens that step's group advantage, which only "
      "train.loss='grpo' reads; use grpo, or reward 'exact_match' or 'partial' with reinforce"
    )


def _per_token(advantage, mask_bc):
  """A_b (broadcast) or A_bc on the counted tokens, 0 elsewhere: f32 [B, C]."""
  counted = (mask_bc > 0).astype(jnp.float32)
  return (advantage if advantage.ndim == 2 else advantage[:, None]) * counted


def rl_loss(student_bcv, tokens_bc, mask_bc, rollout: Rollout, loss_cfg, reference_lp_bc=None):
  """The RL baselines' loss (`rl.reinforce`, or `rl.grpo` with its single update: π_old =
  sg(π_θ), and its KL penalty against `reference_lp_bc` = log π_ref when β > 0), reward
  `rollout.reward_b`, and its metrics, with the same `mismatch/*` as the distillation losses;
  the teacher is not scored.

  Raises:
    ValueError: greedy rollouts (temperature 0): a point-mass policy has no gradient.
  """
  if loss_cfg.temperature == 0:
    raise ValueError(f"loss {loss_cfg.name!r} needs sampled rollouts (rollout.temperature > 0)")
  if loss_cfg.name == rl.GRPO:
    advantage_b, reward_metrics = grpo_advantages(rollout, loss_cfg)
    loss, metrics = configured_grpo(
      student_bcv, tokens_bc, mask_bc, advantage_b, rollout, loss_cfg, None, reference_lp_bc
    )
    metrics = dict(metrics, **reward_metrics)
    metrics["per_token/advantage_bc"] = _per_token(advantage_b, mask_bc)
  else:
    loss, metrics = rl.reinforce(
      student_bcv,
      tokens_bc,
      mask_bc,
      rollout.reward_b,
      rollout.behaviour_logprobs,
      is_clip=loss_cfg.is_clip,
    )
  metrics.update(mismatch.mismatch_metrics(jax.lax.stop_gradient(student_bcv), rollout))
  metrics.update(mismatch.per_token_kl_entry(student_bcv, rollout))
  return loss, metrics


def grpo_advantages(rollout: Rollout, loss_cfg):
  """The whole batch's group advantages and the reward metrics rl/reward_mean,
  rl/advantage_abs_mean and rl/group_all_equal_frac (the share of groups whose rewards are all
  equal, which train nothing with a sequence reward).

  With a sequence reward the advantage is A_b [B] (`rl.group_advantages` of `reward_b`). With
  `loss_cfg.reward` = "step" it is A_bc [B, C] (`rl.step_group_advantages` of the rollout's
  `step_reward_bs` at its `step_index_bc`), rl/advantage_abs_mean is the mean |A_bc| over the
  counted tokens, and the metrics add rl/step_reward_mean (the mean c_bi over rows and units)
  and rl/step_group_all_equal_frac (the share of (group, unit) pairs whose credits are all
  equal); rl/reward_mean stays the exact-match mean (`reward_b`).

  Raises:
    ValueError: a rollout without `reward_b`, or without the step fields for the step reward.
  """
  if rollout.reward_b is None:
    raise ValueError(
      "loss 'grpo' needs Rollout.reward_b: the rollout engine fills it when built with "
      "score_rewards=True (the trainer does this for train.loss='grpo')"
    )
  reward_b = rollout.reward_b.astype(jnp.float32)
  g = loss_cfg.group_size
  r_gn = reward_b.reshape(-1, g)
  flat_g = jnp.all(r_gn == r_gn[:, :1], axis=1).astype(jnp.float32)
  metrics = {"rl/reward_mean": jnp.mean(reward_b), "rl/group_all_equal_frac": jnp.mean(flat_g)}
  if loss_cfg.reward != rewards.STEP:
    advantage_b = rl.group_advantages(reward_b, g, loss_cfg.group_std_normalize)
    return advantage_b, metrics | {"rl/advantage_abs_mean": jnp.mean(jnp.abs(advantage_b))}
  if rollout.step_reward_bs is None or rollout.step_index_bc is None:
    raise ValueError(
      "train.reward='step' needs Rollout.step_reward_bs and step_index_bc: the rollout engine "
      "fills them when built with reward='step'"
    )
  credit_bs = rollout.step_reward_bs.astype(jnp.float32)
  advantage_bc = rl.step_group_advantages(
    credit_bs, rollout.step_index_bc, g, loss_cfg.group_std_normalize
  )
  c_gns = credit_bs.reshape(-1, g, credit_bs.shape[1])
  flat_gs = jnp.all(c_gns == c_gns[:, :1], axis=1).astype(jnp.float32)
  return advantage_bc, metrics | {
    "rl/advantage_abs_mean": losses.masked_mean(jnp.abs(advantage_bc), rollout.completion_mask),
    "rl/step_reward_mean": jnp.mean(credit_bs),
    "rl/step_group_all_equal_frac": jnp.mean(flat_gs),
  }


def grpo_policy_loss(
  params,
  rollout: Rollout,
  advantage_b,
  old_lp_bc,
  student_cfg,
  loss_cfg,
  remat,
  reference_lp_bc=None,
):
  """`rl.grpo` of the student on (a minibatch of) `rollout` against log π_old = `old_lp_bc`
  (and, when β > 0, its KL penalty against log π_ref = `reference_lp_bc`); returns (loss,
  scalar metrics)."""
  raw_bcv, tokens_bc, mask_bc = teacher_forcing.completion_logits(
    params, rollout, student_cfg, loss_cfg.temperature, remat
  )
  student_bcv = policy.student_policy_logits(raw_bcv, rollout)
  return configured_grpo(
    student_bcv, tokens_bc, mask_bc, advantage_b, rollout, loss_cfg, old_lp_bc, reference_lp_bc
  )


def configured_grpo(
  student_bcv, tokens_bc, mask_bc, advantage_b, rollout: Rollout, loss_cfg, old_lp_bc, ref_lp_bc
):
  """`rl.grpo` with the settings of `loss_cfg` (`train_step.LossConfig`: ε, the correction and its
  C, β) against the rollout's behaviour log-probs, log π_old = `old_lp_bc` (None: sg(π_θ))
  and log π_ref = `ref_lp_bc` (None without a KL penalty)."""
  return rl.grpo(
    student_bcv,
    tokens_bc,
    mask_bc,
    advantage_b,
    rollout.behaviour_logprobs,
    old_lp_bc,
    clip_eps=loss_cfg.ppo_clip,
    correction=loss_cfg.mismatch_correction,
    correction_clip=loss_cfg.mismatch_clip,
    reference_logprobs=ref_lp_bc,
    kl_coef=loss_cfg.kl_coef,
  )


def grpo_updates(
  state: train_state.TrainState,
  rollout: Rollout,
  *,
  tx,
  student_cfg,
  loss_cfg,
  remat: str = "none",
  lr_schedule=None,
  reference_params=None,
):
  """K = epochs × minibatches GRPO updates on one batch, in one jitted program.

  log π_old(y) of the student at the start (`state.params`) is scored once, with no gradient
  (the same pass gives the step's `mismatch/*` and `student/entropy`), and so is log π_ref(y)
  of `reference_params` with a KL penalty (`policy.reference_logprobs`). A_b is computed over
  the whole batch (`grpo_advantages`), so groups stay whole. A `jax.lax.scan` then makes the K
  updates: update i takes minibatch i mod M (M = `ppo_minibatches`, the strided split of
  `microbatch.split_microbatches`), applies `rl.grpo`'s clipped loss against π_old (each
  minibatch's loss its own token mean, as PPO implementations do) and one `tx` update. Every
  update of step s uses lr(s) (`state.schedule_counts`; Adam's own count advances K times), so
  `train.steps` and `opt/lr` keep their meaning.

  Returns:
    (new state, metrics): the K updates' scalars averaged (`*_max` keys the largest;
    `perf/grad_norm` the mean pre-clip norm, `perf/grad_norm_max` the largest), the reward
    metrics, `mismatch/*` and `student/entropy` of π_old, and per_token/advantage_bc [B, C].
  """
  import optax

  if loss_cfg.temperature == 0:
    raise ValueError("loss 'grpo' needs sampled rollouts (rollout.temperature > 0)")
  advantage_b, reward_metrics = grpo_advantages(rollout, loss_cfg)
  raw_bcv, tokens_bc, mask_bc = teacher_forcing.completion_logits(
    state.params, rollout, student_cfg, loss_cfg.temperature, remat
  )
  old_bcv = jax.lax.stop_gradient(policy.student_policy_logits(raw_bcv, rollout))
  old_lp_bc = jnp.where(mask_bc > 0, losses.token_logprobs(old_bcv, tokens_bc), 0.0)
  fixed = {"student/entropy": losses.masked_mean(losses.token_entropy(old_bcv), mask_bc)}
  fixed.update(mismatch.mismatch_metrics(old_bcv, rollout))
  fixed = mismatch.with_position_metrics(
    fixed | mismatch.per_token_kl_entry(old_bcv, rollout),
    rollout.completion_mask,
    loss_cfg.mismatch_bucket_tokens,
    loss_cfg.mismatch_cross_kl,
  )
  del raw_bcv, old_bcv
  reference_lp_bc = policy.reference_lp_if_needed(reference_params, rollout, student_cfg, loss_cfg)
  m = loss_cfg.ppo_minibatches
  parts = microbatch.split_microbatches(
    (rollout, advantage_b, old_lp_bc, reference_lp_bc), m, rollout.batch_size
  )
  grad_fn = jax.value_and_grad(grpo_policy_loss, has_aux=True)
  start_opt = state.opt_state

  def update(carry, i):
    params, opt_state = carry
    part, adv_b, old_bc, ref_bc = jax.tree.map(lambda x: x[i % m], parts)
    (loss, metrics), grads = grad_fn(
      params, part, adv_b, old_bc, student_cfg, loss_cfg, remat, ref_bc
    )
    opt_state = train_state.schedule_counts(opt_state, start_opt)  # every update at lr(step)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), (loss, metrics, optax.tree.norm(grads))

  k = loss_cfg.updates_per_batch
  (params, opt_state), (loss_k, metrics_k, norm_k) = jax.lax.scan(
    update, (state.params, state.opt_state), jnp.arange(k)
  )
  opt_state = train_state.schedule_counts(opt_state, start_opt, increment=1)
  metrics = {
    key: (jnp.max(x_k) if key.endswith("_max") else jnp.mean(x_k)) for key, x_k in metrics_k.items()
  }
  metrics.update(fixed, **reward_metrics)
  metrics.update(
    {
      "loss/total": jnp.mean(loss_k),
      "loss/num_tokens": jnp.sum((mask_bc > 0).astype(jnp.float32)),
      "perf/grad_norm": jnp.mean(norm_k),
      "perf/grad_norm_max": jnp.max(norm_k),
      "rl/ppo_updates": jnp.asarray(k, jnp.float32),
      "per_token/advantage_bc": _per_token(advantage_b, mask_bc),
    }
  )
  if lr_schedule is not None:
    metrics["opt/lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
  return new_state, metrics
