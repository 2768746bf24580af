"""The RL baseline (opd_jax/train/rl.py) against hand-computed values."""

import dataclasses
import math
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.config import check as config_check
from opd_jax.data import rewards
from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import teacher_forcing
from opd_jax.model import tokenizer
from opd_jax.model import transformer as model
from opd_jax.train import evaluate, rl, train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import base  # noqa: E402
from conftest import tiny_model_cfg  # noqa: E402

LOG3 = math.log(3.0)


def test_leave_one_out_baseline_hand_computed():
  reward_b = jnp.asarray([1.0, 0.0, 1.0, 0.0])
  # Others' means: (2 - 1) / 3, 2 / 3, 1 / 3, 2 / 3.
  np.testing.assert_allclose(
    rl.leave_one_out_baseline(reward_b), [1 / 3, 2 / 3, 1 / 3, 2 / 3], rtol=1e-6
  )
  with pytest.raises(ValueError, match="B >= 2"):
    rl.leave_one_out_baseline(jnp.asarray([1.0]))


def test_truncated_is_ratio_hand_computed():
  student_lp = jnp.log(jnp.asarray([[0.5, 0.2, 0.3]]))
  behaviour_lp = jnp.asarray([[math.log(0.25), math.log(0.4), -jnp.inf]])
  mask = jnp.asarray([[1, 1, 0]])
  ratio, clipped = rl.truncated_is_ratio(student_lp, behaviour_lp, mask, 1.5)
  # raw ratios 0.5 / 0.25 = 2 (truncated to 1.5) and 0.2 / 0.4 = 0.5; padding reads 1.
  np.testing.assert_allclose(ratio, [[1.5, 0.5, 1.0]], rtol=1e-6)
  np.testing.assert_array_equal(clipped, [[1.0, 0.0, 0.0]])
  ratio, clipped = rl.truncated_is_ratio(student_lp, behaviour_lp, mask, None)
  np.testing.assert_array_equal(ratio, np.ones((1, 3)))
  with pytest.raises(ValueError, match="is_clip"):
    rl.truncated_is_ratio(student_lp, behaviour_lp, mask, 0.0)


def _tiny_batch():
  """B=2, T=2, V=3, uniform student (log π = −log 3), rewards (1, 0), last token masked."""
  logits = jnp.zeros((2, 2, 3))
  tokens = jnp.asarray([[0, 2], [1, 1]])
  mask = jnp.asarray([[1, 1], [1, 0]])
  reward_b = jnp.asarray([1.0, 0.0])
  return logits, tokens, mask, reward_b


def _expected_grad(scale_bt):
  """∂loss/∂z_bt = −m ρ A (onehot(y) − 1/3) / N with N = 3 counted tokens.

  A = (1 − 0, 0 − 1) = (1, −1) from the leave-one-out baseline; `scale_bt` = m ρ A.
  """
  _, tokens, _, _ = _tiny_batch()
  onehot = np.eye(3)[np.asarray(tokens)]
  return -np.asarray(scale_bt)[..., None] * (onehot - 1 / 3) / 3


def test_reinforce_loss_and_gradient_without_is():
  logits, tokens, mask, reward_b = _tiny_batch()
  behaviour = jnp.full((2, 2), -LOG3)

  def loss_fn(z):
    return rl.reinforce(z, tokens, mask, reward_b, behaviour, is_clip=None)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logits)
  # −[1·(−log 3) + 1·(−log 3) + (−1)·(−log 3)] / 3 = log 3 / 3.
  np.testing.assert_allclose(loss, LOG3 / 3, rtol=1e-6)
  np.testing.assert_allclose(grad, _expected_grad([[1, 1], [-1, 0]]), atol=1e-7)
  np.testing.assert_allclose(metrics["rl/reward_mean"], 0.5)
  np.testing.assert_allclose(metrics["rl/advantage_abs_mean"], 1.0)
  np.testing.assert_allclose(metrics["loss/is_ratio"], 1.0)
  np.testing.assert_allclose(metrics["loss/student_logprob"], -LOG3, rtol=1e-6)
  np.testing.assert_allclose(metrics["per_token/advantage_bc"], [[1, 1], [-1, 0]])


