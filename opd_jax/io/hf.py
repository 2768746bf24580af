"""Hugging Face safetensors checkpoints in and out of the opd_jax params layout.

This module owns the mapping between a local Hugging Face checkpoint directory
(`config.json` plus `model.safetensors` or a sharded `model.safetensors.index.json`)
and the params pytree of `opd_jax.model`. It needs neither torch nor a hub.

The tensor-by-tensor mapping between the two layouts is `io.hf_layout`.

Loading reads one tensor at a time and waits until it is on its devices before
reading the next. With a sharding, each process reads from the file only the slices
its own devices hold (`safe_open(...).get_slice(name)[...]` inside
`jax.make_array_from_callback`, each distinct slice once however many of its devices
replicate it), so a host holds at most one tensor's slice (and its converted copy) at a
time and, across the run, reads about 1/n of the split tensors when n processes split
them. The slice of our layout maps back to one rectangular block of the HF tensor:
each HF dimension is the flattening of consecutive dimensions of ours (reversed for a
transposed matrix), so a slice of ours reads the bounding range of its flat indices
along each HF dimension (exactly the slice when only the leading dimension of a group
is split, as the sharding rules do). `bytes_read()` counts the bytes read.

Export, a directory `transformers` loads with its tokenizer, is in `io.hf_export`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from safetensors.numpy import save_file

from opd_jax.io import staged_dir
from opd_jax.io.hf_layout import TensorSpec, tensor_specs
from opd_jax.model.config import ModelConfig
from opd_jax.model.quant import QArray

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The token ids config.json and generation_config.json carry.
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Buffers that some older checkpoints carry and that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SHARD_FILE = re.compile(r"^model-\d+-of-\d+\.safetensors$")


def _checked_dir(path) -> str:
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint path {path!r} is not a directory")
  return path


def read_json(file: str) -> dict[str, Any]:
  """The JSON object in `file`; ValueError when it is not valid JSON or not an object."""
  try:
    with open(file, encoding="utf-8") as fh:
      data = json.load(fh)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{file} is not valid JSON: {e}") from e
  if not isinstance(data, dict):
    raise ValueError(f"{file} must hold a JSON object, found {type(data).__name__}")
  return data


def load_config(path) -> ModelConfig:
  """Reads `config.json` of a Hugging Face checkpoint directory.

  Args:
    path: the checkpoint directory.

  Returns:
    the ModelConfig it describes.

  Raises:
    FileNotFoundError: the directory or its config.json is missing.
    ValueError: the file is not JSON, lacks a required key, or describes an
      unsupported architecture (the message lists the supported model types).
  """
  file = os.path.join(_checked_dir(path), CONFIG_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {os.fspath(path)!r}")
  hf = read_json(file)
  try:
    return ModelConfig.from_hf_dict(hf)
  except KeyError as e:
    raise ValueError(f"{file} lacks required key {e.args[0]!r}") from e
  except ValueError as e:
    raise ValueError(f"{file}: {e}") from e


def _weight_map(directory: str) -> tuple[dict[str, str], str]:
  """(tensor name -> safetensors file, a description of where that map came from)."""
  single = os.path.join(directory, SINGLE_FILE)
  index = os.path.join(directory, INDEX_FILE)
  if os.path.isfile(single):
    try:
      with safetensors.safe_open(single, framework="numpy") as fh:
        return dict.fromkeys(fh.keys(), single), single
    except (safetensors.SafetensorError, OSError) as e:
      raise ValueError(f"cannot read safetensors file {single}: {e}") from e
  if os.path.isfile(index):
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has no 'weight_map' object")
    out = {}
    for name, rel in weight_map.items():
      file = os.path.join(directory, rel)
      if not os.path.isfile(file):
        raise FileNotFoundError(f"{index} maps {name!r} to {file}, which does not exist")
      out[name] = file
    return out, f"{index} and the {len(set(out.values()))} shard(s) it lists"
  raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {directory!r}")


def _lookup(tree, key: tuple):
  return functools.reduce(lambda node, k: node[k], key, tree)


def _sharding_for(shardings, spec: TensorSpec):
  if shardings is None or isinstance(shardings, jax.sharding.Sharding):
    return shardings
  try:
    return _lookup(shardings, spec.key)
  except (KeyError, IndexError, TypeError) as e:
    raise ValueError(f"shardings has no entry for param {spec.path!r}") from e


def _empty_params(cfg: ModelConfig) -> dict:
  return {"layers": [{} for _ in range(cfg.num_layers)]}


def _set(params: dict, key: tuple, value) -> None:
  _lookup(params, key[:-1])[key[-1]] = value


ShardingsArg = jax.sharding.Sharding | dict | Callable[[ModelConfig], Any] | None


_BYTES_READ = [0]


def bytes_read() -> int:
  """Bytes of tensor data `load_checkpoint` has read from weight files in this process."""
  return _BYTES_READ[0]


def reset_bytes_read() -> None:
  """Restarts the `bytes_read` count at 0."""
  _BYTES_READ[0] = 0


def _hf_groups(spec: TensorSpec) -> list[list[int]]:
  """Our dimensions grouped by the HF dimension they flatten into (in our order)."""
  hf_dims = spec.hf_shape[::-1] if spec.transpose else spec.hf_shape
  groups, d = [], 0
  for size in hf_dims:
    group, prod = [], 1
    while d < len(spec.shape) and (not group or prod * spec.shape[d] <= size) and prod < size:
      group.append(d)
      prod *= spec.shape[d]
      d += 1
    if not group and d < len(spec.shape):  # an HF dimension of size 1
      group, d = [d], d + 1
    groups.append(group)
  groups[-1].extend(range(d, len(spec.shape)))  # trailing size-1 dimensions
  return groups


def _read_block(handle, spec: TensorSpec, index, np_dtype) -> np.ndarray:
  """Our `index` (a tuple of slices) of tensor `spec`, read from the file as one block.

  Returns:
    The host array [slice shape] in `np_dtype`; the bytes read are added to `bytes_read`.
  """
  index = tuple(index) + (slice(None),) * (len(spec.shape) - len(tuple(index)))
  ranges = [np.arange(n)[sl] for sl, n in zip(index, spec.shape, strict=True)]
  hf_sel, flat = [], []
  for group in _hf_groups(spec):
    dims = [spec.shape[d] for d in group]
    idx = np.ravel_multi_index(np.ix_(*[ranges[d] for d in group]), dims).reshape(-1)
    hf_sel.append(slice(int(idx.min()), int(idx.max()) + 1))
    flat.append(idx - idx.min())
  try:
    if spec.transpose:
      block = handle.get_slice(spec.hf_name)[tuple(hf_sel[::-1])].T
    else:
      block = handle.get_slice(spec.hf_name)[tuple(hf_sel)]
  except (safetensors.SafetensorError, OSError) as e:
    raise ValueError(f"cannot read tensor {spec.hf_name!r}: {e}") from e
  _BYTES_READ[0] += block.nbytes
  if any(len(f) != s.stop - s.start for f, s in zip(flat, hf_sel, strict=True)):
    block = block[np.ix_(*flat)]
  return np.ascontiguousarray(block.reshape([len(r) for r in ranges]), dtype=np_dtype)


def _place(handle, spec: TensorSpec, sharding, np_dtype) -> jax.Array:
  """Tensor `spec` on `sharding` (None: the default device), reading only the slices this
  process's devices hold, each distinct slice once."""
  if sharding is None:
    return jax.device_put(_read_block(handle, spec, (), np_dtype))
  blocks = {}

  def one(index):
    key = tuple((sl.start, sl.stop) for sl in index)
    if key not in blocks:
      blocks[key] = _read_block(handle, spec, index, np_dtype)
    return blocks[key]

  return jax.make_array_from_callback(spec.shape, sharding, one)


