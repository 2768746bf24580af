"""The sampler's jitted core (`inference.sampler` pads the inputs and assembles the `Rollout`):
`_sample_core` builds the KV cache on the device, prefills it with the padded prompts and runs
the `lax.while_loop` of one-token decode steps, keeping every batch-leading array in the batch
layout with a mesh (`_constrain`, `_constrain_cache`) and counting the K/V elements the FP8
cache clipped (`_clipped_b`); `trace_count` counts how often it was traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from opd_jax.inference import distribution
from opd_jax.model import kvcache, sharding
from opd_jax.model import transformer as model

_TRACES = 0


def trace_count() -> int:
  """How many times the jitted sampler core has been traced (≈ compiled)."""
  return _TRACES


def _constrain(x, mesh, dims: str | None = None):
  """x laid out with its batch (dim 0) over the mesh's batch axes: `dims` letters name
  every dimension (e.g. "btkh"), or None splits dim 0 only. Identity without a mesh."""
  if mesh is None:
    return x
  if dims is None:
    layout = sharding.batch_sharding(mesh, x.ndim)
  else:
    layout = sharding.logical_sharding(mesh, dims, x.shape)
  return jax.lax.with_sharding_constraint(x, layout)


@functools.partial(jax.jit, static_argnames=("cfg", "model_cfg", "cache_len", "mesh"))
def _sample_core(params, tokens_bp, lens_b, live_b, rng, cfg, model_cfg, cache_len, mesh=None):
  """Prefill + decode loop on padded inputs; returns a dict of [B, C(, k)] arrays.

  With a `mesh`, every batch-leading array is constrained to the batch layout (module
  docstring), so no step gathers the batch."""
  global _TRACES
  _TRACES += 1
  b, p = tokens_bp.shape
  c, s, spec = cfg.max_new_tokens, cache_len, cfg.kv
  v = model_cfg.real_vocab_size  # the logits' width: padded embedding rows are never sampled
  k = v if cfg.return_topk == -1 else min(cfg.return_topk, v)
  m = distribution.support_width(cfg, v)
  stops = jnp.asarray(cfg.stop_tokens or (-1,), jnp.int32)
  tokens_bp, lens_b, live_b = (_constrain(x, mesh) for x in (tokens_bp, lens_b, live_b))
  if mesh is not None:  # FSDP: gather the weights once, never the batch
    params = jax.lax.with_sharding_constraint(
      params, sharding.tree_shardings(params, mesh, sharding.DECODE_RULES)
    )

  out = {
    "tokens": jnp.zeros((b, c), jnp.int32),
    "mask": jnp.zeros((b, c), jnp.int32),
    "behaviour_lp": jnp.zeros((b, c), jnp.float32),
    "model_lp": jnp.zeros((b, c), jnp.float32),
  }
  if k:
    out["topk_lp"] = jnp.zeros((b, c, k), jnp.float32)
    out["tail_lp"] = jnp.zeros((b, c), jnp.float32)
    if k < v:
      out["topk_ids"] = jnp.zeros((b, c, k), jnp.int32)
  if m:
    out["support"] = jnp.zeros((b, c, m), jnp.int32)
  out = {name: _constrain(x, mesh) for name, x in out.items()}

  def record(out, done_b, i, logits_bv):
    """Samples token i from logits_bv and stores it for the rows not yet done."""
    key = jax.random.fold_in(rng, i)
    token_b, behaviour_b, model_b, dist, support_bm = distribution.choose_token(
      logits_bv, key, cfg, mesh
    )
    valid_b = ~done_b
    values = {
      "tokens": jnp.where(valid_b, token_b, 0),
      "mask": valid_b.astype(jnp.int32),
      "behaviour_lp": jnp.where(valid_b, behaviour_b, 0.0),
      "model_lp": jnp.where(valid_b, model_b, 0.0),
    }
    if dist is not None:
      topk_lp_bk, ids_bk, tail_b = dist
      values["topk_lp"] = topk_lp_bk
      values["tail_lp"] = tail_b
      if ids_bk is not None:
        values["topk_ids"] = ids_bk
    if support_bm is not None:
      values["support"] = support_bm
    out = {name: _constrain(out[name].at[:, i].set(values[name]), mesh) for name in out}
    stopped_b = jnp.any(token_b[:, None] == stops[None, :], axis=-1)
    # Token i sits at position len_b + i; feeding it needs that cache slot.
    full_b = lens_b + i >= s
    return out, done_b | stopped_b | full_b, token_b

  # Prefill positions 0 .. len_b − 2 (and padding). Its logits are unused, so XLA
  # drops the LM head over all P positions; step 0 below feeds the last prompt
  # token instead, rewriting its own slot, and samples token 0 from one row of
  # logits per sequence.
  cache = _constrain_cache(kvcache.init_cache(model_cfg, b, s, spec), mesh)
  t_prefill = min(p, s)  # every prompt fits in s, so columns ≥ s are padding
  _, cache = model.forward_with_cache(
    params,
    tokens_bp[:, :t_prefill],
    jnp.zeros((b,), jnp.int32),
    cache,
    model_cfg,
    spec,
    lens_b,
    attention=cfg.attention,
  )
  cache = _constrain_cache(cache, mesh)
  # K/V elements one token writes to the FP8 layers, and the clipped ones so far.
  fp8_per_token = 2 * model_cfg.num_kv_heads * model_cfg.head_dim
  fp8_per_token *= sum("k_scale" in entry for entry in cache)
  clipped = jnp.sum(jnp.where(live_b, _clipped_b(cache), 0)).astype(jnp.float32)
  written = jnp.sum(jnp.where(live_b, lens_b, 0)).astype(jnp.float32) * fp8_per_token
  last_b = jnp.take_along_axis(tokens_bp, (lens_b - 1)[:, None], axis=1)[:, 0]

  def cond(state):
    i, _, _, done_b, _, _ = state
    return (i < c) & ~jnp.all(done_b)

  def body(state):
    """Feeds the previous token at position len_b − 1 + i and samples token i."""
    i, cache, token_b, done_b, out, (clipped, written) = state
    pos_b = jnp.minimum(lens_b - 1 + i, s - 1)  # finished rows may run past the cache
    logits_b1v, cache = model.forward_with_cache(
      params, token_b[:, None], pos_b, cache, model_cfg, spec, attention=cfg.attention
    )
    cache = _constrain_cache(cache, mesh)
    logits_b1v = _constrain(logits_b1v, mesh, "btv")
    clipped += jnp.sum(jnp.where(done_b, 0, _clipped_b(cache))).astype(jnp.float32)
    written += jnp.sum(~done_b).astype(jnp.float32) * fp8_per_token
    out, done_b, token_b = record(out, done_b, i, logits_b1v[:, 0])
    return i + 1, cache, token_b, done_b, out, (clipped, written)

  state = (jnp.int32(0), cache, last_b, ~live_b, out, (clipped, written))
  *_, out, (clipped, written) = jax.lax.while_loop(cond, body, state)
  out["kv_saturated_fraction"] = clipped / jnp.maximum(written, 1.0)
  return out


def _constrain_cache(cache, mesh):
  """The KV cache laid out [B over data·fsdp, K over tensor, S, H] (scales alike)."""
  if mesh is None:
    return cache
  return [
    {name: _constrain(x, mesh, "bkth"[: x.ndim]) for name, x in entry.items()} for entry in cache
  ]


def _clipped_b(cache) -> jax.Array:
  """int32 [B]: K/V elements the last cache write clipped, summed over the layers."""
  total_b = jnp.zeros(cache[0]["k"].shape[:1], jnp.int32)
  for entry in cache:
    if "k_clipped" in entry:
      total_b = total_b + entry["k_clipped"] + entry["v_clipped"]
  return total_b
