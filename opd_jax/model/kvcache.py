"""The decode KV cache: plain per-layer dicts plus pure write/read transforms.

Layout. `init_cache` returns a list with one dict per layer:

    {"k": [B, K, S, H], "v": [B, K, S, H]}                      # f32 layers
    {"k": [B, K, S, H] uint16, "v": [B, K, S, H] uint16}        # bf16 layers: bf16 bits
    {"k": [B, K, S, H] uint8 | int8, "v": same,                 # quantized layers: the bits
     "k_scale": [B, k, s, 1] f32, "v_scale": [B, k, s, 1] f32}  # of the format (below)
                                  # (k, s) = (K, S) for "token_head", (1, 1) for "tensor"

Slot `s` of sequence `b` holds the key/value of the token at position `s`; a query
at position p attends to slots 0..p. The layout is head-major ([B, K, S, H], the model's
activations are [B, T, K, H]): a block of slots of one KV head is contiguous, so decode
attention multiplies it in place, as a batched [slots, H]·[H, G·T] product per (b, k). With
[B, S, K, H] storage every block read was first transposed, and on 2 CPU cores those copies
cost more than the products (docs/bench/decode_scaling.md, "Head-major cache"). `as_values`
reads stored bits as their values (a bit-cast); quantized entries dequantize as
f32(q(k)) · k_scale, which the readers compute through `as_wide_values` (on CPU an 8-bit value
goes through f16, with the scale times a power of two: the same f32).

Quantized formats (`QUANTIZED_KV_DTYPES`, `rollout.kv_cache` name in brackets). Each
stores round_fmt(clip(x / scale, ±q_max)) with the scale of the granularity below, so
with q = x / scale the stored value q̂ obeys |q̂ − q| ≤ err(q):

  float8_e4m3fn [fp8]       q_max 448, 3 mantissa bits: err(q) = max(2^-4 |q|, 2^-10)
                            (2^-10 = half the subnormal step 2^-9). Stored as uint8 bits.
  float8_e5m2 [fp8_e5m2]    q_max 57344, 2 mantissa bits: err(q) = max(2^-3 |q|, 2^-17)
                            (half the subnormal step 2^-16), twice e4m3's relative step and
                            a range that cannot overflow a scaled row. Stored as int8 bits.
  float4_e2m1fn [fp4]       q_max 6, values {0, 0.5, 1, 1.5, 2, 3, 4, 6}, 1 mantissa bit:
                            err(q) = max(2^-2 |q|, 2^-2) (half of the spacing 0.5, 1, 2 of
                            [0, 2), [2, 4), [4, 6]). Stored as the uint8 bits of the e2m1
                            value cast to float8_e4m3fn, exact since every e2m1 value is an
                            e4m3 value: one byte per value, not two values packed per byte,
                            so its `bytes_per_token` is FP8's, not half of it. The e4m3 bits
                            (rather than the 4-bit e2m1 code zero-extended to a byte) let
                            every reader (`read`, the blockwise and Pallas attention) decode
                            it as FP8 with no format switch of its own.

The integer storage dtype names the value dtype (`_VALUES`: uint16 bf16, uint8 e4m3, int8
e5m2), so a reader that holds only the entry can bit-cast it; this is why e5m2 bits sit in
int8 rather than uint8: the same byte, a different tag.

Why integer storage. A BF16 or quantized layer stores the bits of its values in a uint16 or
8-bit integer array, so that a write updates the stored buffer in place. XLA:CPU lowers a
scatter into a bf16 buffer by converting the whole buffer to f32 and back (an e4m3 one via
f16), and a bit-cast of the whole buffer and back is itself a pass over it: either way a
decode step would touch every slot of every layer. With integer storage only the new tokens
are bit-cast, and `decode_attention` bit-casts each block it reads
(tests/model/test_decode_attention.py checks the compiled decode loop for any whole-cache copy or
conversion). The bytes are those of the values, so capacity (`bytes_per_token`) is
unchanged.

Scale granularity (`KVCacheSpec.granularity`), the capacity-versus-mismatch knob, for
every quantized format:

* "token_head": one scale per token and head ([B, K, S, 1]); the scale is
  amax(|k|)/q_max of that head's vector, so every entry uses the format's full range.
  Costs 4 bytes per token per head per K and V: 2·K·(H+4) bytes per token per layer.
* "tensor": one scale per layer and sequence ([B, 1, 1, 1]), calibrated at the
  first write (the prefill) as headroom · amax(|k|)/q_max over the prompt and then
  frozen; later tokens saturate at ±q_max·scale. 2·K·H bytes per token per layer
  plus the two f32 scales amortised over the S slots (8/S bytes), i.e. half of
  BF16 to within 8/S bytes: the most capacity, and the most mismatch.

Layers in `KVCacheSpec.bf16_layers` keep a BF16 cache whatever the quantized dtype.

Capacity accounting (`bytes_per_token`) reads the layout itself, so it works on a
real cache and on the abstract one from `abstract_cache` (shapes only, nothing
allocated), which is how model shapes too large for the host are measured.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from opd_jax.model.config import ModelConfig
from opd_jax.model.quant import FP8_DTYPE, FP8_MAX

# Quantized formats (module docstring): dtype name -> (the dtype a scaled entry rounds to,
# q_max: the magnitude a scale maps amax to).
_QUANTIZED = {
  "float8_e4m3fn": (FP8_DTYPE, FP8_MAX),  # 448
  "float8_e5m2": (jnp.float8_e5m2, float(jnp.finfo(jnp.float8_e5m2).max)),  # 57344
  "float4_e2m1fn": (jnp.float4_e2m1fn, float(jnp.finfo(jnp.float4_e2m1fn).max)),  # 6
}
QUANTIZED_KV_DTYPES = tuple(_QUANTIZED)
KV_DTYPES = ("bfloat16", "float32", *QUANTIZED_KV_DTYPES)
KV_GRANULARITIES = ("token_head", "tensor")
# `rollout.kv_cache` values other than "auto" (the engine's compute dtype) -> cache dtype.
KV_CACHE_NAMES = {
  "bf16": "bfloat16",
  "fp8": "float8_e4m3fn",
  "fp8_e5m2": "float8_e5m2",
  "fp4": "float4_e2m1fn",
}


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
  """Static description of the KV cache numerics (hashable, a jit static arg)."""

  dtype: str = "bfloat16"  # one of KV_DTYPES
  granularity: str = "token_head"  # quantized scale granularity, one of KV_GRANULARITIES
  bf16_layers: tuple[int, ...] = ()  # layers kept in BF16 when dtype is quantized
  tensor_headroom: float = 2.0  # "tensor" scale = headroom · prefill amax / q_max

  def __post_init__(self):
    if self.dtype not in KV_DTYPES:
      raise ValueError(f"unknown KV cache dtype {self.dtype!r}; allowed: {', '.join(KV_DTYPES)}")
    if self.granularity not in KV_GRANULARITIES:
      raise ValueError(
        f"unknown KV scale granularity {self.granularity!r}; allowed: {', '.join(KV_GRANULARITIES)}"
      )
    if self.tensor_headroom < 1.0:
      raise ValueError(f"tensor_headroom must be >= 1, got {self.tensor_headroom}")
    layers = self.bf16_layers
    if not isinstance(layers, tuple) or any(
      isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers
    ):
      raise ValueError(f"bf16_layers must be a tuple of non-negative ints, got {layers!r}")

  def layer_dtype(self, layer: int) -> str:
    """The dtype of `layer`'s cache: BF16 for a `bf16_layers` layer of a quantized cache."""
    if self.dtype in QUANTIZED_KV_DTYPES and layer in self.bf16_layers:
      return "bfloat16"
    return self.dtype

  @property
  def q_max(self) -> float:
    """The largest magnitude of the quantized format (ValueError for an unquantized dtype)."""
    return quantized_max(self.dtype)


