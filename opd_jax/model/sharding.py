"""Named-mesh sharding: the device mesh, logical-axis rules and moving arrays between layouts.

The mesh has three named axes:

* `data`: pure data parallelism; parameters are replicated along it.
* `fsdp`: data parallelism with parameters (and optimizer state) split along it.
* `tensor`: tensor parallelism over heads, MLP width and vocabulary.

Shardings are never written by hand per array. Every parameter lives under a dict key
whose suffix after the last `_` names its dimensions, one letter per dimension
(`q_dnh` is [D, N, H]; see `opd_jax.model`). `DIM_LETTERS` turns letters into
logical axis names and a rules table (`DEFAULT_RULES`) maps logical names onto mesh
axes. The recipe is

    abstract = jax.eval_shape(init_fn)            # ShapeDtypeStructs, no memory
    shardings = tree_shardings(abstract, mesh)    # one NamedSharding per leaf
    params = jax.jit(init_fn, out_shardings=shardings)()

which `shard_init` wraps. Because only the path and the rank of a leaf are consulted,
the same rules shard any pytree that ends in the parameter keys: optax state (`mu`
and `nu` mirror the params, scalars such as `count` replicate), `quant.QArray`
weights (the fp8 `value` sits under the parameter key with the parameter's rank),
and batches whose keys carry suffixes such as `tokens_bt`.

A dimension whose size is not divisible by its mesh axes, or whose mesh axes are
already used by an earlier dimension of the same array, is left unsharded, so every
model shape gets a valid (if less split) layout.

The checks of a layout (params sufficiently sharded, a per-leaf description, the
collectives of a compiled program) are in `model.sharding_checks`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from opd_jax.model.quant import QArray

MESH_AXES = ("data", "fsdp", "tensor")
# Axes that split parameters; the ideal per-device parameter bytes are total / their product.
MODEL_AXES = ("fsdp", "tensor")

# One letter per dimension in a key's suffix -> logical axis name.
DIM_LETTERS = {
  "b": "batch",
  "t": "length",
  "v": "vocab",
  "d": "embed",
  "n": "heads",
  "k": "kv_heads",
  "h": "head_dim",
  "f": "mlp",
}

# (logical axis, mesh axis or tuple of mesh axes or None). Logical axes not listed are
# replicated.
DEFAULT_RULES = (
  ("batch", ("data", "fsdp")),
  ("length", None),
  ("vocab", "tensor"),
  ("embed", "fsdp"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("mlp", "tensor"),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# The params' layout while decoding: as `DEFAULT_RULES` but with the FSDP split of the
# embedding axis gathered, so that one-token decode steps keep the batch on (data, fsdp)
# and gather weights (once per sampler call) rather than activations.
DECODE_RULES = tuple((name, None if name == "embed" else axes) for name, axes in DEFAULT_RULES)


def make_mesh(shape: Sequence[int] | Mapping[str, int], devices=None) -> Mesh:
  """Builds the ("data", "fsdp", "tensor") mesh with Auto axis types.

  Args:
    shape: three ints in (data, fsdp, tensor) order, or a dict with some of those
      keys (missing ones are 1). Exactly one entry may be -1, meaning "all the
      devices the other entries leave".
    devices: the devices to lay out; default `jax.devices()`.

  Returns:
    A `jax.sharding.Mesh` of `len(devices)` devices with axis sizes `shape`.
  """
  devices = list(jax.devices() if devices is None else devices)
  count = len(devices)
  if isinstance(shape, Mapping):
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
      raise ValueError(f"unknown mesh axes {sorted(unknown)} in {dict(shape)}; use {MESH_AXES}")
    sizes = [shape.get(name, 1) for name in MESH_AXES]
  else:
    sizes = list(shape)
    if len(sizes) != len(MESH_AXES):
      raise ValueError(f"mesh shape {tuple(sizes)} must have 3 entries for {MESH_AXES}")
  for size in sizes:
    if (
      not isinstance(size, int | np.integer)
      or isinstance(size, bool)
      or not (size == -1 or size >= 1)
    ):
      raise ValueError(f"mesh shape {tuple(sizes)} entries must be positive ints or -1")
  sizes = [int(s) for s in sizes]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh shape {tuple(sizes)} has more than one -1")
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if count % known:
      raise ValueError(
        f"mesh shape {tuple(sizes)}: {count} devices are not divisible by the fixed axes ({known})"
      )
    sizes[sizes.index(-1)] = count // known
  if math.prod(sizes) != count:
    raise ValueError(
      f"mesh shape {tuple(sizes)} has {math.prod(sizes)} devices but there are {count} devices"
    )
  return jax.make_mesh(
    tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
  )


def _dims_of_key(key: str, ndim: int) -> str | None:
  """The key's dimension letters if its suffix names exactly `ndim` known dimensions."""
  if "_" not in key:
    return None
  suffix = key.rsplit("_", 1)[1]
  if len(suffix) == ndim and all(letter in DIM_LETTERS for letter in suffix):
    return suffix
  return None


