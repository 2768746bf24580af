"""Exporting a run's student as a Hugging Face checkpoint: the end-of-run export, the
`python -m opd_jax.export` command, and their bad-input errors.

The reference for every logits check is the trainer's own orbax checkpoint, read back raw
(`StandardCheckpointer().restore` without a target) and run through `opd_jax.model.forward`;
`transformers` loads the export on the torch CPU side in f32.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import apply_overrides

from opd_jax.io import hf, run_history
from opd_jax.model import tokenizer
from opd_jax.model import transformer as model
from opd_jax.train import export as exporting
from opd_jax.train import trainer
from opd_jax.train.setup import run_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import base  # noqa: E402

# A task prompt and its completion, in the built-in task's characters.
TEXT = "12+34-5=41;>: 9*"


def _config(teacher_cache, **overrides):
  """The tiny variant cut to two OPD steps, a checkpoint after each, no mid-run evaluation
  (and a 4-step teacher bootstrap: the export does not need a good teacher)."""
  config = base.get_config("tiny")
  config.teacher.cache_dir = str(teacher_cache)
  config.teacher.pretrain_steps = 4
  config.train.steps = 2
  config.train.checkpoint_every = 1
  config.train.eval_every = 100
  return apply_overrides(config, overrides)


def _checkpoint_params(workdir, step):
  """The student params of checkpoint `step`, read straight from the orbax files."""
  with ocp.StandardCheckpointer() as ckpt:
    state = ckpt.restore(os.path.join(workdir, "checkpoints", str(step), "state"))
  return jax.tree.map(np.asarray, state["params"])


def _tokens(vocab_size, prompt_ids):
  rng = np.random.default_rng(0)
  return np.stack([prompt_ids, rng.integers(0, vocab_size, len(prompt_ids))]).astype(np.int32)


def _max_logits_diff(directory, cfg, params, tokens_bt):
  """max |logits| difference: transformers on the export vs our model on `params` (f32)."""
  import torch
  import transformers

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
    directory, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  assert hf_model.dtype == torch.float32
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens_bt, dtype=torch.long)).logits.numpy()
  ours = np.asarray(model.forward(params, jnp.asarray(tokens_bt), cfg))
  return float(np.max(np.abs(theirs - ours)))


def _json(path):
  return json.loads(Path(path).read_text())


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
  """A finished tiny run on the built-in task (char tokenizer), exported by the trainer."""
  workdir = str(tmp_path_factory.mktemp("char_run"))
  teacher_cache = tmp_path_factory.mktemp("teacher_cache")
  result = trainer.run(_config(teacher_cache), workdir, log=lambda *a: None)
  return workdir, result


@pytest.mark.slow
def test_finished_run_exports_a_student_transformers_loads(char_run):
  workdir, result = char_run
  out = os.path.join(workdir, "export")
  assert result["end_step"] == 2 and result["export_dir"] == out
  assert sorted(os.listdir(out)) == [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    run_history.EXPORT_RECORD,
    "tokenizer.json",
    "tokenizer_config.json",
  ]
  # The record of the checkpoint it holds: `RunHistory` reads that step from the export.
  record = _json(os.path.join(out, run_history.EXPORT_RECORD))
  code = record.pop("provenance")  # the code that exported it (io.provenance)
  assert set(code) == {"git_sha", "dirty", "diff_sha256", "config_sha256"}
  assert record == {"step": 2, "config": exporting.saved_fingerprint(workdir, 2)}
  char = tokenizer.CharTokenizer()
  ids = {"bos_token_id": char.bos_id, "eos_token_id": char.eos_id, "pad_token_id": char.pad_id}
  assert ids == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
  config_json = _json(os.path.join(out, "config.json"))
  assert {k: config_json[k] for k in ids} == ids
  assert _json(os.path.join(out, "generation_config.json")) == ids
  cfg = hf.load_config(out)
  assert config_json["torch_dtype"] == "float32"
  params = _checkpoint_params(workdir, 2)  # what the run trained, as it checkpointed it
  tokens_bt = _tokens(cfg.vocab_size, [char.bos_id, *char.encode(TEXT)])
  diff = _max_logits_diff(out, cfg, params, tokens_bt)
  print(f"export vs trained params: max|logits diff| = {diff:.3g}")
  assert diff <= 1e-5
  # The OPD steps moved the student: the export is not the warm start (step 1 differs too).
  first = _checkpoint_params(workdir, 1)
  assert not np.array_equal(first["embed_vd"], params["embed_vd"])

  from transformers import AutoTokenizer, GenerationConfig

  tok = AutoTokenizer.from_pretrained(out)
  assert tok(TEXT)["input_ids"] == [char.bos_id, *char.encode(TEXT)]
  assert tok.decode(char.encode(TEXT)) == TEXT
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
  assert GenerationConfig.from_pretrained(out).eos_token_id == 2


@pytest.mark.slow
def test_export_command_reads_the_runs_config_and_step(char_run, tmp_path):
  workdir, _ = char_run
  logs = []
  summary = exporting.export_run(workdir, str(tmp_path / "latest"), log=logs.append)
  assert summary["step"] == 2 and summary["config"] == "the run"
  auto = hf.load_checkpoint(os.path.join(workdir, "export"))
  latest = hf.load_checkpoint(tmp_path / "latest")
  assert latest[0] == auto[0]
  jax.tree.map(np.testing.assert_array_equal, latest[1], auto[1])
  for name in ("config.json", "generation_config.json", "tokenizer.json"):
    assert (tmp_path / "latest" / name).read_bytes() == Path(workdir, "export", name).read_bytes()

  exporting.export_run(workdir, str(tmp_path / "first"), step=1, log=logs.append)
  cfg, first = hf.load_checkpoint(tmp_path / "first")
  jax.tree.map(np.testing.assert_array_equal, first, _checkpoint_params(workdir, 1))

  # --config: the run's own config file is accepted; another student is refused by name.
  given = _config("")
  summary = exporting.export_run(workdir, str(tmp_path / "given"), config=given, log=logs.append)
  assert summary["config"] == "--config"
  given.student.arch.hidden_size = 64
  with pytest.raises(ValueError, match=r"student.arch.hidden_size: 32 \(run\) vs 64"):
    exporting.export_run(workdir, str(tmp_path / "other"), config=given, log=logs.append)


@pytest.mark.slow
def test_export_of_a_missing_step_is_named(char_run, tmp_path):
  workdir, _ = char_run
  with pytest.raises(ValueError, match=r"has no checkpoint at step 7 \(has steps \[1, 2\]\)"):
    exporting.export_run(workdir, str(tmp_path / "out"), step=7)
  assert not (tmp_path / "out").exists()


def test_workdir_without_checkpoints_is_named(tmp_path):
  with pytest.raises(ValueError, match="run directory '.*nope' does not exist"):
    exporting.export_run(str(tmp_path / "nope"), str(tmp_path / "out"))
  with pytest.raises(ValueError, match="holds no checkpoints directory"):
    exporting.export_run(str(tmp_path), str(tmp_path / "out"))
  (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1").mkdir(parents=True)  # unfinished
  with pytest.raises(ValueError, match="holds no finished checkpoint"):
    exporting.export_run(str(tmp_path), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_command_exits_with_the_error(tmp_path):
  proc = subprocess.run(
    [sys.executable, "-m", "opd_jax.export", f"--params-from={tmp_path}", f"--out={tmp_path}/o"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=120,
  )
  assert proc.returncode == 1
  assert proc.stderr.strip().endswith(
    f"error: '{tmp_path}' holds no checkpoints directory "
    f"({tmp_path}/checkpoints): not a training run's --workdir, "
    "or the run saved no checkpoint yet"
  )


def test_config_from_fingerprint_inverts_run_fingerprint():
  config = _config("/tmp/cache", **{"rollout.bf16_layers": (0,), "student.dtype": "bfloat16"})
  config.data.prompt_file = "/data/it's.jsonl"
  rebuilt = exporting.config_from_fingerprint(run_history.run_fingerprint(run_spec(config)))
  assert run_history.run_fingerprint(run_spec(rebuilt)) == run_history.run_fingerprint(
    run_spec(config)
  )
  assert rebuilt.rollout.bf16_layers == (0,) and rebuilt.data.prompt_file == "/data/it's.jsonl"
  with pytest.raises(ValueError, match=r"keys that configs/base.py lacks \(student.color\)"):
    exporting.config_from_fingerprint({"student.color": "'red'"})
  with pytest.raises(ValueError, match="config.seed=seven does not parse"):
    exporting.config_from_fingerprint({"seed": "seven"})


def test_export_dir_semantics(tmp_path):
  config = base.get_config("tiny")
  assert config.export.dir == ""
  assert run_history.export_dir(run_spec(config), "/runs/a") == "/runs/a/export"
  config.export.dir = "none"
  assert run_history.export_dir(run_spec(config), "/runs/a") is None
  config.export.dir = str(tmp_path / "students" / "a")
  assert run_history.export_dir(run_spec(config), "/runs/a") == str(tmp_path / "students" / "a")
  assert "export.dir" in run_history.RESUMABLE_KEYS  # a resumed run may export elsewhere


# ---------------------------------------------------------------------------------------------
# A student that starts from a Hugging Face checkpoint with its own tokenizer.

SPECIALS = {"<s>": 18, "</s>": 19, "<pad>": 20}  # after the 18 characters: not the char ids


def _write_hf_tokenizer(directory):
  """A character-level fast tokenizer over the task's alphabet, specials after it."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {c: i for i, c in enumerate(tokenizer.CHAR_ALPHABET)} | SPECIALS
  backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=None))
  backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
  backend.decoder = decoders.Fuse()
  fast = PreTrainedTokenizerFast(
    tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
  )
  fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def hf_run(make_hf_checkpoint, tmp_path_factory):
  """A finished one-step run whose student and teacher are tiny HF Qwen3 checkpoints (the
  student's directory also holds the tokenizer and a generation_config.json); export.dir=none."""
  root = tmp_path_factory.mktemp("hf_run")
  student = shutil.copytree(make_hf_checkpoint("qwen3").path, root / "student")
  teacher = make_hf_checkpoint("qwen3", seed=1).path
  _write_hf_tokenizer(student)
  source_generation = {"do_sample": True, "temperature": 0.6, "eos_token_id": [19, 7]}
  (student / "generation_config.json").write_text(json.dumps(source_generation))
  config = _config(
    root / "unused_cache",
    tokenizer=str(student),
    **{
      "student.checkpoint": str(student),
      "teacher.checkpoint": str(teacher),
      "train.steps": 1,
      "export.dir": "none",
    },
  )
  workdir = str(root / "run")
  result = trainer.run(config, workdir, log=lambda *a: None)
  return workdir, student, result


