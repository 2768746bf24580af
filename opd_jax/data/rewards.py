"""The task's sequence rewards for the RL baseline, computed on the host from decoded text.

    r_b = 1.0 if task.score(prompt_b, completion_b) else 0.0

The rollout source computes them after sampling (it holds the tokenizer) and they travel in
`Rollout.reward_b`; `train.rl` turns them into the REINFORCE loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.data import task


def decode_rows(tokens_bt, mask_bt, tokenizer) -> list[str]:
  """The text of each row's masked-in tokens (the tokenizer drops bos/pad, stops at eos)."""
  tokens_bt, mask_bt = np.asarray(tokens_bt), np.asarray(mask_bt)
  if tokens_bt.shape != mask_bt.shape or tokens_bt.ndim != 2:
    raise ValueError(f"tokens {tokens_bt.shape} and mask {mask_bt.shape} must both be [B, T]")
  return [tokenizer.decode(row[m > 0].tolist()) for row, m in zip(tokens_bt, mask_bt, strict=True)]


def sequence_rewards(prompts: list[str], completions: list[str]) -> np.ndarray:
  """r_b = 1.0 when `task.score(prompt_b, completion_b)` (exact match), else 0.0; f32 [B].

  Raises:
    ValueError: the lists differ in length, or a prompt is not a task prompt.
  """
  if len(prompts) != len(completions):
    raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
  return np.asarray(
    [task.score(p, c) for p, c in zip(prompts, completions, strict=True)], np.float32
  )


def rollout_rewards(rollout, tokenizer) -> jax.Array:
  """The exact-match reward of each sequence of `rollout`, decoded with `tokenizer`: f32 [B].

  The prompt is decoded from the rollout's own prompt tokens (its first `prompt_lens`
  entries), the completion from the tokens its mask counts.
  """
  lens_b = np.asarray(rollout.prompt_lens)
  prompt_bp = np.asarray(rollout.prompt_tokens)
  prompt_mask_bp = (np.arange(prompt_bp.shape[1])[None, :] < lens_b[:, None]).astype(np.int32)
  prompts = decode_rows(prompt_bp, prompt_mask_bp, tokenizer)
  completions = decode_rows(rollout.completion_tokens, rollout.completion_mask, tokenizer)
  return jnp.asarray(sequence_rewards(prompts, completions))
