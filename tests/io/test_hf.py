"""opd_jax.io.hf against transformers: logits parity, round trips, sharded files, errors."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_model_cfg
from safetensors.numpy import load_file, save_file

from opd_jax.io import hf, hf_export
from opd_jax.model import tokenizer as tokenizer_lib
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.model.quant import QArray

LLAMA3_ROPE = {
  "rope_type": "llama3",
  "rope_theta": 10000.0,
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  # With head_dim 16 the wavelengths (6.3, 20, 63, ...) fall in all three llama3
  # bands: kept (< 32/4), smoothed (8..32) and scaled (> 32).
  "original_max_position_embeddings": 32,
}

# (model_type, overrides): each architecture plain, and each with a variant.
VARIANTS = {
  "qwen3": ("qwen3", {}),
  "qwen3_mqa_hd16_bias_tied": (
    "qwen3",
    {
      "num_key_value_heads": 1,
      "head_dim": 16,  # != hidden / heads = 8
      "attention_bias": True,
      "tie_word_embeddings": True,
    },
  ),
  "qwen2": ("qwen2", {}),
  "qwen2_tied_mqa": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
  "llama": ("llama", {}),
  "llama3rope_bias_hd16": (
    "llama",
    {"rope_parameters": LLAMA3_ROPE, "attention_bias": True, "head_dim": 16},
  ),
}


def _tokens(cfg, batch=2, length=24, seed=0):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length))


def _torch_logits(torch_model, tokens):
  with torch.no_grad():
    return torch_model(torch.tensor(tokens)).logits.float().numpy()


def _state(torch_model):
  return {k: v.detach().float().numpy() for k, v in torch_model.state_dict().items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_transformers(make_hf_checkpoint, variant):
  model_type, overrides = VARIANTS[variant]
  ckpt = make_hf_checkpoint(model_type, **overrides)
  cfg, params = hf.load_checkpoint(ckpt.path)
  assert cfg.model_type == model_type
  assert cfg.head_dim == overrides.get("head_dim", 8)
  assert cfg.num_kv_heads == overrides.get("num_key_value_heads", 2)
  assert ("lm_head_dv" in params) == (not cfg.tie_word_embeddings)
  tokens = _tokens(cfg)
  ours = np.asarray(jax.jit(model.forward, static_argnums=2)(params, jnp.asarray(tokens), cfg))
  ref = _torch_logits(ckpt.model, tokens)
  diff = float(np.max(np.abs(ours - ref)))
  print(f"parity {variant}: max|logits diff| = {diff:.3g} (max|logit| {np.max(np.abs(ref)):.3g})")
  assert diff <= 1e-4


@pytest.mark.parametrize("variant", ["qwen3_mqa_hd16_bias_tied", "qwen2", "llama3rope_bias_hd16"])
def test_save_round_trip_loads_in_transformers(make_hf_checkpoint, tmp_path, variant):
  model_type, overrides = VARIANTS[variant]
  ckpt = make_hf_checkpoint(model_type, **overrides)
  cfg, params = hf.load_checkpoint(ckpt.path)
  hf.save_checkpoint(tmp_path, cfg, params)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path, attn_implementation="eager"
  )
  assert type(reloaded) is type(ckpt.model)
  assert reloaded.dtype == torch.float32
  want, got = _state(ckpt.model), _state(reloaded)
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  tokens = _tokens(cfg)
  diff = np.max(np.abs(_torch_logits(reloaded, tokens) - _torch_logits(ckpt.model, tokens)))
  assert diff <= 1e-5
  # And our own loader reads back exactly what it wrote.
  cfg2, params2 = hf.load_checkpoint(tmp_path)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_bf16_round_trip(make_hf_checkpoint, tmp_path):
  ckpt = make_hf_checkpoint("qwen3")
  cfg, params = hf.load_checkpoint(ckpt.path, dtype=jnp.bfloat16)
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  hf.save_checkpoint(tmp_path, cfg, params)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["torch_dtype"] == config["dtype"] == "bfloat16"
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
  assert reloaded.dtype == torch.bfloat16
  for name, value in ckpt.model.state_dict().items():
    torch.testing.assert_close(reloaded.state_dict()[name], value.bfloat16(), rtol=0, atol=0)
  _, params2 = hf.load_checkpoint(tmp_path, dtype=jnp.bfloat16)
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_loads_bf16_checkpoint_into_f32(make_hf_checkpoint):
  ckpt = make_hf_checkpoint("llama", dtype="bfloat16")
  _, params = hf.load_checkpoint(ckpt.path, dtype=jnp.float32)
  want = _state(ckpt.model)
  np.testing.assert_array_equal(params["embed_vd"], want["model.embed_tokens.weight"])
  np.testing.assert_array_equal(
    params["layers"][1]["o_nhd"].reshape(-1, 32).T, want["model.layers.1.self_attn.o_proj.weight"]
  )
  assert params["layers"][0]["q_dnh"].dtype == jnp.float32


def test_sharded_checkpoint_loads_identically(make_hf_checkpoint):
  single = make_hf_checkpoint("qwen2")
  sharded = make_hf_checkpoint("qwen2", max_shard_size="20KB")
  assert (sharded.path / "model.safetensors.index.json").exists()
  assert len(list(sharded.path.glob("model-*-of-*.safetensors"))) > 1
  cfg_a, params_a = hf.load_checkpoint(single.path)
  cfg_b, params_b = hf.load_checkpoint(sharded.path)
  assert cfg_a == cfg_b
  jax.tree.map(np.testing.assert_array_equal, params_b, params_a)


def test_save_sharded_loads_in_transformers_and_back(make_hf_checkpoint, tmp_path):
  ckpt = make_hf_checkpoint("llama", tie_word_embeddings=True)
  cfg, params = hf.load_checkpoint(ckpt.path)
  (tmp_path / "model.safetensors").write_bytes(b"stale")  # must not survive the save
  hf.save_checkpoint(tmp_path, cfg, params, max_shard_bytes=20_000)
  shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
  assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert sorted(set(index["weight_map"].values())) == shards
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path, attn_implementation="eager"
  )
  tokens = _tokens(cfg)
  diff = np.max(np.abs(_torch_logits(reloaded, tokens) - _torch_logits(ckpt.model, tokens)))
  assert diff <= 1e-5
  _, params2 = hf.load_checkpoint(tmp_path)
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_shardings_place_each_param(make_hf_checkpoint):
  ckpt = make_hf_checkpoint("qwen3")
  mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  col = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def rules(cfg):
    shapes = jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg))
    return jax.tree.map(lambda s: col if len(s.shape) >= 2 else rep, shapes)

  _, params = hf.load_checkpoint(ckpt.path, shardings=rules)
  assert params["layers"][0]["q_dnh"].sharding == col
  assert params["layers"][0]["attn_norm_d"].sharding == rep
  _, params = hf.load_checkpoint(ckpt.path, shardings=rep)
  assert all(leaf.sharding == rep for leaf in jax.tree.leaves(params))
  with pytest.raises(ValueError, match="shardings has no entry for param 'embed_vd'"):
    hf.load_checkpoint(ckpt.path, shardings={"layers": []})


def _copy(ckpt, tmp_path):
  return shutil.copytree(ckpt.path, tmp_path / "ckpt")


def _edit_config(path, **changes):
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps(config | changes))


def test_missing_tensor_is_named(make_hf_checkpoint, tmp_path):
  path = _copy(make_hf_checkpoint("qwen3"), tmp_path)
  tensors = load_file(path / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError) as err:
    hf.load_checkpoint(path)
  assert str(err.value) == (
    "tensor 'model.layers.1.mlp.up_proj.weight' (needed for layers/1/up_df) not found in "
    f"{path / 'model.safetensors'}"
  )


def test_missing_tensor_in_sharded_checkpoint_is_named(make_hf_checkpoint, tmp_path):
  path = _copy(make_hf_checkpoint("qwen2", max_shard_size="20KB"), tmp_path)
  index_file = path / "model.safetensors.index.json"
  index = json.loads(index_file.read_text())
  del index["weight_map"]["model.norm.weight"]
  index_file.write_text(json.dumps(index))
  num_shards = len(set(index["weight_map"].values()))
  with pytest.raises(ValueError) as err:
    hf.load_checkpoint(path)
  assert str(err.value) == (
    f"tensor 'model.norm.weight' (needed for final_norm_d) not found in {index_file} "
    f"and the {num_shards} shard(s) it lists"
  )


def test_shape_mismatch_is_named(make_hf_checkpoint, tmp_path):
  path = _copy(make_hf_checkpoint("llama"), tmp_path)
  _edit_config(path, intermediate_size=48)
  with pytest.raises(ValueError) as err:
    hf.load_checkpoint(path)
  assert str(err.value) == (
    f"tensor 'model.layers.0.mlp.gate_proj.weight' in {path / 'model.safetensors'} has shape "
    "(64, 32), but config.json implies (48, 32)"
  )


def test_extra_layers_in_weights_are_rejected(make_hf_checkpoint, tmp_path):
  path = _copy(make_hf_checkpoint("qwen2"), tmp_path)
  _edit_config(path, num_hidden_layers=1)
  with pytest.raises(ValueError, match=r"tensor\(s\) in .* not described by its config.json: "):
    hf.load_checkpoint(path)


def test_unsupported_model_type_lists_supported(make_hf_checkpoint, tmp_path):
  path = _copy(make_hf_checkpoint("llama"), tmp_path)
  _edit_config(path, model_type="mistral")
  with pytest.raises(ValueError) as err:
    hf.load_checkpoint(path)
  assert str(err.value) == (
    f"{path / 'config.json'}: unsupported model_type 'mistral' in config.json; "
    "supported: llama, qwen2, qwen3"
  )


def test_config_missing_key_is_named(make_hf_checkpoint, tmp_path):
  path = _copy(make_hf_checkpoint("llama"), tmp_path)
  config = json.loads((path / "config.json").read_text())
  del config["hidden_size"]
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="config.json lacks required key 'hidden_size'"):
    hf.load_checkpoint(path)


def test_missing_paths_are_named(make_hf_checkpoint, tmp_path):
  missing = tmp_path / "nope"
  with pytest.raises(FileNotFoundError, match=f"checkpoint directory '{missing}' does not exist"):
    hf.load_checkpoint(missing)
  path = _copy(make_hf_checkpoint("qwen3"), tmp_path)
  (path / "model.safetensors").unlink()
  with pytest.raises(
    FileNotFoundError,
    match=re.escape(
      f"no model.safetensors or model.safetensors.index.json in checkpoint directory '{path}'"
    ),
  ):
    hf.load_checkpoint(path)
  (path / "config.json").unlink()
  with pytest.raises(
    FileNotFoundError, match=re.escape(f"no config.json in checkpoint directory '{path}'")
  ):
    hf.load_checkpoint(path)


def test_missing_shard_file_is_named(make_hf_checkpoint, tmp_path):
  path = _copy(make_hf_checkpoint("qwen2", max_shard_size="20KB"), tmp_path)
  shard = sorted(path.glob("model-*-of-*.safetensors"))[-1]
  shard.unlink()
  with pytest.raises(FileNotFoundError, match=re.escape(f"to {shard}, which does not exist")):
    hf.load_checkpoint(path)


def test_corrupt_file_is_named(make_hf_checkpoint, tmp_path):
  path = _copy(make_hf_checkpoint("qwen3"), tmp_path)
  file = path / "model.safetensors"
  file.write_bytes(file.read_bytes()[:-100])  # truncated: the header promises more bytes
  with pytest.raises(ValueError) as err:
    hf.load_checkpoint(path)
  assert str(err.value).startswith(
    f"cannot read safetensors file {file}: Error while deserializing"
  )
  (path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match=re.escape(f"{path / 'config.json'} is not valid JSON")):
    hf.load_checkpoint(path)


def test_save_rejects_quantized_and_mismatched_params(tmp_path):
  cfg = ModelConfig("qwen3", 32, 16, 32, 1, 2, 1, 8, qk_norm=True)
  shapes = jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg))
  params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)
  quantized = dict(params, embed_vd=QArray(params["embed_vd"], jnp.ones((1, 16))))
  with pytest.raises(ValueError, match="save the unquantized params instead"):
    hf.save_checkpoint(tmp_path, cfg, quantized)
  with pytest.raises(ValueError, match=r"param 'layers/0/q_dnh' has shape \(16, 2, 8\), expected"):
    hf.save_checkpoint(tmp_path, dataclasses.replace(cfg, head_dim=4), params)
  with pytest.raises(ValueError, match="params lack 'lm_head_dv'"):
    hf.save_checkpoint(tmp_path, cfg, {k: v for k, v in params.items() if k != "lm_head_dv"})
  tied = dataclasses.replace(cfg, tie_word_embeddings=True)
  with pytest.raises(ValueError, match="does not describe .*: lm_head_dv"):
    hf.save_checkpoint(tmp_path, tied, params)
  assert not list(tmp_path.iterdir())  # nothing written on a rejected save


# ---------------------------------------------------------------------------------------------
# Export: generation ids, generation_config.json and the tokenizer.


def _tiny_params(cfg, seed=0):
  return model.init_params(jax.random.key(seed), cfg)


def _no_bos_fast_tokenizer():
  """A real HF fast tokenizer with eos and pad but no bos (as Qwen's), in memory."""
  import tokenizers
  from tokenizers import models, pre_tokenizers

  vocab = {c: i for i, c in enumerate("0123456789")} | {"<eos>": 10, "<pad>": 11}
  backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=None))
  backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
  return transformers.PreTrainedTokenizerFast(
    tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>"
  )


