"""GRPO's KL penalty to the initial student (`train.kl_coef`, opd_jax/train/rl.py) and the RL
reward's kind (`train.reward`, opd_jax/data/rewards.py) from the config to `Rollout.reward_b`."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_char_cfg, tiny_step_cfg

from opd_jax.config import check as config_check
from opd_jax.data import pipeline as data
from opd_jax.data import rewards, task
from opd_jax.inference import sampler, teacher_forcing, transform
from opd_jax.model import sharding, tokenizer
from opd_jax.model import transformer as model
from opd_jax.rollout.worker import RolloutWorker
from opd_jax.train import losses, microbatch, pretrain, rl, rl_step, train_step
from opd_jax.train import state as train_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import base  # noqa: E402
import grpo_sync  # noqa: E402

CFG = tiny_step_cfg()


def _log_softmax(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _tiny_logits():
  """B = 2, T = 2, V = 3: student and reference logits, tokens, the last token of row 1
  masked."""
  student = jnp.asarray([[[0.5, -0.3, 0.1], [1.0, 0.0, -1.0]], [[0.2, 0.2, 0.9], [0.0, 3.0, 0.0]]])
  reference = jnp.asarray(
    [[[0.0, 0.0, 0.0], [0.3, 0.4, -0.2]], [[1.5, -0.5, 0.1], [2.0, 0.0, 0.0]]]
  )
  tokens = jnp.asarray([[0, 2], [1, 1]])
  mask = jnp.asarray([[1, 1], [1, 0]])
  return student, reference, tokens, mask


def _token_lp(logits, tokens):
  return np.take_along_axis(_log_softmax(logits), np.asarray(tokens)[..., None], -1)[..., 0]


def test_k3_against_numpy_and_in_the_grpo_loss():
  """k3 = exp(d) − d − 1 with d = log π_ref − log π_θ, a mean over the 3 counted tokens; the
  GRPO loss gains β times it, logged as loss/kl_ref, the mean itself as rl/kl_ref."""
  student, reference, tokens, mask = _tiny_logits()
  d = _token_lp(reference, tokens) - _token_lp(student, tokens)
  m = np.asarray(mask, np.float64)
  k3_bt = (np.exp(d) - d - 1) * m
  want = k3_bt.sum() / m.sum()
  assert want > 0.05  # the two policies differ at these tokens
  student_lp = jnp.asarray(_token_lp(student, tokens), jnp.float32)
  ref_lp = jnp.asarray(_token_lp(reference, tokens), jnp.float32)
  got, got_bt = rl.k3_kl_to_reference(student_lp, ref_lp, mask)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(got_bt, k3_bt, rtol=1e-5, atol=1e-7)
  assert float(got_bt[1, 1]) == 0.0  # masked

  advantage = jnp.asarray([1.0, -1.0])
  behaviour = jnp.zeros((2, 2))
  plain, _ = rl.grpo(student, tokens, mask, advantage, behaviour)
  beta = 0.3
  loss, metrics = rl.grpo(
    student, tokens, mask, advantage, behaviour, reference_logprobs=ref_lp, kl_coef=beta
  )
  np.testing.assert_allclose(metrics["rl/kl_ref"], want, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss/kl_ref"], beta * want, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss/grpo"], plain, rtol=1e-6)
  np.testing.assert_allclose(loss, plain + beta * want, rtol=1e-5)
  # With β = 0 nothing is added and no KL is logged.
  _, metrics = rl.grpo(student, tokens, mask, advantage, behaviour, reference_logprobs=ref_lp)
  assert "rl/kl_ref" not in metrics and "loss/kl_ref" not in metrics


def test_k3_is_zero_at_the_reference_and_adds_no_gradient():
  student, _, tokens, mask = _tiny_logits()
  lp = losses.token_logprobs(student, tokens)
  advantage = jnp.asarray([1.0, -1.0])

  def fn(z, beta):
    return rl.grpo(
      z, tokens, mask, advantage, jnp.zeros((2, 2)), reference_logprobs=lp, kl_coef=beta
    )

  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(student, 0.5)
  (plain, _), plain_grad = jax.value_and_grad(fn, has_aux=True)(student, 0.0)
  assert float(metrics["rl/kl_ref"]) == 0.0 and float(metrics["loss/kl_ref"]) == 0.0
  np.testing.assert_allclose(loss, plain)
  np.testing.assert_allclose(grad, plain_grad, atol=1e-7)


def test_the_penalty_pulls_toward_the_reference():
  """∂k3/∂log π_θ(y) = 1 − π_ref(y)/π_θ(y): a gradient step on the penalty alone moves each
  counted token's log π_θ(y) toward log π_ref(y), and the mean k3 falls."""
  student, reference, tokens, mask = _tiny_logits()
  ref_lp = losses.token_logprobs(reference, tokens)

  def penalty(z):
    return rl.k3_kl_to_reference(losses.token_logprobs(z, tokens), ref_lp, mask)[0]

  before = float(penalty(student))
  moved = student - 0.05 * jax.grad(penalty)(student)
  assert float(penalty(moved)) < before
  gap = np.asarray(ref_lp - losses.token_logprobs(student, tokens))
  step = np.asarray(losses.token_logprobs(moved, tokens) - losses.token_logprobs(student, tokens))
  counted = np.asarray(mask) > 0
  assert np.all(np.sign(step[counted]) == np.sign(gap[counted]))
  assert np.all(np.abs(step[counted]) < np.abs(gap[counted]))  # toward, not past


