"""The OPD train step: the loss configuration, the loss dispatch and gradient accumulation.

    train_step(state, teacher_params, rollout, reference_params=None, *, tx, student_cfg,
               teacher_cfg, loss_cfg) -> (state, metrics)

A pure function over the `state.TrainState` (the caller jits it with the state donated,
`state.jit_step`). It draws no random numbers (the rollout carries the samples). The teacher is
frozen data, and so is `reference_params`, the student at step 0 that GRPO's KL penalty reads
(`LossConfig.kl_coef` = β > 0; None otherwise). π_θ is the student scored under the rollout's
own sampling transform (`policy.student_policy_logits`); `check_rollout_loss` refuses the
sampler/loss combinations this cannot serve. The distillation losses are looked up by name in
`TEACHER_LOSSES`, one signature for all, and read the teacher as a `losses.TeacherDistribution`
(full logits or top-k + tail). The RL losses (`rl`) read the task's reward instead; GRPO with
K = `LossConfig.updates_per_batch` > 1 takes `rl_step.grpo_updates`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import teacher_forcing
from opd_jax.model import teacher_topk
from opd_jax.model.config import ModelConfig
from opd_jax.rollout import off_policy
from opd_jax.train import losses, microbatch, policy, rl, rl_step
from opd_jax.train import mismatch_metrics as mismatch
from opd_jax.train import state as train_state


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Static choice of the OPD loss (hashable: a jit static argument)."""

  name: str = "reverse_kl_sampled"  # reverse_kl_sampled | reverse_kl_full | forward_kl | jsd
  # (or reinforce | grpo: the RL baselines on the task reward, opd_jax.train.rl)
  is_clip: float | None = 2.0  # truncation C of the importance ratio; None disables
  advantage_clip: float | None = None  # reverse_kl_sampled: clip A_t to [-c, c]; None = off
  advantage_baseline: str = "none"  # reverse_kl_sampled: none | batch_mean
  jsd_beta: float = 0.5  # β for jsd (0 = forward KL, 1 = reverse KL)
  temperature: float = 1.0  # the sampler's temperature; student logits are divided by it
  teacher_top_k: int = 0  # k > 0: the teacher as its top-k + a tail bucket; 0 = full vocabulary
  teacher_temperature: float = 1.0  # τ_T: π_T = softmax(teacher logits / τ_T), full or sparse
  # grpo only (opd_jax.train.rl; ignored by the other losses):
  group_size: int = 1  # G: completions per prompt, adjacent rows (rollout.samples_per_prompt)
  group_std_normalize: bool = True  # A ÷ (std of the group's rewards + 1e-6)
  ppo_clip: float = 0.2  # ε of the clip of π_θ/π_old
  ppo_epochs: int = 1  # passes over the batch
  ppo_minibatches: int = 1  # updates per pass (divides B); K = epochs × minibatches updates
  mismatch_correction: str = "none"  # none | tis | mis | seq_tis | seq_mis (of π_old/π_b)
  mismatch_clip: float = 2.0  # C: truncation (tis) or band [1/C, C] (mis)
  kl_coef: float = 0.0  # β of the k3 KL to the initial student (grpo only; 0 = off)
  # the RL losses' reward (opd_jax.data.rewards): "step" gives grpo per-token advantages
  # (rl.step_group_advantages); the sequence rewards need nothing here
  reward: str = "exact_match"
  # mismatch by token position (`mismatch_metrics.position_metrics`):
  mismatch_bucket_tokens: int = 16  # w: positions per kl_by_position bucket; 0 = off
  mismatch_cross_kl: float = 0.1  # κ: a completion crosses at its first KL_t > κ (nats)

  def __post_init__(self):
    mismatch.check_position_settings(self.mismatch_bucket_tokens, self.mismatch_cross_kl)
    rl.check_kl_coef(self.kl_coef, self.name)
    teacher_topk.check_top_k(self.teacher_top_k)
    teacher_topk.check_temperature(self.teacher_temperature)
    if self.name not in LOSS_NAMES:
      raise ValueError(f"unknown loss {self.name!r}; allowed: {', '.join(LOSS_NAMES)}")
    rl_step.check_reward(self.reward, self.name)
    if self.name == rl.GRPO:
      rl.check_grpo_settings(
        self.group_size,
        self.ppo_clip,
        self.ppo_epochs,
        self.ppo_minibatches,
        self.mismatch_correction,
        self.mismatch_clip,
        self.kl_coef,
      )

  @property
  def updates_per_batch(self) -> int:
    """K: optimizer updates per rollout batch (grpo's epochs × minibatches; 1 otherwise)."""
    return self.ppo_epochs * self.ppo_minibatches if self.name == rl.GRPO else 1

  @property
  def needs_reference(self) -> bool:
    """Whether the step reads `reference_params` (GRPO with a KL penalty, β > 0)."""
    return self.kl_coef > 0


