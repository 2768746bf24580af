"""The per-step mismatch measurement: `mismatch/*` from the student's logits and a rollout.

Notation (docs/design.md, "The common mismatch scale"): π_b is the distribution the
rollout engine sampled from, π_θ the trainer's student at its current parameters
under the same temperature and the same top-k/top-p transform (the engine's kept
set replayed, `policy.student_policy_logits`), both on the rollout's prefixes.
For every counted completion token y_t:

    ρ_t    = log π_θ(y_t) − log π_b(y_t)
    KL_t   = KL(π_b(·|prefix_t) ‖ π_θ(·|prefix_t)) = Σ_v π_b(v) (log π_b(v) − log π_θ(v))

and the metrics, each over the completion mask:

    mismatch/kl, _p95, _max                     mean, 95th percentile and max of KL_t
    mismatch/k1                                 mean(−ρ_t)
    mismatch/k3                                 mean(exp(ρ_t) − ρ_t − 1)
    mismatch/abs_logp_diff, _p95, _max          of |ρ_t|

By token position (`position_metrics`; t is the completion position, 0 for the first sampled
token, w = `train.mismatch_bucket_tokens`, κ = `train.mismatch_cross_kl`):

    mismatch/kl_by_position/pAAA_BBB            mean KL_t over the counted tokens with
                                                AAA ≤ t ≤ BBB (buckets of w up to C − 1);
                                                NaN when the bucket holds none
    mismatch/first_cross_pos                    mean over the completions that cross of
                                                τ_b = min{t : KL_bt > κ}; NaN when none does
    mismatch/cross_frac                         completions that cross / completions with a
                                                counted token (NaN when there are none)

k1 and k3 are the sampled-token estimators of the same KL (unbiased under
y_t ~ π_b; k3 is non-negative per token). KL_t is exact over the vocabulary when
the rollout carries the full behaviour distribution (`SamplerConfig.return_topk=-1`),
and over π_b's top-k tokens plus one tail bucket holding the rest of each
distribution when it carries the top k; by the data-processing inequality the
bucketed value never exceeds the exact one. Tokens with zero behaviour mass
(filtered by top-k/top-p, every non-argmax token under greedy) contribute 0.

An engine identical to the trainer reads 0 on every metric (to f32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.data.rollout_types import Rollout
from opd_jax.train import losses

# Vocabularies up to this size get the exact KL (the full behaviour distribution).
FULL_DISTRIBUTION_MAX_VOCAB = 4096
# Behaviour tokens kept per position for larger vocabularies.
LARGE_VOCAB_TOP_K = 64


def default_return_topk(vocab_size: int) -> int:
  """The `SamplerConfig.return_topk` that the mismatch metrics need, from V alone.

  -1 (the full behaviour distribution, exact KL) for V ≤ 4096; 64 (top-64 plus a
  tail bucket) above. The rollout stores 4 bytes per vocabulary entry per token
  for the full distribution: 16 KiB per token at V = 4096, still small next to the
  [B, C, V] student logits the step already holds, but 600 KiB at V = 152k, as
  large as the logits themselves. Top-64 stores 64 log-probs, 64 ids and the tail
  (516 bytes per token) and the bucketed KL is a lower bound of the exact KL that
  misses only how the tail mass is spread, so the bound is tight whenever the
  top 64 behaviour tokens hold nearly all the mass, which is the case at the
  temperatures (≤ 1) and filters OPD samples with; a top-k or top-p support within
  the top 64 makes it exact.

  Args:
    vocab_size: V ≥ 1.

  Returns:
    -1 or 64.
  """
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
    raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
  return -1 if vocab_size <= FULL_DISTRIBUTION_MAX_VOCAB else LARGE_VOCAB_TOP_K


def masked_quantile(x_bc, mask_bc, q: float):
  """The q-quantile of x over the entries where mask > 0, as `np.quantile` (linear).

  With the n selected values sorted ascending as s_0 ≤ … ≤ s_{n−1} and
  h = (n − 1) · q:  quantile = s_⌊h⌋ + (h − ⌊h⌋) · (s_⌊h⌋+1 − s_⌊h⌋).  0 when n = 0.

  Args:
    x_bc: values [...] (any shape).
    mask_bc: [...] same shape, bool or numeric.
    q: a Python float in [0, 1].

  Returns:
    f32 scalar.
  """
  if not 0.0 <= q <= 1.0:
    raise ValueError(f"q must be in [0, 1], got {q!r}")
  if x_bc.shape != mask_bc.shape:
    raise ValueError(f"values {x_bc.shape} and mask {mask_bc.shape} differ")
  keep = mask_bc.reshape(-1) > 0
  # Unselected entries sort last; n counts the selected ones.
  s = jnp.sort(jnp.where(keep, x_bc.reshape(-1).astype(jnp.float32), jnp.inf))
  n = jnp.sum(keep)
  h = (jnp.maximum(n, 1) - 1).astype(jnp.float32) * q
  lo = jnp.floor(h).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(n, 1) - 1)
  frac = h - lo.astype(jnp.float32)
  below, above = s[lo], s[hi]
  # Equal neighbours (inf included) give that value, not inf − inf.
  value = jnp.where(above == below, below, below + frac * (above - below))
  # A NaN among the kept values sorts after the inf placeholders; the quantile is NaN, as numpy's.
  value = jnp.where(jnp.any(keep & jnp.isnan(x_bc.reshape(-1))), jnp.nan, value)
  return jnp.where(n > 0, value, 0.0)


def masked_max(x_bc, mask_bc):
  """max of x over the entries where mask > 0 (f32 scalar); 0 when there are none."""
  keep = mask_bc > 0
  value = jnp.max(jnp.where(keep, x_bc.astype(jnp.float32), -jnp.inf))
  return jnp.where(jnp.any(keep), value, 0.0)


def per_token_kl(student_logits_bcv, rollout: Rollout):
  """KL_t = KL(π_b ‖ π_θ) at every completion position, f32 [B, C].

  π_b comes from the rollout's `topk_logprobs` (vocabulary order when its last
  axis is V; else top-k ids plus `tail_logprob`), π_θ = softmax(student_logits_bcv).
  Values at masked positions are unspecified.
  """
  if rollout.topk_logprobs is None:
    raise ValueError(
      "the rollout carries no behaviour distribution; sample with SamplerConfig.return_topk "
      "set (mismatch.default_return_topk(vocab_size))"
    )
  vocab = student_logits_bcv.shape[-1]
  behaviour_lp = rollout.topk_logprobs.astype(jnp.float32)
  if behaviour_lp.shape[:2] != student_logits_bcv.shape[:2]:
    raise ValueError(
      f"behaviour distribution {behaviour_lp.shape} and student logits "
      f"{student_logits_bcv.shape} disagree on [B, C]"
    )
  if behaviour_lp.shape[-1] == vocab:  # the full distribution, vocabulary order
    student_lp = jax.nn.log_softmax(student_logits_bcv.astype(jnp.float32), axis=-1)
    return losses.bucket_kl(behaviour_lp, student_lp)
  if rollout.topk_ids is None or rollout.tail_logprob is None:
    raise ValueError("a top-k behaviour distribution needs topk_ids and tail_logprob")
  behaviour_lp = jnp.concatenate([behaviour_lp, rollout.tail_logprob[..., None]], axis=-1)
  student_lp = losses.logprobs_with_tail(student_logits_bcv, rollout.topk_ids)
  return losses.bucket_kl(behaviour_lp, student_lp)


def mismatch_metrics(student_logits_bcv, rollout: Rollout) -> dict[str, jax.Array]:
  """The `mismatch/*` metrics of the module docstring, f32 scalars.

  Args:
    student_logits_bcv: [B, C, V] logits of π_θ at the rollout's completion
      positions, already under the rollout's transform (divided by its temperature,
      -inf outside its kept set); treated as constants (stop-gradient).
    rollout: the batch, with `behaviour_logprobs` and, for the KL metrics, a
      behaviour distribution (`topk_logprobs`, and `topk_ids` + `tail_logprob` when
      top-k). Without one, only k1, k3 and abs_logp_diff* are returned.

  Returns:
    {"mismatch/kl", "mismatch/kl_p95", "mismatch/kl_max", "mismatch/k1", "mismatch/k3",
     "mismatch/abs_logp_diff", "mismatch/abs_logp_diff_p95", "mismatch/abs_logp_diff_max"}.
  """
  if student_logits_bcv.ndim != 3:
    raise ValueError(f"student logits must be [B, C, V], got shape {student_logits_bcv.shape}")
  mask_bc = rollout.completion_mask
  if mask_bc.shape != student_logits_bcv.shape[:2]:
    raise ValueError(
      f"completion mask {mask_bc.shape} must be [B, C] = {student_logits_bcv.shape[:2]}"
    )
  logits_bcv = jax.lax.stop_gradient(student_logits_bcv).astype(jnp.float32)
  student_lp_bc = losses.token_logprobs(logits_bcv, rollout.completion_tokens)
  rho_bc = student_lp_bc - rollout.behaviour_logprobs.astype(jnp.float32)
  abs_bc = jnp.abs(rho_bc)
  metrics = {}
  if rollout.topk_logprobs is not None:
    kl_bc = per_token_kl(logits_bcv, rollout)
    metrics["mismatch/kl"] = losses.masked_mean(kl_bc, mask_bc)
    metrics["mismatch/kl_p95"] = masked_quantile(kl_bc, mask_bc, 0.95)
    metrics["mismatch/kl_max"] = masked_max(kl_bc, mask_bc)
  metrics["mismatch/k1"] = losses.masked_mean(-rho_bc, mask_bc)
  metrics["mismatch/k3"] = losses.masked_mean(jnp.exp(rho_bc) - rho_bc - 1.0, mask_bc)
  metrics["mismatch/abs_logp_diff"] = losses.masked_mean(abs_bc, mask_bc)
  metrics["mismatch/abs_logp_diff_p95"] = masked_quantile(abs_bc, mask_bc, 0.95)
  metrics["mismatch/abs_logp_diff_max"] = masked_max(abs_bc, mask_bc)
  return metrics


# --- mismatch by token position ---------------------------------------------------------------

POSITION_PREFIX = "mismatch/kl_by_position/"
PER_TOKEN_KL_KEY = "per_token/mismatch_kl_bc"  # the step's [B, C] KL_t, taken out after combining


def check_position_settings(bucket_tokens, cross_kl) -> None:
  """Raises ValueError unless w = `bucket_tokens` is an int ≥ 0 (0 = off) and κ = `cross_kl`
  a number > 0."""
  if isinstance(bucket_tokens, bool) or not isinstance(bucket_tokens, int) or bucket_tokens < 0:
    raise ValueError(
      f"train.mismatch_bucket_tokens must be an int >= 0 (0 = off), got {bucket_tokens!r}"
    )
  if isinstance(cross_kl, bool) or not isinstance(cross_kl, int | float) or not cross_kl > 0:
    raise ValueError(f"train.mismatch_cross_kl must be a number > 0, got {cross_kl!r}")


def position_buckets(completion_len: int, bucket_tokens: int) -> list[tuple[int, int]]:
  """The buckets of completion positions as inclusive (first, last) pairs:
  [(0, w − 1), (w, 2w − 1), …, (n·w, C − 1)], n = ⌈C / w⌉ − 1 (the last one may be short)."""
  check_position_settings(bucket_tokens, 1.0)
  if bucket_tokens == 0:
    raise ValueError("train.mismatch_bucket_tokens is 0 (off): there are no buckets")
  if completion_len < 1:
    raise ValueError(f"the completion length must be >= 1, got {completion_len!r}")
  starts = range(0, completion_len, bucket_tokens)
  return [(a, min(a + bucket_tokens, completion_len) - 1) for a in starts]


def bucket_name(first: int, last: int, completion_len: int) -> str:
  """`mismatch/kl_by_position/p<first>_<last>`, zero-padded to the digits of C − 1 (at least
  3) so that the names of one run sort in position order."""
  width = max(3, len(str(completion_len - 1)))
  return f"mismatch/kl_by_position/p{first:0{width}d}_{last:0{width}d}"


def kl_by_position(kl_bc, mask_bc, bucket_tokens: int):
  """Mean KL per bucket of completion positions.

      kl_n = Σ_b Σ_{t ∈ bucket n} m_bt · KL_bt / N_n,   N_n = Σ_b Σ_{t ∈ bucket n} m_bt

  with the buckets of `position_buckets`; kl_n is NaN where N_n = 0. Values at masked
  positions are never read (they may be NaN).

  Args:
    kl_bc: f32 [B, C] per-token KL.
    mask_bc: [B, C] completion mask (> 0 counts).
    bucket_tokens: w ≥ 1.

  Returns:
    (kl_n f32 [n], tokens_n f32 [n]).
  """
  if kl_bc.ndim != 2 or kl_bc.shape != mask_bc.shape:
    raise ValueError(f"KL {kl_bc.shape} and mask {mask_bc.shape} must both be [B, C]")
  b, c = kl_bc.shape
  n = len(position_buckets(c, bucket_tokens))
  keep_bc = mask_bc > 0
  kl_bc = jnp.where(keep_bc, kl_bc.astype(jnp.float32), 0.0)
  pad = n * bucket_tokens - c  # the last bucket's missing columns count nothing
  kl_bnw = jnp.pad(kl_bc, ((0, 0), (0, pad))).reshape(b, n, bucket_tokens)
  keep_bnw = jnp.pad(keep_bc, ((0, 0), (0, pad))).reshape(b, n, bucket_tokens)
  tokens_n = jnp.sum(keep_bnw, axis=(0, 2)).astype(jnp.float32)
  sum_n = jnp.sum(kl_bnw, axis=(0, 2))
  return jnp.where(tokens_n > 0, sum_n / jnp.maximum(tokens_n, 1.0), jnp.nan), tokens_n


def first_cross(kl_bc, mask_bc, cross_kl: float):
  """Each completion's first position whose KL crosses κ = `cross_kl`:

      τ_b = min{t : m_bt > 0 and KL_bt > κ},   −1 when no counted token crosses.

  Args:
    kl_bc: f32 [B, C] per-token KL (masked values never read).
    mask_bc: [B, C] completion mask.
    cross_kl: κ > 0.

  Returns:
    (first_b int32 [B], counted_b bool [B]: the completion has a counted token).
  """
  keep_bc = mask_bc > 0
  crossed_bc = keep_bc & (jnp.where(keep_bc, kl_bc, 0.0) > cross_kl)
  first_b = jnp.where(jnp.any(crossed_bc, axis=1), jnp.argmax(crossed_bc, axis=1), -1)
  return first_b.astype(jnp.int32), jnp.any(keep_bc, axis=1)


def position_metrics(kl_bc, mask_bc, bucket_tokens: int, cross_kl: float) -> dict:
  """The position metrics of the module docstring, f32 scalars.

      mismatch/kl_by_position/pAAA_BBB = kl_n                        (`kl_by_position`)
      mismatch/first_cross_pos = Σ_{b: τ_b ≥ 0} τ_b / #{b: τ_b ≥ 0}   (`first_cross`; NaN if 0)
      mismatch/cross_frac      = #{b: τ_b ≥ 0} / #{b: Σ_t m_bt > 0}   (NaN if no completion)

  A completion that never crosses adds to the denominator of cross_frac only.

  Args:
    kl_bc: f32 [B, C] per-token KL(π_b ‖ π_θ) (`per_token_kl`).
    mask_bc: [B, C] the counted tokens (the sampled rows only, as `mismatch_metrics`).
    bucket_tokens: w ≥ 1 (static: the names depend on it).
    cross_kl: κ > 0 (nats).

  Returns:
    {bucket_name(...) for each bucket, "mismatch/first_cross_pos", "mismatch/cross_frac"}.
  """
  check_position_settings(bucket_tokens, cross_kl)
  c = kl_bc.shape[-1]
  kl_n, _ = kl_by_position(kl_bc, mask_bc, bucket_tokens)
  names = [bucket_name(a, z, c) for a, z in position_buckets(c, bucket_tokens)]
  metrics = {name: kl_n[i] for i, name in enumerate(names)}
  first_b, counted_b = first_cross(kl_bc, mask_bc, cross_kl)
  crossed_b = first_b >= 0
  crossed = jnp.sum(crossed_b).astype(jnp.float32)
  counted = jnp.sum(counted_b).astype(jnp.float32)
  total = jnp.sum(jnp.where(crossed_b, first_b, 0)).astype(jnp.float32)
  metrics["mismatch/first_cross_pos"] = jnp.where(
    crossed > 0, total / jnp.maximum(crossed, 1), jnp.nan
  )
  metrics["mismatch/cross_frac"] = jnp.where(
    counted > 0, crossed / jnp.maximum(counted, 1), jnp.nan
  )
  return metrics


def per_token_kl_entry(student_logits_bcv, rollout: Rollout) -> dict:
  """{PER_TOKEN_KL_KEY: KL_t [B, C] (stop-gradient)} for `with_position_metrics` to read after
  the step's micro-batches are combined; {} when the rollout carries no behaviour
  distribution."""
  if rollout.topk_logprobs is None:
    return {}
  logits_bcv = jax.lax.stop_gradient(student_logits_bcv).astype(jnp.float32)
  return {PER_TOKEN_KL_KEY: per_token_kl(logits_bcv, rollout)}


def with_position_metrics(metrics: dict, mask_bc, bucket_tokens: int, cross_kl: float) -> dict:
  """`metrics` without its `PER_TOKEN_KL_KEY` array and with the `position_metrics` of it over
  `mask_bc` (none when it holds no such array or w = 0). Per bucket and per completion, these
  are not token means over the whole batch, so they are computed once on the whole batch's
  [B, C] KL, after micro-batches are combined, never averaged across them."""
  metrics = dict(metrics)
  kl_bc = metrics.pop(PER_TOKEN_KL_KEY, None)
  if kl_bc is None or bucket_tokens == 0:
    return metrics
  return metrics | position_metrics(kl_bc, mask_bc, bucket_tokens, cross_kl)


def position_summary(kl_bc, mask_bc, bucket_tokens: int, cross_kl: float) -> dict:
  """The position metrics as plain JSON values, for a measurement outside training (the
  admission check's rows): {"kl_by_position": {"bucket_tokens", "first", "last", "kl" (None
  for an empty bucket), "tokens"}, "first_cross": {"kl": κ, "pos_mean", "frac" (None when
  undefined), "crossed", "completions", "first" (τ_b of every completion with a counted
  token, −1 for none)}}."""
  check_position_settings(bucket_tokens, cross_kl)
  kl_bc, mask_bc = jnp.asarray(kl_bc, jnp.float32), jnp.asarray(mask_bc)
  buckets = position_buckets(kl_bc.shape[1], bucket_tokens)
  kl_n, tokens_n = kl_by_position(kl_bc, mask_bc, bucket_tokens)
  first_b, counted_b = first_cross(kl_bc, mask_bc, cross_kl)
  first = [int(f) for f, c in zip(first_b.tolist(), counted_b.tolist(), strict=True) if c]
  crossed = [f for f in first if f >= 0]

  def value(x: float):
    return None if x != x else float(x)  # NaN -> None

  return {
    "kl_by_position": {
      "bucket_tokens": bucket_tokens,
      "first": [a for a, _ in buckets],
      "last": [z for _, z in buckets],
      "kl": [value(x) for x in kl_n.tolist()],
      "tokens": [int(x) for x in tokens_n.tolist()],
    },
    "first_cross": {
      "kl": float(cross_kl),
      "pos_mean": sum(crossed) / len(crossed) if crossed else None,
      "frac": len(crossed) / len(first) if first else None,
      "crossed": len(crossed),
      "completions": len(first),
      "first": first,
    },
  }
