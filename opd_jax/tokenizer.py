"""Tokenizers behind one small interface, and the student/teacher vocabulary check.

OPD compares student and teacher distributions token by token, so both models must
share one vocabulary. Everything downstream (task encoding, sampler, trainer) uses
only this interface:

    encode(text) -> list[int]     # no special tokens added
    decode(ids) -> str            # stops at eos, drops pad and other special tokens
    vocab_size, pad_id, bos_id, eos_id
    get_vocab() -> dict[str, int] # token string -> id, for the vocabulary check

Two implementations:
- `CharTokenizer`: the built-in character tokenizer for the synthetic task
  (`opd_jax.task`). Needs no files.
- `HFTokenizer`: wraps a local Hugging Face tokenizer directory, loaded offline.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
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


def load_tokenizer(path_or_name: str) -> CharTokenizer | HFTokenizer:
  """Loads a tokenizer by name or from a local directory, without network access.

  Args:
    path_or_name: "char" for the built-in `CharTokenizer`, or a local directory
      holding a Hugging Face tokenizer (tokenizer.json / tokenizer_config.json).

  Returns:
    A tokenizer with encode/decode/vocab_size/pad_id/bos_id/eos_id/get_vocab.

  Raises:
    FileNotFoundError: when the directory does not exist.
  """
  if path_or_name == "char":
    return CharTokenizer()
  if not os.path.isdir(path_or_name):
    raise FileNotFoundError(
      f"tokenizer directory {path_or_name!r} does not exist (use 'char' for the built-in "
      "character tokenizer)"
    )
  from transformers import AutoTokenizer

  return HFTokenizer(AutoTokenizer.from_pretrained(path_or_name, local_files_only=True))


def _first_difference(student_tok, teacher_tok) -> str | None:
  """Describes the first id whose token differs between two tokenizers, or None."""
  s_by_id = {i: t for t, i in student_tok.get_vocab().items()}
  t_by_id = {i: t for t, i in teacher_tok.get_vocab().items()}
  for i in range(max(len(s_by_id), len(t_by_id), max(s_by_id, default=-1) + 1)):
    s, t = s_by_id.get(i), t_by_id.get(i)
    if s != t:
      return f"first differing token: id {i} is {s!r} in the student and {t!r} in the teacher"
  return None


def check_same_vocab(
  student_vocab_size: int, teacher_vocab_size: int, student_tok=None, teacher_tok=None
) -> None:
  """Refuses a student/teacher pair that does not share one vocabulary.

  Per-token KL between student and teacher is only meaningful when id v means the
  same token in both models. Checks the models' vocabulary sizes (embedding rows)
  and, when both tokenizers are given, that every id maps to the same token string.

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
