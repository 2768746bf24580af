"""The step reward (`train.reward="step"`, opd_jax/data/rewards.py): each written step's
credit, the step of every completion token, GRPO's per-step group advantage A_bt
(`rl.step_group_advantages`), the [B, T] advantage of the clipped loss, and its checks."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_step_cfg

from opd_jax.config import check as config_check
from opd_jax.data import rewards, task
from opd_jax.data.rollout_types import Rollout
from opd_jax.data.toy_checkpoints import save_chat_tokenizer
from opd_jax.inference import sampler, transform
from opd_jax.model import sharding
from opd_jax.model import transformer as model
from opd_jax.model.tokenizer import CharTokenizer
from opd_jax.rollout.worker import RolloutWorker
from opd_jax.train import rl, rl_step, train_step
from opd_jax.train import state as train_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import grpo_practice  # noqa: E402

TOK = CharTokenizer()
SUM4 = "10+20+30+40="  # truth 10+20=30;30+30=60;60+40=100>100: S = 3, units 0..3


@pytest.mark.parametrize(
  "completion, credit, units",
  [
    # right: every step and the answer
    ("10+20=30;30+30=60;60+40=100>100", [1, 1, 1, 1], [0] * 9 + [1] * 9 + [2] * 9 + [3] * 4),
    # a wrong middle step, the rest right (each step is compared with the truth's)
    ("10+20=30;30+30=61;60+40=100>100", [1, 0, 1, 1], [0] * 9 + [1] * 9 + [2] * 9 + [3] * 4),
    # a missing step: the second written step is compared with the truth's second, the third
    # is missing (0); the answer is right
    ("10+20=30;60+40=100>100", [1, 0, 0, 1], [0] * 9 + [1] * 9 + [3] * 4),
    # every step right, the answer wrong
    ("10+20=30;30+30=60;60+40=100>99", [1, 1, 1, 0], [0] * 9 + [1] * 9 + [2] * 9 + [3] * 3),
    # garbage without a marker: segments "12", "", "4"; nothing right
    ("12;;4", [0, 0, 0, 0], [0, 0, 0, 1, 2]),
    # garbage after an empty head: everything from the marker on is the answer
    (">>3;;", [0, 0, 0, 0], [3] * 5),
    # a step beyond the S-th (and the S-th step's ";") : the extra step is the answer's
    ("10+20=30;30+30=60;60+40=100;1+1=2>100", [1, 1, 1, 1], [0] * 9 + [1] * 9 + [2] * 10 + [3] * 9),
    # the empty completion: step 1 reads "", wrong
    ("", [0, 0, 0, 0], []),
  ],
)
def test_step_credit_and_character_units_by_hand(completion, credit, units):
  np.testing.assert_array_equal(rewards.step_credit(SUM4, completion), credit)
  assert rewards.char_units(completion, 3) == units
  assert len(units) == len(completion)
  # the answer's column is exact match; partial credit is the credits' mean
  assert rewards.step_credit(SUM4, completion)[-1] == float(task.score(SUM4, completion))
  assert rewards.partial_credit(SUM4, completion) == pytest.approx(np.mean(credit))


def test_chain_steps():
  """37+8*3=: 3:45;2:53;1:61>61, S = 3."""
  right = "3:45;2:53;1:61>61"
  np.testing.assert_array_equal(rewards.step_credit("37+8*3=", right), [1, 1, 1, 1])
  assert rewards.char_units(right, 3) == [0] * 5 + [1] * 5 + [2] * 4 + [3] * 3
  np.testing.assert_array_equal(rewards.step_credit("37+8*3=", "3:45;2:54;1:61>61"), [1, 0, 1, 1])


def test_token_units_eos_dropped_tokens_and_padding():
  """'12' <pad> ';3' <eos> then two masked slots, S = 2: the pad takes the next character's
  unit (';', step 1's separator: unit 0), the eos and the masked slots the answer's (2)."""
  ids = TOK.encode("12") + [TOK.pad_id] + TOK.encode(";3") + [TOK.eos_id, 0, 0]
  mask = [1] * 6 + [0, 0]
  np.testing.assert_array_equal(rewards.token_units(ids, mask, 2, TOK), [0, 0, 0, 0, 1, 2, 2, 2])
  # a bos at the end (no character after it) reads the answer; no eos within the mask
  ids = TOK.encode("1;") + [TOK.bos_id]
  np.testing.assert_array_equal(rewards.token_units(ids, [1, 1, 1], 2, TOK), [0, 0, 2])


def test_step_rewards_of_a_rollout():
  """Two rows of one prompt, token arrays as the sampler lays them out."""
  truth = "10+20=30;30+30=60;60+40=100>100"
  wrong = "10+20=30;30+30=61>61"
  c = len(truth) + 2
  tokens, mask = np.zeros((2, c), np.int32), np.zeros((2, c), np.int32)
  for b, text in enumerate((truth, wrong)):
    ids = TOK.encode(text) + [TOK.eos_id]
    tokens[b, : len(ids)], mask[b, : len(ids)] = ids, 1
  prompt = np.asarray([[TOK.bos_id, *TOK.encode(SUM4)]] * 2, np.int32)
  rollout = _rollout(prompt, tokens, mask)
  credit_bs, index_bc = rewards.step_rewards(rollout, TOK)
  np.testing.assert_array_equal(credit_bs, [[1, 1, 1, 1], [1, 0, 0, 0]])
  want_1 = [0] * 9 + [1] * 8 + [3] * 3 + [3] + [3] * (c - len(wrong) - 1)  # eos, then masked
  np.testing.assert_array_equal(index_bc[1], want_1)
  np.testing.assert_array_equal(index_bc[0][-3:], [3, 3, 3])  # "0", eos, masked
  # The right completion cut off before its eos: its steps keep their credit, the answer none.
  mask[0, len(truth)] = 0
  credit_bs, _ = rewards.step_rewards(_rollout(prompt, tokens, mask), TOK)
  np.testing.assert_array_equal(credit_bs, [[1, 1, 1, 0], [1, 0, 0, 0]])


def _rollout(prompt_bp, tokens_bc, mask_bc, **fields):
  b, c = tokens_bc.shape
  return Rollout(
    prompt_tokens=jnp.asarray(prompt_bp),
    prompt_lens=jnp.full((b,), prompt_bp.shape[1], jnp.int32),
    completion_tokens=jnp.asarray(tokens_bc),
    completion_mask=jnp.asarray(mask_bc),
    behaviour_logprobs=jnp.zeros((b, c)),
    model_logprobs=jnp.zeros((b, c)),
    weight_version=jnp.asarray(0),
    **fields,
  )


# One group of 4 rows, S = 2 (units 0, 1 and the answer 2), and a second group all equal.
CREDIT_BS = np.asarray(
  [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0], [1, 0, 1], [1, 0, 1], [1, 0, 1], [1, 0, 1]],
  np.float32,
)
INDEX_BT = np.asarray(
  [[0, 0, 1, 2, 2], [0, 1, 1, 2, 2], [0, 0, 0, 0, 2], [1, 1, 1, 1, 1]] + [[0, 1, 2, 2, 2]] * 4,
  np.int32,
)


def test_step_group_advantages_by_hand():
  """Group 1, per column (ddof-1 std):
  unit 0: c = 1, 1, 0, 1, mean 3/4, std 1/2        A = 1/2, 1/2, −3/2, 1/2 (÷ (1/2 + ε) · 1/2)
  unit 1: c = 1, 0, 0, 1, mean 1/2, std 1/√3       A = ±(1/2)/(1/√3 + ε)
  unit 2: c = 1, 0, 0, 0, mean 1/4, std 1/2        A = 3/2, −1/2, −1/2, −1/2
  Group 2: every column equal, A = 0."""
  eps = rl.STD_EPS
  u0 = np.asarray([0.25, 0.25, -0.75, 0.25]) / (0.5 + eps)
  u1 = np.asarray([0.5, -0.5, -0.5, 0.5]) / (1 / np.sqrt(3) + eps)
  u2 = np.asarray([0.75, -0.25, -0.25, -0.25]) / (0.5 + eps)
  a_bs = np.stack([u0, u1, u2], axis=1)
  want = np.zeros((8, 5))
  for b in range(4):
    want[b] = a_bs[b, INDEX_BT[b]]
  got = rl.step_group_advantages(jnp.asarray(CREDIT_BS), jnp.asarray(INDEX_BT), 4, True)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got[0], [u0[0], u0[0], u1[0], u2[0], u2[0]], rtol=1e-6)
  centred = rl.step_group_advantages(jnp.asarray(CREDIT_BS), jnp.asarray(INDEX_BT), 4, False)
  np.testing.assert_allclose(centred[2], [-0.75, -0.75, -0.75, -0.75, -0.25], atol=1e-7)
  # every unit equal to the answer: the per-token advantage is the sequence one
  seq = jnp.asarray([1.0, 0.0, 0.0, 1.0])
  same = rl.step_group_advantages(
    jnp.tile(seq[:, None], (1, 3)), jnp.asarray(INDEX_BT[:4]), 4, True
  )
  np.testing.assert_array_equal(
    same, jnp.broadcast_to(rl.group_advantages(seq, 4, True)[:, None], (4, 5))
  )
  with pytest.raises(ValueError, match="must be \\[B, S \\+ 1\\]"):
    rl.step_group_advantages(jnp.zeros(8), jnp.asarray(INDEX_BT), 4, True)


def test_grpo_advantages_and_metrics_of_a_step_rollout():
  mask = np.ones((8, 5), np.int32)
  mask[3, 3:] = 0
  rollout = _rollout(
    np.ones((8, 3), np.int32),
    np.ones((8, 5), np.int32),
    mask,
    reward_b=jnp.asarray(CREDIT_BS[:, -1]),
    step_reward_bs=jnp.asarray(CREDIT_BS),
    step_index_bc=jnp.asarray(INDEX_BT),
  )
  cfg = train_step.LossConfig(name="grpo", group_size=4, reward="step")
  advantage_bc, metrics = rl_step.grpo_advantages(rollout, cfg)
  want = rl.step_group_advantages(jnp.asarray(CREDIT_BS), jnp.asarray(INDEX_BT), 4, True)
  np.testing.assert_array_equal(advantage_bc, want)
  assert metrics["rl/reward_mean"] == pytest.approx(5 / 8)  # the answers: exact match
  assert metrics["rl/step_reward_mean"] == pytest.approx(CREDIT_BS.mean())
  assert metrics["rl/step_group_all_equal_frac"] == pytest.approx(3 / 6)  # group 2's 3 units
  assert metrics["rl/group_all_equal_frac"] == pytest.approx(1 / 2)
  want_abs = np.sum(np.abs(np.asarray(want)) * mask) / mask.sum()
  assert metrics["rl/advantage_abs_mean"] == pytest.approx(want_abs, rel=1e-6)
  with pytest.raises(ValueError, match="needs Rollout.step_reward_bs"):
    rl_step.grpo_advantages(rollout.replace(step_reward_bs=None), cfg)


def _logprob_inputs():
  rng = np.random.default_rng(0)
  b, t = 8, 5
  student = jnp.asarray(np.log(rng.uniform(0.05, 0.95, (b, t))), jnp.float32)
  old = student - jnp.asarray(rng.uniform(-0.4, 0.4, (b, t)), jnp.float32)
  behaviour = old + jnp.asarray(rng.normal(0, 0.5, (b, t)), jnp.float32)
  ref = student + jnp.asarray(rng.normal(0, 0.5, (b, t)), jnp.float32)
  mask = jnp.asarray(np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None], jnp.float32)
  advantage_b = rl.group_advantages(jnp.asarray(rng.integers(0, 2, b), jnp.float32), 4, True)
  return student, old, behaviour, ref, mask, advantage_b


@pytest.mark.parametrize("correction, kl_coef", [("none", 0.0), ("tis", 0.04), ("seq_mis", 0.0)])
def test_a_broadcast_advantage_gives_the_same_loss_and_gradient(correction, kl_coef):
  """[B] A_b and [B, T] A_bt = A_b at every t: the same loss, gradient and metrics, bit for
  bit, with ratios away from 1 (both clip edges cross)."""
  student, old, behaviour, ref, mask, advantage_b = _logprob_inputs()
  advantage_bt = jnp.broadcast_to(advantage_b[:, None], mask.shape)

  def loss(lp, advantage):
    return rl.grpo_from_logprobs(
      lp, mask, advantage, behaviour, old, correction=correction,
      reference_logprobs=ref, kl_coef=kl_coef,
    )  # fmt: skip

  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (loss_b, metrics_b), grad_b = grad_fn(student, advantage_b)
  (loss_bt, metrics_bt), grad_bt = grad_fn(student, advantage_bt)
  np.testing.assert_array_equal(loss_b, loss_bt)
  np.testing.assert_array_equal(grad_b, grad_bt)
  for key in metrics_b:
    np.testing.assert_array_equal(metrics_b[key], metrics_bt[key], err_msg=key)
  assert float(metrics_b["rl/ppo_clip_frac"]) > 0  # the clip acted
  with pytest.raises(ValueError, match="must be \\[B\\] or \\[B, T\\]"):
    loss(student, advantage_bt[:, :3])


def test_a_per_token_advantage_weights_each_token():
  """With ratio 1 the gradient of the loss w.r.t. log π_θ(y_bt) is −A_bt m_bt / Σ m."""
  student, _, behaviour, _, mask, _ = _logprob_inputs()
  advantage_bt = rl.step_group_advantages(jnp.asarray(CREDIT_BS), jnp.asarray(INDEX_BT), 4, True)
  grad = jax.grad(lambda lp: rl.grpo_from_logprobs(lp, mask, advantage_bt, behaviour)[0])(student)
  np.testing.assert_allclose(grad, -advantage_bt * mask / mask.sum(), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("epochs, minibatches", [(1, 1), (2, 2)])
def test_the_train_step_with_step_credit(epochs, minibatches):
  """A sampled batch of 2 prompts × G = 4 through `train_step` (K = 1: the single-update path;
  K = 4: `grpo_updates`' minibatches). Credits equal to the answer's at every unit train
  exactly as exact match does; real step credits give per_token/advantage_bc = A_bt."""
  cfg_m = tiny_step_cfg()
  student = model.init_params(jax.random.key(0), cfg_m, scale=0.3)
  prompts = [[1, 5, 7]] * 4 + [[1, 9, 4]] * 4
  scfg = sampler.SamplerConfig(max_new_tokens=5, temperature=1.0)
  rollout = sampler.sample(student, prompts, jax.random.key(2), scfg, cfg_m)
  reward_b = jnp.asarray(CREDIT_BS[:, -1])
  rollout = rollout.replace(reward_b=reward_b, step_index_bc=jnp.asarray(INDEX_BT))
  tx = optax.adam(1e-2)

  def step(reward, credit_bs):
    cfg = train_step.LossConfig(
      name="grpo", group_size=4, reward=reward, ppo_epochs=epochs, ppo_minibatches=minibatches
    )
    state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
    fn = jax.jit(
      lambda s, r: train_step.train_step(
        s, None, r, tx=tx, student_cfg=cfg_m, teacher_cfg=cfg_m, loss_cfg=cfg
      )
    )
    return fn(state, rollout.replace(step_reward_bs=credit_bs))

  exact, _ = step("exact_match", None)
  tiled, _ = step("step", jnp.tile(reward_b[:, None], (1, 3)))
  for got, want in zip(jax.tree.leaves(tiled.params), jax.tree.leaves(exact.params), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  stepped, metrics = step("step", jnp.asarray(CREDIT_BS))
  want = rl.step_group_advantages(jnp.asarray(CREDIT_BS), jnp.asarray(INDEX_BT), 4, True)
  np.testing.assert_allclose(
    metrics["per_token/advantage_bc"], want * (rollout.completion_mask > 0), rtol=1e-6
  )
  assert float(metrics["rl/step_reward_mean"]) == pytest.approx(CREDIT_BS.mean())
  moved = [
    np.max(np.abs(a - b))
    for a, b in zip(jax.tree.leaves(stepped.params), jax.tree.leaves(exact.params), strict=True)
  ]
  assert max(moved) > 1e-4  # the step credits train differently from the answer alone


def test_the_step_reward_is_refused_where_it_cannot_work(tmp_path):
  with pytest.raises(ValueError, match="only train.loss='grpo' reads"):
    train_step.LossConfig(name="reinforce", reward="step")
  with pytest.raises(ValueError, match="unknown reward 'f1'"):
    train_step.LossConfig(name="grpo", group_size=2, reward="f1")
  train_step.LossConfig(name="reverse_kl_sampled", reward="step")  # read by no OPD loss
  assert config_check.RULES["train.reward"].options == rewards.REWARDS

  c = grpo_practice.get_config("tiny")
  c.train.reward = "step"
  config_check.validate(c)
  c.tokenizer = str(tmp_path)
  with pytest.raises(ValueError, match="needs the built-in character tokenizer"):
    config_check.validate(c)
  c.tokenizer, c.data.prompt_file = "char", "prompts.jsonl"
  with pytest.raises(ValueError, match="train.reward='step'.*has no reward"):
    config_check.validate(c)
  c.data.prompt_file, c.train.loss = "", "reinforce"
  with pytest.raises(ValueError, match="only train.loss='grpo' reads"):
    config_check.validate(c)

  hf = save_chat_tokenizer(tmp_path / "tok")  # one token per character, but not the task's
  with pytest.raises(ValueError, match="needs the built-in character tokenizer.*HFTokenizer"):
    rewards.token_units([5], [1], 2, hf)
  mesh = sharding.make_mesh((1, 1, 1))
  with pytest.raises(ValueError, match="needs the built-in character tokenizer"):
    RolloutWorker(
      iter([]), hf, 10, transform.EngineConfig(), sampler.SamplerConfig(max_new_tokens=8), None,
      jax.random.key(0), mesh, score_rewards=True, reward="step",
    )  # fmt: skip


@pytest.mark.slow
def test_grpo_practice_tiny_trains_with_the_step_reward(tmp_path):
  """`python -m opd_jax.main --config=configs/grpo_practice.py:tiny --config.train.reward=step`
  (in process; about 45 s on 2 busy cores): every trained step logs the step metrics."""
  from opd_jax.io import metrics_writer
  from opd_jax.train import trainer

  c = grpo_practice.get_config("tiny")
  c.train.reward = "step"
  c.teacher.cache_dir = str(tmp_path / "cache")
  c.export.dir = "none"
  trainer.run(c, str(tmp_path / "run"), log=lambda *a: None)
  trained = [
    r for r in metrics_writer.read_jsonl(str(tmp_path / "run")).values() if "loss/grpo" in r
  ]
  assert trained
  for r in trained:
    assert 0 <= r["rl/step_reward_mean"] <= 1 and 0 <= r["rl/step_group_all_equal_frac"] <= 1
    assert 0 <= r["rl/reward_mean"] <= 1 and np.isfinite(r["loss/total"])
