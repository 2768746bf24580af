"""The low-precision KV cache formats side by side: FP8 e4m3 (`rollout.kv_cache=fp8`), FP8 e5m2
(`fp8_e5m2`) and FP4 e2m1 (`fp4`), against f32 values and the uncached forward.

Round trip. A quantized entry stores q̂ = round_fmt(clip(x / s, ±q_max)); with q = x / s,
round-to-nearest obeys |q̂ − q| ≤ err(q) (`kvcache` module docstring):

    e4m3  max(2^-4 |q|, 2^-10)   3 mantissa bits, half of the subnormal step 2^-9
    e5m2  max(2^-3 |q|, 2^-17)   2 mantissa bits, half of the subnormal step 2^-16
    e2m1  max(2^-2 |q|, 2^-2)    1 mantissa bit; grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, spacing
                                 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]: half of it is 0.25
                                 below 2 and at most |q|/4 above

The relative part u = 2^-(m+1) (m mantissa bits) is half a step of the binade, relative to its
lowest value.

so |x̂ − x| ≤ s · err(x / s), each bound checked with 1e-6 relative slack for f32 rounding.

Decode. The cached decode of a tiny random model (prefill, then one token at a time) is compared
with the uncached forward of the same tokens: the log-probabilities differ by the rounding of
the cached keys and values only. The error grows with the format's relative rounding bound u,
so each is bounded by 2u nats (measured: about 1.2u), and fp4's error is above twice e4m3's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from opd_jax import generate
from opd_jax.config import check as config_check
from opd_jax.inference import sampler, transform
from opd_jax.mismatch import candidates as candidates_lib
from opd_jax.mismatch import guard
from opd_jax.model import decode_attention, kvcache, pallas_decode
from opd_jax.model import transformer as model
from opd_jax.train import setup as setup_lib
from opd_jax.train.setup import run_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import base  # noqa: E402
import bf16_sync  # noqa: E402
from conftest import with_rollout  # noqa: E402
from test_decode_attention import _B, _S, _cache_sized, _while_bodies  # noqa: E402
from test_model import CFG  # noqa: E402  (Qwen3, GQA 4/2, q/k norms, biases: L=2, H=16)

E4M3, E5M2, E2M1 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"
# dtype -> (q_max, u = 2^-(m+1) the relative rounding bound of m mantissa bits, the absolute
# error floor below the normal range).
FORMATS = {
  E4M3: (448.0, 2.0**-4, 2.0**-10),
  E5M2: (57344.0, 2.0**-3, 2.0**-17),
  E2M1: (6.0, 2.0**-2, 2.0**-2),
}
# dtype -> storage dtype: e2m1 values are stored as the bytes of their e4m3 values.
STORAGE = {E4M3: jnp.uint8, E5M2: jnp.int8, E2M1: jnp.uint8}

B, S = 2, 8


def _err_bound(q, dtype):
  """err(q) of the module docstring: max(u |q|, floor)."""
  _, u, floor = FORMATS[dtype]
  return np.maximum(u * np.abs(q), floor)


def _slots_first(x_bksh, slots):
  """The first `slots` slots of a [B, K, S, ·] cache array in the model's [B, S, K, ·] layout."""
  return np.swapaxes(np.asarray(x_bksh[:, :, :slots]), 1, 2)


