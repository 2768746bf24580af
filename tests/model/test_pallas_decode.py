"""The Pallas decode-attention kernel (`model/pallas_decode.py`), run in Pallas' interpret mode
on the CPU, against the XLA blockwise path; its selection through `rollout.decode_attention`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

from opd_jax.config import check as config_check
from opd_jax.inference import sampler
from opd_jax.model import decode_attention, kvcache, pallas_decode
from opd_jax.model import transformer as model
from opd_jax.train import setup as setup_lib
from opd_jax.train.setup import run_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))

import base  # noqa: E402

# The model shape (GQA: N = 4 query heads over K = 2 KV heads, head_dim 16 ≠ D / N), the four
# cache formats and the filled caches are the blockwise tests', so both compare the same cases.
from test_decode_attention import CFG, SPECS, _f32, _filled_entry  # noqa: E402


def _queries(batch, tokens, seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((batch, tokens, CFG.num_heads, CFG.head_dim)), dtype)


@pytest.mark.parametrize("driver", pallas_decode.DRIVERS)
@pytest.mark.parametrize("kv", list(SPECS))
@pytest.mark.parametrize("tokens", [1, 3])
def test_kernel_equals_blockwise(kv, tokens, driver):
  """20 slots in blocks of 8 (three blocks; the last one clamped to slots 12..19 by the
  "loop" driver, read past the end and masked by the "grid" one), three rows stopping in
  different blocks, one in the first: equal to the blockwise path to f32 rounding. A query
  one position short differs (the comparison can fail)."""
  entry = _filled_entry(SPECS[kv], 3, 20, seed=0)
  q = _queries(3, tokens, seed=1)
  last_b = np.array([19, 6, 13])
  q_pos_bt = jnp.asarray(last_b[:, None] - np.arange(tokens)[::-1][None, :], jnp.int32)
  want = decode_attention.attend_cache(q, entry, q_pos_bt, CFG, block=8)
  got = pallas_decode.attend_cache(q, entry, q_pos_bt, CFG, block=8, driver=driver)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
  short = pallas_decode.attend_cache(q, entry, q_pos_bt - 1, CFG, block=8, driver=driver)
  assert np.abs(np.asarray(short) - np.asarray(want)).max() > 1e-3


@pytest.mark.parametrize("driver", pallas_decode.DRIVERS)
def test_one_kv_head_and_a_block_larger_than_the_cache(driver):
  """MQA (K = 1, G = 4 query heads on it) over an fp8 tensor-scaled cache of 12 slots with
  block 256 > S (the kernel's blocks: 8 slots, the power of two below S, the second clamped
  to slots 4..11), T = 2: equal to the blockwise path (one block of 12)."""
  mqa = dataclasses.replace(CFG, num_kv_heads=1)
  spec = SPECS["fp8_tensor"]
  rng = np.random.default_rng(6)
  shape = (2, 12, 1, CFG.head_dim)
  entry = kvcache.init_cache(mqa, 2, 12, spec)[0]
  k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
  entry = kvcache.write(entry, k, v, jnp.zeros(2, jnp.int32), spec)
  q = _queries(2, 2, seed=7)
  q_pos_bt = jnp.asarray([[10, 11], [2, 3]], jnp.int32)
  want = decode_attention.attend_cache(q, entry, q_pos_bt, mqa)
  got = pallas_decode.attend_cache(q, entry, q_pos_bt, mqa, driver=driver)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("driver", pallas_decode.DRIVERS)
def test_bf16_activations_equal_blockwise(driver):
  """bf16 queries over an FP8 cache: each block dequantized and rounded to bf16 as in the
  blockwise path, the output rounded to bf16; equal to one bf16 ulp."""
  entry = _filled_entry(SPECS["fp8_token_head"], 2, 20, seed=2)
  q16 = _queries(2, 1, seed=3, dtype=jnp.bfloat16)
  q_pos_bt = jnp.asarray([[17], [9]], jnp.int32)
  want = decode_attention.attend_cache(q16, entry, q_pos_bt, CFG, block=8)
  got = pallas_decode.attend_cache(q16, entry, q_pos_bt, CFG, block=8, driver=driver)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(_f32(got), _f32(want), atol=8e-3, rtol=8e-3)


@pytest.mark.parametrize("driver", pallas_decode.DRIVERS)
def test_unvisited_and_stale_slots_are_never_read(driver):
  """Slots after each row's position hold NaN bits (bf16 storage): the kernel's result stays
  finite and equals the blockwise one on the clean cache. Row 1 stops in its first block, so
  the other slots of that block are masked and their values zeroed before P·V."""
  entry = _filled_entry(SPECS["bf16"], 2, 24, seed=4)
  q_pos_bt = jnp.asarray([[15], [3]], jnp.int32)
  nan_bits = jax.lax.bitcast_convert_type(jnp.bfloat16(jnp.nan), jnp.uint16)
  after_bs = np.arange(24)[None, :] > np.asarray(q_pos_bt)
  poison = jnp.asarray(after_bs)[:, None, :, None]  # [B, 1, S, 1] over the [B, K, S, H] cache
  poisoned = dict(
    entry, k=jnp.where(poison, nan_bits, entry["k"]), v=jnp.where(poison, nan_bits, entry["v"])
  )
  q = _queries(2, 1, seed=5)
  got = pallas_decode.attend_cache(q, poisoned, q_pos_bt, CFG, block=8, driver=driver)
  want = decode_attention.attend_cache(q, entry, q_pos_bt, CFG, block=8)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kv", list(SPECS))
def test_grid_driver_under_the_tpu_interpreter(kv):
  """The "grid" driver under Pallas' TPU interpreter, which simulates Mosaic's memories and
  the pipeline's copies: an out-of-bounds read raises (the last block of 20 slots in blocks
  of 8 runs past S and must be handled as an edge block) and uninitialised memory reads as
  NaN. Equal to the blockwise path, GQA, ragged rows, T = 2."""
  params = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
  entry = _filled_entry(SPECS[kv], 3, 20, seed=8)
  q = _queries(3, 2, seed=9)
  q_pos_bt = jnp.asarray([[18, 19], [5, 6], [12, 13]], jnp.int32)
  want = decode_attention.attend_cache(q, entry, q_pos_bt, CFG, block=8)
  got = pallas_decode.attend_cache(
    q, entry, q_pos_bt, CFG, block=8, driver="grid", interpret=params
  )
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kv", list(SPECS))
@pytest.mark.parametrize(
  ("platform", "driver", "custom_call"),
  [("tpu", "grid", "tpu_custom_call"), ("cuda", "loop", "__gpu$xla.gpu.triton")],
)
def test_kernels_lower_for_their_hardware(kv, platform, driver, custom_call):
  """`jax.export` for a platform this jaxlib cannot run lowers the "grid" driver through
  Pallas' Mosaic TPU rules and the "loop" driver through its Triton rules (tiling and
  power-of-two shape checks included) to their custom calls: 40 slots in blocks of 16, the
  last one partial. Only the lowering is checked: Mosaic and Triton themselves do not run."""
  entry = _filled_entry(SPECS[kv], 2, 40, seed=10)
  q = _queries(2, 1, seed=11, dtype=jnp.bfloat16)
  q_pos_bt = jnp.asarray([[39], [6]], jnp.int32)

  def attend(q, entry, q_pos_bt):
    return pallas_decode.attend_cache(
      q, entry, q_pos_bt, CFG, block=16, driver=driver, interpret=False
    )

  triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # no stable ABI
  exported = export.export(jax.jit(attend), platforms=[platform], disabled_checks=[triton])(
    q, entry, q_pos_bt
  )
  text = exported.mlir_module()
  assert f"stablehlo.custom_call @{custom_call}" in text


def test_forward_with_cache_runs_the_kernel_for_decode_only():
  """attention="pallas" puts a pallas_call in a one-token step and none in a prefill of more
  than MAX_QUERIES tokens (which keeps the blockwise path)."""
  params = model.init_params(jax.random.key(0), CFG, scale=0.3)
  cache = kvcache.init_cache(CFG, 2, 16, SPECS["bf16"])

  def program(tokens):
    def step(params, cache):
      start = jnp.zeros(2, jnp.int32)
      return model.forward_with_cache(params, tokens, start, cache, CFG, attention="pallas")

    return str(jax.make_jaxpr(step)(params, cache))

  assert "pallas_call" in program(jnp.zeros((2, 1), jnp.int32))
  assert "pallas_call" not in program(jnp.zeros((2, pallas_decode.MAX_QUERIES + 1), jnp.int32))


@pytest.mark.parametrize("kv", ["bf16", "fp8_tensor"])
def test_greedy_sampler_tokens_identical_to_blockwise(kv):
  """The jitted sampler (prefill, then the decode while loop) on ragged prompts, greedy,
  12 new tokens in a 32-slot cache: identical tokens and model log-probabilities equal to f32
  rounding with SamplerConfig(attention="pallas") and "blockwise". The pallas program holds
  the kernel (its name is in the lowered program's locations); the blockwise one does not."""
  params = model.init_params(jax.random.key(0), CFG, scale=0.3)
  prompts = [[5, 9], [3, 1, 4, 1, 5, 9, 2], [7] * 11]
  runs = {}
  for attention in ("blockwise", "pallas"):
    cfg = sampler.SamplerConfig(
      max_new_tokens=12, temperature=0.0, cache_len=32, kv=SPECS[kv], attention=attention
    )
    runs[attention] = sampler.sample(params, prompts, jax.random.key(1), cfg, CFG)
    program = sampler.sample_program(params, prompts, jax.random.key(1), cfg, CFG)
    kernels = program.as_text(debug_info=True).count("opd_decode_attention")
    assert (kernels > 0) == (attention == "pallas")
  got, want = runs["pallas"], runs["blockwise"]
  np.testing.assert_array_equal(
    np.asarray(got.completion_tokens), np.asarray(want.completion_tokens)
  )
  np.testing.assert_allclose(
    np.asarray(got.model_logprobs), np.asarray(want.model_logprobs), atol=1e-4, rtol=0
  )
  assert len(np.unique(np.asarray(want.completion_tokens))) > 3  # not one repeated token


def test_config_key_selects_and_refuses():
  """rollout.decode_attention reaches the SamplerConfig; an unknown value is refused by the
  config check and by SamplerConfig itself."""
  config = base.get_config()
  assert config.rollout.decode_attention == "auto"
  config.rollout.decode_attention = "pallas"
  config_check.validate(config)
  scfg = setup_lib.sampler_config(run_spec(config), 0, SPECS["bf16"], 64)
  assert scfg.attention == "pallas"
  hash(scfg)  # a jit static argument
  config.rollout.decode_attention = "flash"
  with pytest.raises(ValueError, match="config.rollout.decode_attention must be one of"):
    config_check.validate(config)
  with pytest.raises(ValueError, match="unknown attention 'flash'"):
    sampler.SamplerConfig(max_new_tokens=1, attention="flash")
