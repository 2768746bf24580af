"""The embedded synthetic task: multi-operand addition with written intermediate steps, and a
long-completion variant (a counted chain of additions).

A prompt lists `num_operands` integers to add; the unique correct completion adds
them left to right, writing every partial sum, then states the answer after `>`:

    prompt      37+58+21=
    completion  37+58=95;95+21=116>116        (then <eos>)
    answer      116

With the default config (three operands in [10, 99]) every prompt is 9 characters
and every completion 20-24 characters, so 10 prompt tokens with `<bos>` and 21-25
completion tokens with `<eos>`. Early mistakes propagate through the written partial
sums, so the prefix the student reaches matters for the final answer.

Learnability: a 2-layer d=128 Llama-style model trained from scratch with AdamW
(lr 1e-3, batch 64, loss on completion tokens) reached 75% held-out exact match
(greedy) after 500 steps, 95% after 750 and 99% after 1000 (timings:
docs/results/benchmarks.md). `TaskConfig(num_operands=5, min_operand=0, max_operand=9)` is easier
(100% after 500 steps); more or wider operands make it harder.

The chain variant (`TaskConfig(kind="chain")`) writes hundreds of tokens per completion, where
KV-cache error has that many positions to accumulate over. A prompt `a+d*n=` asks for
a + d·n; the completion adds d to a running value n times, each step counting down and
writing the new value, then states the answer:

    prompt      37+8*3=
    completion  3:45;2:53;1:61>61            (then <eos>)
    answer      61

a is drawn from [min_operand, max_operand], d from [1, max_step] and n = num_operands. Each
step reads only the step before it (decrement the counter, add d, copied from the prompt),
so the chain is as easy per step at n = 40 as at n = 3, and a mistake in one step carries to
the answer. With n = 32 and the default operands, completions run 186-219 tokens with
`<eos>` (6-7 characters a step). Learnability: the 2-layer d=128 model above, batch 16,
reached 94% held-out greedy exact match at n = 32 after 1,125 steps (`tests/data/test_task.py`,
slow).

Examples are a pure function of `(seed, split, index)`. The train/held-out split is
decided by a hash of the prompt, so the two splits never share a prompt whatever
the seeds and sizes.

This module owns the task definition, the exact-match scorer, the grain-friendly
random-access source and the encodings into fixed-length token arrays.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import jax
import numpy as np

from opd_jax.data import padding

SPLITS = ("train", "heldout")
KINDS = ("sum", "chain")
ANSWER_MARKER = ">"
STEP_SEPARATOR = ";"
COUNT_MARKER = ":"  # chain: "<steps left>:<value>"
_PROMPT_RE = re.compile(r"\d+(\+\d+)+=")
_CHAIN_RE = re.compile(r"(\d+)\+(\d+)\*(\d+)=")
_ANSWER_RE = re.compile(r"-?\d+")
_MAX_DRAWS = 1000


@dataclasses.dataclass(frozen=True, repr=False)
class TaskConfig:
  """Shape of the synthetic addition task (sum) or of its long variant (chain)."""

  num_operands: int = 3  # sum: integers to add (≥ 2); chain: steps n (≥ 2)
  min_operand: int = 10  # smallest operand (≥ 0); chain: of the start a
  max_operand: int = 99  # largest operand; chain: of the start a
  heldout_fraction: float = 0.1  # share of prompts (by hash) reserved for the held-out split
  kind: str = "sum"  # sum | chain (module docstring)
  max_step: int = 9  # chain: largest step d (1..9, one digit)

  def __repr__(self) -> str:
    """The fields, with kind and max_step only when they are not the defaults: the teacher
    cache keys on this string (`pretrain`), so the sum task's keys predate the chain."""
    fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)]
    if self.kind == "sum" and self.max_step == 9:
      fields = fields[:4]
    return f"TaskConfig({', '.join(fields)})"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"TaskConfig.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
    if not isinstance(self.max_step, int) or not 1 <= self.max_step <= 9:
      raise ValueError(f"TaskConfig.max_step must be an int in [1, 9], got {self.max_step!r}")
    if not isinstance(self.num_operands, int) or self.num_operands < 2:
      raise ValueError(f"TaskConfig.num_operands must be an int ≥ 2, got {self.num_operands!r}")
    if not 0 <= self.min_operand <= self.max_operand:
      raise ValueError(
        f"TaskConfig needs 0 ≤ min_operand ≤ max_operand, got min_operand={self.min_operand}, "
        f"max_operand={self.max_operand}"
      )
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(
        f"TaskConfig.heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}"
      )

  def _chars(self, operand: int) -> tuple[int, int]:
    """(prompt chars, completion chars) when every operand equals `operand` (chain: the start
    a = `operand` with d = max_step for the longest, d = 1 for the shortest).

    Both are nondecreasing in the operand, so the min/max operand give exact bounds.
    """
    if self.kind == "chain":
      return self._chain_chars(operand)
    n, width = self.num_operands, len(str(operand))
    prompt = n * width + (n - 1) + 1
    steps = sum(
      len(str(i * operand)) + 1 + width + 1 + len(str((i + 1) * operand)) for i in range(1, n)
    )
    completion = steps + (n - 2) + 1 + len(str(n * operand))
    return prompt, completion

  def _chain_chars(self, start: int) -> tuple[int, int]:
    n = self.num_operands
    d = self.max_step if start == self.max_operand else 1
    prompt = len(format_chain_prompt(start, self.max_step, n))
    return prompt, len(solve_chain(start, d, n).completion)

  @property
  def max_prompt_chars(self) -> int:
    return self._chars(self.max_operand)[0]

  @property
  def max_completion_chars(self) -> int:
    return self._chars(self.max_operand)[1]

  @property
  def min_completion_chars(self) -> int:
    return self._chars(self.min_operand)[1]

  @property
  def max_prompt_tokens(self) -> int:
    """Longest prompt in character tokens, `<bos>` included (10 for the default)."""
    return self.max_prompt_chars + 1

  @property
  def max_completion_tokens(self) -> int:
    """Longest completion in character tokens, `<eos>` included (25 for the default)."""
    return self.max_completion_chars + 1

  @property
  def min_completion_tokens(self) -> int:
    """Shortest completion in character tokens, `<eos>` included (21 for the default)."""
    return self.min_completion_chars + 1

  @property
  def seq_len(self) -> int:
    """Length of `encode_example`'s arrays with the character tokenizer (35 for the default)."""
    return self.max_prompt_tokens + self.max_completion_tokens


