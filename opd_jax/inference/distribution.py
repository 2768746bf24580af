"""π_b, the distribution the engine samples from: temperature, top-k and top-p, the draw, the
token's log-probs and the kept set. Math in f32, for temperature T > 0:

    z = logits / T
    top-k:  z_j = -inf unless j is among the k largest z (exactly k tokens; ties at
            the k-th value go to the lower token id, as `jax.lax.top_k` orders them)
    top-p:  sort the surviving tokens by probability q (softmax of z); keep token j
            iff the mass of the tokens ranked above it is < p (the top token is
            always kept, and the kept set is the smallest whose mass reaches p). Ties:
            after top-k the ranking is top-k's (the lower id first); top-p alone keeps
            every token tied at the threshold (`filter_logits`), so with logits tied
            across the threshold a top-k that removes nothing can change the kept set
    π_b = softmax(z)  (renormalised over the kept set K_b)
    y ~ π_b by inverse-CDF sampling with key fold_in(rng, step)

T = 0 is greedy: y = argmax(logits) and π_b is the point mass on y, so the behaviour log-prob
is 0 (`data.rollout_types` has all log-prob conventions). The kept set travels with the rollout
(`Rollout.support_ids`), so that the trainer scores π_θ on K_b too (`filter_logits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.model import sharding


def _sortable_u32(x_bv):
  """Maps f32 to uint32 so that integer order is float order (-inf lowest; −0 and +0 one key,
  so a tie between them at the top-p threshold is kept whole)."""
  x_bv = jnp.where(x_bv == 0, 0.0, x_bv.astype(jnp.float32))
  bits = jax.lax.bitcast_convert_type(x_bv, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_threshold(key_bv, weight_bv, target_b1):
  """Per row, the largest uint32 τ with Σ_j weight_j · [key_j ≥ τ] ≥ target.

  The left side only decreases as τ grows, so τ is built bit by bit from the top
  (32 masked sums, no sort). It is always one of the row's keys. Requires the
  condition to hold at τ = 0 (the whole row).
  """

  def step(i, tau_b1):
    bit = jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
    cand_b1 = tau_b1 | bit
    mass_b1 = jnp.sum(jnp.where(key_bv >= cand_b1, weight_bv, 0), axis=-1, keepdims=True)
    return jnp.where(mass_b1 >= target_b1, cand_b1, tau_b1)

  return jax.lax.fori_loop(0, 32, step, jnp.zeros((key_bv.shape[0], 1), jnp.uint32))


def support_width(cfg, vocab_size: int) -> int:
  """M, the width of `Rollout.support_ids`: top_k with a top-k filter, V with top-p
  alone, 0 when nothing is filtered (or greedy, whose support is the sampled token)."""
  if cfg.temperature == 0:
    return 0
  if 0 < cfg.top_k < vocab_size:
    return cfg.top_k
  return vocab_size if cfg.top_p < 1.0 else 0


def filter_logits(logits_bv, cfg):
  """Temperature, top-k and top-p applied to logits (T > 0 only), with the kept set.

  top-k takes the k largest z with `jax.lax.top_k`, and top-p within them is a
  cumulative sum over those k sorted values. top-p alone avoids sorting the
  vocabulary (a full sort per step costs more than the model on CPU): it keeps
  z_j ≥ τ, where τ is the largest value whose upper set {i : z_i ≥ τ} holds
  mass ≥ p, which equals the sorted-order definition except that tokens tied
  exactly at τ are all kept.

  The kept set travels with the rollout (`Rollout.support_ids`) whenever a filter is on, so
  the trainer scores its student under the same filter (the "keep sampling mask" practice):
  π_θ = softmax(student logits / T) restricted to K_b and renormalised. Replaying the engine's
  own kept set, rather than re-running top-k/top-p on the trainer's logits, makes an exact
  engine read exactly zero mismatch (no boundary token flips between the two rankings) and
  keeps π_b and π_θ on one support, so KL(π_b ‖ π_θ) and the importance ratios stay finite for
  any engine.

  Args:
    logits_bv: raw logits [B, V].
    cfg: the sampler settings (`sampler.SamplerConfig`); `cfg.temperature` must be > 0.

  Returns:
    (z_bv, support_bm): f32 [B, V] processed logits (logits / T on kept tokens, -inf
    on removed ones; softmax(z) is π_b), and the kept set as int32 [B, M] token ids
    with -1 in unused slots (M = `support_width(cfg, V)`): with top-k the k largest
    tokens in descending order, those removed by top-p set to -1; with top-p alone
    slot j holds j if kept, else -1; None when nothing is filtered.
  """
  z_bv = logits_bv.astype(jnp.float32) / cfg.temperature
  b, v = z_bv.shape
  if 0 < cfg.top_k < v:
    top_z_bk, ids_bk = jax.lax.top_k(z_bv, cfg.top_k)
    keep_bk = top_z_bk > -jnp.inf  # masked logits (fewer than k finite) are not support
    if cfg.top_p < 1.0:
      q_bk = jax.nn.softmax(top_z_bk, axis=-1)
      keep_bk &= jnp.cumsum(q_bk, axis=-1) - q_bk < cfg.top_p  # mass ranked above < p
    rows_b1 = jnp.arange(b)[:, None]
    kept_bv = jnp.zeros((b, v), bool).at[rows_b1, ids_bk].set(keep_bk)
    return jnp.where(kept_bv, z_bv, -jnp.inf), jnp.where(keep_bk, ids_bk, -1)
  if cfg.top_p < 1.0:
    key_bv = _sortable_u32(z_bv)
    probs_bv = jax.nn.softmax(z_bv, axis=-1)
    tau_b1 = _largest_threshold(key_bv, probs_bv, jnp.float32(cfg.top_p))
    kept_bv = key_bv >= tau_b1
    support_bv = jnp.where(kept_bv, jnp.arange(v, dtype=jnp.int32), -1)
    return jnp.where(kept_bv, z_bv, -jnp.inf), support_bv
  return z_bv, None


def process_logits(logits_bv, cfg, mesh=None):
  """The processed logits z of `filter_logits` alone: softmax(z) is π_b ([B, V] f32).
  With a `mesh`, each batch shard filters its own rows (`per_shard`)."""
  return per_shard(lambda x_bv: filter_logits(x_bv, cfg)[0], mesh, logits_bv)


def per_shard(fn, mesh, *arrays):
  """fn applied to each batch shard's rows of `arrays` (a `jax.shard_map` over the mesh's
  batch axes, other dimensions gathered), or to the arrays as they are without a mesh.

  For row-wise functions only (row b of the output depends on row b of the inputs). XLA
  cannot split top-k or a scatter by rows on its own and would gather the batch to run
  them; inside the map every shard runs them on its rows.
  """
  if mesh is None:
    return fn(*arrays)
  spec = jax.sharding.PartitionSpec(sharding.batch_sharding(mesh, 1).spec[0])
  return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(*arrays)


def _argmax(x_bv):
  """First index of the row maximum (a plain max and min; XLA:CPU's argmax is slow)."""
  v = x_bv.shape[-1]
  idx_bv = jnp.arange(v, dtype=jnp.int32)
  is_max_bv = x_bv == jnp.max(x_bv, axis=-1, keepdims=True)
  return jnp.minimum(jnp.min(jnp.where(is_max_bv, idx_bv, v), axis=-1), v - 1)


def _last_positive(x_bn):
  """Index of the last entry > 0 in each row (0 if none)."""
  idx_bn = jnp.arange(x_bn.shape[-1], dtype=jnp.int32)
  return jnp.max(jnp.where(x_bn > 0, idx_bn, 0), axis=-1)


def sample_categorical(key, z_bv, block: int = 128):
  """One draw per row from softmax(z_bv) by inverting its CDF.

  y = min{j : Σ_{i≤j} p_i > u · Σ_i p_i} with one uniform u per row, found in two
  levels (blocks of `block` tokens, then tokens within the chosen block) so that
  no cumulative sum runs over the whole vocabulary. Tokens with p_j = 0 are never
  drawn. Exact up to f32 rounding of the partial sums; ~100× cheaper on CPU than
  Gumbel-max, which needs V random numbers and logs per row.

  Args:
    key: PRNG key.
    z_bv: f32 logits [B, V]; -inf marks zero probability (at least one finite).
    block: tokens per block.

  Returns:
    int32 token ids [B].
  """
  u_b1 = jax.random.uniform(key, (z_bv.shape[0], 1), jnp.float32)
  return _categorical(u_b1, z_bv, block)


def _categorical(u_b1, z_bv, block: int = 128):
  """`sample_categorical` with its uniforms u_b1 [B, 1] drawn."""
  b, v = z_bv.shape
  block = min(block, v)
  nb = -(-v // block)
  p_bv = jnp.exp(z_bv - jnp.max(z_bv, axis=-1, keepdims=True))
  p_bnk = jnp.pad(p_bv, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
  mass_bn = jnp.sum(p_bnk, axis=-1)
  cum_bn = jnp.cumsum(mass_bn, axis=-1)
  u_b1 = u_b1 * cum_bn[:, -1:]
  # Rounding can put u at the total; fall back to the last block (token) with mass.
  blk_b = jnp.minimum(jnp.sum(cum_bn <= u_b1, axis=-1), _last_positive(mass_bn))
  before_bn = jnp.pad(cum_bn[:, :-1], ((0, 0), (1, 0)))
  before_b1 = jnp.take_along_axis(before_bn, blk_b[:, None], axis=-1)
  inner_bk = jnp.take_along_axis(p_bnk, blk_b[:, None, None], axis=1)[:, 0]
  cum_bk = before_b1 + jnp.cumsum(inner_bk, axis=-1)
  tok_b = jnp.minimum(jnp.sum(cum_bk <= u_b1, axis=-1), _last_positive(inner_bk))
  return (blk_b * block + tok_b).astype(jnp.int32)


def choose_token(logits_bv, key, cfg, mesh=None):
  """Samples one token per row (each batch shard its own rows with a `mesh`).

  The uniforms are drawn for the whole batch before the rows are split, so row b's draw
  does not depend on the sharding.

  Returns:
    (token_b int32, behaviour_lp_b f32, model_lp_b f32, dist, support_bm) where dist
    is None or (topk_lp_bk, topk_ids_bk or None, tail_b) per `cfg.return_topk`, and
    support_bm the kept set of `filter_logits` (None when nothing is filtered).
  """
  logits_bv = logits_bv.astype(jnp.float32)
  if cfg.temperature == 0:
    return per_shard(lambda x_bv: _choose_rows(x_bv, None, cfg), mesh, logits_bv)
  u_b1 = jax.random.uniform(key, (logits_bv.shape[0], 1), jnp.float32)
  return per_shard(lambda x_bv, u: _choose_rows(x_bv, u, cfg), mesh, logits_bv, u_b1)


def _choose_rows(logits_bv, u_b1, cfg):
  """`choose_token` on rows of f32 logits with their uniforms (None when greedy)."""
  b, v = logits_bv.shape
  rows_b1 = jnp.arange(b)[:, None]
  if cfg.temperature == 0:
    token_b = _argmax(logits_bv)
    model_lp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    behaviour_lp_b = jnp.zeros((b,), jnp.float32)
    dist_lp_bv = None
    support_bm = None
  else:
    z_bv, support_bm = filter_logits(logits_bv, cfg)
    token_b = _categorical(u_b1, z_bv)
    model_lp_bv = jax.nn.log_softmax(logits_bv / cfg.temperature, axis=-1)
    dist_lp_bv = jax.nn.log_softmax(z_bv, axis=-1)
    behaviour_lp_b = jnp.take_along_axis(dist_lp_bv, token_b[:, None], axis=-1)[:, 0]
  model_lp_b = jnp.take_along_axis(model_lp_bv, token_b[:, None], axis=-1)[:, 0]

  dist = None
  if cfg.return_topk != 0:
    if dist_lp_bv is None:  # greedy: the point mass on the argmax
      dist_lp_bv = jnp.where(jnp.arange(v) == token_b[:, None], 0.0, -jnp.inf)
    if cfg.return_topk == -1 or cfg.return_topk >= v:
      dist = (dist_lp_bv, None, jnp.full((b,), -jnp.inf, jnp.float32))
    else:
      if cfg.temperature == 0:  # rank by the model so that the argmax comes first
        _, ids_bk = jax.lax.top_k(logits_bv, cfg.return_topk)
        topk_lp_bk = jnp.take_along_axis(dist_lp_bv, ids_bk, axis=-1)
      else:
        topk_lp_bk, ids_bk = jax.lax.top_k(dist_lp_bv, cfg.return_topk)
      rest_bv = dist_lp_bv.at[rows_b1, ids_bk].set(-jnp.inf)
      dist = (topk_lp_bk, ids_bk.astype(jnp.int32), jax.nn.logsumexp(rest_bv, axis=-1))
  return token_b, behaviour_lp_b, model_lp_b, dist, support_bm
