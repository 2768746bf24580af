"""Train state, optimizer and the pure, jittable train steps.

    train_step(state, teacher_params, rollout, reference_params=None, *, tx, student_cfg,
               teacher_cfg, loss_cfg) -> (state, metrics)

The step draws no random numbers (the rollout carries the samples), so it takes no
key; `TrainState.rng` is the run's base key, kept in the state so that it is
checkpointed with it. `TrainState` holds only what the optimizer changes (student
params, optimizer state, step) plus that key. The teacher is passed as frozen data:
it is never in the optimizer state and never checkpointed. The step functions are
pure; the caller jits them with explicit shardings and donates the state.

GRPO with more than one update per batch (`LossConfig.updates_per_batch` = K > 1) takes
`grpo_updates` from `train_step`: K optimizer updates against π_old in one program, with the
same signature and state.

GRPO's KL penalty to the initial student (`LossConfig.kl_coef` = β > 0) reads a fourth
argument, `reference_params`: the student at step 0, frozen data like the teacher (never in
the optimizer state, never checkpointed; the trainer keeps it beside the state). It costs one
more copy of the student's params in device memory and one more forward pass per step, with no
gradient: log π_ref is scored once per batch (`reference_logprobs`), before any update.

The student's policy π_θ is scored under the rollout's own sampling transform, in
one place (`student_policy_logits`): divided by the rollout's temperature and
restricted to the engine's kept set (`Rollout.support_ids`) when the sampler
filtered with top-k/top-p. The losses, the importance ratio and the `mismatch/*`
metrics (`opd_jax.mismatch`) all see that same π_θ, so an engine identical to the
trainer gives ratio 1 and zero mismatch under every sampling setting.
`check_rollout_loss` refuses the sampler/loss combinations this cannot serve.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import teacher_forcing
from opd_jax.model import teacher_topk
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.rollout import off_policy
from opd_jax.train import losses, rl
from opd_jax.train import mismatch_metrics as mismatch

# optax is imported by the functions that build or apply the optimizer. The admission check
# imports this module for its scoring (`completion_logits`, `student_policy_logits`) and never
# updates: optax would be 0.3 s of a 5 s check.
if TYPE_CHECKING:
  import optax


@struct.dataclass
class TrainState:
  """params: student pytree; opt_state: optax state; step: int32 []; rng: uint32 key data."""

  params: dict
  opt_state: optax.OptState
  step: jax.Array
  rng: jax.Array


def make_optimizer(
  lr: float, total_steps: int, warmup_steps: int, weight_decay: float, grad_clip: float
) -> optax.GradientTransformation:
  """AdamW after global-norm clipping, with linear warmup then cosine decay to 10%.

  lr(s) = lr · s / warmup for s < warmup, then lr · (0.1 + 0.9 · ½(1 + cos(π·u))) with
  u the fraction of the remaining steps done (`make_schedule`).
  """
  import optax

  schedule = make_schedule(lr, total_steps, warmup_steps)
  return optax.chain(
    optax.clip_by_global_norm(grad_clip), optax.adamw(schedule, weight_decay=weight_decay)
  )


def make_schedule(lr: float, total_steps: int, warmup_steps: int) -> optax.Schedule:
  """The learning rate lr(s) of `make_optimizer` at optimizer step s (logged as `opt/lr`)."""
  import optax

  warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=lr,
    warmup_steps=warmup_steps,
    decay_steps=max(total_steps, warmup_steps + 1),
    end_value=0.1 * lr,
  )


def init_state(params, tx: optax.GradientTransformation, seed: int) -> TrainState:
  """A fresh TrainState at step 0."""
  return TrainState(
    params=params,
    opt_state=tx.init(params),
    step=jnp.zeros((), jnp.int32),
    rng=jax.random.key_data(jax.random.key(seed)),
  )


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

  def __post_init__(self):
    rl.check_kl_coef(self.kl_coef, self.name)
    teacher_topk.check_top_k(self.teacher_top_k)
    teacher_topk.check_temperature(self.teacher_temperature)
    if self.name not in (
      "reverse_kl_sampled",
      "reverse_kl_full",
      "forward_kl",
      "jsd",
      *rl.RL_LOSSES,
    ):
      raise ValueError(f"unknown loss {self.name!r}")
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


def support_mask(rollout: Rollout, vocab_size: int):
  """bool [B, C, V]: True on the engine's kept set K_b, from `rollout.support_ids`.

  Returns None when the rollout carries no kept set (the sampler did not filter).
  """
  ids_bcm = rollout.support_ids
  if ids_bcm is None:
    return None
  b, c, m = ids_bcm.shape
  if m == vocab_size:  # top-p alone: slot j holds j if kept, else -1
    return ids_bcm >= 0
  rows = jnp.arange(b * c)[:, None]
  flat_ids = jnp.where(ids_bcm >= 0, ids_bcm, vocab_size).reshape(b * c, m)
  kept = jnp.zeros((b * c, vocab_size), bool).at[rows, flat_ids].set(True, mode="drop")
  return kept.reshape(b, c, vocab_size)


def student_policy_logits(logits_bcv, rollout: Rollout):
  """π_θ under the rollout's filter: the engine's kept set replayed on the student.

      π_θ(v) = softmax(z)_v over v ∈ K_b, 0 elsewhere,  z = student logits / T

  `logits_bcv` is already divided by the temperature (`completion_logits`). This is
  the "keep sampling mask" choice: the engine's kept set K_b travels with the
  rollout rather than the trainer re-running top-k/top-p on its own logits, because
  the two rankings differ at the boundary by f32 noise even for an identical engine
  (and by the real mismatch otherwise), which would put sampled tokens outside the
  trainer's support (ratio 0, infinite KL). Replaying K_b keeps π_b and π_θ on one
  support: an exact engine reads zero, any engine gives finite metrics, and the
  sampled reverse KL is an unbiased estimator of ∇KL(π_θ ‖ π_T) for the filtered
  policy the engine deploys.

  Positions outside the completion mask keep the unfiltered logits, so padding
  (whose token need not lie in the kept set) can never produce -inf log-probs; so do the
  rows whose completion is a reference (`Rollout.on_policy_b` 0, `opd_jax.rollout.off_policy`),
  which no engine sampled, so K_b says nothing about them.

  Args:
    logits_bcv: [B, C, V] student logits at the completion positions, / T.
    rollout: the batch; its `support_ids` (or None: nothing filtered).

  Returns:
    [B, C, V] logits, -inf outside K_b at counted positions.
  """
  kept_bcv = support_mask(rollout, logits_bcv.shape[-1])
  if kept_bcv is None:
    return logits_bcv
  kept_bcv = kept_bcv | (rollout.completion_mask <= 0)[..., None]
  if rollout.on_policy_b is not None:  # dataset rows: the student unfiltered
    kept_bcv = kept_bcv | (rollout.on_policy_b <= 0)[:, None, None]
  return jnp.where(kept_bcv, logits_bcv, -jnp.inf)


def greedy_policy_logits(logits_bcv, tokens_bc):
  """The greedy engine's transform replayed: the point mass on the sampled token.

  Greedy decoding has no temperature to share and its support is {y_t}, so π_θ
  under the same transform is the point mass on y_t: 0 on y_t, -inf elsewhere.
  """
  vocab = logits_bcv.shape[-1]
  hit_bcv = jnp.arange(vocab) == tokens_bc[..., None]
  return jnp.where(hit_bcv, 0.0, -jnp.inf).astype(jnp.float32)


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

  π_θ is `student_policy_logits` of the student at the sampler's temperature (the
  teacher at its own `teacher_temperature` τ_T, unfiltered, full or top-k + tail:
  `teacher_scores`). The metrics include `mismatch/*`
  (`train.mismatch_metrics.mismatch_metrics`) computed from the same stop-gradient
  student logits: no second forward pass. Greedy rollouts (temperature 0) train
  the student at T = 1 and measure mismatch against the replayed point mass.
  A rollout that carries `teacher_logits` (scored by the rollout engine) skips the
  teacher's forward pass here. `remat` rematerialises the student's layers
  (`model.layer_fn`). `student/entropy` is the mean per-token entropy
  Σ_{b,c} m_bc · H(π_θ(·|b,c)) / max(Σ m, 1) of the same π_θ, from the same logits.
  `reference_lp_bc` is log π_ref of GRPO's KL penalty (`reference_logprobs`; None without one).
  """
  raw_bcv, tokens_bc, mask_bc = teacher_forcing.completion_logits(
    params, rollout, student_cfg, loss_cfg.temperature, remat
  )
  student_bcv = student_policy_logits(raw_bcv, rollout)  # greedy rollouts carry no kept set
  entropy_bc = losses.token_entropy(jax.lax.stop_gradient(student_bcv))
  entropy = {"student/entropy": losses.masked_mean(entropy_bc, mask_bc)}
  if loss_cfg.name in rl.RL_LOSSES:  # the task's reward instead of the teacher: no teacher pass
    loss, metrics = rl_loss(student_bcv, tokens_bc, mask_bc, rollout, loss_cfg, reference_lp_bc)
    return loss, metrics | entropy
  teacher = teacher_scores(teacher_params, rollout, teacher_cfg, loss_cfg)
  if isinstance(teacher, teacher_topk.TopKTeacher):
    loss, metrics, teacher_lp_bc = topk_teacher_loss(student_bcv, teacher, rollout, loss_cfg)
  else:
    loss, metrics, teacher_lp_bc = full_teacher_loss(student_bcv, teacher, rollout, loss_cfg)
  student_bcv = jax.lax.stop_gradient(student_bcv)
  metrics["teacher/logprob"] = losses.masked_mean(teacher_lp_bc, mask_bc)
  # Per-token advantage A_t = log π_T(y_t) − log π_θ(y_t), for histograms.
  metrics["per_token/advantage_bc"] = teacher_lp_bc - losses.token_logprobs(student_bcv, tokens_bc)
  if loss_cfg.temperature > 0:
    policy_bcv = student_bcv
  else:
    policy_bcv = greedy_policy_logits(student_bcv, tokens_bc)
  # mismatch/* over the sampled rows only (reference rows were sampled by no engine)
  metrics.update(mismatch.mismatch_metrics(policy_bcv, off_policy.sampled_rows(rollout)))
  return loss, metrics | entropy