def _no_bos_tokenizer(directory):
  """`_no_bos_fast_tokenizer` saved to `directory` and loaded from there, as a run loads it."""
  _no_bos_fast_tokenizer().save_pretrained(directory)
  return tokenizer_lib.load_tokenizer(str(directory))


def test_save_with_generation_config_writes_the_ids(tmp_path):
  cfg = tiny_model_cfg(vocab_size=21)
  generation = hf_export.generation_config(tokenizer_lib.CharTokenizer())
  assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
  hf.save_checkpoint(tmp_path, cfg, _tiny_params(cfg), generation_config=generation)
  config = json.loads((tmp_path / "config.json").read_text())
  assert {k: config[k] for k in hf.ID_KEYS} == generation
  assert json.loads((tmp_path / "generation_config.json").read_text()) == generation
  loaded = transformers.AutoConfig.from_pretrained(tmp_path)
  assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 0)
  assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id == 2
  # A save without ids leaves no stale generation_config.json and no ids behind.
  hf.save_checkpoint(tmp_path, cfg, _tiny_params(cfg))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
  assert not set(hf.ID_KEYS) & set(json.loads((tmp_path / "config.json").read_text()))


@pytest.mark.parametrize(
  "generation, message",
  [
    ({"bos_token_id": 1}, "generation_config has no eos_token_id"),
    ({"eos_token_id": 21}, r"eos_token_id=21 is outside the model's vocabulary \[0, 21\)"),
    ({"eos_token_id": [2, -1]}, r"eos_token_id=\[2, -1\] is outside"),
    ({"eos_token_id": True}, "eos_token_id must be an int or a list of ints, got True"),
    ({"eos_token_id": 2, "pad_token_id": "0"}, "pad_token_id must be an int"),
  ],
)
def test_save_refuses_bad_generation_ids(tmp_path, generation, message):
  cfg = tiny_model_cfg(vocab_size=21)
  with pytest.raises(ValueError, match=message):
    hf.save_checkpoint(tmp_path / "out", cfg, _tiny_params(cfg), generation_config=generation)
  assert not (tmp_path / "out").exists()


