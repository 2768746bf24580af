"""GRPO's loss and its gradient against TRL's (`trl==1.16.0`, in the test extra).

TRL's GRPO loss is the trainer method `GRPOTrainer._compute_loss(model, inputs)`. It is called
here, unmodified, on a trainer built without its `__init__` (no model, no data set): the
attributes the method reads are set from a real `GRPOConfig`, the accelerator is a real
single-process `accelerate.Accelerator`, and the one step that would run a model,
`_get_per_token_logps_and_entropies`, returns the fixed log π_θ(y_bt) of the test. The project's
side is `rl.grpo_from_logprobs` on the same arrays. Both run in f32; the loss and its gradient
with respect to log π_θ must agree to 1e-6.

Aggregations both have: the token mean over the batch, Σ m ℓ / Σ m (TRL "bnpo"; "dapo" over a
single generation batch, whose normaliser is then the same token count), the PPO clip, the k3
KL penalty without TRL's `use_bias_correction_kl`, and token-level truncated IS against the
engine (TRL's `importance_sampling_ratio`, here fed the project's `mismatch_weights`).
Aggregations one side lacks: TRL's "grpo" (per-sequence mean, then batch mean), "dr_grpo"
(÷ B · max length), "luspo", "cispo", "sapo", "vespo", sequence-level ratios, the entropy mask
and bonus; the project's masked corrections (mis, seq_mis) drop tokens from the denominator,
where TRL's masking modes zero the token and keep it there, and its minibatch loss is each
minibatch's own token mean where "dapo" divides by the whole generation batch's tokens.
"""

from __future__ import annotations

import collections
import importlib.util
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.train import rl

if importlib.util.find_spec("trl") is None:  # only a missing trl skips; a broken one fails
  pytest.skip(
    "trl is not installed: it is the reference GRPO loss (pip install -e '.[test]')",
    allow_module_level=True,
  )
import torch  # noqa: E402
from trl.trainer import grpo_trainer as trl_grpo  # noqa: E402

TOL = 1e-6
B, T = 8, 6  # two groups of 4 completions, up to 6 tokens


def _inputs(seed: int, ratio_off: bool):
  """Log π_θ, π_old, π_ref, π_b, a ragged mask and group advantages, as f32 numpy arrays."""
  rng = np.random.default_rng(seed)
  student_bt = np.log(rng.uniform(0.05, 0.95, (B, T))).astype(np.float32)
  # π_old differs from π_θ by up to ±0.4 in log space: ratios e^±0.4 cross both clip edges
  shift_bt = rng.uniform(-0.4, 0.4, (B, T)) if ratio_off else np.zeros((B, T))
  old_bt = (student_bt - shift_bt).astype(np.float32)
  ref_bt = (student_bt + rng.normal(0.0, 0.5, (B, T))).astype(np.float32)
  behaviour_bt = (old_bt + rng.normal(0.0, 0.8, (B, T))).astype(np.float32)
  lengths_b = rng.integers(1, T + 1, B)
  mask_bt = (np.arange(T)[None, :] < lengths_b[:, None]).astype(np.float32)
  reward_b = rng.integers(0, 2, B).astype(np.float32)
  reward_b[:2] = (0.0, 1.0)  # the first group has signal
  advantage_b = np.asarray(rl.group_advantages(jnp.asarray(reward_b), 4, True))
  return student_bt, old_bt, ref_bt, behaviour_bt, mask_bt, advantage_b


def _trl_trainer(loss_type: str, beta: float, student_bt, is_correction: bool, tmp_path):
  """A GRPOTrainer without `__init__`, carrying the attributes `_compute_loss` reads (from a
  real GRPOConfig) and returning `student_bt` as its per-token log-probs."""
  from accelerate import Accelerator
  from trl import GRPOConfig

  args = GRPOConfig(
    output_dir=str(tmp_path),
    loss_type=loss_type,
    beta=beta,
    epsilon=0.2,
    use_bias_correction_kl=False,
    report_to="none",
    use_cpu=True,
    bf16=False,
  )
  trainer = object.__new__(trl_grpo.GRPOTrainer)
  trainer.args = args
  trainer.loss_type = args.loss_type
  trainer.beta = args.beta
  trainer.epsilon_low = args.epsilon
  trainer.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
  trainer.importance_sampling_level = args.importance_sampling_level
  trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
  trainer.top_entropy_quantile = args.top_entropy_quantile
  trainer.use_vllm = is_correction  # the engine's ratio is applied only under vLLM
  trainer.vllm_importance_sampling_correction = is_correction
  trainer.aux_loss_enabled = False
  trainer._entropy_bonus_enabled = False
  trainer._metrics = {"train": collections.defaultdict(list), "eval": {}}
  trainer.accelerator = Accelerator(cpu=True)
  trainer.current_gradient_accumulation_steps = 1
  trainer.model = types.SimpleNamespace(training=True)
  assert args.steps_per_generation == 1 and trainer.accelerator.num_processes == 1
  student = torch.tensor(student_bt, requires_grad=True)

  def per_token_logps(model, input_ids, attention_mask, logits_to_keep, **_):
    assert logits_to_keep == T
    return student, torch.zeros_like(student).detach(), None

  trainer._get_per_token_logps_and_entropies = per_token_logps
  return trainer, student


