"""The rollout engine's weight transform T(θ): fp8 prepared once per version, same samples."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.config import check as config_check
from opd_jax.inference import sampler, transform
from opd_jax.inference.sampler import SamplerConfig
from opd_jax.model import kvcache, quant, quant_compute
from opd_jax.model import transformer as model
from opd_jax.train import setup as setup_lib
from opd_jax.train.setup import run_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import base  # noqa: E402
from conftest import tiny_model_cfg

CFG = tiny_model_cfg()
PROMPTS = [[3, 17, 9, 4, 100], list(range(20, 31)), [7], [5] * 14]
FP8_KV = kvcache.KVCacheSpec(dtype="float8_e4m3fn")


@pytest.fixture(scope="module")
def params():
  return model.init_params(jax.random.key(0), CFG, scale=0.3)


def _is_qarray(x) -> bool:
  return isinstance(x, quant.QArray)


@pytest.mark.parametrize("block_size", [None, 16])
def test_fp8_engine_params_are_the_dequantized_recipe(params, block_size):
  cfg = transform.EngineConfig(
    weights="fp8", weight_block_size=block_size, bf16_layers=(1,), kv=FP8_KV
  )
  prepared = transform.engine_params(params, cfg, jax.random.key(0))
  recipe = quant.QuantRecipe(block_size=block_size, bf16_layers=(1,))
  qparams = quant.quantize_params(params, recipe)
  # CPU has no FP8 matmuls: every matrix is dense, equal to the QArray's dequantization.
  assert not any(_is_qarray(x) for x in jax.tree.leaves(prepared, is_leaf=_is_qarray))
  expected = quant.dequantize_params(qparams, jnp.float32)
  for a, b in zip(jax.tree.leaves(prepared), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Layer 0 really is quantized (differs from θ), layer 1 is kept.
  assert not np.array_equal(prepared["layers"][0]["q_dnh"], params["layers"][0]["q_dnh"])
  np.testing.assert_array_equal(prepared["layers"][1]["q_dnh"], params["layers"][1]["q_dnh"])
  # The trainer applies T under jit (once per version): same weights as eager.
  jitted = jax.jit(transform.engine_params, static_argnums=1)(params, cfg, jax.random.key(0))
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(prepared), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The id names the recipe, not the hardware layout.
  kv_part = "kv=fp8/token_head,noise=0"
  block = "ch" if block_size is None else f"b{block_size}"
  assert cfg.engine_id == f"w=fp8/{block}+bf16[1],{kv_part}"


@pytest.mark.parametrize(
  "scfg",
  [
    SamplerConfig(max_new_tokens=8, temperature=0.0, kv=FP8_KV),
    SamplerConfig(max_new_tokens=8, temperature=1.0, return_topk=-1, kv=FP8_KV),
  ],
  ids=["greedy", "sampled-full-distribution"],
)
def test_prepared_fp8_samples_like_per_step_dequantization(params, scfg):
  """The engine's fp8 params sample exactly what the unprepared QArrays sample."""
  cfg = transform.EngineConfig(weights="fp8", kv=FP8_KV)
  prepared = transform.engine_params(params, cfg, jax.random.key(0))
  qparams = quant.quantize_params(params, quant.QuantRecipe())
  rng = jax.random.key(5)
  fast = sampler.sample(prepared, PROMPTS, rng, scfg, CFG, engine_id=cfg.engine_id)
  slow = sampler.sample(qparams, PROMPTS, rng, scfg, CFG, engine_id=cfg.engine_id)
  np.testing.assert_array_equal(fast.completion_tokens, slow.completion_tokens)
  np.testing.assert_array_equal(fast.completion_mask, slow.completion_mask)
  np.testing.assert_array_equal(fast.behaviour_logprobs, slow.behaviour_logprobs)
  np.testing.assert_array_equal(fast.model_logprobs, slow.model_logprobs)
  if scfg.return_topk:
    np.testing.assert_array_equal(fast.topk_logprobs, slow.topk_logprobs)
  assert fast.engine_id == slow.engine_id == cfg.engine_id
  # Not vacuous: the fp8 engine differs from the trainer's weights.
  dense = sampler.sample(params, PROMPTS, rng, scfg, CFG)
  assert not np.array_equal(np.asarray(fast.model_logprobs), np.asarray(dense.model_logprobs))


