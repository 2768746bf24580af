"""Evaluation on the user's own prompts: data.eval_file, answers scored by data.eval_metric
(exact_match or a function by import path), the held-out slice of the prompt file, and
train.eval_every=0.

The runs use tiny random checkpoints (a Qwen3 student, a Llama teacher, 99-token vocabulary)
with the character-level chat tokenizer of tests/data/test_prompts.py saved in the student.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import apply_overrides, xla_flags_with

from opd_jax.data import scoring
from opd_jax.io import build, hf, metrics_writer
from opd_jax.train import evaluate, preflight, trainer
from opd_jax.train import setup as setup_lib

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))

import base  # noqa: E402
from test_prompts import save_tokenizer, write_jsonl  # noqa: E402

VOCAB = 99  # save_tokenizer's 96 characters and 3 special tokens
SELF = __name__  # this module's import name, for scorers referenced by path
MAX_NEW = 8

# Scorers referenced as f"{SELF}:<name>" (data.eval_metric).


def completion_length(prompt: str, completion: str, answer: str) -> float:
  """Characters of the completion (a scorer whose value depends on every argument's row)."""
  del prompt, answer
  return float(len(completion))


def answer_in_prompt(prompt: str, completion: str, answer: str) -> float:
  del completion
  return float(answer in prompt)


def failing(prompt: str, completion: str, answer: str) -> float:
  raise KeyError("no such key")


def two_args(prompt: str, completion: str) -> float:
  return 0.0


NOT_CALLABLE = 3


# ---------------------------------------------------------------------------------------------
# Fixtures.


@pytest.fixture(scope="module")
def models(make_hf_checkpoint, tmp_path_factory):
  """(student dir with its tokenizer, teacher dir) with real weights."""
  root = tmp_path_factory.mktemp("user_eval")
  student = shutil.copytree(make_hf_checkpoint("qwen3", vocab_size=VOCAB).path, root / "s")
  teacher = shutil.copytree(make_hf_checkpoint("llama", seed=1, vocab_size=VOCAB).path, root / "t")
  save_tokenizer(student)
  return student, teacher


@pytest.fixture(scope="module")
def corrupt(models, tmp_path_factory):
  """The same directories with unreadable weights: a check that fires first was made before
  any weights load (a load would raise "cannot read safetensors file")."""
  root = tmp_path_factory.mktemp("corrupt")
  out = []
  for directory in models:
    copy = shutil.copytree(directory, root / Path(directory).name)
    (copy / "model.safetensors").write_bytes(b"corrupt: not a safetensors file")
    out.append(copy)
  return tuple(out)


def user_config(student, teacher, prompt_file, **overrides):
  config = base.get_config("tiny")
  config.student.checkpoint = str(student)
  config.teacher.checkpoint = str(teacher)
  config.data.prompt_file = prompt_file
  config.data.batch_size = 4
  config.data.eval_size = 4
  config.rollout.max_new_tokens = MAX_NEW
  config.train.steps = 2
  config.train.eval_every = 2
  config.train.checkpoint_every = 2
  config.export.dir = "none"
  return apply_overrides(config, overrides)


def numbered_prompts(tmp_path, n, name="p.jsonl"):
  return write_jsonl(tmp_path / name, [{"prompt": f"q{i:02d}: "} for i in range(n)])


def texts(prompt_set):
  return [r["text"] for r in prompt_set.records]


def quiet(*args, **kwargs):
  pass


# ---------------------------------------------------------------------------------------------
# Scorers.


@pytest.mark.parametrize(
  "completion, final",
  [
    ("so x = \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),  # the last, braces balanced
    ("\\boxed{ 7 ", "7"),  # unclosed: the rest
    ("3 + 4 = 7\n#### 7\nthe end", "7"),  # the line after the last ####
    ("#### 1\n####  12 ", "12"),
    ("first line\n  the answer is 9 \n\n  \n", "the answer is 9"),  # the last non-blank line
    ("", ""),
    ("\n \n", ""),
  ],
)
def test_final_answer(completion, final):
  assert scoring.final_answer(completion) == final


def test_exact_match_against_hand_computed_values():
  em = scoring.exact_match
  assert em("p", "step\n 4 ", " 4\n") == 1.0  # both sides stripped
  assert em("p", "4.", "4") == 0.0  # no normalisation
  assert em("p", "Four", "four") == 0.0  # case-sensitive
  assert em("p", "\\boxed{x^2}", "x^2") == 1.0
  assert em("p", "#### 72", "72") == 1.0
  # JSON numbers are answers as their text; records without one are not scored.
  records = [{"answer": 4}, {"answer": "4"}, {}, {"answer": 0.5}, {"answer": None}]
  assert scoring.answers(records, "f") == ["4", "4", None, "0.5", None]
  with pytest.raises(ValueError, match=r'record 1 of f: its "answer" is not a string'):
    scoring.answers([{"answer": "a"}, {"answer": [1]}], "f")


def test_scorers_resolve_by_name_and_import_path():
  assert scoring.resolve("exact_match") is scoring.exact_match
  assert scoring.resolve("none") is None
  assert scoring.resolve(f"{SELF}:completion_length") is completion_length
  assert scoring.resolve("os.path:join") is os.path.join  # any importable module
  cases = {
    "no_such_module_xyz:f": r"cannot import module 'no_such_module_xyz' \(ModuleNotFoundError",
    f"{SELF}:missing": rf"module '{SELF}' has no attribute 'missing'",
    f"{SELF}:NOT_CALLABLE": r"'NOT_CALLABLE' is a int, not a function",
    f"{SELF}:two_args": r"two_args must accept \(prompt, completion, answer\)",
    "exact-match": r"must be one of exact_match, none or an import path",
    "pkg.mod.fn": r"must be one of exact_match, none or an import path",
  }
  for metric, message in cases.items():
    with pytest.raises(ValueError, match=message) as e:
      scoring.resolve(metric)
    assert repr(metric) in str(e.value)  # the bad value is named
  with pytest.raises(ValueError, match=r"scorer failing failed on record 3: KeyError"):
    scoring.score(failing, "p", "c", "a", "record 3")


# ---------------------------------------------------------------------------------------------
# Preflight: the scorer, the held-out slice, eval_every=0 (no weights are read).


@pytest.mark.parametrize(
  "metric, message",
  [
    ("no_such_module_xyz:score", r"cannot import module 'no_such_module_xyz'"),
    (f"{SELF}:missing", r"has no attribute 'missing'"),
    (f"{SELF}:two_args", r"must accept \(prompt, completion, answer\)"),
    ("exactmatch", r"config.data.eval_metric must be one of exact_match, none"),
  ],
)
def test_a_bad_scorer_is_refused_before_weights_load(corrupt, tmp_path, metric, message):
  student, teacher = corrupt
  file = numbered_prompts(tmp_path, 12)
  config = user_config(student, teacher, file, **{"data.eval_metric": metric})
  with pytest.raises(ValueError, match=message):
    trainer.run(config, str(tmp_path / "w"), log=quiet)
  # The same run with a good scorer gets as far as the weights.
  config.data.eval_metric = f"{SELF}:completion_length"
  with pytest.raises(ValueError, match="cannot read safetensors file"):
    trainer.run(config, str(tmp_path / "w"), log=quiet)


def test_the_held_out_slice_is_excluded_from_training(corrupt, tmp_path):
  student, teacher = corrupt
  file = numbered_prompts(tmp_path, 20)
  lines = []
  checked = preflight.check(
    setup_lib.run_spec(user_config(student, teacher, file)), str(tmp_path / "w"), lines.append
  )
  train, held = texts(checked.train_prompts), texts(checked.eval_prompts)
  assert (len(train), len(held)) == (16, 4)
  assert not set(train) & set(held) and sorted(train + held) == [f"q{i:02d}: " for i in range(20)]
  assert train == sorted(train) and held == sorted(held)  # the file's order
  assert "4 prompts of " in lines[-2] and "(data.eval_size=4; seed 0), 16 left" in lines[-2]
  # Seeded by config.seed, which is also the permutation's seed: reproducible, and another
  # seed holds out other records.
  order = np.random.default_rng(0).permutation(20)
  assert held == [f"q{i:02d}: " for i in sorted(order[:4])]
  again = preflight.check(
    setup_lib.run_spec(user_config(student, teacher, file)), str(tmp_path / "w"), quiet
  )
  assert texts(again.eval_prompts) == held
  other = preflight.check(
    setup_lib.run_spec(user_config(student, teacher, file, seed=1)), str(tmp_path / "w"), quiet
  )
  assert texts(other.eval_prompts) != held
  # The training batches the run draws come from the training records only, over epochs.
  batches = iter(setup_lib.process_prompt_batches(checked.train_prompts, 4, seed=0))
  seen = {t for _ in range(12) for t in next(batches)["text"]}
  assert seen == set(train)


def test_a_small_prompt_file_gives_at_most_half_and_one_prompt_is_refused(corrupt, tmp_path):
  student, teacher = corrupt
  assert [evaluate.heldout_size(n, 4) for n in (2, 3, 7, 8, 9, 100)] == [1, 1, 3, 4, 4, 4]
  file = numbered_prompts(tmp_path, 7)  # data.eval_size=4 > 7 // 2
  lines = []
  checked = preflight.check(
    setup_lib.run_spec(user_config(student, teacher, file)), str(tmp_path / "w"), lines.append
  )
  assert (len(checked.train_prompts), len(checked.eval_prompts)) == (4, 3)
  assert "3 prompts of" in lines[-2] and "(data.eval_size=4, capped at half the file" in lines[-2]
  one = numbered_prompts(tmp_path, 1, "one.jsonl")
  with pytest.raises(ValueError, match=r"one.jsonl: a prompt file of 1 prompt cannot spare"):
    trainer.run(user_config(student, teacher, one), str(tmp_path / "w"), log=quiet)
  # Without evaluation nothing is held out; with an eval file neither.
  off = preflight.check(
    setup_lib.run_spec(user_config(student, teacher, one, **{"train.eval_every": 0})),
    str(tmp_path / "w"),
    quiet,
  )
  assert len(off.train_prompts) == 1 and off.eval_prompts is None
  eval_file = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "answer": 1}])
  config = user_config(student, teacher, file, **{"data.eval_file": eval_file})
  with_file = preflight.check(setup_lib.run_spec(config), str(tmp_path / "w"), quiet)
  assert len(with_file.train_prompts) == 7 and texts(with_file.eval_prompts) == ["x"]


