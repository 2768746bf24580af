"""Low-precision weight formats (FP8 e4m3 and e5m2, INT8, INT4, FP4 e2m1) as a pure
transform of the params pytree.

A quantized matrix is a `QArray`: the weight in the format's own dtype plus a scale per group
(per output channel, per tensor, b×b blocks or g inputs of a column: `QuantRecipe`), so that
W ≈ f32(Q) · scale (`quantize` gives the equations, `WEIGHT_FORMATS` the formats). The
embeddings, the LM head, norms and biases, and whole `bf16_layers`, stay dense; `HeadDtype`
marks an engine whose output head runs in bf16. How the engine computes with them (dense in
the compute dtype, or FP8 matmuls where the hardware has them) is `model.quant_compute`.
docs/design.md ("Low-precision weights") describes the formats, groupings and compute paths.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448.0
SCALE_FLOOR = float(jnp.finfo(jnp.float32).tiny)  # guards all-zero groups

# Weight formats: name -> (storage dtype, q_max: the magnitude a group's amax maps to).
WEIGHT_FORMATS = {
  "fp8_e4m3": (jnp.float8_e4m3fn, FP8_MAX),
  "fp8_e5m2": (jnp.float8_e5m2, float(jnp.finfo(jnp.float8_e5m2).max)),  # 57344
  "int8": (jnp.int8, 127.0),
  "int4": (jnp.int4, 7.0),
  "fp4_e2m1": (jnp.float4_e2m1fn, float(jnp.finfo(jnp.float4_e2m1fn).max)),  # 6
}
INT_FORMATS = ("int8", "int4")
# Formats whose scales are powers of two stored as float8_e8m0fnu (the MX layout).
POW2_SCALE_FORMATS = ("fp4_e2m1",)
SCALE_E8M0 = jnp.float8_e8m0fnu
# Storage width of each format in bits (4-bit formats count as packed two per byte).
FORMAT_BITS = {"fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4, "fp4_e2m1": 4}

# Per-layer matrices that get quantized, with their number of leading contraction axes.
LAYER_MATRICES = {
  "q_dnh": 1,
  "k_dkh": 1,
  "v_dkh": 1,
  "o_nhd": 2,
  "gate_df": 1,
  "up_df": 1,
  "down_fd": 1,
}
KEEP_DTYPES = ("bfloat16", "float16", "float32")

HEAD_KEY = "head_dtype"  # params[HEAD_KEY]: the engine's output-head dtype, when not float32
HEAD_DTYPES = ("float32", "bfloat16")


@jax.tree_util.register_static
class HeadDtype:
  """The dtype the final norm and LM head run in ("The output head" above): a static
  params marker (no leaves, hashable), so jitted callers key their compilation on it."""

  def __init__(self, name: str):
    if name not in HEAD_DTYPES:
      raise ValueError(f"unknown head dtype {name!r}; allowed: {', '.join(HEAD_DTYPES)}")
    self.name = name

  def __eq__(self, other):
    return isinstance(other, HeadDtype) and other.name == self.name

  def __hash__(self):
    return hash(("HeadDtype", self.name))

  def __repr__(self):
    return f"HeadDtype({self.name!r})"


def head_dtype_of(params) -> str:
  """The dtype `params`' output head runs in: "float32" (the trainer's) unless marked."""
  marker = params.get(HEAD_KEY)
  return "float32" if marker is None else marker.name


def _check_size(name: str, value) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
    raise ValueError(f"{name} must be None or a positive int, got {value!r}")


def _check_grouping(block_size, group_size, per_tensor) -> None:
  """At most one of b×b blocks, groups of g inputs and one scale per tensor."""
  _check_size("block_size", block_size)
  _check_size("group_size", group_size)
  if not isinstance(per_tensor, bool):
    raise ValueError(f"per_tensor must be a bool, got {per_tensor!r}")
  chosen = [
    n
    for n, on in (
      ("block_size", block_size is not None),
      ("group_size", group_size is not None),
      ("per_tensor", per_tensor),
    )
    if on
  ]
  if len(chosen) > 1:
    raise ValueError(
      f"choose one scale grouping, not {' and '.join(chosen)}: per channel (none of them), "
      "b×b blocks (block_size), groups of g inputs (group_size) or one per tensor (per_tensor)"
    )


def _check_format(fmt) -> None:
  if fmt not in WEIGHT_FORMATS:
    raise ValueError(f"unknown weight format {fmt!r}; allowed: {', '.join(WEIGHT_FORMATS)}")


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
  """Static weight recipe (hashable, a jit static arg).

  Attributes:
    block_size: the edge b of b×b blocks, or None.
    bf16_layers: indices of layers whose matrices stay unquantized.
    keep_dtype: dtype of every unquantized leaf, one of KEEP_DTYPES; None keeps the
      compute dtype of the original params (the embedding table's dtype).
    fmt: the weight format, a key of `WEIGHT_FORMATS` (default FP8 e4m3).
    group_size: g for one scale per g consecutive inputs of each output column, or None.
    per_tensor: one scale per matrix.
    With none of block_size, group_size and per_tensor: one scale per output channel.
  """

  block_size: int | None = None
  bf16_layers: tuple[int, ...] = ()
  keep_dtype: str | None = None
  fmt: str = "fp8_e4m3"
  group_size: int | None = None
  per_tensor: bool = False

  def __post_init__(self):
    b = self.block_size
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
      raise ValueError(f"block_size must be None (per-channel) or a positive int, got {b!r}")
    _check_grouping(self.block_size, self.group_size, self.per_tensor)
    _check_format(self.fmt)
    layers = self.bf16_layers
    if not isinstance(layers, tuple) or any(
      isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers
    ):
      raise ValueError(f"bf16_layers must be a tuple of non-negative ints, got {layers!r}")
    if len(set(layers)) != len(layers):
      raise ValueError(f"bf16_layers has duplicates: {layers!r}")
    if self.keep_dtype is not None and self.keep_dtype not in KEEP_DTYPES:
      raise ValueError(
        f"unknown keep_dtype {self.keep_dtype!r}; allowed: None, {', '.join(KEEP_DTYPES)}"
      )


def _expand_scale(
  scale, block_size: int | None, rows: int, cols: int, group_size: int | None = None
) -> jax.Array:
  """Broadcasts a scale to the [rows, cols] view: [1, out] (per channel) and [1, 1] (per
  tensor) broadcast as they are; [ceil(in/b), ceil(out/b)] (blocks) and [ceil(in/g), out]
  (groups) are repeated and cut to size."""
  if group_size is not None:
    return jnp.repeat(scale, group_size, axis=0)[:rows]
  if block_size is None:
    return scale
  b = block_size
  full = jnp.repeat(jnp.repeat(scale, b, axis=0), b, axis=1)
  return full[:rows, :cols]


@struct.dataclass
class QArray:
  """A quantized weight with scales: W ≈ f32(value) · expand(scale).

  Attributes:
    value: the weight's shape, in the format's dtype (`WEIGHT_FORMATS[fmt][0]`).
    scale: scales of the 2-D [in, out] view: [1, out] per channel, [1, 1] per tensor,
      [ceil(in/b), ceil(out/b)] for b×b blocks, [ceil(in/g), out] for groups of g inputs;
      f32, or float8_e8m0fnu powers of two for the MX formats (`POW2_SCALE_FORMATS`).
    num_in_axes: static; the leading axes of `value` that are contracted (in).
    block_size: static; None unless b×b block scales, else the block edge b.
    native_fp8: static; False: matmuls dequantize the weight to the compute dtype
      (W8A16); True: they run as fp8 × fp8 dot_generals (W8A8, `fp8_matmul`). Set by
      `prepare_for_compute` on hardware with FP8 matmuls, for e4m3 weights only.
    fmt: static; the format, a key of `WEIGHT_FORMATS`.
    group_size: static; None unless group scales, else the group length g.
  """

  value: jax.Array
  scale: jax.Array
  num_in_axes: int = struct.field(pytree_node=False, default=1)
  block_size: int | None = struct.field(pytree_node=False, default=None)
  native_fp8: bool = struct.field(pytree_node=False, default=False)
  fmt: str = struct.field(pytree_node=False, default="fp8_e4m3")
  group_size: int | None = struct.field(pytree_node=False, default=None)

  @property
  def shape(self):
    return self.value.shape

  @property
  def dtype(self):
    return self.value.dtype

  @property
  def nbytes(self) -> int:
    """Bytes of the values at the format's width (4-bit formats packed two per byte) plus
    the scales."""
    values = math.ceil(math.prod(self.value.shape) * FORMAT_BITS[self.fmt] / 8)
    return int(values + self.scale.nbytes)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """Returns f32(value) · expand(scale), cast to `dtype`, in the original shape."""
    shape = self.value.shape
    rows = math.prod(shape[: self.num_in_axes])
    w_io = self.value.reshape(rows, -1).astype(jnp.float32)
    scale = self.scale.astype(jnp.float32)
    scale = _expand_scale(scale, self.block_size, *w_io.shape, self.group_size)
    return (w_io * scale).astype(dtype).reshape(shape)


def as_dense(w, dtype) -> jax.Array:
  """The weight as a dense `dtype` array: dequantizes a QArray, casts a plain array."""
  if isinstance(w, QArray):
    return w.dequantize(dtype)
  return w.astype(dtype)


def _group_amax(abs_io, block_size, group_size, per_tensor) -> jax.Array:
  """max |W| per scale group of the [rows, cols] view, in the scale's stored shape."""
  rows, cols = abs_io.shape
  if per_tensor:
    return jnp.max(abs_io, keepdims=True)  # [1, 1]
  if group_size is not None:
    g = group_size
    rg = -(-rows // g)
    padded = jnp.pad(abs_io, ((0, rg * g - rows), (0, 0)))  # zeros never win amax
    return jnp.max(padded.reshape(rg, g, cols), axis=1)  # [ceil(in/g), out]
  if block_size is None:
    return jnp.max(abs_io, axis=0, keepdims=True)  # [1, out]
  b = block_size
  rb, cb = -(-rows // b), -(-cols // b)
  padded = jnp.pad(abs_io, ((0, rb * b - rows), (0, cb * b - cols)))
  return jnp.max(padded.reshape(rb, b, cb, b), axis=(1, 3))  # [ceil(in/b), ceil(out/b)]


def pow2_scale(amax, q_max: float) -> jax.Array:
  """2^ceil(log2(max(amax / q_max, tiny_f32))), exactly (from the binary exponent, not a
  floating-point log2), as f32: the smallest power of two s with amax / s ≤ q_max."""
  mantissa, exponent = jnp.frexp(jnp.maximum(amax / q_max, SCALE_FLOOR))  # x = m · 2^e
  exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # x = 2^(e-1) exactly
  return jnp.ldexp(jnp.ones_like(amax), exponent)


@functools.partial(
  jax.jit, static_argnames=("num_in_axes", "block_size", "fmt", "group_size", "per_tensor")
)
def quantize(
  w,
  num_in_axes: int = 1,
  block_size: int | None = None,
  fmt: str = "fp8_e4m3",
  group_size: int | None = None,
  per_tensor: bool = False,
) -> QArray:
  """Quantizes one weight to `fmt` with per-channel, per-tensor, block or group scales.

  The weight is viewed as W_io = reshape(w, [prod(shape[:num_in_axes]), -1]). For each
  scale group G (a column, the matrix, a b×b block or g inputs of one column),
  amax_G = max |W_G| and, with q_max = `WEIGHT_FORMATS[fmt][1]`,

      s_G = max(amax_G / q_max, tiny_f32)                  (f32; fp8 and int formats)
      s_G = 2^ceil(log2(max(amax_G / q_max, tiny_f32)))    (float8_e8m0fnu; fp4, MX)
      Q = round(clip(W / s_G, ±q_max))                     (fp8, fp4: in the dtype's
                                                            conversion, to nearest even)
      Q = clip(round(W / s_G), ±q_max)                     (int8, int4: half to even)

  so that every element obeys, with s = s_G and r = |W / s|,

      fp8_e4m3  |Ŵ − W| ≤ s · max(2^-4 · r, 2^-10)     (3 mantissa bits; q_max 448)
      fp8_e5m2  |Ŵ − W| ≤ s · max(2^-3 · r, 2^-17)     (2 mantissa bits; q_max 57344)
      int8/int4 |Ŵ − W| ≤ s / 2                        (q_max 127 / 7; −8 unused in int4)
      fp4_e2m1  |Ŵ − W| ≤ s · max(2^-2 · r, 2^-2)      (1 mantissa bit; q_max 6)

  The f32 floor tiny_f32 keeps an all-zero group finite, and the clip keeps e4m3fn (which has
  no infinities) from turning a value a hair above q_max into NaN. FP4's power-of-two scale
  rounds the exponent up, so |W / s| ≤ 6 and nothing saturates (the MX spec's
  floor(log2(amax)) − 2 can clip amax), at the cost of at most one bit.

  Jitted (one compile per shape, format and grouping), so eager `quantize_params` is cheap.

  Args:
    w: a float array of rank > num_in_axes.
    num_in_axes: how many leading axes are contracted (the "in" side).
    block_size: b for b×b block scales, or None.
    fmt: a key of `WEIGHT_FORMATS`.
    group_size: g for one scale per g inputs of each output column, or None.
    per_tensor: one scale for the whole matrix.

  Returns:
    A QArray with value [w.shape] in the format's dtype and the scale of its grouping
    (`QArray.scale`).
  """
  if not 1 <= num_in_axes < w.ndim:
    raise ValueError(f"num_in_axes must be in [1, {w.ndim - 1}] for shape {w.shape}")
  _check_grouping(block_size, group_size, per_tensor)
  _check_format(fmt)
  dtype, q_max = WEIGHT_FORMATS[fmt]
  rows = math.prod(w.shape[:num_in_axes])
  w_io = w.reshape(rows, -1).astype(jnp.float32)
  cols = w_io.shape[1]
  amax = _group_amax(jnp.abs(w_io), block_size, group_size, per_tensor)
  if fmt in POW2_SCALE_FORMATS:
    scale = pow2_scale(amax, q_max)
  else:
    scale = jnp.maximum(amax / q_max, SCALE_FLOOR)
  q_io = w_io / _expand_scale(scale, block_size, rows, cols, group_size)
  if fmt in INT_FORMATS:
    q_io = jnp.round(q_io)
  value = jnp.clip(q_io, -q_max, q_max).astype(dtype).reshape(w.shape)
  if fmt in POW2_SCALE_FORMATS:
    scale = scale.astype(SCALE_E8M0)
  return QArray(
    value=value,
    scale=scale,
    num_in_axes=num_in_axes,
    block_size=block_size,
    fmt=fmt,
    group_size=group_size,
  )


def _is_qarray(x) -> bool:
  return isinstance(x, QArray)


def quantize_params(params, recipe: QuantRecipe):
  """Quantized params for the rollout engine: a pure transform, jittable with a static recipe.

  Every matrix in `LAYER_MATRICES` of every layer not in `recipe.bf16_layers`
  becomes a `QArray`; every other leaf (embeddings, LM head, norms, biases, the
  matrices of the kept layers) is cast to the keep dtype.

  Args:
    params: a dense params pytree (layout in `opd_jax.model`).
    recipe: the quantization recipe.

  Returns:
    The params pytree with QArray leaves, usable by `model.forward` and
    `model.forward_with_cache` unchanged.
  """
  if any(_is_qarray(x) for x in jax.tree.leaves(params, is_leaf=_is_qarray)):
    raise ValueError("params are already quantized (contain QArray leaves)")
  layers = params["layers"]
  out_of_range = [i for i in recipe.bf16_layers if i >= len(layers)]
  if out_of_range:
    raise ValueError(f"bf16_layers {out_of_range} out of range for a {len(layers)}-layer model")
  keep = jnp.dtype(recipe.keep_dtype) if recipe.keep_dtype else params["embed_vd"].dtype
  cast = lambda tree: jax.tree.map(lambda x: x.astype(keep), tree)
  out = {name: cast(leaf) for name, leaf in params.items() if name != "layers"}
  out["layers"] = []
  for i, layer in enumerate(layers):
    new = {}
    for name, w in layer.items():
      if name in LAYER_MATRICES and i not in recipe.bf16_layers:
        new[name] = quantize(
          w,
          LAYER_MATRICES[name],
          recipe.block_size,
          recipe.fmt,
          recipe.group_size,
          recipe.per_tensor,
        )
      else:
        new[name] = cast(w)
    out["layers"].append(new)
  return out


def dequantize_params(qparams, dtype=jnp.float32):
  """Every leaf as a dense `dtype` array (QArrays dequantized): for inspection and tests.

  Args:
    qparams: a params pytree, possibly with QArray leaves.
    dtype: the output dtype.

  Returns:
    The same pytree structure with plain arrays.
  """
  return jax.tree.map(lambda x: as_dense(x, dtype), qparams, is_leaf=_is_qarray)


def params_nbytes(params) -> int:
  """Bytes the params occupy, counting a QArray as its values at the format's width plus
  its scales (`QArray.nbytes`)."""
  leaves = jax.tree.leaves(params, is_leaf=_is_qarray)
  return int(sum(x.nbytes for x in leaves))
