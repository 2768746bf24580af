"""Blockwise attention over the filled cache prefix against the full-cache reference, and
the compiled decode loop's treatment of the cache (no whole-cache copy or conversion)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.inference import sampler
from opd_jax.model import decode_attention, kvcache
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig

# GQA (G = 2), q/k norms: the sampler's tiny shape with a head_dim that differs from D / N.
CFG = ModelConfig(
  model_type="qwen3",
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  qk_norm=True,
)
FP8 = "float8_e4m3fn"
SPECS = {
  "f32": kvcache.KVCacheSpec(dtype="float32"),
  "bf16": kvcache.KVCacheSpec(dtype="bfloat16"),
  "fp8_token_head": kvcache.KVCacheSpec(dtype=FP8, granularity="token_head"),
  "fp8_tensor": kvcache.KVCacheSpec(dtype=FP8, granularity="tensor"),
}


def _filled_entry(spec, batch, slots, seed):
  """One layer's cache with random keys and values written to every slot."""
  rng = np.random.default_rng(seed)
  entry = kvcache.init_cache(CFG, batch, slots, spec)[0]
  shape = (batch, slots, CFG.num_kv_heads, CFG.head_dim)
  k = jnp.asarray(rng.standard_normal(shape), jnp.float32) * 2.0
  v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return kvcache.write(entry, k, v, jnp.zeros(batch, jnp.int32), spec)


def _reference(q_btnh, entry, q_pos_bt, kernel="reference"):
  keys, values = kvcache.read(entry, q_btnh.dtype)
  slots = jnp.broadcast_to(jnp.arange(keys.shape[1]), keys.shape[:2])
  return model.attend(q_btnh, keys, values, q_pos_bt, slots, CFG, kernel)


@pytest.mark.parametrize("kv", list(SPECS))
@pytest.mark.parametrize("tokens", [1, 5])
def test_blockwise_equals_full_cache_attention(kv, tokens):
  """Decode (T = 1) and prefill-shaped (T = 5) queries at ragged positions, 20 slots in
  blocks of 8: three blocks, the last one clamped to slots 12..19 with 12..15 masked as
  already seen. Rows stop in different blocks, one in the first."""
  entry = _filled_entry(SPECS[kv], 3, 20, seed=0)
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((3, tokens, CFG.num_heads, CFG.head_dim)), jnp.float32)
  last_b = np.array([19, 6, 13]) if tokens == 1 else np.array([19, 4, 12])
  q_pos_bt = jnp.asarray(last_b[:, None] - np.arange(tokens)[::-1][None, :], jnp.int32)
  got = decode_attention.attend_cache(q, entry, q_pos_bt, CFG, block=8)
  want = _reference(q, entry, q_pos_bt)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_bf16_compute_and_bf16_attention_kernel_match_the_reference():
  """bf16 activations: P·V in f32 differs from the reference's bf16 probabilities by bf16
  rounding only. The bf16_attention variant's two passes round the normalised probabilities
  as the dense variant does."""
  entry = _filled_entry(SPECS["fp8_token_head"], 2, 20, seed=2)
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((2, 1, CFG.num_heads, CFG.head_dim)), jnp.float32)
  q_pos_bt = jnp.asarray([[17], [9]], jnp.int32)
  q16 = q.astype(jnp.bfloat16)
  got = decode_attention.attend_cache(q16, entry, q_pos_bt, CFG, block=8)
  want = _reference(q16, entry, q_pos_bt)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(_f32(got), _f32(want), atol=2e-2, rtol=0)
  low = decode_attention.attend_cache(q, entry, q_pos_bt, CFG, "bf16_attention", block=8)
  low_want = _reference(q, entry, q_pos_bt, "bf16_attention")
  np.testing.assert_allclose(np.asarray(low), np.asarray(low_want), atol=1e-5, rtol=0)
  # ... and the variant is not the f32 path (the comparison above can fail).
  assert np.abs(np.asarray(low) - np.asarray(_reference(q, entry, q_pos_bt))).max() > 1e-4