def test_native_fp8_layout_samples_close_to_emulated(params):
  """W8A8 (the layout on FP8 hardware, forced here) through the whole sampler loop."""
  qparams = quant.quantize_params(params, quant.QuantRecipe())
  native = quant_compute.prepare_for_compute(qparams, native_fp8=True)
  scfg = SamplerConfig(max_new_tokens=8, temperature=1.0, return_topk=-1, kv=FP8_KV)
  rng = jax.random.key(5)
  ref = sampler.sample(qparams, PROMPTS, rng, scfg, CFG)
  out = sampler.sample(native, PROMPTS, rng, scfg, CFG)
  # Step c of row b is conditioned on the same prefix in both engines while their tokens
  # agree before c (always at c = 0), so their behaviour distributions are comparable there.
  tokens_ref, tokens_nat = np.asarray(ref.completion_tokens), np.asarray(out.completion_tokens)
  same_prefix_bc = np.cumprod(tokens_ref == tokens_nat, axis=1)
  same_prefix_bc = np.concatenate([np.ones_like(same_prefix_bc[:, :1]), same_prefix_bc[:, :-1]], 1)
  lp_ref = np.asarray(ref.topk_logprobs, np.float64)
  lp_nat = np.asarray(out.topk_logprobs, np.float64)
  kl_bc = np.sum(np.exp(lp_ref) * (lp_ref - lp_nat), axis=-1)
  kl = kl_bc[same_prefix_bc.astype(bool)]
  # Same bound as test_quant.test_native_w8a8_forward_close_to_emulated (0.07 nats, mean).
  assert kl.size >= len(PROMPTS) and 1e-5 < float(np.mean(kl)) < 0.07, kl


def _matrices(params):
  """{path string: array} of every leaf, for comparing engines matrix by matrix."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(p): np.asarray(w) for p, w in flat}


def test_restricted_noise_is_the_full_noise_on_the_selected_matrices(params):
  full = _matrices(transform.add_weight_noise(params, 0.1, jax.random.key(3)))
  base = _matrices(params)
  cases = {
    ((1,), ()): lambda k: "['layers'][1]" in k,
    ((), ("attention",)): lambda k: any(f"'{m}_" in k for m in "qkvo"),
    ((0,), ("mlp",)): lambda k: (
      "['layers'][0]" in k and any(m in k for m in ("gate", "up", "down"))
    ),
    ((), ("embed", "lm_head")): lambda k: "embed_vd" in k or "lm_head_dv" in k,
  }
  for (layers, modules), selected in cases.items():
    noisy = _matrices(transform.add_weight_noise(params, 0.1, jax.random.key(3), layers, modules))
    changed = {k for k in noisy if not np.array_equal(noisy[k], base[k])}
    assert changed == {k for k in base if selected(k) and base[k].ndim >= 2}, (layers, modules)
    for k in changed:
      np.testing.assert_array_equal(noisy[k], full[k])


def test_engine_settings_are_named_and_checked():
  cfg = transform.EngineConfig(noise_sigma=0.05, noise_layers=(0, 1), noise_modules=("attention",))
  assert cfg.engine_id == "w=trainer,kv=bfloat16,noise=0.05@L[0, 1]@attention"
  kernel = transform.EngineConfig(kernel="bf16_attention")
  assert kernel.engine_id == "w=trainer,kv=bfloat16,noise=0,kernel=bf16_attention"
  assert transform.EngineConfig().engine_id == "w=trainer,kv=bfloat16,noise=0"
  with pytest.raises(ValueError, match="unknown module 'mlp_up'"):
    transform.EngineConfig(noise_sigma=0.1, noise_modules=("mlp_up",))
  with pytest.raises(ValueError, match="noise_sigma is 0"):
    transform.EngineConfig(noise_layers=(0,))
  with pytest.raises(ValueError, match="selects no matrix"):
    transform.EngineConfig(noise_sigma=0.1, noise_layers=(0,), noise_modules=("embeddings",))
  with pytest.raises(ValueError, match="unknown kernel 'flash'"):
    transform.EngineConfig(kernel="flash")
  with pytest.raises(ValueError, match="noise_layers must be"):
    transform.EngineConfig(noise_sigma=0.1, noise_layers=(-1,))


def test_noise_layer_out_of_range_is_named(params):
  cfg = transform.EngineConfig(noise_sigma=0.1, noise_layers=(2,))
  with pytest.raises(ValueError, match=r"noise_layers \[2\] out of range for a 2-layer model"):
    transform.engine_params(params, cfg, jax.random.key(0))


@pytest.mark.parametrize("kernel", ["bf16_attention", "bf16_matmul"])
def test_kernel_variant_cached_decode_matches_its_uncached_forward(params, kernel):
  """The variant runs through the sampler's cached decode and the teacher-forced forward
  alike, and moves the distribution away from the reference path by bf16 rounding.

  bf16 rounding is discontinuous: the cached and uncached forwards differ by f32 rounding
  upstream of the rounded scores, which flips a few bf16 roundings, so the two agree to a
  KL well below the variant's own, not bit for bit."""
  cfg = transform.EngineConfig(kernel=kernel, kv=kvcache.KVCacheSpec(dtype="float32"))
  params_r = transform.engine_params(params, cfg, jax.random.key(0))
  assert model.kernel_of(params_r) == kernel and model.kernel_of(params) == "reference"
  scfg = SamplerConfig(max_new_tokens=6, kv=cfg.kv, return_topk=-1)
  out = sampler.sample(params_r, PROMPTS, jax.random.key(1), scfg, CFG, engine_id=cfg.engine_id)
  seq = out.sequences()
  idx_bc1 = np.asarray(seq.logit_index_bc)[..., None]
  mask_bc = np.asarray(out.completion_mask) > 0

  def logprobs(p):
    logits_btv = np.asarray(model.forward(p, seq.tokens_bt, CFG), np.float64)
    return np.asarray(jax.nn.log_softmax(np.take_along_axis(logits_btv, idx_bc1, 1), -1))

  def mean_kl(lp_a, lp_b):
    return float(np.sum(np.exp(lp_a) * (lp_a - lp_b), axis=-1)[mask_bc].mean())

  cached = np.asarray(out.topk_logprobs, np.float64)
  uncached, reference = logprobs(params_r), logprobs(params)
  variant_kl = mean_kl(uncached, reference)
  assert 1e-6 < variant_kl < 1e-2, variant_kl
  assert mean_kl(cached, uncached) < 0.5 * variant_kl