def quantized_max(dtype: str) -> float:
  """q_max of a quantized KV dtype: 448 (e4m3), 57344 (e5m2), 6 (e2m1)."""
  if dtype not in _QUANTIZED:
    raise ValueError(
      f"KV cache dtype {dtype!r} is not quantized; quantized: {', '.join(QUANTIZED_KV_DTYPES)}"
    )
  return _QUANTIZED[dtype][1]


# Storage dtype of each cache dtype and the value dtype each storage dtype's bits are
# (module docstring, "Why integer storage"); e2m1 values are stored as e4m3 bits.
_STORAGE = {
  "float32": jnp.float32,
  "bfloat16": jnp.uint16,
  "float8_e4m3fn": jnp.uint8,
  "float8_e5m2": jnp.int8,
  "float4_e2m1fn": jnp.uint8,
}
_VALUES = {
  jnp.dtype(jnp.uint16): jnp.bfloat16,
  jnp.dtype(jnp.uint8): FP8_DTYPE,
  jnp.dtype(jnp.int8): jnp.float8_e5m2,
}


def storage_dtype(dtype: str):
  """The array dtype a cache of `dtype` (one of KV_DTYPES) is stored in."""
  return _STORAGE[dtype]


# The slot axis of every cache array ([B, K, S, H] values, [B, K, S, 1] scales).
SLOT_AXIS = 2


