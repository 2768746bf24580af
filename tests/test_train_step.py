"""The jitted OPD train step: no retrace, frozen teacher, and exact fixed points."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax import model, sampler, sharding, train_step
from opd_jax.model_config import ModelConfig

CFG = ModelConfig("qwen3", 24, 32, 64, 1, 4, 2, 8, qk_norm=True, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def setup():
  student = model.init_params(jax.random.key(0), CFG, scale=0.3)
  teacher = model.init_params(jax.random.key(1), CFG, scale=0.3)
  prompts = [[1, 5, 7], [1, 9], [1, 4, 4, 4], [1, 3]]
  scfg = sampler.SamplerConfig(max_new_tokens=6, temperature=1.0)
  rollout = sampler.sample(student, prompts, jax.random.key(2), scfg, CFG)
  tx = train_step.make_optimizer(1e-2, 10, 0, 0.0, 1.0)
  mesh = sharding.make_mesh((1, 1, 1))
  return student, teacher, rollout, tx, mesh


def _jitted(tx, mesh, state, loss="reverse_kl_sampled"):
  shardings = sharding.tree_shardings(jax.eval_shape(lambda: state), mesh)
  return train_step.jit_step(
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
  state = train_step.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  for _ in range(3):
    state, metrics = step(state, teacher, rollout)
  assert int(state.step) == 3
  assert np.isfinite(float(metrics["loss/total"]))


def test_teacher_is_not_optimizer_state(setup):
  student, teacher, rollout, tx, mesh = setup
  state = train_step.init_state(jax.tree.map(jnp.copy, student), tx, 0)
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
  state = train_step.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  state, metrics = _jitted(tx, mesh, state, loss)(state, student, rollout)
  assert float(metrics["perf/grad_norm"]) < 1e-5
  assert float(metrics["teacher/reverse_kl"]) < 1e-6
  state = train_step.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  _, metrics = _jitted(tx, mesh, state, loss)(state, teacher, rollout)
  assert float(metrics["perf/grad_norm"]) > 1e-2  # a different teacher does pull


def test_steps_reduce_kl_to_teacher_on_fixed_rollout(setup):
  student, teacher, rollout, tx, mesh = setup
  state = train_step.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  step = _jitted(tx, mesh, state, "reverse_kl_full")
  kls = []
  for _ in range(5):
    state, metrics = step(state, teacher, rollout)
    kls.append(float(metrics["teacher/reverse_kl"]))
  assert kls[-1] < 0.7 * kls[0], kls


def test_completion_logits_align_with_sampler_logprobs(setup):
  """Teacher-forced logits at logit_index reproduce the sampler's model log-probs."""
  student, _, rollout, _, _ = setup
  logits_bcv, tokens_bc, mask_bc = train_step.completion_logits(student, rollout, CFG)
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits_bcv), tokens_bc[..., None], -1)[..., 0]
  np.testing.assert_allclose(
    np.asarray(lp * mask_bc), np.asarray(rollout.model_logprobs * mask_bc), atol=1e-5
  )
