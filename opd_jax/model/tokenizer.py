"""Tokenizers behind one small interface, and the student/teacher vocabulary check.

OPD compares student and teacher distributions token by token, so both models must
share one vocabulary. Everything downstream (task encoding, sampler, trainer) uses
only this interface:

    encode(text) -> list[int]     # no special tokens added
    decode(ids) -> str            # stops at eos, drops pad and other special tokens
    vocab_size, pad_id, bos_id, eos_id
    get_vocab() -> dict[str, int] # token string -> id, for the vocabulary check
    render_chat(messages) -> str  # the chat template with the generation prompt appended

Vocabulary checks: `check_vocabularies` accepts a student and teacher that share one
tokenizer even when their embedding tables differ in size (padded vocabularies, e.g.
Qwen2.5 0.5B-3B with 151,936 rows and 7B+ with 152,064 over one tokenizer of 151,665
tokens); `real_vocab_size` is V_real, the ids that tokenizer can produce, which the models'
logits are cut to (`ModelConfig.logical_vocab_size`). Tokenizers that differ are refused
with what differs (`tokenizer_differences`). `check_same_vocab` is the strict form (equal
sizes).

Two implementations:
- `CharTokenizer`: the built-in character tokenizer for the synthetic task
  (`opd_jax.data.task`). Needs no files.
- `HFTokenizer`: wraps a local Hugging Face tokenizer directory, loaded offline.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
# A Hugging Face tokenizer directory holds at least one of these.
TOKENIZER_MAIN_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Digits, the operators and separators of the synthetic task, and a space.
CHAR_ALPHABET = "0123456789+-*=;>: "


class CharTokenizer:
  """Character-level tokenizer: `<pad>`=0, `<bos>`=1, `<eos>`=2, then one id per character.

  The alphabet is fixed (`CHAR_ALPHABET`), so ids never change between runs and a
  model trained on the synthetic task can be reloaded without a tokenizer file.
  """

  def __init__(self, alphabet: str = CHAR_ALPHABET):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError(f"alphabet {alphabet!r} has repeated characters")
    self.alphabet = alphabet
    self._tokens = list(SPECIAL_TOKENS) + list(alphabet)
    self._char_to_id = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(alphabet)}

  @property
  def vocab_size(self) -> int:
    """Number of ids: 3 special tokens plus the alphabet."""
    return len(self._tokens)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  def encode(self, text: str) -> list[int]:
    """Character ids of `text`, without bos/eos.

    Raises:
      ValueError: naming the first character outside the alphabet and its position.
    """
    ids = []
    for pos, char in enumerate(text):
      if char not in self._char_to_id:
        raise ValueError(
          f"character {char!r} at position {pos} of {text!r} is not in the tokenizer "
          f"alphabet {self.alphabet!r}"
        )
      ids.append(self._char_to_id[char])
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, stopping at the first eos and skipping pad and bos.

    Raises:
      ValueError: for an id outside [0, vocab_size).
    """
    chars = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
      if i >= len(SPECIAL_TOKENS):
        chars.append(self._tokens[i])
    return "".join(chars)

  def get_vocab(self) -> dict[str, int]:
    """Token string -> id."""
    return {t: i for i, t in enumerate(self._tokens)}

  def render_chat(self, messages) -> str:
    """Always raises: the character tokenizer serves the built-in task and has no chat template.

    Raises:
      ValueError: naming the fix (a Hugging Face tokenizer with a chat template).
    """
    raise ValueError(
      'the built-in character tokenizer has no chat template, so "messages" records cannot be '
      "rendered; set config.tokenizer (or student.checkpoint) to a Hugging Face tokenizer "
      'directory with a chat template, or give plain "prompt" text'
    )