def test_rollout_config_keys_reach_the_engine():
  config = base.get_config()
  config.rollout.noise_sigma = 0.02
  config.rollout.noise_layers = (1,)
  config.rollout.noise_modules = ("attention", "embed")
  config.rollout.kernel = "bf16_matmul"
  config_check.validate(config)
  ecfg = setup_lib.engine_config(run_spec(config), "float32")
  assert (ecfg.noise_layers, ecfg.noise_modules, ecfg.kernel) == (
    (1,),
    ("attention", "embed"),
    "bf16_matmul",
  )
  assert ecfg.engine_id == "w=trainer,kv=float32,noise=0.02@L[1]@attention+embed,kernel=bf16_matmul"
  config.rollout.noise_modules = ("attn",)
  with pytest.raises(ValueError, match=r"config.rollout.noise_modules has unknown 'attn'"):
    config_check.validate(config)
  config.rollout.noise_modules = ()
  config.rollout.kernel = "flash"
  with pytest.raises(ValueError, match="config.rollout.kernel must be one of"):
    config_check.validate(config)


@pytest.mark.parametrize("spec", ["rollout.stale_k=64", "rollout.mode=async,rollout.max_lag=64"])
def test_staleness_up_to_64_is_accepted_and_its_checkpoints_named(spec):
  """No config bound stops k = 64; measuring it needs θ_t and θ_(t−64), which the admission
  check asks for by name before anything is built."""
  from opd_jax.mismatch import admission
  from opd_jax.mismatch import candidates as candidates_lib

  config = base.get_config("tiny")
  candidate = candidates_lib.parse_candidate(spec, config)
  assert candidate.lag == 64
  assert candidates_lib.candidate_source(candidate) == "stale"
  problem = admission.stale_lag_problem(candidate, None)
  assert "--params-from=RUN with checkpoints at steps t and t-64" in problem
  assert "--config.train.keep_checkpoints=65 or more" in problem