def check_rollout_loss(sampler_cfg, loss_cfg: LossConfig) -> None:
  """Refuses sampler/loss combinations whose π_θ is undefined or whose loss is infinite.

  - `loss_cfg.temperature` must equal the sampler's temperature (π_θ is scored at it).
  - Greedy rollouts (T = 0) cannot carry an importance ratio: π_b is a point mass, so
    `reverse_kl_sampled` with `is_clip` is refused (use is_clip=None, or T > 0), and so are
    the RL losses (a point mass has no policy gradient). Greedy
    rollouts only choose the prefixes: the losses score the student at T = 1,
    unfiltered (a point mass has no gradient).
  - With a top-k/top-p filter (any top_k > 0 or top_p < 1 counts) π_θ is zero outside
    the kept set, so the forward KL KL(π_T ‖ π_θ) is infinite wherever the teacher has
    mass there: `forward_kl` and `jsd` with β = 0 are refused.

  Args:
    sampler_cfg: the rollout's `sampler.SamplerConfig` (temperature, top_k, top_p).
    loss_cfg: the train step's `LossConfig`.

  Raises:
    ValueError naming the combination and what to change.
  """
  temperature = sampler_cfg.temperature
  if loss_cfg.temperature != temperature:
    raise ValueError(
      f"LossConfig.temperature={loss_cfg.temperature} differs from the sampler's "
      f"temperature={temperature}; the student must be scored at the rollout's temperature"
    )
  if temperature == 0:
    if loss_cfg.name in rl.RL_LOSSES:
      raise ValueError(
        f"loss {loss_cfg.name!r} needs sampled rollouts (rollout.temperature > 0): a "
        "point-mass policy has no gradient"
      )
    if loss_cfg.name == "reverse_kl_sampled" and loss_cfg.is_clip is not None:
      raise ValueError(
        "greedy rollouts (temperature 0) cannot carry an importance ratio: the behaviour "
        "policy is a point mass. Use reverse_kl_sampled with is_clip=None (train.is_clip=0), "
        "another loss, or sample at temperature > 0"
      )
    return
  filtered = sampler_cfg.top_k > 0 or sampler_cfg.top_p < 1.0
  forward = loss_cfg.name == "forward_kl" or (loss_cfg.name == "jsd" and loss_cfg.jsd_beta == 0)
  if filtered and forward:
    raise ValueError(
      f"loss {loss_cfg.name!r} (forward KL to the teacher) is infinite under top-k/top-p "
      f"rollouts (top_k={sampler_cfg.top_k}, top_p={sampler_cfg.top_p}): the student is "
      "scored on the engine's kept set and has no mass elsewhere. Use reverse_kl_full, "
      "reverse_kl_sampled or jsd with beta > 0, or sample without a filter"
    )