def load_checkpoint(
  path, dtype=jnp.float32, shardings: ShardingsArg = None
) -> tuple[ModelConfig, dict]:
  """Loads a local Hugging Face Llama / Qwen2 / Qwen3 checkpoint.

  Tensors are read one at a time, converted to our layout and `dtype` on the
  host, and placed on their sharding before the next one is read; each process
  reads only the slices of each tensor that its devices hold (module docstring).
  Tensors the config does not need (a tied `lm_head.weight`, RoPE buffers) are
  skipped; any other unused tensor is an error, since it means config.json and the
  weights disagree.

  Args:
    path: directory holding config.json and model.safetensors or
      model.safetensors.index.json with its shards.
    dtype: dtype of every returned param (f32, bf16, ...).
    shardings: None (default device); one `jax.sharding.Sharding` for every
      param; a pytree of shardings with the params' structure (None leaves mean
      the default device); or a callable `cfg -> such a pytree`.

  Returns:
    (cfg, params) with params laid out as in `opd_jax.model`.

  Raises:
    FileNotFoundError: a missing directory, config.json or weight file.
    ValueError: an unsupported or malformed config, a corrupt weight file, a
      missing or unexpected tensor, or a tensor of the wrong shape.
  """
  directory = _checked_dir(path)
  cfg = load_config(directory)
  if callable(shardings):
    shardings = shardings(cfg)
  weight_map, searched = _weight_map(directory)
  specs = tensor_specs(cfg)
  np_dtype = np.dtype(dtype)
  params = _empty_params(cfg)
  with ExitStack() as stack:
    handles = {}
    for spec in specs:
      file = weight_map.get(spec.hf_name)
      if file is None:
        raise ValueError(
          f"tensor {spec.hf_name!r} (needed for {spec.path}) not found in {searched}"
        )
      if file not in handles:
        try:
          handles[file] = stack.enter_context(safetensors.safe_open(file, framework="numpy"))
        except (safetensors.SafetensorError, OSError) as e:
          raise ValueError(f"cannot read safetensors file {file}: {e}") from e
      handle = handles[file]
      try:
        found = tuple(handle.get_slice(spec.hf_name).get_shape())
      except safetensors.SafetensorError as e:
        raise ValueError(
          f"{spec.hf_name!r} is mapped to {file}, which does not hold it (the map: {searched}; {e})"
        ) from e
      if found != spec.hf_shape:
        raise ValueError(
          f"tensor {spec.hf_name!r} in {file} has shape {found}, but config.json "
          f"implies {spec.hf_shape}"
        )
      try:
        placed = _place(handle, spec, _sharding_for(shardings, spec), np_dtype)
      except ValueError as e:
        raise ValueError(f"{e} (in {file})") from e
      _set(params, spec.key, placed.block_until_ready())
  used = {spec.hf_name for spec in specs}
  if cfg.tie_word_embeddings:
    used.add("lm_head.weight")
  unexpected = sorted(
    name for name in weight_map if name not in used and not name.endswith(_IGNORED_SUFFIXES)
  )
  if unexpected:
    shown = ", ".join(unexpected[:5]) + (", ..." if len(unexpected) > 5 else "")
    raise ValueError(
      f"{len(unexpected)} tensor(s) in {directory} are not described by its config.json: {shown}"
    )
  return cfg, params