def is_tensor_scale(scale) -> bool:
  """Whether a scale array is the "tensor" granularity's one scale per sequence ([B, 1, 1, 1],
  broadcast over the slots) rather than one per token and head ([B, K, S, 1]). One slot alone
  does not say it: a one-slot token/head cache has [B, K, 1, 1] (the two agree when K = 1)."""
  return scale.shape[1] == 1 and scale.shape[SLOT_AXIS] == 1


def as_values(x):
  """The values of stored cache entries: uint16 bits as bf16, uint8 bits as e4m3 (which also
  holds e2m1 values), int8 bits as e5m2, f32 as is (a bit-cast: same bytes, no arithmetic)."""
  value_dtype = _VALUES.get(jnp.dtype(x.dtype))
  return x if value_dtype is None else jax.lax.bitcast_convert_type(x, value_dtype)


def as_wide_values(x) -> tuple[jax.Array, float]:
  """(v, c) with v · c = as_values(x) exactly, v in a dtype the backend widens to f32 cheaply.

  On CPU the 8-bit formats go through f16, which x86 widens to f32 in one instruction,
  where XLA:CPU converts e4m3 and e5m2 by a generic routine of its own (`bench.kernels`:
  1.64 against 1.82 ns per element for e4m3, 1.25 against 1.69 for e5m2; with it, FP8 KV
  decode at batch 16 gained 3–6 % against BF16: docs/bench/decode_scaling.md, "Converting
  FP8 blocks through f16").

  * uint8 (e4m3 bits s eeee mmm) → the f16 with bits s 0 eeee mmm 0000000: the same exponent
    field read with bias 15 instead of 7, so v = e4m3 · 2^-8 for normals and subnormals alike
    (an e4m3 subnormal m·2^-9 lands on the f16 subnormal m·2^-17), c = 256. The e4m3 NaN
    code (s 1111 111) is mapped to an f16 NaN, so a NaN stays a NaN.
  * int8 (e5m2 bits) → the f16 whose top byte they are: e5m2 is f16 with its low byte
    dropped, so v is the value itself, c = 1.
  * uint16 (bf16) and f32: `as_values`, c = 1.

  Other backends keep the format's own conversion (native on FP8 hardware): (as_values(x),
  1). A reader multiplies its scale by c (a power of two: no rounding is added).
  """
  dtype = jnp.dtype(x.dtype)
  if jax.default_backend() != "cpu" or dtype not in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.int8)):
    return as_values(x), 1.0
  wide = jax.lax.bitcast_convert_type(x, jnp.int8).astype(jnp.int16)  # sign-extended
  if dtype == jnp.dtype(jnp.int8):
    return jax.lax.bitcast_convert_type(wide << 8, jnp.float16), 1.0
  # wide << 7 puts e4m3's sign at bit 15 (from the sign extension) and a copy at bit 14,
  # which the mask clears: bit 14 is the top bit of f16's 5-bit exponent field.
  bits = (wide << 7) & jnp.int16(~0x4000)
  bits = jnp.where((x & 0x7F) == 0x7F, jnp.int16(0x7E00), bits)
  return jax.lax.bitcast_convert_type(bits, jnp.float16), 256.0


def _as_stored(x, stored_dtype):
  """x (f32 / bf16 / e4m3 / e5m2 / e2m1 values) in a cache's storage dtype: cast to the
  storage's value dtype (exact for values already in that format, and for e2m1 into e4m3),
  then bit-cast to bits."""
  value_dtype = _VALUES.get(jnp.dtype(stored_dtype))
  if value_dtype is None:
    return x.astype(stored_dtype)
  return jax.lax.bitcast_convert_type(x.astype(value_dtype), stored_dtype)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, spec: KVCacheSpec) -> list[dict]:
  """Allocates a zeroed cache: a list of L per-layer dicts (see module docstring).

  Args:
    cfg: the model config (L, K, H).
    batch: B sequences.
    max_len: S slots per sequence.
    spec: the cache numerics.

  Returns:
    L dicts with "k", "v" [B, K, S, H] (f32; uint16 bf16 bits; uint8 e4m3 bits, int8 e5m2
    bits, uint8 e4m3 bits of e2m1 values) and, on quantized layers, "k_scale", "v_scale"
    ([B, K, S, 1] for "token_head", [B, 1, 1, 1] for "tensor") f32 zeros.
  """
  out_of_range = [i for i in spec.bf16_layers if i >= cfg.num_layers]
  if out_of_range:
    raise ValueError(f"bf16_layers {out_of_range} out of range for {cfg.num_layers} layers")
  shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
  cache = []
  for layer in range(cfg.num_layers):
    dtype = spec.layer_dtype(layer)
    stored = storage_dtype(dtype)  # the bits of 0.0 are 0 in every format
    entry = {"k": jnp.zeros(shape, stored), "v": jnp.zeros(shape, stored)}
    if dtype in QUANTIZED_KV_DTYPES:
      if spec.granularity == "token_head":
        scale_shape = (batch, cfg.num_kv_heads, max_len, 1)
      else:
        scale_shape = (batch, 1, 1, 1)
      entry["k_scale"] = jnp.zeros(scale_shape, jnp.float32)
      entry["v_scale"] = jnp.zeros(scale_shape, jnp.float32)
    cache.append(entry)
  return cache


