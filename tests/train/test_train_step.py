"""The jitted OPD train step: no retrace, frozen teacher, and exact fixed points."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import student_teacher_rollout, tiny_step_cfg

from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import sampler, teacher_forcing, transform
from opd_jax.model import sharding
from opd_jax.train import evaluate, losses, train_step
from opd_jax.train import state as train_state

CFG = tiny_step_cfg()
PROMPTS = [[1, 5, 7], [1, 9], [1, 4, 4, 4], [1, 3]]


@pytest.fixture(scope="module")
def setup():
  scfg = sampler.SamplerConfig(max_new_tokens=6, temperature=1.0)
  student, teacher, rollout = student_teacher_rollout(CFG, PROMPTS, scfg)
  tx = train_state.make_optimizer(1e-2, 10, 0, 0.0, 1.0)
  mesh = sharding.make_mesh((1, 1, 1))
  return student, teacher, rollout, tx, mesh


def _jitted(tx, mesh, state, loss="reverse_kl_sampled"):
  shardings = sharding.tree_shardings(jax.eval_shape(lambda: state), mesh)
  return train_state.jit_step(
    train_step.train_step,
    shardings,
    tx=tx,
    student_cfg=CFG,
    teacher_cfg=CFG,
    loss_cfg=train_step.LossConfig(name=loss),
  )


def test_no_retrace_after_first_step(setup):
  student, teacher, rollout, tx, mesh = setup
  traced = chex.assert_max_traces(n=1)(train_step.train_step)
  step = jax.jit(
    lambda s, t, r: traced(
      s, t, r, tx=tx, student_cfg=CFG, teacher_cfg=CFG, loss_cfg=train_step.LossConfig()
    ),
    donate_argnums=0,
  )
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  for _ in range(3):
    state, metrics = step(state, teacher, rollout)
  assert int(state.step) == 3
  assert np.isfinite(float(metrics["loss/total"]))


def test_teacher_is_not_optimizer_state(setup):
  student, teacher, rollout, tx, mesh = setup
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  opt_leaves = jax.tree.leaves(state.opt_state)
  n_student = len(jax.tree.leaves(student))
  # adamw keeps mu and nu shaped like the student only (plus scalar counts).
  assert sum(x.ndim > 0 for x in opt_leaves) == 2 * n_student
  teacher_before = jax.tree.map(np.asarray, teacher)
  state, _ = _jitted(tx, mesh, state)(state, teacher, rollout)
  for a, b in zip(jax.tree.leaves(teacher_before), jax.tree.leaves(teacher), strict=True):
    np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("loss", ["reverse_kl_sampled", "reverse_kl_full", "forward_kl", "jsd"])
def test_student_equal_to_teacher_is_a_fixed_point(setup, loss):
  """When π_θ = π_T every loss has zero gradient (up to f32 rounding of two forwards)."""
  student, teacher, rollout, tx, mesh = setup
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  state, metrics = _jitted(tx, mesh, state, loss)(state, student, rollout)
  assert float(metrics["perf/grad_norm"]) < 1e-5
  assert float(metrics["teacher/reverse_kl"]) < 1e-6
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  _, metrics = _jitted(tx, mesh, state, loss)(state, teacher, rollout)
  assert float(metrics["perf/grad_norm"]) > 1e-2  # a different teacher does pull


def test_steps_reduce_kl_to_teacher_on_fixed_rollout(setup):
  student, teacher, rollout, tx, mesh = setup
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  step = _jitted(tx, mesh, state, "reverse_kl_full")
  kls = []
  for _ in range(5):
    state, metrics = step(state, teacher, rollout)
    kls.append(float(metrics["teacher/reverse_kl"]))
  assert kls[-1] < 0.7 * kls[0], kls


def test_completion_logits_align_with_sampler_logprobs(setup):
  """Teacher-forced logits at logit_index reproduce the sampler's model log-probs."""
  student, _, rollout, _, _ = setup
  logits_bcv, tokens_bc, mask_bc = teacher_forcing.completion_logits(student, rollout, CFG)
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits_bcv), tokens_bc[..., None], -1)[..., 0]
  np.testing.assert_allclose(
    np.asarray(lp * mask_bc), np.asarray(rollout.model_logprobs * mask_bc), atol=1e-5
  )


_opd_loss = jax.jit(train_step.opd_loss, static_argnums=(3, 4, 5))

# (temperature, top_k, top_p, return_topk): unfiltered at T = 1 and 0.7, top-k, top-p
# alone, both, and a top-k behaviour distribution with its tail bucket.
EXACT_SETTINGS = [
  (1.0, 0, 1.0, -1),
  (0.7, 0, 1.0, -1),
  (1.0, 5, 1.0, -1),
  (0.9, 0, 0.8, -1),
  (0.8, 6, 0.7, 4),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "return_topk"), EXACT_SETTINGS)
