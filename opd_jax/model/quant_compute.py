"""How the engine computes with quantized weights: `prepare_for_compute` lays the weights out
once per weight version: dense in the compute dtype (W8A16, emulated) or, on hardware with FP8
matmuls (`has_native_fp8`, `native_fp8_rule`), kept for `fp8_matmul` (W8A8), which also rounds
the activations (`quantize_activations`) and so adds mismatch the emulated path does not have.
The formats and `QArray` are `model.quant`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from opd_jax.model.quant import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, QArray, _is_qarray

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
  """The params the engine samples with: quantized matrices laid out for this hardware.

  Without FP8 matmuls every QArray W becomes dense: as_dense(W, dtype) =
  dtype(f32(Q) · scale), the exact computation the model would otherwise repeat in
  every decode step, so the logits are unchanged and the dequantization runs once per
  weight version. With FP8 matmuls every QArray is kept and marked `native_fp8=True`,
  so `model.linear` multiplies it with `fp8_matmul` (W8A8). A QArray of another format
  (e5m2, INT8, INT4, FP4) or with group scales is made dense on every backend: those are
  weight-only formats here. Plain leaves pass through.

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
    if native and x.fmt == "fp8_e4m3" and x.group_size is None:
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

      per channel:  y_mo = s_m · scale_o · Σ_i X̂_mi Q_io     (per tensor: scale_o = s)
      b×b blocks:   y_mo = s_m · Σ_r scale_{r, o//b} · Σ_{i in block r} X̂_mi Q_io

  where (X̂, s) = `quantize_activations(x)`. Rows of the last partial block are padded
  with zeros, which add nothing.

  Args:
    x: activations [..., *w.shape[:w.num_in_axes]], any float dtype.
    w: a QArray.

  Returns:
    y [..., *w.shape[w.num_in_axes:]] in f32.
  """
  if w.fmt != "fp8_e4m3" or w.group_size is not None:
    raise ValueError(
      f"fp8_matmul multiplies e4m3 weights with channel, tensor or block scales; got {w.fmt} "
      f"with group_size={w.group_size} (dequantize it: `prepare_for_compute`)"
    )
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
