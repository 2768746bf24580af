"""Which parameters a run started from: a short digest of a parameter pytree's exact bits.

A built-in teacher and a warm-started student are pure functions of their settings on one
machine, and are cached under keys of those settings (`train.pretrain.teacher_key`). Across
machines they are not: the CPU's vector width changes XLA's code and so the last bits of every
step, and the teacher's bootstrap, which trains until a held-out accuracy crosses a target,
can stop after a different number of steps. Two runs of one comparison trained on two
machines can then start from different teachers under identical configs. Each run therefore
records the digest of the teacher and of the student it started from (`trainer`'s result,
"start_digests"), and a comparison refuses to pool runs whose digests differ
(`experiments.study_provenance.check_same_start`).

The digest of a pytree is sha256 over, for every leaf in tree order, its key path, shape,
dtype and the checksum

    c = Σ_i (2 i + 1) · u_i   (mod 2^32)

where u_i is the unsigned integer of the same width as the leaf's i-th element's bits (in
row-major order; 4-bit formats included), widened to 32 bits (a 64-bit element counts as its
two 32-bit halves). The
weights 2i + 1 are odd, so changing any one element's bits changes c, and they differ by
position, so swapping two unequal elements does too. The checksums are computed on the devices
in one jitted call, so sharded parameters are never gathered onto one host; only one uint32 per
leaf leaves the devices.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

DIGEST_CHARS = 16  # hex characters kept
_UINT = {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint32}


def bit_width(dtype) -> int | None:
  """Bits per element of a numeric dtype (4 for int4 and fp4, whose itemsize reads 1); None
  for any other dtype."""
  for info in (jnp.iinfo, jnp.finfo):
    try:
      return int(info(dtype).bits)
    except (ValueError, TypeError):
      pass
  return None


def _bits_u32(x):
  """x's element bits as uint32 (bool as 0/1; a 64-bit element as a trailing pair)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = jax.lax.bitcast_convert_type(x, _UINT[bit_width(x.dtype)])
  return bits.astype(jnp.uint32)


def _checksum(x):
  """Σ_i (2i + 1) · u_i mod 2^32 over x's elements in row-major order (uint32 scalar)."""
  bits = _bits_u32(x)
  index = jnp.zeros(bits.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(bits.ndim)):
    iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
    index = index + iota * jnp.uint32(stride % 2**32)
    stride *= bits.shape[axis]
  return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree.map(_checksum, tree))


def digest(params) -> str | None:
  """The first DIGEST_CHARS hex digits of the digest above; None for params None.

  Args:
    params: a pytree of arrays (jax or numpy, any sharding); its structure is part of what is
      hashed (the key paths), so the same arrays under other names differ.

  Raises:
    ValueError: a leaf that is not an array of a fixed-width dtype.
  """
  if params is None:
    return None
  leaves, _ = jax.tree_util.tree_flatten_with_path(params)
  for path, leaf in leaves:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or (dtype != np.bool_ and bit_width(dtype) not in _UINT):
      raise ValueError(
        f"params leaf {jax.tree_util.keystr(path)} is not an array of a fixed-width dtype: "
        f"{type(leaf).__name__} {dtype}"
      )
  sums = jax.device_get(_checksums(params))
  h = hashlib.sha256()
  for (path, leaf), (_, c) in zip(
    leaves, jax.tree_util.tree_flatten_with_path(sums)[0], strict=True
  ):
    h.update(f"{jax.tree_util.keystr(path)}|{tuple(leaf.shape)}|{leaf.dtype}|{int(c)};".encode())
  return h.hexdigest()[:DIGEST_CHARS]
