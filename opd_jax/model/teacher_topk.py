"""The sparse teacher: its top-k log-probabilities plus one tail bucket per position.

At a vocabulary of V ≈ 150k, the teacher's full logits [B, C, V] for every completion
token dominate the memory and transfer of a distillation step. `train.teacher_top_k`
= k > 0 replaces them, per position, by

    ids_1..k      the teacher's k most likely tokens S (descending),
    log π_T(ids)  their log-probabilities, normalised over the full vocabulary,
    tail          log π_T(tail) = log(1 − Σ_{v∈S} π_T(v)), computed as a logsumexp over
                  the other V − k logits (no cancellation when the top-k hold ~all mass),
    tail_count    n = |{v ∉ S : π_T(v) > 0}|, the tokens the tail bucket covers,

i.e. k + 1 bins ("top-k + tail", as TRL's and slime's users store the teacher). The
student is projected onto the same bins (`project`): its probabilities at the
teacher's k ids, and the rest summed into its tail. `TopKTeacher` is a
`train.losses.TeacherDistribution`, so every loss there reads it as it reads full logits;
k = 0 keeps the full-vocabulary losses, the exact reference.

Teacher temperature (`teacher.temperature` = τ_T): π_T = softmax(z_T / τ_T), applied to
the teacher's logits before the top-k, the tail and every loss or train-step metric that
reads π_T (`teacher/*`; full and sparse). It is independent of `rollout.temperature` T_r,
at which the student is sampled and scored (π_θ = softmax(z_θ / T_r),
`policy.student_policy_logits`). The losses drive softmax(z_θ / T_r) towards
softmax(z_T / τ_T), i.e. z_θ ≈ z_T · T_r / τ_T up to a constant: the student at its own
T = 1 learns the teacher at temperature τ_T / T_r. The default τ_T = 1 matches the student
at T_r to the teacher at T = 1; τ_T = T_r matches the two at T = 1 (what a student deployed
at T = 1 wants when sampling rollouts at T_r ≠ 1). Greedy rollouts (T_r = 0) score the
student at T = 1 and the teacher at τ_T. Held-out `quality/*` (`opd_jax.train.evaluate`) still
compares with the teacher at T = 1.

The sampled loss needs log π_T(y) of any token y (`TopKTeacher.token_logprobs`): for y ∈ S it is the
stored value; for y ∉ S the tail mass is spread uniformly over the n tokens it covers,
log π_T(y) = tail − log n. This is the maximum-entropy distribution consistent with the
k + 1 bins (it is the full distribution when k = V − 1 or n = 1, and tail − log(V − k)
when no logit is −inf).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class TopKTeacher:
  """The teacher at every completion position as its top-k bins plus a tail.

  Attributes:
    logprobs_bck: f32 [B, C, k], log π_T of `ids_bck`, normalised over the full
      vocabulary (at `temperature`), descending.
    ids_bck: int32 [B, C, k], the teacher's k most likely token ids.
    tail_bc: f32 [B, C], log(1 − Σ_k π_T(ids)); −inf when nothing remains (k = V).
    tail_count_bc: int32 [B, C], tokens outside the top-k with π_T > 0 (finite logit).
    temperature: static, the τ_T the log-probs were computed at.
  """

  logprobs_bck: jax.Array
  ids_bck: jax.Array
  tail_bc: jax.Array
  tail_count_bc: jax.Array
  temperature: float = struct.field(pytree_node=False, default=1.0)

  @property
  def k(self) -> int:
    return self.ids_bck.shape[-1]

  def check_student(self, student_logits) -> None:
    """Raises ValueError unless student logits [B, C, V] cover these positions and V ≥ k."""
    if self.ids_bck.shape[:2] != student_logits.shape[:2]:
      raise ValueError(
        f"teacher top-k ids {self.ids_bck.shape} and student logits {student_logits.shape} "
        "disagree; expected [B, T, k] and [B, T, V]"
      )
    if self.k > student_logits.shape[-1]:
      raise ValueError(
        f"train.teacher_top_k={self.k} exceeds the student's vocabulary V="
        f"{student_logits.shape[-1]}"
      )

  def bin_logprobs(self):
    """[..., k + 1] f32: the teacher's log-probabilities on the k + 1 bins (tail last)."""
    return jnp.concatenate([self.logprobs_bck, self.tail_bc[..., None]], axis=-1)

  def student_bin_logprobs(self, student_logits):
    """[..., k + 1] f32: the student's log-probabilities on the same bins (`project`)."""
    return project(student_logits, self.ids_bck)

  def token_logprobs(self, tokens):
    """log π_T(y) of the tokens y [B, C], in f32.

    y ∈ S:  the stored log π_T(y)
    y ∉ S:  tail − log n,  n = `tail_count_bc` (the tail spread uniformly over the
            tokens it covers; −inf when the tail is empty)
    """
    tokens = tokens.astype(jnp.int32)
    hit = self.ids_bck == tokens[..., None]
    top = jnp.sum(jnp.where(hit, self.logprobs_bck, 0.0), axis=-1)
    count = jnp.maximum(self.tail_count_bc, 1).astype(jnp.float32)
    spread = jnp.where(self.tail_count_bc > 0, self.tail_bc - jnp.log(count), -jnp.inf)
    return jnp.where(jnp.any(hit, axis=-1), top, spread)

  def top_mass(self):
    """[B, C] f32: Σ_{v∈S} π_T(v), the share of the teacher's mass its top-k hold."""
    return jnp.sum(jnp.exp(self.logprobs_bck), axis=-1)

  def per_position_metrics(self) -> dict:
    """teacher/top_k_mass per position (`top_mass`), which the losses average."""
    return {"teacher/top_k_mass": self.top_mass()}


