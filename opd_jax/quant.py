"""FP8 (e4m3) weight quantization as a pure transform of the params pytree.

Format
------
A quantized matrix is a `QArray`: the weight stored as `float8_e4m3fn` plus an f32
scale, so that W ≈ dequantize(Q) = f32(Q) · scale. e4m3 has 3 mantissa bits and a
max finite value of 448, so the scale maps each group's absolute maximum to 448:

    scale_g = max(|W_g|) / 448,   Q_g = round_e4m3(W_g / scale_g).

Two groupings are offered, chosen by `QuantRecipe.block_size`:

* per output channel (block_size=None, the default). Every weight is viewed as a
  2-D [in, out] matrix (its contraction axes flattened first); each output column
  gets one scale. This is the granularity that survives outlier-heavy columns best
  per byte of metadata, and it folds into the matmul epilogue (x @ Q) · scale.
* 128×128 blocks (block_size=128), the DeepSeek-V3 style. Each block of the 2-D
  view gets its own scale, which bounds error from outliers that are localised in
  both dimensions. Edges that do not fill a block get a scale of their own.

What stays in BF16
------------------
The embeddings, the LM head and every norm and bias stay in the compute dtype:
they are a small share of the bytes and the logits are most sensitive to them.
A recipe adds whole layers (`bf16_layers`) to that list; the mismatch study shows
some layers are much more sensitive to reduced precision than others.

Compute
-------
Model code never branches on precision: it calls `as_dense(w, dtype)`, which is the
identity for a plain array and the dequantization for a `QArray`. XLA fuses the
dequantization into the following dot, so on GPU the fp8 bytes are what is read
from memory; on CPU XLA converts fp8 to f32 first, which gives the memory saving
and the numerics but not the speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448.0


@struct.dataclass
class QArray:
  """An fp8 weight with scales: W ≈ f32(value) · expand(scale).

  Attributes:
    value: float8_e4m3fn array with the original weight's shape.
    scale: f32 scales of the 2-D [in, out] view: [1, out] per channel, or
      [ceil(in/b), ceil(out/b)] for b×b blocks.
    num_in_axes: static; the leading axes of `value` that are contracted (in).
    block_size: static; None for per-channel scales, else the block edge b.
  """

  value: jax.Array
  scale: jax.Array
  num_in_axes: int = struct.field(pytree_node=False, default=1)
  block_size: int | None = struct.field(pytree_node=False, default=None)

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
    rows = int(np.prod(shape[: self.num_in_axes]))
    w_io = self.value.reshape(rows, -1).astype(jnp.float32)
    scale = self.scale
    if self.block_size is not None:
      b = self.block_size
      scale = jnp.repeat(jnp.repeat(scale, b, axis=0), b, axis=1)
      scale = scale[: w_io.shape[0], : w_io.shape[1]]
    return (w_io * scale).astype(dtype).reshape(shape)


def as_dense(w, dtype) -> jax.Array:
  """The weight as a dense `dtype` array: dequantizes a QArray, casts a plain array."""
  if isinstance(w, QArray):
    return w.dequantize(dtype)
  return w.astype(dtype)