def opd_loss(
  params,
  teacher_params,
  rollout: Rollout,
  student_cfg: ModelConfig,
  teacher_cfg: ModelConfig,
  loss_cfg: LossConfig,
  remat: str = "none",
  reference_lp_bc=None,
):
  """The configured OPD loss of the student on `rollout`; returns (loss, metrics).

  π_θ is `policy.student_policy_logits` of the student at the sampler's temperature (the
  teacher at its own `teacher_temperature` τ_T, unfiltered, full or top-k + tail:
  `teacher_scores`). The metrics include `mismatch/*`
  (`train.mismatch_metrics.mismatch_metrics`) computed from the same stop-gradient
  student logits: no second forward pass. Greedy rollouts (temperature 0) train
  the student at T = 1 and measure mismatch against the replayed point mass.
  A rollout that carries `teacher_logits` (scored by the rollout engine) skips the
  teacher's forward pass here. `remat` rematerialises the student's layers
  (`model.layer_fn`). `student/entropy` is the mean per-token entropy
  Σ_{b,c} m_bc · H(π_θ(·|b,c)) / max(Σ m, 1) of the same π_θ, from the same logits.
  `teacher/reverse_kl` is the reverse KL on the teacher's bins (≤ the full one with a sparse
  teacher), and `teacher/logprob` the mean log π_T of the sampled tokens
  (`TeacherDistribution.token_logprobs`). `reference_lp_bc` is log π_ref of GRPO's KL penalty
  (`policy.reference_logprobs`; None without one).
  """
  raw_bcv, tokens_bc, mask_bc = teacher_forcing.completion_logits(
    params, rollout, student_cfg, loss_cfg.temperature, remat
  )
  student_bcv = policy.student_policy_logits(raw_bcv, rollout)  # greedy: no kept set
  entropy_bc = losses.token_entropy(jax.lax.stop_gradient(student_bcv))
  entropy = {"student/entropy": losses.masked_mean(entropy_bc, mask_bc)}
  if loss_cfg.name in rl.RL_LOSSES:  # the task's reward instead of the teacher: no teacher pass
    loss, metrics = rl_step.rl_loss(
      student_bcv, tokens_bc, mask_bc, rollout, loss_cfg, reference_lp_bc
    )
    return loss, metrics | entropy
  teacher = teacher_scores(teacher_params, rollout, teacher_cfg, loss_cfg)
  loss, metrics = teacher_loss(loss_cfg.name)(student_bcv, teacher, rollout, loss_cfg)
  student_bcv = jax.lax.stop_gradient(student_bcv)
  metrics = dict(metrics)
  if "teacher/reverse_kl" not in metrics:  # reverse_kl_full already reports it
    _, kl = losses.reverse_kl_full(student_bcv, teacher, rollout.completion_mask)
    metrics["teacher/reverse_kl"] = kl["teacher/reverse_kl"]
  teacher_lp_bc = teacher.token_logprobs(tokens_bc)
  metrics["teacher/logprob"] = losses.masked_mean(teacher_lp_bc, mask_bc)
  # Per-token advantage A_t = log π_T(y_t) − log π_θ(y_t), for histograms.
  metrics["per_token/advantage_bc"] = teacher_lp_bc - losses.token_logprobs(student_bcv, tokens_bc)
  if loss_cfg.temperature > 0:
    policy_bcv = student_bcv
  else:
    policy_bcv = policy.greedy_policy_logits(student_bcv, tokens_bc)
  # mismatch/* over the sampled rows only (reference rows were sampled by no engine)
  sampled = off_policy.sampled_rows(rollout)
  metrics.update(mismatch.mismatch_metrics(policy_bcv, sampled))
  metrics.update(mismatch.per_token_kl_entry(policy_bcv, sampled))
  return loss, metrics | entropy


def teacher_scores(
  teacher_params, rollout: Rollout, teacher_cfg: ModelConfig, loss_cfg
) -> losses.TeacherDistribution:
  """π_T at the rollout's completion positions, as the losses read it.

  Returns `losses.FullTeacher` of the logits z_T / τ_T [B, C, V] when
  `loss_cfg.teacher_top_k` = 0, else a `teacher_topk.TopKTeacher` (top-k log-probs of
  softmax(z_T / τ_T) plus the tail). No gradient flows through either. Sources: the rollout's
  sparse teacher (`teacher_topk`, scored by the engine at τ_T with the same k), the rollout's
  raw logits (`teacher_logits`, scored by the engine at T = 1), or the teacher's forward pass
  here.

  Raises:
    ValueError: a rollout's sparse teacher with another k or τ_T than `loss_cfg`'s, or a
      sparse teacher where the loss asks for the full vocabulary.
  """
  k, tau = loss_cfg.teacher_top_k, loss_cfg.teacher_temperature
  given = rollout.teacher_topk
  if given is not None:
    if given.k != k or given.temperature != tau:
      raise ValueError(
        f"the rollout's sparse teacher has top-k {given.k} at temperature {given.temperature}"
        f", but the loss asks for train.teacher_top_k={k} at teacher.temperature={tau}"
      )
    return given
  if rollout.teacher_logits is None:
    logits_bcv, _, _ = teacher_forcing.completion_logits(teacher_params, rollout, teacher_cfg)
  else:  # scored by the rollout engine: the same frozen teacher, the same positions
    logits_bcv = rollout.teacher_logits
  logits_bcv = jax.lax.stop_gradient(logits_bcv)
  if k == 0:
    return losses.FullTeacher(teacher_topk.scale_logits(logits_bcv, tau))
  return teacher_topk.from_logits(logits_bcv, k, tau)


