"""FP8 (e4m3) weight quantization as a pure transform of the params pytree.

Format
------
A quantized matrix is a `QArray`: the weight stored as `float8_e4m3fn` plus an f32
scale, so that W ≈ dequantize(Q) = f32(Q) · scale. e4m3 has 3 mantissa bits and a
max finite value of 448, so the scale maps each group's absolute maximum to 448:

    scale_g = max(max(|W_g|) / 448, tiny_f32),   Q_g = round_e4m3(clip(W_g / scale_g, ±448)).

The `tiny_f32` floor keeps an all-zero group finite (it quantizes to zeros), and the
clip guards against the division landing a hair above 448, which e4m3fn (no
infinities) would turn into NaN. Round-to-nearest in e4m3 has a relative error of
at most 2^-4 in the normal range and an absolute error of at most 2^-10 in the
subnormal range, so every element obeys

    |Ŵ − W| ≤ scale_g · max(2^-4 · |W / scale_g|, 2^-10).

Two groupings are offered, chosen by `QuantRecipe.block_size`:

* per output channel (block_size=None, the default). Every weight is viewed as a
  2-D [in, out] matrix (its contraction axes flattened first); each output column
  gets one scale, stored as [1, out]. This is the granularity that survives
  outlier-heavy columns best per byte of metadata, and it folds into the matmul
  epilogue (x @ Q) · scale.
* 128×128 blocks (block_size=128), the DeepSeek-V3 style. Each block of the 2-D
  view gets its own scale, stored as [ceil(in/b), ceil(out/b)], which bounds error
  from outliers that are localised in both dimensions. Edge blocks that do not fill
  b×b get a scale of their own, computed over the entries they do hold.

The contraction ("in") axes are fixed by the params layout: axis 0 of `q_dnh`,
`k_dkh`, `v_dkh`, `gate_df`, `up_df` and `down_fd`, and axes (n, h) of `o_nhd`.

What stays unquantized
----------------------
The embeddings, the LM head and every norm and bias stay dense in the compute
dtype (the embedding table's dtype unless `QuantRecipe.keep_dtype` says otherwise):
they are a small share of the bytes and the logits are most sensitive to them.
A recipe adds whole layers (`bf16_layers`) to that list; the mismatch study shows
some layers are much more sensitive to reduced precision than others.

Compute
-------
Model code never branches on precision: every matmul goes through one helper,
`model.linear(x, w)`, which multiplies by a plain array as it is and by a `QArray`
in one of two ways, chosen once per published weight version by
`prepare_for_compute` (the engine calls it right after `quantize_params`):

* W8A16, emulated (hardware without FP8 matmuls: CPU, GPUs before compute
  capability 8.9, TPUs before v7). The weight is dequantized to the compute dtype,
  `as_dense(w, dt) = dt(f32(Q) · scale)`, and the dot runs in that dtype. Doing that
  inside every decode step re-converts every matrix per token, so
  `prepare_for_compute` does it once per weight version instead and hands the
  sampler dense compute-dtype weights: the same elementwise computation, so the
  logits are bit-identical to the per-step dequantization (tested). The FP8 memory
  saving of the weights is given up on such hardware; the FP8 KV cache stays FP8 in
  memory either way. Measured on CPU (`python -m opd_jax.bench.sampler`, rows
  fp8_vs_dense): the per-step dequantization cost about 2.5% of a 58M-parameter
  decode at batch 16 and nothing measurable at the test sizes; most of the FP8
  engine's old slowdown (0.75× dense in CPU time at 58M, 0.22× on the tiny model)
  was the FP8 KV-cache write (see `kvcache._scatter_time`).
* W8A8, native (`has_native_fp8`: NVIDIA compute capability ≥ 8.9, i.e. Ada, L4,
  H100/H200 and later; TPU v7 Ironwood and later). The QArray is kept, marked
  `native_fp8=True`, and `fp8_matmul` runs `lax.dot_general` on e4m3 operands with
  f32 accumulation. A native FP8 GEMM needs the activations in e4m3 too, so each
  token's activation row x_m (the contracted axes flattened) gets its own scale

      s_m = max(max_i |x_mi| / 448, tiny_f32),   X̂_m = round_e4m3(clip(x_m / s_m, ±448)),

  and y_mo = s_m · Σ_i X̂_mi · Q_io · scale_o (per channel; with b×b blocks the sum
  is split per row block r and each partial sum is multiplied by scale_ro). The
  weights are exactly those of the emulated path; the activation rounding
  (relative error ≤ 2^-4 per element, like the weights) is an ADDITIONAL mismatch
  source that the emulated path does not have. So the same recipe measures more
  mismatch on FP8 hardware than on CPU, and a budget calibrated on one backend is
  not valid on the other (the budget fingerprint includes the backend). Measured on
  the test suite's 2-layer model: mean KL(W8A16 ‖ W8A8) ≈ 0.02 nats, as large as
  the weight rounding itself (KL(f32 ‖ W8A16) ≈ 0.022). The per-token rule is the
  simplest one a GEMM epilogue can apply (one scale per row of x); DeepSeek-V3's
  1×128 activation tiles would be finer. This path is tested on CPU only (XLA
  upcasts there); its speed on FP8 hardware has not been measured yet.

Which hardware counts as native is a rule on the device kind, not a probe: XLA
accepts fp8 dot_generals everywhere (CPU upcasts internally, which is how the
tests run the native path), so "it compiles" says nothing about speed. TPU v5p and
v6e are left on the emulated path: their matrix units take bf16 and int8, so an
fp8 dot would be converted anyway, and W8A8 would add mismatch for no speed.
`prepare_for_compute(..., native_fp8=...)` overrides the rule.
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


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
  """Static FP8 weight recipe (hashable, a jit static arg).

  Attributes:
    block_size: None for per-output-channel scales, else the edge b of b×b blocks.
    bf16_layers: indices of layers whose matrices stay unquantized.
    keep_dtype: dtype of every unquantized leaf, one of KEEP_DTYPES; None keeps the
      compute dtype of the original params (the embedding table's dtype).
  """

  block_size: int | None = None
  bf16_layers: tuple[int, ...] = ()
  keep_dtype: str | None = None

  def __post_init__(self):
    b = self.block_size
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
      raise ValueError(f"block_size must be None (per-channel) or a positive int, got {b!r}")
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


def _expand_scale(scale, block_size: int | None, rows: int, cols: int) -> jax.Array:
  """Broadcasts a [1, out] or [ceil(in/b), ceil(out/b)] scale to the [rows, cols] view."""
  if block_size is None:
    return scale
  b = block_size
  full = jnp.repeat(jnp.repeat(scale, b, axis=0), b, axis=1)
  return full[:rows, :cols]


@struct.dataclass
class QArray:
  """An fp8 weight with scales: W ≈ f32(value) · expand(scale).

  Attributes:
    value: float8_e4m3fn array with the original weight's shape.
    scale: f32 scales of the 2-D [in, out] view: [1, out] per channel, or
      [ceil(in/b), ceil(out/b)] for b×b blocks.
    num_in_axes: static; the leading axes of `value` that are contracted (in).
    block_size: static; None for per-channel scales, else the block edge b.
    native_fp8: static; False: matmuls dequantize the weight to the compute dtype
      (W8A16); True: they run as fp8 × fp8 dot_generals (W8A8, `fp8_matmul`). Set by
      `prepare_for_compute` on hardware with FP8 matmuls.
  """

  value: jax.Array
  scale: jax.Array
  num_in_axes: int = struct.field(pytree_node=False, default=1)
  block_size: int | None = struct.field(pytree_node=False, default=None)
  native_fp8: bool = struct.field(pytree_node=False, default=False)

  @property
  def shape(self):
    return self.value.shape

  @property
  def dtype(self):
    return self.value.dtype

  @property
  def nbytes(self) -> int:
    return int(self.value.nbytes + self.scale.nbytes)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """Returns f32(value) · expand(scale), cast to `dtype`, in the original shape."""
    shape = self.value.shape
    rows = math.prod(shape[: self.num_in_axes])
    w_io = self.value.reshape(rows, -1).astype(jnp.float32)
    scale = _expand_scale(self.scale, self.block_size, *w_io.shape)
    return (w_io * scale).astype(dtype).reshape(shape)


def as_dense(w, dtype) -> jax.Array:
  """The weight as a dense `dtype` array: dequantizes a QArray, casts a plain array."""
  if isinstance(w, QArray):
    return w.dequantize(dtype)
  return w.astype(dtype)


@functools.partial(jax.jit, static_argnames=("num_in_axes", "block_size"))
def quantize(w, num_in_axes: int = 1, block_size: int | None = None) -> QArray:
  """Quantizes one weight to e4m3 with per-channel or block scales.

  The weight is viewed as W_io = reshape(w, [prod(shape[:num_in_axes]), -1]).
  Per channel: scale_o = max(max_i |W_io|, ·) / 448. Blocks: scale_rc =
  max(|W| over block (r, c)) / 448 for the b×b blocks of W_io (edge blocks partial).
  Both are floored at `SCALE_FLOOR`; Q = round_e4m3(clip(W / scale, ±448)).
  Jitted (one compile per shape and grouping), so eager `quantize_params` is cheap.

  Args:
    w: a float array of rank > num_in_axes.
    num_in_axes: how many leading axes are contracted (the "in" side).
    block_size: None for per-output-channel scales, else the block edge b.

  Returns:
    A QArray with value [w.shape] e4m3 and scale [1, out] or
    [ceil(in/b), ceil(out/b)] f32.
  """
  if not 1 <= num_in_axes < w.ndim:
    raise ValueError(f"num_in_axes must be in [1, {w.ndim - 1}] for shape {w.shape}")
  if block_size is not None and block_size <= 0:
    raise ValueError(f"block_size must be None or a positive int, got {block_size!r}")
  rows = math.prod(w.shape[:num_in_axes])
  abs_io = jnp.abs(w.reshape(rows, -1).astype(jnp.float32))
  cols = abs_io.shape[1]
  if block_size is None:
    amax = jnp.max(abs_io, axis=0, keepdims=True)  # [1, out]
  else:
    b = block_size
    rb, cb = -(-rows // b), -(-cols // b)
    padded = jnp.pad(abs_io, ((0, rb * b - rows), (0, cb * b - cols)))  # zeros never win amax
    amax = jnp.max(padded.reshape(rb, b, cb, b), axis=(1, 3))  # [ceil(in/b), ceil(out/b)]
  scale = jnp.maximum(amax / FP8_MAX, SCALE_FLOOR)
  q_io = w.reshape(rows, -1).astype(jnp.float32) / _expand_scale(scale, block_size, rows, cols)
  value = jnp.clip(q_io, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE).reshape(w.shape)
  return QArray(value=value, scale=scale, num_in_axes=num_in_axes, block_size=block_size)


def _is_qarray(x) -> bool:
  return isinstance(x, QArray)


def quantize_params(params, recipe: QuantRecipe):
  """FP8 params for the rollout engine: a pure transform, jittable with a static recipe.

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
        new[name] = quantize(w, LAYER_MATRICES[name], recipe.block_size)
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
  """Bytes the params occupy, counting a QArray as its e4m3 values plus f32 scales."""
  leaves = jax.tree.leaves(params, is_leaf=_is_qarray)
  return int(sum(x.nbytes for x in leaves))


# TPU generations whose matrix units multiply fp8 natively (device_kind "TPU7x", "TPU v7"...).
MIN_NATIVE_FP8_TPU_GENERATION = 7
# NVIDIA compute capability of the first FP8 tensor cores (Ada; Hopper is 9.0).
MIN_NATIVE_FP8_CUDA_CAPABILITY = (8, 9)


def native_fp8_rule(platform: str, device_kind: str, compute_capability: str = "") -> bool:
  """The rule behind `has_native_fp8`, on a device's descriptive strings.

  NVIDIA GPUs with compute capability ≥ 8.9 (Ada, L4, Hopper, Blackwell) and TPUs of
  generation ≥ 7 (Ironwood: device_kind "TPU7x") are native; CPUs, older GPUs, AMD
  GPUs (their capability is "gfx…", and their fp8 formats are the fnuz variants, not
  e4m3fn) and TPU v2–v6 are not.

  Args:
    platform: `jax.Device.platform` ("cpu", "gpu", "tpu", ...).
    device_kind: `jax.Device.device_kind`, e.g. "NVIDIA H100 80GB HBM3", "TPU v5p".
    compute_capability: the CUDA device's "major.minor", "" when there is none.

  Returns:
    True when fp8 × fp8 dot_generals run on FP8 matrix units.
  """
  if platform == "gpu":
    major, _, minor = compute_capability.partition(".")
    if not (major.isdigit() and minor.isdigit()):
      return False
    return (int(major), int(minor)) >= MIN_NATIVE_FP8_CUDA_CAPABILITY
  if platform == "tpu":
    digits = "".join(ch if ch.isdigit() else " " for ch in device_kind).split()
    return bool(digits) and int(digits[0]) >= MIN_NATIVE_FP8_TPU_GENERATION
  return False


def has_native_fp8(device=None) -> bool:
  """Whether `device` (default: the first device) has FP8 matmul units (`native_fp8_rule`)."""
  device = jax.devices()[0] if device is None else device
  capability = str(getattr(device, "compute_capability", "") or "")
  return native_fp8_rule(device.platform, device.device_kind, capability)


def prepare_for_compute(qparams, dtype=None, native_fp8: bool | None = None):
  """The params the engine samples with: FP8 matrices laid out for this hardware's matmuls.

  Without FP8 matmuls every QArray W becomes dense: as_dense(W, dtype) =
  dtype(f32(Q) · scale), the exact computation the model would otherwise repeat in
  every decode step, so the logits are unchanged and the dequantization runs once per
  weight version. With FP8 matmuls every QArray is kept and marked `native_fp8=True`,
  so `model.linear` multiplies it with `fp8_matmul` (W8A8). Plain leaves pass through.

  Args:
    qparams: a params pytree from `quantize_params` (plain params pass through).
    dtype: the compute dtype; None (the default) is the embedding table's dtype, which
      is what the model computes in. Another dtype is refused: the model would cast the
      dense weights again at every step.
    native_fp8: None decides by `has_native_fp8()`; True/False forces the W8A8 / W8A16 path.

  Returns:
    The params pytree with dense arrays (W8A16) or native QArrays (W8A8) as matrices.
  """
  compute = jnp.dtype(qparams["embed_vd"].dtype)
  if dtype is not None and jnp.dtype(dtype) != compute:
    raise ValueError(
      f"dtype {jnp.dtype(dtype).name} differs from the compute dtype {compute.name} "
      "(the embedding table's); requantize with QuantRecipe(keep_dtype=...) instead"
    )
  native = has_native_fp8() if native_fp8 is None else bool(native_fp8)

  def prepare(x):
    if not _is_qarray(x):
      return x
    if native:
      return dataclasses.replace(x, native_fp8=True)
    return x.dequantize(jnp.float32).astype(compute)

  return jax.tree.map(prepare, qparams, is_leaf=_is_qarray)


def quantize_activations(x_mi: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-token e4m3 activations: s_m = max(max_i |x_mi| / 448, tiny), X̂ = e4m3(x / s).

  Args:
    x_mi: [M, I] activations, one row per token.

  Returns:
    (X̂ [M, I] float8_e4m3fn, s [M, 1] f32), with x ≈ f32(X̂) · s.
  """
  x32 = x_mi.astype(jnp.float32)
  scale_m1 = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / FP8_MAX, SCALE_FLOOR)
  return jnp.clip(x32 / scale_m1, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), scale_m1


def fp8_matmul(x, w: QArray) -> jax.Array:
  """W8A8 matmul: y = x · W with e4m3 × e4m3 dot_generals and f32 accumulation.

  With x viewed as [M, I] (its last `w.num_in_axes` axes flattened) and W as its
  [I, O] view:

      per channel:  y_mo = s_m · scale_o · Σ_i X̂_mi Q_io
      b×b blocks:   y_mo = s_m · Σ_r scale_{r, o//b} · Σ_{i in block r} X̂_mi Q_io

  where (X̂, s) = `quantize_activations(x)`. Rows of the last partial block are padded
  with zeros, which add nothing.

  Args:
    x: activations [..., *w.shape[:w.num_in_axes]], any float dtype.
    w: a QArray.

  Returns:
    y [..., *w.shape[w.num_in_axes:]] in f32.
  """
  n = w.num_in_axes
  in_shape, out_shape = w.shape[:n], w.shape[n:]
  if tuple(x.shape[x.ndim - n :]) != tuple(in_shape):
    raise ValueError(f"x {x.shape} does not end in the weight's input axes {in_shape}")
  lead = x.shape[: x.ndim - n]
  rows, cols = math.prod(in_shape), math.prod(out_shape)
  xq_mi, scale_m1 = quantize_activations(x.reshape(-1, rows))
  q_io = w.value.reshape(rows, cols)
  if w.block_size is None:
    acc_mo = jax.lax.dot_general(
      xq_mi, q_io, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    y_mo = acc_mo * w.scale * scale_m1
  else:
    b = w.block_size
    rb = -(-rows // b)
    pad = rb * b - rows
    xq_rmb = jnp.pad(xq_mi, ((0, 0), (0, pad))).reshape(-1, rb, b).transpose(1, 0, 2)
    q_rbo = jnp.pad(q_io, ((0, pad), (0, 0))).reshape(rb, b, cols)
    acc_rmo = jax.lax.dot_general(
      xq_rmb, q_rbo, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32
    )
    scale_ro = jnp.repeat(w.scale, b, axis=1)[:, :cols]
    y_mo = jnp.sum(acc_rmo * scale_ro[:, None, :], axis=0) * scale_m1
  return y_mo.reshape(*lead, *out_shape)
