"""The checks of a sharded layout: are the params split over the model axes
(`assert_params_sufficiently_sharded`, as MaxText does after init), a per-leaf description of
where params live (`describe`), and the cross-device ops of a compiled program
(`hlo_collectives`, which tests use to show that a program never all-gathers the batch).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding

from opd_jax.model import sharding as sharding_lib
from opd_jax.model.quant import QArray

_HLO_OPS = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
_HLO_LINE = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_HLO_ARRAY = re.compile(r"^[a-z0-9]+\[([0-9,]*)\]")


def hlo_collectives(hlo_text: str) -> list[dict]:
  """The cross-device ops of a compiled HLO text (`jitted.lower(...).compile().as_text()`).

  Returns:
    One dict per op: "op" (one of all-gather, all-reduce, all-to-all, reduce-scatter,
    collective-permute; an async "-start" counts as its op), "operand" (the first
    operand's shape, None when it is a tuple or not found), "result" (the result's shape,
    None for a tuple), "dims" (the `dimensions={..}` an all-gather or all-to-all
    concatenates along, else ()), and "line" (the HLO line).
  """

  def shape(type_text):
    match = _HLO_ARRAY.match(type_text)
    return None if match is None else tuple(int(n) for n in match.group(1).split(",") if n)

  shapes, lines = {}, []
  for line in hlo_text.splitlines():
    match = _HLO_LINE.match(line)
    if match is None:
      continue
    name, type_text, op, rest = match.groups()
    shapes[name] = shape(type_text)
    lines.append((line, type_text, op, rest))
  found = []
  for line, type_text, op, rest in lines:
    base = op.removesuffix("-start")
    if base not in _HLO_OPS:
      continue
    operand = re.match(r"\s*(?:[^%]*\s)?%([\w.\-]+)", rest)
    dims = re.search(r"dimensions=\{([0-9,]*)\}", rest)
    found.append(
      {
        "op": base,
        "operand": shapes.get(operand.group(1)) if operand else None,
        "result": shape(type_text),
        "dims": tuple(int(n) for n in dims.group(1).split(",") if n) if dims else (),
        "line": line.strip(),
      }
    )
  return found


def _shard_bytes(leaf) -> int:
  sharding = getattr(leaf, "sharding", None)
  shape = tuple(leaf.shape)
  if sharding is not None:
    shape = tuple(sharding.shard_shape(shape))
  return math.prod(shape) * np.dtype(leaf.dtype).itemsize


def assert_params_sufficiently_sharded(
  params, mesh, tolerance: float = 0.02, min_elements: int = 1024
) -> float:
  """Checks that parameters are split over the model axes, as MaxText does after init.

  With M = fsdp · tensor devices, a perfectly sharded model holds total/M bytes per
  device. Over the leaves with at least `min_elements` elements,

      excess = Σ_leaf shard_bytes · M / Σ_leaf bytes − 1,

  which is 0 when every such leaf is split M ways and M − 1 when all are replicated.
  When M == 1 the excess is 0 and the check passes.

  Args:
    params: a pytree of `jax.Array`s (or ShapeDtypeStructs with shardings).
    mesh: the mesh the params are laid out on.
    tolerance: the largest allowed excess (0.02 = 2% more bytes per device).
    min_elements: leaves smaller than this (norms, biases) are not checked.

  Returns:
    The measured excess.
  """
  model_devices = math.prod(mesh.shape[a] for a in sharding_lib.MODEL_AXES)
  total, per_device, wasted = 0, 0, []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not hasattr(leaf, "shape") or math.prod(leaf.shape) < min_elements:
      continue
    nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    shard = _shard_bytes(leaf)
    total += nbytes
    per_device += shard
    if shard * model_devices > nbytes:
      wasted.append((shard - nbytes / model_devices, path, leaf))
  if total == 0:
    return 0.0
  excess = per_device * model_devices / total - 1.0
  if excess > tolerance:
    wasted.sort(key=lambda item: -item[0])
    worst = "; ".join(
      f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)} {_spec_str(leaf)}"
      for _, path, leaf in wasted[:5]
    )
    raise ValueError(
      f"params are not sharded over the model axes {sharding_lib.MODEL_AXES} "
      f"({model_devices} devices): "
      f"per-device bytes are {excess:.1%} above total/{model_devices} "
      f"(tolerance {tolerance:.1%}); largest under-sharded leaves: {worst}"
    )
  return excess


def _spec_str(leaf) -> str:
  sharding = getattr(leaf, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return str(sharding.spec)
  if sharding is None:
    return "host" if isinstance(leaf, np.ndarray) else "unplaced"
  return "replicated" if sharding.is_fully_replicated else str(sharding)


def _human_bytes(n: int) -> str:
  if n < 1024:
    return f"{n} B"
  exponent = min(int(math.log(n, 1024)), 3)
  return f"{n / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def describe(params, max_leaves: int = 3) -> str:
  """A human summary of a params pytree: sizes per top-level group and layouts.

  One line per top-level key (`embed_vd`, `layers`, ...) with its parameter count,
  its bytes, and the shape, dtype and PartitionSpec of its `max_leaves` biggest
  leaves (one per leaf name, so the layers list shows `gate_df` once, not once per
  layer); then a total line. A `QArray` counts as its weight's elements and as the
  bytes of its value plus scales.

  Args:
    params: a pytree of arrays, ShapeDtypeStructs or QArrays.
    max_leaves: how many of each group's biggest leaves to show.

  Returns:
    The multi-line summary.
  """
  groups = params.items() if isinstance(params, Mapping) else [("params", params)]
  lines, grand_count, grand_bytes = [], 0, 0
  for group, tree in groups:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QArray))[0]
    count, nbytes, biggest = 0, 0, {}
    for path, leaf in leaves:
      if not hasattr(leaf, "shape"):
        continue
      size = math.prod(leaf.shape)
      if isinstance(leaf, QArray):
        leaf_bytes, shown = leaf.nbytes, leaf.value
      else:
        leaf_bytes, shown = size * np.dtype(leaf.dtype).itemsize, leaf
      count += size
      nbytes += leaf_bytes
      name = next(
        (e.key for e in reversed(path) if isinstance(e, jax.tree_util.DictKey)),
        jax.tree_util.keystr(path) or str(group),
      )
      if name not in biggest or biggest[name][0] < size:
        label = f"{name} {tuple(leaf.shape)} {np.dtype(shown.dtype).name} {_spec_str(shown)}"
        biggest[name] = (size, label)
    top = sorted(biggest.values(), key=lambda item: -item[0])[:max_leaves]
    lines.append(
      f"{group:<14} {count:>14,} params {_human_bytes(nbytes):>11}   "
      + "; ".join(label for _, label in top)
    )
    grand_count += count
    grand_bytes += nbytes
  lines.append(f"{'total':<14} {grand_count:>14,} params {_human_bytes(grand_bytes):>11}")
  return "\n".join(lines)
