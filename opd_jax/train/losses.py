"""On-policy distillation losses and the per-token f32 utilities they share.

Notation: π_θ is the student, π_T the frozen teacher, π_b the rollout engine's
behaviour policy that sampled the completion tokens y_t. Every loss takes student logits
[B, T, V] aligned so that logits[:, t] is the distribution over tokens[:, t] (the caller
shifts), the teacher, and a completion mask [B, T].

Reduction, for every loss: the mean over masked tokens of the whole batch,

    loss = Σ_{b,t} m_bt · ℓ_bt / max(Σ_{b,t} m_bt, 1),

so an all-zero mask gives 0. Everything is computed in f32 whatever the logits' dtype.

The teacher is a `TeacherDistribution`: its log-probabilities on K bins that partition the
vocabulary, the student's log-probabilities on the same bins, and log π_T of any token. Full
logits (`FullTeacher`, K = V: the bins are the tokens) and the sparse teacher
(`teacher_topk.TopKTeacher`, `train.teacher_top_k` = k > 0: K = k + 1, the teacher's top-k and
a tail bucket) both satisfy it, so each divergence is written once:
- `reverse_kl_sampled`: the policy-gradient form of KL(π_θ ‖ π_T) on the sampled
  tokens (Tinker, slime), with truncated importance weights for π_b ≠ π_θ.
- `reverse_kl_full`: KL(π_θ ‖ π_T) summed over the bins.
- `forward_kl`: KL(π_T ‖ π_θ) summed over the bins.
- `jsd`: TRL's generalized Jensen-Shannon divergence, which is `forward_kl` at β=0
  and `reverse_kl_full` at β=1.
On top-k bins each is the divergence between the two coarse-grained distributions, ≤ the full
one by the data-processing inequality, equal at k = V. By the chain rule the gap is exactly
p(tail) · KL(p(·|tail) ‖ q(·|tail)), p the distribution the expectation is under: 0 at k = V,
small when p's top-k hold nearly all its mass (`teacher/top_k_mass` for the forward KL).

Each returns `(loss, metrics)` with namespaced metric names (`loss/*`, `teacher/*`).
Configuration arguments (`is_clip`, `beta`) are Python numbers, static under `jax.jit`.

The helpers `token_logprobs`, `per_token_kl`, `topk_logprobs_with_tail`,
`logprobs_with_tail`, `bucket_kl` and `masked_mean` also serve the mismatch metrics
(`opd_jax.mismatch`). Student logits may hold -inf outside a top-k/top-p kept set
(`policy.student_policy_logits`): every helper treats exp(-inf) · (-inf) as 0.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct


def token_logprobs(logits, tokens):
  """log π(y) of the given tokens, in f32.

  Args:
    logits: [..., V] (e.g. [B, T, V]).
    tokens: int [...] (e.g. [B, T]).

  Returns:
    [...] f32: log_softmax(logits)[..., tokens].
  """
  if logits.shape[:-1] != tokens.shape:
    raise ValueError(
      f"logits {logits.shape} and tokens {tokens.shape} disagree; expected logits [..., V] "
      "with tokens [...]"
    )
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def bucket_kl(p_logprobs, q_logprobs):
  """KL(p ‖ q) = Σ_i p_i (log p_i − log q_i) over the last axis of log-probabilities.

  Buckets with p_i = 0 (log p_i = −inf) contribute 0.

  Args:
    p_logprobs: [..., K] log-probabilities of p (any partition of the vocabulary).
    q_logprobs: [..., K] log-probabilities of q on the same buckets.

  Returns:
    [...] f32.
  """
  p = p_logprobs.astype(jnp.float32)
  q = q_logprobs.astype(jnp.float32)
  empty = p == -jnp.inf
  safe_p = jnp.where(empty, 0.0, p)
  terms = jnp.where(empty, 0.0, jnp.exp(safe_p) * (safe_p - jnp.where(empty, 0.0, q)))
  return jnp.sum(terms, axis=-1)


def logprobs_with_tail(logits, ids):
  """Log-probabilities of the tokens `ids` plus one tail bucket holding the rest.

  Args:
    logits: [..., V].
    ids: int [..., k], distinct token ids per position, k < V.

  Returns:
    [..., k + 1] f32: log π(ids_1..k), then log(1 − Σ_i π(ids_i)) computed as a
    logsumexp over the other V − k logits (no cancellation).
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  top = jnp.take_along_axis(logits, ids, axis=-1) - norm
  flat_ids = ids.reshape(-1, ids.shape[-1])
  rows = jnp.arange(flat_ids.shape[0])[:, None]
  in_top = jnp.zeros((flat_ids.shape[0], vocab), bool).at[rows, flat_ids].set(True)
  in_top = in_top.reshape(logits.shape)
  tail = jax.nn.logsumexp(jnp.where(in_top, -jnp.inf, logits), axis=-1, keepdims=True) - norm
  return jnp.concatenate([top, tail], axis=-1)