class HFTokenizer:
  """A Hugging Face tokenizer exposed through the same interface as `CharTokenizer`.

  `vocab_size` is `len(tokenizer)`, which counts added special tokens. A model's
  embedding table may be larger (padded); compare model sizes with `check_same_vocab`.
  `pad_id` falls back to `eos_id` when the tokenizer defines no pad token (Llama);
  `bos_id` may be None (Qwen).
  """

  def __init__(self, hf_tokenizer):
    if hf_tokenizer.eos_token_id is None:
      raise ValueError(f"tokenizer {hf_tokenizer.name_or_path!r} defines no eos token")
    self.hf = hf_tokenizer

  @property
  def vocab_size(self) -> int:
    return len(self.hf)

  @property
  def pad_id(self) -> int:
    pad = self.hf.pad_token_id
    return self.eos_id if pad is None else int(pad)

  @property
  def bos_id(self) -> int | None:
    bos = self.hf.bos_token_id
    return None if bos is None else int(bos)

  @property
  def eos_id(self) -> int:
    return int(self.hf.eos_token_id)

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without special tokens."""
    return list(self.hf.encode(text, add_special_tokens=False))

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first eos, with special tokens (pad included) dropped."""
    kept = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      kept.append(i)
    return self.hf.decode(kept, skip_special_tokens=True)

  def get_vocab(self) -> dict[str, int]:
    """Token string -> id, added tokens included."""
    return dict(self.hf.get_vocab())

  def render_chat(self, messages) -> str:
    """`messages` ([{"role", "content"}, ...]) rendered with the tokenizer's chat template,
    with the generation prompt (the assistant turn's opening) appended: the text a chat
    model continues. `encode` of it gives the ids `apply_chat_template(tokenize=True)` gives.

    Raises:
      ValueError: the tokenizer has no chat template, or the template fails on `messages`.
    """
    if not getattr(self.hf, "chat_template", None):
      raise ValueError(
        f'tokenizer {self.hf.name_or_path!r} has no chat template, so "messages" records '
        'cannot be rendered; give plain "prompt" text or a tokenizer with a chat template'
      )
    try:
      return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 errors (TemplateError, UndefinedError, ...) and others
      raise ValueError(f"the chat template of {self.hf.name_or_path!r} failed: {e}") from e


def load_tokenizer(path_or_name: str) -> CharTokenizer | HFTokenizer:
  """Loads a tokenizer by name or from a local directory, without network access.

  Args:
    path_or_name: "char" (or "", see `resolve_name`) for the built-in `CharTokenizer`,
      or a local directory holding a Hugging Face tokenizer (tokenizer.json /
      tokenizer_config.json).

  Returns:
    A tokenizer with encode/decode/vocab_size/pad_id/bos_id/eos_id/get_vocab.

  Raises:
    FileNotFoundError: when the directory does not exist.
    ValueError: when it holds no tokenizer files, or transformers cannot load them.
  """
  if path_or_name in ("char", ""):
    return CharTokenizer()
  if not os.path.isdir(path_or_name):
    raise FileNotFoundError(
      f"tokenizer directory {path_or_name!r} does not exist (use 'char' for the built-in "
      "character tokenizer)"
    )
  if not any(os.path.isfile(os.path.join(path_or_name, n)) for n in TOKENIZER_MAIN_FILES):
    raise ValueError(
      f"directory {path_or_name!r} holds no tokenizer ({', '.join(TOKENIZER_MAIN_FILES)}); "
      "set config.tokenizer to the directory of the checkpoint's tokenizer"
    )
  from transformers import AutoTokenizer

  try:
    hf_tokenizer = AutoTokenizer.from_pretrained(path_or_name, local_files_only=True)
  except (OSError, ValueError, KeyError) as e:
    raise ValueError(f"cannot load the tokenizer in {path_or_name!r}: {e}") from e
  return HFTokenizer(hf_tokenizer)


def resolve_name(tokenizer: str, student_checkpoint: str) -> str:
  """The tokenizer a run uses: `config.tokenizer` when set, else the student checkpoint's
  directory when there is one, else "char" (the built-in task's tokenizer).

  Args:
    tokenizer: `config.tokenizer`: "" (unset), "char", or a tokenizer directory.
    student_checkpoint: `config.student.checkpoint` ("" for a built-in student).
  """
  if tokenizer:
    return tokenizer
  return student_checkpoint or "char"


def real_vocab_size(tok) -> int:
  """V_real: how many ids the tokenizer can produce, max(len, largest id + 1).

  The largest id counts every token of `get_vocab()` (added tokens included) and the
  bos/eos/pad ids, so a tokenizer whose ids leave gaps is never cut short. A model's
  embedding table may have more rows (a padded vocabulary); its logits are then cut to
  V_real (`ModelConfig.logical_vocab_size`).
  """
  ids = list(tok.get_vocab().values()) + [i for i in special_ids(tok).values() if i is not None]
  return max(tok.vocab_size, max(ids, default=-1) + 1)