def _wide_kv(seed, tokens):
  """K/V [B, T, K, H] whose heads differ by 30× and whose entries spread over e^±2."""
  rng = np.random.default_rng(seed)
  shape = (B, tokens, CFG.num_kv_heads, CFG.head_dim)
  x = (
    rng.standard_normal(shape) * np.array([1.0, 30.0])[:, None] * np.exp(rng.standard_normal(shape))
  )
  return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_token_head_round_trip_within_the_format_bound(dtype):
  """Five tokens written at slots 1 and 3: every element within s · err(x / s) of its f32 value,
  s = amax / q_max per token and head. In the normal range (|q| ≥ 1) the largest relative error
  is at most u and, for e5m2 and e2m1, above u / 2 (the next finer format's u), so the format is
  the one named: e4m3 stays within 2^-4, e5m2 goes past it, e2m1 past 2^-3."""
  q_max, u, _ = FORMATS[dtype]
  spec = kvcache.KVCacheSpec(dtype=dtype, granularity="token_head")
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  assert entry["k"].dtype == STORAGE[dtype] and entry["k_scale"].shape == (B, 2, S, 1)
  k, v = _wide_kv(0, 5), _wide_kv(1, 5) * 1e-3
  entry = kvcache.write(entry, k, v, jnp.array([1, 3]), spec)
  k_all, v_all = kvcache.read(entry, jnp.float32)
  worst_rel = 0.0
  for name, x, x_all in (("k", k, k_all), ("v", v, v_all)):
    for b, s0 in enumerate((1, 3)):
      x_b = np.asarray(x[b])
      got = np.asarray(x_all[b, s0 : s0 + 5])
      scale = np.swapaxes(np.asarray(entry[name + "_scale"][b, :, s0 : s0 + 5]), 0, 1)
      np.testing.assert_allclose(scale, np.abs(x_b).max(-1, keepdims=True) / q_max, rtol=1e-6)
      q = x_b / scale
      assert np.all(np.abs(got - x_b) <= scale * _err_bound(q, dtype) * (1 + 1e-6))
      normal = np.abs(q) >= 1
      worst_rel = max(worst_rel, (np.abs(got - x_b) / np.abs(x_b))[normal].max())
      # The head's amax maps to ±q_max, a value of every format: it comes back exactly.
      np.testing.assert_allclose(np.abs(got).max(-1), np.abs(x_b).max(-1), rtol=1e-6)
  assert worst_rel <= u * (1 + 1e-6)
  if dtype != E4M3:
    assert worst_rel > u / 2