def topk_logprobs_with_tail(logits, k: int):
  """The k most likely tokens' log-probabilities plus a tail bucket.

  Args:
    logits: [..., V].
    k: number of tokens kept, 1 ≤ k < V.

  Returns:
    (logprobs [..., k + 1] f32 as in `logprobs_with_tail`, ids int32 [..., k]).
  """
  vocab = logits.shape[-1]
  if not isinstance(k, int) or not 1 <= k < vocab:
    raise ValueError(f"top_k must be an int in [1, V) = [1, {vocab}) here, got {k!r}")
  _, ids = jax.lax.top_k(jax.lax.stop_gradient(logits.astype(jnp.float32)), k)
  return logprobs_with_tail(logits, ids), ids


def per_token_kl(p_logits, q_logits, top_k: int | None = None):
  """Per-position KL(p ‖ q) from logits, in f32.

  Exact:  KL = Σ_v p(v) (log p(v) − log q(v)).
  top_k:  the same sum over p's k most likely tokens S plus one tail bucket,
          p(tail) = 1 − Σ_{v∈S} p(v), q(tail) = 1 − Σ_{v∈S} q(v). By the data-processing
          inequality this never exceeds the exact KL; top_k = V gives the exact KL.

  Args:
    p_logits: [..., V], the distribution the expectation is under.
    q_logits: [..., V].
    top_k: None for exact, else 1 ≤ top_k ≤ V.

  Returns:
    [...] f32.
  """
  if p_logits.shape != q_logits.shape:
    raise ValueError(f"logit shapes differ: {p_logits.shape} vs {q_logits.shape}")
  vocab = p_logits.shape[-1]
  if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= vocab):
    raise ValueError(f"top_k must be None or an int in [1, V={vocab}], got {top_k!r}")
  if top_k is None or top_k == vocab:
    p = jax.nn.log_softmax(p_logits.astype(jnp.float32), axis=-1)
    q = jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=-1)
    return bucket_kl(p, q)
  p, ids = topk_logprobs_with_tail(p_logits, top_k)
  return bucket_kl(p, logprobs_with_tail(q_logits, ids))


