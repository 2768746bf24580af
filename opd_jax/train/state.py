"""The train state, its optimizer and learning-rate schedule, and jitting a step over it.

`TrainState` holds only what the optimizer changes (student params, optimizer state, step) plus
the run's base key, kept in the state so that it is checkpointed with it. The teacher (and
GRPO's reference student) are frozen data passed beside it: never in the optimizer state, never
checkpointed. Every step function over it is pure, `step(state, ...) -> (state, metrics)`; the
caller jits it with the state donated (`jit_step`). The steps themselves: the OPD step
(`train_step`), GRPO's K updates (`rl_step.grpo_updates`), the supervised step
(`pretrain.sft_step`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

# optax is imported by the functions that build or apply the optimizer. The admission check
# imports the train step for its scoring and never updates: optax would be 0.3 s of a 5 s check.
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


def apply_gradients(state: TrainState, grads, tx, loss, metrics):
  """One `tx` update of `state` by `grads`: (state at step + 1, metrics with `loss/total` =
  `loss` and `perf/grad_norm` = ‖grads‖₂ before clipping)."""
  import optax

  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, **{"loss/total": loss, "perf/grad_norm": optax.tree.norm(grads)})
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


def _is_schedule_state(x) -> bool:
  import optax

  return isinstance(x, optax.ScaleByScheduleState)


def schedule_counts(opt_state, like, increment: int = 0):
  """`opt_state` with every learning-rate schedule's step count taken from `like` (+ increment),
  the other leaves (Adam's moments and its own count) unchanged.

  Several updates per train step (`rl_step.grpo_updates`) use this to apply lr(step) at each of them
  and advance the schedule once.
  """
  return jax.tree.map(
    lambda s, r: r._replace(count=r.count + increment) if _is_schedule_state(s) else s,
    opt_state,
    like,
    is_leaf=_is_schedule_state,
  )


def jit_step(step_fn, state_shardings, **static):
  """`step_fn` partially applied to its static arguments, jitted with the state donated
  and the state's output sharding pinned to `state_shardings`."""
  fn = functools.partial(step_fn, **static)
  return jax.jit(fn, donate_argnums=0, out_shardings=(state_shardings, None))