def test_a_bad_answer_in_the_eval_file_is_refused_before_weights_load(corrupt, tmp_path):
  student, teacher = corrupt
  file = numbered_prompts(tmp_path, 8)
  bad = write_jsonl(
    tmp_path / "e.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": {}}]
  )
  config = user_config(student, teacher, file, **{"data.eval_file": bad})
  with pytest.raises(ValueError, match=r'prompt 1 of .*e.jsonl: its "answer" is not .*(line 2)'):
    trainer.run(config, str(tmp_path / "w"), log=quiet)


# ---------------------------------------------------------------------------------------------
# The metrics, on real weights.


@pytest.fixture(scope="module")
def loaded(models):
  """(student params, student cfg, teacher params, teacher cfg, tokenizer)."""
  student, teacher = models
  s_cfg, s_params = hf.load_checkpoint(str(student))
  t_cfg, t_params = hf.load_checkpoint(str(teacher))
  tok = build.plan_models(setup_lib.run_spec(user_config(student, teacher, ""))).tokenizer
  return s_params, s_cfg, t_params, t_cfg, tok


def _eval_prompts(tmp_path, tok, records):
  from opd_jax.data import pipeline as data
  from opd_jax.data import prompts

  return prompts.prepare(data.JsonlSource(write_jsonl(tmp_path / "e.jsonl", records)), tok)