def logical_axes(path, leaf) -> tuple[str | None, ...]:
  """Logical axis names of one leaf, from the dict keys on its path.

  The last dict key on `path` whose suffix has one known letter per dimension of
  `leaf` names the axes; a leaf with no such key is replicated (all None). So
  `["layers"][0]["q_dnh"]` -> ("embed", "heads", "head_dim"), the adamw `mu` of the
  same weight gets the same axes, `QArray.value` under `q_dnh` too, while its
  [1, N·H] scale (rank 2) and the scalar `count` replicate. A 2-D weight's
  per-channel scale [1, out] does match (rank 2) and takes the weight's output axis.

  Args:
    path: a key path from `jax.tree_util.tree_flatten_with_path`.
    leaf: an array or ShapeDtypeStruct.

  Returns:
    A tuple with one logical axis name (or None) per dimension of `leaf`.
  """
  ndim = len(_shape(leaf))
  for entry in reversed(path):
    if isinstance(entry, jax.tree_util.DictKey) and isinstance(entry.key, str):
      dims = _dims_of_key(entry.key, ndim)
      if dims is not None:
        return tuple(DIM_LETTERS[letter] for letter in dims)
  return (None,) * ndim


def _shape(leaf) -> tuple[int, ...]:
  """Shape of an array, ShapeDtypeStruct or Python scalar."""
  return tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)


def _rules_dict(rules: Rules, mesh) -> dict[str, tuple[str, ...]]:
  table = {}
  for name, axes in rules:
    if name in table:
      raise ValueError(f"logical axis {name!r} appears twice in the sharding rules")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    for axis in axes:
      if axis not in mesh.shape:
        raise ValueError(
          f"sharding rule {name!r} -> {axis!r} names an axis not in the mesh {tuple(mesh.shape)}"
        )
    table[name] = axes
  return table


def logical_spec(
  axes: Sequence[str | None], shape: Sequence[int] | None, mesh, rules=DEFAULT_RULES
):
  """PartitionSpec for logical `axes` of an array of `shape` on `mesh`.

  A dimension is sharded over its rule's mesh axes when their size product divides
  the dimension's size and none of them is used by an earlier dimension; otherwise
  it is left unsharded.

  Args:
    axes: one logical axis name (or None) per dimension.
    shape: the array's shape, or None to skip the divisibility check.
    mesh: a `Mesh` or `AbstractMesh` (only its axis sizes are read).
    rules: (logical axis, mesh axes) pairs.

  Returns:
    A `PartitionSpec` with one entry per dimension.
  """
  table = _rules_dict(rules, mesh)
  used: set[str] = set()
  entries = []
  for i, name in enumerate(axes):
    mesh_axes = table.get(name, ()) if name is not None else ()
    split = math.prod(mesh.shape[a] for a in mesh_axes)
    fits = shape is None or shape[i] % split == 0
    if not mesh_axes or used.intersection(mesh_axes) or not fits:
      entries.append(None)
      continue
    used.update(mesh_axes)
    entries.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return P(*entries)


