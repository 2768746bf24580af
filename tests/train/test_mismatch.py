"""The mismatch metrics against values worked out by hand (ln 2 multiples)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.data.rollout_types import Rollout
from opd_jax.train import mismatch_metrics as mismatch

LN2 = np.log(2.0)
NEG = -np.inf
NAN = np.nan


def _lp(*probs):
  with np.errstate(divide="ignore"):
    return np.log(np.asarray(probs, np.float64))


# B = 2, C = 3, V = 4. Row 1's positions 1 and 2 are masked and hold junk (NaN, inf).
# Position        π_b                     π_θ                       y   KL(π_b‖π_θ)  ρ
# (0, 0) top-p   (1/2, 1/4, 1/4, 0)      (1/4, 1/4, 1/4, 1/4)      0   ½ ln 2       −ln 2
# (0, 1) greedy  point mass on 2          (1/4, 1/4, 1/2, 0)        2   ln 2         −ln 2
# (0, 2) exact   (.1, .2, .3, .4)        the same                  3   0            0
# (1, 0) top-k   (1/2, 1/2, 0, 0)        (1/8, 1/8, 1/4, 1/2)      1   2 ln 2       −2 ln 2
BEHAVIOUR_DIST = np.array(
  [
    [_lp(0.5, 0.25, 0.25, 0), _lp(0, 0, 1, 0), _lp(0.1, 0.2, 0.3, 0.4)],
    [_lp(0.5, 0.5, 0, 0), [NAN] * 4, [NAN, 0.0, NEG, 1.0]],
  ]
)
STUDENT = np.array(
  [
    [_lp(1, 1, 1, 1), _lp(1, 1, 2, 0), _lp(0.1, 0.2, 0.3, 0.4) + 7.0],  # logits: shifts are free
    [_lp(1, 1, 2, 4), [np.inf, 0, 0, 0], [0.0, 0, 0, 0]],
  ]
)
TOKENS = np.array([[0, 2, 3], [1, 0, 0]], np.int32)
MASK = np.array([[1, 1, 1], [1, 0, 0]], np.int32)
BEHAVIOUR_LP = np.array([[np.log(0.5), 0.0, np.log(0.4)], [np.log(0.5), 5.0, NAN]])

# The per-token values of the table, over the four counted tokens.
KL = np.array([0.5, 1.0, 0.0, 2.0]) * LN2
RHO = np.array([-1.0, -1.0, 0.0, -2.0]) * LN2


def _rollout(**dist) -> Rollout:
  return Rollout(
    prompt_tokens=jnp.ones((2, 1), jnp.int32),
    prompt_lens=jnp.ones((2,), jnp.int32),
    completion_tokens=jnp.asarray(TOKENS),
    completion_mask=jnp.asarray(MASK),
    behaviour_logprobs=jnp.asarray(BEHAVIOUR_LP, jnp.float32),
    model_logprobs=jnp.zeros((2, 3), jnp.float32),
    weight_version=jnp.asarray(0, jnp.int32),
    **{k: jnp.asarray(v) for k, v in dist.items()},
  )


def _full_rollout() -> Rollout:
  ids = np.broadcast_to(np.arange(4, dtype=np.int32), (2, 3, 4))
  return _rollout(
    topk_logprobs=BEHAVIOUR_DIST.astype(np.float32),
    topk_ids=ids,
    tail_logprob=np.full((2, 3), NEG, np.float32),
  )


def _metrics(rollout, student=STUDENT):
  fn = jax.jit(mismatch.mismatch_metrics)
  return {k: float(v) for k, v in fn(jnp.asarray(student, jnp.float32), rollout).items()}


def test_exact_metrics_hand_computed():
  m = _metrics(_full_rollout())
  # KL: (½ + 1 + 0 + 2) ln 2 / 4; p95 of the sorted (0, ½, 1, 2) ln 2 at h = 3 · 0.95 = 2.85.
  np.testing.assert_allclose(m["mismatch/kl"], 3.5 * LN2 / 4, rtol=1e-6)
  np.testing.assert_allclose(m["mismatch/kl_p95"], 1.85 * LN2, rtol=1e-6)
  np.testing.assert_allclose(m["mismatch/kl_max"], 2 * LN2, rtol=1e-6)
  # k1 = mean(−ρ) = ln 2; k3 = mean(e^ρ − ρ − 1) = (2(ln 2 − ½) + 0 + (2 ln 2 − ¾)) / 4.
  np.testing.assert_allclose(m["mismatch/k1"], LN2, rtol=1e-6)
  np.testing.assert_allclose(m["mismatch/k3"], LN2 - 0.4375, rtol=1e-6)
  # |ρ| = (1, 1, 0, 2) ln 2: mean ln 2, p95 (1 + 0.85) ln 2, max 2 ln 2.
  np.testing.assert_allclose(m["mismatch/abs_logp_diff"], LN2, rtol=1e-6)
  np.testing.assert_allclose(m["mismatch/abs_logp_diff_p95"], 1.85 * LN2, rtol=1e-6)
  np.testing.assert_allclose(m["mismatch/abs_logp_diff_max"], 2 * LN2, rtol=1e-6)
  # The sampled-token estimators agree with the exact per-token table.
  np.testing.assert_allclose(m["mismatch/k1"], np.mean(-RHO), rtol=1e-6)
  assert np.isclose(m["mismatch/kl"], KL.mean())


def test_top_k_with_tail_bucket_hand_computed():
  """Top-2 behaviour tokens plus a tail: a lower bound of the exact KL (data processing).

  (0, 0): buckets {0, 1, rest}: π_b (½, ¼, ¼), π_θ (¼, ¼, ½) → ½ ln 2 − ¼ ln 2 = ¼ ln 2.
  (0, 1): {2, 0, rest}: π_b (1, 0, 0), π_θ(2) = ½ → ln 2 (the point mass loses nothing).
  (0, 2): equal distributions → 0.  (1, 0): {0, 1, rest}: π_b (½, ½, 0) → 2 ln 2.
  """
  ids = np.array([[[0, 1], [2, 0], [3, 2]], [[0, 1], [0, 1], [0, 1]]], np.int32)
  top = np.take_along_axis(BEHAVIOUR_DIST, ids, -1)
  tail = np.array([[np.log(0.25), NEG, np.log(0.3)], [NEG, NAN, NAN]])
  rollout = _rollout(
    topk_logprobs=top.astype(np.float32), topk_ids=ids, tail_logprob=tail.astype(np.float32)
  )
  m = _metrics(rollout)
  np.testing.assert_allclose(m["mismatch/kl"], 3.25 * LN2 / 4, rtol=1e-6)
  np.testing.assert_allclose(m["mismatch/kl_max"], 2 * LN2, rtol=1e-6)
  assert m["mismatch/kl"] <= _metrics(_full_rollout())["mismatch/kl"]
  # The sampled-token metrics do not depend on how the distribution is stored.
  np.testing.assert_allclose(m["mismatch/k3"], LN2 - 0.4375, rtol=1e-6)


def test_identical_distributions_read_zero_and_no_distribution_drops_kl():
  behaviour = np.where(MASK[..., None] > 0, BEHAVIOUR_DIST, 0.0)
  rollout = _rollout(
    topk_logprobs=behaviour.astype(np.float32),
    topk_ids=np.broadcast_to(np.arange(4, dtype=np.int32), (2, 3, 4)),
    tail_logprob=np.full((2, 3), NEG, np.float32),
  )
  # π_θ = π_b wherever π_b has mass; -inf elsewhere (the replayed kept set).
  student = np.where(np.isfinite(behaviour), behaviour + 3.0, NEG)
  student[1, 1:] = 0.0
  m = _metrics(
    rollout.replace(behaviour_logprobs=jnp.asarray(np.where(MASK > 0, BEHAVIOUR_LP, 0.0))), student
  )
  for name, value in m.items():
    assert abs(value) < 1e-6, (name, value)
  sampled_only = _metrics(_rollout())
  assert set(sampled_only) == {
    "mismatch/k1",
    "mismatch/k3",
    "mismatch/abs_logp_diff",
    "mismatch/abs_logp_diff_p95",
    "mismatch/abs_logp_diff_max",
  }
  np.testing.assert_allclose(sampled_only["mismatch/k1"], LN2, rtol=1e-6)


def test_metrics_take_no_gradient():
  grad = jax.grad(lambda s: mismatch.mismatch_metrics(s, _full_rollout())["mismatch/kl"])
  np.testing.assert_array_equal(grad(jnp.asarray(STUDENT, jnp.float32)), 0.0)


@pytest.mark.parametrize("q", [0.0, 0.5, 0.95, 1.0])
def test_masked_quantile_matches_numpy(q):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 7)).astype(np.float32)
  mask = rng.random((5, 7)) < 0.6
  got = float(mismatch.masked_quantile(jnp.asarray(x), jnp.asarray(mask), q))
  np.testing.assert_allclose(got, np.quantile(x[mask], q), rtol=1e-6)
  one = np.zeros((5, 7), bool)
  one[2, 3] = True
  assert float(mismatch.masked_quantile(jnp.asarray(x), jnp.asarray(one), q)) == x[2, 3]
  assert float(mismatch.masked_quantile(jnp.asarray(x), jnp.zeros((5, 7)), q)) == 0.0
  assert float(mismatch.masked_max(jnp.asarray(x), jnp.zeros((5, 7)))) == 0.0
  with_nan = x.copy()
  with_nan[np.argwhere(mask)[0][0], np.argwhere(mask)[0][1]] = np.nan  # a kept NaN: NaN, as numpy
  assert np.isnan(float(mismatch.masked_quantile(jnp.asarray(with_nan), jnp.asarray(mask), q)))
  with_nan[~mask] = np.nan  # NaN only where masked out: ignored
  with_nan[mask] = x[mask]
  got = float(mismatch.masked_quantile(jnp.asarray(with_nan), jnp.asarray(mask), q))
  np.testing.assert_allclose(got, np.quantile(x[mask], q), rtol=1e-6)


def test_default_return_topk_and_bad_inputs():
  assert mismatch.default_return_topk(128) == -1
  assert mismatch.default_return_topk(4096) == -1
  assert mismatch.default_return_topk(4097) == 64
  assert mismatch.default_return_topk(151936) == 64
  with pytest.raises(ValueError, match="vocab_size must be a positive int"):
    mismatch.default_return_topk(0)
  with pytest.raises(ValueError, match="q must be in"):
    mismatch.masked_quantile(jnp.zeros(3), jnp.ones(3), 1.5)
  with pytest.raises(ValueError, match="no behaviour distribution"):
    mismatch.per_token_kl(jnp.zeros((2, 3, 4)), _rollout())
  with pytest.raises(ValueError, match=r"must be \[B, C\]"):
    mismatch.mismatch_metrics(jnp.zeros((2, 4, 4)), _full_rollout())