def _greedy_texts(params, cfg, eval_set, tok):
  rollout = evaluate.greedy_rollout(params, cfg, eval_set, MAX_NEW, tok.eos_id)
  return evaluate.score_rollout(rollout, dataclasses.replace(eval_set, scorer=None), tok)[1]


@pytest.mark.slow
def test_scores_count_only_records_with_answers(loaded, tmp_path):
  """exact_match on the student's and the teacher's greedy completions against answers made
  to match some of them: the scores are the hand-counted fractions; chunks do not change the
  metrics."""
  s_params, s_cfg, t_params, t_cfg, tok = loaded
  prompts_ = ["ab", "cd: ", "A: ", "x=", "1+1="]
  plain = _eval_prompts(tmp_path, tok, [{"prompt": p} for p in prompts_])
  bare = evaluate.make_prompt_eval_set(plain, tok, scoring.exact_match, chunk=0)
  assert bare.scorer is None  # no answers: KL only
  student = _greedy_texts(s_params, s_cfg, bare, tok)
  teacher = _greedy_texts(t_params, t_cfg, bare, tok)
  assert all(student) and student != teacher
  # Answers: rows 0 and 2 match the student, row 1 the teacher, row 3 no one, row 4 has none.
  answers = [
    scoring.final_answer(student[0]),
    scoring.final_answer(teacher[1]),
    scoring.final_answer(student[2]),
    "no such answer",
    None,
  ]
  records = [
    {"prompt": p} | ({} if a is None else {"answer": a})
    for p, a in zip(prompts_, answers, strict=True)
  ]
  eval_prompts = _eval_prompts(tmp_path, tok, records)
  want_student = np.mean(
    [scoring.exact_match("", s, a) for s, a in zip(student[:4], answers[:4], strict=True)]
  )
  want_teacher = np.mean(
    [scoring.exact_match("", t, a) for t, a in zip(teacher[:4], answers[:4], strict=True)]
  )
  assert (want_student, want_teacher) == (0.5, 0.25)  # the rows made to match
  results = []
  for chunk in (0, 2):  # one batch; chunks of 2, 2 and 1 rows
    eval_set = evaluate.make_prompt_eval_set(eval_prompts, tok, scoring.exact_match, chunk)
    metrics, samples = evaluate.evaluate(s_params, s_cfg, t_params, t_cfg, eval_set, tok, MAX_NEW)
    assert sorted(metrics) == [
      "quality/relative_score",
      "quality/student_score",
      "quality/student_teacher_kl",
      "quality/teacher_score",
    ]
    assert metrics["quality/student_score"] == pytest.approx(want_student)
    assert metrics["quality/teacher_score"] == pytest.approx(want_teacher)
    assert metrics["quality/relative_score"] == pytest.approx(want_student / want_teacher)
    assert samples[0] == f"ab{student[0]} [answer: {answers[0]}]"
    assert samples[3] == f"x={student[3]} [answer: no such answer]"
    results.append(metrics)
  assert results[1]["quality/student_teacher_kl"] == pytest.approx(
    results[0]["quality/student_teacher_kl"], rel=1e-5
  )
  # The KL-only set reports the same KL and no score.
  metrics, samples = evaluate.evaluate(s_params, s_cfg, t_params, t_cfg, bare, tok, MAX_NEW)
  assert list(metrics) == ["quality/student_teacher_kl"]
  assert metrics["quality/student_teacher_kl"] == pytest.approx(
    results[0]["quality/student_teacher_kl"], rel=1e-6
  )
  assert samples[1] == f"cd: {student[1]}"