def test_generation_config_keeps_the_sources_defaults(tmp_path):
  char = tokenizer_lib.CharTokenizer()
  source = {"temperature": 0.7, "top_p": 0.8, "eos_token_id": [5, 2], "bos_token_id": 9}
  (tmp_path / "generation_config.json").write_text(json.dumps(source))
  # The tokenizer's ids win; a source eos list that holds the tokenizer's eos stays.
  assert hf_export.generation_config(char, tmp_path) == {
    "temperature": 0.7,
    "top_p": 0.8,
    "eos_token_id": [5, 2],
    "bos_token_id": 1,
    "pad_token_id": 0,
  }
  (tmp_path / "generation_config.json").write_text(json.dumps(source | {"eos_token_id": [5, 7]}))
  assert hf_export.generation_config(char, tmp_path)["eos_token_id"] == 2
  # No bos in the tokenizer: the source's bos stays; without a source there is none.
  no_bos = _no_bos_tokenizer(tmp_path / "tok")
  assert no_bos.bos_id is None
  assert hf_export.generation_config(no_bos, tmp_path)["bos_token_id"] == 9
  assert hf_export.generation_config(no_bos) == {"eos_token_id": 10, "pad_token_id": 11}
  assert hf_export.generation_config(char, tmp_path / "no_such_dir") == hf_export.token_ids(char)