def _f32(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _attention_float64(q_btnh, entry, q_pos_bt):
  """softmax(q·kᵀ/√H + mask)·v in float64 over the exact dequantized cache, k = f64(k̂) · c
  (the cache's [B, K, S, H] moved to [B, S, K, H])."""
  scale = {"k": entry.get("k_scale"), "v": entry.get("v_scale")}
  k, v = (
    np.swapaxes(
      np.asarray(kvcache.as_values(entry[n]).astype(jnp.float32), np.float64)
      * (1.0 if scale[n] is None else np.asarray(scale[n], np.float64)),
      1,
      2,
    )
    for n in ("k", "v")
  )
  b, t, n, h = q_btnh.shape
  q_btkgh = np.asarray(q_btnh.astype(jnp.float32), np.float64).reshape(
    b, t, CFG.num_kv_heads, -1, h
  )
  s_bkgts = np.einsum("btkgh,bskh->bkgts", q_btkgh, k) / np.sqrt(h)
  visible_bts = np.arange(k.shape[1])[None, None, :] <= np.asarray(q_pos_bt)[:, :, None]
  s_bkgts = np.where(visible_bts[:, None, None], s_bkgts, -np.inf)
  p_bkgts = np.exp(s_bkgts - s_bkgts.max(-1, keepdims=True))
  p_bkgts /= p_bkgts.sum(-1, keepdims=True)
  return np.einsum("bkgts,bskh->btkgh", p_bkgts, v).reshape(b, t, n, h)


@pytest.mark.parametrize("granularity", ["token_head", "tensor"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
def test_scaled_cache_scales_after_the_products_against_float64(fmt, granularity):
  """A quantized cache's scale multiplies the scores and the probabilities (module docstring),
  not every element of K and V. Against float64 attention over the exact dequantized values
  f64(k̂)·c: with f32 compute within f32 rounding (2e-6, outputs are O(1)); with bf16 compute
  within the output's own bf16 rounding, 2^-8 relative, plus f32 accumulation (1e-5), since
  k̂ and v̂ are exact in bf16, and closer than the dequantize-then-cast order (`kvcache.read`,
  which rounds k̂·c and v̂·c to bf16 before the products), which both paths agree with to
  bf16 rounding."""
  spec = kvcache.KVCacheSpec(dtype=fmt, granularity=granularity)
  entry = _filled_entry(spec, 3, 20, seed=6)
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.standard_normal((3, 2, CFG.num_heads, CFG.head_dim)), jnp.float32)
  q_pos_bt = jnp.asarray([[18, 19], [5, 6], [12, 13]], jnp.int32)
  got32 = np.asarray(decode_attention.attend_cache(q, entry, q_pos_bt, CFG, block=8))
  want32 = _attention_float64(q, entry, q_pos_bt)
  np.testing.assert_allclose(got32, want32, atol=2e-6, rtol=0)

  q16 = q.astype(jnp.bfloat16)
  want16 = _attention_float64(q16, entry, q_pos_bt)
  got16 = _f32(decode_attention.attend_cache(q16, entry, q_pos_bt, CFG, block=8))
  assert np.all(np.abs(got16 - want16) <= 2.0**-8 * np.abs(want16) + 1e-5)
  # The dequantize-then-cast order: the bf16 cache of dtype(f32(k̂)·c), as `kvcache.read` gives.
  keys, values = kvcache.read(entry, jnp.bfloat16)
  bits = {  # stored head-major, as `kvcache.init_cache` lays a cache out
    n: jax.lax.bitcast_convert_type(jnp.swapaxes(x, 1, 2), jnp.uint16)
    for n, x in (("k", keys), ("v", values))
  }
  old16 = _f32(decode_attention.attend_cache(q16, bits, q_pos_bt, CFG, block=8))
  assert np.abs(got16 - want16).max() < np.abs(old16 - want16).max()
  np.testing.assert_allclose(got16, old16, atol=2e-2, rtol=0)


def test_compiled_decode_step_scales_scores_not_the_block():
  """The blockwise decode step on an FP8 "token_head" cache multiplies nothing of the size of
  a block of K or V (B · block · K · H elements): the scales meet the [B, K, R, block]
  scores and probabilities only."""
  spec = kvcache.KVCacheSpec(dtype=FP8, granularity="token_head")
  params = model.init_params(jax.random.key(0), CFG)
  cache = kvcache.init_cache(CFG, _B, _S, spec)
  args = (params, jnp.zeros((_B, 1), jnp.int32), jnp.arange(_B, dtype=jnp.int32), cache, CFG, spec)
  step = jax.jit(model.forward_with_cache, static_argnums=(4, 5), static_argnames="attention")
  hlo = step.lower(*args, attention="blockwise").compile().as_text()
  block_elements = _B * decode_attention.BLOCK * CFG.num_kv_heads * CFG.head_dim
  sizes = [
    int(np.prod([int(d) for d in dims.split(",")]))
    for dims in re.findall(r"= f32\[([\d,]+)\]\S* multiply\(", hlo)
  ]
  assert sizes, "no f32 multiply found at all"
  assert max(sizes) < block_elements, sorted(set(sizes))


def test_blocks_after_the_largest_position_are_never_read():
  """Slots from the first block boundary after the batch's largest position hold NaN: the
  blockwise result stays finite and equal to the reference on a clean cache; the reference
  reads them and turns NaN."""
  entry = _filled_entry(SPECS["f32"], 2, 24, seed=4)
  poisoned = dict(
    entry, k=entry["k"].at[:, :, 16:].set(jnp.nan), v=entry["v"].at[:, :, 16:].set(jnp.nan)
  )
  q = jnp.asarray(np.random.default_rng(5).standard_normal((2, 1, 4, 16)), jnp.float32)
  q_pos_bt = jnp.asarray([[15], [3]], jnp.int32)
  assert int(decode_attention.num_blocks(q_pos_bt, 24, 8)) == 2
  got = decode_attention.attend_cache(q, poisoned, q_pos_bt, CFG, block=8)
  np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(q, entry, q_pos_bt)), atol=2e-6)
  assert np.isnan(np.asarray(_reference(q, poisoned, q_pos_bt))).all()