def test_a_scorer_by_import_path_scores_every_answered_row(loaded, tmp_path):
  s_params, s_cfg, t_params, t_cfg, tok = loaded
  records = [{"prompt": "ab", "answer": "a"}, {"prompt": "cd"}, {"prompt": "ef", "answer": "z"}]
  eval_prompts = _eval_prompts(tmp_path, tok, records)
  scorer = scoring.resolve(f"{SELF}:completion_length")
  eval_set = evaluate.make_prompt_eval_set(eval_prompts, tok, scorer, chunk=0)
  student = _greedy_texts(s_params, s_cfg, eval_set, tok)
  metrics, _ = evaluate.evaluate(s_params, s_cfg, t_params, t_cfg, eval_set, tok, MAX_NEW, 1.0)
  assert metrics["quality/student_score"] == pytest.approx((len(student[0]) + len(student[2])) / 2)
  assert metrics["quality/teacher_score"] == 1.0  # given, not decoded again
  # The scorer sees the prompt's text and the answer of its own row.
  eval_set = dataclasses.replace(eval_set, scorer=answer_in_prompt)
  metrics, _ = evaluate.evaluate(s_params, s_cfg, t_params, t_cfg, eval_set, tok, MAX_NEW, 1.0)
  assert metrics["quality/student_score"] == 0.5  # "a" in "ab", "z" not in "ef"
  eval_set = dataclasses.replace(eval_set, scorer=failing)
  with pytest.raises(ValueError, match=r"scorer failing failed on held-out prompt 0 of .*KeyErr"):
    evaluate.evaluate(s_params, s_cfg, t_params, t_cfg, eval_set, tok, MAX_NEW, 1.0)