def test_char_tokenizer_loads_in_transformers(tmp_path):
  char = tokenizer_lib.CharTokenizer()
  files = hf_export.save_char_tokenizer(char, tmp_path)
  assert files == ["tokenizer.json", "tokenizer_config.json"]
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
  text = tokenizer_lib.CHAR_ALPHABET + "907+1="
  assert len(tok) == char.vocab_size
  assert tok.encode(text, add_special_tokens=False) == char.encode(text)
  assert tok(text)["input_ids"] == [char.bos_id, *char.encode(text)]  # [bos] prompt, as the task
  assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
  ids = [char.bos_id, *char.encode(text), char.eos_id, char.pad_id]
  assert tok.decode(ids, skip_special_tokens=True) == char.decode(ids) == text
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
  with pytest.raises(Exception, match="Missing"):
    tok.encode("x", add_special_tokens=False)  # outside the alphabet, as in CharTokenizer


def test_export_student_writes_a_loadable_directory(tmp_path):
  cfg = tiny_model_cfg(vocab_size=21)
  params = _tiny_params(cfg)
  no_bos = _no_bos_tokenizer(tmp_path / "tok")
  (tmp_path / "tok" / "vocab.json").write_text("{}")  # a file the char export must not keep
  out = tmp_path / "out"
  files = hf_export.export_student(out, cfg, params, no_bos)  # copies from where no_bos was loaded
  copied = sorted(p.name for p in (tmp_path / "tok").iterdir())
  assert files == sorted(["config.json", "generation_config.json", "model.safetensors", *copied])
  for name in copied:
    assert (out / name).read_bytes() == (tmp_path / "tok" / name).read_bytes()
  config = json.loads((out / "config.json").read_text())
  assert (config["eos_token_id"], config["pad_token_id"], "bos_token_id" in config) == (
    10,
    11,
    False,
  )
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  tokens = _tokens(cfg)
  ours = np.asarray(model.forward(params, jnp.asarray(tokens), cfg))
  assert np.max(np.abs(_torch_logits(reloaded, tokens) - ours)) <= 1e-5
  # Exporting again with the char tokenizer replaces the earlier tokenizer's files.
  files = hf_export.export_student(out, cfg, params, tokenizer_lib.CharTokenizer())
  assert "vocab.json" not in files and "tokenizer.json" in files
  assert json.loads((out / "generation_config.json").read_text())["bos_token_id"] == 1


