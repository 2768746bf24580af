"""The task's sequence rewards for the RL baselines, computed on the host from decoded text.

    exact_match    r_b = 1.0 if task.score(prompt_b, completion_b) else 0.0
    partial        r_b = (Σ_{i<S} [s_i = s*_i] + [answer right]) / (S + 1)

For `partial`, s*_1..s*_S are the written steps of the task's unique correct completion
(`task.solve` / `task.solve_chain`: "37+58=95", "95+21=116" for 37+58+21=; "3:45", ... for a
chain), s_i the i-th ";"-separated step written before the answer marker, compared as
strings position by position (a missing step is wrong, extra steps are ignored), and the last
unit is the exact-match answer. A right completion scores 1; a right answer reached through
a wrong step scores below 1 (exact match gives it 1); every step right but a wrong answer
scores S / (S + 1).

The rollout source computes them after sampling (it holds the tokenizer) and they travel in
`Rollout.reward_b`; `train.rl` turns them into the REINFORCE or GRPO loss.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.data import task

REWARDS = ("exact_match", "partial")
_SUM_PROMPT_RE = re.compile(r"\d+(\+\d+)+=")
_CHAIN_PROMPT_RE = re.compile(r"(\d+)\+(\d+)\*(\d+)=")


def decode_rows(tokens_bt, mask_bt, tokenizer) -> list[str]:
  """The text of each row's masked-in tokens (the tokenizer drops bos/pad, stops at eos)."""
  tokens_bt, mask_bt = np.asarray(tokens_bt), np.asarray(mask_bt)
  if tokens_bt.shape != mask_bt.shape or tokens_bt.ndim != 2:
    raise ValueError(f"tokens {tokens_bt.shape} and mask {mask_bt.shape} must both be [B, T]")
  return [tokenizer.decode(row[m > 0].tolist()) for row, m in zip(tokens_bt, mask_bt, strict=True)]


def reference_example(prompt: str) -> task.Example:
  """The task's unique correct example for a sum or chain prompt.

  Raises:
    ValueError: `prompt` is not a task prompt.
  """
  chain = _CHAIN_PROMPT_RE.fullmatch(prompt)
  if chain:
    return task.solve_chain(*(int(g) for g in chain.groups()))
  if not _SUM_PROMPT_RE.fullmatch(prompt):
    raise ValueError(f"{prompt!r} is not a task prompt like '37+58+21=' or '37+8*3='")
  return task.solve([int(x) for x in prompt[:-1].split("+")])


def partial_credit(prompt: str, completion: str) -> float:
  """(correct written steps + right answer) / (steps + 1) (module docstring), in [0, 1].

  Raises:
    ValueError: `prompt` is not a task prompt.
  """
  truth = reference_example(prompt)
  want = truth.completion.partition(task.ANSWER_MARKER)[0].split(task.STEP_SEPARATOR)
  got = completion.partition(task.ANSWER_MARKER)[0].split(task.STEP_SEPARATOR)
  right = sum(g == w for g, w in zip(got, want, strict=False))
  return (right + float(task.score(prompt, completion))) / (len(want) + 1)


def sequence_rewards(
  prompts: list[str], completions: list[str], kind: str = "exact_match"
) -> np.ndarray:
  """r_b of each (prompt, completion) pair: `kind` exact_match (1.0 when `task.score`, else
  0.0) or partial (`partial_credit`); f32 [B].

  Raises:
    ValueError: the lists differ in length, a prompt is not a task prompt, or an unknown kind.
  """
  if kind not in REWARDS:
    raise ValueError(f"unknown reward {kind!r}; known: {', '.join(REWARDS)}")
  if len(prompts) != len(completions):
    raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
  fn = task.score if kind == "exact_match" else partial_credit
  return np.asarray([fn(p, c) for p, c in zip(prompts, completions, strict=True)], np.float32)


def rollout_rewards(rollout, tokenizer, kind: str = "exact_match") -> jax.Array:
  """The `kind` reward of each sequence of `rollout`, decoded with `tokenizer`: f32 [B].

  The prompt is decoded from the rollout's own prompt tokens (its first `prompt_lens`
  entries), the completion from the tokens its mask counts.
  """
  lens_b = np.asarray(rollout.prompt_lens)
  prompt_bp = np.asarray(rollout.prompt_tokens)
  prompt_mask_bp = (np.arange(prompt_bp.shape[1])[None, :] < lens_b[:, None]).astype(np.int32)
  prompts = decode_rows(prompt_bp, prompt_mask_bp, tokenizer)
  completions = decode_rows(rollout.completion_tokens, rollout.completion_mask, tokenizer)
  return jnp.asarray(sequence_rewards(prompts, completions, kind))