def abstract_cache(cfg: ModelConfig, batch: int, max_len: int, spec: KVCacheSpec) -> list[dict]:
  """The cache `init_cache` would build, as `jax.ShapeDtypeStruct`s (nothing allocated)."""
  return jax.eval_shape(lambda: init_cache(cfg, batch, max_len, spec))


def _nbytes(x) -> int:
  """`x.nbytes` of an array; size · itemsize of an abstract `jax.ShapeDtypeStruct`."""
  if hasattr(x, "nbytes"):
    return int(x.nbytes)
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def bytes_per_token(cache: list[dict]) -> float:
  """Bytes one cached token costs across all layers, from the cache's own layout.

  bytes_per_token = Σ_layers Σ_arrays nbytes / (B · S), so per-sequence scales
  ("tensor" granularity) are amortised over the S slots.

  Args:
    cache: from `init_cache` (arrays) or `abstract_cache` (shapes only).

  Returns:
    Bytes per cached token (float: amortised scales are fractional).
  """
  total = 0.0
  for entry in cache:
    batch, slots = entry["k"].shape[0], entry["k"].shape[SLOT_AXIS]
    total += sum(_nbytes(x) for x in entry.values()) / (batch * slots)
  return total


def _quantize_rows(x_btkh: jax.Array, scale, dtype: str) -> jax.Array:
  """round_fmt(clip(x / scale, ±q_max)) in the quantized format `dtype` (the clip keeps
  e4m3fn and e2m1fn from NaN and e5m2 from ±inf)."""
  value_dtype, q_max = _QUANTIZED[dtype]
  q = x_btkh.astype(jnp.float32) / scale
  return jnp.clip(q, -q_max, q_max).astype(value_dtype)


def _scatter_time(dst_bks, src_btk, start_b):
  """dst[b, :, start_b : start_b + T] = src[b] (moved to [K, T, ...]) for every b, in place.

  The source [B, T, K, ·] (the model's layout) is cast to the cache's value dtype, bit-cast to
  its integer storage (module docstring) and moved to the cache's head-major layout; only the T
  new tokens are converted and moved, never the buffer.
  """
  src_bkt = jnp.swapaxes(_as_stored(src_btk, dst_bks.dtype), 1, 2)

  def one(d, s, start):
    return jax.lax.dynamic_update_slice(d, s, (0, start) + (0,) * (d.ndim - 2))

  return jax.vmap(one)(dst_bks, src_bkt, start_b)