def test_kl_coef_is_refused_outside_grpo_and_without_a_reference():
  with pytest.raises(ValueError, match="kl_coef=0.1 is GRPO's KL penalty"):
    train_step.LossConfig(name="reinforce", kl_coef=0.1)
  with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
    train_step.LossConfig(name="grpo", group_size=2, kl_coef=-1.0)
  cfg = train_step.LossConfig(name="grpo", group_size=2, kl_coef=0.1)
  assert (
    cfg.needs_reference and not train_step.LossConfig(name="grpo", group_size=2).needs_reference
  )
  student, _, tokens, mask = _tiny_logits()
  with pytest.raises(ValueError, match="needs log π_ref"):
    rl.grpo(student, tokens, mask, jnp.zeros(2), jnp.zeros((2, 2)), kl_coef=0.1)

  c = base.get_config("tiny")
  c.train.kl_coef = 0.1  # with the default loss, reverse_kl_full
  with pytest.raises(ValueError, match="train.kl_coef=0.1 is GRPO's KL penalty") as e:
    config_check.validate(c)
  assert "train.loss='reverse_kl_full' has none" in str(e.value)
  c.train.kl_coef = -0.1
  with pytest.raises(ValueError, match="config.train.kl_coef must be >= 0"):
    config_check.validate(c)
  c = grpo_sync.get_config("tiny")
  c.train.kl_coef = 0.1
  config_check.validate(c)


@pytest.fixture(scope="module")
def batch():
  """Two prompts × G = 2 sampled completions with rewards (1, 0, 0, 1), the student, and a
  reference that differs from it."""
  student = model.init_params(jax.random.key(0), CFG, scale=0.3)
  reference = model.init_params(jax.random.key(5), CFG, scale=0.3)
  prompts = [[1, 5, 7], [1, 5, 7], [1, 9], [1, 9]]
  scfg = sampler.SamplerConfig(max_new_tokens=6, temperature=1.0)
  rollout = sampler.sample(student, prompts, jax.random.key(2), scfg, CFG)
  return student, reference, rollout.replace(reward_b=jnp.asarray([1.0, 0.0, 0.0, 1.0]))


def _run_step(state, rollout, reference, loss_cfg, tx):
  fn = jax.jit(
    lambda s, r, ref: train_step.train_step(
      s, None, r, ref, tx=tx, student_cfg=CFG, teacher_cfg=CFG, loss_cfg=loss_cfg
    )
  )
  return fn(state, rollout, reference)


def test_train_step_at_the_reference_reads_zero_and_refuses_a_missing_reference(batch):
  """K = 1: π_θ = π_ref gives rl/kl_ref = 0 (up to f32 rounding: log π_ref is scored by a
  forward pass of its own) and the step of β = 0; without reference params the step says what
  it needs."""
  student, _, rollout = batch
  tx = optax.sgd(0.1)
  cfg = train_step.LossConfig(name="grpo", group_size=2, kl_coef=0.5)
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  new, metrics = _run_step(state, rollout, student, cfg, tx)
  assert 0.0 <= float(metrics["rl/kl_ref"]) < 1e-10
  plain_cfg = train_step.LossConfig(name="grpo", group_size=2)
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  plain, _ = _run_step(state, rollout, None, plain_cfg, tx)
  for got, want in zip(jax.tree.leaves(new.params), jax.tree.leaves(plain.params), strict=True):
    np.testing.assert_allclose(got, want, atol=1e-6)
  with pytest.raises(ValueError, match="needs the initial student's params"):
    _run_step(state, rollout, None, cfg, tx)