# ---------------------------------------------------------------------------------------------
# Whole runs.


def _samples(workdir):
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(
    os.path.join(workdir, "tb"), size_guidance={"tensors": 0}
  )
  acc.Reload()
  if "quality/student_samples" not in acc.Tags()["tensors"]:
    return {}
  return {
    e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("quality/student_samples")
  }


def _quality(workdir):
  rows = metrics_writer.read_jsonl(workdir)
  return {
    step: {k: v for k, v in r.items() if k.startswith("quality/")} for step, r in rows.items()
  }


@pytest.mark.slow
def test_a_run_evaluates_on_the_eval_file(models, tmp_path):
  student, teacher = models
  file = numbered_prompts(tmp_path, 8)
  eval_records = [
    {"prompt": "e0: ", "answer": "e"},
    {"messages": [{"role": "user", "content": "e1?"}]},
    {"prompt": "e2: ", "answer": 3},
  ]
  eval_file = write_jsonl(tmp_path / "eval.jsonl", eval_records)
  config = user_config(
    student,
    teacher,
    file,
    **{"data.eval_file": eval_file, "data.eval_metric": f"{SELF}:completion_length"},
  )
  lines = []
  result = trainer.run(config, str(tmp_path / "w"), log=lines.append)
  quality = _quality(str(tmp_path / "w"))
  names = {
    "quality/student_score",
    "quality/teacher_score",
    "quality/relative_score",
    "quality/student_teacher_kl",
    "quality/student_teacher_kl_at_rollout_t",
  }
  assert {s for s, q in quality.items() if q} == {0, 2}
  assert set(quality[0]) == names and set(quality[2]) == names
  assert result["student_score_before"] == quality[0]["quality/student_score"]
  assert result["student_score_after"] == quality[2]["quality/student_score"]
  assert result["teacher_score"] == quality[0]["quality/teacher_score"]
  assert result["student_teacher_kl_after"] == quality[2]["quality/student_teacher_kl"]
  assert "student_accuracy_after" not in result and "teacher_accuracy" not in result
  # Every sample comes from the eval file (the chat record rendered), none from the task.
  samples = _samples(str(tmp_path / "w"))
  assert sorted(samples) == [0, 2]
  for text in samples.values():  # the four samples joined by newlines
    assert text.startswith("e0: ") and " [answer: e]\n<|im_start|>user\ne1?<|im_end|>" in text
    assert text.endswith(" [answer: 3]") and "q0" not in text  # no training prompt
  assert any("3 prompts of" in line and "2 carry an answer (scored by" in line for line in lines)
  assert any(line.startswith("step 0: teacher score ") for line in lines)


@pytest.mark.slow
def test_without_an_eval_file_the_run_evaluates_its_held_out_slice(models, tmp_path):
  student, teacher = models
  file = numbered_prompts(tmp_path, 12)
  config = user_config(student, teacher, file)
  result = trainer.run(config, str(tmp_path / "w"), log=quiet)
  checked = preflight.check(setup_lib.run_spec(config), str(tmp_path / "w2"), quiet)
  held = texts(checked.eval_prompts)
  samples = _samples(str(tmp_path / "w"))
  assert sorted(samples) == [0, 2]
  trained = texts(checked.train_prompts)
  for text in samples.values():  # the four held-out prompts, in order, and no trained one
    assert text.startswith(held[0])
    assert [text.index(h) for h in held] == sorted(text.index(h) for h in held)
    assert not any(t in text for t in trained)
  # No answers: the KL is the evaluation.
  quality = _quality(str(tmp_path / "w"))
  assert set(quality[2]) == {
    "quality/student_teacher_kl",
    "quality/student_teacher_kl_at_rollout_t",
  }
  assert set(result) >= {"student_teacher_kl_before", "student_teacher_kl_after"}
  assert not {"teacher_score", "student_score_after", "teacher_accuracy"} & set(result)