def _reverse_kl_sampled(student_bcv, teacher, rollout: Rollout, loss_cfg: LossConfig):
  return losses.reverse_kl_sampled(
    student_bcv,
    teacher,
    rollout.completion_tokens,
    rollout.completion_mask,
    rollout.behaviour_logprobs,
    is_clip=loss_cfg.is_clip,
    advantage_clip=loss_cfg.advantage_clip,
    baseline=loss_cfg.advantage_baseline,
  )


def _reverse_kl_full(student_bcv, teacher, rollout: Rollout, loss_cfg: LossConfig):
  return losses.reverse_kl_full(student_bcv, teacher, rollout.completion_mask)


def _forward_kl(student_bcv, teacher, rollout: Rollout, loss_cfg: LossConfig):
  return losses.forward_kl(student_bcv, teacher, rollout.completion_mask)


def _jsd(student_bcv, teacher, rollout: Rollout, loss_cfg: LossConfig):
  return losses.jsd(student_bcv, teacher, rollout.completion_mask, beta=loss_cfg.jsd_beta)


# `train.loss` name -> the distillation loss, one signature for all:
#   loss(student_bcv [B, C, V], teacher: losses.TeacherDistribution, rollout, loss_cfg)
#     -> (loss f32 [], metrics)
# reading its settings (is_clip, jsd_beta, ...) from the `LossConfig`.
TEACHER_LOSSES = {
  "reverse_kl_sampled": _reverse_kl_sampled,
  "reverse_kl_full": _reverse_kl_full,
  "forward_kl": _forward_kl,
  "jsd": _jsd,
}
LOSS_NAMES = (*TEACHER_LOSSES, *rl.RL_LOSSES)  # every `train.loss`; the RL ones read no teacher


def teacher_loss(name: str):
  """The distillation loss registered as `name` in `TEACHER_LOSSES`.

  Raises:
    ValueError: `name` is not registered; the message names the allowed names.
  """
  if name not in TEACHER_LOSSES:
    raise ValueError(
      f"unknown distillation loss {name!r}; allowed: {', '.join(TEACHER_LOSSES)}"
      f" (the RL losses {', '.join(rl.RL_LOSSES)} read the reward, not a teacher)"
    )
  return TEACHER_LOSSES[name]