def test_minibatch_updates_match_hand_applied_updates_with_the_penalty(batch):
  """epochs 1 × minibatches 2 with β = 0.5 against a reference ≠ the student: log π_ref is
  scored once and split like log π_old; each update is SGD on its minibatch's GRPO loss plus
  β · mean k3 over that minibatch."""
  student, reference, rollout = batch
  tx = optax.sgd(0.5)
  cfg = train_step.LossConfig(name="grpo", group_size=2, ppo_minibatches=2, kl_coef=0.5)
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  state, metrics = _run_step(state, rollout, reference, cfg, tx)
  assert float(metrics["rl/kl_ref"]) > 0.0
  np.testing.assert_allclose(metrics["loss/kl_ref"], 0.5 * metrics["rl/kl_ref"], rtol=1e-6)

  advantage_b = rl.group_advantages(rollout.reward_b, 2, True)
  z, tokens, mask = teacher_forcing.completion_logits(student, rollout, CFG)
  old_lp = jnp.where(mask > 0, losses.token_logprobs(z, tokens), 0.0)
  z_ref, _, _ = teacher_forcing.completion_logits(reference, rollout, CFG)
  ref_lp = jnp.where(mask > 0, losses.token_logprobs(z_ref, tokens), 0.0)
  parts = microbatch.split_microbatches((rollout, advantage_b, old_lp, ref_lp), 2, 4)

  def loss(p, i):
    part, adv, old, ref = jax.tree.map(lambda x: x[i], parts)
    return rl_step.grpo_policy_loss(p, part, adv, old, CFG, cfg, "none", ref)

  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  params, kls = student, []
  for i in range(2):
    (_, m), grads = grad_fn(params, i)
    kls.append(float(m["rl/kl_ref"]))
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
    np.testing.assert_allclose(got, want, atol=2e-5)
  np.testing.assert_allclose(metrics["rl/kl_ref"], np.mean(kls), rtol=1e-5)


# --- the reward's kind, from the worker to Rollout.reward_b ---------------------------------

TASK = task.TaskConfig(num_operands=3, max_operand=19)
TOK = tokenizer.CharTokenizer()
WORKER_CFG = tiny_char_cfg(hidden_size=32, head_dim=16)


@pytest.fixture(scope="module")
def writing_student():
  """A tiny student after 200 supervised steps: it writes the task's format with some steps
  right, so partial credit takes values strictly between 0 and 1."""
  mesh = sharding.make_mesh((1, 1, 1))
  params = model.init_params(jax.random.key(1), WORKER_CFG, jnp.float32, scale=0.3)
  params = pretrain.supervised_train(
    params,
    WORKER_CFG,
    task_cfg=TASK,
    tokenizer=TOK,
    steps=200,
    lr=1e-2,
    batch_size=32,
    seed=0,
    mesh=mesh,
    log=lambda *a: None,
  )
  return mesh, params


def _worker(mesh, reward):
  source = task.TaskSource("train", 10_000, 0, TASK)
  return RolloutWorker(
    iter(data.prompt_batches(source, 16, 0)),
    TOK,
    TASK.max_prompt_tokens,
    transform.EngineConfig(),
    sampler.SamplerConfig(max_new_tokens=20, stop_tokens=(TOK.eos_id,)),
    WORKER_CFG,
    jax.random.key(7),
    mesh,
    score_rewards=True,
    reward=reward,
  )


def _texts(rollout):
  lens_b = np.asarray(rollout.prompt_lens)
  prompt_bp = np.asarray(rollout.prompt_tokens)
  prompt_mask = (np.arange(prompt_bp.shape[1])[None, :] < lens_b[:, None]).astype(np.int32)
  prompts = rewards.decode_rows(prompt_bp, prompt_mask, TOK)
  return prompts, rewards.decode_rows(rollout.completion_tokens, rollout.completion_mask, TOK)


def test_the_engine_scores_the_reward_kind_it_is_given(writing_student):
  """The same batch (same prompts and keys) scored with partial credit and with exact match:
  each `reward_b` equals `rewards.sequence_rewards` of its kind on the decoded texts, and the
  step reward's arrays equal `rewards.step_credit` and `rewards.token_units` of them."""
  mesh, params = writing_student
  got, steps = {}, {}
  for kind in rewards.REWARDS:
    worker = _worker(mesh, kind)
    rollout, _ = worker.sample(worker.transform(params, 0), worker.draw_prompts(), 0, 0)
    got[kind], steps[kind] = (np.asarray(rollout.reward_b), _texts(rollout)), rollout
  partial, (prompts, completions) = got["partial"]
  exact, texts = got["exact_match"]
  assert texts == (prompts, completions)  # the same samples
  rollout = steps["partial"]
  done = rewards.finished_rows(rollout.completion_tokens, rollout.completion_mask, TOK.eos_id)
  np.testing.assert_allclose(
    partial, rewards.sequence_rewards(prompts, completions, "partial", done), rtol=1e-6
  )
  np.testing.assert_array_equal(
    exact, rewards.sequence_rewards(prompts, completions, "exact_match", done)
  )
  assert np.any((partial > 0) & (partial < 1)), (partial, completions)  # the kind mattered
  step, texts = got["step"]  # reward_b is exact match; the steps ride beside it
  assert texts == (prompts, completions)
  np.testing.assert_array_equal(step, exact)
  rollout = steps["step"]
  credit_bs = np.stack(
    [rewards.step_credit(*row) for row in zip(prompts, completions, done, strict=True)]
  )
  np.testing.assert_array_equal(rollout.step_reward_bs, credit_bs)
  tokens_bc, mask_bc = np.asarray(rollout.completion_tokens), np.asarray(rollout.completion_mask)
  s = credit_bs.shape[1] - 1
  for b, index_c in enumerate(np.asarray(rollout.step_index_bc)):
    np.testing.assert_array_equal(index_c, rewards.token_units(tokens_bc[b], mask_bc[b], s, TOK))
  assert np.any(credit_bs[:, 0] != credit_bs[:, -1])  # a step's credit differs from the answer's
  with pytest.raises(ValueError, match="unknown reward 'f1' \\(train.reward\\)"):
    _worker(mesh, "f1")