def test_export_student_refuses_before_writing(tmp_path):
  cfg = tiny_model_cfg(vocab_size=21)
  params = _tiny_params(cfg)
  no_bos = _no_bos_tokenizer(tmp_path / "tok")
  out = tmp_path / "out"
  in_memory = tokenizer_lib.HFTokenizer(_no_bos_fast_tokenizer())  # loaded from no directory
  with pytest.raises(ValueError, match="HFTokenizer needs its tokenizer directory"):
    hf_export.export_student(out, cfg, params, in_memory)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="holds none of the tokenizer files"):
    hf_export.export_student(out, cfg, params, no_bos, tokenizer_dir=tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="tokenizer directory .* does not exist"):
    hf_export.export_student(out, cfg, params, no_bos, tokenizer_dir=tmp_path / "gone")
  assert not out.exists()


def test_export_into_its_own_tokenizer_directory(tmp_path):
  """A run trained from an export writes its export back over it: the tokenizer is read from
  the old directory before the new one replaces it, and nothing of the old weights is left."""
  cfg = tiny_model_cfg(vocab_size=21)
  no_bos = _no_bos_tokenizer(tmp_path / "tok")
  out = tmp_path / "out"
  first = hf_export.export_student(out, cfg, _tiny_params(cfg), no_bos)
  (out / "README.md").write_text("kept")  # not the export's: it survives
  again = tokenizer_lib.load_tokenizer(str(out))
  params = _tiny_params(cfg, seed=1)
  files = hf_export.export_student(out, cfg, params, again)
  assert files == sorted([*first, "README.md"]) and (out / "README.md").read_text() == "kept"
  for name in first:
    if name in hf_export.TOKENIZER_FILES:
      assert (out / name).read_bytes() == (tmp_path / "tok" / name).read_bytes()
  _, reloaded = hf.load_checkpoint(out)
  jax.tree.map(np.testing.assert_array_equal, reloaded, params)


