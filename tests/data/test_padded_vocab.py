"""Padded vocabularies: a student and teacher that share one tokenizer but whose embedding
tables differ in size (as Qwen2.5 0.5B-3B with 151,936 rows and 7B+ with 152,064 over one
tokenizer of 151,665 tokens).

The pair here: two tiny random HF Qwen3 checkpoints with 300 and 364 embedding rows, both
saved with one byte-level BPE tokenizer of V_real = 290 tokens. References: `transformers`'
logits on the same weights (cut to the first 290), numpy log-softmaxes for the losses, and
the unpadded config (`logical_vocab_size=0`) as the control that shows each check can fail.

`python tests/data/test_padded_vocab.py sharded` is the sharded check's subprocess (8 host devices).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags_with
from test_prompts import user_config

from opd_jax.inference import sampler
from opd_jax.io import build, hf
from opd_jax.model import sharding
from opd_jax.model import tokenizer as tokenizer_lib
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.train import (
  export as exporting,
)
from opd_jax.train import (
  preflight,
  train_step,
  trainer,
)
from opd_jax.train.setup import run_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import base  # noqa: E402

V_REAL = 290  # the tokenizer: 256 byte symbols, 31 merges, 3 special tokens
STUDENT_ROWS, TEACHER_ROWS = 300, 364
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
  "the quick brown fox jumps over the lazy dog",
  "a student learns from a teacher on its own samples",
  "the teacher scores every token the student writes",
  "two plus two is four and three plus three is six",
] * 20
OTHER_CORPUS = ["zebras zigzag across the azure plaza", "jazz quizzes puzzle the wizard"] * 40
CHAT_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_bpe_tokenizer(directory, corpus=CORPUS, eos="<|im_end|>", size=V_REAL):
  """A Qwen-like byte-level BPE tokenizer trained on `corpus` (`size` tokens: the 256 byte
  symbols, merges, then the 3 special tokens), saved into `directory`."""
  import tokenizers
  import transformers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  bpe = trainers.BpeTrainer(
    vocab_size=size - len(SPECIALS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  backend.train_from_iterator(corpus, bpe)
  backend.add_special_tokens(SPECIALS)  # ids size-3 .. size-1, as Qwen's come last
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=backend,
    eos_token=eos,
    pad_token="<|endoftext|>",
    additional_special_tokens=["<|im_start|>"],
  )
  fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(directory)
  tok = tokenizer_lib.load_tokenizer(str(directory))
  assert tok.vocab_size == size, tok.vocab_size
  return tok


@pytest.fixture(scope="module")
def pair(make_hf_checkpoint, tmp_path_factory):
  """(student dir, teacher dir, student torch model, teacher torch model): 300 and 364 rows,
  the same 290-token tokenizer saved into both."""
  root = tmp_path_factory.mktemp("padded")
  s = make_hf_checkpoint("qwen3", vocab_size=STUDENT_ROWS)
  t = make_hf_checkpoint("qwen3", seed=1, vocab_size=TEACHER_ROWS)
  student = shutil.copytree(s.path, root / "student")
  teacher = shutil.copytree(t.path, root / "teacher")
  for directory in (student, teacher):
    save_bpe_tokenizer(directory)
  return student, teacher, s.model, t.model


run_config = user_config  # the tiny config on two HF checkpoint directories


def _tokens(tok, n_rows=2, width=12):
  """[n_rows, width] ids of real text, all below V_real."""
  ids = tok.encode("the student learns from the teacher on its own samples, two plus two")
  assert len(ids) >= width
  return np.stack([ids[i : i + width] for i in range(n_rows)]).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# The check, before any weights load.


def test_padded_pair_is_planned_before_weights(pair, tmp_path):
  student, teacher, _, _ = pair
  plan = build.plan_models(run_spec(run_config(student, teacher)))
  assert (plan.student_cfg.vocab_size, plan.teacher_cfg.vocab_size) == (300, 364)
  assert plan.student_cfg.real_vocab_size == plan.teacher_cfg.real_vocab_size == V_REAL
  assert (plan.student_cfg.logical_vocab_size, plan.teacher_cfg.logical_vocab_size) == (290, 290)
  assert "are identical (290 ids, bos=None, eos=289, pad=287)" in plan.vocab_note
  assert "embedding rows: student 300, teacher 364" in plan.vocab_note
  assert "logits cover ids [0, 290)" in plan.vocab_note
  # preflight (the run's first step) logs it; corrupt weights prove nothing was loaded.
  broken = {who: shutil.copytree(d, tmp_path / who) for who, d in (("s", student), ("t", teacher))}
  for directory in broken.values():
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": f"{a} plus two"}) + "\n" for a in range(16)))
  lines = []
  config = run_config(broken["s"], broken["t"], str(prompts))
  checked = preflight.check(run_spec(config), str(tmp_path / "w"), log=lines.append)
  assert checked.plan.teacher_cfg.real_vocab_size == V_REAL
  assert any("are identical (290 ids" in line for line in lines), lines
  with pytest.raises(ValueError, match="cannot read safetensors file"):
    build.build_models(run_spec(config), checked.plan)


def test_one_tokenizer_only_says_what_was_compared(pair, tmp_path):
  student, teacher, _, _ = pair
  bare = shutil.copytree(teacher, tmp_path / "bare_teacher")
  for name in os.listdir(bare):
    if name.startswith(("tokenizer", "special_tokens", "chat_template")):
      os.remove(bare / name)
  plan = build.plan_models(run_spec(run_config(student, bare)))
  assert plan.teacher_cfg.real_vocab_size == V_REAL
  assert "the teacher has no tokenizer of its own to compare, so only the sizes" in (
    plan.vocab_note
  )
  # Equal tables over a smaller tokenizer: the padded rows are still left out.
  plan = build.plan_models(run_spec(run_config(student, student)))
  assert plan.student_cfg.real_vocab_size == plan.teacher_cfg.real_vocab_size == V_REAL
  # The built-in task keeps its unpadded models and logs nothing.
  builtin = build.plan_models(run_spec(base.get_config("tiny")))
  assert builtin.student_cfg.logical_vocab_size == 0 and builtin.vocab_note == ""


def test_different_tokenizers_are_refused_with_the_difference(pair, tmp_path):
  student, teacher, _, _ = pair
  other = shutil.copytree(teacher, tmp_path / "other_merges")
  save_bpe_tokenizer(other, corpus=OTHER_CORPUS)  # same size, other merges
  with pytest.raises(ValueError) as info:
    build.plan_models(run_spec(run_config(student, other)))
  message = str(info.value)
  assert "student and teacher vocabularies differ" in message
  assert "are not the same tokenizer: first differing token: id 256 is" in message
  assert re.search(r"\(\d+ id\(s\) differ; also id \d+: '\S+' vs '\S+', id \d+", message)
  # Same vocabulary, another eos: the special ids are named with their tokens.
  other_eos = shutil.copytree(teacher, tmp_path / "other_eos")
  save_bpe_tokenizer(other_eos, eos="<|endoftext|>")
  with pytest.raises(
    ValueError, match=r"eos id 289 \('<\|im_end\|>'\) in the student, 287 \('<\|endoftext\|>'\)"
  ):
    build.plan_models(run_spec(run_config(student, other_eos)))
  # A tokenizer with more ids than the teacher has rows cannot be padding.
  small = shutil.copytree(teacher, tmp_path / "small_teacher")
  config_json = json.loads((small / "config.json").read_text())
  (small / "config.json").write_text(json.dumps(config_json | {"vocab_size": 280}))
  with pytest.raises(
    ValueError,
    match=r"student vocab_size=300, teacher vocab_size=280, and tokenizer .* has 290 tokens, "
    r"more than the teacher's 280 embedding rows",
  ):
    build.plan_models(run_spec(run_config(student, small)))


def test_tokenizer_differences_lists_every_kind():
  a = tokenizer_lib.CharTokenizer("0123456789+=")
  assert tokenizer_lib.tokenizer_differences(a, tokenizer_lib.CharTokenizer("0123456789+=")) == []
  diffs = tokenizer_lib.tokenizer_differences(a, tokenizer_lib.CharTokenizer("0123456789=+-"))
  assert diffs[0].startswith("first differing token: id 13 is '+' in the student and '=' in")
  assert "(3 id(s) differ; also id 14: '=' vs '+', id 15: None vs '-')" in diffs[0]
  assert diffs[1] == "the student's tokenizer has 15 tokens, the teacher's 16"
  assert tokenizer_lib.real_vocab_size(a) == 15


# ---------------------------------------------------------------------------------------------
# The models over V_real.


@pytest.fixture(scope="module")
def models(pair):
  student, teacher, _, _ = pair
  return build.build_models(run_spec(run_config(student, teacher)))


def test_logits_equal_transformers_over_the_real_vocabulary(pair, models):
  import torch

  _, _, student_hf, teacher_hf = pair
  tokens_bt = _tokens(models.tokenizer)
  for cfg, params, reference in (
    (models.student_cfg, models.student_params, student_hf),
    (models.teacher_cfg, models.teacher_params, teacher_hf),
  ):
    ours = np.asarray(model.forward(params, jnp.asarray(tokens_bt), cfg))
    with torch.no_grad():
      theirs = reference(torch.tensor(tokens_bt, dtype=torch.long)).logits.numpy()
    assert theirs.shape[-1] == cfg.vocab_size and ours.shape[-1] == V_REAL
    diff = float(np.max(np.abs(ours - theirs[..., :V_REAL])))
    print(f"V={cfg.vocab_size} -> {V_REAL}: max|logits - transformers[..., :V_real]| = {diff:.3g}")
    assert diff <= 1e-5
    # The weights keep every row (so an export matches the source's shapes).
    assert params["embed_vd"].shape[0] == cfg.vocab_size
  # The cached path (the sampler's) cuts the same way.
  cfg, params = models.student_cfg, models.student_params
  from opd_jax.model import kvcache

  cache = kvcache.init_cache(cfg, 2, 16, kvcache.KVCacheSpec("float32"))
  start_b = jnp.zeros((2,), jnp.int32)
  cached, _ = model.forward_with_cache(params, jnp.asarray(tokens_bt), start_b, cache, cfg)
  plain = model.forward(params, jnp.asarray(tokens_bt), cfg)
  assert cached.shape == plain.shape == (2, 12, V_REAL)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(plain), atol=1e-5)


def forced_padding(params):
  """The student's params changed so that the padded rows win every softmax unless cut: a
  constant +20 on hidden dimension 0 of every embedding (so the final normed state's
  dimension 0 is large and positive for any input) and lm-head weight 50 on that dimension
  for rows 290..299."""
  forced = dict(params)
  forced["embed_vd"] = params["embed_vd"].at[:, 0].add(20.0)
  forced["lm_head_dv"] = params["lm_head_dv"].at[0, V_REAL:].set(50.0)
  return forced


@pytest.mark.slow
def test_padded_rows_are_never_sampled(models):
  cfg = models.student_cfg
  params = forced_padding(models.student_params)
  unpadded = dataclasses.replace(cfg, logical_vocab_size=0)
  prompts = [list(row) for row in _tokens(models.tokenizer, n_rows=4, width=5)]
  rng = jax.random.key(0)
  greedy = sampler.SamplerConfig(max_new_tokens=6, temperature=0.0)
  hot = sampler.SamplerConfig(max_new_tokens=6, temperature=1.5, top_p=0.95, return_topk=-1)
  for scfg in (greedy, hot):
    # Control: over all 300 rows the forced rows take every sample.
    control = sampler.sample(params, prompts, rng, scfg, unpadded)
    assert np.all(np.asarray(control.completion_tokens) >= V_REAL), scfg
    rollout = sampler.sample(params, prompts, rng, scfg, cfg)
    tokens = np.asarray(rollout.completion_tokens)
    assert tokens.shape == (4, 6) and tokens.max() < V_REAL, (scfg, tokens)
  # The behaviour distribution is over V_real and sums to one there.
  assert rollout.topk_logprobs.shape == (4, 6, V_REAL)
  np.testing.assert_allclose(np.exp(np.asarray(rollout.topk_logprobs)).sum(-1), 1.0, atol=1e-5)


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow
def test_losses_are_over_the_real_vocabulary(models):
  s_cfg, t_cfg = models.student_cfg, models.teacher_cfg
  prompts = [list(row) for row in _tokens(models.tokenizer, n_rows=4, width=5)]
  scfg = sampler.SamplerConfig(max_new_tokens=6, temperature=1.0)
  rollout = sampler.sample(models.student_params, prompts, jax.random.key(1), scfg, s_cfg)
  # By hand: each model's full logits (the unpadded config keeps every row), cut to V_real.
  seq = rollout.sequences()
  index = np.asarray(seq.logit_index_bc)[:, :, None]
  mask = np.asarray(rollout.completion_mask, np.float64)

  def full_logits(params, cfg):
    logits = model.forward(params, seq.tokens_bt, dataclasses.replace(cfg, logical_vocab_size=0))
    return np.take_along_axis(np.asarray(logits, np.float64), index, axis=1)

  s_full = full_logits(models.student_params, s_cfg)
  t_full = full_logits(models.teacher_params, t_cfg)
  assert (s_full.shape[-1], t_full.shape[-1]) == (300, 364)
  s_lp, t_lp = _log_softmax(s_full[..., :V_REAL]), _log_softmax(t_full[..., :V_REAL])

  def masked_mean(x):
    return float((x * mask).sum() / mask.sum())

  reverse = masked_mean((np.exp(s_lp) * (s_lp - t_lp)).sum(-1))
  forward = masked_mean((np.exp(t_lp) * (t_lp - s_lp)).sum(-1))
  for name, expected in (("reverse_kl_full", reverse), ("forward_kl", forward)):
    loss_cfg = train_step.LossConfig(name=name)
    loss, metrics = train_step.opd_loss(
      models.student_params, models.teacher_params, rollout, s_cfg, t_cfg, loss_cfg
    )
    print(f"{name}: opd_loss {float(loss):.6f}, by hand over V_real {expected:.6f}")
    assert abs(float(loss) - expected) <= 1e-5 * max(1.0, abs(expected))
  # Control: the same KL with the padded rows inside both softmaxes (first 300 rows) differs
  # by far more than the tolerance above.
  s_pad, t_pad = _log_softmax(s_full), _log_softmax(t_full[..., :STUDENT_ROWS])
  padded = masked_mean((np.exp(s_pad) * (s_pad - t_pad)).sum(-1))
  assert abs(padded - reverse) > 1e-4, (padded, reverse)


# ---------------------------------------------------------------------------------------------
# A run end to end, and the export.


@pytest.mark.slow
def test_short_opd_run_trains_the_padded_pair_and_exports_every_row(pair, tmp_path):
  import torch
  import transformers

  student, teacher, _, _ = pair
  records = [{"prompt": f"{a} plus {b} is"} for a in range(6) for b in range(4)]
  prompt_file = tmp_path / "prompts.jsonl"
  prompt_file.write_text("".join(json.dumps(r) + "\n" for r in records))
  config = run_config(
    student,
    teacher,
    str(prompt_file),
    **{
      "train.steps": 2,
      "train.log_every": 1,
      "train.eval_every": 100,
      "train.checkpoint_every": 2,
      "rollout.max_new_tokens": 8,
      "export.dir": str(tmp_path / "export"),
    },
  )
  lines = []
  result = trainer.run(config, str(tmp_path / "run"), log=lambda *a: lines.append(" ".join(a)))
  assert result["end_step"] == 2
  assert any("are identical (290 ids" in line for line in lines)
  assert any("V=364 (logits over the first 290)" in line for line in lines)
  # The export keeps the source's 300 rows and transformers loads it.
  out = tmp_path / "export"
  assert json.loads((out / "config.json").read_text())["vocab_size"] == STUDENT_ROWS
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
    out, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  assert hf_model.lm_head.weight.shape[0] == STUDENT_ROWS
  cfg, params = hf.load_checkpoint(str(out))
  cfg = build.with_real_vocab(cfg, V_REAL)
  tokens_bt = _tokens(tokenizer_lib.load_tokenizer(str(out)))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens_bt, dtype=torch.long)).logits.numpy()[..., :V_REAL]
  ours = np.asarray(model.forward(params, jnp.asarray(tokens_bt), cfg))
  assert float(np.max(np.abs(ours - theirs))) <= 1e-5
  # `python -m opd_jax.export` of the same checkpoint writes the same 300-row student.
  again = tmp_path / "export_again"
  exporting.export_run(str(tmp_path / "run"), str(again), log=lambda *a: None)
  assert json.loads((again / "config.json").read_text())["vocab_size"] == STUDENT_ROWS
  assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
  # The OPD steps moved the student away from its source.
  source = transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
  trained, original = hf_model.lm_head.weight.detach(), source.lm_head.weight.detach()
  assert float((trained[:V_REAL] - original[:V_REAL]).abs().max()) > 0
  # The padded rows receive no gradient (Adam moves nothing without one; no weight decay).
  assert float((trained[V_REAL:] - original[V_REAL:]).abs().max()) == 0.0


# ---------------------------------------------------------------------------------------------
# Sharded: the cut logits on a mesh whose tensor axis splits the vocabulary.

SHARDED_CFG = ModelConfig(
  model_type="qwen3",
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=4,
  head_dim=8,
  qk_norm=True,
  logical_vocab_size=50,  # 64 rows split 4 ways over tensor; 50 is not a multiple of 4
)


def sharded_main() -> None:
  """Prints one JSON line: sharded vs unsharded forward and sampling of `SHARDED_CFG`."""
  cfg = SHARDED_CFG
  params = model.init_params(jax.random.key(0), cfg, jnp.float32)
  params["lm_head_dv"] = params["lm_head_dv"].at[:, 50:].set(5.0)  # big padded logits
  tokens_bt = jax.random.randint(jax.random.key(1), (8, 8), 0, 50)
  ref = np.asarray(model.forward(params, tokens_bt, cfg))
  prompts = [list(map(int, row[:4])) for row in np.asarray(tokens_bt)]
  scfg = sampler.SamplerConfig(max_new_tokens=5, temperature=1.0, return_topk=-1)
  ref_tokens = np.asarray(
    sampler.sample(params, prompts, jax.random.key(2), scfg, cfg).completion_tokens
  )
  out = {"devices": jax.device_count(), "forward": {}, "sample_max_id": {}, "sample_equal": {}}
  for shape in ((1, 2, 4), (2, 1, 4)):
    name = "x".join(map(str, shape))
    mesh = sharding.make_mesh(shape)
    placed = jax.device_put(params, sharding.tree_shardings(params, mesh))
    out.setdefault("lm_head_spec", {})[name] = str(placed["lm_head_dv"].sharding.spec)
    forward = jax.jit(model.forward, static_argnums=2)
    logits = np.asarray(
      forward(placed, jax.device_put(tokens_bt, sharding.batch_sharding(mesh, 2)), cfg)
    )
    out["forward"][name] = [list(logits.shape), float(np.max(np.abs(logits - ref)))]
    rollout = sampler.sample(placed, prompts, jax.random.key(2), scfg, cfg, mesh=mesh)
    tokens = np.asarray(rollout.completion_tokens)[: len(prompts)]
    out["sample_max_id"][name] = int(tokens.max())
    out["sample_equal"][name] = bool(np.array_equal(tokens, ref_tokens))
  print(json.dumps(out))


@pytest.mark.slow
def test_sharded_vocabulary_axis_cuts_the_same_logits():
  env = dict(os.environ, XLA_FLAGS=xla_flags_with("--xla_force_host_platform_device_count=8"))
  env["JAX_PLATFORMS"] = "cpu"
  tests = str(ROOT / "tests")  # the conftest test_prompts imports from
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), tests, env.get("PYTHONPATH", "")]).rstrip(
    os.pathsep
  )
  proc = subprocess.run(
    [sys.executable, __file__, "sharded"],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=str(ROOT),
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  print(result)
  assert result["devices"] == 8
  for name, spec in result["lm_head_spec"].items():
    assert spec.endswith("'tensor')"), (name, spec)  # the vocabulary axis is split
  for name, (shape, diff) in result["forward"].items():
    assert shape == [8, 8, 50] and diff <= 1e-5, (name, shape, diff)
  for name, top in result["sample_max_id"].items():
    assert top < 50, (name, top)
  assert all(result["sample_equal"].values()), result["sample_equal"]


if __name__ == "__main__" and sys.argv[1:] == ["sharded"]:
  sharded_main()