def test_config_check_names_the_reward_kinds():
  assert config_check.RULES["train.reward"].options == rewards.REWARDS
  c = base.get_config("tiny")
  assert c.train.reward == "exact_match"
  c.train.reward = "f1"
  with pytest.raises(ValueError, match="config.train.reward must be one of exact_match, partial"):
    config_check.validate(c)
  c = grpo_sync.get_config("tiny")
  c.train.reward = "partial"
  config_check.validate(c)
  c = base.get_config("tiny")
  c.train.reward = "partial"  # read by no distillation loss, and not refused (docs/rl_baseline.md)
  config_check.validate(c)


def _grpo_run_config(cache, steps, stop_after=0):
  """grpo_sync.py:tiny on a two-operand task (14+11=) with partial credit and β = 0.1: its
  student, warm-started a little longer, earns some credit, so not every advantage is 0 and
  the student moves away from π_ref."""
  c = grpo_sync.get_config("tiny")
  c.teacher.cache_dir = cache
  c.data.num_operands, c.data.max_operand = 2, 19
  c.student.warmup_steps, c.student.warmup_lr = 100, 1e-2
  c.train.reward, c.train.kl_coef = "partial", 0.1
  c.train.steps, c.train.stop_after, c.train.lr, c.train.warmup_steps = steps, stop_after, 1e-3, 0
  c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 1, 0, 1
  c.export.dir = "none"
  return c


def _logged(workdir, key):
  from opd_jax.io import metrics_writer

  rows = metrics_writer.read_jsonl(workdir)
  return {step: rows[step][key] for step in sorted(rows) if key in rows[step]}


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
  """A finished two-step run of `_grpo_run_config` and its teacher and warm-start cache."""
  from opd_jax.train import trainer

  cache = str(tmp_path_factory.mktemp("cache"))
  workdir = str(tmp_path_factory.mktemp("run"))
  result = trainer.run(_grpo_run_config(cache, 2), workdir, log=lambda *a: None)
  assert result["end_step"] == 2
  return cache, workdir


def test_grpo_with_the_kl_penalty_trains_and_logs_it(two_step_run):
  """Two steps of a real run with train.kl_coef > 0 and train.reward = partial: rl/kl_ref and
  loss/kl_ref are logged every step, ≥ 0, and step 2 (whose student has moved) reads > 0."""
  _, workdir = two_step_run
  kl = _logged(workdir, "rl/kl_ref")
  reward = _logged(workdir, "rl/reward_mean")
  assert reward[1] > 0  # partial credit reached the loss
  assert sorted(kl) == [1, 2] and all(v >= 0 for v in kl.values())
  assert kl[2] > 0, (kl, reward)
  np.testing.assert_allclose(_logged(workdir, "loss/kl_ref")[2], 0.1 * kl[2], rtol=1e-5)


def test_a_resumed_run_rebuilds_the_same_reference(two_step_run, tmp_path):
  """Stopped after step 1 and resumed, the run rebuilds π_ref from the warm start's cache (it
  is in no checkpoint) and step 2 reads the uninterrupted run's KL to it."""
  from opd_jax.train import trainer

  cache, straight = two_step_run
  workdir = str(tmp_path / "run")
  trainer.run(_grpo_run_config(cache, 2, stop_after=1), workdir, log=lambda *a: None)
  lines = []
  result = trainer.run(_grpo_run_config(cache, 2), workdir, log=lambda *a: lines.append(a[0]))
  assert (result["start_step"], result["end_step"]) == (1, 2)
  assert any("rebuilding the starting student" in str(line) for line in lines)
  want = _logged(straight, "rl/kl_ref")[2]
  assert want > 0
  np.testing.assert_allclose(_logged(workdir, "rl/kl_ref")[2], want, rtol=1e-6)