def logical_sharding(mesh, dims: str, shape: Sequence[int] | None = None, rules=DEFAULT_RULES):
  """NamedSharding for an array whose dimensions are named by letters, e.g. "btv".

  Args:
    mesh: the device mesh.
    dims: one `DIM_LETTERS` letter per dimension.
    shape: the array's shape for the divisibility fallback, or None.
    rules: (logical axis, mesh axes) pairs.

  Returns:
    The `NamedSharding`.
  """
  unknown = [letter for letter in dims if letter not in DIM_LETTERS]
  if unknown:
    raise ValueError(f"unknown dimension letters {unknown} in {dims!r}; known: {list(DIM_LETTERS)}")
  if shape is not None and len(shape) != len(dims):
    raise ValueError(f"dims {dims!r} name {len(dims)} dimensions but shape is {tuple(shape)}")
  axes = [DIM_LETTERS[letter] for letter in dims]
  return NamedSharding(mesh, logical_spec(axes, shape, mesh, rules))


def batch_sharding(mesh, ndim: int, rules=DEFAULT_RULES) -> NamedSharding:
  """Sharding of an activation or batch array: leading dim on the `batch` rule, rest replicated.

  With the default rules the batch [B, ...] is split over ("data", "fsdp"), so B must
  be divisible by data·fsdp.

  Args:
    mesh: the device mesh.
    ndim: the array's rank (≥ 1).
    rules: (logical axis, mesh axes) pairs.

  Returns:
    The `NamedSharding`.
  """
  if ndim < 1:
    raise ValueError(f"a batch array needs a leading batch dimension, got ndim={ndim}")
  return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1), None, mesh, rules))


def batch_shards(mesh, rules=DEFAULT_RULES) -> int:
  """How many ways the batch rule splits a batch: data · fsdp with the default rules."""
  return math.prod(mesh.shape[a] for a in _rules_dict(rules, mesh).get("batch", ()))


def place_rows(host_bx: np.ndarray, mesh, rules=DEFAULT_RULES) -> jax.Array:
  """A global array of the host batch `host_bx` [B, ...], split by `batch_sharding`.

  Every process passes the same host array; each device receives only its own rows
  (`jax.make_array_from_callback`), so no device holds, and no program gathers, rows of
  another batch shard. B must be divisible by `batch_shards(mesh)`.
  """
  host_bx = np.asarray(host_bx)
  shards = batch_shards(mesh, rules)
  if host_bx.ndim < 1 or host_bx.shape[0] % shards:
    raise ValueError(
      f"a batch of shape {host_bx.shape} cannot be split over {shards} batch shards "
      f"(mesh {dict(mesh.shape)}): its leading size must be a multiple of {shards}"
    )
  layout = batch_sharding(mesh, host_bx.ndim, rules)
  return jax.make_array_from_callback(host_bx.shape, layout, lambda index: host_bx[index])


def to_host(tree):
  """Every leaf of `tree` as one whole host array, gathered across processes where a leaf
  spans them (`process_allgather`). Every process must call it: with several processes it
  is a collective, so calling it from process 0 alone hangs or fails the others."""
  if jax.process_count() > 1:
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)


def local_rows(x) -> list[tuple[int, np.ndarray]]:
  """This process's rows of a batch-leading array: (first row, host rows) per distinct
  row block its devices hold (devices that replicate a block, e.g. along "tensor", count
  once), in row order. For a fully addressable array this covers every row."""
  blocks = {}
  for shard in x.addressable_shards:
    rows = shard.index[0] if shard.index else slice(None)
    start = rows.start or 0
    if start not in blocks:
      blocks[start] = np.asarray(shard.data)
  return sorted(blocks.items(), key=lambda item: item[0])