_step = jax.jit(
  model.forward_with_cache, static_argnums=(4, 5), static_argnames=("attention", "block")
)


def _greedy(params, prompts, spec, attention, block, steps=10, slots=24):
  """Greedy decode through `forward_with_cache`: ragged prompts prefilled together (right
  padded), then one token per step at each row's own position. Returns (tokens [B, steps],
  logits [B, steps, V])."""
  lens = np.array([len(p) for p in prompts])
  tokens = np.zeros((len(prompts), lens.max()), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, : len(p)] = p
  cache = kvcache.init_cache(CFG, len(prompts), slots, spec)
  zeros = jnp.zeros(len(prompts), jnp.int32)
  logits, cache = _step(
    params, jnp.asarray(tokens), zeros, cache, CFG, spec, jnp.asarray(lens), attention=attention
  )
  logits_b = np.asarray(logits)[np.arange(len(prompts)), lens - 1]
  out_tokens, out_logits = [], []
  for i in range(steps):
    token_b = logits_b.argmax(-1).astype(np.int32)
    out_tokens.append(token_b)
    out_logits.append(logits_b)
    pos_b = jnp.asarray(lens + i, jnp.int32)
    logits, cache = _step(
      params,
      jnp.asarray(token_b[:, None]),
      pos_b,
      cache,
      CFG,
      spec,
      attention=attention,
      block=block,
    )
    logits_b = np.asarray(logits)[:, 0]
  return np.stack(out_tokens, 1), np.stack(out_logits, 1)


