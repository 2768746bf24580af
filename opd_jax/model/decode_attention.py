"""Attention over the filled prefix of a KV cache, in blocks, with an online softmax.

`transformer.attend` over a whole cache costs O(S) per query whatever its position: it
reads and masks every one of the S slots, and an FP8 cache is first dequantized in full
(`kvcache.read`). `attend_cache` reads the cache of one layer in blocks of `block` slots
and visits only the blocks at or before the largest query position of the batch, so a
decode step at position p costs O(p), and a completion O(T²/2) rather than O(T · S).

The loop over blocks j = 0 .. ⌈(max_b,t q_pos + 1) / block⌉ − 1 is a `lax.fori_loop`
with a traced bound (a `while` loop in the HLO). Block j covers slots
[j·block, (j + 1)·block); its slice starts at min(j·block, S − block) so that it stays in
the buffer, and slots below j·block (already visited) are masked, as are slots after each
query's own position (rows of different lengths within the last block). Each block is
sliced from the stored cache and converted where it is consumed, so no full-precision copy
of the cache exists at any time. The cache is head-major ([B, K, S, H], `kvcache`), so a block
of one KV head is contiguous and enters both products as it is: the G query heads of that KV
head and the T queries form R = G·T rows, the scores are a batched [block, H]·[H, R] product
per (b, k) and the weighted values [R, block]·[block, H] (`_scores`, `_weighted`).

Scaled (quantized) entries. A scale c_s is one per slot and KV head ("token_head") or one
per sequence ("tensor"), constant along H, which both products contract or keep, so it
factors out of them exactly:

    q·k_s = c^k_s · (q·k̂_s),     Σ_s p_s v_s = Σ_s (p_s · c^v_s) v̂_s,

with k̂, v̂ the stored values (e4m3, e5m2, e2m1), cast to the compute dtype, which holds
every one of them exactly. The f32 scores are scaled after the QKᵀ product and the f32
probabilities before the P·V product, on [B, K, R, block] arrays H / (G·T) times smaller
than the block: no per-element multiply and no rounding of k̂ · c to the compute dtype, which
`kvcache.read` (and the Pallas kernel) do, so with bf16 compute the two paths differ by that
rounding (2^-8 of an element), with f32 compute by f32 rounding. The pass that converts each
block is then a cast, as for a BF16 cache. The bf16_attention variant below keeps the
dequantize-then-cast order, as its reference does.

Online softmax (flash-decoding). With the scores s_i = q·k_i/√H of a query and its
visible keys, the running state after a block is

    m' = max(m, max_i s_i),   z' = z·e^(m − m') + Σ_i e^(s_i − m'),
    acc' = acc·e^(m − m') + Σ_i e^(s_i − m') v_i,

from m = −∞ (the f32 minimum, the mask value), z = 0, acc = 0; the output is acc / z,
which equals softmax(s)·v up to f32 rounding. P·V accumulates in f32 whatever the compute
dtype.

kernel="bf16_attention" (`transformer` module docstring) rounds the probabilities of the
normalised softmax to bf16, which an online softmax does not know until the last block.
That variant runs two passes over the blocks: the first computes m and z, the second
p_i = round_bf16(e^(s_i − m)/z) and Σ_i p_i v_i in f32, the numerics of the dense
variant. Scores are rounded as there: q and k in bf16, the product emitted in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.model import kvcache
from opd_jax.model.config import ModelConfig

BLOCK = 256  # cache slots read per block
_MASKED = jnp.finfo(jnp.float32).min  # the score of an invisible slot, as in transformer.attend


def _slice_slots(x_bks, start, size: int) -> jax.Array:
  """x[:, :, start : start + size] (the slot axis); a [B, 1, 1, 1] "tensor" scale is returned
  whole."""
  if kvcache.is_tensor_scale(x_bks):
    return x_bks
  return jax.lax.dynamic_slice_in_dim(x_bks, start, size, axis=kvcache.SLOT_AXIS)


def block_kv(entry: dict, start, size: int, dtype) -> tuple[jax.Array, jax.Array]:
  """Slots start .. start + size − 1 of one layer's cache as (k, v) [B, K, size, H] in `dtype`.

  Stored bits are bit-cast to their values (`kvcache.as_values`); FP8 entries dequantize as
  f32(e4m3(k)) · k_scale (read through `kvcache.as_wide_values`, which gives the same f32)
  then cast to `dtype`: per element the value `kvcache.read` gives.
  """
  if "k_scale" not in entry:
    k = kvcache.as_values(_slice_slots(entry["k"], start, size))
    v = kvcache.as_values(_slice_slots(entry["v"], start, size))
    return k.astype(dtype), v.astype(dtype)
  k, c = kvcache.as_wide_values(_slice_slots(entry["k"], start, size))
  v, _ = kvcache.as_wide_values(_slice_slots(entry["v"], start, size))
  k = k.astype(jnp.float32) * (_slice_slots(entry["k_scale"], start, size) * c)
  v = v.astype(jnp.float32) * (_slice_slots(entry["v_scale"], start, size) * c)
  return k.astype(dtype), v.astype(dtype)


def block_values(entry: dict, start, size: int, dtype):
  """Slots start .. start + size − 1 of one layer's cache as the stored values and their scales.

  Returns:
    (k̂, v̂, k_scale, v_scale): k̂, v̂ [B, K, size, H] in `dtype`, the stored values read by
    `kvcache.as_wide_values` (on CPU an FP8 value divided by the power of two c, with the
    scales multiplied by it) and cast, exact for every cache format; the scales [B, K, 1, size]
    ("token_head") or [B, 1, 1, 1] ("tensor"), f32, laid out to multiply scores
    [B, K, R, size], or None for an unscaled (f32, bf16) cache. k = k̂ · k_scale up to the
    rounding `block_kv` adds.
  """
  if "k_scale" not in entry:
    k = kvcache.as_values(_slice_slots(entry["k"], start, size)).astype(dtype)
    v = kvcache.as_values(_slice_slots(entry["v"], start, size)).astype(dtype)
    return k, v, None, None
  k, c = kvcache.as_wide_values(_slice_slots(entry["k"], start, size))
  v, _ = kvcache.as_wide_values(_slice_slots(entry["v"], start, size))
  k, v = k.astype(dtype), v.astype(dtype)

  def scale(name):  # [B, K, size, 1] or [B, 1, 1, 1] -> [B, K, 1, size] or [B, 1, 1, 1]
    return jnp.swapaxes(_slice_slots(entry[name], start, size), 2, 3) * c

  return k, v, scale("k_scale"), scale("v_scale")


def num_blocks(q_pos_bt, slots: int, block: int = BLOCK):
  """⌈(max q_pos + 1) / block⌉ (traced): the blocks a query at the largest position needs."""
  size = min(block, slots)
  last = jnp.clip(jnp.max(q_pos_bt), 0, slots - 1)
  return last // size + 1


def _batched_f32(lhs, rhs):
  """Σ_c lhs[b, k, m, c] · rhs[b, k, c, n] with an f32 result: a batched product over (b, k).

  bf16 operands multiply exactly in f32 and accumulate there, which is what a bf16 product
  with an f32 result means; on CPU they are widened first, because XLA:CPU's dot runtime
  rejects bf16 × bf16 = f32 for some shapes (GPUs and TPUs take them as they are)."""
  if jax.default_backend() == "cpu":
    lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  return jax.lax.dot_general(
    lhs, rhs, (((3,), (2,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32
  )


def _scores(k_bksh, q_bkhr):
  """s[b, k, r, s] = Σ_h q[b, k, h, r] · k[b, k, s, h] in f32: the block as the left operand of
  a batched [size, H]·[H, R] product (no operand of block size is transposed), then the small
  [size, R] result turned to [R, size].

  On CPU an optimization barrier keeps XLA from folding that transpose into the product:
  folded, it becomes q·kᵀ with the block contracted over its minor axis, which XLA:CPU runs
  with Eigen instead of XNNPACK, at about 2 ms per layer for batch 64 × 104 slots of
  qwen3-50m (a fifth of the decode step). Kept apart, the step at S 4096 ran 0.98–1.14× as
  fast as before at batch 1 and 1.00–1.54× at batch 16, 1.30–1.54× at t = 4000
  (docs/bench/decode_scaling.md, "The scores' transpose"). GPUs and TPUs take either form of
  the product, so there the transpose may fold."""
  s_bksr = _batched_f32(k_bksh, q_bkhr)
  if jax.default_backend() == "cpu":
    s_bksr = jax.lax.optimization_barrier(s_bksr)
  return jnp.swapaxes(s_bksr, 2, 3)


def _weighted(p_bkrs, v_bksh):
  """Σ_s p[b, k, r, s] · v[b, k, s, h] in f32: a batched [R, size]·[size, H] product."""
  return _batched_f32(p_bkrs, v_bksh)


def attend_cache(
  q_btnh,
  entry: dict,
  q_pos_bt,
  cfg: ModelConfig,
  kernel: str = "reference",
  block: int = BLOCK,
):
  """softmax(q·kᵀ/√H + mask)·v over the filled prefix of one layer's cache (module docstring).

  Slot s holds the key of position s; query (b, t) sees slots s ≤ q_pos[b, t]. The G query
  heads of a KV head and the T queries form R = G·T rows (r = g·T + t), so that each block
  enters two batched products per (b, k) with no transpose of the block (`_scores`,
  `_weighted`).

  Args:
    q_btnh: queries [B, T, N, H] in the compute dtype (T = 1 in decode, the prompt in prefill).
    entry: one layer's cache dict (`kvcache` layout), already holding the new tokens.
    q_pos_bt: int positions [B, T] of the queries (< S).
    cfg: the model config (K, G).
    kernel: "bf16_attention" for the two-pass bf16 variant, anything else for f32 scores.
    block: slots per block (a block of min(block, S) slots).

  Returns:
    [B, T, N, H] in q's dtype.
  """
  b, t, n, h = q_btnh.shape
  kh, g = cfg.num_kv_heads, cfg.num_groups
  rows = g * t
  slots = entry["k"].shape[kvcache.SLOT_AXIS]
  size = min(block, slots)
  low = kernel == "bf16_attention"
  dtype = q_btnh.dtype
  # [B, T, K, G, H] -> [B, K, H, G, T] -> [B, K, H, R]: the small operand carries the transpose.
  q_bkhr = q_btnh.reshape(b, t, kh, g, h).transpose(0, 2, 4, 3, 1).reshape(b, kh, h, rows)
  if low:
    q_bkhr = q_bkhr.astype(jnp.bfloat16)
  # Row r = g·T + t sees slots ≤ q_pos[b, t].
  pos_br = jnp.tile(q_pos_bt, (1, g))
  trips = num_blocks(q_pos_bt, slots, size)

  def scores(j):
    """Scores [B, K, R, size] of block j (masked), its values [B, K, size, H] and their
    scale [B, K, 1, size] (or [B, 1, 1, 1]; None when the values are dequantized)."""
    nominal = j * size
    start = jnp.minimum(nominal, slots - size)
    if low:
      k_bksh, v_bksh = block_kv(entry, start, size, dtype)
      k_scale = v_scale = None
      k_bksh = k_bksh.astype(jnp.bfloat16)
    else:
      k_bksh, v_bksh, k_scale, v_scale = block_values(entry, start, size, dtype)
    s_bkrs = _scores(k_bksh, q_bkhr)
    if low:
      s_bkrs = (s_bkrs.astype(jnp.bfloat16) * jnp.bfloat16(h**-0.5)).astype(jnp.float32)
    elif k_scale is None:
      s_bkrs = s_bkrs * (h**-0.5)
    else:
      s_bkrs = s_bkrs * (k_scale * h**-0.5)
    slot_s = start + jnp.arange(size)
    visible_brs = (slot_s[None, None, :] <= pos_br[:, :, None]) & (slot_s >= nominal)
    return jnp.where(visible_brs[:, None], s_bkrs, _MASKED), v_bksh, v_scale

  m0 = jnp.full((b, kh, rows), _MASKED, jnp.float32)  # running max m
  z0 = jnp.zeros((b, kh, rows), jnp.float32)
  acc0 = jnp.zeros((b, kh, rows, h), jnp.float32)

  def output(acc_bkrh):
    out = acc_bkrh.reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4)
    return out.astype(dtype).reshape(b, t, n, h)

  if not low:

    def online(j, state):
      m, z, acc = state
      s_bkrs, v_bksh, v_scale = scores(j)
      m_new = jnp.maximum(m, jnp.max(s_bkrs, axis=-1))
      alpha = jnp.exp(m - m_new)
      p_bkrs = jnp.exp(s_bkrs - m_new[..., None])
      z = z * alpha + jnp.sum(p_bkrs, axis=-1)
      if v_scale is not None:
        p_bkrs = p_bkrs * v_scale  # Σ_s p_s · c_s · v̂_s: the values' scale, not z's
      acc = acc * alpha[..., None] + _weighted(p_bkrs, v_bksh)
      return m_new, z, acc

    _, z, acc = jax.lax.fori_loop(0, trips, online, (m0, z0, acc0))
    return output(acc / z[..., None])

  def stats(j, state):
    m, z = state
    s_bkrs, _, _ = scores(j)
    m_new = jnp.maximum(m, jnp.max(s_bkrs, axis=-1))
    z = z * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s_bkrs - m_new[..., None]), axis=-1)
    return m_new, z

  m, z = jax.lax.fori_loop(0, trips, stats, (m0, z0))

  def weighted(j, acc):
    s_bkrs, v_bksh, _ = scores(j)
    p_bkrs = (jnp.exp(s_bkrs - m[..., None]) / z[..., None]).astype(jnp.bfloat16)
    return acc + _weighted(p_bkrs, v_bksh.astype(jnp.bfloat16))

  return output(jax.lax.fori_loop(0, trips, weighted, acc0))