@dataclasses.dataclass(frozen=True)
class Example:
  """One task instance; `completion` excludes the end-of-sequence token."""

  prompt: str
  completion: str
  answer: str


def format_chain_prompt(start: int, step: int, count: int) -> str:
  """'37+8*3=' for start 37, step 8, 3 steps."""
  return f"{int(start)}+{int(step)}*{int(count)}="


def solve_chain(start: int, step: int, count: int) -> Example:
  """The chain variant's unique correct example: `count` steps "k:v", k counting down from
  `count` to 1 and v = start + step · (count − k + 1), then the answer start + step · count."""
  steps, value = [], int(start)
  for k in range(int(count), 0, -1):
    value += int(step)
    steps.append(f"{k}{COUNT_MARKER}{value}")
  completion = STEP_SEPARATOR.join(steps) + ANSWER_MARKER + str(value)
  return Example(
    prompt=format_chain_prompt(start, step, count), completion=completion, answer=str(value)
  )


def format_prompt(operands) -> str:
  """'37+58+21=' for operands (37, 58, 21)."""
  return "+".join(str(int(x)) for x in operands) + "="


def solve(operands) -> Example:
  """The unique correct example for `operands`: partial sums left to right, then the answer."""
  operands = [int(x) for x in operands]
  steps, total = [], operands[0]
  for x in operands[1:]:
    steps.append(f"{total}+{x}={total + x}")
    total += x
  completion = STEP_SEPARATOR.join(steps) + ANSWER_MARKER + str(total)
  return Example(prompt=format_prompt(operands), completion=completion, answer=str(total))