def write(entry: dict, k_btkh, v_btkh, start_b, spec: KVCacheSpec, valid_len_b=None) -> dict:
  """Returns `entry` with tokens written at slots start_b .. start_b + T - 1.

  Quantized layers store round_fmt(clip(x / scale, ±q_max)) in the format of `spec.dtype`
  (q_max 448 e4m3, 57344 e5m2, 6 e2m1; module docstring) with
  "token_head": scale = max(amax_h |x| / q_max, 1e-12) per token and head;
  "tensor": scale = headroom · amax |x| / q_max per sequence over the real tokens of
  its first write whose real tokens are not all zero (the calibration), then frozen.
  A scale of 0 means "not calibrated yet": a write whose real tokens are all zero
  (e.g. a prompt whose keys vanish) stores zeros (exact) and leaves the scale at 0,
  so the first non-zero write calibrates it instead of a 1e-12 floor that would clip
  every later value to ±q_max · 1e-12 (±4.5e-10 in e4m3).

  Saturation. On "tensor" layers the returned dict also holds "k_clipped" and
  "v_clipped": int32 [B], how many of *this write's* real elements had
  |x / scale| > q_max and were clipped to ±q_max · scale (the sampler sums them into
  `Rollout.kv_saturated_fraction`). "token_head" scales are each vector's own
  amax / q_max, so they cannot clip (beyond f32 rounding) and carry no counter.
  `init_cache` does not allocate the counters (they are not cache storage and do not
  count in `bytes_per_token`); the first write adds them.

  Args:
    entry: one layer's cache dict.
    k_btkh: keys [B, T, K, H].
    v_btkh: values [B, T, K, H].
    start_b: int [B], the slot of each sequence's first new token.
    spec: the cache numerics (quantized format, granularity, headroom).
    valid_len_b: optional int [B]; only tokens t < valid_len_b[b] are real (the rest
      is prompt padding): they alone calibrate a "tensor" scale and count as clipped.

  Returns:
    The updated layer dict (same shapes and dtypes, plus the counters above).
  """
  out = dict(entry)
  if "k_scale" not in entry:
    out["k"] = _scatter_time(entry["k"], k_btkh, start_b)
    out["v"] = _scatter_time(entry["v"], v_btkh, start_b)
    return out
  batch, tokens = k_btkh.shape[:2]
  if valid_len_b is None:
    real_bt = jnp.ones((batch, tokens), bool)
  else:
    real_bt = jnp.arange(tokens)[None, :] < valid_len_b[:, None]
  if spec.dtype not in QUANTIZED_KV_DTYPES or entry["k"].dtype != storage_dtype(spec.dtype):
    raise ValueError(
      f"a quantized cache entry stored as {entry['k'].dtype} cannot take a {spec.dtype} write; "
      "build the cache with init_cache and the same KVCacheSpec"
    )
  q_max = spec.q_max  # a scaled entry is a quantized layer: spec.layer_dtype is spec.dtype
  for name, x in (("k", k_btkh), ("v", v_btkh)):
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)  # [B,T,K,1]
    if spec.granularity == "token_head":
      scale = jnp.maximum(amax / q_max, 1e-12)
      out[name + "_scale"] = _scatter_time(entry[name + "_scale"], scale, start_b)
      out[name] = _scatter_time(entry[name], _quantize_rows(x, scale, spec.dtype), start_b)
      continue
    old = entry[name + "_scale"]  # [B,1,1,1]; 0 until a non-zero write calibrates it
    amax = jnp.where(real_bt[:, :, None, None], amax, 0.0)
    fresh = jnp.max(amax, axis=(1, 2), keepdims=True) * spec.tensor_headroom / q_max
    scale = jnp.where(old > 0, old, fresh)  # still 0 when every real entry is 0
    safe = jnp.where(scale > 0, scale, 1.0)  # uncalibrated: real entries are all 0, read as 0
    over = (jnp.abs(x / safe) > q_max) & real_bt[:, :, None, None]
    out[name + "_clipped"] = jnp.sum(over, axis=(1, 2, 3), dtype=jnp.int32)
    out[name + "_scale"] = scale
    out[name] = _scatter_time(entry[name], _quantize_rows(x, safe, spec.dtype), start_b)
  return out


def read(entry: dict, dtype) -> tuple[jax.Array, jax.Array]:
  """The whole cache of one layer as dense (k, v) arrays [B, S, K, H] in `dtype`.

  Quantized layers dequantize as f32(k) · k_scale (scale broadcast over H, or over all). This
  materializes the whole cache in `dtype`, in the model's [B, S, K, H] layout: the reference
  path of `transformer.forward_with_cache` (attention="reference"); the blockwise one reads
  blocks in place.
  """
  if "k_scale" not in entry:
    k, v = as_values(entry["k"]), as_values(entry["v"])
  else:
    (k, c), (v, _) = as_wide_values(entry["k"]), as_wide_values(entry["v"])
    k = k.astype(jnp.float32) * (entry["k_scale"] * c)
    v = v.astype(jnp.float32) * (entry["v_scale"] * c)
  return jnp.swapaxes(k.astype(dtype), 1, 2), jnp.swapaxes(v.astype(dtype), 1, 2)


def measure_bytes_per_token(
  cfg: ModelConfig, spec: KVCacheSpec, seq_len: int, allocate: bool
) -> float:
  """Bytes per cached token of a batch-1, `seq_len`-slot cache built by `init_cache`.

  Args:
    cfg: the model shape.
    spec: the cache numerics.
    seq_len: S, the slots per-sequence scales are amortised over.
    allocate: allocate the cache for real, or trace it with `jax.eval_shape`.

  Returns:
    `bytes_per_token` of that cache (scales included).
  """
  make = init_cache if allocate else abstract_cache
  cache = make(cfg, 1, seq_len, spec)
  return bytes_per_token(cache)