def test_exact_engine_reads_zero_mismatch_and_unit_ratio(
  setup, temperature, top_k, top_p, return_topk
):
  """The trainer's own weights in the engine: π_b = π_θ under every sampling setting."""
  student, teacher, _, _, _ = setup
  scfg = sampler.SamplerConfig(8, temperature, top_k=top_k, top_p=top_p, return_topk=return_topk)
  rollout = sampler.sample(student, PROMPTS, jax.random.key(3), scfg, CFG)
  loss_cfg = train_step.LossConfig(temperature=temperature)  # reverse_kl_sampled, is_clip 2
  train_step.check_rollout_loss(scfg, loss_cfg)
  _, m = _opd_loss(student, teacher, rollout, CFG, CFG, loss_cfg)
  assert abs(float(m["mismatch/kl"])) < 1e-6, float(m["mismatch/kl"])
  assert abs(float(m["mismatch/kl_max"])) < 1e-5
  np.testing.assert_allclose(float(m["loss/is_ratio"]), 1.0, atol=1e-5)
  assert float(m["loss/is_clip_frac"]) == 0.0
  assert float(m["mismatch/abs_logp_diff_max"]) < 1e-4
  assert abs(float(m["mismatch/k1"])) < 1e-5 and abs(float(m["mismatch/k3"])) < 1e-6
  if top_k or top_p < 1:
    # Scored unfiltered, the same exact engine would look off-policy.
    _, unfiltered = _opd_loss(
      student, teacher, rollout.replace(support_ids=None), CFG, CFG, loss_cfg
    )
    assert float(unfiltered["loss/is_ratio"]) < 0.98
    assert float(unfiltered["mismatch/kl"]) > 1e-2


def test_a_perturbed_engine_reads_nonzero_mismatch(setup):
  student, teacher, _, _, _ = setup
  scfg = sampler.SamplerConfig(8, 1.0, top_k=5, return_topk=-1)
  noisy = transform.add_weight_noise(student, 0.05, jax.random.key(7))
  rollout = sampler.sample(noisy, PROMPTS, jax.random.key(3), scfg, CFG)
  _, m = _opd_loss(student, teacher, rollout, CFG, CFG, train_step.LossConfig())
  assert 1e-4 < float(m["mismatch/kl"]) < 1.0
  assert float(m["mismatch/kl_p95"]) <= float(m["mismatch/kl_max"])
  assert np.isfinite(float(m["mismatch/k3"])) and float(m["mismatch/abs_logp_diff"]) > 0


@pytest.mark.parametrize("loss", ["reverse_kl_sampled", "reverse_kl_full", "jsd"])
def test_filtered_rollouts_train_with_finite_gradients(setup, loss):
  """-inf outside the kept set reaches no gradient; padding positions stay unfiltered."""
  student, teacher, _, tx, mesh = setup
  scfg = sampler.SamplerConfig(8, 0.9, top_k=4, top_p=0.9, return_topk=-1)
  free = sampler.sample(student, PROMPTS, jax.random.key(4), scfg, CFG)
  scfg = dataclasses.replace(scfg, stop_tokens=(int(free.completion_tokens[0, 2]),))
  rollout = sampler.sample(student, PROMPTS, jax.random.key(4), scfg, CFG)
  assert int(np.asarray(rollout.completion_mask).sum()) < rollout.completion_mask.size
  loss_cfg = train_step.LossConfig(name=loss, temperature=0.9)
  train_step.check_rollout_loss(scfg, loss_cfg)
  grads, m = jax.grad(_opd_loss, has_aux=True)(student, teacher, rollout, CFG, CFG, loss_cfg)
  norm = float(optax.tree.norm(grads))
  assert np.isfinite(norm) and norm > 1e-3
  assert all(np.isfinite(float(v)) for k, v in m.items() if not k.startswith("per_token/"))


def test_greedy_rollouts_train_at_t1_and_refuse_an_importance_ratio(setup):
  student, teacher, _, _, _ = setup
  scfg = sampler.SamplerConfig(8, 0.0, return_topk=-1)
  with pytest.raises(ValueError, match="greedy rollouts .* cannot carry an importance ratio"):
    train_step.check_rollout_loss(scfg, train_step.LossConfig(temperature=0.0))
  loss_cfg = train_step.LossConfig(name="reverse_kl_full", temperature=0.0)
  train_step.check_rollout_loss(scfg, loss_cfg)
  train_step.check_rollout_loss(scfg, train_step.LossConfig(is_clip=None, temperature=0.0))
  rollout = sampler.sample(student, PROMPTS, jax.random.key(3), scfg, CFG)
  grads, m = jax.grad(_opd_loss, has_aux=True)(student, teacher, rollout, CFG, CFG, loss_cfg)
  assert float(optax.tree.norm(grads)) > 1e-3  # a point mass would give no gradient
  # The replayed transform is the point mass on y: the scale reads 0 by construction.
  assert float(m["mismatch/kl"]) == 0.0 and float(m["mismatch/abs_logp_diff_max"]) == 0.0