def test_reinforce_truncated_is_weights_tokens_but_takes_no_gradient():
  logits, tokens, mask, reward_b = _tiny_batch()
  # π_b(y) = 1/6, 2/3, 1/3 on the counted tokens: ratios 2 → 1.5 (C), 0.5, 1.
  behaviour = jnp.log(jnp.asarray([[1 / 6, 2 / 3], [1 / 3, 1.0]]))

  def loss_fn(z):
    return rl.reinforce(z, tokens, mask, reward_b, behaviour, is_clip=1.5)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logits)
  # −[1.5·(−log 3) + 0.5·(−log 3) − 1·(−log 3)] / 3 = log 3 / 3 (same value, other weights).
  np.testing.assert_allclose(loss, LOG3 / 3, rtol=1e-6)
  # The ratio is a constant weight: the gradient is ρ times the unweighted one.
  np.testing.assert_allclose(grad, _expected_grad([[1.5, 0.5], [-1, 0]]), atol=1e-7)
  np.testing.assert_allclose(metrics["loss/is_ratio"], 1.0, rtol=1e-6)  # (1.5 + 0.5 + 1) / 3
  np.testing.assert_allclose(metrics["loss/is_clip_frac"], 1 / 3, rtol=1e-6)


def test_reinforce_all_equal_rewards_give_no_gradient():
  logits, tokens, mask, _ = _tiny_batch()
  logits = logits + jnp.asarray([0.3, -0.2, 0.1])
  grad = jax.grad(lambda z: rl.reinforce(z, tokens, mask, jnp.ones(2), jnp.zeros((2, 2)))[0])(
    logits
  )
  np.testing.assert_array_equal(grad, np.zeros_like(grad))


def test_reinforce_refuses_missing_reward_and_bad_shapes():
  logits, tokens, mask, reward_b = _tiny_batch()
  behaviour = jnp.zeros((2, 2))
  with pytest.raises(ValueError, match="reward_b"):
    rl.reinforce(logits, tokens, mask, None, behaviour)
  with pytest.raises(ValueError, match="must be \\[B\\]"):
    rl.reinforce(logits, tokens, mask, jnp.ones(3), behaviour)
  with pytest.raises(ValueError, match="must all be"):
    rl.reinforce(logits, tokens, mask, reward_b, jnp.zeros((2, 3)))


def _text_rollout(prompts, completions, junk_after_mask=False, cut=()):
  """A Rollout of the given texts, tokenized as the engine does (bos + prompt, eos); the rows
  in `cut` have no eos (the token budget ended them)."""
  tok = tokenizer.CharTokenizer()
  p, c = 12, 28
  prompt_bp = np.zeros((len(prompts), p), np.int32)
  lens_b = np.zeros(len(prompts), np.int32)
  tokens_bc = np.zeros((len(prompts), c), np.int32)
  mask_bc = np.zeros((len(prompts), c), np.int32)
  for b, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
    ids = [tok.bos_id, *tok.encode(prompt)]
    prompt_bp[b, : len(ids)], lens_b[b] = ids, len(ids)
    out = [*tok.encode(completion), *([] if b in cut else [tok.eos_id])]
    tokens_bc[b, : len(out)], mask_bc[b, : len(out)] = out, 1
    if junk_after_mask:
      tokens_bc[b, len(out) :] = tok.encode("9")[0]
  zeros = jnp.zeros((len(prompts), c))
  return Rollout(
    prompt_tokens=jnp.asarray(prompt_bp),
    prompt_lens=jnp.asarray(lens_b),
    completion_tokens=jnp.asarray(tokens_bc),
    completion_mask=jnp.asarray(mask_bc),
    behaviour_logprobs=zeros,
    model_logprobs=zeros,
    weight_version=jnp.zeros((), jnp.int32),
  ), tok


def test_reward_from_decoded_text():
  prompts = ["37+58+21=", "37+58+21=", "10+10+10=", "10+10+10="]
  completions = [
    "37+58=95;95+21=116>116",  # right
    "37+58=95;95+21=117>117",  # wrong answer
    "10+10=20;20+10=30>30>30",  # malformed: two answer markers
    "wrong steps>30",  # only the answer counts
  ]
  np.testing.assert_array_equal(rewards.sequence_rewards(prompts, completions), [1, 0, 0, 1])
  engine_texts = [*completions[:2], "10+10=20;20+10=30>30", "10+10=20;20+10=30>31"]
  rollout, tok = _text_rollout(prompts, engine_texts, junk_after_mask=True)
  # The tokens past the mask (a junk '9' after eos) are not part of the completion.
  np.testing.assert_array_equal(rewards.rollout_rewards(rollout, tok), [1, 0, 1, 0])
  # Cut off by the token budget ("...>1160" stopped after "...>116"): no answer, whatever
  # the text; its written steps still count for partial credit (2 of 2, answer 0: 2/3).
  rollout, tok = _text_rollout(prompts[:2], [completions[0]] * 2, cut=(1,))
  np.testing.assert_array_equal(rewards.rollout_rewards(rollout, tok), [1, 0])
  np.testing.assert_allclose(rewards.rollout_rewards(rollout, tok, "partial"), [1, 2 / 3])
  # The held-out accuracy reads the same rule; a user's scorer reads whatever was written.
  eval_set = evaluate.make_eval_set([{"prompt": p} for p in prompts[:2]], tok, 12)
  assert evaluate.accuracy(rollout, eval_set, tok)[0] == 0.5
  lenient = dataclasses.replace(eval_set, requires_eos=False)
  assert evaluate.accuracy(rollout, lenient, tok)[0] == 1.0
  with pytest.raises(ValueError, match="not a task prompt"):
    rewards.sequence_rewards(["hello"], ["1"])
  with pytest.raises(ValueError, match="2 prompts but 1"):
    rewards.sequence_rewards(["1+1=", "1+2="], ["2"])


