"""KV cache layout, write/read round trips, fp8 scales, byte accounting and the capacity bench."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.bench import kv_capacity
from opd_jax.model import kvcache
from opd_jax.model.config import ModelConfig

# L=3, K=2, H=16.
CFG = ModelConfig(
  model_type="llama",
  vocab_size=32,
  hidden_size=32,
  intermediate_size=64,
  num_layers=3,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
)
B, S = 2, 8
FP8 = "float8_e4m3fn"


def _f32(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


@pytest.mark.parametrize("granularity", ["token_head", "tensor"])
def test_init_cache_layout_with_bf16_layers(granularity):
  spec = kvcache.KVCacheSpec(dtype=FP8, granularity=granularity, bf16_layers=(1,))
  cache = kvcache.init_cache(CFG, B, S, spec)
  assert len(cache) == 3
  scale_shape = (B, 2, S, 1) if granularity == "token_head" else (B, 1, 1, 1)
  for layer in (0, 2):
    entry = cache[layer]
    assert set(entry) == {"k", "v", "k_scale", "v_scale"}
    for name in ("k", "v"):
      # e4m3 values stored as their bytes (kvcache module docstring: "Why uint8").
      assert entry[name].shape == (B, 2, S, 16) and entry[name].dtype == jnp.uint8
      assert entry[name + "_scale"].shape == scale_shape
      assert entry[name + "_scale"].dtype == jnp.float32
  assert set(cache[1]) == {"k", "v"}
  assert cache[1]["k"].shape == (B, 2, S, 16) and cache[1]["k"].dtype == jnp.uint16  # bf16 bits
  # Non-fp8 caches ignore bf16_layers: every layer has the one dtype.
  f32 = kvcache.init_cache(CFG, B, S, kvcache.KVCacheSpec(dtype="float32", bf16_layers=(1,)))
  assert all(set(e) == {"k", "v"} and e["v"].dtype == jnp.float32 for e in f32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_read_round_trip_exact(dtype):
  spec = kvcache.KVCacheSpec(dtype=dtype)
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  # bf16-representable values (8-bit mantissa), so both dtypes round-trip exactly.
  k = jax.random.normal(jax.random.key(0), (B, 3, 2, 16)).astype(jnp.bfloat16)
  v = jax.random.normal(jax.random.key(1), (B, 3, 2, 16)).astype(jnp.bfloat16)
  start = jnp.array([0, 4])
  entry = kvcache.write(entry, k.astype(jnp.float32), v.astype(jnp.float32), start, spec)
  k_all, v_all = kvcache.read(entry, jnp.float32)
  assert k_all.shape == (B, S, 2, 16) and k_all.dtype == jnp.float32
  for b, s0 in enumerate((0, 4)):
    np.testing.assert_array_equal(np.asarray(k_all[b, s0 : s0 + 3]), _f32(k[b]))
    np.testing.assert_array_equal(np.asarray(v_all[b, s0 : s0 + 3]), _f32(v[b]))
  # Untouched slots stay zero.
  assert not np.any(np.asarray(k_all[0, 3:])) and not np.any(np.asarray(k_all[1, :4]))
  assert not np.any(np.asarray(k_all[1, 7:]))


def test_fp8_token_head_scales_and_error_bound():
  spec = kvcache.KVCacheSpec(dtype=FP8, granularity="token_head")
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  k = jax.random.normal(jax.random.key(0), (B, 5, 2, 16)) * jnp.array([1.0, 30.0])[:, None]
  k = k * jnp.exp(jax.random.normal(jax.random.key(2), k.shape))  # wide per-head range
  v = jax.random.normal(jax.random.key(1), (B, 5, 2, 16)) * 1e-3
  start = jnp.array([1, 3])
  entry = kvcache.write(entry, k, v, start, spec)
  k_all, v_all = kvcache.read(entry, jnp.float32)
  for name, x, x_all in (("k", k, k_all), ("v", v, v_all)):
    for b, s0 in enumerate((1, 3)):
      x_b = np.asarray(x[b])  # [T, K, H]
      got = np.asarray(x_all[b, s0 : s0 + 5])
      scale = np.swapaxes(np.asarray(entry[name + "_scale"][b, :, s0 : s0 + 5]), 0, 1)  # [T, K, 1]
      # scale = amax over the head's H entries / 448, one per token and head.
      np.testing.assert_allclose(scale, np.abs(x_b).max(-1, keepdims=True) / 448, rtol=1e-6)
      # e4m3 rounding: |x̂ − x| ≤ s · max(2^-4 |x/s|, 2^-10); 1e-6 slack for f32.
      bound = scale * np.maximum(2.0**-4 * np.abs(x_b / scale), 2.0**-10)
      assert np.all(np.abs(got - x_b) <= bound * (1 + 1e-6))
      # The entry holding each head's amax maps to ±448 and comes back (almost) exactly.
      np.testing.assert_allclose(np.abs(got).max(-1), np.abs(x_b).max(-1), rtol=1e-6)


def test_fp8_tensor_scale_calibrated_once_then_frozen():
  spec = kvcache.KVCacheSpec(dtype=FP8, granularity="tensor", tensor_headroom=2.0)
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  x0 = jnp.ones((B, 4, 2, 16)) * jnp.array([0.5, 3.0])[:, None, None, None]  # amax 0.5, 3
  x0 = x0.at[:, 0, 0, 0].set(-jnp.array([0.5, 3.0]) / 4)
  entry = kvcache.write(entry, x0, 2 * x0, jnp.zeros(B, jnp.int32), spec)
  # scale = headroom · amax / 448 per sequence, from the first write.
  k_scale = np.asarray(entry["k_scale"]).reshape(B)
  np.testing.assert_allclose(k_scale, 2.0 * np.array([0.5, 3.0]) / 448, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(entry["v_scale"]).reshape(B), 2 * k_scale, rtol=1e-6)
  k_all, _ = kvcache.read(entry, jnp.float32)
  # 224 and -56 are e4m3 values, so the prefill round-trips.
  np.testing.assert_allclose(np.asarray(k_all[:, :4]), np.asarray(x0), rtol=1e-6)
  # A later token 100× larger: the scale stays, the value saturates at ±448 · scale.
  x1 = jnp.ones((B, 1, 2, 16)) * 100.0
  x1 = x1.at[:, 0, 1, :].set(-100.0)
  x1 = x1.at[:, 0, 0, 0].set(0.25)  # in range: still quantized normally
  entry = kvcache.write(entry, x1, x1, jnp.full(B, 4), spec)
  np.testing.assert_array_equal(np.asarray(entry["k_scale"]).reshape(B), k_scale)
  k_all, _ = kvcache.read(entry, jnp.float32)
  got = np.asarray(k_all[:, 4])  # [B, K, H]
  sat = 448 * k_scale[:, None]
  np.testing.assert_allclose(got[:, 0, 1:], np.broadcast_to(sat, (B, 15)), rtol=1e-6)
  np.testing.assert_allclose(got[:, 1, :], -np.broadcast_to(sat, (B, 16)), rtol=1e-6)
  np.testing.assert_allclose(got[:, 0, 0], 0.25, rtol=2.0**-4)
  np.testing.assert_allclose(np.asarray(k_all[:, :4]), np.asarray(x0), rtol=1e-6)  # untouched


def test_bytes_per_token_hand_computed():
  k, h, layers = 2, 16, 3

  def bpt(spec):
    allocated = kvcache.bytes_per_token(kvcache.init_cache(CFG, B, S, spec))
    # The abstract (eval_shape) cache must account the same bytes without allocating.
    assert kvcache.bytes_per_token(kvcache.abstract_cache(CFG, B, S, spec)) == allocated
    return allocated

  # fp8 token_head: 1 byte per entry plus a 4-byte scale per head, for K and V.
  assert bpt(kvcache.KVCacheSpec(dtype=FP8)) == 2 * k * (h + 4) * layers == 240
  # fp8 tensor: 1 byte per entry; two f32 scales per layer and sequence amortised over S.
  tensor = kvcache.KVCacheSpec(dtype=FP8, granularity="tensor")
  assert bpt(tensor) == 2 * k * h * layers + layers * 2 * 4 / S == 195
  assert bpt(kvcache.KVCacheSpec(dtype="bfloat16")) == 4 * k * h * layers == 384
  assert bpt(kvcache.KVCacheSpec(dtype="float32")) == 8 * k * h * layers == 768
  mixed = kvcache.KVCacheSpec(dtype=FP8, bf16_layers=(1,))
  assert bpt(mixed) == 2 * k * (h + 4) * 2 + 4 * k * h == 288


def test_bad_spec_errors_name_allowed_values():
  with pytest.raises(ValueError, match="'int8'.*bfloat16, float32, float8_e4m3fn"):
    kvcache.KVCacheSpec(dtype="int8")
  with pytest.raises(ValueError, match="'per_block'.*token_head, tensor"):
    kvcache.KVCacheSpec(dtype=FP8, granularity="per_block")
  with pytest.raises(ValueError, match="tensor_headroom"):
    kvcache.KVCacheSpec(tensor_headroom=0.5)
  with pytest.raises(ValueError, match="non-negative ints"):
    kvcache.KVCacheSpec(dtype=FP8, bf16_layers=[0])
  with pytest.raises(ValueError, match=r"bf16_layers \[3\] out of range for 3 layers"):
    kvcache.init_cache(CFG, B, S, kvcache.KVCacheSpec(dtype=FP8, bf16_layers=(3,)))


def test_capacity_rows_and_floors():
  budget = 16 * 2**30
  rows = kv_capacity.capacity_rows(budget, seq_len=4096)
  assert len(rows) == 3 * 5  # 3 models × (bf16 + 2 fp8 recipes × 2 granularities)
  by_key = {(r["model"], r["recipe"], r["granularity"]): r for r in rows}
  # Hand-computed Qwen3-1.7B (L=28, K=8, H=128) bytes per token.
  assert by_key["qwen3-1.7b", "bf16", None]["kv_bytes_per_token"] == 4 * 8 * 128 * 28
  assert by_key["qwen3-1.7b", "fp8_all", "token_head"]["kv_bytes_per_token"] == 2 * 8 * 132 * 28
  paper = by_key["qwen3-1.7b", "fp8_paper", "tensor"]
  assert paper["num_bf16_layers"] == 1 and paper["num_layers"] == 28
  assert paper["kv_bytes_per_token"] == 27 * 2 * 8 * 128 + 4 * 8 * 128 + 27 * 8 / 4096
  # Qwen3-8B (L=36) baseline and the tiny model's really allocated cache.
  assert by_key["qwen3-8b", "bf16", None]["kv_bytes_per_token"] == 4 * 8 * 128 * 36
  tiny = by_key["tiny", "bf16", None]
  assert tiny["source"] == "allocated" and tiny["kv_bytes_per_token"] == 4 * 2 * 16 * 4
  for r in rows:
    assert r["tokens_in_budget"] == int(budget // r["kv_bytes_per_token"])
    assert r["budget_bytes"] == budget
  checks = kv_capacity.check_floors(rows)
  assert len(checks) == 4 and all(c["ok"] for c in checks), checks
  for model in kv_capacity.MODELS:
    assert by_key[model, "fp8_all", "tensor"]["ratio_vs_bf16"] >= 1.99
  best = max(
    by_key["qwen3-1.7b", "fp8_paper", g]["ratio_vs_bf16"] for g in ("token_head", "tensor")
  )
  assert best >= 1.93
  # The floors can fail: with 1-slot sequences the amortised tensor scales cost too much.
  assert not all(c["ok"] for c in kv_capacity.check_floors(kv_capacity.capacity_rows(budget, 1)))


def test_bench_entry_point_json():
  proc = subprocess.run(
    [sys.executable, "-m", "opd_jax.bench.kv_capacity", "--json", "--budget-gib", "8"],
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert set(out) == {"rows"} and len(out["rows"]) == 15
  keys = {"model", "recipe", "granularity", "kv_bytes_per_token", "tokens_in_budget"}
  assert all(keys | {"budget_bytes", "ratio_vs_bf16"} <= set(r) for r in out["rows"])
  assert all(r["budget_bytes"] == 8 * 2**30 for r in out["rows"])


def test_tensor_scale_calibrates_on_real_tokens_only():
  """A "tensor" scale set at prefill ignores the prompt's padding columns."""
  spec = kvcache.KVCacheSpec(dtype="float8_e4m3fn", granularity="tensor")
  cfg = ModelConfig("qwen3", 16, 8, 16, 1, 2, 1, 4)
  x_btkh = jnp.ones((1, 4, 1, 4), jnp.float32).at[0, 3].set(100.0)  # column 3 is padding
  entry = kvcache.init_cache(cfg, 1, 8, spec)[0]
  masked = kvcache.write(entry, x_btkh, x_btkh, jnp.zeros(1, jnp.int32), spec, jnp.array([3]))
  unmasked = kvcache.write(entry, x_btkh, x_btkh, jnp.zeros(1, jnp.int32), spec)
  expected = spec.tensor_headroom * 1.0 / 448.0
  np.testing.assert_allclose(float(masked["k_scale"].reshape(())), expected, rtol=1e-6)
  np.testing.assert_allclose(float(unmasked["k_scale"].reshape(())), 100 * expected, rtol=1e-6)
  # The padding column would clip (100 / scale = 22400 > 448) but is not a real token.
  np.testing.assert_array_equal(masked["k_clipped"], [0])
  np.testing.assert_array_equal(unmasked["k_clipped"], [0])