def test_check_rollout_loss_refuses_what_the_filter_cannot_serve():
  top_k = sampler.SamplerConfig(8, 1.0, top_k=5)
  with pytest.raises(ValueError, match="forward KL to the teacher.* is infinite"):
    train_step.check_rollout_loss(top_k, train_step.LossConfig(name="forward_kl"))
  with pytest.raises(ValueError, match="'jsd'"):
    train_step.check_rollout_loss(top_k, train_step.LossConfig(name="jsd", jsd_beta=0.0))
  train_step.check_rollout_loss(top_k, train_step.LossConfig(name="jsd", jsd_beta=0.5))
  unfiltered = sampler.SamplerConfig(8, 1.0)
  train_step.check_rollout_loss(unfiltered, train_step.LossConfig(name="forward_kl"))
  with pytest.raises(ValueError, match=r"LossConfig.temperature=1.0 differs .* temperature=0.7"):
    train_step.check_rollout_loss(sampler.SamplerConfig(8, 0.7), train_step.LossConfig())


def test_loss_registry_refuses_an_unknown_name_naming_the_allowed_ones():
  allowed = "reverse_kl_sampled, reverse_kl_full, forward_kl, jsd"
  with pytest.raises(ValueError, match=f"unknown distillation loss 'kl'; allowed: {allowed}"):
    train_step.teacher_loss("kl")
  with pytest.raises(ValueError, match=f"unknown loss 'kl'; allowed: {allowed}, reinforce, grpo"):
    train_step.LossConfig(name="kl")
  # Every registered loss has the registry's one signature: (student, teacher, rollout, cfg).
  student = jnp.zeros((1, 2, 3))
  rollout = Rollout(
    prompt_tokens=jnp.zeros((1, 1), jnp.int32),
    prompt_lens=jnp.ones((1,), jnp.int32),
    completion_tokens=jnp.zeros((1, 2), jnp.int32),
    completion_mask=jnp.ones((1, 2), jnp.int32),
    behaviour_logprobs=jnp.full((1, 2), -np.log(3.0)),
    model_logprobs=jnp.zeros((1, 2)),
    weight_version=jnp.zeros((), jnp.int32),
  )
  for name in train_step.TEACHER_LOSSES:
    loss, _ = train_step.teacher_loss(name)(
      student, losses.FullTeacher(student), rollout, train_step.LossConfig(name=name)
    )
    assert abs(float(loss)) < 1e-6, name  # π_θ = π_T: every divergence is 0


def test_quality_kl_at_the_rollout_transform(setup):
  """evaluate.student_teacher_kl with the training sampler's T and top-k, against numpy."""
  student, teacher, rollout, _, _ = setup
  scfg = sampler.SamplerConfig(8, 0.7, top_k=5)
  got = evaluate.student_teacher_kl(student, CFG, teacher, CFG, rollout, scfg)
  at_t1 = evaluate.student_teacher_kl(student, CFG, teacher, CFG, rollout)
  s_bcv = np.asarray(teacher_forcing.completion_logits(student, rollout, CFG)[0], np.float64) / 0.7
  t_bcv = np.asarray(teacher_forcing.completion_logits(teacher, rollout, CFG)[0], np.float64)
  kth = np.sort(s_bcv, axis=-1)[..., -5:-4]
  s_lp = _np_log_softmax(np.where(s_bcv >= kth, s_bcv, -np.inf))
  t_lp = _np_log_softmax(t_bcv)
  with np.errstate(invalid="ignore"):
    kl = np.where(np.isfinite(s_lp), np.exp(s_lp) * (s_lp - t_lp), 0.0).sum(-1)
  mask = np.asarray(rollout.completion_mask) > 0
  np.testing.assert_allclose(got, kl[mask].mean(), rtol=1e-4)
  assert abs(got - at_t1) > 1e-3
  same = evaluate.student_teacher_kl(student, CFG, teacher, CFG, rollout, SAMPLED_T1)
  np.testing.assert_allclose(same, at_t1, rtol=1e-5)

  # The teacher at teacher.temperature τ_T = 2, as the loss scores it: π_T = softmax(z_T / 2).
  hot = evaluate.student_teacher_kl(student, CFG, teacher, CFG, rollout, scfg, 2.0)
  t2_lp = _np_log_softmax(t_bcv / 2.0)
  with np.errstate(invalid="ignore"):
    kl2 = np.where(np.isfinite(s_lp), np.exp(s_lp) * (s_lp - t2_lp), 0.0).sum(-1)
  np.testing.assert_allclose(hot, kl2[mask].mean(), rtol=1e-4)
  assert abs(hot - got) > 1e-3
  # Without the rollout transform both stay at T = 1: τ_T is the loss's, not the model's.
  plain = evaluate.student_teacher_kl(student, CFG, teacher, CFG, rollout, None, 2.0)
  np.testing.assert_allclose(plain, at_t1, rtol=1e-6)


SAMPLED_T1 = sampler.SamplerConfig(8, 1.0)


def _np_log_softmax(x):
  m = np.max(x, axis=-1, keepdims=True)
  return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))