def map_local_rows(fn, *arrays) -> jax.Array:
  """fn applied on the host to this process's rows of batch-split arrays, as one global
  array: out[r0:r1] = fn(r0, *(a[r0:r1] for a in arrays)) for every row block [r0, r1) a
  device of this process holds (each block computed once). fn returns a numpy array with
  one entry per row; the result is laid out like `arrays[0]`'s batch. Host-side work per
  row (decoding texts, scoring them) then runs on exactly one process per row block, and
  reductions of the result count every row once however many devices replicate it.
  """
  first = arrays[0]
  blocks = [dict(local_rows(a)) for a in arrays]
  done = {start: np.asarray(fn(start, *(b[start] for b in blocks))) for start in blocks[0]}
  if not isinstance(first.sharding, NamedSharding):  # one device: one block
    return jax.numpy.asarray(np.concatenate([done[k] for k in sorted(done)]))
  width = next(iter(done.values())).shape[1:]
  spec = first.sharding.spec
  layout = NamedSharding(first.sharding.mesh, P(spec[0] if len(spec) else None))

  def piece(index):
    start = index[0].start or 0
    return done[start][: (index[0].stop or first.shape[0]) - start]

  return jax.make_array_from_callback((first.shape[0],) + width, layout, piece)


def params_mesh(tree):
  """The ("data", "fsdp", "tensor") `Mesh` a pytree's arrays are laid out on (the first
  `NamedSharding` leaf's), or None when there is none or it has a single device."""
  for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QArray)):
    leaf = leaf.value if isinstance(leaf, QArray) else leaf
    layout = getattr(leaf, "sharding", None)
    mesh = layout.mesh if isinstance(layout, NamedSharding) else None
    if mesh is not None and mesh.size > 1 and set(MESH_AXES) <= set(mesh.axis_names):
      return mesh
  return None


def replicated(mesh) -> NamedSharding:
  """Sharding that keeps a full copy on every device (RNG keys, scalars)."""
  return NamedSharding(mesh, P())


@functools.lru_cache(maxsize=64)
def _identity_jit(treedef, leaf_shardings: tuple):
  return jax.jit(lambda tree: tree, out_shardings=jax.tree.unflatten(treedef, leaf_shardings))


def relayout(tree, shardings):
  """`tree` laid out as `shardings` (a matching pytree of `Sharding`s).

  Arrays already on the shardings' devices go through a jitted identity, built once per layout
  and compiled once per input shape, so a loop that relayouts every step (each rollout onto
  the train mesh) compiles it once, not once per call. Anything else is a transfer
  (`transfer`): shard for shard between meshes of one shape, else `jax.device_put`.
  """
  leaves, treedef = jax.tree.flatten(shardings)
  devices = set().union(*(s.device_set for s in leaves))
  if all(
    getattr(x, "sharding", None) is not None and x.sharding.device_set <= devices
    for x in jax.tree.leaves(tree)
  ):
    return _identity_jit(treedef, tuple(leaves))(tree)
  return jax.tree.map(transfer, tree, shardings)


def split_devices(num_rollout: int, devices=None) -> tuple[list, list]:
  """(training devices, rollout devices): `rollout.devices` set apart from the trainer's.

  Each of the P processes gives its last num_rollout / P local devices to the rollouts and
  keeps the others for training, in `devices` order. So the i-th training device and the i-th
  rollout device belong to the same process whenever the two sets are equal halves, and
  meshes of one shape over them are mirrors (`transfer` then copies shard for shard, inside
  each process).

  Raises:
    ValueError: num_rollout not a multiple of the process count, or leaving a process no
      training device.
  """
  devices = list(jax.devices() if devices is None else devices)
  processes = sorted({d.process_index for d in devices})
  if num_rollout < 1 or num_rollout % len(processes):
    raise ValueError(
      f"rollout.devices={num_rollout} must be a positive multiple of the process count "
      f"({len(processes)}): every process gives the same number of its devices to rollouts"
    )
  per_process = num_rollout // len(processes)
  train, rollout = [], []
  for p in processes:
    local = [d for d in devices if d.process_index == p]
    if per_process >= len(local):
      raise ValueError(
        f"rollout.devices={num_rollout} takes {per_process} of each process's {len(local)} "
        "devices, leaving none to train on; set fewer (half the devices is the usual split)"
      )
    train += local[: len(local) - per_process]
    rollout += local[len(local) - per_process :]
  return train, rollout