def test_fp4_bytes_are_e4m3_bits_of_e2m1_values():
  """An fp4 cache holds one value per byte: the e4m3 bits of values on the e2m1 grid (cast to
  e2m1 and back unchanged), equal to round_e2m1(x / s) computed by ml_dtypes."""
  spec = kvcache.KVCacheSpec(dtype=E2M1)
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  k = _wide_kv(2, 4)
  entry = kvcache.write(entry, k, k, jnp.zeros(B, jnp.int32), spec)
  stored = _slots_first(entry["k"], 4).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  on_grid = stored.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np.testing.assert_array_equal(stored, on_grid)
  assert set(np.unique(np.abs(stored))) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
  q = np.clip(np.asarray(k) / _slots_first(entry["k_scale"], 4), -6, 6)
  np.testing.assert_array_equal(stored, q.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
  e5m2 = kvcache.KVCacheSpec(dtype=E5M2)
  entry = kvcache.write(kvcache.init_cache(CFG, B, S, e5m2)[0], k, k, jnp.zeros(B, jnp.int32), e5m2)
  got = _slots_first(entry["k"], 4).view(ml_dtypes.float8_e5m2).astype(np.float32)
  q = np.asarray(k) / _slots_first(entry["k_scale"], 4)
  np.testing.assert_array_equal(got, q.astype(ml_dtypes.float8_e5m2).astype(np.float32))


@pytest.mark.parametrize("dtype", [E5M2, E2M1])
def test_tensor_scale_uses_the_format_max(dtype):
  """ "tensor" granularity: s = headroom · amax / q_max from the prefill, then frozen; the prefill
  round-trips within s · err, and a later token 100× larger saturates at ±q_max · s and is
  counted as clipped."""
  q_max, _, _ = FORMATS[dtype]
  spec = kvcache.KVCacheSpec(dtype=dtype, granularity="tensor", tensor_headroom=2.0)
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  x0 = _wide_kv(3, 4)
  entry = kvcache.write(entry, x0, x0, jnp.zeros(B, jnp.int32), spec)
  scale = np.asarray(entry["k_scale"]).reshape(B)
  np.testing.assert_allclose(scale, 2.0 * np.abs(np.asarray(x0)).max((1, 2, 3)) / q_max, rtol=1e-6)
  got = np.asarray(kvcache.read(entry, jnp.float32)[0][:, :4])
  s = scale[:, None, None, None]
  assert np.all(
    np.abs(got - np.asarray(x0)) <= s * _err_bound(np.asarray(x0) / s, dtype) * 1.000001
  )
  assert np.all(np.asarray(entry["k_clipped"]) == 0)
  x1 = jnp.full((B, 1, 2, 16), 100.0) * jnp.abs(x0).max()
  entry = kvcache.write(entry, x1, x1, jnp.full(B, 4), spec)
  np.testing.assert_array_equal(np.asarray(entry["k_scale"]).reshape(B), scale)
  sat = np.asarray(kvcache.read(entry, jnp.float32)[0][:, 4])
  np.testing.assert_allclose(sat, np.broadcast_to(q_max * s[..., 0], sat.shape), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(entry["k_clipped"]), [2 * 16] * B)


@pytest.mark.parametrize("dtype", [E5M2, E2M1])
def test_layout_bf16_layers_and_bytes(dtype):
  """Every quantized format keeps `bf16_layers` in BF16 and costs FP8's bytes: one byte per
  value (FP4 is not packed two per byte), 2·K·(H+4)·L = 160 with per-token scales and
  2·K·H·L + L·2·4/S = 130 with per-tensor ones (K=2, H=16, L=2, S=8)."""
  spec = kvcache.KVCacheSpec(dtype=dtype, bf16_layers=(1,))
  cache = kvcache.init_cache(CFG, B, S, spec)
  assert set(cache[0]) == {"k", "v", "k_scale", "v_scale"}
  assert cache[0]["v"].dtype == STORAGE[dtype]
  assert set(cache[1]) == {"k", "v"} and cache[1]["k"].dtype == jnp.uint16
  for gran, want in (("token_head", 160), ("tensor", 130)):
    for d in (E4M3, dtype):
      one = kvcache.KVCacheSpec(dtype=d, granularity=gran)
      assert kvcache.bytes_per_token(kvcache.init_cache(CFG, B, S, one)) == want
      assert kvcache.bytes_per_token(kvcache.abstract_cache(CFG, B, S, one)) == want


def test_q_max_per_format_and_bad_dtypes_are_named():
  assert [kvcache.KVCacheSpec(dtype=d).q_max for d in FORMATS] == [448.0, 57344.0, 6.0]
  with pytest.raises(ValueError, match="'bfloat16' is not quantized; quantized: float8_e4m3fn"):
    _ = kvcache.KVCacheSpec(dtype="bfloat16").q_max
  with pytest.raises(ValueError, match="'float4_e2m1'.*float8_e5m2, float4_e2m1fn"):
    kvcache.KVCacheSpec(dtype="float4_e2m1")
  # An e4m3 cache (uint8) written with an e5m2 spec would cast e5m2 values past 448 to NaN.
  entry = kvcache.init_cache(CFG, B, S, kvcache.KVCacheSpec(dtype=E4M3))[0]
  x = jnp.ones((B, 1, 2, 16))
  with pytest.raises(ValueError, match="stored as uint8 cannot take a float8_e5m2 write"):
    kvcache.write(entry, x, x, jnp.zeros(B, jnp.int32), kvcache.KVCacheSpec(dtype=E5M2))


def _random_params(seed):
  """N(0, 0.1²) matrices and biases, norms 1 + N(0, 0.05²) (drawn with numpy: fast on CPU)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: model.init_params(jax.random.key(0), CFG))

  def draw(path, leaf):
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    return jnp.asarray(1.0 + 0.05 * noise if "norm" in jax.tree_util.keystr(path) else 0.1 * noise)

  return jax.tree_util.tree_map_with_path(draw, shapes)


_cached = jax.jit(model.forward_with_cache, static_argnums=(4, 5))


def _decode_logprob_error(params, tokens_bt, spec):
  """|log p_cached − log p_uncached| [B, T, V]: every token decoded one at a time through the
  cache (one compilation per format: each step has the decode's shape)."""
  b, t = tokens_bt.shape
  ref = jax.nn.log_softmax(model.forward(params, jnp.asarray(tokens_bt), CFG), -1)
  cache = kvcache.init_cache(CFG, b, 16, spec)
  out = []
  for pos in range(t):
    step = jnp.asarray(tokens_bt[:, pos : pos + 1])
    logits, cache = _cached(params, step, jnp.full(b, pos, jnp.int32), cache, CFG, spec)
    out.append(logits)
  return np.abs(np.asarray(jax.nn.log_softmax(jnp.concatenate(out, 1), -1) - ref))


def test_cached_decode_against_uncached_forward_per_format():
  """Ten tokens decoded one at a time with per-token-and-head scales: each format within 2u nats
  of the uncached forward (u = 2^-4, 2^-3, 2^-2; measured about 1.2u: 0.073, 0.140, 0.294), and
  fp4's error above twice e4m3's (the format did change). An f32 cache equals the forward to f32
  rounding (tests/model/test_model.py)."""
  params = _random_params(0)
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 10))
  worst = {}
  for dtype, (_, u, _) in FORMATS.items():
    err = _decode_logprob_error(params, tokens, kvcache.KVCacheSpec(dtype=dtype))
    worst[dtype] = err.max()
    assert 1e-3 < worst[dtype] <= 2 * u, (dtype, worst[dtype])
  assert worst[E2M1] > 2 * worst[E4M3], worst
  assert worst[E5M2] > worst[E4M3], worst