def special_ids(tok) -> dict[str, int | None]:
  """{"bos", "eos", "pad"} -> the tokenizer's id (bos may be None)."""
  return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}


def _first_difference(student_tok, teacher_tok) -> str | None:
  """Describes the first id whose token differs between two tokenizers, or None."""
  s_by_id = {i: t for t, i in student_tok.get_vocab().items()}
  t_by_id = {i: t for t, i in teacher_tok.get_vocab().items()}
  for i in range(max(len(s_by_id), len(t_by_id), max(s_by_id, default=-1) + 1)):
    s, t = s_by_id.get(i), t_by_id.get(i)
    if s != t:
      return f"first differing token: id {i} is {s!r} in the student and {t!r} in the teacher"
  return None


def tokenizer_differences(student_tok, teacher_tok, examples: int = 3) -> list[str]:
  """What differs between two tokenizers, one phrase per kind ([] when they are identical).

  Compared: the token -> id maps (`get_vocab()`, added tokens included), id by id, with the
  first difference and the count of differing ids; the sizes; and the bos/eos/pad ids
  (`special_ids`), each named with its token.

  Args:
    student_tok, teacher_tok: tokenizers with `get_vocab()`, `vocab_size` and the special ids.
    examples: how many further differing ids are shown after the first.
  """
  s_vocab, t_vocab = student_tok.get_vocab(), teacher_tok.get_vocab()
  out = []
  if s_vocab != t_vocab:
    s_by_id = {i: t for t, i in s_vocab.items()}
    t_by_id = {i: t for t, i in t_vocab.items()}
    differing = sorted(i for i in set(s_by_id) | set(t_by_id) if s_by_id.get(i) != t_by_id.get(i))
    phrase = (
      f"first differing token: id {differing[0]} is {s_by_id.get(differing[0])!r} in the "
      f"student and {t_by_id.get(differing[0])!r} in the teacher ({len(differing)} id(s) differ"
    )
    more = [
      f"id {i}: {s_by_id.get(i)!r} vs {t_by_id.get(i)!r}" for i in differing[1 : 1 + examples]
    ]
    out.append(phrase + (f"; also {', '.join(more)}" if more else "") + ")")
  if student_tok.vocab_size != teacher_tok.vocab_size:
    out.append(
      f"the student's tokenizer has {student_tok.vocab_size} tokens, the teacher's "
      f"{teacher_tok.vocab_size}"
    )
  s_ids, t_ids = special_ids(student_tok), special_ids(teacher_tok)
  s_tokens = {i: t for t, i in s_vocab.items()}
  t_tokens = {i: t for t, i in t_vocab.items()}
  for name in s_ids:
    if s_ids[name] != t_ids[name]:
      out.append(
        f"{name} id {s_ids[name]} ({s_tokens.get(s_ids[name])!r}) in the student, "
        f"{t_ids[name]} ({t_tokens.get(t_ids[name])!r}) in the teacher"
      )
  return out


def check_same_vocab(
  student_vocab_size: int, teacher_vocab_size: int, student_tok=None, teacher_tok=None
) -> None:
  """Refuses a student/teacher pair that does not share one vocabulary of one size.

  The strict check: equal embedding rows and, when both tokenizers are given, every id
  mapped to the same token string. A run accepts more: one tokenizer over embedding tables
  of different sizes (`check_vocabularies`).

  Args:
    student_vocab_size: the student model's vocabulary size (ModelConfig.vocab_size).
    teacher_vocab_size: the teacher model's vocabulary size.
    student_tok: optional student tokenizer (anything with `get_vocab()`).
    teacher_tok: optional teacher tokenizer.

  Raises:
    ValueError: with both sizes, and the first differing token when tokenizers are given.
  """
  diff = None
  if student_tok is not None and teacher_tok is not None:
    diff = _first_difference(student_tok, teacher_tok)
  if student_vocab_size != teacher_vocab_size or diff is not None:
    message = (
      f"student and teacher vocabularies differ: student vocab_size={student_vocab_size}, "
      f"teacher vocab_size={teacher_vocab_size}"
    )
    if diff is not None:
      message += f"; {diff}"
    raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class VocabCheck:
  """What `check_vocabularies` accepted: V_real, the two tables' rows, and what it compared."""

  real_vocab_size: int  # V_real: the ids every softmax and sampler of the run covers
  student_rows: int  # the student's embedding rows (ModelConfig.vocab_size)
  teacher_rows: int  # the teacher's
  compared: str  # one line for the run's log: which tokenizers were compared, and how