@pytest.mark.slow
def test_eval_every_0_runs_and_writes_no_quality_metrics(models, tmp_path):
  student, teacher = models
  file = numbered_prompts(tmp_path, 4)  # one batch: nothing could be held out
  config = user_config(student, teacher, file, **{"train.eval_every": 0})
  lines = []
  result = trainer.run(config, str(tmp_path / "w"), log=lines.append)
  assert result["end_step"] == 2 and result["stopped_by"] is None
  assert not any("kl" in k or "accuracy" in k or "score" in k for k in result)
  rows = metrics_writer.read_jsonl(str(tmp_path / "w"))
  assert rows and not any(k.startswith("quality/") for r in rows.values() for k in r)
  assert "loss/total" in rows[2]
  assert _samples(str(tmp_path / "w")) == {}
  assert "evaluation off (train.eval_every=0)" in lines
  assert any(line.startswith("step 0: evaluation off (setup ") for line in lines)
  assert any(line.startswith("done: ") for line in lines)
  # eval_every=0 resumes and stops cleanly too (the end-of-run summary without an evaluation).
  config.train.steps = 3
  result = trainer.run(config, str(tmp_path / "w"), log=quiet)
  assert (result["start_step"], result["end_step"]) == (2, 3)
  # Turning evaluation on would hold 2 of the 4 trained prompts out: refused on resume.
  config.train.steps, config.train.eval_every = 4, 2
  with pytest.raises(ValueError, match=r"trained without a held-out slice .* would train with"):
    trainer.run(config, str(tmp_path / "w"), log=quiet)
  config.data.eval_file = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "e", "answer": "1"}])
  result = trainer.run(config, str(tmp_path / "w"), log=quiet)  # an eval file leaves them
  assert (result["start_step"], result["end_step"]) == (3, 4) and "student_score_after" in result


# ---------------------------------------------------------------------------------------------
# On a mesh: the user's set, decoded in chunks, split over data·fsdp.

SHARDED_CHECK = """
import json
import jax, jax.numpy as jnp
from opd_jax.train import evaluate
from opd_jax.model import transformer as model, sharding, tokenizer
from opd_jax.data import prompts
from opd_jax.model.config import ModelConfig

tok = tokenizer.CharTokenizer()
cfg = ModelConfig("qwen3", tok.vocab_size, 32, 64, 2, 4, 2, 8, qk_norm=True)
records = [{"prompt": f"{i}+{2 * i}="} | ({"answer": str(i)} if i % 3 else {}) for i in range(13)]
prepared = prompts.prepare(records, tok, name="records")
scorer = lambda prompt, completion, answer: float(len(completion) + len(answer))
student = model.init_params(jax.random.key(0), cfg, jnp.float32, scale=0.3)
teacher = model.init_params(jax.random.key(1), cfg, jnp.float32, scale=0.3)
mesh = sharding.make_mesh((2, 2, 2))
place = lambda p: jax.device_put(p, sharding.tree_shardings(p, mesh))
out = []
for chunk, s, t in ((0, student, teacher), (5, place(student), place(teacher))):
  eval_set = evaluate.make_prompt_eval_set(prepared, tok, scorer, chunk)
  out.append(evaluate.evaluate(s, cfg, t, cfg, eval_set, tok, 6))
print(json.dumps({"devices": jax.device_count(), "runs": out}))
"""


@pytest.mark.slow
def test_a_chunked_eval_on_a_mesh_matches_the_unsharded_one(tmp_path):
  """13 rows in chunks of 5 on a 2x2x2 mesh (chunks padded to 8, 8 and 4 rows over 4
  data·fsdp shards) against one unsharded batch: padding rows are neither scored nor in
  the KL, and every row is scored once."""
  flags = xla_flags_with("--xla_force_host_platform_device_count=8")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  proc = subprocess.run(
    [sys.executable, "-c", SHARDED_CHECK], env=env, capture_output=True, text=True, timeout=900
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["devices"] == 8
  (ref, ref_samples), (split, split_samples) = got["runs"]
  assert sorted(ref) == sorted(split) and "quality/student_score" in ref
  for name, value in ref.items():
    assert split[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
  assert split_samples == ref_samples
