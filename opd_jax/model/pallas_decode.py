"""Decode attention over the KV cache as a Pallas kernel (opt-in: attention="pallas").

What it computes is `decode_attention.attend_cache` (the XLA blockwise path, which stays the
reference and the CPU path): softmax(q·kᵀ/√H + mask)·v over the filled prefix of one layer's
cache, query (b, t) seeing slots s ≤ q_pos[b, t], with grouped KV heads (G = N / K query heads
per KV head). The kernel reads the cache's stored bits (`kvcache` layout: f32, uint16 bf16 bits,
uint8 e4m3 bits with "token_head" [B, K, S, 1] or "tensor" [B, 1, 1, 1] f32 scales) one block
of `block` slots at a time, bit-casts and dequantizes each block inside the kernel,

    k = dtype(f32(e4m3(bits)) · k_scale)   (FP8),   k = dtype(bits as bf16 / f32)   (else),

exactly as `kvcache.read` does per element, and keeps an online softmax per query row. With
the scores s_j = q·k_j/√H of a block (invisible slots set to the f32 minimum),

    m' = max(m, max_j s_j),   l' = l·e^(m − m') + Σ_j e^(s_j − m'),
    o' = o·e^(m − m') + Σ_j e^(s_j − m') v_j,

from m = f32 min, l = 0, o = 0; the output is o / l. Scores, probabilities and P·V are f32
whatever the compute dtype; q and each dequantized block are rounded to the compute dtype first,
as `kvcache.read` does (the blockwise path scales a quantized block's scores and probabilities
instead), so the two agree to f32 rounding, and with a quantized cache and bf16 compute to the
bf16 rounding of a dequantized element (tests/model/test_pallas_decode.py).

Layout inside the kernel. The T queries of a row and the G query heads of one KV head form
R = T·G query rows (row r = t·G + g), padded to a power of two of at least `MIN_ROWS` = 16 so
that the two matmuls per block, [R, H]·[H, block] and [R, block]·[block, H], have the operand
sizes Triton requires (powers of two, ≥ 16 for `dot`) and a whole number of TPU sublane tiles
(H and the block must be powers of two for Triton as well). Padded rows repeat the last
row's position and are dropped from the output. Block slots are masked where s < j·block
(a clamped last block re-reading earlier slots), s > the row's position, or s ≥ S; values of
masked slots are zeroed so that stale or uninitialised slots cannot leak a NaN into P·V.

Two drivers share the per-block update (`_block_update`):

* "loop" (the structure of jax's `pallas/ops/gpu/decode_attention.py`): grid (B, K), one program
  per row and KV head, whose refs span the row's S slots of that head; an in-kernel
  `fori_loop` with a data-dependent trip count ⌈(max position of the row + 1) / block⌉ loads
  `block` slots per step (`pl.ds`). Rows of different lengths stop at their own last block.
  Triton reads refs from global memory, so only the visited blocks are read.
* "grid" (the structure of jax's TPU kernels, `pallas/ops/tpu/flash_attention.py` and
  `paged_attention`): grid (B, ⌈S / block⌉) with the block axis sequential ("arbitrary"), each
  step's [K, block, H] tile (the cache's head-major layout; last two dims the block and the
  full H, as Mosaic's tiling rule requires for a block that is a multiple of 8) DMA'd to VMEM
  by the pipeline; the running m, l, o live in VMEM scratch. The last live block of each row
  is scalar-prefetched, and the index map clamps later block indices to it, so the pipeline
  issues no copy for them (same block index) and `pl.when` skips their compute.

Default driver: "grid" on TPU, "loop" elsewhere. Default `interpret`: True on CPU.

Where it has run. Only on CPU, and the numbers only from Pallas' interpret modes: both
drivers under the generic interpreter (`interpret=True`), and the "grid" driver also under the
TPU interpreter (`pltpu.InterpretParams`), which simulates Mosaic's memories and the
pipeline's copies and raises on an out-of-bounds read. Neither has run on a GPU or TPU. What is
checked beyond that (tests/model/test_pallas_decode.py): `jax.export` for platform "tpu" lowers the
"grid" driver to a Mosaic custom call, and for "cuda" the "loop" driver to Triton IR
(`pltriton.CompilerParams`: Triton, not Mosaic GPU), with a CPU-only jaxlib; the compilers
behind them (Mosaic in libtpu, Triton in XLA:GPU) never ran, so whether they accept the kernels,
and how fast they are, is not known. Triton's rule that every array's size is a power of two is
why a block holds a power of two of slots (`block` rounded down); FP8 bit-casts and e4m3 → f32
conversion need hardware support (recent GPUs; TPU generations vary); the f32 matmuls request
`Precision.HIGHEST` so that a GPU does not drop to TF32. Under a sharded sampler
(`sampler.sample(..., mesh=)`) the call is not wrapped in `shard_map`: the interpreter's plain
HLO is partitioned like any other, a compiled kernel would need the wrapper. The interpreter
emulates the block specs by slicing, so the "loop" driver there copies each row's [S, H] stored
bits per step: its cost on CPU says nothing about the kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from opd_jax.model import kvcache
from opd_jax.model.config import ModelConfig

BLOCK = 256  # cache slots per block (a power of two, a multiple of the TPU sublane tiles)
MIN_ROWS = 16  # query rows per KV head are padded to a power of two ≥ this
MAX_QUERIES = 8  # forward_with_cache uses the kernel for T ≤ this; longer (prefill) is blockwise
DRIVERS = ("loop", "grid")
_MASKED = jnp.finfo(jnp.float32).min  # the score of an invisible slot, as in decode_attention


def _dequantize(bits, scale, dtype) -> jax.Array:
  """Stored cache bits → f32 values rounded to `dtype`: f32(e4m3)·scale for FP8 (module
  docstring); `scale` is None for unscaled (f32, bf16) caches."""
  x = kvcache.as_values(bits)
  if scale is None:
    return x.astype(dtype).astype(jnp.float32)
  return (x.astype(jnp.float32) * scale).astype(dtype).astype(jnp.float32)


def _block_update(state, q_rh, k_bits, v_bits, k_scale, v_scale, pos_r1, nominal, start, *, dims):
  """One block's online-softmax step for R query rows of one KV head (module docstring).

  Args:
    state: (m [R, 1], l [R, 1], o [R, H]) f32, the running max, sum and weighted values.
    q_rh: queries [R, H] f32 (already rounded to the compute dtype).
    k_bits, v_bits: the block's stored entries [size, H] (storage dtype).
    k_scale, v_scale: their FP8 scales ([size, 1] or [1, 1]) or None.
    pos_r1: int32 [R, 1], each row's position.
    nominal: the block's first new slot j·size; slots below it were visited already.
    start: the block's first slot as read (min(nominal, S − size), or nominal).
    dims: (size, slots S, 1/√H, compute dtype) (static).

  Returns:
    The updated (m, l, o).
  """
  size, slots, sm_scale, dtype = dims
  m_r1, l_r1, o_rh = state
  k_sh = _dequantize(k_bits, k_scale, dtype)
  v_sh = _dequantize(v_bits, v_scale, dtype)
  slot_1s = start + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
  slot_s1 = start + jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0)
  visible_rs = (slot_1s <= pos_r1) & (slot_1s >= nominal) & (slot_1s < slots)
  live_s1 = (slot_s1 <= jnp.max(pos_r1)) & (slot_s1 >= nominal) & (slot_s1 < slots)
  v_sh = jnp.where(live_s1, v_sh, 0.0)
  s_rs = jax.lax.dot_general(
    q_rh,
    k_sh,
    (((1,), (1,)), ((), ())),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  s_rs = jnp.where(visible_rs, s_rs * sm_scale, _MASKED)
  m_new = jnp.maximum(m_r1, jnp.max(s_rs, axis=1, keepdims=True))
  alpha_r1 = jnp.exp(m_r1 - m_new)
  p_rs = jnp.exp(s_rs - m_new)
  l_new = l_r1 * alpha_r1 + jnp.sum(p_rs, axis=1, keepdims=True)
  pv_rh = jnp.dot(
    p_rs, v_sh, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
  )
  return m_new, l_new, o_rh * alpha_r1 + pv_rh


def _loop_kernel(q_ref, pos_ref, k_ref, v_ref, *rest, dims, scaled: bool, tensor_scale: bool):
  """The "loop" driver's program (b, k): refs q [R, H], pos [R, 1], k/v [S, H], optional
  scales [S, 1] ("token_head") or [1, 1] ("tensor"), output [R, H]."""
  if scaled:
    ks_ref, vs_ref, o_ref = rest
  else:
    (o_ref,) = rest
  size, slots, _, _ = dims
  q_rh = q_ref[...].astype(jnp.float32)
  pos_r1 = pos_ref[...]
  trips = jnp.minimum(jnp.clip(jnp.max(pos_r1), 0, slots - 1) // size + 1, pl.cdiv(slots, size))

  def body(j, state):
    nominal = j * size
    start = jnp.minimum(nominal, slots - size)
    window = pl.ds(start, size)
    k_scale = v_scale = None
    if scaled:
      k_scale = ks_ref[...] if tensor_scale else ks_ref[window, :]
      v_scale = vs_ref[...] if tensor_scale else vs_ref[window, :]
    return _block_update(
      state, q_rh, k_ref[window, :], v_ref[window, :], k_scale, v_scale, pos_r1, nominal, start,
      dims=dims,
    )  # fmt: skip

  rows, h = q_rh.shape
  state = (
    jnp.full((rows, 1), _MASKED, jnp.float32),
    jnp.zeros((rows, 1), jnp.float32),
    jnp.zeros((rows, h), jnp.float32),
  )
  _, l_r1, o_rh = jax.lax.fori_loop(0, trips, body, state)
  o_ref[...] = (o_rh / l_r1).astype(o_ref.dtype)


def _grid_kernel(
  last_ref, q_ref, pos_ref, k_ref, v_ref, *rest, dims, scaled: bool, tensor_scale: bool, kv_heads
):
  """The "grid" driver's program (b, j): refs q [K, R, H], pos [R, 1], k/v [K, size, H], optional
  scales [K, size, 1] or [1, 1, 1], output [K, R, H]; scratch m, l [K, R, 1] and o [K, R, H]."""
  if scaled:
    ks_ref, vs_ref, o_ref, m_ref, l_ref, acc_ref = rest
  else:
    o_ref, m_ref, l_ref, acc_ref = rest
  size, _, _, _ = dims
  b, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(j <= last_ref[b])
  def _step():
    pos_r1 = pos_ref[...]
    for head in range(kv_heads):  # static: K is small and Mosaic prefers 2-D matmuls
      k_scale = v_scale = None
      if scaled:  # one [1, 1] scale for every head, or the head's [size, 1] column
        which = 0 if tensor_scale else head
        k_scale, v_scale = ks_ref[which], vs_ref[which]
      state = (m_ref[head], l_ref[head], acc_ref[head])
      q_rh = q_ref[head].astype(jnp.float32)
      m_r1, l_r1, o_rh = _block_update(
        state, q_rh, k_ref[head], v_ref[head], k_scale, v_scale, pos_r1,
        j * size, j * size, dims=dims,
      )  # fmt: skip
      m_ref[head], l_ref[head], acc_ref[head] = m_r1, l_r1, o_rh

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def default_driver() -> str:
  """ "grid" on TPU, "loop" on every other backend (module docstring)."""
  return "grid" if jax.default_backend() == "tpu" else "loop"


@functools.partial(jax.jit, static_argnames=("cfg", "block", "driver", "interpret"))
def attend_cache(
  q_btnh,
  entry: dict,
  q_pos_bt,
  cfg: ModelConfig,
  block: int = BLOCK,
  driver: str | None = None,
  interpret: bool | None = None,
):
  """softmax(q·kᵀ/√H + mask)·v over one layer's cache, as a Pallas kernel (module docstring).

  Args:
    q_btnh: queries [B, T, N, H] in the compute dtype (T a decode step's few tokens).
    entry: one layer's cache dict (`kvcache` layout), already holding the new tokens.
    q_pos_bt: int positions [B, T] of the queries; query (b, t) sees slots ≤ q_pos[b, t].
    cfg: the model config (K, G).
    block: slots per block; a block holds min(block, S) rounded down to a power of two
      (Triton's rule for every array in a kernel), the last one clamped to end at S.
    driver: "loop" or "grid"; None picks `default_driver()`.
    interpret: run in Pallas' interpret mode; None means on CPU only.

  Returns:
    [B, T, N, H] in q's dtype.
  """
  driver = driver or default_driver()
  if driver not in DRIVERS:
    raise ValueError(f"unknown driver {driver!r}; allowed: {', '.join(DRIVERS)}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  b, t, n, h = q_btnh.shape
  kh, g = cfg.num_kv_heads, cfg.num_groups
  slots = entry["k"].shape[kvcache.SLOT_AXIS]
  size = 1 << (min(block, slots).bit_length() - 1)  # the largest power of two ≤ min(block, S)
  rows = t * g
  padded = max(MIN_ROWS, 1 << (rows - 1).bit_length())  # a power of two ≥ rows
  dims = (size, slots, h**-0.5, q_btnh.dtype)
  # Row r = t·G + g of KV head k; padding rows repeat the last row (dropped at the end).
  q_bkrh = q_btnh.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, rows, h)
  q_bkrh = jnp.pad(q_bkrh, ((0, 0), (0, 0), (0, padded - rows), (0, 0)), mode="edge")
  pos_br = jnp.repeat(q_pos_bt.astype(jnp.int32), g, axis=1)
  pos_br1 = jnp.pad(pos_br, ((0, 0), (0, padded - rows)), mode="edge")[..., None]
  scaled = "k_scale" in entry
  tensor_scale = scaled and kvcache.is_tensor_scale(entry["k_scale"])
  operands = [q_bkrh, pos_br1, entry["k"], entry["v"]]
  if scaled:
    operands += [entry["k_scale"], entry["v_scale"]]
  out_shape = jax.ShapeDtypeStruct((b, kh, padded, h), q_btnh.dtype)

  if driver == "loop":
    kv_spec = pl.BlockSpec((None, None, slots, h), lambda i, k: (i, k, 0, 0))
    in_specs = [
      pl.BlockSpec((None, None, padded, h), lambda i, k: (i, k, 0, 0)),
      pl.BlockSpec((None, padded, 1), lambda i, k: (i, 0, 0)),
      kv_spec,
      kv_spec,
    ]
    if scaled:
      if tensor_scale:
        scale_spec = pl.BlockSpec((None, None, 1, 1), lambda i, k: (i, 0, 0, 0))
      else:
        scale_spec = pl.BlockSpec((None, None, slots, 1), lambda i, k: (i, k, 0, 0))
      in_specs += [scale_spec, scale_spec]
    kernel = functools.partial(_loop_kernel, dims=dims, scaled=scaled, tensor_scale=tensor_scale)
    out_bkrh = pl.pallas_call(
      kernel,
      grid=(b, kh),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, padded, h), lambda i, k: (i, k, 0, 0)),
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="opd_decode_attention_loop",
    )(*operands)
  else:
    # The last block each row needs, scalar-prefetched: the index maps clamp to it.
    last_b = jnp.clip(jnp.max(q_pos_bt, axis=1), 0, slots - 1).astype(jnp.int32) // size

    def block_index(i, j, last):
      return (i, 0, jnp.minimum(j, last[i]), 0)

    kv_spec = pl.BlockSpec((None, kh, size, h), block_index)
    in_specs = [
      pl.BlockSpec((None, kh, padded, h), lambda i, j, last: (i, 0, 0, 0)),
      pl.BlockSpec((None, padded, 1), lambda i, j, last: (i, 0, 0)),
      kv_spec,
      kv_spec,
    ]
    if scaled:
      if tensor_scale:
        scale_spec = pl.BlockSpec((None, 1, 1, 1), lambda i, j, last: (i, 0, 0, 0))
      else:
        scale_spec = pl.BlockSpec((None, kh, size, 1), block_index)
      in_specs += [scale_spec, scale_spec]
    grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, pl.cdiv(slots, size)),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, kh, padded, h), lambda i, j, last: (i, 0, 0, 0)),
      scratch_shapes=[
        pltpu.VMEM((kh, padded, 1), jnp.float32),
        pltpu.VMEM((kh, padded, 1), jnp.float32),
        pltpu.VMEM((kh, padded, h), jnp.float32),
      ],
    )
    kernel = functools.partial(
      _grid_kernel, dims=dims, scaled=scaled, tensor_scale=tensor_scale, kv_heads=kh
    )
    out_bkrh = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="opd_decode_attention_grid",
    )(last_b, *operands)

  out = out_bkrh[:, :, :rows].reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, t, n, h)