@pytest.mark.slow
def test_hf_student_export_copies_its_tokenizer(hf_run, tmp_path):
  workdir, student, result = hf_run
  assert result["end_step"] == 1 and "export_dir" not in result
  assert not os.path.exists(os.path.join(workdir, "export"))  # export.dir="none"
  out = tmp_path / "out"
  summary = exporting.export_run(workdir, str(out), log=lambda *a: None)
  copied = ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
  assert set(copied) <= set(os.listdir(student))
  assert summary["files"] == sorted(
    [
      "config.json",
      "generation_config.json",
      "model.safetensors",
      run_history.EXPORT_RECORD,
      *copied,
    ]
  )
  assert _json(out / run_history.EXPORT_RECORD)["step"] == 1
  for name in copied:
    assert (out / name).read_bytes() == (student / name).read_bytes(), name
  # Ids from the run's tokenizer; the source's sampling defaults and eos list survive.
  generation = _json(out / "generation_config.json")
  assert generation == {
    "do_sample": True,
    "temperature": 0.6,
    "bos_token_id": 18,
    "eos_token_id": [19, 7],
    "pad_token_id": 20,
  }
  config_json = _json(out / "config.json")
  assert [config_json[k] for k in hf.ID_KEYS] == [18, [19, 7], 20]

  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(out)
  run_tok = tokenizer.load_tokenizer(str(student))
  assert tok.encode(TEXT, add_special_tokens=False) == run_tok.encode(TEXT)
  cfg = hf.load_config(out)
  params = _checkpoint_params(workdir, 1)
  tokens_bt = _tokens(cfg.vocab_size, [18, *run_tok.encode(TEXT)])
  diff = _max_logits_diff(out, cfg, params, tokens_bt)
  print(f"HF-student export vs trained params: max|logits diff| = {diff:.3g}")
  assert diff <= 1e-5