@pytest.mark.parametrize("kv", list(SPECS))
def test_greedy_decode_tokens_identical_to_full_cache_attention(kv):
  """Prompts of 2, 7 and 11 tokens, 10 greedy steps over a 24-slot cache in blocks of 4:
  the tokens are identical and the logits equal, in every KV format: to f32 rounding with an
  f32 cache; with a bf16 or fp8 cache, an f32-rounding difference in a hidden state can flip
  the rounding of one key element as it is stored (2^-9 or 2^-4 of it), hence the looser
  bounds there."""
  params = model.init_params(jax.random.key(0), CFG, scale=0.3)
  prompts = [[5, 9], [3, 1, 4, 1, 5, 9, 2], [7] * 11]
  spec = SPECS[kv]
  tokens, logits = _greedy(params, prompts, spec, "blockwise", 4)
  ref_tokens, ref_logits = _greedy(params, prompts, spec, "reference", 4)
  np.testing.assert_array_equal(tokens, ref_tokens)
  atol = {"f32": 5e-5, "bf16": 1e-3}.get(kv, 1e-2)
  np.testing.assert_allclose(logits, ref_logits, atol=atol, rtol=0)
  assert len(np.unique(tokens)) > 3  # the decode goes somewhere, not one repeated token


def test_unknown_attention_is_named():
  with pytest.raises(ValueError, match="unknown attention 'dense'; allowed: auto, blockwise"):
    model.forward_with_cache({}, jnp.zeros((1, 1), jnp.int32), None, [], CFG, attention="dense")


# Cache shape [B, K, S, H] chosen so that no other array of the program has it (nor its
# [B, S, K, H] transpose, the layout a dequantized copy for the model's attention takes).
_B, _S = 4, 600


def _cache_sized(hlo: str):
  """(computation, dtype, opcode, called computation's root opcode) of every instruction whose
  result has the cache's [B, K, S, H] shape or its [B, S, K, H] transpose, parameters and tuple
  plumbing excluded."""
  k, h = CFG.num_kv_heads, CFG.head_dim
  shape = rf"\[(?:{_B},{k},{_S},{h}|{_B},{_S},{k},{h})\]"
  roots, found, comp = {}, [], None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
    if head:
      comp = head.group(1)
    root = re.match(r"^\s*ROOT \S+ = \S+ ([\w-]+)\(", line)
    if root:
      roots[comp] = root.group(1)
    op = re.match(rf"^\s*(?:ROOT )?\S+ = (\w+){shape}\S* ([\w-]+)\((.*)", line)
    if op and op.group(2) not in ("parameter", "get-tuple-element", "tuple", "while"):
      called = re.search(r"calls=(%[\w.\-]+)", op.group(3))
      found.append((comp, op.group(1), op.group(2), called and called.group(1)))
  return [(c, d, o, roots.get(k) if k else None) for c, d, o, k in found]


def _while_bodies(hlo: str) -> set[str]:
  return set(re.findall(r"while\(.*?body=(%[\w.\-]+)", hlo))


@pytest.mark.parametrize("kv", ["bf16", "fp8_token_head", "fp8_tensor"])
def test_compiled_decode_loop_neither_copies_nor_dequantizes_the_cache(kv):
  """The sampler's compiled program (prefill + decode while loop) on a BF16 or FP8 cache of
  600 slots (three blocks): no instruction anywhere produces the cache in a value dtype
  ([B, K, S, H] in f32, bf16, f16 or e4m3: a conversion of the whole cache), only in its
  integer storage, and inside the loops the only cache-sized instructions are the in-place
  scatters of the new token (no copy, no bit-cast pass over the buffer)."""
  params = model.init_params(jax.random.key(0), CFG)
  spec = SPECS[kv]
  scfg = sampler.SamplerConfig(max_new_tokens=4, temperature=0.0, kv=spec, cache_len=_S)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [1], [3, 3]]
  hlo = sampler.sample_program(params, prompts, jax.random.key(0), scfg, CFG).compile().as_text()
  ops = _cache_sized(hlo)
  assert ops, "the detector found no cache-sized instruction at all"
  assert {d for _, d, _, _ in ops} == {"u16" if kv == "bf16" else "u8"}, ops
  bodies = _while_bodies(hlo)
  in_loop = [op for op in ops if op[0] in bodies]
  # One scatter per layer for K and V: the decode step's write.
  assert len(in_loop) == 2 * CFG.num_layers, in_loop
  assert all(o == "fusion" and root == "scatter" for _, _, o, root in in_loop), in_loop