def check_top_k(top_k, vocab_size: int | None = None) -> None:
  """Refuses a `train.teacher_top_k` that is not an int in [0, V] (0 = full vocabulary)."""
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
    raise ValueError(
      f"train.teacher_top_k must be an int >= 0 (0 = the full vocabulary), got {top_k!r}"
    )
  if vocab_size is not None and top_k > vocab_size:
    raise ValueError(
      f"train.teacher_top_k={top_k} exceeds the vocabulary V={vocab_size}; use k <= V "
      "(k = V is the full distribution, 0 the full-vocabulary losses)"
    )


def check_temperature(temperature) -> None:
  """Refuses a `teacher.temperature` that is not a finite number > 0."""
  ok = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
  if not ok or not 0 < temperature < float("inf"):
    raise ValueError(f"teacher.temperature must be a finite number > 0, got {temperature!r}")


def scale_logits(logits, temperature: float):
  """z / τ_T in f32 (τ_T = 1 returns the logits unchanged, in f32)."""
  check_temperature(temperature)
  logits = logits.astype(jnp.float32)
  return logits if temperature == 1.0 else logits / temperature


def _in_set(ids, vocab_size: int):
  """bool [..., V]: True at the token ids `ids` [..., k] of each position."""
  flat_ids = ids.reshape(-1, ids.shape[-1])
  rows = jnp.arange(flat_ids.shape[0])[:, None]
  hit = jnp.zeros((flat_ids.shape[0], vocab_size), bool).at[rows, flat_ids].set(True)
  return hit.reshape(*ids.shape[:-1], vocab_size)


def _masked_logsumexp(x, drop):
  """log Σ_{v: ¬drop_v} exp(x_v) over the last axis; −inf when nothing is left.

  NaN-free gradient even when every entry is dropped or −inf, and when a dropped entry is
  far above the kept ones (the inner `where`s keep exp from overflowing in either branch).
  """
  keep = ~drop & (x > -jnp.inf)
  top = jax.lax.stop_gradient(jnp.max(jnp.where(keep, x, -jnp.inf), axis=-1, keepdims=True))
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  terms = jnp.where(keep, jnp.exp(jnp.where(keep, x, top) - top), 0.0)
  total = jnp.sum(terms, axis=-1)
  safe = jnp.where(total > 0, total, 1.0)
  return jnp.where(total > 0, jnp.log(safe) + top[..., 0], -jnp.inf)