def _key_tuple(path_and_leaf) -> tuple[str | int, ...]:
  """("layers", 0, "q_dnh") from a `tree_leaves_with_path` entry."""
  path, _ = path_and_leaf
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name  # "float32", "bfloat16", "float16"


def _plan_shards(specs, leaves, max_shard_bytes: int) -> list[list[int]]:
  """Groups spec indices into consecutive shards of at most max_shard_bytes (or one tensor)."""
  shards, current, size = [], [], 0
  for i, leaf in enumerate(leaves):
    nbytes = int(np.prod(specs[i].shape)) * np.dtype(leaf.dtype).itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(i)
    size += nbytes
  shards.append(current)
  return shards


def save_checkpoint(
  path,
  cfg: ModelConfig,
  params,
  max_shard_bytes: int = 4 * 2**30,
  generation_config: dict[str, Any] | None = None,
) -> None:
  """Writes params as a Hugging Face checkpoint that `transformers` loads.

  Writes config.json (`cfg.to_hf_dict()` plus `torch_dtype`/`dtype`, the
  embedding's dtype, plus the bos/eos/pad ids of `generation_config`) and the
  weights in HF layout, each tensor in its own dtype. Models up to
  `max_shard_bytes` go to one model.safetensors; larger ones to
  model-0000i-of-0000n.safetensors shards plus model.safetensors.index.json.
  The whole checkpoint is written beside `path` and then takes its place
  (`staged_dir.replaced_directory`), so a write that fails part way leaves the
  old checkpoint whole, and no stale shard, index or generation config
  survives; other files in `path` (a tokenizer, a README) are kept. The host
  holds at most one shard at a time; params must be fully addressable from this
  process.

  Args:
    path: output directory (created if needed).
    cfg: the model config.
    params: the unquantized params pytree of `opd_jax.model`.
    max_shard_bytes: largest shard size in bytes (a single larger tensor gets
      a shard of its own).
    generation_config: written as generation_config.json, its `ID_KEYS` also
      into config.json (`generation_config(tokenizer)` builds one); it must name
      an `eos_token_id`. None writes neither (a cache that only opd_jax reads).

  Raises:
    ValueError: a `cfg` that config.json cannot express (`hf_expressible`);
      params hold a QArray, lack or add a tensor relative to `cfg`,
      or have a tensor of the wrong shape; a generation_config without an int
      (or list of int) eos_token_id or with an id outside the vocabulary.
  """
  hf_expressible(cfg)
  if generation_config is not None:
    _check_ids(generation_config, cfg.vocab_size)
  quantized = [
    jax.tree_util.keystr(p)
    for p, leaf in jax.tree_util.tree_leaves_with_path(
      params, is_leaf=lambda x: isinstance(x, QArray)
    )
    if isinstance(leaf, QArray)
  ]
  if quantized:
    raise ValueError(
      f"params hold fp8 QArrays ({', '.join(quantized[:3])}"
      f"{', ...' if len(quantized) > 3 else ''}); save the unquantized params instead"
    )
  specs = tensor_specs(cfg)
  leaves = []
  for spec in specs:
    try:
      leaf = _lookup(params, spec.key)
    except (KeyError, IndexError, TypeError) as e:
      raise ValueError(f"params lack {spec.path!r}, which {cfg.model_type} needs") from e
    if tuple(leaf.shape) != spec.shape:
      raise ValueError(f"param {spec.path!r} has shape {tuple(leaf.shape)}, expected {spec.shape}")
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      raise ValueError(f"param {spec.path!r} is not fully addressable from this process")
    leaves.append(leaf)
  known = {spec.key for spec in specs}
  extra = [
    "/".join(str(k) for k in key)
    for key in map(_key_tuple, jax.tree_util.tree_leaves_with_path(params))
    if key not in known
  ]
  if extra:
    raise ValueError(
      f"params hold tensors that the {cfg.model_type} config does not describe "
      f"(tie_word_embeddings={cfg.tie_word_embeddings}, qkv_bias={cfg.qkv_bias}, "
      f"o_bias={cfg.o_bias}, qk_norm={cfg.qk_norm}): {', '.join(extra)}"
    )

  with staged_dir.replaced_directory(path, owned_by_checkpoint) as directory:
    dtype = _dtype_name(params["embed_vd"].dtype)
    _write_checkpoint(directory, cfg, specs, leaves, dtype, max_shard_bytes, generation_config)