def test_failed_save_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
  cfg = tiny_model_cfg(vocab_size=21)
  params = _tiny_params(cfg)
  hf.save_checkpoint(tmp_path / "ckpt", cfg, params)
  before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
  calls = []

  def full_disk(tensors, file, metadata=None):
    calls.append(file)
    if len(calls) == 2:
      raise OSError(28, "No space left on device")
    save_file(tensors, file, metadata=metadata)

  monkeypatch.setattr(hf, "save_file", full_disk)
  with pytest.raises(OSError, match="No space"):
    hf.save_checkpoint(tmp_path / "ckpt", cfg, _tiny_params(cfg, seed=1), max_shard_bytes=2_000)
  assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging directory left


@pytest.mark.parametrize(
  "model_type, flags, named",
  [
    ("llama", {"qk_norm": True}, "qk_norm=True"),
    ("qwen3", {}, "qk_norm=False"),
    ("qwen2", {"qkv_bias": False}, "qkv_bias=False, o_bias=False"),
    ("llama", {"qkv_bias": True}, "qkv_bias=True, o_bias=False"),
  ],
)
def test_save_refuses_a_config_json_cannot_express(tmp_path, model_type, flags, named):
  cfg = ModelConfig(model_type, 21, 16, 32, 1, 2, 1, 8, **flags)
  with pytest.raises(ValueError, match=f"cannot express this {model_type} model: .*{named}"):
    hf.save_checkpoint(tmp_path / "out", cfg, {})
  assert not (tmp_path / "out").exists()


def test_a_shard_index_naming_the_wrong_file_is_a_value_error(make_hf_checkpoint, tmp_path):
  path = tmp_path / "ckpt"
  shutil.copytree(make_hf_checkpoint("qwen2", max_shard_size="20KB").path, path)  # shared
  index_file = path / "model.safetensors.index.json"
  index = json.loads(index_file.read_text())
  first = sorted(set(index["weight_map"].values()))[0]
  moved = next(n for n, f in index["weight_map"].items() if f != first)
  index["weight_map"][moved] = first
  index_file.write_text(json.dumps(index))
  with pytest.raises(ValueError, match=f"'{re.escape(moved)}' is mapped to .*{first}"):
    hf.load_checkpoint(path)