def masked_mean(x_bt, mask_bt):
  """Σ m·x / max(Σ m, 1) in f32; values at masked-out positions (even inf/NaN) are ignored.

  Their gradients are not: the masked term's cotangent is 0, and 0 times a non-finite
  derivative is NaN, so a loss must make its masked-out terms finite before this mean."""
  m = mask_bt.astype(jnp.float32)
  x = jnp.where(m > 0, x_bt.astype(jnp.float32), 0.0)
  return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def token_entropy(logits):
  """Per-position entropy H = −Σ_v π(v) log π(v) of softmax(logits), in f32.

  Tokens with zero mass (logit −inf, outside a top-k/top-p kept set) contribute 0.

  Args:
    logits: [..., V].

  Returns:
    [...] f32.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  empty = logp == -jnp.inf
  safe = jnp.where(empty, 0.0, logp)
  return -jnp.sum(jnp.where(empty, 0.0, jnp.exp(safe) * safe), axis=-1)


@runtime_checkable
class TeacherDistribution(Protocol):
  """π_T at every position as the losses read it: K bins that partition the vocabulary.

  `FullTeacher` (K = V) and `teacher_topk.TopKTeacher` (K = k + 1) satisfy it.
  """

  def check_student(self, student_logits) -> None:
    """Raises ValueError when student logits [B, T, V] cannot be mapped onto the bins."""

  def bin_logprobs(self) -> jax.Array:
    """[B, T, K] f32: log π_T of each bin."""

  def student_bin_logprobs(self, student_logits) -> jax.Array:
    """[B, T, K] f32: log π_θ of each bin, from student logits [B, T, V]; differentiable."""

  def token_logprobs(self, tokens) -> jax.Array:
    """[B, T] f32: log π_T(y) of the tokens y [B, T]."""

  def per_position_metrics(self) -> dict:
    """name -> [B, T] values the losses report as their masked mean (e.g. `teacher/*`)."""


@struct.dataclass
class FullTeacher:
  """The teacher as full logits z_T [B, T, V] (already / τ_T): the bins are the V tokens."""

  logits: jax.Array

  def check_student(self, student_logits) -> None:
    if student_logits.shape != self.logits.shape:
      raise ValueError(
        f"student logits {student_logits.shape} and teacher logits {self.logits.shape} differ; "
        "student and teacher must share one vocabulary (see tokenizer.check_same_vocab)"
      )

  def bin_logprobs(self):
    return jax.nn.log_softmax(self.logits.astype(jnp.float32), axis=-1)

  def student_bin_logprobs(self, student_logits):
    return jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)

  def token_logprobs(self, tokens):
    return token_logprobs(self.logits, tokens)

  def per_position_metrics(self) -> dict:
    return {}


def as_teacher(teacher) -> TeacherDistribution:
  """`teacher` itself when it is a `TeacherDistribution`; full logits [B, T, V] as a
  `FullTeacher`."""
  return teacher if isinstance(teacher, TeacherDistribution) else FullTeacher(teacher)


def _checked(student_logits, teacher, mask) -> TeacherDistribution:
  """`as_teacher(teacher)`, after checking the shapes of the logits, the teacher and the mask."""
  if student_logits.ndim != 3:
    raise ValueError(f"student logits must be [B, T, V], got shape {student_logits.shape}")
  teacher = as_teacher(teacher)
  teacher.check_student(student_logits)
  if mask.shape != student_logits.shape[:2]:
    raise ValueError(f"mask {mask.shape} must be [B, T] = {student_logits.shape[:2]}")
  return teacher


def _with_teacher_metrics(metrics: dict, teacher: TeacherDistribution, mask) -> dict:
  """`metrics`, the teacher's per-position metrics masked-averaged, and loss/num_tokens."""
  per_position = {k: masked_mean(x, mask) for k, x in teacher.per_position_metrics().items()}
  return metrics | per_position | {"loss/num_tokens": jnp.sum(mask.astype(jnp.float32))}


def _bins(student_logits, teacher, mask):
  """(student [B, T, K] log-probs with gradient, teacher [B, T, K] log-probs without, the
  teacher as a `TeacherDistribution`), on the teacher's bins."""
  teacher = _checked(student_logits, teacher, mask)
  teacher_lp = teacher.bin_logprobs()
  # At masked-out positions the teacher becomes uniform over its K bins: a −inf teacher
  # log-prob there (padding id 0) would make the masked term's gradient 0 · inf = NaN.
  uniform = -jnp.log(jnp.float32(teacher_lp.shape[-1]))
  teacher_lp = jnp.where(mask[..., None] > 0, teacher_lp, uniform)
  return teacher.student_bin_logprobs(student_logits), jax.lax.stop_gradient(teacher_lp), teacher


def _other_rows_mean(x_bt, mask_bt):
  """[B, 1] f32: for each row b, Σ_{b'≠b,t} m·x / max(Σ_{b'≠b,t} m, 1) (masked-out x ignored)."""
  m = mask_bt.astype(jnp.float32)
  x = jnp.where(m > 0, x_bt.astype(jnp.float32), 0.0) * m
  sum_b1 = jnp.sum(x, axis=1, keepdims=True)
  count_b1 = jnp.sum(m, axis=1, keepdims=True)
  return (jnp.sum(sum_b1) - sum_b1) / jnp.maximum(jnp.sum(count_b1) - count_b1, 1.0)


