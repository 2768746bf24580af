"""Teacher-forced logits at a rollout's completion positions: how every model scores a rollout.

The trainer's student, the frozen teacher, the admission check's π_θ and the evaluation all
score a rollout the same way: one `model.forward` over the concatenated prompt and completion
(`Rollout.sequences`), then the logits at the positions that predict each completion token:

    logits_bcv[b, c] = forward(params, tokens_bt)[b, logit_index_bc[b, c]] / temperature

`completion_logits` is that function; `sharded_completion_logits` is the same under a mesh,
with the batch kept split over data·fsdp and the vocabulary over tensor, so that scoring never
gathers the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from opd_jax.model import sharding
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig


def completion_logits(
  params, rollout, cfg: ModelConfig, temperature: float = 1.0, remat: str = "none"
):
  """Teacher-forced logits over the rollout's completion tokens (`remat`: `model.forward`'s).

  Returns:
    (logits_bcv f32, where logits_bcv[b, c] is the distribution of completion
    token c of row b, divided by the temperature when it is > 0; tokens_bc; mask_bc).
  """
  seq = rollout.sequences()
  logits_btv = model.forward(params, seq.tokens_bt, cfg, remat=remat)
  logits_bcv = jnp.take_along_axis(logits_btv, seq.logit_index_bc[:, :, None], axis=1)
  if temperature > 0:
    logits_bcv = logits_bcv / temperature
  return logits_bcv, rollout.completion_tokens, rollout.completion_mask


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def sharded_completion_logits(params, rollout, cfg: ModelConfig, mesh=None):
  """Teacher-forced logits at the rollout's completion positions (T = 1): (f32 [B, C, V],
  mask [B, C]), `completion_logits`.

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
  logits_bcv, _, mask_bc = completion_logits(params, rollout, cfg)
  if mesh is not None:
    logits_bcv = jax.lax.with_sharding_constraint(
      logits_bcv, sharding.logical_sharding(mesh, "btv", logits_bcv.shape)
    )
  return logits_bcv, mask_bc
