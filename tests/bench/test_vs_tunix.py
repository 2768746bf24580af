"""The tunix side-by-side harness (docs/bench/vs_tunix.py) without tunix: its checkpoints use
the θ tunix's Qwen3 attention always applies, its transformers reference decodes exactly the
requested tokens and equals opd_jax's greedy tokens, and bad rows are refused by name."""

import importlib.util
import pathlib

import numpy as np
import pytest

from opd_jax.bench import sampler as bench_sampler

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vs_tunix():
  spec = importlib.util.spec_from_file_location("vs_tunix", ROOT / "docs" / "bench" / "vs_tunix.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # imports no tunix: the harness imports it where it runs it
  return module


def test_checkpoints_use_tunix_theta_and_the_bench_shape(vs_tunix):
  assert {name: cfg.rope_theta for name, cfg in vs_tunix.MODELS.items()} == {
    "tiny": 1e6,
    "qwen3-50m": 1e6,
  }
  bench = bench_sampler.MODELS["qwen3-50m"]
  assert vs_tunix.MODELS["qwen3-50m"] == type(bench)(**{**vars(bench), "rope_theta": 1e6})
  # tiny: embedding + LM head 2 * 512 * 64, per layer q/o 2 * 64 * 64, k/v 2 * 64 * 32, MLP
  # 3 * 64 * 128, norms 2 * 64 + q/k norms 2 * 16; final norm 64.
  per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64 + 2 * 16
  assert vs_tunix.MODELS["tiny"].num_params() == 2 * 512 * 64 + 2 * per_layer + 64


def test_shapes_parsed_and_bad_ones_named(vs_tunix):
  assert vs_tunix.parse_shapes("1:128, 16:128,") == [(1, 128), (16, 128)]
  for bad in ("1:0", "1", "a:2", ",", "1:2:3"):
    with pytest.raises(ValueError, match="--shapes"):
      vs_tunix.main([f"--shapes={bad}", "--models=tiny"])
  with pytest.raises(ValueError, match="unknown or no model"):
    vs_tunix.main(["--models=qwen3-8b"])


def test_tokenizer_pads_outside_the_vocabulary(vs_tunix):
  tok = vs_tunix.IdTokenizer(512)
  assert tok.encode("5 17 9") == [5, 17, 9] and tok.decode(np.array([5, 17, 9])) == "5 17 9"
  assert tok.pad_id() == tok.eos_id() == 512 and not tok.bos_id()


def test_reference_equals_opd_jax_greedy(vs_tunix, tmp_path):
  import jax
  import jax.numpy as jnp
  import torch
  import transformers

  from opd_jax.inference import sampler
  from opd_jax.io import hf
  from opd_jax.model import kvcache
  from opd_jax.model import transformer as model

  cfg = vs_tunix.MODELS["tiny"]
  params = model.init_params(jax.random.key(0), cfg, jnp.float32, scale=0.1)
  hf.save_checkpoint(str(tmp_path), cfg, params)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
  tokens_bp = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 16))
  ref = vs_tunix.reference_tokens(hf_model.eval(), tokens_bp, 12)
  scfg = sampler.SamplerConfig(
    max_new_tokens=12, temperature=0.0, kv=kvcache.KVCacheSpec("float32"), cache_len=28
  )
  prompts = (tokens_bp.astype(np.int32), np.full((2,), 16, np.int32))
  out = sampler.sample(params, prompts, jax.random.key(0), scfg, cfg)
  assert ref.shape == (2, 12) and np.unique(ref).size > 4  # not a loop of one token
  np.testing.assert_array_equal(np.asarray(out.completion_tokens), ref)