def check_vocabularies(
  student_rows: int,
  teacher_rows: int,
  tok,
  teacher_tok=None,
  tokenizer_name: str = "the run's tokenizer",
  teacher_tokenizer_name: str = "the teacher's tokenizer",
) -> VocabCheck:
  """Accepts a student and teacher that share one tokenizer, padded tables included.

  Per-token KL between student and teacher is only meaningful when id v means the same
  token in both. The run's tokenizer `tok` is the student's. When the teacher checkpoint has
  a tokenizer of its own (`teacher_tok`), the two must be identical (`tokenizer_differences`:
  every token's id, the sizes, the bos/eos/pad ids); without one, only the sizes can be
  compared, and the returned `compared` line says so. Either way both embedding tables must
  hold the tokenizer's ids, V_real = `real_vocab_size(tok)` ≤ min(student_rows,
  teacher_rows); rows beyond V_real are padding, which the models' logits leave out
  (`ModelConfig.logical_vocab_size`), so the tables may differ in size.

  Args:
    student_rows, teacher_rows: the models' embedding rows (ModelConfig.vocab_size).
    tok: the run's tokenizer.
    teacher_tok: the teacher checkpoint's own tokenizer, or None when it has none (or it is
      the run's tokenizer directory).
    tokenizer_name, teacher_tokenizer_name: how messages name the two (their directories).

  Returns:
    The `VocabCheck`.

  Raises:
    ValueError: tokenizers that differ (what differs, with examples), or a tokenizer with
      more ids than a table has rows (both sizes named).
  """
  if teacher_tok is not None:
    diffs = tokenizer_differences(tok, teacher_tok)
    if diffs:
      raise ValueError(
        f"student and teacher vocabularies differ: {tokenizer_name} (the student's) and "
        f"{teacher_tokenizer_name} are not the same tokenizer: {'; '.join(diffs)}"
      )
  v_real = real_vocab_size(tok)
  smaller = min(student_rows, teacher_rows)
  if v_real > smaller:
    bad = {k: i for k, i in special_ids(tok).items() if i is not None and i >= smaller}
    specials = f"; its special ids {bad} are beyond that" if bad else ""
    if student_rows == teacher_rows:
      raise ValueError(
        f"tokenizer {tokenizer_name} has {v_real} tokens but the models' vocabulary is "
        f"{student_rows}{specials}"
      )
    who = "student" if student_rows < teacher_rows else "teacher"
    raise ValueError(
      f"student and teacher vocabularies differ: student vocab_size={student_rows}, "
      f"teacher vocab_size={teacher_rows}, and tokenizer {tokenizer_name} has {v_real} "
      f"tokens, more than the {who}'s {smaller} embedding rows, so they cannot be one "
      f"tokenizer's padded tables{specials}"
    )
  ids = ", ".join(f"{k}={v}" for k, v in special_ids(tok).items())
  if teacher_tok is not None:
    what = (
      f"{tokenizer_name} (the student's) and {teacher_tokenizer_name} are identical "
      f"({v_real} ids, {ids})"
    )
  else:
    what = (
      f"only {tokenizer_name} is known ({v_real} ids, {ids}); the teacher has no tokenizer "
      "of its own to compare, so only the sizes were checked"
    )
  rows = f"embedding rows: student {student_rows}, teacher {teacher_rows}"
  padded = (
    f"; logits cover ids [0, {v_real}), the padded rows are masked out"
    if v_real < max(student_rows, teacher_rows)
    else ""
  )
  return VocabCheck(v_real, student_rows, teacher_rows, f"vocabulary: {what}; {rows}{padded}")
