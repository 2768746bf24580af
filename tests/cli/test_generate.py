"""`python -m opd_jax.generate` against `sampler.sample` on the same checkpoint."""

from __future__ import annotations

import itertools
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax import generate
from opd_jax.config import check as config_check
from opd_jax.inference import sampler
from opd_jax.io import hf
from opd_jax.io.build import DTYPES
from opd_jax.train import setup as setup_lib
from opd_jax.train.setup import run_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))

import base  # noqa: E402


def _save_tokenizer(path, vocab_size):
  """A WordLevel tokenizer whose ids are the model's: '<pad>'=0, '<bos>'=1, '<eos>'=2, 'w3'..."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
  raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
  raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  fast = PreTrainedTokenizerFast(
    tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
  )
  fast.save_pretrained(path)


def test_json_output_equals_sampler(make_hf_checkpoint, capsys):
  ckpt = make_hf_checkpoint("qwen3")
  argv = ["--checkpoint", str(ckpt.path), "--prompt-ids", "5,9,2,77", "--prompt-ids", "100,3"]
  argv += ["--max-new-tokens", "6", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9"]
  argv += ["--seed", "4", "--dtype", "float32", "--ignore-eos", "--stop-ids", "17", "--json"]
  assert generate.main(argv) == 0
  got = json.loads(capsys.readouterr().out)
  assert set(got) == {"completions", "logprobs"}  # no tokenizer in the directory

  cfg, params = hf.load_checkpoint(ckpt.path, jnp.float32)
  scfg = sampler.SamplerConfig(6, 0.8, top_k=20, top_p=0.9, stop_tokens=(17,))
  ref = sampler.sample(params, [[5, 9, 2, 77], [100, 3]], jax.random.key(4), scfg, cfg)
  for b in range(2):
    mask = np.asarray(ref.completion_mask[b], bool)
    assert got["completions"][b] == np.asarray(ref.completion_tokens[b])[mask].tolist()
    np.testing.assert_allclose(got["logprobs"][b], np.asarray(ref.behaviour_logprobs[b])[mask])
    assert 1 <= len(got["completions"][b]) <= 6


def test_text_prompts_with_checkpoint_tokenizer(make_hf_checkpoint, tmp_path, capsys):
  ckpt = make_hf_checkpoint("qwen3")
  directory = tmp_path / "ckpt"
  shutil.copytree(ckpt.path, directory)
  _save_tokenizer(directory, 128)
  argv = ["--checkpoint", str(directory), "--prompt", "w5 w9 w77", "--prompt-ids", "1,5,9,77"]
  argv += ["--max-new-tokens", "5", "--temperature", "0", "--dtype", "float32", "--json"]
  assert generate.main(argv) == 0
  got = json.loads(capsys.readouterr().out)
  # The text prompt is encoded as <bos> w5 w9 w77, i.e. the same ids as the second prompt.
  assert got["completions"][0] == got["completions"][1]
  ids = got["completions"][0]
  assert 1 <= len(ids) <= 5 and (len(ids) == 5 or ids[-1] == 2)  # stops at <eos> = 2
  words = [f"w{i}" for i in ids if i != 2]
  assert got["text"][0].split() == words
  np.testing.assert_array_equal(got["logprobs"][0], 0.0)  # greedy: point-mass behaviour

  assert generate.main(argv[:-1]) == 0  # readable output
  out = capsys.readouterr().out
  assert "engine w=trainer,kv=float32" in out and "[1] " in out


def test_bad_arguments(make_hf_checkpoint):
  ckpt = str(make_hf_checkpoint("qwen3").path)
  with pytest.raises(ValueError, match="--prompt 'hello' needs a tokenizer"):
    generate.main(["--checkpoint", ckpt, "--prompt", "hello"])
  with pytest.raises(ValueError, match=r"--prompt-ids '1,x': expected comma-separated integer"):
    generate.main(["--checkpoint", ckpt, "--prompt-ids", "1,x"])
  with pytest.raises(ValueError, match="no prompt given"):
    generate.main(["--checkpoint", ckpt])
  with pytest.raises(ValueError, match="--dtype 'float16' is not one of: float32, bfloat16"):
    generate.main(["--checkpoint", ckpt, "--prompt-ids", "1", "--dtype", "float16"])
  with pytest.raises(ValueError, match="rollout.kv_cache 'int8' is not one of: auto, bf16, fp8"):
    generate.main(["--checkpoint", ckpt, "--prompt-ids", "1", "--rollout=rollout.kv_cache=int8"])
  with pytest.raises(ValueError, match="--rollout 'rollout.kv=fp8': expected one of"):
    generate.main(["--checkpoint", ckpt, "--prompt-ids", "1", "--rollout=rollout.kv=fp8"])
  with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 2.0"):
    generate.main(["--checkpoint", ckpt, "--prompt-ids", "1", "--top-p", "2"])
  with pytest.raises(FileNotFoundError, match="does not exist"):
    generate.main(["--checkpoint", ckpt + "-missing", "--prompt-ids", "1"])


def test_options_and_defaults_are_the_trainers():
  config = base.get_config()
  args = generate.parse_args(["--checkpoint", "x", "--prompt-ids", "1"])
  assert (args.weights, args.kv_cache, args.dtype) == (
    config.rollout.weights,
    config.rollout.kv_cache,
    config.student.dtype,
  )
  rules = config_check.RULES
  assert rules["rollout.weights"].options == generate.WEIGHTS
  assert rules["rollout.kv_cache"].options == generate.KV_CACHES
  assert tuple(DTYPES) == rules["student.dtype"].options == generate.DTYPE_NAMES
  # Each combination names the engine the trainer builds for the same values.
  for weights, kv, dtype in itertools.product(generate.WEIGHTS, generate.KV_CACHES, DTYPES):
    config.rollout.weights, config.rollout.kv_cache = weights, kv
    config.rollout.weight_group_size = 32 if weights == "fp4" else 0  # fp4 needs its MX blocks
    ref = setup_lib.engine_config(run_spec(config), dtype)
    assert generate.engine_numerics(weights, kv, dtype) == (ref.weights, ref.kv.dtype)


@pytest.mark.slow
def test_defaults_and_deprecated_spellings(make_hf_checkpoint, capsys):
  ckpt = str(make_hf_checkpoint("qwen3").path)
  capsys.readouterr()  # transformers' progress bar, when this test is the first to save it
  base_argv = ["--checkpoint", ckpt, "--prompt-ids", "5,9,2", "--max-new-tokens", "4"]
  base_argv += ["--temperature", "0", "--ignore-eos"]
  assert generate.main(base_argv) == 0  # the defaults: trainer weights, f32 compute and cache
  captured = capsys.readouterr()
  assert captured.out.startswith("engine w=trainer,kv=float32,") and captured.err == ""
  default = generate.generate(generate.parse_args(base_argv))

  messages = []
  old = base_argv + ["--weights", "dense", "--kv-cache", "f32", "--dtype", "bfloat16"]
  got = generate.generate(generate.parse_args(old), warn=messages.append)
  assert messages == [
    "warning: --weights dense is deprecated; use --weights trainer",
    "warning: --kv-cache f32 is deprecated; use --kv-cache auto with --dtype float32 "
    "(a float32 cache is still used)",
  ]
  assert got["engine_id"].startswith("w=trainer,kv=float32,")  # bf16 weights, f32 cache
  assert len(got["completions"][0]) == 4

  # The line in docs/guides/fp8_async.md: fp8 weights and an fp8 KV cache.
  readme = base_argv + ["--rollout=rollout.weights=fp8,rollout.kv_cache=fp8", "--json"]
  assert generate.main(readme) == 0
  fp8 = json.loads(capsys.readouterr().out)
  assert len(fp8["completions"][0]) == 4 and len(default["completions"][0]) == 4
  bf16 = generate.generate(generate.parse_args(base_argv + ["--rollout=rollout.weights=bf16"]))
  assert bf16["engine_id"].startswith("w=bf16,kv=bfloat16,")  # auto follows the engine dtype


def test_padded_rows_are_never_generated(make_hf_checkpoint, tmp_path, capsys):
  """A 100-token tokenizer over 128 embedding rows whose padded lm-head columns dominate
  every logit: without the tokenizer only padded ids come out; with it, none do."""
  cfg, params = hf.load_checkpoint(make_hf_checkpoint("qwen3").path, jnp.float32)
  params = jax.device_get(params)
  params["lm_head_dv"] = np.asarray(params["lm_head_dv"]).copy()
  params["lm_head_dv"][:, 100:] = 1e3  # padded rows; the final norm keeps h nonzero
  directory = tmp_path / "padded"
  hf.save_checkpoint(directory, cfg, params)
  argv = ["--checkpoint", str(directory), "--prompt-ids", "5,9,77", "--max-new-tokens", "4"]
  argv += ["--temperature", "0", "--dtype", "float32", "--ignore-eos", "--json"]

  assert generate.main(argv) == 0  # no tokenizer: all 128 rows are the vocabulary
  unmasked = json.loads(capsys.readouterr().out)["completions"][0]
  assert min(unmasked) >= 100  # the control: the padded rows win when they are allowed

  _save_tokenizer(directory, 100)
  assert generate.main(argv) == 0
  masked = json.loads(capsys.readouterr().out)["completions"][0]
  assert len(masked) == 4 and max(masked) < 100


def test_rollout_spec_and_the_old_engine_flags_parse_alike(capsys):
  """`--rollout=rollout.<key>=<value>,...` (the candidates' syntax) sets what the old flags set;
  each old flag still parses, with a warning, and is hidden from --help."""
  base_argv = ["--checkpoint=x", "--prompt-ids=1", "--prompt=a", "--prompt-ids=2"]
  spec = "rollout.weights=fp4,rollout.kv_cache=fp8,rollout.weight_group_size=32"
  new = generate.parse_args([*base_argv, f"--rollout={spec},rollout.kv_granularity=tensor"])
  assert capsys.readouterr().err == ""
  old = generate.parse_args(
    [*base_argv, "--weights", "fp4", "--kv-cache=fp8", "--weight-group-size=32"]
    + ["--kv-granularity=tensor"]
  )
  err = capsys.readouterr().err
  assert "--weights is deprecated" in err and "use --rollout=rollout.weights=VALUE" in err
  for key in ("weights", "kv_cache", "kv_granularity", "weight_group_size"):
    assert getattr(new, key) == getattr(old, key), key
  assert (new.weights, new.kv_cache, new.weight_group_size) == ("fp4", "fp8", 32)
  assert new.prompts == [("ids", "1"), ("text", "a"), ("ids", "2")]  # in the order given
  with pytest.raises(SystemExit) as shown:
    generate.parse_args(["--help"])
  assert shown.value.code == 0
  text = capsys.readouterr().out
  assert "  --rollout: " in text and "  --weights" not in text and "  --kv-cache" not in text
