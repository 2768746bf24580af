"""The prompt pipeline: sources of prompts and a deterministic, shardable, resumable batcher.

Sources are random-access sequences of dicts with at least a string `"prompt"`:

* `opd_jax.data.task.TaskSource(split, size, seed)`: the built-in synthetic task
  (`{"prompt", "completion", "answer"}`).
* `JsonlSource(path)`: a JSONL file, one object per line with a string `"prompt"` or a chat
  `"messages"` list (`[{"role": ..., "content": ...}, ...]`, rendered later with the
  tokenizer's chat template by `opd_jax.data.prompts`); other fields (e.g. `"answer"`) are kept.
  The file is read and validated eagerly, so a bad file fails at start-up with the file and
  line in the message, not hours into a run.

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

import difflib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  import grain

PROMPT_FIELDS = ("prompt", "messages")


class JsonlSource:
  """Prompts from a JSONL file, read eagerly (grain's random-access source protocol).

  Every non-blank line must be a JSON object with exactly one of a string `"prompt"` field or
  a non-empty `"messages"` list of `{"role": str, "content": str}` objects; all its fields are
  kept. A reference completion (for train.on_policy_fraction < 1, `opd_jax.rollout.off_policy`) is a
  `"completion"` string or a final assistant message, not both. `source[i]` returns a fresh
  copy of record i's dict; `line_numbers[i]` is its line.

  Raises (from the constructor):
    FileNotFoundError: the file does not exist.
    ValueError: the file has no records; a line is not valid JSON (file, line number and the
      JSON error in the message); a line has neither field (with the nearest field name when
      one looks misspelt), both, or a malformed one.
  """

  def __init__(self, path: str | os.PathLike):
    """Args:
    path: the JSONL file.
    """
    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"prompt file {self.path} does not exist")
    records, lines = [], []
    with open(self.path, "rb") as f:  # split on b"\n" only; each line decoded below
      for line_no, raw in enumerate(f, start=1):
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          raise ValueError(f"prompt file {self.path} line {line_no} is not UTF-8: {e}") from e
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"prompt file {self.path} line {line_no} is not valid JSON: {e}") from e
        problem = record_problem(record)
        if problem:
          raise ValueError(f"prompt file {self.path} line {line_no} {problem}")
        records.append(record)
        lines.append(line_no)
    if not records:
      raise ValueError(f"prompt file {self.path} is empty")
    self._records = records
    self.line_numbers = lines

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> dict[str, Any]:
    return dict(self._records[int(index)])

  def __repr__(self) -> str:
    return f"JsonlSource({self.path!r}, {len(self)} prompts)"


def record_problem(record: Any) -> str | None:
  """What is wrong with one prompt record, as the end of a sentence; None when it is valid."""
  if not isinstance(record, dict):
    return f"must be a JSON object, got {type(record).__name__}"
  has_prompt, has_messages = "prompt" in record, "messages" in record
  if has_prompt and has_messages:
    return 'has both "prompt" and "messages"; give one'
  if "completion" in record and not isinstance(record["completion"], str):
    return f'has a "completion" that is not a string: {record["completion"]!r:.80}'
  if has_messages:
    return _messages_problem(record["messages"], "completion" in record)
  if not isinstance(record.get("prompt"), str):
    hint = ""
    for key in record:
      near = difflib.get_close_matches(str(key), PROMPT_FIELDS, n=1, cutoff=0.6)
      if near and not has_prompt:
        hint = f'; is {key!r} a misspelt "{near[0]}"?'
        break
    return f'has no string "prompt" field and no "messages" list (fields: {sorted(record)}){hint}'
  return None


def _messages_problem(messages: Any, has_completion: bool = False) -> str | None:
  if not isinstance(messages, list) or not messages:
    return f'has "messages" that is not a non-empty list: {messages!r:.80}'
  for i, message in enumerate(messages):
    ok = isinstance(message, dict) and all(
      isinstance(message.get(k), str) for k in ("role", "content")
    )
    if not ok:
      return (
        f'has "messages"[{i}] that is not a {{"role": str, "content": str}} object: {message!r:.80}'
      )
  if messages[-1]["role"] == "assistant":  # the reference completion (opd_jax.rollout.off_policy)
    if len(messages) == 1:
      return 'has only an assistant message in "messages": nothing is left to prompt with'
    if has_completion:
      return 'has both a "completion" and a final assistant message; give one'
  return None


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
    try:
      arrays = [np.asarray(v) for v in values]
    except ValueError:  # a ragged nested list: numpy refuses it
      out[key] = values
      continue
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
  import grain  # here, not at the top: commands that read no batches (admit) skip its 0.07 s

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