def from_logits(logits, top_k: int, temperature: float = 1.0) -> TopKTeacher:
  """The sparse teacher of full logits [..., V] (e.g. [B, C, V]).

      π_T = softmax(z / τ_T),  S = its k largest,  tail = log Σ_{v∉S} π_T(v)

  Computed without materialising log π_T: with m_1 the largest logit and m_t the largest
  outside S, s_t = Σ_{v∉S} exp(z_v − m_t) ≥ 1 and s_S = Σ_{v∈S} exp(z_v − m_1), so
  log Z = m_1 + log(s_S + exp(m_t − m_1) · s_t) and tail = m_t + log s_t − log Z: no
  cancellation and no underflow of a tiny tail. (The top-k values are used whole: slicing
  them makes XLA's CPU backend replace the top-k by a full sort, ~50x slower.)

  Args:
    logits: [..., V] teacher logits (any float dtype; computed in f32).
    top_k: k, 1 ≤ k ≤ V.
    temperature: τ_T > 0.

  Returns:
    `TopKTeacher` (no gradient flows through it: the teacher is frozen).
  """
  vocab = logits.shape[-1]
  check_top_k(top_k, vocab)
  if top_k == 0:
    raise ValueError("train.teacher_top_k=0 means the full vocabulary: no sparse teacher")
  z = scale_logits(jax.lax.stop_gradient(logits), temperature)
  top_z, ids = jax.lax.top_k(z, top_k)
  ids = ids.astype(jnp.int32)
  m_1 = _finite_or_zero(jnp.max(z, axis=-1))
  top_sum = jnp.sum(jnp.exp(top_z - m_1[..., None]), axis=-1)
  if top_k == vocab:  # nothing left for the tail
    log_z = m_1 + jnp.log(top_sum)
    empty = jnp.full(z.shape[:-1], -jnp.inf)
    count = jnp.zeros(z.shape[:-1], jnp.int32)
    return TopKTeacher(top_z - log_z[..., None], ids, empty, count, float(temperature))
  in_tail = ~_in_set(ids, vocab) & (z > -jnp.inf)
  max_t = jnp.max(jnp.where(in_tail, z, -jnp.inf), axis=-1)
  # An empty tail takes m_t = m_1, so that exp(m_t − m_1) · s_t = 1 · 0 even where the
  # logits are far below 0 (a fallback of 0 would overflow exp to inf, and inf · 0 is NaN).
  m_t = jnp.where(jnp.isfinite(max_t), max_t, m_1)
  tail_sum = jnp.sum(jnp.where(in_tail, jnp.exp(z - m_t[..., None]), 0.0), axis=-1)
  # Counted in f32 (exact below 2^24 tokens): XLA's CPU backend reduces f32, not int, fast.
  count = jnp.sum(jnp.where(in_tail, 1.0, 0.0), axis=-1).astype(jnp.int32)
  log_z = m_1 + jnp.log(top_sum + jnp.exp(m_t - m_1) * tail_sum)
  safe_tail = jnp.where(tail_sum > 0, tail_sum, 1.0)
  tail = jnp.where(tail_sum > 0, m_t + jnp.log(safe_tail) - log_z, -jnp.inf)
  return TopKTeacher(top_z - log_z[..., None], ids, tail, count, float(temperature))


def _finite_or_zero(x):
  return jnp.where(jnp.isfinite(x), x, 0.0)


def project(logits, ids):
  """The student's log-probabilities on the teacher's bins, in f32.

      q_i = π_θ(ids_i) for i = 1..k,   q_tail = 1 − Σ_i π_θ(ids_i) = Σ_{v∉S} π_θ(v)

  the tail computed as a logsumexp over the other V − k tokens (no cancellation), with a
  NaN-free gradient when it is empty (k = V, or a student filtered to −inf outside S).

  Args:
    logits: [..., V] student logits (−inf allowed outside a kept set).
    ids: int [..., k] distinct token ids per position (the teacher's top-k).

  Returns:
    [..., k + 1] f32 log-probabilities (tail last); gradients flow to `logits`.
  """
  z = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(z, axis=-1, keepdims=True)
  top = jnp.take_along_axis(z, ids.astype(jnp.int32), axis=-1) - log_z
  tail_lse = _masked_logsumexp(z, _in_set(ids, z.shape[-1]))[..., None]
  # An empty tail stays a constant −inf: a NaN cotangent from a consumer (logaddexp at two
  # −inf) must not reach log Z through it.
  tail = jnp.where(tail_lse > -jnp.inf, tail_lse - log_z, -jnp.inf)
  return jnp.concatenate([top, tail], axis=-1)