def teacher_scores(teacher_params, rollout: Rollout, teacher_cfg: ModelConfig, loss_cfg):
  """π_T at the rollout's completion positions, in the form the loss reads it.

  Returns the full logits z_T / τ_T [B, C, V] when `loss_cfg.teacher_top_k` = 0, else a
  `teacher_topk.TopKTeacher` (top-k log-probs of softmax(z_T / τ_T) plus the tail). No
  gradient flows through either. Sources: the rollout's sparse teacher (`teacher_topk`,
  scored by the engine at τ_T with the same k), the rollout's raw logits (`teacher_logits`,
  scored by the engine at T = 1), or the teacher's forward pass here.

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
    return teacher_topk.scale_logits(logits_bcv, tau)
  return teacher_topk.from_logits(logits_bcv, k, tau)


# loss name -> (the loss against full teacher logits, the same loss on the sparse teacher)
TEACHER_LOSSES = {
  "reverse_kl_sampled": (losses.reverse_kl_sampled, losses.reverse_kl_sampled_topk),
  "reverse_kl_full": (losses.reverse_kl_full, losses.reverse_kl_topk),
  "forward_kl": (losses.forward_kl, losses.forward_kl_topk),
  "jsd": (losses.jsd, losses.jsd_topk),
}


def configured_loss(student_bcv, teacher, rollout: Rollout, loss_cfg: LossConfig, sparse: bool):
  """(loss, metrics) of `loss_cfg.name` against the teacher: full logits [B, C, V] (already
  / τ_T) or, with `sparse`, a `teacher_topk.TopKTeacher` (`losses.*_topk`, on its k + 1
  bins)."""
  if loss_cfg.name not in TEACHER_LOSSES:
    raise ValueError(f"unknown loss {loss_cfg.name!r}; known: {', '.join(TEACHER_LOSSES)}")
  fn = TEACHER_LOSSES[loss_cfg.name][int(sparse)]
  mask_bc = rollout.completion_mask
  if loss_cfg.name == "reverse_kl_sampled":
    return fn(
      student_bcv,
      teacher,
      rollout.completion_tokens,
      mask_bc,
      rollout.behaviour_logprobs,
      is_clip=loss_cfg.is_clip,
      advantage_clip=loss_cfg.advantage_clip,
      baseline=loss_cfg.advantage_baseline,
    )
  if loss_cfg.name == "jsd":
    return fn(student_bcv, teacher, mask_bc, beta=loss_cfg.jsd_beta)
  return fn(student_bcv, teacher, mask_bc)


def full_teacher_loss(student_bcv, teacher_bcv, rollout: Rollout, loss_cfg: LossConfig):
  """The configured loss against the full teacher logits [B, C, V] (already / τ_T).

  Returns:
    (loss, metrics with teacher/reverse_kl, teacher_lp_bc = log π_T(y) [B, C]).
  """
  tokens_bc, mask_bc = rollout.completion_tokens, rollout.completion_mask
  loss, metrics = configured_loss(student_bcv, teacher_bcv, rollout, loss_cfg, sparse=False)
  student_bcv = jax.lax.stop_gradient(student_bcv)
  teacher_lp_bc = losses.token_logprobs(teacher_bcv, tokens_bc)
  metrics = dict(metrics)
  if "teacher/reverse_kl" not in metrics:  # reverse_kl_full already reports it
    kl_bc = losses.per_token_kl(student_bcv, teacher_bcv)
    metrics["teacher/reverse_kl"] = losses.masked_mean(kl_bc, mask_bc)
  return loss, metrics, teacher_lp_bc


def topk_teacher_loss(student_bcv, teacher, rollout: Rollout, loss_cfg: LossConfig):
  """The configured loss against the sparse teacher (`losses.*_topk`, on its k + 1 bins).

  `teacher/reverse_kl` is then the reverse KL between the coarse-grained distributions
  (≤ the full one), and `teacher/logprob` uses the tail spread uniformly for sampled tokens
  outside the top-k (`teacher_topk.token_logprobs`).

  Returns:
    (loss, metrics with teacher/reverse_kl and teacher/top_k_mass, teacher_lp_bc [B, C]).
  """
  tokens_bc, mask_bc = rollout.completion_tokens, rollout.completion_mask
  loss, metrics = configured_loss(student_bcv, teacher, rollout, loss_cfg, sparse=True)
  metrics = dict(metrics)
  if "teacher/reverse_kl" not in metrics:  # reverse_kl_topk already reports it
    _, kl = losses.reverse_kl_topk(jax.lax.stop_gradient(student_bcv), teacher, mask_bc)
    metrics["teacher/reverse_kl"] = kl["teacher/reverse_kl"]
  return loss, metrics, teacher_topk.token_logprobs(teacher, tokens_bc)


def rl_loss(
  student_bcv, tokens_bc, mask_bc, rollout: Rollout, loss_cfg: LossConfig, reference_lp_bc=None
):
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
    loss, metrics = rl.grpo(
      student_bcv,
      tokens_bc,
      mask_bc,
      advantage_b,
      rollout.behaviour_logprobs,
      clip_eps=loss_cfg.ppo_clip,
      correction=loss_cfg.mismatch_correction,
      correction_clip=loss_cfg.mismatch_clip,
      reference_logprobs=reference_lp_bc,
      kl_coef=loss_cfg.kl_coef,
    )
    counted = (mask_bc > 0).astype(jnp.float32)
    metrics = dict(metrics, **reward_metrics)
    metrics["per_token/advantage_bc"] = advantage_b[:, None] * counted
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
  return loss, metrics


def grpo_advantages(rollout: Rollout, loss_cfg: LossConfig):
  """The whole batch's group advantages A_b (`rl.group_advantages`) and the reward metrics
  rl/reward_mean, rl/advantage_abs_mean and rl/group_all_equal_frac (the share of groups
  whose rewards are all equal, which train nothing).

  Raises:
    ValueError: a rollout without `reward_b`.
  """
  if rollout.reward_b is None:
    raise ValueError(
      "loss 'grpo' needs Rollout.reward_b: the rollout engine fills it when built with "
      "score_rewards=True (the trainer does this for train.loss='grpo')"
    )
  reward_b = rollout.reward_b.astype(jnp.float32)
  g = loss_cfg.group_size
  advantage_b = rl.group_advantages(reward_b, g, loss_cfg.group_std_normalize)
  r_gn = reward_b.reshape(-1, g)
  flat_g = jnp.all(r_gn == r_gn[:, :1], axis=1).astype(jnp.float32)
  return advantage_b, {
    "rl/reward_mean": jnp.mean(reward_b),
    "rl/advantage_abs_mean": jnp.mean(jnp.abs(advantage_b)),
    "rl/group_all_equal_frac": jnp.mean(flat_g),
  }


def reference_logprobs(reference_params, rollout: Rollout, student_cfg, loss_cfg: LossConfig):
  """log π_ref(y_bc) of the frozen initial student at the rollout's completion tokens; f32
  [B, C], 0 outside the mask, no gradient.

  One forward pass of `reference_params` (the student's architecture `student_cfg`), scored
  exactly as π_θ is: divided by the sampler's temperature and restricted to the engine's kept
  set (`student_policy_logits`), so that π_θ = π_ref gives k3 = 0 under every sampling setting.
  """
  raw_bcv, tokens_bc, mask_bc = teacher_forcing.completion_logits(
    reference_params, rollout, student_cfg, loss_cfg.temperature
  )
  ref_bcv = jax.lax.stop_gradient(student_policy_logits(raw_bcv, rollout))
  return jnp.where(mask_bc > 0, losses.token_logprobs(ref_bcv, tokens_bc), 0.0)


def _reference_lp(reference_params, rollout: Rollout, student_cfg, loss_cfg: LossConfig):
  """`reference_logprobs` when the loss has a KL penalty (β > 0), else None.

  Raises:
    ValueError: β > 0 and no `reference_params`.
  """
  if not loss_cfg.needs_reference:
    return None
  if reference_params is None:
    raise ValueError(
      f"train.kl_coef={loss_cfg.kl_coef} needs the initial student's params: pass "
      "reference_params (a frozen copy of the student at step 0) to the train step"
    )
  return reference_logprobs(reference_params, rollout, student_cfg, loss_cfg)


def _apply(state: TrainState, grads, tx, loss, metrics):
  import optax

  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, **{"loss/total": loss, "perf/grad_norm": optax.tree.norm(grads)})
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


def train_step(
  state: TrainState,
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
  (`split_microbatches`) whose gradients a `jax.lax.scan` accumulates, one optimizer
  update per step: g = Σ_k w_k ∇loss_k with w_k = N_k / max(N, 1)
  (`losses.microbatch_weights`), which is the full batch's gradient of the same
  token-mean loss, while only one micro-batch's activations are live at a time.

  Args:
    state: the TrainState (donated by the caller).
    teacher_params: frozen teacher params; no gradient, not in the optimizer.
    rollout: a version-tagged `Rollout` batch from the engine.
    reference_params: frozen params of the student at step 0, read only by GRPO's KL penalty
      (`loss_cfg.kl_coef` > 0, `reference_logprobs`); no gradient, not in the optimizer. None
      otherwise.
    tx: the optax transformation (static).
    student_cfg, teacher_cfg: model configs (static).
    loss_cfg: the loss (static).
    microbatches: K, gradient-accumulation micro-batches per step (static; divides B).
    remat: the student forward's rematerialisation (`model.layer_fn`; static).
    lr_schedule: the optimizer's schedule (`make_schedule`); when given, `opt/lr` is
      lr_schedule(state.step), the rate this update applies.

  Returns:
    (new state, metrics): f32 scalars under loss/*, teacher/*, mismatch/*, student/*,
    opt/*, perf/*, and per-token arrays [B, C] under per_token/*.

  GRPO with K = `loss_cfg.updates_per_batch` > 1 makes K optimizer updates on the batch
  (`grpo_updates`); with K = 1 it takes the path of every other loss.
  """
  if loss_cfg.updates_per_batch > 1:
    check_microbatches(loss_cfg, microbatches, rollout.batch_size)
    return grpo_updates(
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
    reference_lp_bc = _reference_lp(reference_params, rollout, student_cfg, loss_cfg)
    (loss, metrics), grads = grad_fn(state.params, teacher_params, rollout, *args, reference_lp_bc)
  else:  # no KL penalty here: grpo, the only loss with one, refuses micro-batches
    check_microbatches(loss_cfg, microbatches, rollout.batch_size)
    parts = split_microbatches(rollout, microbatches)
    w_k = losses.microbatch_weights(parts.completion_mask)

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
      sampled_w_k = losses.microbatch_weights(off_policy.sampled_rows(parts).completion_mask)
    metrics = combine_microbatch_metrics(metrics_k, w_k, sampled_w_k)
  if lr_schedule is not None:
    metrics = dict(metrics, **{"opt/lr": jnp.asarray(lr_schedule(state.step), jnp.float32)})
  return _apply(state, grads, tx, loss, metrics)


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


def split_microbatches(rollout: Rollout, microbatches: int, batch_size: int | None = None):
  """The rollout as K micro-batches stacked on a new leading axis: leaves [K, B/K, ...].

  Row j·K + k goes to micro-batch k (a strided split), so each micro-batch takes the same
  share of every device's contiguous block of rows. Scalars are repeated K times. Any pytree
  whose leaves are [B, ...] or scalars splits the same way when `batch_size` gives B.
  """
  k, b = microbatches, rollout.batch_size if batch_size is None else batch_size

  def split(x):
    if x.ndim == 0:
      return jnp.broadcast_to(x, (k,))
    return jnp.swapaxes(x.reshape(b // k, k, *x.shape[1:]), 0, 1)

  return jax.tree.map(split, rollout)


def combine_microbatch_metrics(metrics_k: dict, w_k, sampled_w_k=None) -> dict:
  """The full batch's metrics from K micro-batches' (leaves [K, ...], weights w_k [K]).

  Token means (almost every metric) combine as Σ_k w_k · x_k, exactly; `loss/num_tokens`
  sums; `*_max` takes the max; `per_token/*` go back to the batch's row order [B, C].
  Quantiles (`*_p95`) cannot be combined exactly: they read the token-weighted mean of
  the micro-batches' quantiles. `sampled_w_k` (the micro-batches' shares of the sampled
  tokens, when some rows are references: `opd_jax.rollout.off_policy`) weights `mismatch/*`, which
  average over sampled tokens only.
  """
  out = {}
  for key, x_k in metrics_k.items():
    if sampled_w_k is not None and key.startswith("mismatch/") and not key.endswith("_max"):
      out[key] = jnp.sum(sampled_w_k * x_k)
      continue
    if key.startswith("per_token/"):
      out[key] = jnp.swapaxes(x_k, 0, 1).reshape(-1, *x_k.shape[2:])
    elif key == "loss/num_tokens":
      out[key] = jnp.sum(x_k)
    elif key.endswith("_max"):
      out[key] = jnp.max(x_k)
    else:
      out[key] = jnp.sum(w_k * x_k)
  return out


def grpo_policy_loss(
  params,
  rollout: Rollout,
  advantage_b,
  old_lp_bc,
  student_cfg,
  loss_cfg: LossConfig,
  remat,
  reference_lp_bc=None,
):
  """`rl.grpo` of the student on (a minibatch of) `rollout` against log π_old = `old_lp_bc`
  (and, when β > 0, its KL penalty against log π_ref = `reference_lp_bc`); returns (loss,
  scalar metrics)."""
  raw_bcv, tokens_bc, mask_bc = teacher_forcing.completion_logits(
    params, rollout, student_cfg, loss_cfg.temperature, remat
  )
  student_bcv = student_policy_logits(raw_bcv, rollout)
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
    reference_logprobs=reference_lp_bc,
    kl_coef=loss_cfg.kl_coef,
  )


def _is_schedule_state(x) -> bool:
  import optax

  return isinstance(x, optax.ScaleByScheduleState)


def _schedule_counts(opt_state, like, increment: int = 0):
  """`opt_state` with every learning-rate schedule's step count taken from `like` (+ increment),
  the other leaves (Adam's moments and its own count) unchanged."""
  return jax.tree.map(
    lambda s, r: r._replace(count=r.count + increment) if _is_schedule_state(s) else s,
    opt_state,
    like,
    is_leaf=_is_schedule_state,
  )


def grpo_updates(
  state: TrainState,
  rollout: Rollout,
  *,
  tx,
  student_cfg,
  loss_cfg: LossConfig,
  remat: str = "none",
  lr_schedule=None,
  reference_params=None,
):
  """K = epochs × minibatches GRPO updates on one batch, in one jitted program.

  1. log π_old(y) of the student at the start (`state.params`): one forward pass, no
     gradient, which also gives the step's `mismatch/*` and `student/entropy`. With a KL
     penalty (β > 0), log π_ref(y) of `reference_params` too (`reference_logprobs`): one more
     forward pass, once per batch, split with the minibatches like log π_old.
  2. A_b over the whole batch (`grpo_advantages`: groups stay whole whatever the split).
  3. A `jax.lax.scan` over the K updates: update i takes minibatch i mod M (M =
     `ppo_minibatches`, the strided split of `split_microbatches`) and applies
     `rl.grpo`'s clipped loss against π_old (plus β · mean k3 against π_ref), then one `tx`
     update. Each minibatch's loss is its own token mean (over its kept tokens), as PPO
     implementations do.

  The learning-rate schedule advances once per train step, not once per update: every one
  of the K updates of step s uses lr(s) (Adam's own step count, its bias correction,
  advances K times). So `train.steps` and `opt/lr` keep their meaning.

  Returns:
    (new state, metrics): the scalars of the K updates averaged (`perf/grad_norm` the mean
    pre-clip norm, `perf/grad_norm_max` the largest; `rl/ppo_ratio_abs_dev_max` the
    largest), `rl/*` reward metrics (`rl/kl_ref`, `loss/kl_ref`: the K updates' mean), `mismatch/*`
    and `student/entropy` of π_old, and per_token/advantage_bc [B, C].
  """
  import optax

  if loss_cfg.temperature == 0:
    raise ValueError("loss 'grpo' needs sampled rollouts (rollout.temperature > 0)")
  advantage_b, reward_metrics = grpo_advantages(rollout, loss_cfg)
  raw_bcv, tokens_bc, mask_bc = teacher_forcing.completion_logits(
    state.params, rollout, student_cfg, loss_cfg.temperature, remat
  )
  old_bcv = jax.lax.stop_gradient(student_policy_logits(raw_bcv, rollout))
  old_lp_bc = jnp.where(mask_bc > 0, losses.token_logprobs(old_bcv, tokens_bc), 0.0)
  fixed = {"student/entropy": losses.masked_mean(losses.token_entropy(old_bcv), mask_bc)}
  fixed.update(mismatch.mismatch_metrics(old_bcv, rollout))
  del raw_bcv, old_bcv
  reference_lp_bc = _reference_lp(reference_params, rollout, student_cfg, loss_cfg)
  m = loss_cfg.ppo_minibatches
  parts = split_microbatches(
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
    opt_state = _schedule_counts(opt_state, start_opt)  # every update at lr(step)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), (loss, metrics, optax.tree.norm(grads))

  k = loss_cfg.updates_per_batch
  (params, opt_state), (loss_k, metrics_k, norm_k) = jax.lax.scan(
    update, (state.params, state.opt_state), jnp.arange(k)
  )
  opt_state = _schedule_counts(opt_state, start_opt, increment=1)
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
      "per_token/advantage_bc": advantage_b[:, None] * (mask_bc > 0),
    }
  )
  if lr_schedule is not None:
    metrics["opt/lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
  return new_state, metrics


def sft_loss(params, tokens_bt, loss_mask_bt, cfg: ModelConfig):
  """Next-token cross-entropy −mean_{t: m_t=1} log π_θ(x_t | x_<t), for pretraining."""
  logits_btv = model.forward(params, tokens_bt[:, :-1], cfg)
  logp_bt = losses.token_logprobs(logits_btv, tokens_bt[:, 1:])
  mask_bt = loss_mask_bt[:, 1:]
  loss = -losses.masked_mean(logp_bt, mask_bt)
  correct = jnp.argmax(logits_btv, axis=-1) == tokens_bt[:, 1:]
  return loss, {"loss/sft": loss, "quality/token_accuracy": losses.masked_mean(correct, mask_bt)}


def sft_step(state: TrainState, tokens_bt, loss_mask_bt, *, tx, cfg: ModelConfig):
  """One supervised update; `loss_mask_bt[b, t]` marks tokens that are targets."""
  (loss, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(
    state.params, tokens_bt, loss_mask_bt, cfg
  )
  return _apply(state, grads, tx, loss, metrics)


def jit_step(step_fn, state_shardings, **static):
  """`step_fn` partially applied to its static arguments, jitted with the state donated
  and the state's output sharding pinned to `state_shardings`."""
  fn = functools.partial(step_fn, **static)
  return jax.jit(fn, donate_argnums=0, out_shardings=(state_shardings, None))
