"""Prompt records to token ids: plain text or chat messages, the length policy, the shapes.

A record (`data.JsonlSource`) is `{"prompt": text}` or `{"messages": [{"role", "content"}]}`;
other fields are kept. Its ids, computed once when the run starts (`prepare`):

    text = record["prompt"]   or   tokenizer.render_chat(prompt_messages(record["messages"]))
    ids  = [bos] + encode(text)

where the chat template appends the generation prompt (the opening of the assistant turn)
after the conversation without a final assistant message (that message is the record's
reference completion, `opd_jax.rollout.off_policy`),
and bos is added when the tokenizer has one and the text does not already start with it
(chat templates such as Llama 3's write it themselves).

With `max_tokens` > 0 (`data.max_prompt_tokens`), a prompt of n > max_tokens ids is handled
by the `overlong` policy (`data.overlong`):

    truncate_left  keep the last max_tokens ids (after the bos, which stays first)
    drop           leave the record out; the count and the first few records are logged
    error          raise, naming the record and its length

Shapes: `task.encode_prompts` pads each batch to the power-of-two bucket of its own longest
prompt (`padding.prompt_bucket`, at least 16), never past the longest prompt, so one long
prompt does not pad every batch of the run. The sampler and the train step compile once per
bucket; `PromptSet.buckets` lists the buckets the prompts can reach (at most
log2(longest / 16) + 1 of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from opd_jax.data import padding, scoring

OVERLONG = ("truncate_left", "drop", "error")
_SHOWN = 5  # dropped records named in the log line


def prompt_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """The conversation a chat record prompts with: its messages without a final "assistant"
  message, which is the record's reference completion (`opd_jax.rollout.off_policy`), not prompt."""
  messages = list(messages)
  if messages and messages[-1].get("role") == "assistant":
    return messages[:-1]
  return messages


def record_text(record: dict[str, Any], tokenizer) -> str:
  """The text a record's prompt is: its "prompt", or its "messages" (`prompt_messages`)
  through the chat template with the generation prompt."""
  if "messages" in record:
    return tokenizer.render_chat(prompt_messages(record["messages"]))
  return record["prompt"]


def record_ids(record: dict[str, Any], tokenizer) -> tuple[str, list[int]]:
  """(text, ids) of one record: ids = [bos] + encode(text), bos only when the tokenizer has
  one and the encoded text does not already start with it."""
  text = record_text(record, tokenizer)
  ids = tokenizer.encode(text)
  bos = tokenizer.bos_id
  if bos is not None and (not ids or ids[0] != bos):
    ids = [bos, *ids]
  return text, ids


def truncate_left(ids: Sequence[int], max_tokens: int, bos_id: int | None) -> list[int]:
  """The last `max_tokens` ids; when `ids` start with bos, bos plus the last max_tokens - 1."""
  ids = list(ids)
  if len(ids) <= max_tokens:
    return ids
  if bos_id is not None and ids and ids[0] == bos_id and max_tokens > 1:
    return [bos_id, *ids[len(ids) - (max_tokens - 1) :]]
  return ids[len(ids) - max_tokens :]


