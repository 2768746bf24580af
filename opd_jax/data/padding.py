"""Padded widths shared by the prompt encoders (`task`, `prompts`) and the sampler.

Prompts are padded to a power of two of at least `MIN_PROMPT_BUCKET` tokens, so that a run
compiles one sampler program per bucket rather than one per prompt length.
"""

from __future__ import annotations

MIN_PROMPT_BUCKET = 16


def next_pow2(n: int) -> int:
  """The smallest power of two ≥ n (n ≥ 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def prompt_bucket(length: int) -> int:
  """Padded prompt width for a longest prompt of `length` tokens."""
  return next_pow2(max(length, MIN_PROMPT_BUCKET))
