"""The sparse teacher (`train.teacher_top_k`: top-k log-probs plus a tail bucket) and the
teacher temperature (`teacher.temperature`).

References: hand-computed coarse-grained divergences on 5-token vocabularies, the
full-vocabulary losses (k = V must reproduce them, and every k must stay below them by
the data-processing inequality), and a 32k-vocabulary model where the sparse losses'
values and gradients are compared with the full ones.
"""

import functools
import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_char_cfg

from opd_jax.config import check as config_check
from opd_jax.data import pipeline as data
from opd_jax.data import task
from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import sampler, teacher_forcing, transform
from opd_jax.model import sharding, teacher_topk, tokenizer
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.rollout.worker import RolloutWorker
from opd_jax.train import losses, train_step

ROOT = Path(__file__).resolve().parents[2]

# Teacher probabilities over V = 5, in a shuffled order: top-2 are ids 3 (0.4) and 0 (0.3).
P_T = np.array([0.3, 0.05, 0.15, 0.4, 0.1])
Q_S = np.array([0.2, 0.2, 0.3, 0.1, 0.2])  # the student


def _logits(p, shift=0.0):
  """[1, 1, V] logits whose softmax is p (shifted, to show normalisation is done)."""
  return jnp.asarray(np.log(p) + shift, jnp.float32)[None, None, :]


def _kl(p, q):
  return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def test_from_logits_keeps_the_top_k_and_the_tail_by_hand():
  t = teacher_topk.from_logits(_logits(P_T, shift=3.0), 2)
  np.testing.assert_array_equal(np.asarray(t.ids_bck[0, 0]), [3, 0])
  np.testing.assert_allclose(np.exp(t.logprobs_bck[0, 0]), [0.4, 0.3], rtol=1e-6)
  np.testing.assert_allclose(np.exp(t.tail_bc[0, 0]), 0.3, rtol=1e-6)  # 0.05 + 0.15 + 0.1
  assert int(t.tail_count_bc[0, 0]) == 3
  np.testing.assert_allclose(float(t.top_mass()[0, 0]), 0.7, rtol=1e-6)
  np.testing.assert_allclose(np.exp(t.bin_logprobs()[0, 0]).sum(), 1.0, rtol=1e-6)


def test_topk_losses_by_hand():
  """k = 2: teacher bins (0.4, 0.3 | 0.3), student bins (0.1, 0.2 | 0.7)."""
  p_bar, q_bar = [0.4, 0.3, 0.3], [0.1, 0.2, 0.7]
  # A second, masked-out position holds other logits: it must not count.
  teacher_bcv = jnp.concatenate([_logits(P_T), _logits(P_T[::-1])], axis=1)
  student_bcv = jnp.concatenate([_logits(Q_S, shift=-1.0), _logits(Q_S[::-1])], axis=1)
  mask = jnp.array([[1, 0]])
  teacher = teacher_topk.from_logits(teacher_bcv, 2)
  fwd, m = losses.forward_kl(student_bcv, teacher, mask)
  np.testing.assert_allclose(float(fwd), _kl(p_bar, q_bar), rtol=1e-5)
  np.testing.assert_allclose(float(m["teacher/top_k_mass"]), 0.7, rtol=1e-6)
  rev, m = losses.reverse_kl_full(student_bcv, teacher, mask)
  np.testing.assert_allclose(float(rev), _kl(q_bar, p_bar), rtol=1e-5)
  assert float(m["teacher/reverse_kl"]) == float(rev)
  mix = [0.5 * a + 0.5 * b for a, b in zip(p_bar, q_bar, strict=True)]
  js, _ = losses.jsd(student_bcv, teacher, mask, beta=0.5)
  np.testing.assert_allclose(float(js), 0.5 * _kl(p_bar, mix) + 0.5 * _kl(q_bar, mix), rtol=1e-5)
  mix = [0.2 * a + 0.8 * b for a, b in zip(p_bar, q_bar, strict=True)]
  js, _ = losses.jsd(student_bcv, teacher, mask, beta=0.2)
  np.testing.assert_allclose(float(js), 0.2 * _kl(p_bar, mix) + 0.8 * _kl(q_bar, mix), rtol=1e-5)
  # The coarse-grained values stay below the full-vocabulary ones.
  assert float(fwd) < _kl(P_T, Q_S) and float(rev) < _kl(Q_S, P_T)


