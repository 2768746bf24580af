"""GRPO (opd_jax/train/rl.py, rl_step.grpo_updates) against hand-computed values."""

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_step_cfg

from opd_jax.config import check as config_check
from opd_jax.data import rewards
from opd_jax.inference import sampler, teacher_forcing
from opd_jax.model import transformer as model
from opd_jax.train import losses, rl, rl_step, train_step
from opd_jax.train import state as train_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import base  # noqa: E402
import grpo_sync  # noqa: E402

CFG = tiny_step_cfg()
LOG3 = math.log(3.0)
CORRECTIONS = ("none", "tis", "mis", "seq_tis", "seq_mis")


def test_group_baseline_and_std_normalisation_hand_computed():
  reward_b = jnp.asarray([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
  # Group 1: mean 1/4; group 2: all equal, so its advantages are 0.
  centred = [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]
  np.testing.assert_allclose(rl.group_advantages(reward_b, 4, False), centred, atol=1e-7)
  # Sample std of (1, 0, 0, 0): sqrt((0.75² + 3·0.25²) / 3) = 0.5.
  scaled = np.asarray(centred) / np.asarray([0.5 + 1e-6] * 4 + [1e-6] * 4)
  np.testing.assert_allclose(rl.group_advantages(reward_b, 4, True), scaled, rtol=1e-6)
  # G = 2: (1, 0) -> ±0.5, sample std 1/√2.
  np.testing.assert_allclose(
    rl.group_advantages(reward_b[:2], 2, True), [0.5 / (2**-0.5 + 1e-6), -0.5 / (2**-0.5 + 1e-6)]
  )
  with pytest.raises(ValueError, match="divide the batch"):
    rl.group_advantages(reward_b, 3, True)
  with pytest.raises(ValueError, match=">= 2"):
    rl.group_advantages(reward_b, 1, True)


@pytest.mark.parametrize("value, group", [(1 / 3, 8), (0.8, 3), (0.8, 6), (2 / 3, 5)])
def test_a_flat_group_of_inexact_rewards_gets_no_advantage(value, group):
  """Partial credits such as 1/3 are not exact in f32: the group mean can miss them by one ulp,
  which std + 1e-6 would turn into an advantage of a few hundredths for every row alike."""
  reward_b = jnp.full((2 * group,), value, jnp.float32).at[group].set(0.0)  # group 2 not flat
  advantage_b = np.asarray(rl.group_advantages(reward_b, group, True))
  np.testing.assert_array_equal(advantage_b[:group], 0.0)
  assert np.all(advantage_b[group + 1 :] > 0) and advantage_b[group] < 0


def _ratios():
  """Three rows of π_old/π_b ratios, the last token of rows 1 and 2 padding.

  Row 0: (3, 0.25, 1.5), product 1.125; row 1: (0.9, 1.1), product 0.99; row 2: (3, 1),
  product 3.
  """
  ratio = np.asarray([[3.0, 0.25, 1.5], [0.9, 1.1, 7.0], [3.0, 1.0, 7.0]])
  mask = jnp.asarray([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
  old = jnp.full((3, 3), -LOG3)
  behaviour = old - jnp.log(jnp.asarray(ratio))
  return old, behaviour, mask


def test_mismatch_weights_token_and_sequence_hand_computed():
  old, behaviour, mask = _ratios()
  m = np.asarray(mask, np.float32)
  want = {  # (w, keep) with C = 2 and the band [1/2, 2]
    "none": (m, m),
    "tis": ([[2, 0.25, 1.5], [0.9, 1.1, 0], [2, 1, 0]], m),
    "mis": (m, [[0, 0, 1], [1, 1, 0], [0, 1, 0]]),
    "seq_tis": ([[1.125] * 3, [0.99, 0.99, 0], [2, 2, 0]], m),
    "seq_mis": (m, [[1, 1, 1], [1, 1, 0], [0, 0, 0]]),
  }
  for correction, (w, keep) in want.items():
    got_w, got_keep = rl.mismatch_weights(old, behaviour, mask, correction, 2.0)
    np.testing.assert_allclose(got_w, w, rtol=1e-5, err_msg=correction)
    np.testing.assert_array_equal(got_keep, keep, err_msg=correction)
  with pytest.raises(ValueError, match="mismatch_correction must be one of"):
    rl.mismatch_weights(old, behaviour, mask, "is", 2.0)
  with pytest.raises(ValueError, match="mismatch_clip C must be > 1"):
    rl.mismatch_weights(old, behaviour, mask, "tis", 1.0)


def test_identical_engine_gives_unit_weights_and_masks_nothing():
  old = jax.random.normal(jax.random.key(0), (4, 5)) - 2.0
  mask = jnp.asarray([[1, 1, 1, 1, 0]] * 4)
  for correction in CORRECTIONS:
    w, keep = rl.mismatch_weights(old, old, mask, correction, 2.0)
    np.testing.assert_array_equal(w, mask, err_msg=correction)
    np.testing.assert_array_equal(keep, mask, err_msg=correction)


def test_ppo_clipped_objective_and_gradient_hand_computed():
  """Four tokens, ε = 0.2: r = (1.5, 0.5, 1.1, 0.7), A = (+1, +1, −1, −1).

  min(rA, clip(r)A) = (1.2 clipped, 0.5, −1.1, −0.8 clipped); loss = −(−0.2)/4 = 0.05.
  ∂loss/∂log π_θ = −rA/4 on the unclipped tokens, 0 on the clipped: (0, −0.125, 0.275, 0).
  """
  ratio = jnp.asarray([[1.5], [0.5], [1.1], [0.7]])
  old = jnp.full((4, 1), -1.0)
  advantage = jnp.asarray([1.0, 1.0, -1.0, -1.0])
  ones = jnp.ones((4, 1))

  def loss_fn(lp, weight):
    loss, _, active = rl.ppo_clip_loss(lp, old, advantage, weight, ones, 0.2)
    return loss, active

  lp = old + jnp.log(ratio)
  (loss, active), grad = jax.value_and_grad(loss_fn, has_aux=True)(lp, ones)
  np.testing.assert_allclose(loss, 0.05, rtol=1e-5)
  np.testing.assert_allclose(grad[:, 0], [0.0, -0.125, 0.275, 0.0], rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(active[:, 0], [1, 0, 0, 1])
  # A correction weight w = (1, 2, 0.5, 1) scales each token's term and gradient.
  weight = jnp.asarray([[1.0], [2.0], [0.5], [1.0]])
  (loss, _), grad = jax.value_and_grad(loss_fn, has_aux=True)(lp, weight)
  np.testing.assert_allclose(loss, -(1.2 + 1.0 - 0.55 - 0.8) / 4, rtol=1e-5)
  np.testing.assert_allclose(grad[:, 0], [0.0, -0.25, 0.1375, 0.0], rtol=1e-5, atol=1e-7)


def test_single_update_is_the_plain_policy_gradient():
  """K = 1 (π_old = sg(π_θ)): ratio exactly 1, loss −Σ m A / N, gradient −Σ m A ∇log π_θ / N."""
  logits = jax.random.normal(jax.random.key(1), (4, 3, 5))
  tokens = jnp.asarray([[0, 1, 2], [3, 4, 0], [1, 1, 1], [2, 0, 4]])
  mask = jnp.asarray([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
  advantage = jnp.asarray([0.5, -0.5, 1.0, -1.0])

  def grpo(z):
    return rl.grpo(z, tokens, mask, advantage, jnp.zeros((4, 3)), clip_eps=0.2)

  def policy_gradient(z):
    lp = losses.token_logprobs(z, tokens)
    return -losses.masked_mean(advantage[:, None] * lp, mask)

  (loss, metrics), grad = jax.value_and_grad(grpo, has_aux=True)(logits)
  n = 9.0
  np.testing.assert_allclose(loss, -(0.5 * 3 - 0.5 * 2 + 1.0 - 1.0 * 3) / n, rtol=1e-6)
  np.testing.assert_allclose(grad, jax.grad(policy_gradient)(logits), atol=1e-7)
  assert float(metrics["rl/ppo_ratio_abs_dev_max"]) == 0.0
  assert float(metrics["rl/ppo_clip_frac"]) == 0.0


def test_masked_tokens_leave_the_denominator():
  """Uniform student over V = 3 (log π = −log 3), ratios of `_ratios` rows 0 and 1, A = (1, −1).

  none: −(3·1 + 2·(−1)) / 5 = −0.2. mis keeps (0, 0, 1) and (1, 1, 0): −(1 − 2) / 3 = 1/3, and
  the gradient on a kept token is −A (onehot − 1/3) / 3, 0 on a dropped one.
  """
  old, behaviour, mask = _ratios()
  behaviour, mask = behaviour[:2], mask[:2]
  logits = jnp.zeros((2, 3, 3))
  tokens = jnp.asarray([[0, 1, 2], [2, 1, 0]])
  advantage = jnp.asarray([1.0, -1.0])

  def fn(z, correction):
    return rl.grpo(z, tokens, mask, advantage, behaviour, correction=correction)

  (loss, _), _ = jax.value_and_grad(fn, has_aux=True)(logits, "none")
  np.testing.assert_allclose(loss, -0.2, rtol=1e-6)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logits, "mis")
  np.testing.assert_allclose(loss, 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(metrics["rl/correction_masked_frac"], 2 / 5, rtol=1e-6)
  keep = np.asarray([[0, 0, 1], [1, 1, 0]], np.float32)
  onehot = np.eye(3)[np.asarray(tokens)]
  want = -(keep * np.asarray(advantage)[:, None])[..., None] * (onehot - 1 / 3) / 3
  np.testing.assert_allclose(grad, want, atol=1e-7)


@pytest.fixture(scope="module")
def batch():
  """A sampled batch of two prompts × G = 2 completions, with rewards (1, 0, 0, 1)."""
  student = model.init_params(jax.random.key(0), CFG, scale=0.3)
  prompts = [[1, 5, 7], [1, 5, 7], [1, 9], [1, 9]]
  scfg = sampler.SamplerConfig(max_new_tokens=6, temperature=1.0)
  rollout = sampler.sample(student, prompts, jax.random.key(2), scfg, CFG)
  return student, rollout.replace(reward_b=jnp.asarray([1.0, 0.0, 0.0, 1.0]))


def _step(student, rollout, tx, loss_cfg, schedule=None):
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  fn = jax.jit(
    lambda s, r: train_step.train_step(
      s, None, r, tx=tx, student_cfg=CFG, teacher_cfg=CFG, loss_cfg=loss_cfg, lr_schedule=schedule
    )
  )
  return fn(state, rollout)


def test_two_updates_match_two_hand_applied_updates(batch):
  """epochs = 2: update 1 at π_old = θ_0 (ratio ≈ 1), update 2 at θ_1 against the same π_old."""
  student, rollout = batch
  tx = optax.sgd(0.5)
  cfg = train_step.LossConfig(name="grpo", group_size=2, ppo_epochs=2, mismatch_correction="tis")
  state, metrics = _step(student, rollout, tx, cfg)
  assert float(metrics["rl/ppo_updates"]) == 2.0 and int(state.step) == 1
  assert float(metrics["rl/ppo_ratio_abs_dev_max"]) > 1e-3  # the second update's ratio ≠ 1

  advantage_b = rl.group_advantages(rollout.reward_b, 2, True)
  z, tokens, mask = teacher_forcing.completion_logits(student, rollout, CFG)
  old_lp = jnp.where(mask > 0, losses.token_logprobs(z, tokens), 0.0)  # π_old = π_θ0

  def loss(p):
    return rl_step.grpo_policy_loss(p, rollout, advantage_b, old_lp, CFG, cfg, "none")[0]

  grad_fn = jax.jit(jax.grad(loss))
  params = student
  for _ in range(2):
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grad_fn(params))
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_minibatches_and_schedule_counts(batch):
  """epochs 2 × minibatches 2 = 4 updates: Adam counts 4, the lr schedule 1 (every update at
  lr(step)), and a fresh step-0 batch with an identical engine masks nothing."""
  student, rollout = batch
  schedule = train_state.make_schedule(1e-2, 10, 3)
  tx = train_state.make_optimizer(1e-2, 10, 3, 0.0, 1.0)
  cfg = train_step.LossConfig(
    name="grpo", group_size=2, ppo_epochs=2, ppo_minibatches=2, mismatch_correction="seq_mis"
  )
  state, metrics = _step(student, rollout, tx, cfg, schedule)
  counts = [int(x) for x in jax.tree.leaves(state.opt_state) if x.ndim == 0]
  assert sorted(counts) == [1, 4]  # the schedule's count and Adam's
  assert float(metrics["rl/ppo_updates"]) == 4.0
  assert float(metrics["rl/correction_masked_frac"]) == 0.0
  np.testing.assert_allclose(metrics["rl/correction_weight_mean"], 1.0)
  assert float(metrics["mismatch/abs_logp_diff"]) < 1e-4  # the engine is the trainer
  assert np.isfinite(float(metrics["loss/total"])) and metrics["per_token/advantage_bc"].shape == (
    rollout.completion_mask.shape
  )


def test_loss_config_and_config_check_name_bad_grpo_settings():
  with pytest.raises(ValueError, match="samples_per_prompt"):
    train_step.LossConfig(name="grpo", group_size=1)
  with pytest.raises(ValueError, match="ppo_clip"):
    train_step.LossConfig(name="grpo", group_size=2, ppo_clip=1.5)
  with pytest.raises(ValueError, match="ppo_epochs"):
    train_step.LossConfig(name="grpo", group_size=2, ppo_epochs=0)
  with pytest.raises(ValueError, match="mismatch_correction must be one of"):
    train_step.LossConfig(name="grpo", group_size=2, mismatch_correction="geo")
  with pytest.raises(ValueError, match="microbatches=2 cannot split loss 'grpo'"):
    train_step.check_microbatches(train_step.LossConfig(name="grpo", group_size=2), 2, 8)
  train_step.LossConfig(name="reverse_kl_full", group_size=1)  # ignored by the other losses

  c = base.get_config("tiny")
  c.train.loss = "grpo"
  c.rollout.samples_per_prompt = 4
  config_check.validate(c)
  c.rollout.samples_per_prompt = 1
  c.train.ppo_minibatches = 3
  c.train.microbatches = 2
  with pytest.raises(ValueError) as e:
    config_check.validate(c)
  for part in (
    "samples_per_prompt must be >= 2",
    "ppo_minibatches=3 must divide",
    "microbatches=2",
  ):
    assert part in str(e.value)
  c = base.get_config("tiny")
  c.train.mismatch_correction = "is"
  c.train.mismatch_clip = 1.0
  c.train.ppo_clip = 0.0
  with pytest.raises(ValueError) as e:
    config_check.validate(c)
  for key in ("mismatch_correction", "mismatch_clip", "ppo_clip"):
    assert f"config.train.{key}" in str(e.value)


def test_partial_credit_reward_hand_computed():
  prompts = ["37+58+21="] * 4 + ["37+8*3="]
  completions = [
    "37+58=95;95+21=116>116",  # all right: 1
    "37+58=95;95+21=117>117",  # first step right: 1/3
    "37+58=96;95+21=116>116",  # second step and answer right: 2/3
    "wrong>116",  # the answer alone: 1/3
    "3:45;2:53;1:60>61",  # two of three chain steps and the answer: 3/4
  ]
  np.testing.assert_allclose(
    rewards.sequence_rewards(prompts, completions, "partial"), [1, 1 / 3, 2 / 3, 1 / 3, 0.75]
  )
  np.testing.assert_array_equal(rewards.sequence_rewards(prompts, completions), [1, 0, 1, 1, 1])
  with pytest.raises(ValueError, match="unknown reward 'f1'"):
    rewards.sequence_rewards(prompts, completions, "f1")
  with pytest.raises(ValueError, match="not a task prompt"):
    rewards.partial_credit("hello", "1")


def test_grpo_sync_config_validates():
  for arg in (None, "tiny"):
    c = grpo_sync.get_config(arg)
    config_check.validate(c)
    assert c.train.loss == "grpo" and c.rollout.samples_per_prompt >= 2


@pytest.mark.slow
def test_grpo_raises_the_training_reward(tmp_path):
  """A short real run: grpo_sync.py:tiny's model on a two-operand task (12+15=), warm-started
  for 400 supervised steps, then 300 GRPO steps of 4 prompts × G = 8 completions, two updates
  per step, at lr 3e-4. The training reward of the last 75 steps is at least 0.05 above that of
  the first 75. (The same prompts and keys with the student frozen, lr 1e-9, read 0.370 and
  0.374 in the two quarters: the prompts alone do not move it by 0.05.)"""
  from opd_jax.io import metrics_writer
  from opd_jax.train import trainer

  c = grpo_sync.get_config("tiny")
  c.data.num_operands, c.data.max_operand = 2, 19
  c.data.batch_size, c.data.eval_size = 4, 64
  c.rollout.samples_per_prompt, c.rollout.max_new_tokens = 8, 16
  c.student.warmup_steps, c.student.warmup_lr = 400, 3e-3
  c.teacher.cache_dir = str(tmp_path / "cache")
  c.train.steps, c.train.lr, c.train.warmup_steps = 300, 3e-4, 0
  c.train.ppo_epochs, c.train.ppo_minibatches = 1, 2
  c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 1, 300, 300
  c.export.dir = "none"
  result = trainer.run(c, str(tmp_path / "run"), log=lambda *a: None)
  rows = metrics_writer.read_jsonl(str(tmp_path / "run"))
  reward = np.asarray(
    [rows[k]["rl/reward_mean"] for k in sorted(rows) if "rl/reward_mean" in rows[k]]
  )
  first, last = reward[:75].mean(), reward[-75:].mean()
  print(
    f"GRPO learning check: training reward first 75 steps {first:.3f}, last 75 {last:.3f}; "
    f"greedy held-out accuracy {result['student_accuracy_before']:.3f} -> "
    f"{result['student_accuracy_after']:.3f}"
  )
  assert len(reward) == 300 and last > first + 0.05