def split_of(prompt: str, task_cfg: TaskConfig) -> str:
  """'heldout' for the `heldout_fraction` of prompts selected by a stable hash, else 'train'."""
  digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
  u = int.from_bytes(digest, "little") / 2.0**64
  return "heldout" if u < task_cfg.heldout_fraction else "train"


def make_example(
  seed: int, index: int, split: str = "train", task_cfg: TaskConfig = TaskConfig()
) -> Example:
  """Deterministic example number `index` of `split`.

  Operands are drawn uniformly from [min_operand, max_operand] with
  `np.random.default_rng([seed, split_id, index])`, redrawing until the prompt's hash
  falls in `split`.

  Args:
    seed: the data seed.
    index: the example number (≥ 0).
    split: 'train' or 'heldout'.
    task_cfg: the task shape.

  Returns:
    An `Example`.
  """
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  if index < 0:
    raise ValueError(f"example index must be ≥ 0, got {index}")
  rng = np.random.default_rng([seed, SPLITS.index(split), index])
  for _ in range(_MAX_DRAWS):
    if task_cfg.kind == "chain":
      start = int(rng.integers(task_cfg.min_operand, task_cfg.max_operand + 1))
      step = int(rng.integers(1, task_cfg.max_step + 1))
      if split_of(format_chain_prompt(start, step, task_cfg.num_operands), task_cfg) == split:
        return solve_chain(start, step, task_cfg.num_operands)
      continue
    operands = rng.integers(
      task_cfg.min_operand, task_cfg.max_operand + 1, size=task_cfg.num_operands
    )
    if split_of(format_prompt(operands), task_cfg) == split:
      return solve(operands)
  raise ValueError(f"{task_cfg} leaves the {split!r} split (nearly) empty; widen the operand range")


class TaskSource:
  """Random-access source of task examples (grain's `RandomAccessDataSource` protocol).

  `source[i]` is `{"prompt": str, "completion": str, "answer": str}`, a pure function
  of `(seed, split, i)`.
  """

  def __init__(
    self, split: str, size: int, seed: int = 0, task_cfg: TaskConfig = TaskConfig()
  ) -> None:
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if size < 1:
      raise ValueError(f"TaskSource size must be ≥ 1, got {size}")
    self.split, self.size, self.seed, self.config = split, size, seed, task_cfg

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict[str, str]:
    index = int(index)
    if not 0 <= index < self.size:
      raise IndexError(f"index {index} out of range for a TaskSource of size {self.size}")
    return dataclasses.asdict(make_example(self.seed, index, self.split, self.config))

  def __repr__(self) -> str:
    return f"TaskSource(split={self.split!r}, size={self.size}, seed={self.seed}, {self.config})"


def parse_answer(completion_text: str) -> str | None:
  """The integer literal after the single answer marker, or None when malformed."""
  head, marker, tail = completion_text.partition(ANSWER_MARKER)
  if not marker or ANSWER_MARKER in tail or not _ANSWER_RE.fullmatch(tail):
    return None
  return tail


def score(prompt: str, completion_text: str) -> bool:
  """Exact match of the final answer.

  Args:
    prompt: a task prompt such as '37+58+21=' (sum) or '37+8*3=' (chain).
    completion_text: the decoded completion (text before `<eos>`).

  Returns:
    True iff the completion holds exactly one '>' followed by exactly the decimal value
    of the prompt's expression (the operands' sum; a + d·n for a chain) with no sign,
    spaces or leading zeros. Intermediate steps are not checked. Anything malformed
    scores False.

  Raises:
    ValueError: when `prompt` is not a task prompt.
  """
  chain = _CHAIN_RE.fullmatch(prompt)
  if chain:
    start, step, count = (int(g) for g in chain.groups())
    return parse_answer(completion_text) == str(start + step * count)
  if not _PROMPT_RE.fullmatch(prompt):
    raise ValueError(f"{prompt!r} is not a task prompt like '37+58+21=' or '37+8*3='")
  truth = str(sum(int(x) for x in prompt[:-1].split("+")))
  return parse_answer(completion_text) == truth