def test_train_step_dispatches_reinforce_without_the_teacher():
  """The step's loss equals rl.reinforce on the student's logits; the teacher is unused."""
  cfg = tiny_model_cfg(vocab_size=21)
  params = model.init_params(jax.random.key(0), cfg)
  rollout, _ = _text_rollout(["37+58+21=", "10+10+10="], ["37+58=95;95+21=116>116", "1>2"])
  rollout = rollout.replace(reward_b=jnp.asarray([1.0, 0.0]))
  loss_cfg = train_step.LossConfig(name="reinforce", is_clip=None)
  loss, metrics = train_step.opd_loss(params, None, rollout, cfg, None, loss_cfg)
  logits, tokens, mask = teacher_forcing.completion_logits(params, rollout, cfg)
  want, _ = rl.reinforce(logits, tokens, mask, rollout.reward_b, rollout.behaviour_logprobs)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  assert "mismatch/k3" in metrics and "rl/reward_mean" in metrics
  with pytest.raises(ValueError, match="temperature > 0"):
    train_step.opd_loss(
      params, None, rollout, cfg, None, train_step.LossConfig(name="reinforce", temperature=0.0)
    )


def test_config_check_names_reinforce_settings():
  c = base.get_config("tiny")
  c.train.loss = "reinforce"
  config_check.validate(c)
  c.rollout.temperature = 0.0
  c.data.prompt_file = "prompts.jsonl"
  with pytest.raises(ValueError, match="temperature must be > 0") as e:
    config_check.validate(c)
  assert "data.prompt_file" in str(e.value)


def test_train_step_dispatches_single_update_grpo_and_refuses_greedy():
  """GRPO with K = 1 goes through `opd_loss` like reinforce: its loss is `rl.grpo` on the
  student's logits with the group advantages of the whole batch, and it needs the reward."""
  assert rl.needs_reward("grpo") and rl.needs_reward("reinforce")
  assert not rl.needs_reward("reverse_kl_full")
  cfg = tiny_model_cfg(vocab_size=21)
  params = model.init_params(jax.random.key(0), cfg)
  prompts = ["37+58+21=", "37+58+21=", "10+10+10=", "10+10+10="]
  texts = ["37+58=95;95+21=116>116", "1>2", "1>3", "10+10=20;20+10=30>30"]
  rollout, _ = _text_rollout(prompts, texts)
  loss_cfg = train_step.LossConfig(name="grpo", group_size=2, mismatch_correction="tis")
  with pytest.raises(ValueError, match="needs Rollout.reward_b"):
    train_step.opd_loss(params, None, rollout, cfg, None, loss_cfg)
  rollout = rollout.replace(reward_b=jnp.asarray([1.0, 0.0, 0.0, 1.0]))
  loss, metrics = train_step.opd_loss(params, None, rollout, cfg, None, loss_cfg)
  logits, tokens, mask = teacher_forcing.completion_logits(params, rollout, cfg)
  advantage_b = rl.group_advantages(rollout.reward_b, 2, True)
  want, _ = rl.grpo(logits, tokens, mask, advantage_b, rollout.behaviour_logprobs, correction="tis")
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_allclose(metrics["rl/group_all_equal_frac"], 0.0)
  assert "mismatch/k3" in metrics and metrics["per_token/advantage_bc"].shape == mask.shape
  greedy = dataclasses.replace(loss_cfg, temperature=0.0)
  with pytest.raises(ValueError, match="needs sampled rollouts"):
    train_step.check_rollout_loss(types.SimpleNamespace(temperature=0.0), greedy)