def test_sampled_token_outside_the_top_k_gets_the_tail_spread_uniformly():
  # One teacher logit is -inf (a padded or filtered token): the tail covers only the others.
  p = np.array([0.3, 0.05, 0.15, 0.4, 0.1, 0.0])
  with np.errstate(divide="ignore"):
    logits = jnp.asarray(np.log(p), jnp.float32)[None, None, :]
  teacher = teacher_topk.from_logits(jnp.repeat(logits, 3, axis=1), 2)
  assert int(teacher.tail_count_bc[0, 0]) == 3  # ids 1, 2, 4; not the -inf id 5
  lp = teacher.token_logprobs(jnp.array([[3, 2, 1]]))
  np.testing.assert_allclose(np.asarray(lp[0]), np.log([0.4, 0.1, 0.1]), rtol=1e-5)
  # The sampled loss with is_clip=None: loss = −mean[(log π_T(y) − log π_θ(y)) · log π_θ(y)].
  q = np.array([0.2, 0.2, 0.3, 0.1, 0.1, 0.1])
  student = jnp.repeat(_logits(q), 3, axis=1)
  tokens, mask = jnp.array([[3, 2, 1]]), jnp.ones((1, 3))
  loss, m = losses.reverse_kl_sampled(
    student, teacher, tokens, mask, jnp.zeros((1, 3)), is_clip=None
  )
  t_lp, s_lp = np.log([0.4, 0.1, 0.1]), np.log(q[[3, 2, 1]])
  np.testing.assert_allclose(float(loss), -np.mean((t_lp - s_lp) * s_lp), rtol=1e-5)
  np.testing.assert_allclose(float(m["teacher/logprob"]), np.mean(t_lp), rtol=1e-5)
  np.testing.assert_allclose(float(m["teacher/reverse_kl_k1"]), np.mean(s_lp - t_lp), rtol=1e-5)


def test_sampled_topk_is_the_full_sampled_loss_when_the_tail_is_uniform():
  """π̃_T = π_T exactly when the teacher's tail is uniform: losses and gradients agree."""
  rng = np.random.default_rng(0)
  v, k = 9, 3
  teacher_bcv = jnp.asarray(np.concatenate([[[[4.0, 3.0, 2.5]]], np.zeros((1, 1, v - k))], -1))
  teacher_bcv = jnp.repeat(teacher_bcv, 4, axis=1)
  student_bcv = jnp.asarray(rng.normal(size=(1, 4, v)), jnp.float32)
  tokens, mask = jnp.array([[0, 5, 8, 2]]), jnp.array([[1, 1, 1, 0]])
  behaviour = jnp.asarray(rng.normal(size=(1, 4)) - 2.0, jnp.float32)
  teacher = teacher_topk.from_logits(teacher_bcv, k)

  def full(s):
    return losses.reverse_kl_sampled(s, teacher_bcv, tokens, mask, behaviour, is_clip=2.0)[0]

  def sparse(s):
    return losses.reverse_kl_sampled(s, teacher, tokens, mask, behaviour, is_clip=2.0)[0]

  np.testing.assert_allclose(float(sparse(student_bcv)), float(full(student_bcv)), rtol=1e-6)
  np.testing.assert_allclose(
    jax.grad(sparse)(student_bcv), jax.grad(full)(student_bcv), rtol=1e-5, atol=1e-7
  )


