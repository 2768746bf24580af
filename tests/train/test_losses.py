"""OPD losses against values and gradients worked out in numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.model import teacher_topk
from opd_jax.train import losses

# Two sequences of three positions over V = 4; the last position of row 1 is masked.
S = np.array(
  [
    [[1.0, 2.0, 0.5, -1.0], [0.0, 0.3, 2.5, 1.0], [-0.5, 1.5, 0.2, 0.0]],
    [[2.0, -1.0, 0.0, 0.7], [0.4, 0.4, -2.0, 3.0], [9.0, -9.0, 9.0, -9.0]],
  ],
  np.float32,
)
TCH = np.array(
  [
    [[0.5, 2.5, 0.0, -0.5], [1.0, 0.0, 2.0, 0.5], [0.0, 1.0, 1.0, 0.0]],
    [[1.0, 0.0, 0.5, 0.5], [0.0, 1.0, -1.0, 2.0], [-9.0, 9.0, -9.0, 9.0]],
  ],
  np.float32,
)
TOKENS = np.array([[1, 2, 0], [3, 3, 1]], np.int32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
BEHAVIOUR = np.array([[-1.0, -0.2, -3.0], [-2.5, -0.9, -1.0]], np.float32)


def _sparse(teacher_logits, k):
  """The teacher as its top-k plus a tail bucket (a `losses.TeacherDistribution`)."""
  return teacher_topk.from_logits(jnp.asarray(teacher_logits), k)


def np_logsoftmax(x):
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_kl(p_lp, q_lp):
  return (np.exp(p_lp) * (p_lp - q_lp)).sum(-1)


def np_masked_mean(x, mask):
  return (x * mask).sum() / mask.sum()


def test_token_logprobs_and_per_token_kl():
  np.testing.assert_allclose(
    losses.token_logprobs(jnp.asarray(S), jnp.asarray(TOKENS)),
    np.take_along_axis(np_logsoftmax(S), TOKENS[..., None], -1)[..., 0],
    rtol=1e-6,
  )
  # V = 3 by hand: p = softmax([0, ln 2, ln 3]) = (1/6, 2/6, 3/6), q uniform.
  p = jnp.log(jnp.array([1.0, 2.0, 3.0]))
  expected = sum(pi * np.log(pi * 3) for pi in (1 / 6, 2 / 6, 3 / 6))
  np.testing.assert_allclose(losses.per_token_kl(p, jnp.zeros(3)), expected, rtol=1e-6)
  np.testing.assert_allclose(
    losses.per_token_kl(jnp.asarray(S), jnp.asarray(TCH)),
    np_kl(np_logsoftmax(S), np_logsoftmax(TCH)),
    rtol=1e-5,
  )


def test_top_k_buckets():
  # k = V is the exact KL; k = 2 keeps p's two most likely tokens plus a tail bucket.
  full = losses.per_token_kl(jnp.asarray(S), jnp.asarray(TCH))
  np.testing.assert_array_equal(
    losses.per_token_kl(jnp.asarray(S), jnp.asarray(TCH), top_k=4), full
  )
  p_lp, q_lp = np_logsoftmax(S), np_logsoftmax(TCH)
  top2 = np.argsort(-S, axis=-1, kind="stable")[..., :2]
  p2 = np.take_along_axis(np.exp(p_lp), top2, -1)
  q2 = np.take_along_axis(np.exp(q_lp), top2, -1)
  p_b = np.concatenate([p2, 1 - p2.sum(-1, keepdims=True)], -1)
  q_b = np.concatenate([q2, 1 - q2.sum(-1, keepdims=True)], -1)
  expected = np_kl(np.log(p_b), np.log(q_b))
  got = losses.per_token_kl(jnp.asarray(S), jnp.asarray(TCH), top_k=2)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
  assert (np.asarray(got) <= np.asarray(full) + 1e-6).all()  # coarse-graining lowers KL
  lp, ids = losses.topk_logprobs_with_tail(jnp.asarray(S), 2)
  np.testing.assert_array_equal(ids, top2)
  np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, rtol=1e-6)


def test_reverse_kl_sampled_value_and_metrics():
  s_lp = np.take_along_axis(np_logsoftmax(S), TOKENS[..., None], -1)[..., 0]
  t_lp = np.take_along_axis(np_logsoftmax(TCH), TOKENS[..., None], -1)[..., 0]
  raw = np.exp(s_lp - BEHAVIOUR)
  assert (raw > 2.0).any() and (raw < 2.0).any()  # the clip is exercised
  ratio = np.minimum(raw, 2.0)
  adv = t_lp - s_lp
  loss, m = losses.reverse_kl_sampled(S, TCH, TOKENS, MASK, BEHAVIOUR, is_clip=2.0)
  np.testing.assert_allclose(loss, -np_masked_mean(ratio * adv * s_lp, MASK), rtol=1e-5)
  np.testing.assert_allclose(m["loss/reverse_kl_sampled"], loss)
  np.testing.assert_allclose(m["teacher/reverse_kl_k1"], np_masked_mean(-adv, MASK), rtol=1e-5)
  np.testing.assert_allclose(m["teacher/logprob"], np_masked_mean(t_lp, MASK), rtol=1e-5)
  np.testing.assert_allclose(m["loss/is_ratio"], np_masked_mean(ratio, MASK), rtol=1e-5)
  np.testing.assert_allclose(m["loss/is_clip_frac"], np_masked_mean(raw > 2.0, MASK))
  assert float(m["loss/num_tokens"]) == 5.0
  # Padding may carry any behaviour log-prob; masked positions must not leak into the loss.
  padded = BEHAVIOUR.copy()
  padded[1, 2] = np.nan
  np.testing.assert_array_equal(
    losses.reverse_kl_sampled(S, TCH, TOKENS, MASK, padded, is_clip=2.0)[0], loss
  )
  grad = jax.grad(lambda s: losses.reverse_kl_sampled(s, TCH, TOKENS, MASK, padded)[0])(S)
  assert np.isfinite(np.asarray(grad)).all()
  loss_none, m_none = losses.reverse_kl_sampled(S, TCH, TOKENS, MASK, BEHAVIOUR, is_clip=None)
  np.testing.assert_allclose(loss_none, -np_masked_mean(adv * s_lp, MASK), rtol=1e-5)
  assert float(m_none["loss/is_ratio"]) == 1.0


def test_reverse_kl_sampled_gradient_by_hand():
  # One token: ∂loss/∂z = −r·A·(onehot(y) − π_θ), with r and A held fixed.
  z = np.array([[[0.2, -0.4, 1.1]]], np.float32)
  zt = np.array([[[1.0, 0.0, -1.0]]], np.float32)
  y, lb = 2, -0.5
  p = np.exp(np_logsoftmax(z))[0, 0]
  lp_s, lp_t = np.log(p[y]), np_logsoftmax(zt)[0, 0, y]
  r, a = min(np.exp(lp_s - lb), 2.0), lp_t - lp_s
  expected = -r * a * (np.eye(3)[y] - p)

  def f(logits):
    return losses.reverse_kl_sampled(
      logits, zt, jnp.array([[y]]), jnp.ones((1, 1)), jnp.array([[lb]]), 2.0
    )[0]

  np.testing.assert_allclose(jax.grad(f)(jnp.asarray(z))[0, 0], expected, rtol=1e-5)
  grad_teacher = jax.grad(
    lambda t: losses.reverse_kl_sampled(
      z, t, jnp.array([[y]]), jnp.ones((1, 1)), jnp.array([[lb]])
    )[0]
  )(jnp.asarray(zt))
  np.testing.assert_array_equal(grad_teacher, 0.0)


@pytest.mark.parametrize("behaviour_is_student", [True, False])
def test_reverse_kl_sampled_gradient_is_unbiased(behaviour_is_student):
  # E_{y~π_b}[∇ loss(y)] with untruncated ratios equals ∇ KL(π_θ ‖ π_T), computed exactly.
  z = jnp.array([[[0.3, -1.0, 0.8, 0.1]]])
  zt = jnp.array([[[1.0, 0.5, -0.5, 0.0]]])
  zb = z if behaviour_is_student else jnp.array([[[0.0, 0.7, 0.2, -0.3]]])
  pb = jax.nn.softmax(zb[0, 0])
  clip = None if behaviour_is_student else 1e9
  one = jnp.ones((1, 1))

  def sampled(logits, y):
    lb = jnp.log(pb[y]).reshape(1, 1)
    return losses.reverse_kl_sampled(logits, zt, jnp.full((1, 1), y), one, lb, clip)[0]

  expected_grad = sum(pb[y] * jax.grad(sampled)(z, y) for y in range(4))
  exact_grad = jax.grad(lambda logits: losses.reverse_kl_full(logits, zt, one)[0])(z)
  np.testing.assert_allclose(expected_grad, exact_grad, rtol=1e-5, atol=1e-7)


def test_reverse_kl_sampled_advantage_clip_by_hand():
  # V = 2, π_θ = (½, ½) at both positions; π_T(0) = 0.01, so at position 0 (y = 0)
  # A = ln(0.01/0.5) = −3.91 clips to −1, at position 1 (y = 1) A = ln(0.99/0.5) = 0.683 stays.
  z = jnp.zeros((1, 2, 2))
  zt = jnp.array([[[0.0, np.log(99.0)], [0.0, np.log(99.0)]]])
  tokens, mask = jnp.array([[0, 1]]), jnp.ones((1, 2))
  behaviour = jnp.full((1, 2), np.log(0.5))

  def f(logits, c):
    return losses.reverse_kl_sampled(logits, zt, tokens, mask, behaviour, None, c)

  loss, m = f(z, 1.0)
  a1 = np.log(1.98)
  np.testing.assert_allclose(loss, -0.5 * (-1.0 + a1) * np.log(0.5), rtol=1e-6)
  assert float(m["loss/advantage_clip_frac"]) == 0.5
  np.testing.assert_allclose(m["teacher/reverse_kl_k1"], 0.5 * (np.log(50.0) - a1), rtol=1e-6)
  # ∂loss/∂z_t = −½ · clip(A_t) · (onehot(y_t) − π_θ).
  grad = jax.grad(lambda s: f(s, 1.0)[0])(z)
  np.testing.assert_allclose(grad[0], [[0.25, -0.25], [0.25 * a1, -0.25 * a1]], rtol=1e-5)
  # A clip no advantage reaches changes nothing.
  np.testing.assert_array_equal(f(z, 10.0)[0], f(z, None)[0])
  assert float(f(z, None)[1]["loss/advantage_clip_frac"]) == 0.0


def test_reverse_kl_sampled_advantage_clip_is_an_f_divergence_gradient():
  # E_{y~π_θ}[∇ loss(y)] with A clipped to [−c, c] equals ∇ Σ_y π_T f(π_θ/π_T), where
  # f(u) = u ln u − u + 1 for |ln u| ≤ c, continued linearly with slope ±c outside.
  c = 0.5
  z = jnp.array([[[0.3, -1.0, 0.8, 0.1]]])
  zt = jnp.array([[[2.0, -1.5, -0.5, 0.0]]])  # ratios outside e^{±c} on both sides
  one = jnp.ones((1, 1))

  def f(u):
    lo, hi = np.exp(-c), np.exp(c)
    inner = lambda v: v * jnp.log(v) - v + 1  # noqa: E731
    return jnp.where(
      u > hi, inner(hi) + c * (u - hi), jnp.where(u < lo, inner(lo) - c * (u - lo), inner(u))
    )

  def divergence(logits):
    p, q = jax.nn.softmax(logits[0, 0]), jax.nn.softmax(zt[0, 0])
    return jnp.sum(q * f(p / q))

  u = jax.nn.softmax(z[0, 0]) / jax.nn.softmax(zt[0, 0])
  assert (jnp.abs(jnp.log(u)) > c).sum() >= 2  # the clip acts

  def sampled(logits, y):
    lb = jax.lax.stop_gradient(jax.nn.log_softmax(logits[0, 0])[y]).reshape(1, 1)
    return losses.reverse_kl_sampled(logits, zt, jnp.full((1, 1), y), one, lb, None, c)[0]

  pb = jax.nn.softmax(z[0, 0])
  expected_grad = sum(pb[y] * jax.grad(sampled)(z, y) for y in range(4))
  np.testing.assert_allclose(expected_grad, jax.grad(divergence)(z), rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="advantage_clip"):
    losses.reverse_kl_sampled(z, zt, jnp.zeros((1, 1), jnp.int32), one, one, None, 0.0)


def test_reverse_kl_sampled_batch_mean_baseline_by_hand():
  # Row 0 has 3 tokens, row 1 has 2 (its third is padding). With c = 0.25, each row's baseline
  # is the mean clipped advantage of the OTHER row's tokens, and
  # ∂loss/∂z_bt = −m_bt (clip(A_bt) − b_b)(onehot(y_bt) − π_θ) / Σ m.
  c = 0.25
  s_lp_all = np_logsoftmax(S)
  s_lp = np.take_along_axis(s_lp_all, TOKENS[..., None], -1)[..., 0]
  t_lp = np.take_along_axis(np_logsoftmax(TCH), TOKENS[..., None], -1)[..., 0]
  adv = np.clip(t_lp - s_lp, -c, c)
  assert ((np.abs(t_lp - s_lp) > c) & (MASK > 0)).sum() == 3  # the clip acts on 3 of 5
  b = np.array([adv[1, :2].mean(), adv[0].mean()])[:, None]
  used = (adv - b) * MASK

  def f(logits, baseline):
    return losses.reverse_kl_sampled(logits, TCH, TOKENS, MASK, BEHAVIOUR, None, c, baseline)

  loss, m = f(jnp.asarray(S), "batch_mean")
  np.testing.assert_allclose(loss, -(used * s_lp).sum() / 5, rtol=1e-5)
  np.testing.assert_allclose(
    m["loss/advantage_baseline"], (3 * b[0, 0] + 2 * b[1, 0]) / 5, rtol=1e-5
  )
  onehot = np.eye(4)[TOKENS]
  expected = -used[..., None] * (onehot - np.exp(s_lp_all)) / 5
  grad = jax.grad(lambda z: f(z, "batch_mean")[0])(jnp.asarray(S))
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
  # Without a baseline: the same with b = 0; the baseline metric reads 0.
  loss_none, m_none = f(jnp.asarray(S), "none")
  np.testing.assert_allclose(loss_none, -(adv * MASK * s_lp).sum() / 5, rtol=1e-5)
  assert float(m_none["loss/advantage_baseline"]) == 0.0
  with pytest.raises(ValueError, match="baseline"):
    f(jnp.asarray(S), "mean")


@pytest.mark.parametrize("c", [None, 0.5])
def test_reverse_kl_sampled_baseline_keeps_the_expected_gradient(c):
  # Two sequences of one token each, V = 3, sampled on-policy and independently. Summed
  # exactly over the 9 joint samples, the gradient with the batch-mean baseline equals the
  # gradient without it; without a clip both equal ∇ KL(π_θ ‖ π_T) exactly.
  z = jnp.array([[[0.3, -1.0, 0.8]], [[1.2, 0.1, -0.4]]])
  zt = jnp.array([[[1.0, 0.5, -1.5]], [[-0.5, 0.9, 0.2]]])
  p = jax.nn.softmax(z, axis=-1)[:, 0]
  mask = jnp.ones((2, 1))

  def expected_grad(baseline):
    total = jnp.zeros_like(z)
    for y0 in range(3):
      for y1 in range(3):
        tokens = jnp.array([[y0], [y1]])

        def loss(logits, tokens=tokens):
          lb = jax.lax.stop_gradient(losses.token_logprobs(logits, tokens))
          return losses.reverse_kl_sampled(logits, zt, tokens, mask, lb, None, c, baseline)[0]

        total = total + p[0, y0] * p[1, y1] * jax.grad(loss)(z)
    return total

  with_baseline, without = expected_grad("batch_mean"), expected_grad("none")
  np.testing.assert_allclose(with_baseline, without, rtol=1e-5, atol=1e-7)
  if c is None:
    exact = jax.grad(lambda logits: losses.reverse_kl_full(logits, zt, mask)[0])(z)
    np.testing.assert_allclose(with_baseline, exact, rtol=1e-5, atol=1e-7)
  # The baseline does change individual sampled gradients (it is not a no-op).
  tokens = jnp.array([[0], [2]])
  lb = losses.token_logprobs(z, tokens)
  grads = [
    jax.grad(lambda lg, bl=bl: losses.reverse_kl_sampled(lg, zt, tokens, mask, lb, None, c, bl)[0])(
      z
    )
    for bl in ("none", "batch_mean")
  ]
  assert float(jnp.max(jnp.abs(grads[0] - grads[1]))) > 1e-3


def test_reverse_and_forward_kl_full_values():
  p_lp, q_lp = np_logsoftmax(S), np_logsoftmax(TCH)
  rev, m = losses.reverse_kl_full(S, TCH, MASK)
  np.testing.assert_allclose(rev, np_masked_mean(np_kl(p_lp, q_lp), MASK), rtol=1e-5)
  assert set(m) == {"loss/reverse_kl_full", "teacher/reverse_kl", "loss/num_tokens"}
  fwd, m = losses.forward_kl(S, TCH, MASK)
  np.testing.assert_allclose(fwd, np_masked_mean(np_kl(q_lp, p_lp), MASK), rtol=1e-5)
  np.testing.assert_allclose(m["teacher/forward_kl"], fwd)
  # The same functions on the sparse teacher: k = V gives the exact loss; the top-k bins
  # are the teacher's top-k plus a tail bucket.
  np.testing.assert_allclose(losses.reverse_kl_full(S, _sparse(TCH, 4), MASK)[0], rev, rtol=1e-6)
  np.testing.assert_allclose(losses.forward_kl(S, _sparse(TCH, 4), MASK)[0], fwd, rtol=1e-6)
  fwd1 = losses.forward_kl(S, _sparse(TCH, 1), MASK)[0]
  top1 = TCH.argmax(-1)[..., None]
  pt, ps = np.exp(q_lp), np.exp(p_lp)
  t_b = np.concatenate([np.take_along_axis(pt, top1, -1), 1 - np.take_along_axis(pt, top1, -1)], -1)
  s_b = np.concatenate([np.take_along_axis(ps, top1, -1), 1 - np.take_along_axis(ps, top1, -1)], -1)
  np.testing.assert_allclose(fwd1, np_masked_mean(np_kl(np.log(t_b), np.log(s_b)), MASK), rtol=1e-5)


def test_jsd_endpoints_and_interior():
  np.testing.assert_array_equal(
    losses.jsd(S, TCH, MASK, 0.0)[0], losses.forward_kl(S, TCH, MASK)[0]
  )
  np.testing.assert_array_equal(
    losses.jsd(S, TCH, MASK, 1.0)[0], losses.reverse_kl_full(S, TCH, MASK)[0]
  )
  beta = 0.3
  ps, pt = np.exp(np_logsoftmax(S)), np.exp(np_logsoftmax(TCH))
  mix = beta * pt + (1 - beta) * ps
  per_token = beta * np_kl(np.log(pt), np.log(mix)) + (1 - beta) * np_kl(np.log(ps), np.log(mix))
  loss, m = losses.jsd(S, TCH, MASK, beta)
  np.testing.assert_allclose(loss, np_masked_mean(per_token, MASK), rtol=1e-5)
  np.testing.assert_allclose(m["loss/jsd"], loss)
  # β = 0.5 is the symmetric JSD, bounded by ln 2.
  half = losses.jsd(S, TCH, MASK, 0.5)[0]
  np.testing.assert_allclose(half, losses.jsd(TCH, S, MASK, 0.5)[0], rtol=1e-6)
  assert 0 < float(half) < np.log(2)


def test_masks_are_respected():
  for fn in (
    functools.partial(losses.reverse_kl_sampled, tokens=TOKENS, behaviour_logprobs=BEHAVIOUR),
    losses.reverse_kl_full,
    lambda s, t, mask: losses.forward_kl(s, _sparse(t, 2), mask),
    functools.partial(losses.jsd, beta=0.4),
  ):
    noisy_s, noisy_t = S.copy(), TCH.copy()
    noisy_s[1, 2] = [50.0, -3.0, 7.0, 1.0]  # masked position
    noisy_t[1, 2] = [-20.0, 4.0, 0.0, 9.0]
    base, _ = fn(S, TCH, mask=MASK)
    np.testing.assert_allclose(fn(noisy_s, noisy_t, mask=MASK)[0], base, rtol=1e-6)
    grad = jax.grad(lambda s, fn=fn: fn(s, TCH, mask=MASK)[0])(jnp.asarray(S))
    np.testing.assert_array_equal(grad[1, 2], 0.0)
    assert np.isfinite(np.asarray(grad)).all()
    assert float(fn(S, TCH, mask=np.zeros_like(MASK))[0]) == 0.0


def test_teacher_gets_no_gradient_and_jit_with_static_args():
  for fn in (
    losses.reverse_kl_full,
    lambda s, t, mask: losses.reverse_kl_full(s, _sparse(t, 2), mask),
    losses.forward_kl,
    functools.partial(losses.jsd, beta=0.5),
  ):
    grad_t = jax.grad(lambda t, fn=fn: fn(S, t, MASK)[0])(jnp.asarray(TCH))
    np.testing.assert_array_equal(grad_t, 0.0)
  jitted = jax.jit(losses.jsd, static_argnames="beta")
  np.testing.assert_allclose(
    jitted(S, _sparse(TCH, 2), MASK, beta=0.3)[0],
    losses.jsd(S, _sparse(TCH, 2), MASK, beta=0.3)[0],
    rtol=1e-6,
  )


def test_bf16_inputs_compute_in_f32():
  loss, _ = losses.reverse_kl_full(
    jnp.asarray(S, jnp.bfloat16), jnp.asarray(TCH, jnp.bfloat16), MASK
  )
  assert loss.dtype == jnp.float32
  ref = losses.reverse_kl_full(
    jnp.asarray(S, jnp.bfloat16).astype(jnp.float32),
    jnp.asarray(TCH, jnp.bfloat16).astype(jnp.float32),
    MASK,
  )[0]
  np.testing.assert_array_equal(loss, ref)


def test_bad_arguments():
  with pytest.raises(ValueError, match="differ"):
    losses.reverse_kl_full(S, TCH[..., :3], MASK)
  with pytest.raises(ValueError, match="mask"):
    losses.forward_kl(S, TCH, MASK[:, :2])
  with pytest.raises(ValueError, match=r"\[B, T, V\]"):
    losses.forward_kl(S[0], TCH[0], MASK[0])
  with pytest.raises(ValueError, match="beta"):
    losses.jsd(S, TCH, MASK, 1.5)
  with pytest.raises(ValueError, match="beta"):
    losses.jsd(S, TCH, MASK, -0.1)
  with pytest.raises(ValueError, match="is_clip"):
    losses.reverse_kl_sampled(S, TCH, TOKENS, MASK, BEHAVIOUR, is_clip=0.0)
  with pytest.raises(ValueError, match="behaviour_logprobs"):
    losses.reverse_kl_sampled(S, TCH, TOKENS, MASK, BEHAVIOUR[:, :2])
  with pytest.raises(ValueError, match="top_k"):
    losses.reverse_kl_full(S[..., :3], _sparse(TCH, 4), MASK)
  with pytest.raises(ValueError, match="top-k ids"):
    losses.forward_kl(S[:, :2], _sparse(TCH, 2), MASK[:, :2])
  with pytest.raises(ValueError, match="tokens"):
    losses.token_logprobs(S, TOKENS[:, :2])


@pytest.mark.parametrize(
  "loss_name", ["reverse_kl_sampled", "reverse_kl_full", "forward_kl", "jsd"]
)
@pytest.mark.parametrize("sparse", [False, True])
def test_a_minus_inf_teacher_at_a_masked_position_leaves_the_gradient_finite(loss_name, sparse):
  """Padding (masked, token 0) where the teacher gives token 0 no mass: the masked term is
  ignored in the value and must be in the gradient too (0 · inf would be NaN)."""
  teacher = TCH.copy()
  teacher[1, 2, 0] = -np.inf  # only at the masked position (row 1, position 2)
  tokens = TOKENS.copy()
  tokens[1, 2] = 0
  target = _sparse(teacher, 2) if sparse else jnp.asarray(teacher)
  mask = jnp.asarray(MASK)
  if loss_name == "reverse_kl_sampled":
    fn = functools.partial(
      losses.reverse_kl_sampled,
      teacher=target,
      tokens=jnp.asarray(tokens),
      mask=mask,
      behaviour_logprobs=jnp.asarray(BEHAVIOUR),
    )
  else:
    fn = functools.partial(getattr(losses, loss_name), teacher=target, mask=mask)
  finite_teacher = _sparse(TCH, 2) if sparse else jnp.asarray(TCH)
  value, grad = jax.value_and_grad(lambda s: fn(s)[0])(jnp.asarray(S))
  assert np.all(np.isfinite(np.asarray(grad))) and np.isfinite(float(value))
  # Unmasked positions hold the same teacher, so the value is the finite teacher's.
  if loss_name == "reverse_kl_sampled":
    expected = fn.func(
      jnp.asarray(S), finite_teacher, jnp.asarray(tokens), mask, jnp.asarray(BEHAVIOUR)
    )[0]
  else:
    expected = fn.func(jnp.asarray(S), finite_teacher, mask)[0]
  np.testing.assert_allclose(float(value), float(expected), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(grad)[1, 2], 0.0)
