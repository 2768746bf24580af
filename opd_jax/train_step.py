"""Train state, optimizer and the pure, jittable train steps.

    train_step(state, teacher_params, rollout, rng) -> (state, metrics)

`TrainState` holds only what the optimizer changes (student params, optimizer
state, step) plus the run's RNG key. The teacher is passed as frozen data: it is
never in the optimizer state and never checkpointed. The step functions are pure;
the caller jits them with explicit shardings and donates the state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import struct

from opd_jax import losses, model
from opd_jax.model_config import ModelConfig
from opd_jax.rollout import Rollout


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
  u the fraction of the remaining steps done.
  """
  warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=lr,
    warmup_steps=warmup_steps,
    decay_steps=max(total_steps, warmup_steps + 1),
    end_value=0.1 * lr,
  )
  return optax.chain(
    optax.clip_by_global_norm(grad_clip), optax.adamw(schedule, weight_decay=weight_decay)
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
  is_clip: float | None = 2.0  # truncation C of the importance ratio; None disables
  jsd_beta: float = 0.5  # β for jsd (0 = forward KL, 1 = reverse KL)
  temperature: float = 1.0  # the sampler's temperature; student logits are divided by it

  def __post_init__(self):
    if self.name not in ("reverse_kl_sampled", "reverse_kl_full", "forward_kl", "jsd"):
      raise ValueError(f"unknown loss {self.name!r}")


def completion_logits(params, rollout: Rollout, cfg: ModelConfig, temperature: float = 1.0):
  """Teacher-forced logits over the rollout's completion tokens.

  Returns:
    (logits_bcv f32, where logits_bcv[b, c] is the distribution of completion
    token c of row b, divided by the temperature when it is > 0; tokens_bc; mask_bc).
  """
  seq = rollout.sequences()
  logits_btv = model.forward(params, seq.tokens_bt, cfg)
  logits_bcv = jnp.take_along_axis(logits_btv, seq.logit_index_bc[:, :, None], axis=1)
  if temperature > 0:
    logits_bcv = logits_bcv / temperature
  return logits_bcv, rollout.completion_tokens, rollout.completion_mask


def opd_loss(
  params,
  teacher_params,
  rollout: Rollout,
  student_cfg: ModelConfig,
  teacher_cfg: ModelConfig,
  loss_cfg: LossConfig,
):
  """The configured OPD loss of the student on `rollout`; returns (loss, metrics)."""
  # The student is scored at the sampler's temperature, so π_θ is the distribution the
  # rollout was drawn from when the engine is exact; the teacher stays at T = 1.
  student_bcv, tokens_bc, mask_bc = completion_logits(
    params, rollout, student_cfg, loss_cfg.temperature
  )
  teacher_bcv, _, _ = completion_logits(teacher_params, rollout, teacher_cfg)
  teacher_bcv = jax.lax.stop_gradient(teacher_bcv)
  if loss_cfg.name == "reverse_kl_sampled":
    loss, metrics = losses.reverse_kl_sampled(
      student_bcv,
      teacher_bcv,
      tokens_bc,
      mask_bc,
      rollout.behaviour_logprobs,
      is_clip=loss_cfg.is_clip,
    )
  elif loss_cfg.name == "reverse_kl_full":
    loss, metrics = losses.reverse_kl_full(student_bcv, teacher_bcv, mask_bc)
  elif loss_cfg.name == "forward_kl":
    loss, metrics = losses.forward_kl(student_bcv, teacher_bcv, mask_bc)
  else:
    loss, metrics = losses.jsd(student_bcv, teacher_bcv, mask_bc, beta=loss_cfg.jsd_beta)
  student_bcv = jax.lax.stop_gradient(student_bcv)
  teacher_lp_bc = losses.token_logprobs(teacher_bcv, tokens_bc)
  metrics = dict(metrics)
  if "teacher/reverse_kl" not in metrics:  # reverse_kl_full already reports it
    kl_bc = losses.per_token_kl(student_bcv, teacher_bcv)
    metrics["teacher/reverse_kl"] = losses.masked_mean(kl_bc, mask_bc)
  metrics["teacher/logprob"] = losses.masked_mean(teacher_lp_bc, mask_bc)
  # Per-token advantage A_t = log π_T(y_t) − log π_θ(y_t), for histograms.
  metrics["per_token/advantage_bc"] = teacher_lp_bc - losses.token_logprobs(student_bcv, tokens_bc)
  return loss, metrics


def _apply(state: TrainState, grads, tx, loss, metrics):
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, **{"loss/total": loss, "perf/grad_norm": optax.tree.norm(grads)})
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


def train_step(
  state: TrainState,
  teacher_params,
  rollout: Rollout,
  *,
  tx,
  student_cfg,
  teacher_cfg,
  loss_cfg: LossConfig,
):
  """One OPD update on a batch of (possibly off-policy) rollouts.

  Args:
    state: the TrainState (donated by the caller).
    teacher_params: frozen teacher params; no gradient, not in the optimizer.
    rollout: a version-tagged `Rollout` batch from the engine.
    tx: the optax transformation (static).
    student_cfg, teacher_cfg: model configs (static).
    loss_cfg: the loss (static).

  Returns:
    (new state, metrics): f32 scalars under loss/*, teacher/*, perf/*, and per-token
    arrays [B, C] under per_token/*.
  """
  grad_fn = jax.value_and_grad(opd_loss, has_aux=True)
  (loss, metrics), grads = grad_fn(
    state.params, teacher_params, rollout, student_cfg, teacher_cfg, loss_cfg
  )
  return _apply(state, grads, tx, loss, metrics)


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
