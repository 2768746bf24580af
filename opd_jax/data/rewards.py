"""The task's rewards for the RL baselines, computed on the host from decoded text.

    exact_match    r_b = [answer right]
    partial        r_b = (Σ_{i=1..S} [s_i = s*_i] + [answer right]) / (S + 1)
    step           c_{b,i} = [s_i = s*_i] for i = 1..S, c_{b,S+1} = [answer right]: one
                   credit per written step, each token credited with its own step's
                   (`step_credit`, `token_units`; GRPO only, `train.rl.step_group_advantages`)

[answer right] is `task.score(prompt_b, completion_b)` for a completion that ended with its eos,
and 0 for one the token budget cut off (`finished_rows`): "...>116" cut from "...>1160" is
not a right answer. Its written steps still earn their credit.

For `partial`, s*_1..s*_S are the written steps of the task's unique correct completion
(`task.solve` / `task.solve_chain`: "37+58=95", "95+21=116" for 37+58+21=; "3:45", ... for a
chain), s_i the i-th ";"-separated step written before the answer marker, compared as
strings position by position (a missing step is wrong, extra steps are ignored), and the last
unit is the exact-match answer. A right completion scores 1; a right answer reached through
a wrong step scores below 1 (exact match gives it 1); every step right but a wrong answer
scores S / (S + 1).

For `step`, unit i of a completion is its i-th written step (i ≤ S: the step's characters and
its trailing ";"), and unit S + 1 the answer: the ">" marker, everything after it, the "<eos>",
and any steps written beyond the S-th (they have no true step to be compared with, so they
share the answer's credit). A token the decoder drops (a sampled "<pad>" or "<bos>") belongs to
the unit of the next character (the answer's at the end). Positions outside the completion
mask read the answer unit too; the loss never counts them. In the arrays the units are
0-based: step i is column i − 1, the answer column S. The token-to-character map needs one
character per token, so `step` takes the task's `CharTokenizer` only.

The rollout source computes them after sampling (it holds the tokenizer) and they travel in
`Rollout.reward_b` (with `step`: the exact-match reward, and `Rollout.step_reward_bs`,
`Rollout.step_index_bc`); `train.rl` turns them into the REINFORCE or GRPO loss.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.data import task
from opd_jax.model.tokenizer import SPECIAL_TOKENS, CharTokenizer

STEP = "step"  # the per-step reward (module docstring)
REWARDS = ("exact_match", "partial", STEP)
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


def answer_right(prompt: str, completion: str, finished: bool = True) -> float:
  """[answer right]: 1.0 when the completion ended with its eos (`finished`) and
  `task.score` accepts it, else 0.0."""
  return float(finished and task.score(prompt, completion))


def partial_credit(prompt: str, completion: str, finished: bool = True) -> float:
  """(correct written steps + right answer) / (steps + 1) (module docstring), in [0, 1].

  Raises:
    ValueError: `prompt` is not a task prompt.
  """
  truth = reference_example(prompt)
  want = truth.completion.partition(task.ANSWER_MARKER)[0].split(task.STEP_SEPARATOR)
  got = completion.partition(task.ANSWER_MARKER)[0].split(task.STEP_SEPARATOR)
  right = sum(g == w for g, w in zip(got, want, strict=False))
  return (right + answer_right(prompt, completion, finished)) / (len(want) + 1)


def true_steps(prompt: str) -> list[str]:
  """s*_1..s*_S: the written steps of `prompt`'s unique correct completion.

  Raises:
    ValueError: `prompt` is not a task prompt.
  """
  truth = reference_example(prompt).completion
  return truth.partition(task.ANSWER_MARKER)[0].split(task.STEP_SEPARATOR)


def step_credit(prompt: str, completion: str, finished: bool = True) -> np.ndarray:
  """c_i = [s_i = s*_i] for the S true steps (`partial_credit`'s comparison; a missing step
  reads 0), then c_{S+1} = [answer right] (`answer_right`); f32 [S + 1].

  Raises:
    ValueError: `prompt` is not a task prompt.
  """
  want = true_steps(prompt)
  got = completion.partition(task.ANSWER_MARKER)[0].split(task.STEP_SEPARATOR)
  steps = [float(i < len(got) and got[i] == w) for i, w in enumerate(want)]
  return np.asarray([*steps, answer_right(prompt, completion, finished)], np.float32)


def char_units(completion: str, num_steps: int) -> list[int]:
  """The 0-based unit of each character of `completion` (module docstring): i − 1 for the
  characters of written step i ≤ S = `num_steps` and its trailing ";", S for the answer
  marker, everything after it and any step beyond the S-th."""
  head, marker, tail = completion.partition(task.ANSWER_MARKER)
  segments = head.split(task.STEP_SEPARATOR)
  units = []
  for i, segment in enumerate(segments):
    unit = min(i, num_steps)
    units += [unit] * (len(segment) + (i < len(segments) - 1))  # the step and its ";"
  return units + [num_steps] * (len(marker) + len(tail))


def token_units(token_ids, mask, num_steps: int, tokenizer) -> np.ndarray:
  """The 0-based unit of every completion token (module docstring): its character's unit
  (`char_units`), the next character's for a dropped pad/bos, S for the eos, the tokens after
  it and the positions outside `mask`; int32 [C].

  Raises:
    ValueError: `tokenizer` is not a `CharTokenizer` (a token must be one character).
  """
  check_step_tokenizer(tokenizer)
  token_ids, mask = np.asarray(token_ids), np.asarray(mask)
  counted = [int(t) for t, m in zip(token_ids, mask, strict=True) if m > 0]
  units = char_units(tokenizer.decode(counted), num_steps)
  out = np.full(token_ids.shape, num_steps, np.int32)
  chars = 0
  for c, (t, m) in enumerate(zip(token_ids, mask, strict=True)):
    if not m > 0:
      continue
    if int(t) == tokenizer.eos_id:
      break  # the eos and everything after it: the answer unit
    out[c] = units[chars] if chars < len(units) else num_steps
    chars += int(t) >= len(SPECIAL_TOKENS)
  return out


def check_step_tokenizer(tokenizer) -> None:
  """Raises ValueError unless `tokenizer` is the task's `CharTokenizer` (one token, one
  character): the step reward maps tokens to the characters of the decoded text."""
  if not isinstance(tokenizer, CharTokenizer):
    raise ValueError(
      f"train.reward='step' maps each completion token to one character of the task's text, "
      f"so it needs the built-in character tokenizer (config.tokenizer='char'); got "
      f"{type(tokenizer).__name__}"
    )


def sequence_rewards(
  prompts: list[str], completions: list[str], kind: str = "exact_match", finished=None
) -> np.ndarray:
  """r_b of each (prompt, completion) pair: `kind` exact_match (`answer_right`) or partial
  (`partial_credit`); f32 [B]. The `step` kind's sequence reward is exact match (its per-step
  credits are `step_rewards`). `finished[b]`: whether completion b ended with its eos (None:
  all did, for texts that are whole completions).

  Raises:
    ValueError: the lists differ in length, a prompt is not a task prompt, or an unknown kind.
  """
  if kind not in REWARDS:
    raise ValueError(f"unknown reward {kind!r}; known: {', '.join(REWARDS)}")
  if len(prompts) != len(completions):
    raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
  finished = [True] * len(prompts) if finished is None else [bool(f) for f in finished]
  fn = partial_credit if kind == "partial" else answer_right
  return np.asarray(
    [fn(p, c, f) for p, c, f in zip(prompts, completions, finished, strict=True)], np.float32
  )


def finished_rows(tokens_bc, mask_bc, eos_id: int) -> np.ndarray:
  """Whether each row's counted tokens include its eos: bool [B] (False for a completion the
  token budget or the cache cut off)."""
  tokens_bc, mask_bc = np.asarray(tokens_bc), np.asarray(mask_bc)
  return np.any((tokens_bc == eos_id) & (mask_bc > 0), axis=-1)


def _rollout_texts(rollout, tokenizer) -> tuple[list[str], list[str], np.ndarray]:
  """(prompts, completions, finished) of `rollout`: the prompt decoded from its first
  `prompt_lens` tokens, the completion from the tokens its mask counts, and whether those
  include the eos (`finished_rows`)."""
  lens_b = np.asarray(rollout.prompt_lens)
  prompt_bp = np.asarray(rollout.prompt_tokens)
  prompt_mask_bp = (np.arange(prompt_bp.shape[1])[None, :] < lens_b[:, None]).astype(np.int32)
  prompts = decode_rows(prompt_bp, prompt_mask_bp, tokenizer)
  tokens_bc, mask_bc = rollout.completion_tokens, rollout.completion_mask
  finished = finished_rows(tokens_bc, mask_bc, tokenizer.eos_id)
  return prompts, decode_rows(tokens_bc, mask_bc, tokenizer), finished


def rollout_rewards(rollout, tokenizer, kind: str = "exact_match") -> jax.Array:
  """The `kind` reward of each sequence of `rollout`, decoded with `tokenizer`: f32 [B]."""
  prompts, completions, finished = _rollout_texts(rollout, tokenizer)
  return jnp.asarray(sequence_rewards(prompts, completions, kind, finished))


def step_rewards(rollout, tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """The `step` reward of `rollout` (module docstring): (step_reward_bs f32 [B, S + 1], c_{b,i}
  of `step_credit`, the answer in column S; step_index_bc int32 [B, C], `token_units`).

  Raises:
    ValueError: a tokenizer that is not a `CharTokenizer`, a prompt that is not a task
      prompt, or rows with different step counts S (one task config writes one S).
  """
  check_step_tokenizer(tokenizer)
  prompts, completions, finished = _rollout_texts(rollout, tokenizer)
  credit = [step_credit(p, c, f) for p, c, f in zip(prompts, completions, finished, strict=True)]
  widths = sorted({len(c) for c in credit})
  if len(widths) > 1:
    raise ValueError(f"train.reward='step' needs one step count per batch; got S + 1 in {widths}")
  tokens_bc, mask_bc = np.asarray(rollout.completion_tokens), np.asarray(rollout.completion_mask)
  s = widths[0] - 1 if widths else 0
  index = [token_units(t, m, s, tokenizer) for t, m in zip(tokens_bc, mask_bc, strict=True)]
  credit_bs = np.stack(credit) if credit else np.zeros((0, 1), np.float32)
  return credit_bs, np.stack(index) if index else np.zeros(tokens_bc.shape, np.int32)