def encode_example(example, tokenizer, seq_len: int) -> dict[str, np.ndarray]:
  """Fixed-length arrays for supervised training on one example.

  Layout: `[bos] prompt completion [eos] pad ...` (bos only when the tokenizer has one).
  The model is trained with logits[:, t] predicting tokens[:, t + 1], weighted by
  loss_mask[:, t + 1]: the mask marks the completion tokens and the eos.

  Args:
    example: an `Example` or a `TaskSource` item dict.
    tokenizer: a `opd_jax.model.tokenizer` tokenizer.
    seq_len: T; `TaskConfig.seq_len` fits every example of that config with the
      character tokenizer.

  Returns:
    {"tokens": int32 [T], "loss_mask": float32 [T], "prompt_len": int32 scalar
     (tokens before the completion, bos included)}.

  Raises:
    ValueError: when the encoded example is longer than `seq_len`.
  """
  prompt, completion = _fields(example)
  bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  prompt_ids = bos + tokenizer.encode(prompt)
  completion_ids = tokenizer.encode(completion) + [tokenizer.eos_id]
  length = len(prompt_ids) + len(completion_ids)
  if length > seq_len:
    raise ValueError(f"example {prompt + completion!r} needs {length} tokens > seq_len={seq_len}")
  tokens = np.full((seq_len,), tokenizer.pad_id, np.int32)
  tokens[:length] = prompt_ids + completion_ids
  loss_mask = np.zeros((seq_len,), np.float32)
  loss_mask[len(prompt_ids) : length] = 1.0
  return {"tokens": tokens, "loss_mask": loss_mask, "prompt_len": np.int32(len(prompt_ids))}


def encode_batch(examples, tokenizer, seq_len: int) -> dict[str, np.ndarray]:
  """`encode_example` over a list, stacked: tokens [B, T], loss_mask [B, T], prompt_len [B]."""
  encoded = [encode_example(e, tokenizer, seq_len) for e in examples]
  return {k: np.stack([e[k] for e in encoded]) for k in ("tokens", "loss_mask", "prompt_len")}


def encode_prompts(prompts, tokenizer, length: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded prompt tokens for the sampler, padded to the batch's own bucket.

  Row b is `[bos] prompt_b pad ...` for a text prompt (bos when the tokenizer has one), or
  prompt_b itself when it is already token ids (`opd_jax.data.prompts` gives those, bos
  included); decoding for row b starts at position lengths[b], overwriting the padding.
  The width is

      P = min(length, padding.prompt_bucket(max_b lengths[b]))

  so a batch of short prompts is not padded to the longest prompt of the whole run, and the
  sampler, which pads to that same power-of-two bucket, sees at most one shape per bucket.
  Every default-config task prompt has the same length, below the smallest bucket, so P is
  `length` there. With several processes P is always `length`: each process encodes its own
  rows, and the gathered arrays must agree in shape.

  Args:
    prompts: B prompts, each a string or a sequence of token ids.
    tokenizer: a `opd_jax.model.tokenizer` tokenizer.
    length: the widest a batch may be (`TaskConfig.max_prompt_tokens` fits the task; the
      longest prepared prompt for a file).

  Returns:
    (tokens int32 [B, P], lengths int32 [B]).

  Raises:
    ValueError: when a prompt is longer than `length`.
  """
  bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  rows = []
  for prompt in prompts:
    ids = bos + tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if len(ids) > length:
      raise ValueError(f"prompt {prompt!r} needs {len(ids)} tokens > length={length}")
    rows.append(ids)
  width = min(length, padding.prompt_bucket(max((len(r) for r in rows), default=1)))
  if jax.process_count() > 1:
    width = length
  tokens = np.full((len(rows), width), tokenizer.pad_id, np.int32)
  lengths = np.zeros((len(rows),), np.int32)
  for b, ids in enumerate(rows):
    tokens[b, : len(ids)] = ids
    lengths[b] = len(ids)
  return tokens, lengths


def _fields(example) -> tuple[str, str]:
  if isinstance(example, Example):
    return example.prompt, example.completion
  return example["prompt"], example["completion"]
