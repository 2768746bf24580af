"""The `Rollout`: what the rollout engine hands to the trainer.

A `Rollout` is a pytree dataclass (`flax.struct.dataclass`), so it crosses `jax.jit`, device
transfers and the async double buffer as one value. All per-token arrays are aligned on the
completion axis C: entry [b, c] describes the c-th generated token of sequence b.

Log-probability conventions (all f32, natural log):

* `behaviour_logprobs` is log π_b(y_c), the probability of the sampled token under
  the distribution the engine actually sampled from: softmax of the logits divided
  by the temperature, with the tokens removed by top-k and top-p set to zero mass
  and the rest renormalised. Greedy decoding (temperature 0) samples from a point
  mass on the argmax, so its behaviour log-prob is exactly 0.
* `model_logprobs` is the engine model's unfiltered log-prob of the same token:
  log_softmax(logits / T)[y_c] for T > 0, log_softmax(logits)[y_c] for greedy. It is
  carried for inspection; the trainer and the mismatch metrics read `behaviour_logprobs`
  (against π_θ under the same filter: `train.mismatch_metrics`).
* The optional `topk_*` fields describe the behaviour distribution π_b(·|prefix)
  at every step: its k largest log-probs (descending) with their token ids, and the
  log of the remaining mass. When the sampler is asked for the full distribution,
  `topk_logprobs` is [B, C, V] in vocabulary order, `topk_ids` is arange(V) and the
  tail is -inf. Tokens with zero behaviour mass (filtered by top-k/top-p, or every
  non-argmax token under greedy) have log-prob -inf; consumers must treat
  exp(-inf) · (-inf) as 0 (e.g. with `jnp.where(p > 0, ...)`).

* `support_ids` is the engine's kept set K_b (the support of π_b) at every step when
  the sampler filtered with top-k or top-p: the trainer restricts its student to the
  same set (`policy.student_policy_logits`), so π_θ and π_b are compared under
  one transform. Greedy rollouts carry none: their support is the sampled token.

Masked positions (after the stop token) hold token 0 and log-probs 0; the `topk_*`
and `support_ids` fields there are unspecified, so always weight by `completion_mask`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from opd_jax.model.teacher_topk import TopKTeacher


class Sequences(NamedTuple):
  """Prompt and completion packed for a training forward pass.

  Attributes:
    tokens_bt: int32 [B, T], T = P + C. Row b is prompt_b[:len_b] followed directly
      by its C completion slots, then zero padding; position t of the row is the
      model position t, so `model.forward(params, tokens_bt, cfg)` scores it.
    completion_mask_bt: int32 [B, T]; 1 where tokens_bt[b, t] is a generated token
      that counts (completion_mask[b, t - len_b] == 1).
    logit_index_bc: int32 [B, C]; the position whose logits predict completion
      token c of row b: len_b - 1 + c. Gather logits_btv along t with it to get
      [B, C, V] aligned with `Rollout.behaviour_logprobs`.
  """

  tokens_bt: jax.Array
  completion_mask_bt: jax.Array
  logit_index_bc: jax.Array


@struct.dataclass
class Rollout:
  """A batch of sampled completions with everything the trainer needs.

  Attributes:
    prompt_tokens: int32 [B, P], right-padded with 0.
    prompt_lens: int32 [B], number of real prompt tokens (≥ 1).
    completion_tokens: int32 [B, C], generated tokens; 0 where masked.
    completion_mask: int32 [B, C]; 1 for generated tokens up to and including the
      stop token, 0 after it (and after the sequence ran out of cache).
    behaviour_logprobs: f32 [B, C], log π_b(y) of the sampled token (see module
      docstring); 0 where masked.
    model_logprobs: f32 [B, C], unfiltered temperature-scaled log-prob of the
      sampled token under the engine's model; 0 where masked.
    weight_version: int32 scalar, the version of the weights that sampled it.
    topk_logprobs: f32 [B, C, k] or [B, C, V] behaviour log-probs, or None.
    topk_ids: int32 [B, C, k] or [B, C, V] token ids of `topk_logprobs`, or None.
    tail_logprob: f32 [B, C], log of the behaviour mass outside `topk_ids`, or None.
    support_ids: int32 [B, C, M], the token ids the top-k/top-p filter kept at each
      step, -1 in unused slots; None when the sampler did not filter. With top-k,
      M = top_k (the k largest, descending, those removed by top-p set to -1); with
      top-p alone, M = V and slot j holds j if kept (4·V bytes per token: bound the
      support with top-k on large vocabularies).
    kv_saturated_fraction: f32 scalar, the share of the K/V elements written to FP8
      cache layers (prompt and counted completion tokens, K and V) that clipped at
      ± the format's largest value · scale (448 for e4m3); 0 without FP8 layers. None for
      hand-built rollouts.
    teacher_logits: f32 [B, C, V], the frozen teacher's raw logits (T = 1; the train step
      divides them by `teacher.temperature`) at the
      completion positions when the rollout engine scored them
      (`rollout.score_teacher`), so the train step skips the teacher's forward
      pass; None otherwise.
    reward_b: f32 [B], the task's reward of each decoded completion (`train.reward`: exact
      match, 1 or 0, or partial credit in [0, 1]; exact match for the step reward;
      `opd_jax.data.rewards`), when the rollout engine scored it for an RL loss
      (`opd_jax.train.rl`); None otherwise.
    on_policy_b: int32 [B], 1 for a row the engine sampled, 0 for a row whose completion is
      the prompt's reference (`opd_jax.rollout.off_policy`, train.on_policy_fraction < 1; its
      log-probs are 0 and its `topk_*`/`support_ids` unspecified); None when every row was
      sampled.
    teacher_topk: the sparse teacher (`opd_jax.model.teacher_topk.TopKTeacher`: top-k log-probs
      [B, C, k] at `teacher.temperature`, their ids, the tail bucket [B, C]) when the
      rollout engine scored the teacher with `train.teacher_top_k` = k > 0; it then
      carries this instead of `teacher_logits`. None otherwise.
    step_reward_bs: f32 [B, S + 1], with `train.reward="step"`: c_{b,i} = 1 where row b's
      written step i + 1 equals the true one (columns 0..S−1) and the answer is right (column
      S), else 0 (`rewards.step_rewards`); None otherwise.
    step_index_bc: int32 [B, C], with `train.reward="step"`: the 0-based unit (column of
      `step_reward_bs`) each completion token belongs to, S for the answer, the eos and
      positions outside the mask (`rewards.token_units`); None otherwise.
    engine_id: static string naming the engine configuration that produced it.
  """

  prompt_tokens: jax.Array
  prompt_lens: jax.Array
  completion_tokens: jax.Array
  completion_mask: jax.Array
  behaviour_logprobs: jax.Array
  model_logprobs: jax.Array
  weight_version: jax.Array
  topk_logprobs: jax.Array | None = None
  topk_ids: jax.Array | None = None
  tail_logprob: jax.Array | None = None
  support_ids: jax.Array | None = None
  kv_saturated_fraction: jax.Array | None = None
  teacher_logits: jax.Array | None = None
  reward_b: jax.Array | None = None
  on_policy_b: jax.Array | None = None
  teacher_topk: TopKTeacher | None = None
  step_reward_bs: jax.Array | None = None
  step_index_bc: jax.Array | None = None
  engine_id: str = struct.field(pytree_node=False, default="")

  @property
  def batch_size(self) -> int:
    return self.completion_tokens.shape[0]

  def completion_lens(self) -> jax.Array:
    """int32 [B]: number of counted completion tokens per sequence."""
    return jnp.sum(self.completion_mask, axis=1).astype(jnp.int32)

  def sequences(self) -> Sequences:
    """Packs prompt + completion left-aligned for a teacher-forced forward pass.

    Layout for row b (T = P + C):

        t:      0 .. len_b-1 | len_b .. len_b+C-1 | len_b+C .. T-1
        token:  prompt_b     | completion_b       | 0 (padding)

    Completion token c sits at t = len_b + c and is predicted by the logits at
    t - 1 = `logit_index_bc[b, c]`. Padding after a prompt (and masked completion
    slots) never influence the counted positions because attention is causal.

    Returns:
      `Sequences(tokens_bt, completion_mask_bt, logit_index_bc)`.
    """
    b, p = self.prompt_tokens.shape
    c = self.completion_tokens.shape[1]
    t_idx = jnp.arange(p + c)[None, :]
    lens_b1 = self.prompt_lens[:, None]
    prompt_bt = jnp.pad(self.prompt_tokens, ((0, 0), (0, c)))
    prompt_bt = jnp.where(t_idx < lens_b1, prompt_bt, 0)

    def place(row, values, start):
      return jax.lax.dynamic_update_slice(row, values.astype(row.dtype), (start,))

    zeros_bt = jnp.zeros((b, p + c), jnp.int32)
    completion_bt = jax.vmap(place)(zeros_bt, self.completion_tokens, self.prompt_lens)
    mask_bt = jax.vmap(place)(zeros_bt, self.completion_mask, self.prompt_lens)
    tokens_bt = jnp.where(t_idx < lens_b1, prompt_bt, completion_bt).astype(jnp.int32)
    logit_index_bc = (lens_b1 - 1 + jnp.arange(c)[None, :]).astype(jnp.int32)
    return Sequences(tokens_bt, mask_bt.astype(jnp.int32), logit_index_bc)