@pytest.mark.parametrize("dtype", [E5M2, E2M1])
def test_blockwise_and_pallas_read_the_new_formats(dtype):
  """The blockwise attention and the Pallas kernel (interpret mode) decode int8 e5m2 bits and
  e4m3-coded e2m1 bytes as `kvcache.read` does: equal to the dense reference to f32 rounding."""
  spec = kvcache.KVCacheSpec(dtype=dtype)
  rng = np.random.default_rng(4)
  shape = (2, 12, CFG.num_kv_heads, CFG.head_dim)
  k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
  entry = kvcache.write(
    kvcache.init_cache(CFG, 2, 12, spec)[0], k, v, jnp.zeros(2, jnp.int32), spec
  )
  q = jnp.asarray(rng.standard_normal((2, 1, CFG.num_heads, CFG.head_dim)), jnp.float32)
  q_pos_bt = jnp.asarray([[11], [5]], jnp.int32)
  keys, values = kvcache.read(entry, jnp.float32)
  slots = jnp.broadcast_to(jnp.arange(12), (2, 12))
  want = model.attend(q, keys, values, q_pos_bt, slots, CFG, "reference")
  blockwise = decode_attention.attend_cache(q, entry, q_pos_bt, CFG, block=4)
  pallas = pallas_decode.attend_cache(q, entry, q_pos_bt, CFG, block=4, driver="loop")
  for got in (blockwise, pallas):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_compiled_decode_loop_keeps_e5m2_in_its_int8_storage():
  """The sampler's program on an e5m2 cache of [4, 600, 2, 16] (the detector's shape: this K and
  H are test_decode_attention's): the cache exists only as int8, and the
  decode loop touches it only by the new token's in-place scatters (as for e4m3, in
  tests/model/test_decode_attention.py)."""
  params = model.init_params(jax.random.key(0), CFG)
  spec = kvcache.KVCacheSpec(dtype=E5M2)
  scfg = sampler.SamplerConfig(max_new_tokens=3, temperature=0.0, kv=spec, cache_len=_S)
  prompts = [[1, 2, 3], [4, 5], [1], [3, 3]]
  assert len(prompts) == _B
  hlo = sampler.sample_program(params, prompts, jax.random.key(0), scfg, CFG).compile().as_text()
  ops = _cache_sized(hlo)
  assert ops and {d for _, d, _, _ in ops} == {"s8"}, ops
  in_loop = [op for op in ops if op[0] in _while_bodies(hlo)]
  assert len(in_loop) == 2 * CFG.num_layers, in_loop
  assert all(o == "fusion" and root == "scatter" for _, _, o, root in in_loop), in_loop


# --- config names, engine ids and sources -----------------------------------------------------