def reverse_kl_sampled(
  student_logits,
  teacher,
  tokens,
  mask,
  behaviour_logprobs,
  is_clip: float | None = 2.0,
  advantage_clip: float | None = None,
  baseline: str = "none",
):
  """Sampled reverse KL in policy-gradient form (Tinker / slime on-policy distillation).

  With y_t the sampled tokens and sg the stop-gradient:

      A_t = sg(log π_T(y_t) − log π_θ(y_t))                    per-token advantage
      r_t = sg(min(exp(log π_θ(y_t) − log π_b(y_t)), C))        truncated IS weight
      loss = −mean_t[ r_t · A_t · log π_θ(y_t) ]

  Gradient: ∇loss = −mean_t[r_t A_t ∇log π_θ(y_t)]. Without truncation and with
  y_t ~ π_b, its expectation at each position is
  Σ_y π_θ(y) (log π_θ(y) − log π_T(y)) ∇log π_θ(y) = ∇ KL(π_θ ‖ π_T), the gradient of
  the reverse KL (the Σ_y π_θ ∇log π_θ = 0 term vanishes). The loss value itself is
  a surrogate; `teacher/reverse_kl_k1` reports the sampled KL estimate.

  Advantage clipping (`advantage_clip` = c) replaces A_t by clip(A_t, −c, c) in the
  loss. The expected gradient becomes Σ_y π_θ(y) f'(π_θ(y)/π_T(y)) ∇log π_θ(y) with
  f'(u) = clip(log u, −c, c): that is the exact gradient of the f-divergence
  D_f(π_θ ‖ π_T) = Σ_y π_T(y) f(π_θ(y)/π_T(y)), f(u) = ∫_1^u clip(log s, −c, c) ds,
  which is convex with f(1) = 0 and strictly convex around u = 1, so its only
  minimum is π_θ = π_T. It equals the reverse KL's integrand wherever the log-ratio
  is within [−c, c] and grows linearly in the ratio outside it: the clipped estimator
  is unbiased for a Huber-like divergence with the same minimiser, and bounds the
  per-token step that rare tokens the teacher rules out (A_t ≈ −10) would take.

  Baseline (`baseline="batch_mean"`) subtracts a stop-gradient scalar from the (clipped)
  advantage of every token of row b:

      b_b = Σ_{b'≠b, t} m_b't · clip(A_b't) / max(Σ_{b'≠b, t} m_b't, 1)
      loss = −mean_t[ r_t · (clip(A_t, −c, c) − b_b) · log π_θ(y_t) ]

  the mean advantage over the completion tokens of the batch's other sequences. Those
  are sampled independently of row b's tokens, so E_y[b_b ∇log π_θ(y_t)] =
  b_b · Σ_y ∇π_θ(y) = 0 and the expected gradient is unchanged (exactly, not only for a
  large batch; a mean that included row b's own tokens would correlate with them and
  shrink the expected gradient by about 1/N). The baseline removes the common offset
  of A_t (its mean is −KL, not 0), whose b · ∇log π_θ(y_t) terms are pure noise.

  π_θ must be the policy the rollout was sampled under when the engine is exact: the
  student's logits at the sampler's temperature, restricted to the engine's top-k/top-p
  kept set (`policy.student_policy_logits`, -inf elsewhere). Then r_t = 1 for an
  exact engine and the estimator targets KL(π_θ ‖ π_T) of that filtered policy. Every
  counted y_t must have finite student logit (the kept set holds it).

  Args:
    student_logits: [B, T, V] under θ, at the sampler's temperature and filter.
    teacher: a `TeacherDistribution` (or full logits [B, T, V]); receives no gradient. With
      the sparse teacher, log π_T(y_t) of a token outside its top-k spreads the tail mass
      uniformly over the tokens it covers (`TopKTeacher.token_logprobs`): the maximum-entropy
      teacher π̃_T consistent with the bins, so the estimator targets KL(π_θ ‖ π̃_T).
    tokens: int [B, T] sampled tokens.
    mask: [B, T] completion mask (bool or float).
    behaviour_logprobs: [B, T] log π_b(y_t) as returned by the sampler.
    is_clip: truncation C > 0 of the importance ratio, or None for r_t = 1 (treat the
      rollout as on-policy).
    advantage_clip: c > 0 to clip A_t to [−c, c] in the loss, or None for no clipping.
    baseline: "none", or "batch_mean" to subtract b_b above from the (clipped) advantage.

  Returns:
    (loss scalar f32, metrics): loss/reverse_kl_sampled, teacher/reverse_kl_k1
    (mean of log π_θ − log π_T), teacher/logprob, loss/student_logprob, loss/is_ratio
    (mean r_t), loss/is_clip_frac (share of tokens with ratio > C),
    loss/advantage_clip_frac (share of tokens with |A_t| > c), loss/advantage_baseline
    (mean over tokens of the subtracted b, 0 without one), loss/num_tokens, and the teacher's
    per-position metrics (teacher/top_k_mass for the sparse teacher).
  """
  teacher = _checked(student_logits, teacher, mask)
  _check_sampled_args(tokens, mask, behaviour_logprobs, is_clip, advantage_clip, baseline)
  # Masked-out positions (padding) may hold any teacher log-prob, −inf included; zero them so
  # that no 0 · inf = NaN reaches the gradient through the masked term.
  teacher_lp = jnp.where(mask > 0, jax.lax.stop_gradient(teacher.token_logprobs(tokens)), 0.0)
  student_lp = token_logprobs(student_logits, tokens)
  advantage = jax.lax.stop_gradient(teacher_lp - student_lp)
  if is_clip is None:
    ratio = jnp.ones_like(student_lp)
    clipped = jnp.zeros_like(student_lp)
  else:
    # Padding may hold any behaviour log-prob; zero it so no NaN reaches the gradient.
    behaviour_lp = jnp.where(mask > 0, behaviour_logprobs.astype(jnp.float32), 0.0)
    raw = jnp.exp(jax.lax.stop_gradient(student_lp) - behaviour_lp)
    ratio = jnp.minimum(raw, is_clip)
    clipped = (raw > is_clip).astype(jnp.float32)
  if advantage_clip is None:
    used_advantage = advantage
    advantage_clipped = jnp.zeros_like(advantage)
  else:
    used_advantage = jnp.clip(advantage, -advantage_clip, advantage_clip)
    advantage_clipped = (jnp.abs(advantage) > advantage_clip).astype(jnp.float32)
  baseline_b1 = jnp.zeros((mask.shape[0], 1), jnp.float32)
  if baseline == "batch_mean":
    baseline_b1 = _other_rows_mean(used_advantage, mask)
  used_advantage = used_advantage - baseline_b1
  loss = -masked_mean(ratio * used_advantage * student_lp, mask)
  metrics = {
    "loss/reverse_kl_sampled": loss,
    "teacher/reverse_kl_k1": masked_mean(-advantage, mask),
    "teacher/logprob": masked_mean(teacher_lp, mask),
    "loss/student_logprob": masked_mean(jax.lax.stop_gradient(student_lp), mask),
    "loss/is_ratio": masked_mean(ratio, mask),
    "loss/is_clip_frac": masked_mean(clipped, mask),
    "loss/advantage_clip_frac": masked_mean(advantage_clipped, mask),
    "loss/advantage_baseline": masked_mean(jnp.broadcast_to(baseline_b1, mask.shape), mask),
  }
  return loss, _with_teacher_metrics(metrics, teacher, mask)


