"""Prefix shift: the coupling's flip probability by hand, first divergence, an exact engine
never diverges, and the teacher-forced engine reproduces the engine's own decode."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from opd_jax.inference import transform
from opd_jax.inference.sampler import SamplerConfig
from opd_jax.mismatch import measure as measure_lib
from opd_jax.mismatch import prefix_shift
from opd_jax.model import kvcache
from opd_jax.model import transformer as model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import bf16_sync  # noqa: E402
from conftest import tiny_model_cfg

CFG = tiny_model_cfg(vocab_size=64)
PROMPTS = [[3, 17, 9, 4, 10], list(range(20, 31)), [7], [5] * 9, [1, 2], [60, 61, 62]]
SCFG = SamplerConfig(max_new_tokens=10, stop_tokens=(0,))
F32_KV = kvcache.KVCacheSpec(dtype="float32")


@pytest.fixture(scope="module")
def params():
  return model.init_params(jax.random.key(0), CFG, scale=0.3)


@pytest.mark.parametrize(
  "p, q, flip",
  [
    ([0.5, 0.5], [0.6, 0.4], 0.1),  # = TV
    ([0.5, 0.0, 0.5], [0.4, 0.2, 0.4], 0.2),  # = TV
    ([0.3, 0.4, 0.3], [0.4, 0.4, 0.2], 0.2),  # TV = 0.1: shifted boundaries flip the middle
  ],
)
def test_coupled_flip_probability_by_hand(p, q, flip):
  with np.errstate(divide="ignore"):  # log 0 = -inf: a token with no mass
    lp = np.log(np.asarray([[p]], np.float32))
    lq = np.log(np.asarray([[q]], np.float32))
  np.testing.assert_allclose(prefix_shift.coupled_flip_probability(lp, lq), [[flip]], atol=1e-6)
  np.testing.assert_allclose(prefix_shift.coupled_flip_probability(lp, lp), [[0.0]], atol=1e-6)


def test_first_divergence_by_hand():
  a = [[1, 2, 3, 0], [1, 2, 3, 4], [5, 6, 0, 0]]
  ma = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
  b = [[1, 2, 3, 0], [1, 9, 3, 4], [5, 6, 7, 0]]
  mb = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
  np.testing.assert_array_equal(prefix_shift.first_divergence(a, ma, b, mb), [-1, 1, 2])


def test_exact_engine_never_diverges(params):
  row = prefix_shift.prefix_shift(
    params, CFG, transform.EngineConfig(kv=F32_KV), PROMPTS, jax.random.key(0), SCFG
  )
  assert row["diverged_fraction"] == 0.0 and np.isnan(row["first_divergence"])
  assert row["teacher_forced/kl"] < 1e-6 and row["own_prefix/kl"] < 1e-6
  assert row["teacher_forced/flip"] < 1e-4 and row["predicted/diverged_fraction"] < 1e-3
  assert row["histogram"][-1] == len(PROMPTS) and sum(row["histogram"]) == len(PROMPTS)


def test_noise_diverges_and_the_figures_are_consistent(params):
  ecfg = transform.EngineConfig(noise_sigma=0.3, kv=F32_KV)
  row = prefix_shift.prefix_shift(params, CFG, ecfg, PROMPTS, jax.random.key(0), SCFG)
  assert row["diverged_fraction"] > 0
  assert sum(row["histogram"]) == len(PROMPTS)
  assert 0 < row["teacher_forced/tv"] <= row["teacher_forced/flip"] + 1e-6
  assert 0 <= row["censored_first_divergence"] <= SCFG.max_new_tokens
  assert 0 < row["predicted/diverged_fraction"] <= 1
  assert row["own_prefix/kl"] > 0 and row["teacher_forced/kl"] > 0
  # Own-prefix KL is `measure`'s value: the same procedure as the admission check.
  own = measure_lib.measure(params, CFG, ecfg, PROMPTS, jax.random.key(0), SCFG)
  assert row["own_prefix/kl"] == pytest.approx(own["mismatch/kl"], rel=1e-6)


@pytest.mark.parametrize("granularity", ["token_head", "tensor"])
def test_teacher_forced_engine_reproduces_its_own_decode(params, granularity):
  """Scored on its own samples, the one-shot cached forward with the engine's FP8 weights and
  FP8 KV cache gives the distributions the engine sampled from."""
  kv = kvcache.KVCacheSpec("float8_e4m3fn", granularity)
  ecfg = transform.EngineConfig(weights="fp8", kv=kv)
  rollout = measure_lib.engine_rollout(params, CFG, ecfg, PROMPTS, jax.random.key(0), SCFG)
  params_r, _ = measure_lib.engine_inputs(params, ecfg, jax.random.key(0))
  logits = prefix_shift.engine_logits(params_r, rollout.replace(engine_id=""), CFG, kv, 1.0)
  lp = np.asarray(jax.nn.log_softmax(logits), np.float64)
  behaviour = np.asarray(rollout.topk_logprobs, np.float64)
  mask = np.asarray(rollout.completion_mask) > 0
  kl = np.sum(np.exp(behaviour) * (behaviour - lp), axis=-1)[mask]
  assert kl.max() < 1e-4, kl.max()
  # Not vacuous: the unperturbed student differs from the FP8 engine by more.
  dense = np.asarray(
    jax.nn.log_softmax(prefix_shift.engine_logits(params, rollout, CFG, F32_KV, 1.0)), np.float64
  )
  assert np.sum(np.exp(behaviour) * (behaviour - dense), axis=-1)[mask].mean() > 10 * kl.mean()


def test_sources_parse_and_bad_ones_are_named():
  config = bf16_sync.get_config("tiny")
  specs = prefix_shift.source_specs("noise:0.01:0.05")
  assert specs == [
    ("noise:0.01", "rollout.noise_sigma=0.01"),
    ("noise:0.05", "rollout.noise_sigma=0.05"),
  ]
  ecfg = prefix_shift.source_engine(prefix_shift.source_specs("fp8")[0][1], config)
  assert ecfg.weights == "fp8" and ecfg.kv.dtype == "float8_e4m3fn" and ecfg.noise_sigma == 0
  kernel = prefix_shift.source_engine(prefix_shift.source_specs("kernel:bf16_matmul")[0][1], config)
  assert kernel.kernel == "bf16_matmul"
  with pytest.raises(ValueError, match="unknown --source 'fp4'"):
    prefix_shift.source_specs("fp4")
  with pytest.raises(ValueError, match="noise sigma 'x'"):
    prefix_shift.source_specs("noise:x")
  with pytest.raises(ValueError, match="changes"):
    prefix_shift.source_engine("rollout.temperature=0.5", config)
  with pytest.raises(ValueError, match="unfiltered"):
    prefix_shift.check_sampling(SamplerConfig(4, top_k=5), 64)
  with pytest.raises(ValueError, match="temperature > 0"):
    prefix_shift.check_sampling(SamplerConfig(4, temperature=0.0), 64)
