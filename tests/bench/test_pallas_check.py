"""bench.pallas_check's float64 reference against softmax(q·kᵀ/√H)·v computed directly, one
query row and head at a time, on a tiny cache."""

from __future__ import annotations

import numpy as np

from opd_jax.bench import pallas_check


def _direct(q_btnh, k_bskh, v_bskh, q_pos_bt, groups):
  """Loops: query (b, t, n) against the slots s ≤ q_pos[b, t] of KV head n // groups."""
  b_, t_, n_, h_ = q_btnh.shape
  out = np.zeros((b_, t_, n_, h_))
  for b in range(b_):
    for t in range(t_):
      for n in range(n_):
        last = q_pos_bt[b, t]
        k, v = k_bskh[b, : last + 1, n // groups], v_bskh[b, : last + 1, n // groups]
        scores = np.array([q_btnh[b, t, n] @ k[s] for s in range(last + 1)]) / np.sqrt(h_)
        weights = np.exp(scores - scores.max())
        out[b, t, n] = (weights / weights.sum()) @ v
  return out


def test_float64_reference_equals_the_direct_softmax():
  import jax.numpy as jnp

  from opd_jax.model import kvcache

  cfg = pallas_check.CFG  # N 4 query heads over K 2 KV heads of H 16
  rng = np.random.default_rng(0)
  batch, slots = 2, 6
  shape = (batch, slots, cfg.num_kv_heads, cfg.head_dim)
  k, v = rng.standard_normal(shape), rng.standard_normal(shape)
  k[1, 3:], v[1, 3:] = 1e4, 1e4  # row 1 sees slots 0..2 only: these must not leak in
  spec = kvcache.KVCacheSpec(dtype="float32")
  entry = kvcache.init_cache(cfg, batch, slots, spec)[0]
  entry = kvcache.write(
    entry,
    jnp.asarray(k, jnp.float32),
    jnp.asarray(v, jnp.float32),
    jnp.zeros(batch, jnp.int32),
    spec,
  )
  q = rng.standard_normal((batch, 2, cfg.num_heads, cfg.head_dim))
  q_pos_bt = np.array([[4, 5], [1, 2]])
  got = pallas_check.float64_attention(jnp.asarray(q, jnp.float32), entry, q_pos_bt, cfg)
  k32, v32, q32 = (np.asarray(np.float32(x), np.float64) for x in (k, v, q))  # as stored
  want = _direct(q32, k32, v32, q_pos_bt, cfg.num_heads // cfg.num_kv_heads)
  assert got.dtype == np.float64
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
  assert np.abs(got[1]).max() < 10  # the masked slots of 1e4 were not read