def hf_expressible(cfg: ModelConfig) -> None:
  """Refuses a `cfg` whose config.json transformers would read as another architecture.

  config.json says only `model_type` and `attention_bias`, so (as `ModelConfig.from_hf_dict`
  reads them) Qwen3 has the q/k norm and the others do not, Qwen2 has q/k/v biases and no
  output bias, and Llama/Qwen3 have the q/k/v and output biases together or not at all.

  Raises:
    ValueError: naming the flags config.json cannot carry.
  """
  problems = []
  if cfg.qk_norm != (cfg.model_type == "qwen3"):
    problems.append(
      f"qk_norm={cfg.qk_norm} (a {cfg.model_type} config.json implies {cfg.model_type == 'qwen3'})"
    )
  if cfg.model_type == "qwen2" and not (cfg.qkv_bias and not cfg.o_bias):
    problems.append(f"qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias} (qwen2 implies True, False)")
  if cfg.model_type != "qwen2" and cfg.qkv_bias != cfg.o_bias:
    problems.append(f"qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias} (attention_bias sets both)")
  if problems:
    raise ValueError(
      f"a Hugging Face config.json cannot express this {cfg.model_type} model: "
      f"{'; '.join(problems)}; transformers would load it as a different model"
    )


def owned_by_checkpoint(name: str) -> bool:
  """Whether `save_checkpoint` owns the file `name` of a checkpoint directory: the weights
  (single file, shards, index), config.json and generation_config.json."""
  return name in (SINGLE_FILE, INDEX_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE) or bool(
    _SHARD_FILE.match(name)
  )