def _trl_loss(loss_type, beta, inputs, is_weight_bt, tmp_path):
  """(loss, d loss / d log π_θ) of TRL's `_compute_loss` on the fixed inputs."""
  student_bt, old_bt, ref_bt, _, mask_bt, advantage_b = inputs
  trainer, student = _trl_trainer(loss_type, beta, student_bt, is_weight_bt is not None, tmp_path)
  batch = {
    "prompt_ids": torch.ones((B, 3), dtype=torch.long),
    "prompt_mask": torch.ones((B, 3), dtype=torch.long),
    "completion_ids": torch.ones((B, T), dtype=torch.long),
    "completion_mask": torch.tensor(mask_bt),
    "advantages": torch.tensor(advantage_b),
    "old_per_token_logps": torch.tensor(old_bt),
    "ref_per_token_logps": torch.tensor(ref_bt),
    "num_items_in_batch": torch.tensor(mask_bt.sum()),
  }
  if is_weight_bt is not None:
    batch["importance_sampling_ratio"] = torch.tensor(is_weight_bt)
  loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, batch)
  loss.backward()
  return float(loss.detach()), student.grad.numpy()


def _project_loss(beta, inputs, correction="none"):
  """(loss, d loss / d log π_θ, metrics) of `rl.grpo_from_logprobs` on the same inputs."""
  student_bt, old_bt, ref_bt, behaviour_bt, mask_bt, advantage_b = inputs

  def loss_fn(student):
    return rl.grpo_from_logprobs(
      student,
      jnp.asarray(mask_bt),
      jnp.asarray(advantage_b),
      jnp.asarray(behaviour_bt),
      jnp.asarray(old_bt),
      clip_eps=0.2,
      correction=correction,
      correction_clip=2.0,
      reference_logprobs=jnp.asarray(ref_bt),
      kl_coef=beta,
    )

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(student_bt))
  return float(loss), np.asarray(grad), metrics


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04, 0.5])
@pytest.mark.parametrize("ratio_off", [False, True], ids=["ratio1", "ratio_ne_1"])
def test_grpo_loss_and_gradient_equal_trl(loss_type, beta, ratio_off, tmp_path):
  """Token-mean GRPO with the ε = 0.2 clip and the k3 penalty equals TRL's bnpo and dapo."""
  inputs = _inputs(seed=7 + int(ratio_off), ratio_off=ratio_off)
  ours, ours_grad, metrics = _project_loss(beta, inputs)
  ref, ref_grad = _trl_loss(loss_type, beta, inputs, None, tmp_path)
  if ratio_off:  # the clip is really exercised: some tokens sit past 1 ± ε with an active clip
    assert float(metrics["rl/ppo_clip_frac"]) > 0.05
    assert float(metrics["rl/ppo_ratio_abs_dev_max"]) > 0.2
  assert np.isfinite(ours) and abs(ours) > 1e-3
  np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL)
  np.testing.assert_allclose(ours_grad, ref_grad, rtol=0, atol=TOL)
  assert np.all(ours_grad[inputs[4] == 0] == 0)  # padding gets no gradient on either side


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_token_tis_equals_trl_importance_ratio(beta, tmp_path):
  """Token TIS: the project's weight min(π_old/π_b, C) applied as TRL's engine ratio gives the
  same loss and gradient (the KL penalty unweighted on both sides)."""
  inputs = _inputs(seed=11, ratio_off=True)
  _, old_bt, _, behaviour_bt, mask_bt, _ = inputs
  weight_bt, _ = rl.mismatch_weights(
    jnp.asarray(old_bt), jnp.asarray(behaviour_bt), jnp.asarray(mask_bt), "tis", 2.0
  )
  weight_bt = np.asarray(weight_bt)
  assert weight_bt.max() == pytest.approx(2.0) and weight_bt[mask_bt > 0].min() < 0.9
  ours, ours_grad, _ = _project_loss(beta, inputs, correction="tis")
  ref, ref_grad = _trl_loss("bnpo", beta, inputs, weight_bt, tmp_path)
  np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL)
  np.testing.assert_allclose(ours_grad, ref_grad, rtol=0, atol=TOL)


def test_trl_per_sequence_grpo_differs_on_ragged_masks(tmp_path):
  """TRL's default "grpo" aggregation (mean per sequence, then over sequences) is not the
  project's token mean: on ragged lengths the two differ, so the equality above is not vacuous."""
  inputs = _inputs(seed=7, ratio_off=True)
  ours, _, _ = _project_loss(0.04, inputs)
  per_sequence, _ = _trl_loss("grpo", 0.04, inputs, None, tmp_path)
  assert abs(ours - per_sequence) > 1e-3
