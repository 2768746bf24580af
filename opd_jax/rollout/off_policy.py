"""GKD's on-policy fraction λ: a mix of the student's samples and the data's completions.

Generalized Knowledge Distillation (Agarwal et al., "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes") trains on the student's own samples with
probability λ and on the dataset's fixed completions otherwise; the loss is a divergence to
the teacher on whichever sequences were chosen. `train.on_policy_fraction` is that λ, and
λ = 1 (the default) is pure on-policy distillation, unchanged.

Granularity: a fixed share of the prompts of every batch, not TRL's coin per batch. Of the B
prompts of batch n, k_n are off-policy,

    x = (1 − λ) · B,   k_n = ⌊x⌋ + [u_n < x − ⌊x⌋],   u_n ~ U(0, 1)

(stochastic rounding, so E[k_n] / B = 1 − λ exactly), and which k_n prompts is a uniform
draw; both come from `np.random.default_rng([*seed, n])`, with the seed from the run's key,
so the mix is a pure function of (seed, batch index): the same on every process, after a
resume, and in async mode. Every batch keeps its shapes (B·n rows of C completion slots),
so nothing recompiles, and a batch always mixes both kinds of rows instead of the gradient
alternating between two populations from step to step.

Reference completions. A record's reference is its `"completion"` string, or, for a chat
record, the content of a final `"assistant"` message of `"messages"` (the prompt is then
the conversation before it, `prompts.prompt_messages`). Its ids are

    ref = encode(reference) + [eos]    (cut to the C = rollout.max_new_tokens slots)

the layout a sampled row has when it stops at eos; a reference longer than C is cut like a
sample that ran out of budget (no eos). The chat template's end-of-turn marker is the
tokenizer's eos (for chat checkpoints the eos is normally the end-of-turn token).

An off-policy prompt's rows (all `samples_per_prompt` of them, so every prompt keeps the
same weight in the token mean) are the sampled rows with their completion replaced: tokens
and mask from the reference, behaviour and model log-probs 0, `on_policy_b` 0. The sampler
still decodes them (the shapes stay static); the teacher scores the replaced rows when
`rollout.score_teacher` is set, because the mix happens before it.

What the data rows may not feed:

* `mismatch/*` measure the engine that sampled against the trainer; dataset rows were not
  sampled by any engine, so `sampled_rows` zeroes their mask for those metrics, which then
  average over sampled tokens only (0 when a batch has none, as at λ = 0).
* The student's kept set: with top-k/top-p the engine's support K_b (`support_ids`) is that
  of the sampled token, not the reference's, so the train step scores data rows unfiltered
  (`policy.student_policy_logits`).
* The sampled reverse KL and the RL loss are score-function estimators, unbiased only for
  y ~ π_θ, and their importance ratio needs a behaviour probability the data does not have:
  λ < 1 is refused with them (`config_check`); reverse_kl_full, forward_kl and jsd, GKD's
  divergences, are defined on any sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from opd_jax.data.rollout_types import Rollout


def reference_text(record: Mapping[str, Any]) -> str | None:
  """A record's reference completion: its "completion" string, else the content of a final
  assistant message of its "messages"; None when it has neither."""
  completion = record.get("completion")
  if isinstance(completion, str):
    return completion
  messages = record.get("messages")
  if isinstance(messages, Sequence) and messages:
    last = messages[-1]
    if isinstance(last, Mapping) and last.get("role") == "assistant":
      return last.get("content")
  return None


def reference_ids(text: str, tokenizer, width: int) -> list[int]:
  """encode(text) + [eos], cut to `width` ids."""
  return (list(tokenizer.encode(text)) + [tokenizer.eos_id])[:width]


@dataclasses.dataclass(frozen=True)
class References:
  """A batch's reference completions in the sampler's completion layout.

  Attributes:
    tokens_bc: int32 [B, C], reference ids then 0.
    mask_bc: int32 [B, C], 1 on the reference ids (eos included).
  """

  tokens_bc: np.ndarray
  mask_bc: np.ndarray


def encode_references(batch: Mapping[str, Any], tokenizer, width: int) -> References:
  """The references of a collated prompt batch (`data.collate`), [B, width].

  Raises:
    ValueError: a row without a reference (the preflight check refuses such files first).
  """
  rows = len(batch["prompt"])
  tokens_bc = np.zeros((rows, width), np.int32)
  mask_bc = np.zeros((rows, width), np.int32)
  for b in range(rows):
    text = reference_text({k: v[b] for k, v in batch.items()})
    if text is None:
      raise ValueError(
        f'prompt row {b} of the batch has no reference completion (a "completion" string or '
        "a final assistant message), which train.on_policy_fraction < 1 needs"
      )
    ids = reference_ids(text, tokenizer, width)
    tokens_bc[b, : len(ids)] = ids
    mask_bc[b, : len(ids)] = 1
  return References(tokens_bc, mask_bc)


def off_policy_prompts(fraction: float, seed: Sequence[int], batch_index: int, prompts: int):
  """bool [prompts]: which prompts of batch `batch_index` take their reference completion.

  k = ⌊x⌋ + [u < x − ⌊x⌋] of them with x = (1 − fraction)·prompts (module docstring), chosen
  uniformly; a pure function of (seed, batch_index).
  """
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"the on-policy fraction must be in [0, 1], got {fraction!r}")
  rng = np.random.default_rng([*seed, batch_index])
  x = (1.0 - fraction) * prompts
  k = int(np.floor(x)) + int(rng.random() < x - np.floor(x))
  off_b = np.zeros((prompts,), bool)
  off_b[rng.permutation(prompts)[:k]] = True
  return off_b


@jax.jit
def _replace_rows(rollout: Rollout, off_b, tokens_bc, mask_bc) -> Rollout:
  off_b1 = off_b[:, None]
  return rollout.replace(
    completion_tokens=jnp.where(off_b1, tokens_bc, rollout.completion_tokens),
    completion_mask=jnp.where(off_b1, mask_bc, rollout.completion_mask),
    behaviour_logprobs=jnp.where(off_b1, 0.0, rollout.behaviour_logprobs),
    model_logprobs=jnp.where(off_b1, 0.0, rollout.model_logprobs),
    on_policy_b=jnp.where(off_b, 0, 1).astype(jnp.int32),
  )


class Mix:
  """λ applied to a rollout engine's batches.

  Args:
    fraction: λ in [0, 1).
    seed: ints seeding the choice of rows (`seed_from_key` of the run's key).
    tokenizer: encodes the references.
    width: C, the sampler's completion slots (`rollout.max_new_tokens`).
    samples_per_prompt: n, adjacent rows per prompt.
  """

  def __init__(self, fraction: float, seed, tokenizer, width: int, samples_per_prompt: int = 1):
    if not 0.0 <= fraction < 1.0:
      raise ValueError(f"a Mix needs an on-policy fraction in [0, 1), got {fraction!r}")
    self.fraction = fraction
    self.seed = [int(s) for s in np.atleast_1d(seed)]
    self._tokenizer = tokenizer
    self._width = width
    self._n = samples_per_prompt

  def references(self, batch: Mapping[str, Any]) -> References:
    """This process's rows of `batch`, gathered over processes and repeated n times: the
    global [B·n, C] layout of `RolloutWorker.draw_prompts`."""
    refs = encode_references(batch, self._tokenizer, self._width)
    tokens_bc, mask_bc = refs.tokens_bc, refs.mask_bc
    if jax.process_count() > 1:
      tokens_bc = np.asarray(multihost_utils.process_allgather(tokens_bc, tiled=True))
      mask_bc = np.asarray(multihost_utils.process_allgather(mask_bc, tiled=True))
    return References(np.repeat(tokens_bc, self._n, axis=0), np.repeat(mask_bc, self._n, axis=0))

  def apply(self, rollout: Rollout, refs: References, batch_index: int) -> tuple[Rollout, float]:
    """The rollout with batch `batch_index`'s off-policy prompts' rows replaced by their
    references; returns it and the realised on-policy fraction of its prompts."""
    rows = refs.tokens_bc.shape[0]
    if refs.tokens_bc.shape[1] != rollout.completion_tokens.shape[1]:
      raise ValueError(
        f"references have {refs.tokens_bc.shape[1]} completion slots, the rollout "
        f"{rollout.completion_tokens.shape[1]}"
      )
    off_p = off_policy_prompts(self.fraction, self.seed, batch_index, rows // self._n)
    off_b = np.repeat(off_p, self._n)
    extra = rollout.batch_size - rows  # a sharded sampler's padding rows (mask 0) stay
    tokens_bc, mask_bc = refs.tokens_bc, refs.mask_bc
    if extra:
      off_b = np.pad(off_b, (0, extra))
      tokens_bc = np.pad(tokens_bc, ((0, extra), (0, 0)))
      mask_bc = np.pad(mask_bc, ((0, extra), (0, 0)))
    mixed = _replace_rows(rollout, off_b, tokens_bc, mask_bc)
    return mixed, 1.0 - float(off_p.mean())


def seed_from_key(key) -> list[int]:
  """The mix's numpy seed from a JAX key (its raw key data)."""
  return [int(x) for x in np.asarray(jax.random.key_data(key)).reshape(-1)]


def sampled_rows(rollout: Rollout) -> Rollout:
  """The rollout with the dataset rows' mask zeroed: what `mismatch/*` average over."""
  if rollout.on_policy_b is None:
    return rollout
  on_b1 = rollout.on_policy_b[..., None]  # [B, 1], or [K, B/K, 1] for micro-batches
  mask_bc = rollout.completion_mask * on_b1.astype(rollout.completion_mask.dtype)
  return rollout.replace(completion_mask=mask_bc)


def check_references(source, tokenizer, width: int, name: str | None = None) -> str:
  """Refuses a prompt source with a record that has no reference completion, or one that does
  not tokenize; returns a one-line summary (how many references, how many are cut to C).

  Args:
    source: random-access records (`data.JsonlSource`; its `line_numbers` name lines).
    tokenizer: the run's tokenizer.
    width: C, `rollout.max_new_tokens`.
    name: the source's name in messages; default its `path`.

  Raises:
    ValueError: naming the file and the first record (and line) without a reference, or whose
      reference the tokenizer refuses.
  """
  name = name or getattr(source, "path", "the prompts")
  lines = getattr(source, "line_numbers", None)
  cut, longest = 0, 0
  for i in range(len(source)):
    where = f"record {i}" + (f" (line {lines[i]})" if lines is not None else "")
    text = reference_text(source[i])
    if text is None:
      raise ValueError(
        f"train.on_policy_fraction < 1 trains on reference completions, but {where} of {name} "
        'has none: give every record a "completion" string (or, for "messages" records, end '
        "the conversation with the assistant's reply), or set train.on_policy_fraction=1"
      )
    try:
      n = len(tokenizer.encode(text)) + 1
    except ValueError as e:
      raise ValueError(f"the reference completion of {where} of {name}: {e}") from e
    cut += n > width
    longest = max(longest, n)
  return (
    f"{name}: {len(source)} reference completions, longest {longest} tokens with eos; "
    f"{cut} longer than rollout.max_new_tokens={width} are cut (no eos)"
  )
