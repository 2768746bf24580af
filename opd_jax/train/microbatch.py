"""Micro-batches of one batch: the strided split, the token weights that make their gradients
sum to the whole batch's, and the whole batch's metrics from theirs.

Used by the OPD step's gradient accumulation (`train_step.train_step` with `train.microbatches`
= K > 1) and by GRPO's minibatch updates (`rl_step.grpo_updates`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.data.rollout_types import Rollout


def microbatch_weights(mask_kbt):
  """w_k = N_k / max(N, 1) for micro-batches k of one batch: N_k = Σ_{b,t} m_kbt counted
  tokens of micro-batch k, N = Σ_k N_k the whole batch's.

  Every OPD loss (`losses`) is a token mean over its (micro-)batch,
  loss_k = Σ_{b,t∈k} m ℓ / max(N_k, 1).
  Micro-batch k's term is loss_k · w_k, so (an empty micro-batch has loss_k = 0)

      Σ_k w_k · loss_k = Σ_k Σ_{b,t∈k} m ℓ / max(N, 1) = loss of the whole batch,
      Σ_k w_k · ∇loss_k = ∇loss of the whole batch,

  i.e. the token mean is normalised by the whole batch's token count N, not each
  micro-batch's N_k. (Exact for per-token terms; a term that couples rows, such as the
  `batch_mean` baseline, is not split this way.)

  Args:
    mask_kbt: [K, B/K, T] the completion mask of each micro-batch.

  Returns:
    [K] f32 weights summing to 1 (to 0 when the batch has no counted token).
  """
  n_k = jnp.sum(mask_kbt.astype(jnp.float32).reshape(mask_kbt.shape[0], -1), axis=1)
  return n_k / jnp.maximum(jnp.sum(n_k), 1.0)


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