def train_step(
  state: train_state.TrainState,
  teacher_params,
  rollout: Rollout,
  reference_params=None,
  *,
  tx,
  student_cfg,
  teacher_cfg,
  loss_cfg: LossConfig,
  microbatches: int = 1,
  remat: str = "none",
  lr_schedule=None,
):
  """One OPD update on a batch of (possibly off-policy) rollouts.

  With `microbatches` = K > 1 the batch is split into K micro-batches
  (`microbatch.split_microbatches`) whose gradients a `jax.lax.scan` accumulates, one optimizer
  update per step: g = Σ_k w_k ∇loss_k with w_k = N_k / max(N, 1)
  (`microbatch.microbatch_weights`), which is the full batch's gradient of the same
  token-mean loss, while only one micro-batch's activations are live at a time.

  Args:
    state: the TrainState (donated by the caller).
    teacher_params: frozen teacher params; no gradient, not in the optimizer.
    rollout: a version-tagged `Rollout` batch from the engine.
    reference_params: frozen params of the student at step 0, read only by GRPO's KL penalty
      (`loss_cfg.kl_coef` > 0, `policy.reference_logprobs`); no gradient, not in the
      optimizer. None otherwise.
    tx: the optax transformation (static).
    student_cfg, teacher_cfg: model configs (static).
    loss_cfg: the loss (static).
    microbatches: K, gradient-accumulation micro-batches per step (static; divides B).
    remat: the student forward's rematerialisation (`model.layer_fn`; static).
    lr_schedule: the optimizer's schedule (`state.make_schedule`); when given, `opt/lr` is
      lr_schedule(state.step), the rate this update applies.

  Returns:
    (new state, metrics): f32 scalars under loss/*, teacher/*, mismatch/*, student/*,
    opt/*, perf/*, and per-token arrays [B, C] under per_token/*. The position metrics
    (`mismatch/kl_by_position/*`, `first_cross_pos`, `cross_frac`) are computed once from the
    whole batch's per-token KL, after the micro-batches are combined.

  GRPO with K = `loss_cfg.updates_per_batch` > 1 makes K optimizer updates on the batch
  (`rl_step.grpo_updates`); with K = 1 it takes the path of every other loss.
  """
  if loss_cfg.updates_per_batch > 1:
    check_microbatches(loss_cfg, microbatches, rollout.batch_size)
    return rl_step.grpo_updates(
      state,
      rollout,
      tx=tx,
      student_cfg=student_cfg,
      loss_cfg=loss_cfg,
      remat=remat,
      lr_schedule=lr_schedule,
      reference_params=reference_params,
    )
  grad_fn = jax.value_and_grad(opd_loss, has_aux=True)
  args = (student_cfg, teacher_cfg, loss_cfg, remat)
  if microbatches == 1:
    reference_lp_bc = policy.reference_lp_if_needed(
      reference_params, rollout, student_cfg, loss_cfg
    )
    (loss, metrics), grads = grad_fn(state.params, teacher_params, rollout, *args, reference_lp_bc)
  else:  # no KL penalty here: grpo, the only loss with one, refuses micro-batches
    check_microbatches(loss_cfg, microbatches, rollout.batch_size)
    parts = microbatch.split_microbatches(rollout, microbatches)
    w_k = microbatch.microbatch_weights(parts.completion_mask)

    def accumulate(acc, part_w):
      part, w = part_w
      (loss, metrics), grads = grad_fn(state.params, teacher_params, part, *args)
      acc = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), acc, grads)
      return acc, (loss, metrics)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    grads, (loss_k, metrics_k) = jax.lax.scan(accumulate, zeros, (parts, w_k))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    loss = jnp.sum(w_k * loss_k)
    sampled_w_k = None  # λ < 1: mismatch/* are means over the sampled tokens only
    if rollout.on_policy_b is not None:
      sampled_w_k = microbatch.microbatch_weights(off_policy.sampled_rows(parts).completion_mask)
    metrics = microbatch.combine_microbatch_metrics(metrics_k, w_k, sampled_w_k)
  metrics = mismatch.with_position_metrics(
    metrics,
    off_policy.sampled_rows(rollout).completion_mask,
    loss_cfg.mismatch_bucket_tokens,
    loss_cfg.mismatch_cross_kl,
  )
  if lr_schedule is not None:
    metrics = dict(metrics, **{"opt/lr": jnp.asarray(lr_schedule(state.step), jnp.float32)})
  return train_state.apply_gradients(state, grads, tx, loss, metrics)


def check_microbatches(loss_cfg: LossConfig, microbatches: int, batch_size: int) -> None:
  """Refuses micro-batching that would not reproduce the full batch's gradient.

  Raises:
    ValueError: K < 1, K not dividing the batch, or a loss whose per-token terms depend
      on other rows (the `batch_mean` baseline, `reinforce`'s leave-one-out baseline,
      `grpo`'s group baseline).
  """
  if microbatches < 1 or batch_size % microbatches:
    raise ValueError(
      f"train.microbatches={microbatches} must be >= 1 and divide the rollout batch "
      f"({batch_size} rows)"
    )
  if microbatches == 1:
    return
  coupled = loss_cfg.name in rl.RL_LOSSES or (
    loss_cfg.name == "reverse_kl_sampled" and loss_cfg.advantage_baseline != "none"
  )
  if coupled:
    raise ValueError(
      f"train.microbatches={microbatches} cannot split loss {loss_cfg.name!r} with its "
      "batch baseline (each row's advantage depends on the other rows): use "
      "train.microbatches=1 or advantage_baseline='none'"
    )