def _random_case(v, seed=0, filtered=False):
  rng = np.random.default_rng(seed)
  teacher = jnp.asarray(2.0 * rng.normal(size=(2, 3, v)), jnp.float32)
  student = rng.normal(size=(2, 3, v))
  if filtered:  # a top-k/top-p student: -inf outside its kept set
    student[..., : v // 3] = -np.inf
  mask = jnp.array([[1, 1, 0], [1, 0, 1]])
  return jnp.asarray(student, jnp.float32), teacher, mask


# Each loss is written once: the same function reads full logits and the sparse teacher.
LOSSES = {
  "forward": losses.forward_kl,
  "reverse": losses.reverse_kl_full,
  "jsd_0.3": functools.partial(losses.jsd, beta=0.3),
  "jsd_0": functools.partial(losses.jsd, beta=0.0),
  "jsd_1": functools.partial(losses.jsd, beta=1.0),
}


# A filtered (top-k/top-p) student has no forward KL: it is infinite, and refused
# (train_step.check_rollout_loss), so those pairs are not cases.
_CASES = [
  (name, filtered)
  for name in sorted(LOSSES)
  for filtered in (False, True)
  if not (filtered and name in ("forward", "jsd_0"))
]


@pytest.mark.parametrize("name, filtered", _CASES)
def test_k_equal_to_v_gives_the_full_loss_and_gradient(name, filtered):
  v = 7
  student, teacher_bcv, mask = _random_case(v, filtered=filtered)
  loss_fn = LOSSES[name]
  teacher = teacher_topk.from_logits(teacher_bcv, v)
  assert np.all(np.asarray(teacher.tail_bc) == -np.inf)  # nothing left for the tail

  def full(s):
    return loss_fn(s, teacher_bcv, mask)[0]

  def sparse(s):
    return loss_fn(s, teacher, mask)[0]

  np.testing.assert_allclose(float(sparse(student)), float(full(student)), rtol=1e-6, atol=1e-7)
  g_sparse, g_full = jax.grad(sparse)(student), jax.grad(full)(student)
  assert np.all(np.isfinite(g_sparse))  # an empty tail bucket has a NaN-free gradient
  np.testing.assert_allclose(g_sparse, g_full, rtol=1e-5, atol=1e-7)


def test_k_equal_to_v_gives_the_full_sampled_loss():
  v = 7
  student, teacher_bcv, mask = _random_case(v)
  tokens = jnp.array([[0, 3, 6], [2, 2, 5]])
  behaviour = jnp.full((2, 3), -1.5)
  teacher = teacher_topk.from_logits(teacher_bcv, v)
  full, mf = losses.reverse_kl_sampled(student, teacher_bcv, tokens, mask, behaviour)
  sparse, ms = losses.reverse_kl_sampled(student, teacher, tokens, mask, behaviour)
  np.testing.assert_allclose(float(sparse), float(full), rtol=1e-6)
  for key in mf:
    np.testing.assert_allclose(float(ms[key]), float(mf[key]), rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_coarse_grained_losses_grow_with_k_up_to_the_full_loss(name):
  """Data-processing inequality: top-k bins refine as k grows, so each loss is monotone in
  k and bounded by the full-vocabulary loss, reached at k = V."""
  v = 40
  student, teacher_bcv, mask = _random_case(v, seed=3)
  loss_fn = LOSSES[name]
  values = [
    float(loss_fn(student, teacher_topk.from_logits(teacher_bcv, k), mask)[0])
    for k in (1, 4, 16, 39, 40)
  ]
  full = float(loss_fn(student, teacher_bcv, mask)[0])
  assert all(a <= b + 1e-6 for a, b in zip(values, values[1:], strict=False)), values
  assert values[-2] <= full + 1e-6
  np.testing.assert_allclose(values[-1], full, rtol=1e-6)


def test_teacher_temperature_by_hand():
  """τ_T = 2 on logits (0, ln 2, ln 4): π_T ∝ (1, √2, 2)."""
  logits = jnp.log(jnp.array([1.0, 2.0, 4.0]))[None, None, :]
  z = 1 + math.sqrt(2) + 2
  t = teacher_topk.from_logits(logits, 1, temperature=2.0)
  assert t.temperature == 2.0 and int(t.ids_bck[0, 0, 0]) == 2
  np.testing.assert_allclose(float(t.logprobs_bck[0, 0, 0]), math.log(2 / z), rtol=1e-6)
  np.testing.assert_allclose(float(t.tail_bc[0, 0]), math.log((1 + math.sqrt(2)) / z), rtol=1e-6)
  scaled = teacher_topk.scale_logits(logits, 2.0)
  np.testing.assert_allclose(
    np.exp(jax.nn.log_softmax(scaled[0, 0])), np.array([1, math.sqrt(2), 2]) / z, rtol=1e-6
  )
  np.testing.assert_array_equal(teacher_topk.scale_logits(logits, 1.0), logits)


# ---------------------------------------------------------------------------------------------
# The train step and the rollout engine on a real tiny model.

TOK = tokenizer.CharTokenizer()
TASK = task.TaskConfig(num_operands=2, max_operand=99)
CFG = tiny_char_cfg()
SAMPLER = sampler.SamplerConfig(max_new_tokens=5, stop_tokens=(TOK.eos_id,))


@pytest.fixture(scope="module")
def tiny_run():
  """(student params, teacher params, mesh, engine factory) on the char vocabulary."""
  student = model.init_params(jax.random.key(1), CFG, jnp.float32, scale=0.3)
  teacher = model.init_params(jax.random.key(2), CFG, jnp.float32, scale=0.6)
  mesh = sharding.make_mesh((1, 1, 1))

  def make_engine(**kwargs):
    source = task.TaskSource("train", 1000, 0, TASK)
    return RolloutWorker(
      iter(data.prompt_batches(source, 4, 0)),
      TOK,
      TASK.max_prompt_tokens,
      transform.EngineConfig(),
      SAMPLER,
      CFG,
      jax.random.key(7),
      mesh,
      teacher=(teacher, CFG),
      **kwargs,
    )

  return student, teacher, mesh, make_engine


def _sample(make_engine, student, **kwargs):
  eng = make_engine(**kwargs)
  rollout, _ = eng.sample(eng.transform(student, 0), eng.draw_prompts(), 0, 0)
  return rollout


@functools.partial(jax.jit, static_argnames="loss_cfg")
def _loss_and_grad(student, teacher, rollout, loss_cfg):
  fn = jax.value_and_grad(train_step.opd_loss, has_aux=True)
  (loss, metrics), grads = fn(student, teacher, rollout, CFG, CFG, loss_cfg)
  return loss, metrics, jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl_sampled"])
def test_engine_scored_sparse_teacher_matches_the_step_scored_one(tiny_run, loss):
  """The engine carries [B, C, k] instead of [B, C, V], at τ_T; the step reads it and gets
  the loss and gradient it computes from the teacher's own forward pass."""
  student, teacher, _, make_engine = tiny_run
  k, tau = 4, 0.7
  rollout = _sample(make_engine, student, teacher_top_k=k, teacher_temperature=tau)
  assert rollout.teacher_logits is None
  got = rollout.teacher_topk
  b, c = rollout.completion_tokens.shape
  assert got.ids_bck.shape == (b, c, k) and got.tail_bc.shape == (b, c) and got.temperature == tau
  cfg = train_step.LossConfig(loss, teacher_top_k=k, teacher_temperature=tau)
  loss_e, metrics_e, grad_e = _loss_and_grad(student, teacher, rollout, cfg)
  in_step = rollout.replace(teacher_topk=None)
  loss_s, metrics_s, grad_s = _loss_and_grad(student, teacher, in_step, cfg)
  np.testing.assert_allclose(loss_e, loss_s, rtol=1e-5)
  np.testing.assert_allclose(grad_e, grad_s, rtol=1e-4, atol=1e-7)
  for key in ("teacher/top_k_mass", "teacher/reverse_kl", "teacher/logprob"):
    np.testing.assert_allclose(float(metrics_e[key]), float(metrics_s[key]), rtol=1e-5)
  # A loss asking for another k, temperature, or the full vocabulary is refused.
  for bad in (
    dict(teacher_top_k=5, teacher_temperature=tau),
    dict(teacher_top_k=k, teacher_temperature=1.0),
    dict(teacher_top_k=0, teacher_temperature=tau),
  ):
    with pytest.raises(ValueError, match="sparse teacher"):
      train_step.opd_loss(student, teacher, rollout, CFG, CFG, train_step.LossConfig(loss, **bad))


def test_teacher_temperature_in_the_train_step(tiny_run):
  """τ_T divides the teacher's logits on every path: the step's own forward pass, and the
  engine's raw logits (`Rollout.teacher_logits`, T = 1)."""
  student, teacher, _, make_engine = tiny_run
  tau = 1.7
  rollout = _sample(make_engine, student)  # the full path: raw teacher logits
  raw_bcv = rollout.teacher_logits
  student_bcv, tokens, mask = teacher_forcing.completion_logits(student, rollout, CFG)
  expected, _ = losses.forward_kl(student_bcv, raw_bcv / tau, mask)
  cfg = train_step.LossConfig("forward_kl", teacher_temperature=tau)
  for r in (rollout, rollout.replace(teacher_logits=None)):
    loss, metrics = train_step.opd_loss(student, teacher, r, CFG, CFG, cfg)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)
    teacher_lp = losses.token_logprobs(raw_bcv / tau, tokens)
    np.testing.assert_allclose(
      float(metrics["teacher/logprob"]), float(losses.masked_mean(teacher_lp, mask)), rtol=1e-5
    )
  # τ_T = 1 is the unchanged full path.
  base, _ = losses.forward_kl(student_bcv, raw_bcv, mask)
  loss, _ = train_step.opd_loss(
    student, teacher, rollout, CFG, CFG, train_step.LossConfig("forward_kl")
  )
  assert float(loss) == float(base)


def test_bad_values_are_refused_naming_the_key(tiny_run):
  student, teacher, _, make_engine = tiny_run
  for k in (-1, 1.5, True):
    with pytest.raises(ValueError, match="train.teacher_top_k"):
      train_step.LossConfig("forward_kl", teacher_top_k=k)
  for tau in (0.0, -1.0, float("inf")):
    with pytest.raises(ValueError, match="teacher.temperature"):
      train_step.LossConfig("forward_kl", teacher_temperature=tau)
    with pytest.raises(ValueError, match="teacher.temperature"):
      make_engine(teacher_temperature=tau)
  with pytest.raises(ValueError, match="train.teacher_top_k"):
    make_engine(teacher_top_k=-2)
  with pytest.raises(ValueError, match="train.teacher_top_k=6 exceeds the vocabulary V=5"):
    teacher_topk.from_logits(jnp.zeros((1, 1, 5)), 6)
  # k > V met by the step (V = the char vocabulary) before any update.
  rollout = _sample(make_engine, student)
  cfg = train_step.LossConfig("reverse_kl_full", teacher_top_k=CFG.vocab_size + 1)
  with pytest.raises(ValueError, match="train.teacher_top_k"):
    train_step.opd_loss(student, teacher, rollout, CFG, CFG, cfg)
  # The run config: both keys checked by config_check.validate.
  spec = importlib.util.spec_from_file_location("base", ROOT / "configs" / "base.py")
  base = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(base)
  c = base.get_config()
  config_check.validate(c)  # the defaults (k = 0, τ_T = 1) pass
  c.train.teacher_top_k, c.teacher.temperature = -1, 0.0
  with pytest.raises(ValueError) as err:
    config_check.validate(c)
  assert "config.train.teacher_top_k must be >= 0" in str(err.value)
  assert "config.teacher.temperature must be > 0" in str(err.value)


# ---------------------------------------------------------------------------------------------
# A 32k vocabulary: how far the sparse losses are from the full ones.

V_32K = 32768
CFG_32K = ModelConfig(
  model_type="qwen3",
  vocab_size=V_32K,
  hidden_size=32,
  intermediate_size=64,
  num_layers=1,
  num_heads=2,
  num_kv_heads=1,
  head_dim=16,
  qk_norm=True,
  tie_word_embeddings=True,
)


@pytest.mark.slow
def test_sparse_versus_full_on_a_32k_vocabulary():
  """A random teacher with a peaked next-token distribution (init scale 0.8: its top-64
  tokens hold ~90% of its mass) and a student near it (the teacher's weights plus 5% noise,
  as late in distillation). For k = 64 and 256 the sparse losses' values and gradients
  (w.r.t. every student parameter) are compared with the full-vocabulary ones."""
  teacher = model.init_params(jax.random.key(0), CFG_32K, jnp.float32, scale=0.8)
  noise = model.init_params(jax.random.key(1), CFG_32K, jnp.float32, scale=0.8)
  student = jax.tree.map(lambda t, n: t + 0.05 * n, teacher, noise)
  rng = np.random.default_rng(0)
  b, p, c = 2, 4, 8
  rollout = Rollout(
    prompt_tokens=jnp.asarray(rng.integers(0, V_32K, (b, p)), jnp.int32),
    prompt_lens=jnp.array([p, p - 1], jnp.int32),
    completion_tokens=jnp.asarray(rng.integers(0, V_32K, (b, c)), jnp.int32),
    completion_mask=jnp.ones((b, c), jnp.int32).at[1, -2:].set(0),
    behaviour_logprobs=jnp.zeros((b, c)),
    model_logprobs=jnp.zeros((b, c)),
    weight_version=jnp.zeros((), jnp.int32),
  )
  teacher_bcv, _, mask = teacher_forcing.completion_logits(teacher, rollout, CFG_32K)
  ks = (64, 256)
  sparse = [teacher_topk.from_logits(teacher_bcv, k) for k in ks]
  names = ("forward", "reverse", "jsd_0.3")

  def all_losses(params, rollout, teacher_bcv, sparse):
    student_bcv, _, mask = teacher_forcing.completion_logits(params, rollout, CFG_32K)
    out = []
    for name in names:
      out.append(LOSSES[name](student_bcv, teacher_bcv, mask)[0])
      out += [LOSSES[name](student_bcv, t, mask)[0] for t in sparse]
    return jnp.stack(out)

  args = (student, rollout, teacher_bcv, sparse)
  values = np.asarray(jax.jit(all_losses)(*args))
  jac = jax.jit(jax.jacrev(all_losses))(*args)
  grads = np.concatenate([np.asarray(g).reshape(len(values), -1) for g in jax.tree.leaves(jac)], 1)
  mass = [float(losses.masked_mean(t.top_mass(), mask)) for t in sparse]
  assert 0.8 < mass[0] < mass[1] < 1.0, mass

  def cosine(a, b):
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

  # (value ratio sparse/full, gradient cosine) lower bounds per k, for every loss. Measured:
  # k = 64: forward 0.875 / 0.9977, reverse 0.857 / 0.9896, jsd 0.877 / 0.9968;
  # k = 256: forward 0.956 / 0.9997, reverse 0.950 / 0.9989, jsd 0.957 / 0.9996.
  floors = {64: (0.8, 0.98), 256: (0.9, 0.995)}
  for i, name in enumerate(names):
    full, full_grad = values[3 * i], grads[3 * i]
    previous = 0.0
    for j, k in enumerate(ks, start=1):
      ratio = values[3 * i + j] / full
      cos = cosine(grads[3 * i + j], full_grad)
      print(f"{name} k={k}: sparse/full {ratio:.3f}, gradient cosine {cos:.4f}")
      ratio_floor, cos_floor = floors[k]
      assert previous <= ratio <= 1.0 + 1e-6, (name, k, ratio)  # DPI, monotone in k
      assert ratio >= ratio_floor and cos >= cos_floor, (name, k, ratio, cos)
      previous = ratio


@pytest.mark.parametrize("shift", [0.0, -100.0, -500.0])
def test_an_empty_tail_is_shift_invariant_far_below_zero(shift):
  """Every logit outside the top-k at −inf: the top-k log-probs are the softmax of the kept
  logits wherever they sit (log-prob-like engine logits are ≤ 0; a small τ_T scales them)."""
  z = jnp.asarray([[[0.0 + shift, -1.0 + shift, -jnp.inf, -jnp.inf]]])
  teacher = teacher_topk.from_logits(z, 2)
  expected = np.log(np.exp([0.0, -1.0]) / np.exp([0.0, -1.0]).sum())
  np.testing.assert_allclose(
    np.asarray(teacher.logprobs_bck[0, 0]), expected, atol=1e-4
  )  # f32 at |z| = 500
  assert float(teacher.tail_bc[0, 0]) == -np.inf
  scaled = teacher_topk.from_logits(jnp.asarray([[[-0.9, -0.91, -jnp.inf]]]), 2, temperature=0.01)
  assert np.all(np.isfinite(np.asarray(scaled.logprobs_bck)))
