"""opd_jax.model and ModelConfig: cached decode against uncached forward, RoPE, validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from opd_jax.model import kvcache
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig

# Qwen3 numerics plus every optional tensor: GQA, head_dim != D / N, q/k norms, biases.
CFG = ModelConfig(
  model_type="qwen3",
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  qkv_bias=True,
  o_bias=True,
  qk_norm=True,
)
F32_CACHE = kvcache.KVCacheSpec(dtype="float32")


def _random_params(seed, cfg):
  """Random params in init_params' layout: N(0, 0.1²) matrices and biases, norms 1 + N(0, 0.05²).

  Drawn with numpy: compiling JAX's RNG for every leaf costs tens of seconds on CPU.
  """
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg))

  def draw(path, leaf):
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    is_norm = "norm" in jax.tree_util.keystr(path)
    return jnp.asarray(1.0 + 0.05 * noise if is_norm else 0.1 * noise)

  return jax.tree_util.tree_map_with_path(draw, shapes)


_cached = jax.jit(model.forward_with_cache, static_argnums=(4, 5))
_uncached = jax.jit(model.forward, static_argnums=2)


def test_cached_decode_matches_forward_with_ragged_starts():
  """Prompts of lengths 6 and 3 prefilled together (the short one padded), then each
  sequence decodes from its own position; logits equal the uncached forward of the
  sequence's true tokens."""
  params = _random_params(0, CFG)
  rng = np.random.default_rng(0)
  lengths = np.array([6, 3])
  steps = 4
  full = rng.integers(0, CFG.vocab_size, (2, 6 + steps))  # row 1 uses only the first 3 + steps
  prompt = full[:, :6].copy()
  prompt[1, 3:] = rng.integers(0, CFG.vocab_size, 3)  # padding garbage, overwritten by decode
  # Causal attention: the logits at position p of `full` are those of the prefix
  # full[b, :p + 1], so one uncached forward is the reference for every step.
  ref = np.asarray(_uncached(params, jnp.asarray(full), CFG))
  cache = kvcache.init_cache(CFG, batch=2, max_len=16, spec=F32_CACHE)
  start = jnp.zeros(2, jnp.int32)
  logits, cache = _cached(params, jnp.asarray(prompt), start, cache, CFG, F32_CACHE)
  np.testing.assert_allclose(logits[0], ref[0, :6], atol=1e-5, rtol=0)
  np.testing.assert_allclose(logits[1, :3], ref[1, :3], atol=1e-5, rtol=0)
  for step in range(steps):
    start = lengths + step
    tokens = full[np.arange(2), start][:, None]
    logits, cache = _cached(params, jnp.asarray(tokens), jnp.asarray(start), cache, CFG, F32_CACHE)
    for b in range(2):
      np.testing.assert_allclose(
        logits[b, 0], ref[b, start[b]], atol=1e-5, rtol=0, err_msg=f"{b=} {step=}"
      )


def test_chunked_prefill_matches_forward():
  params = _random_params(3, CFG)
  tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 9))
  cache = kvcache.init_cache(CFG, batch=2, max_len=12, spec=F32_CACHE)
  first, cache = _cached(
    params, jnp.asarray(tokens[:, :5]), jnp.zeros(2, jnp.int32), cache, CFG, F32_CACHE
  )
  second, _ = _cached(
    params, jnp.asarray(tokens[:, 5:]), jnp.full(2, 5, jnp.int32), cache, CFG, F32_CACHE
  )
  ref = np.asarray(_uncached(params, jnp.asarray(tokens), CFG))
  np.testing.assert_allclose(np.concatenate([first, second], axis=1), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
  "head_dim, theta, rope",
  [
    (16, 10000.0, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, orig=32)),
    (64, 500000.0, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, orig=8192)),
    (128, 500000.0, dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, orig=8192)),
    (32, 10000.0, None),
  ],
)
def test_rope_inv_freq_matches_transformers(head_dim, theta, rope):
  rope_parameters = {"rope_type": "default", "rope_theta": theta}
  if rope is not None:
    orig = rope.pop("orig")
    rope_parameters |= rope | {"rope_type": "llama3", "original_max_position_embeddings": orig}
  hf_config = transformers.LlamaConfig(
    vocab_size=16,
    hidden_size=4 * head_dim,
    intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=4,
    head_dim=head_dim,
    max_position_embeddings=65536,
    rope_parameters=rope_parameters,
  )
  if rope is None:
    want = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
  else:
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
  cfg = ModelConfig.from_hf_dict(hf_config.to_dict())
  assert (cfg.rope_scaling is None) == (rope is None)
  got = cfg.rope_inv_freq()
  assert got.shape == (head_dim // 2,)
  # Ours is computed in f64 and rounded once; transformers' in f32: a few ulp apart.
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)


def test_unsupported_model_type_lists_supported():
  with pytest.raises(ValueError) as err:
    ModelConfig("gemma", 16, 8, 8, 1, 2, 1, 4)
  assert str(err.value) == "unsupported model_type 'gemma'; supported: llama, qwen2, qwen3"
  with pytest.raises(
    ValueError, match="unsupported model_type 'mistral' in config.json; supported"
  ):
    ModelConfig.from_hf_dict({"model_type": "mistral"})
  # A field that changes the outputs is refused, never ignored: the MLP is SwiGLU.
  with pytest.raises(ValueError, match="hidden_act='gelu_pytorch_tanh' is not supported"):
    ModelConfig.from_hf_dict({"model_type": "llama", "hidden_act": "gelu_pytorch_tanh"})


def test_heads_must_be_multiple_of_kv_heads():
  with pytest.raises(ValueError) as err:
    ModelConfig("llama", 16, 8, 8, 1, num_heads=6, num_kv_heads=4, head_dim=4)
  assert str(err.value) == "num_heads (6) must be a multiple of num_kv_heads (4)"
  with pytest.raises(ValueError, match=r"ModelConfig.head_dim must be a positive int, got 0"):
    ModelConfig("llama", 16, 8, 8, 1, num_heads=2, num_kv_heads=1, head_dim=0)