def test_tensor_scale_waits_for_a_nonzero_write_and_counts_clipping():
  """An all-zero prompt leaves the scale uncalibrated (0), not frozen at a floor."""
  spec = kvcache.KVCacheSpec(dtype=FP8, granularity="tensor", tensor_headroom=2.0)
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  assert "k_clipped" not in entry  # a write statistic, not cache storage
  x0 = jnp.zeros((B, 3, 2, 16)).at[1, 2].set(50.0)  # row 1's third column is padding
  entry = kvcache.write(entry, x0, x0, jnp.zeros(B, jnp.int32), spec, jnp.array([3, 2]))
  np.testing.assert_array_equal(np.asarray(entry["k_scale"]).reshape(B), 0.0)
  np.testing.assert_array_equal(entry["k_clipped"], [0, 0])
  k_all, _ = kvcache.read(entry, jnp.float32)
  np.testing.assert_array_equal(np.asarray(k_all[:, :3]), 0.0)
  # The first non-zero write calibrates: scale = 2 · amax / 448; amax · (1, ½) are
  # e4m3 values (224, 112) there, so they round-trip exactly.
  amax = jnp.array([2.0, 0.5])[:, None, None, None]
  x1 = amax * jnp.ones((B, 1, 2, 16)).at[:, :, 1].set(-0.5)
  entry = kvcache.write(entry, x1, 3 * x1, jnp.full(B, 3), spec)
  np.testing.assert_allclose(np.asarray(entry["k_scale"]).reshape(B), [4 / 448, 1 / 448])
  np.testing.assert_allclose(np.asarray(entry["v_scale"]).reshape(B), [12 / 448, 3 / 448])
  np.testing.assert_array_equal(entry["k_clipped"], [0, 0])
  k_all, v_all = kvcache.read(entry, jnp.float32)
  np.testing.assert_allclose(np.asarray(k_all[:, 3]), np.asarray(x1[:, 0]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(v_all[:, 3]), 3 * np.asarray(x1[:, 0]), rtol=1e-6)
  # Later: 2 · amax maps to exactly 448 (kept); 3 · amax to 672 (clipped). Counted per row
  # over this write only: 16 + 8 elements of K, the same of V.
  x2 = 0.1 * amax * jnp.ones((B, 1, 2, 16))
  x2 = x2.at[:, 0, 0, :].set(3 * amax[:, 0, 0]).at[:, 0, 1, :8].set(-3 * amax[:, 0, 0])
  x2 = x2.at[:, 0, 1, 8].set(2 * amax[:, 0, 0, 0])
  entry = kvcache.write(entry, x2, 3 * x2, jnp.full(B, 4), spec)
  np.testing.assert_array_equal(entry["k_clipped"], [24, 24])
  np.testing.assert_array_equal(entry["v_clipped"], [24, 24])
  k_all, _ = kvcache.read(entry, jnp.float32)
  np.testing.assert_allclose(np.asarray(k_all[:, 4, 0, 0]), 448 * np.array([4, 1]) / 448)
  np.testing.assert_allclose(np.asarray(k_all[:, 4, 1, 8]), 2 * np.array([2.0, 0.5]))


@pytest.mark.parametrize("granularity", ["token_head", "tensor"])
def test_fp8_storage_holds_the_e4m3_bytes(granularity):
  """The uint8 storage holds exactly the bytes of round_e4m3(x / scale), and `read` gives
  those e4m3 values times the scale."""
  spec = kvcache.KVCacheSpec(dtype=FP8, granularity=granularity)
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  k = jax.random.normal(jax.random.key(3), (B, 3, 2, 16))
  entry = kvcache.write(entry, k, -k, jnp.array([2, 5]), spec)
  scale = np.swapaxes(np.asarray(entry["k_scale"], np.float32), 1, 2)  # [B, S or 1, K or 1, 1]
  scale = scale[:, 2:5] if granularity == "token_head" else scale  # row 0's slots 2..4
  expected = (np.asarray(k[0]) / scale[0]).astype(jnp.float8_e4m3fn)
  stored = np.swapaxes(np.asarray(entry["k"][0, :, 2:5]), 0, 1)  # head-major storage
  np.testing.assert_array_equal(stored, expected.view(np.uint8))
  k_all, _ = kvcache.read(entry, jnp.float32)
  np.testing.assert_array_equal(np.asarray(k_all[0, 2:5]), expected.astype(np.float32) * scale[0])


def test_bf16_storage_holds_the_bf16_bits():
  spec = kvcache.KVCacheSpec(dtype="bfloat16")
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  k = jax.random.normal(jax.random.key(4), (B, 2, 2, 16))
  entry = kvcache.write(entry, k, k, jnp.array([0, 6]), spec)
  stored = np.swapaxes(np.asarray(entry["k"][1, :, 6:8]), 0, 1)  # head-major storage
  np.testing.assert_array_equal(stored, np.asarray(k[1].astype(jnp.bfloat16)).view(np.uint16))
  assert not np.any(np.asarray(entry["k"][1, :, :6]))  # 0 bits: bf16 zeros


def test_token_head_write_adds_no_counter():
  spec = kvcache.KVCacheSpec(dtype=FP8, granularity="token_head")
  entry = kvcache.init_cache(CFG, B, S, spec)[0]
  x = jnp.zeros((B, 2, 2, 16))  # all-zero vectors: the 1e-12 floor stores exact zeros
  entry = kvcache.write(entry, x, x, jnp.zeros(B, jnp.int32), spec)
  assert set(entry) == {"k", "v", "k_scale", "v_scale"}
  np.testing.assert_array_equal(np.asarray(kvcache.read(entry, jnp.float32)[0]), 0.0)


@pytest.mark.parametrize("stored", [jnp.uint8, jnp.int8])
def test_wide_values_equal_the_values_for_every_code(stored):
  """Every one of the 256 codes: as_wide_values' v · c equals as_values' value exactly, in f32,
  NaN to NaN (on CPU through f16; elsewhere the format's own conversion with c = 1)."""
  codes = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), stored)
  want = np.asarray(kvcache.as_values(codes).astype(jnp.float32))
  v, c = kvcache.as_wide_values(codes)
  got = np.asarray(v.astype(jnp.float32)) * np.float32(c)
  assert c in (1.0, 256.0)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
  assert np.isnan(want).sum() == (2 if stored == jnp.uint8 else 6)  # e4m3fn: ±NaN; e5m2: ±3 NaN