@dataclasses.dataclass
class PromptSet:
  """Prepared prompts, a random-access source (grain's protocol) for `data.prompt_batches`.

  Record i is the source record with "prompt" replaced by its token ids (int32 [n_i], bos
  included) and "text" set to the record's prompt text, which `task.encode_prompts` takes as
  is. With `overlong="truncate_left"` the ids may encode only the end of that text: "text" stays
  the whole prompt (what the scorer and the sample log read), not what the model saw.
  """

  name: str  # where the prompts came from, for messages
  records: list[dict[str, Any]]
  lengths: np.ndarray  # int32 [N], the ids' lengths
  max_tokens: int  # the limit applied; 0 = none
  overlong: str
  dropped: list[str] = dataclasses.field(default_factory=list)  # names of dropped records
  truncated: int = 0

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int) -> dict[str, Any]:
    return dict(self.records[int(index)])

  @property
  def width(self) -> int:
    """The longest prompt in ids: the widest any batch is padded to."""
    return int(self.lengths.max())

  @property
  def buckets(self) -> list[int]:
    """The prompt widths the sampler can compile: bucket(n) over the prompts' lengths n."""
    return sorted({padding.prompt_bucket(int(n)) for n in np.unique(self.lengths)})

  def describe(self) -> str:
    """One log line: counts, lengths, what the length policy did, the compiled shapes."""
    n = self.lengths
    line = (
      f"{self.name}: {len(self)} prompts of {int(n.min())}..{self.width} tokens "
      f"(median {int(np.median(n))})"
    )
    if self.max_tokens:
      line += f"; limit {self.max_tokens} tokens ({self.overlong}): "
      line += f"{self.truncated} truncated, {len(self.dropped)} dropped"
      if self.dropped:
        more = ", ..." if len(self.dropped) > _SHOWN else ""
        line += f" ({', '.join(self.dropped[:_SHOWN])}{more})"
    widths = ", ".join(map(str, self.buckets))
    return (
      f"{line}; each batch is padded to the bucket of its longest prompt: "
      f"{len(self.buckets)} sampler shape(s) (prompt widths {widths})"
    )


def _line(source, index: int) -> str:
  lines = getattr(source, "line_numbers", None)
  return f" (line {lines[index]})" if lines is not None else ""


def prepare(
  source, tokenizer, max_tokens: int = 0, overlong: str = "error", name: str | None = None
) -> PromptSet:
  """Renders and tokenizes every record of `source` and applies the length policy.

  Args:
    source: a random-access sequence of records (`data.JsonlSource`, a list of dicts).
    tokenizer: a `opd_jax.model.tokenizer` tokenizer.
    max_tokens: the longest prompt kept as is, in ids with bos; 0 = no limit.
    overlong: what happens to longer prompts: one of `OVERLONG`.
    name: the source's name in messages; default its `path`.

  Returns:
    The `PromptSet`.

  Raises:
    ValueError: a record that cannot be rendered or tokenized, an empty one (no ids but bos),
      or one whose "answer" is not a string or a number (the message
      names the record: "prompt i of <file>: ... (line n)"); with overlong="error", the first
      record longer than `max_tokens`; every record dropped; an unknown policy.
  """
  if overlong not in OVERLONG:
    raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}; got {overlong!r}")
  if max_tokens < 0:
    raise ValueError(f"max_tokens must be >= 0 (0 = no limit), got {max_tokens}")
  name = name or getattr(source, "path", "the prompts")
  records, lengths, dropped, truncated = [], [], [], 0
  for i in range(len(source)):
    record = source[i]
    where = f"prompt {i} of {name}"
    try:
      text, ids = record_ids(record, tokenizer)
      scoring.answer_of(record)  # every record's, before a held-out split picks some
    except ValueError as e:
      raise ValueError(f"{where}: {e}{_line(source, i)}") from e
    if not ids or list(ids) == [tokenizer.bos_id]:
      raise ValueError(f"{where}{_line(source, i)} is empty: it encodes to no tokens but bos")
    if max_tokens and len(ids) > max_tokens:
      if overlong == "error":
        raise ValueError(
          f"{where}{_line(source, i)} has {len(ids)} tokens, more than "
          f"data.max_prompt_tokens={max_tokens} (set data.overlong to truncate_left or drop)"
        )
      if overlong == "drop":
        dropped.append(f"prompt {i}")
        continue
      ids = truncate_left(ids, max_tokens, tokenizer.bos_id)
      truncated += 1
    records.append(record | {"prompt": np.asarray(ids, np.int32), "text": text})
    lengths.append(len(ids))
  if not records:
    raise ValueError(
      f"all {len(source)} prompts of {name} are longer than data.max_prompt_tokens="
      f"{max_tokens} and were dropped"
    )
  return PromptSet(
    name, records, np.asarray(lengths, np.int32), max_tokens, overlong, dropped, truncated
  )
