"""The prompt pipeline: sources of prompts and a deterministic, shardable, resumable batcher.

Sources are random-access sequences of dicts with at least a string `"prompt"`:

* `opd_jax.task.TaskSource(split, size, seed)`: the built-in synthetic task
  (`{"prompt", "completion", "answer"}`).
* `JsonlSource(path)`: a JSONL file, one object per line with a string `"prompt"`; other fields
  (e.g. `"answer"`) are kept. The file is read and validated eagerly, so a bad file fails at
  start-up with the file and line in the message, not hours into a run.

`prompt_batches` turns a source into a grain iterator of batches:

    source ─▶ shuffle(seed) ─▶ [shard_index::shard_count] ─▶ repeat ─▶ map(encode_fn) ─▶ batch

The shuffle is a pure function of (seed, epoch, index), reshuffled every epoch; each process
reads every `shard_count`-th element of that order, so the shards of one epoch are disjoint and
together cover the source. Batches may straddle an epoch boundary.

The iterator's position is a small dict (`get_state()` / `set_state()`); `state_to_json` and
`state_from_json` turn it into bytes for a checkpoint. Restoring it into a freshly built
iterator with the same arguments continues with exactly the batches the original would have
produced next.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np


class JsonlSource:
  """Prompts from a JSONL file, read eagerly (grain's random-access source protocol).

  Every non-blank line must be a JSON object with a string `"prompt"` field; all its fields are
  kept. `source[i]` returns a fresh copy of line i's dict.

  Raises (from the constructor):
    FileNotFoundError: the file does not exist.
    ValueError: the file has no records; a line is not valid JSON (file, line number and the
      JSON error in the message); a line has no string "prompt" field.
  """

  def __init__(self, path: str | os.PathLike):
    """Args:
    path: the JSONL file.
    """
    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"prompt file {self.path} does not exist")
    records = []
    with open(self.path, encoding="utf-8") as f:
      for line_no, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"prompt file {self.path} line {line_no} is not valid JSON: {e}") from e
        if not isinstance(record, dict):
          raise ValueError(
            f"prompt file {self.path} line {line_no} must be a JSON object, "
            f"got {type(record).__name__}"
          )
        if not isinstance(record.get("prompt"), str):
          raise ValueError(
            f'prompt file {self.path} line {line_no} has no string "prompt" field '
            f"(fields: {sorted(record)})"
          )
        records.append(record)
    if not records:
      raise ValueError(f"prompt file {self.path} is empty")
    self._records = records

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> dict[str, Any]:
    return dict(self._records[int(index)])

  def __repr__(self) -> str:
    return f"JsonlSource({self.path!r}, {len(self)} prompts)"


def collate(examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Batches a list of example dicts into one dict (the `batch_fn` of `prompt_batches`).

  Per field:
    * strings → `list[str]` (grain's default batching would make a NumPy unicode array);
    * numbers / arrays of one shape → `np.stack`, shape `[B, ...]`;
    * anything else (ragged token lists, mixed types) → a plain list of the B values.
  A field missing from some examples (optional JSONL fields) becomes a list with `None` there.

  Args:
    examples: B dicts.

  Returns:
    field -> batched value, fields in first-seen order.
  """
  keys = list(dict.fromkeys(k for e in examples for k in e))
  out = {}
  for key in keys:
    values = [e.get(key) for e in examples]
    if any(v is None for v in values) or any(isinstance(v, str | bytes) for v in values):
      out[key] = values
      continue
    arrays = [np.asarray(v) for v in values]
    same_shape = all(a.shape == arrays[0].shape for a in arrays)
    if same_shape and all(a.dtype.kind in "biufV" for a in arrays):
      out[key] = np.stack(arrays)
    else:
      out[key] = values
  return out


def prompt_batches(
  source: Sequence[Mapping[str, Any]],
  batch_size: int,
  seed: int,
  num_epochs: int | None = None,
  shard_index: int = 0,
  shard_count: int = 1,
  encode_fn: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
  num_threads: int = 0,
) -> grain.IterDataset:
  """A deterministic, sharded, resumable grain dataset of prompt batches.

  Element order: epoch e visits the source in the permutation π_e = index_shuffle(seed + e);
  this shard takes positions shard_index, shard_index + shard_count, ... of π_e. Consecutive
  elements are grouped into batches of `batch_size`; a last partial batch is dropped.

  Args:
    source: random-access sequence of dicts (`TaskSource`, `JsonlSource`, a list of dicts).
    batch_size: B, examples per batch on this process.
    seed: shuffle seed; the same seed gives the same batches.
    num_epochs: passes over this shard's slice; None repeats forever.
    shard_index: this process's shard, `jax.process_index()`.
    shard_count: number of shards, `jax.process_count()`.
    encode_fn: optional per-example transform (e.g. tokenisation) applied before batching.
    num_threads: grain reader threads; 0 reads in the calling thread (sources are in memory),
      raise it when `encode_fn` is expensive.

  Returns:
    A `grain.IterDataset`; `iter()` of it yields `collate`d batches: strings as lists of B,
    equal-shape numbers as arrays [B, ...]. The iterator supports `get_state()`/`set_state()`.

  Raises:
    ValueError: on a non-positive batch size or epoch count, a shard index outside
      [0, shard_count), fewer examples than shards, or a finite run too short for one batch.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
  if shard_count < 1 or not 0 <= shard_index < shard_count:
    raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index} and {shard_count}")
  if len(source) < shard_count:
    raise ValueError(f"{len(source)} prompts cannot be split over {shard_count} shards")
  ds = grain.MapDataset.source(source).seed(seed).shuffle()[shard_index::shard_count]
  if num_epochs is not None and len(ds) * num_epochs < batch_size:
    raise ValueError(
      f"shard {shard_index} holds {len(ds)} prompts x {num_epochs} epochs, "
      f"fewer than one batch of {batch_size}"
    )
  ds = ds.repeat(num_epochs)
  if encode_fn is not None:
    ds = ds.map(encode_fn)
  ds = ds.batch(batch_size, drop_remainder=True, batch_fn=collate)
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads))


def state_to_json(state: Mapping[str, Any]) -> bytes:
  """Serialises an iterator state (`iterator.get_state()`) to UTF-8 JSON bytes.

  NumPy integers (which some grain iterators use) are written as plain ints.
  """
  return json.dumps(state, sort_keys=True, default=_json_default).encode("utf-8")


def state_from_json(data: bytes | str) -> dict[str, Any]:
  """Inverse of `state_to_json`; pass the result to `iterator.set_state`."""
  return json.loads(data)


def _json_default(value: Any) -> Any:
  if isinstance(value, np.integer):
    return int(value)
  if isinstance(value, np.ndarray):
    return value.tolist()
  raise TypeError(f"iterator state holds a {type(value).__name__}, which is not JSON-serialisable")