def test_reference_attention_materializes_the_dequantized_cache():
  """The detector above on the full-cache reference path finds what the blockwise path
  avoids: the FP8 cache dequantized to f32 at its full size."""
  spec = kvcache.KVCacheSpec(dtype=FP8, granularity="token_head")
  params = model.init_params(jax.random.key(0), CFG)
  cache = kvcache.init_cache(CFG, _B, _S, spec)
  args = (params, jnp.zeros((_B, 1), jnp.int32), jnp.arange(_B, dtype=jnp.int32), cache, CFG, spec)

  def hlo(attention):
    step = jax.jit(model.forward_with_cache, static_argnums=(4, 5), static_argnames="attention")
    return step.lower(*args, attention=attention).compile()

  reference, blockwise = hlo("reference"), hlo("blockwise")
  assert any(d == "f32" for _, d, _, _ in _cache_sized(reference.as_text()))
  assert not any(d != "u8" for _, d, _, _ in _cache_sized(blockwise.as_text()))
  # XLA's buffer plan: the reference's scratch holds dequantized K and V of a layer (f32, 4
  # bytes per element each); the blockwise step's scratch is below one such copy.
  f32_copy = _B * _S * CFG.num_kv_heads * CFG.head_dim * 4
  assert reference.memory_analysis().temp_size_in_bytes >= 2 * f32_copy
  assert blockwise.memory_analysis().temp_size_in_bytes < f32_copy


def test_decode_scaling_ratios_hand_computed():
  """The bench's goal ratios from hand-made rows: S = 4096 over S = 256 at t = 32, and BF16
  ms over FP8 ms at S = 4096, t ≥ 1024 (rows at other positions or capacities ignored)."""
  from opd_jax.bench import decode_scaling

  def row(kv, slots, t, ms, batch=1):
    return dict(
      attention="blockwise", kv=kv, batch=batch, capacity=slots, position=t, ms_per_step=ms
    )

  rows = [
    row("bf16", 256, 32, 10.0),
    row("bf16", 4096, 32, 12.0),
    row("bf16", 4096, 1024, 20.0),
    row("bf16", 4096, 256, 15.0),
    row("fp8_tensor", 4096, 1024, 25.0),
    row("fp8_tensor", 4096, 256, 1.0),
    row("fp8_tensor", 1024, 32, 1.0),
  ]
  assert decode_scaling.ratios(rows) == {
    "s4096_over_s256_at_t32": {"blockwise/bf16/b1": 1.2},
    "fp8_over_bf16_speed": {"blockwise/fp8_tensor/b1/t1024": 0.8},
  }


@pytest.mark.parametrize(
  "attention, backend, runs_as",
  [
    ("auto", "cpu", "blockwise"),
    ("auto", "tpu", "blockwise"),
    ("auto", "gpu", "reference"),
    ("auto", "cuda", "reference"),
    ("blockwise", "gpu", "blockwise"),
    ("reference", "cpu", "reference"),
    ("pallas", "cpu", "pallas"),
    ("pallas", "tpu", "pallas"),
  ],
)
def test_resolve_attention_per_platform(attention, backend, runs_as):
  assert model.resolve_attention(attention, backend) == runs_as


def test_resolve_attention_refuses_pallas_on_gpu_and_unknown_names():
  with pytest.raises(ValueError, match="not offered on a GPU"):
    model.resolve_attention("pallas", "gpu")
  with pytest.raises(ValueError, match="unknown attention 'flash'"):
    model.resolve_attention("flash", "cpu")


def test_auto_is_the_blockwise_path_on_this_backend():
  assert jax.default_backend() == "cpu"  # the suite runs on CPU
  assert model.resolve_attention("auto") == "blockwise"