def _check_sampled_args(tokens, mask, behaviour_logprobs, is_clip, advantage_clip, baseline):
  if tokens.shape != mask.shape or behaviour_logprobs.shape != mask.shape:
    raise ValueError(
      f"tokens {tokens.shape}, behaviour_logprobs {behaviour_logprobs.shape} and mask "
      f"{mask.shape} must all be [B, T]"
    )
  if is_clip is not None and not is_clip > 0:
    raise ValueError(f"is_clip must be None or > 0, got {is_clip!r}")
  if advantage_clip is not None and not advantage_clip > 0:
    raise ValueError(f"advantage_clip must be None or > 0, got {advantage_clip!r}")
  if baseline not in ("none", "batch_mean"):
    raise ValueError(f"baseline must be 'none' or 'batch_mean', got {baseline!r}")


def reverse_kl_full(student_logits, teacher, mask):
  """Reverse KL(π_θ ‖ π_T), summed over the teacher's bins at every position.

      ℓ_t = Σ_i π_θ(i) (log π_θ(i) − log π_T(i))

  over the vocabulary (full logits), or over the teacher's top-k ids S and the tail
  π(tail) = 1 − Σ_{i∈S} π(i) (the sparse teacher). Gradients flow to the student only.

  Args:
    student_logits: [B, T, V].
    teacher: a `TeacherDistribution` (or full logits [B, T, V]); receives no gradient.
    mask: [B, T].

  Returns:
    (loss, metrics): loss/reverse_kl_full, teacher/reverse_kl, the teacher's per-position
    metrics, loss/num_tokens.
  """
  student_lp, teacher_lp, teacher = _bins(student_logits, teacher, mask)
  loss = masked_mean(bucket_kl(student_lp, teacher_lp), mask)
  metrics = {"loss/reverse_kl_full": loss, "teacher/reverse_kl": loss}
  return loss, _with_teacher_metrics(metrics, teacher, mask)