def test_config_names_map_to_the_cache_dtypes():
  allowed = config_check.RULES["rollout.kv_cache"].options
  assert allowed == ("auto", *kvcache.KV_CACHE_NAMES)
  assert allowed == generate.KV_CACHES
  for name, dtype in (("fp8_e5m2", E5M2), ("fp4", E2M1), ("fp8", E4M3)):
    assert generate.engine_numerics("trainer", name, "float32") == ("trainer", dtype)
    config = base.get_config()
    config.rollout.kv_cache = name
    config.rollout.kv_granularity = "tensor"
    config_check.validate(config)
    engine = setup_lib.engine_config(run_spec(config), "float32")
    assert engine.kv == kvcache.KVCacheSpec(dtype=dtype, granularity="tensor")
    label = {"fp8": "fp8", "fp8_e5m2": "fp8_e5m2", "fp4": "fp4"}[name]
    assert engine.engine_id == f"w=trainer,kv={label}/tensor,noise=0"
  kv = kvcache.KVCacheSpec(dtype=E2M1, bf16_layers=(0,))
  assert transform.EngineConfig(kv=kv).engine_id == "w=trainer,kv=fp4/token_head+bf16[0],noise=0"
  scfg = sampler.SamplerConfig(max_new_tokens=1, kv=kvcache.KVCacheSpec(dtype=E5M2))
  params = {"embed_vd": jnp.zeros((4, 2), jnp.float32)}
  assert sampler.engine_label(params, scfg).startswith("w=float32,kv=float8_e5m2/token_head,")


@pytest.fixture(scope="module")
def tiny():
  return bf16_sync.get_config("tiny")


@pytest.mark.parametrize(
  "base_rollout, spec, sources",
  [
    ({}, "rollout.kv_cache=fp8_e5m2", "fp8_e5m2_kv"),
    ({}, "rollout.kv_cache=fp4", "fp4_kv"),
    ({}, "rollout.kv_cache=fp4,rollout.kv_granularity=tensor", "fp4_kv"),
    ({"kv_cache": "fp4"}, "rollout.kv_granularity=tensor", "fp4_kv"),
    ({"kv_cache": "fp8_e5m2"}, "rollout.kv_bf16_layers=(0,)", "fp8_e5m2_kv"),
    ({"kv_cache": "fp8"}, "rollout.kv_cache=fp4", "fp4_kv"),
    ({}, "rollout.weights=fp8,rollout.kv_cache=fp8_e5m2", "fp8_weights+fp8_e5m2_kv"),
    (
      {},
      "rollout.weights=fp4,rollout.weight_group_size=32,rollout.kv_cache=fp4",
      "fp4_weights+fp4_kv",
    ),
    ({"kv_cache": "fp4"}, "rollout.kv_cache=auto", "reference"),
  ],
)
def test_candidate_sources_of_the_new_formats(tiny, base_rollout, spec, sources):
  c = candidates_lib.parse_candidate(spec, with_rollout(tiny, **base_rollout))
  assert candidates_lib.candidate_source(c) == sources


def test_bad_kv_cache_value_is_named(tiny):
  with pytest.raises(
    ValueError, match="rollout.kv_cache must be one of auto, bf16, fp8, fp8_e5m2, fp4"
  ):
    candidates_lib.parse_candidate("rollout.kv_cache=fp6", tiny)


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2", "fp4"])
def test_guard_falls_back_from_every_quantized_cache_to_bf16(name):
  rollout = dict(base.get_config().rollout.to_dict(), kv_cache=name)
  rungs = guard.fallback_ladder(rollout)
  assert rungs[1].name == "kv bf16" and rungs[1].overrides == {"kv_cache": "bf16"}
  assert len(guard.fallback_ladder(dict(rollout, kv_cache="bf16"))) == len(rungs) - 1


def test_the_scale_granularity_is_read_from_both_axes():
  """One slot alone does not make a per-sequence scale: a one-slot token/head cache with two
  KV heads keeps one scale per head (the Pallas reader would give every head head 0's)."""
  assert kvcache.is_tensor_scale(jnp.ones((3, 1, 1, 1)))
  assert not kvcache.is_tensor_scale(jnp.ones((3, 2, 1, 1)))
  assert not kvcache.is_tensor_scale(jnp.ones((3, 2, 8, 1)))