def _write_checkpoint(
  directory, cfg, specs, leaves, dtype, max_shard_bytes, generation_config
) -> None:
  """Writes the checked `leaves` (in `specs` order) and the JSON files, config.json's dtype
  `dtype`, into the empty `directory`."""
  shards = _plan_shards(specs, leaves, max_shard_bytes)
  weight_map, total = {}, 0
  for s, members in enumerate(shards):
    name = (
      SINGLE_FILE if len(shards) == 1 else f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
    )
    tensors = {}
    for i in members:
      host = np.asarray(jax.device_get(leaves[i]))
      tensors[specs[i].hf_name] = np.ascontiguousarray(specs[i].to_hf(host))
      weight_map[specs[i].hf_name] = name
      total += tensors[specs[i].hf_name].nbytes
    save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
    del tensors
  if len(shards) > 1:
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as fh:
      json.dump(index, fh, indent=2, sort_keys=True)

  hf = cfg.to_hf_dict() | {"torch_dtype": dtype, "dtype": dtype}
  if generation_config is not None:
    hf |= {k: generation_config[k] for k in ID_KEYS if k in generation_config}
    write_json(os.path.join(directory, GENERATION_CONFIG_FILE), generation_config)
  write_json(os.path.join(directory, CONFIG_FILE), hf)


def write_json(file: str, data: dict) -> None:
  """Writes `data` to `file` as Hugging Face does: indent 2, sorted keys, newline-terminated."""
  with open(file, "w", encoding="utf-8") as fh:
    json.dump(data, fh, indent=2, sort_keys=True)
    fh.write("\n")


def _check_ids(generation: dict[str, Any], vocab_size: int) -> None:
  """Refuses a generation config whose ids transformers could not use with this model."""
  if "eos_token_id" not in generation:
    raise ValueError(f"generation_config has no eos_token_id (keys: {sorted(generation)})")
  for key in ID_KEYS:
    value = generation.get(key)
    ids = value if isinstance(value, list) else [value]
    if value is None and key != "eos_token_id":
      continue
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
      raise ValueError(f"generation_config {key} must be an int or a list of ints, got {value!r}")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
      raise ValueError(
        f"generation_config {key}={value!r} is outside the model's vocabulary [0, {vocab_size})"
      )