def forward_kl(student_logits, teacher, mask):
  """Forward KL(π_T ‖ π_θ), summed over the teacher's bins at every position.

      ℓ_t = Σ_i π_T(i) (log π_T(i) − log π_θ(i))

  with the bins of `reverse_kl_full`. Gradients flow to the student only.

  Returns:
    (loss, metrics): loss/forward_kl, teacher/forward_kl, the teacher's per-position metrics,
    loss/num_tokens.
  """
  student_lp, teacher_lp, teacher = _bins(student_logits, teacher, mask)
  loss = masked_mean(bucket_kl(teacher_lp, student_lp), mask)
  metrics = {"loss/forward_kl": loss, "teacher/forward_kl": loss}
  return loss, _with_teacher_metrics(metrics, teacher, mask)


def jsd(student_logits, teacher, mask, beta: float = 0.5):
  """Generalized Jensen-Shannon divergence, in TRL's `generalized_jsd_loss` convention.

  For 0 < β < 1, with the mixture M = β·π_T + (1 − β)·π_θ on the teacher's bins:

      ℓ_t = β · KL(π_T ‖ M) + (1 − β) · KL(π_θ ‖ M)

  and, as TRL special-cases them, the endpoints are the two KLs:

      β = 0:  ℓ_t = KL(π_T ‖ π_θ)   (exactly `forward_kl`)
      β = 1:  ℓ_t = KL(π_θ ‖ π_T)   (exactly `reverse_kl_full`)

  The interior formula tends to 0 at both ends, so the endpoints are not its limits.
  β = 0.5 is the symmetric Jensen-Shannon divergence. On top-k bins the mixture of the
  coarse-grained distributions is the coarse-grained mixture, so this is the JSD of the
  coarse-grained distributions. Gradients flow to the student only.

  Args:
    student_logits: [B, T, V].
    teacher: a `TeacherDistribution` (or full logits [B, T, V]); receives no gradient.
    mask: [B, T].
    beta: β in [0, 1], a Python float.

  Returns:
    (loss, metrics): loss/jsd, the teacher's per-position metrics, loss/num_tokens.
  """
  teacher = _checked(student_logits, teacher, mask)
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f"beta must be in [0, 1], got {beta!r}")
  if beta == 0.0:
    loss, _ = forward_kl(student_logits, teacher, mask)
  elif beta == 1.0:
    loss, _ = reverse_kl_full(student_logits, teacher, mask)
  else:
    student_lp, teacher_lp, _ = _bins(student_logits, teacher, mask)
    loss = masked_mean(_generalized_jsd(student_lp, teacher_lp, beta), mask)
  return loss, _with_teacher_metrics({"loss/jsd": loss}, teacher, mask)


def _generalized_jsd(student_lp, teacher_lp, beta: float):
  """Per-position β·KL(π_T ‖ M) + (1 − β)·KL(π_θ ‖ M), M = β·π_T + (1 − β)·π_θ, 0 < β < 1,
  from log-probabilities on any common partition (the vocabulary, or top-k bins)."""
  mixture_lp = jnp.logaddexp(teacher_lp + jnp.log(beta), student_lp + jnp.log1p(-beta))
  return beta * bucket_kl(teacher_lp, mixture_lp) + (1 - beta) * bucket_kl(student_lp, mixture_lp)