def _mirror(x: jax.Array, target: NamedSharding) -> jax.Array:
  """`x` copied shard for shard onto `target`'s mesh: same mesh shape and spec, other devices.

  Each process copies only its own shards, to the device at the same mesh position, so no
  data crosses processes (multi-controller JAX cannot `device_put` between device sets).
  """
  position = {d: i for i, d in enumerate(x.sharding.mesh.devices.flat)}
  targets = list(target.mesh.devices.flat)
  shards = []
  for shard in x.addressable_shards:
    device = targets[position[shard.device]]
    if device.process_index != shard.device.process_index:
      raise ValueError(
        f"cannot copy a shard from {shard.device} to {device}: mirrored meshes must pair devices "
        "of one process (use `split_devices` to place the rollout devices)"
      )
    shards.append(jax.device_put(shard.data, device))
  return jax.make_array_from_single_device_arrays(x.shape, target, shards)


def transfer(x, target):
  """One array moved onto `target`, a sharding on other devices (the rollout devices).

  Between two ("data", "fsdp", "tensor") meshes of one shape the copy is shard for shard
  (`_mirror`), after relaying `x` out with `target`'s spec on its own mesh if it differs; this
  is the only transfer that works across processes. Otherwise `jax.device_put`, which works
  in one process.
  """
  source = getattr(x, "sharding", None)
  if jax.process_count() > 1 and isinstance(x, jax.Array) and x.is_fully_addressable:
    # A process-local value (a scalar each process put on its own default device): every
    # process holds it, so it is placed like a host value.
    return jax.device_put(np.asarray(x), target)
  if (
    isinstance(source, NamedSharding)
    and isinstance(target, NamedSharding)
    and source.mesh.devices.shape == target.mesh.devices.shape
    and source.mesh.axis_names == target.mesh.axis_names
  ):
    local = NamedSharding(source.mesh, target.spec)
    if not source.is_equivalent_to(local, x.ndim):
      x = _identity_jit(jax.tree.structure(0), (local,))(x)
    return _mirror(x, target)
  if jax.process_count() > 1 and isinstance(x, jax.Array):
    raise ValueError(
      f"cannot move an array from {source} to {target} across processes: the rollout mesh must "
      "mirror the training mesh (rollout.devices = half the devices, rollout.mesh_* = 0)"
    )
  return jax.device_put(x, target)


def tree_shardings(abstract_tree, mesh, rules: Rules = DEFAULT_RULES):
  """One NamedSharding per leaf, from names and shapes only.

  Args:
    abstract_tree: a pytree of arrays or ShapeDtypeStructs (`jax.eval_shape` output).
    mesh: a `Mesh` (or `AbstractMesh` to inspect specs without devices).
    rules: (logical axis, mesh axes) pairs; default `DEFAULT_RULES`.

  Returns:
    A pytree with the structure of `abstract_tree` whose leaves are `NamedSharding`s.
  """

  def one(path, leaf):
    return NamedSharding(mesh, logical_spec(logical_axes(path, leaf), _shape(leaf), mesh, rules))

  return jax.tree_util.tree_map_with_path(one, abstract_tree)


def shard_init(init_fn: Callable[[], Any], mesh, rules: Rules = DEFAULT_RULES):
  """Runs `init_fn` so that every leaf is created directly in its sharded layout.

  Args:
    init_fn: a function of no arguments returning a pytree (close over the RNG).
    mesh: the device mesh.
    rules: (logical axis, mesh axes) pairs.

  Returns:
    (tree, shardings): the initialised pytree and its `tree_shardings`, ready to be
    passed as `in_shardings`/`out_shardings` of the step functions.
  """
  shardings = tree_shardings(jax.eval_shape(init_fn), mesh, rules)
  return jax.jit(init_fn, out_shardings=shardings)(), shardings
