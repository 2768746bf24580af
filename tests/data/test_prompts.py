"""Users' own checkpoints: the default tokenizer, chat prompts, the length policy, per-batch
prompt buckets, and the checks that fail before any weights load."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import pytest
from conftest import apply_overrides

from opd_jax.data import padding, prompts, task, toy_checkpoints
from opd_jax.data import pipeline as data
from opd_jax.data.toy_checkpoints import CHARS, CHAT_TEMPLATE
from opd_jax.inference import decode_loop, sampler
from opd_jax.io import build, hf, run_history
from opd_jax.model import tokenizer as tokenizer_lib
from opd_jax.model import transformer as model
from opd_jax.train import preflight, trainer
from opd_jax.train.setup import run_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))

import base  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
# A character-level fast tokenizer (Qwen-like: eos and pad, no bos unless asked) with a
# simple chat template, saved into a directory; 99 or 100 tokens.
save_tokenizer = toy_checkpoints.save_chat_tokenizer


@pytest.fixture(scope="module")
def ckpts(make_hf_checkpoint, tmp_path_factory):
  """Student and teacher directories (tiny random Qwen3, vocab 128) with the student's own
  tokenizer, and their weight files replaced by corrupt bytes: any weight load fails with
  "cannot read safetensors file", so an error other than that one was raised before it."""
  root = tmp_path_factory.mktemp("user_ckpts")
  student = shutil.copytree(make_hf_checkpoint("qwen3").path, root / "student")
  teacher = shutil.copytree(make_hf_checkpoint("qwen3", seed=1).path, root / "teacher")
  save_tokenizer(student)
  for directory in (student, teacher):
    (directory / "model.safetensors").write_bytes(b"corrupt: not a safetensors file")
  return student, teacher


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def user_config(student, teacher, prompt_file="", **overrides):
  config = base.get_config("tiny")
  config.student.checkpoint = str(student)
  config.teacher.checkpoint = str(teacher)
  config.data.prompt_file = prompt_file
  config.export.dir = "none"
  return apply_overrides(config, overrides)


# ---------------------------------------------------------------------------------------------
# The tokenizer a run uses.


def test_default_tokenizer_is_the_student_checkpoints(ckpts, tmp_path):
  student, teacher = ckpts
  plan = build.plan_models(run_spec(user_config(student, teacher)))
  assert plan.tokenizer_path == str(student)
  assert isinstance(plan.tokenizer, tokenizer_lib.HFTokenizer)
  assert plan.tokenizer.encode("hi") == [CHARS.index("h"), CHARS.index("i")]
  assert (plan.student_cfg.vocab_size, plan.teacher_cfg.vocab_size) == (128, 128)
  # Without checkpoints "" is the built-in task's tokenizer; an explicit setting is kept.
  builtin = base.get_config("tiny")
  assert builtin.tokenizer == "" and build.tokenizer_path(run_spec(builtin)) == "char"
  assert isinstance(build.plan_models(run_spec(builtin)).tokenizer, tokenizer_lib.CharTokenizer)
  assert build.tokenizer_path(run_spec(user_config(student, teacher, tokenizer="char"))) == "char"
  # "" and "char" are the same run for a built-in student (old checkpoints resume).
  builtin.tokenizer = "char"
  assert run_history.run_fingerprint(run_spec(builtin)) == run_history.run_fingerprint(
    run_spec(base.get_config("tiny"))
  )
  # A student directory without a tokenizer says what to set.
  with pytest.raises(ValueError, match=r"holds no tokenizer .*set config.tokenizer"):
    build.plan_models(run_spec(user_config(teacher, teacher)))


# ---------------------------------------------------------------------------------------------
# Records to ids: plain prompts and chat messages.


def test_messages_are_rendered_with_the_chat_template(tmp_path):
  tok = save_tokenizer(tmp_path / "qwen_like")
  text, ids = prompts.record_ids({"messages": MESSAGES}, tok)
  assert text == (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
  )
  expected = tok.hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
  expected = expected["input_ids"] if hasattr(expected, "keys") else list(expected)
  assert ids == expected
  assert ids[0] == tok.hf.convert_tokens_to_ids("<|im_start|>") and tok.bos_id is None
  # A plain prompt is its text's ids, as before.
  assert prompts.record_ids({"prompt": "2+2?"}, tok) == ("2+2?", tok.encode("2+2?"))


def test_a_template_that_writes_bos_gets_no_second_one(tmp_path):
  tok = save_tokenizer(
    tmp_path / "llama_like", bos=True, template="{{ bos_token }}" + CHAT_TEMPLATE
  )
  _, ids = prompts.record_ids({"messages": MESSAGES}, tok)
  assert ids[0] == tok.bos_id and ids[1] != tok.bos_id
  assert prompts.record_ids({"prompt": "hi"}, tok)[1] == [tok.bos_id, *tok.encode("hi")]


def test_messages_without_a_chat_template_name_the_record(tmp_path):
  tok = save_tokenizer(tmp_path / "plain", template=None)
  file = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1"}, {"messages": MESSAGES}])
  with pytest.raises(ValueError, match=r"prompt 1 of .*p.jsonl: tokenizer .* has no chat template"):
    prompts.prepare(data.JsonlSource(file), tok)
  with pytest.raises(ValueError, match=r"prompt 1 of .*character tokenizer has no chat template"):
    prompts.prepare(data.JsonlSource(file), tokenizer_lib.CharTokenizer())


@pytest.mark.parametrize(
  "record, problem",
  [
    ({"promt": "hi"}, r"""line 2 has no string "prompt" .*is 'promt' a misspelt "prompt"\?"""),
    ({"prompt": "a", "messages": MESSAGES}, 'line 2 has both "prompt" and "messages"'),
    ({"messages": []}, 'line 2 has "messages" that is not a non-empty list'),
    ({"messages": [{"role": "user"}]}, r'line 2 has "messages"\[0\] that is not a'),
  ],
)
def test_prompt_file_schema_errors_name_the_line(tmp_path, record, problem):
  file = write_jsonl(tmp_path / "p.jsonl", [{"messages": MESSAGES}, record])
  with pytest.raises(ValueError, match=problem):
    data.JsonlSource(file)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')  # a Latin-1 byte on line 2
  with pytest.raises(ValueError, match=r"p.jsonl line 2 is not UTF-8"):
    data.JsonlSource(str(path))


def test_an_empty_prompt_is_refused_with_or_without_bos(tmp_path):
  file = data.JsonlSource(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": ""}]))
  for tok in (save_tokenizer(tmp_path / "tok"), save_tokenizer(tmp_path / "bos", bos=True)):
    with pytest.raises(ValueError, match=r"prompt 1 of .*\(line 2\) is empty"):
      prompts.prepare(file, tok)


def test_a_bad_answer_is_named_by_its_line_wherever_the_split_puts_it(tmp_path):
  records = [{"prompt": "a", "answer": "1"}] * 5 + [{"prompt": "b", "answer": [10]}]
  file = data.JsonlSource(write_jsonl(tmp_path / "p.jsonl", records))
  with pytest.raises(
    ValueError, match=r'prompt 5 of .*: its "answer" is not a string .*\(line 6\)'
  ):
    prompts.prepare(file, save_tokenizer(tmp_path / "tok"))


# ---------------------------------------------------------------------------------------------
# The length policy.


def _lengths_file(tmp_path, *lengths):
  return data.JsonlSource(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x" * n} for n in lengths]))


def test_truncate_left_keeps_the_last_tokens(tmp_path):
  tok = save_tokenizer(tmp_path / "tok")
  source = data.JsonlSource(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "abcdefghij"}]))
  kept = prompts.prepare(source, tok, max_tokens=4, overlong="truncate_left")
  assert kept[0]["prompt"].tolist() == tok.encode("ghij")
  assert kept[0]["text"] == "abcdefghij" and kept.truncated == 1 and not kept.dropped
  # With bos, bos stays first and the rest is the end of the prompt.
  bos = save_tokenizer(tmp_path / "bos", bos=True)
  kept = prompts.prepare(source, bos, max_tokens=4, overlong="truncate_left")
  assert kept[0]["prompt"].tolist() == [bos.bos_id, *bos.encode("hij")]


def test_drop_counts_and_logs_the_dropped(tmp_path):
  tok = save_tokenizer(tmp_path / "tok")
  kept = prompts.prepare(_lengths_file(tmp_path, 3, 9, 4, 12), tok, 8, "drop")
  assert [len(r["prompt"]) for r in kept.records] == [3, 4]
  assert kept.dropped == ["prompt 1", "prompt 3"] and kept.truncated == 0
  assert "limit 8 tokens (drop): 0 truncated, 2 dropped (prompt 1, prompt 3)" in kept.describe()
  with pytest.raises(ValueError, match="all 1 prompts of .* were dropped"):
    prompts.prepare(_lengths_file(tmp_path, 9), tok, 8, "drop")


def test_error_names_the_record(tmp_path):
  tok = save_tokenizer(tmp_path / "tok")
  with pytest.raises(ValueError) as err:
    prompts.prepare(_lengths_file(tmp_path, 3, 12), tok, 8, "error")
  assert str(err.value) == (
    f"prompt 1 of {tmp_path / 'p.jsonl'} (line 2) has 12 tokens, more than "
    "data.max_prompt_tokens=8 (set data.overlong to truncate_left or drop)"
  )
  assert len(prompts.prepare(_lengths_file(tmp_path, 3, 12), tok)) == 2  # 0 = no limit


# ---------------------------------------------------------------------------------------------
# Per-batch prompt widths.


def test_batches_are_padded_to_their_own_bucket(tmp_path):
  tok = save_tokenizer(tmp_path / "tok")
  lengths = [3, 5, 4, 6, 2, 40, 7, 5]
  prepared = prompts.prepare(_lengths_file(tmp_path, *lengths), tok)
  assert prepared.width == 40 and prepared.buckets == [16, 64]
  assert "2 sampler shape(s) (prompt widths 16, 64)" in prepared.describe()
  widths = []
  for batch in data.prompt_batches(prepared, 2, seed=0, num_epochs=1):
    tokens_bp, lens_b = task.encode_prompts(list(batch["prompt"]), tok, prepared.width)
    longest = int(lens_b.max())
    assert tokens_bp.shape[1] <= min(prepared.width, padding.prompt_bucket(longest))
    assert tokens_bp.shape[1] >= longest
    for row, n, ids in zip(tokens_bp, lens_b, batch["prompt"], strict=True):
      assert row[:n].tolist() == list(ids) and (row[n:] == tok.pad_id).all()
    widths.append(tokens_bp.shape[1])
  assert sorted(widths) == [16, 16, 16, 40]  # only the long prompt's batch is wide


@pytest.mark.slow
def test_the_sampler_compiles_once_per_bucket(tmp_path, make_hf_checkpoint):
  tok = save_tokenizer(tmp_path / "tok")
  prepared = prompts.prepare(_lengths_file(tmp_path, 3, 5, 4, 6, 2, 40, 7, 5), tok)
  cfg = hf.load_config(make_hf_checkpoint("qwen3").path)
  params = model.init_params(jax.random.key(0), cfg)
  scfg = sampler.SamplerConfig(max_new_tokens=3, top_k=5, stop_tokens=(tok.eos_id,))
  before = decode_loop.trace_count()
  for batch in data.prompt_batches(prepared, 2, seed=0, num_epochs=1):
    pair = task.encode_prompts(list(batch["prompt"]), tok, prepared.width)
    sampler.sample(params, pair, jax.random.key(0), scfg, cfg)
  assert decode_loop.trace_count() - before == len(prepared.buckets) == 2  # not one per batch


def test_task_prompts_keep_their_width():
  tok = tokenizer_lib.CharTokenizer()
  tokens, lengths = task.encode_prompts(["1+2=", "37+58+21="], tok, 10)
  assert tokens.shape == (2, 10) and lengths.tolist() == [5, 10]


# ---------------------------------------------------------------------------------------------
# Fail fast: each check fires before any weights load (the weight files are corrupt, so a
# load would raise "cannot read safetensors file" instead).


def _run(config, workdir):
  trainer.run(config, str(workdir), log=lambda *a: None)


def test_a_load_would_have_failed(ckpts, tmp_path):
  student, teacher = ckpts
  good = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}] * 8)
  with pytest.raises(ValueError, match="cannot read safetensors file"):
    _run(user_config(student, teacher, good), tmp_path / "w")


def test_misspelt_prompt_field_is_reported_before_weights(ckpts, tmp_path):
  student, teacher = ckpts
  file = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"promt": "hi"}])
  with pytest.raises(ValueError, match=r"p.jsonl line 2 .*is 'promt' a misspelt \"prompt\"\?"):
    _run(user_config(student, teacher, file), tmp_path / "w")


def test_untokenizable_and_overlong_prompts_are_reported_before_weights(ckpts, tmp_path):
  student, teacher = ckpts
  file = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "12+3="}, {"prompt": "what"}])
  config = user_config(student, teacher, file, tokenizer="char")
  with pytest.raises(ValueError, match=r"prompt 1 of .*p.jsonl: character 'w' at position 0"):
    _run(config, tmp_path / "w")
  long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "hi"}, {"prompt": "x" * 50}])
  config = user_config(student, teacher, long, **{"data.max_prompt_tokens": 32})
  with pytest.raises(ValueError, match=r"prompt 1 of .*long.jsonl \(line 2\) has 50 tokens"):
    _run(config, tmp_path / "w")


def test_prompts_past_the_models_context_are_reported_before_weights(ckpts, tmp_path):
  student, teacher = ckpts
  short = _edited_copy(student, tmp_path, "ctx64", max_position_embeddings=64)
  file = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"prompt": "x" * 50}])
  config = user_config(short, teacher, file)
  config.rollout.max_new_tokens = 28
  with pytest.raises(
    ValueError,
    match=r"reach 50 tokens, .* 78 positions, past the models' "
    r"context of 64 .*data.max_prompt_tokens \(at most 36\)",
  ):
    _run(config, tmp_path / "w")


def test_eval_file_is_checked_before_weights(ckpts, tmp_path):
  student, teacher = ckpts
  good = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}] * 8)
  bad = write_jsonl(tmp_path / "eval.jsonl", ["not an object"])
  config = user_config(student, teacher, good)
  with config.unlocked():
    config.data.eval_file = bad  # a key of the eval-file work; checked whenever present
  with pytest.raises(ValueError, match="eval.jsonl line 1 must be a JSON object, got str"):
    preflight.check(run_spec(config), str(tmp_path / "w"), log=lambda *a: None)


def test_bad_mesh_is_reported_before_weights(ckpts, tmp_path):
  student, teacher = ckpts
  devices = jax.device_count()
  config = user_config(student, teacher, **{"mesh.data": 1, "mesh.tensor": devices + 1})
  with pytest.raises(ValueError, match=rf"has {devices + 1} devices but there are {devices}"):
    _run(config, tmp_path / "w")


def test_unwritable_workdir_is_reported_before_weights(ckpts, tmp_path):
  student, teacher = ckpts
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ValueError, match=r"the workdir .*a_file/w' is not writable"):
    _run(user_config(student, teacher), tmp_path / "a_file" / "w")


def _edited_copy(directory, tmp_path, name, **changes):
  out = shutil.copytree(directory, tmp_path / name)
  config = json.loads((out / "config.json").read_text())
  (out / "config.json").write_text(json.dumps(config | changes))
  return out


def test_config_json_problems_are_reported_before_weights(ckpts, tmp_path):
  student, teacher = ckpts
  other_vocab = _edited_copy(teacher, tmp_path, "t96", vocab_size=96)
  with pytest.raises(ValueError, match="student vocab_size=128, teacher vocab_size=96"):
    _run(user_config(student, other_vocab), tmp_path / "w")
  mistral = _edited_copy(teacher, tmp_path, "mistral", model_type="mistral")
  with pytest.raises(ValueError, match="teacher checkpoint: .*unsupported model_type 'mistral'"):
    _run(user_config(student, mistral), tmp_path / "w")
  small = _edited_copy(student, tmp_path, "s64", vocab_size=64)
  small_teacher = _edited_copy(teacher, tmp_path, "t64", vocab_size=64)
  with pytest.raises(ValueError, match=r"has 99 tokens but the models' vocabulary is 64"):
    _run(user_config(small, small_teacher), tmp_path / "w")
  no_weights = tmp_path / "no_weights"
  no_weights.mkdir()
  shutil.copy(teacher / "config.json", no_weights)
  with pytest.raises(FileNotFoundError, match="teacher checkpoint .* but no weights"):
    _run(user_config(student, no_weights), tmp_path / "w")


def test_teacher_with_another_tokenizer_is_reported_before_weights(ckpts, tmp_path):
  student, teacher = ckpts
  other = shutil.copytree(teacher, tmp_path / "other_tok")
  save_tokenizer(other, bos=True)  # one more token, <s>, and it is the bos
  with pytest.raises(ValueError, match="first differing token: id 99 is None in the student"):
    _run(user_config(student, other), tmp_path / "w")


def test_teacher_top_k_beyond_the_vocabulary_is_reported_before_weights(ckpts, tmp_path):
  student, teacher = ckpts
  good = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}] * 8)
  config = user_config(student, teacher, good)
  config.train.teacher_top_k = 1000  # the tokenizer has 99 ids
  with pytest.raises(ValueError, match=r"train.teacher_top_k=1000 exceeds the vocabulary V=99"):
    _run(config, tmp_path / "w")
