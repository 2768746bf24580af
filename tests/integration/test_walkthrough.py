"""The toy-checkpoint walkthrough of docs/guides/own_checkpoints.md, command by command: toy HF
checkpoints with padded vocabularies and a chat tokenizer, a run on a JSONL prompt file
with an eval file, and the exported student loaded and run by `transformers`."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from opd_jax.data import toy_checkpoints

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
  proc = subprocess.run(
    [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=900
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.slow  # three processes, two of them load JAX and compile a run: about a minute
def test_readme_walkthrough_from_toy_checkpoints_to_a_transformers_student(tmp_path):
  out = tmp_path / "mine"
  _run("opd_jax.toy_checkpoints", f"--out={out}", "--teacher-vocab-rows=160")
  workdir = tmp_path / "run"
  log = _run(
    "opd_jax.main",
    "--config=configs/base.py",
    f"--workdir={workdir}",
    f"--config.student.checkpoint={out}/student",
    f"--config.teacher.checkpoint={out}/teacher",
    f"--config.data.prompt_file={out}/prompts.jsonl",
    f"--config.data.eval_file={out}/eval.jsonl",
    "--config.train.steps=20",
    "--config.train.eval_every=10",
    "--config.rollout.max_new_tokens=32",
    "--config.data.batch_size=8",
    f"--json={workdir}/done.json",
  )
  done = json.loads((workdir / "done.json").read_text())  # main --json: the final record
  assert done["end_step"] == 20 and done["export_dir"] == str(workdir / "export")
  assert "done: {" in log  # the readable line stays on stdout
  assert "embedding rows: student 128, teacher 160" in log
  assert f"KL(student||teacher) on 64 prompts of {out}/eval.jsonl" in log

  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  kl = [r["quality/student_teacher_kl"] for r in rows if "quality/student_teacher_kl" in r]
  assert len(kl) == 3 and kl[-1] < kl[0]  # steps 0, 10, 20: the student moves to the teacher

  import torch
  import transformers

  export = workdir / "export"
  tok = transformers.AutoTokenizer.from_pretrained(export)
  student = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
  messages = [{"role": "system", "content": toy_checkpoints.SYSTEM}]
  messages.append({"role": "user", "content": "12+30+7="})
  ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
  ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
  with torch.no_grad():
    logits = student(ids).logits[0, -1].numpy()
    new = student.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
  assert logits.shape == (128,) and np.isfinite(logits).all()  # the student's own rows
  assert 1 <= len(new) <= 8 and isinstance(tok.decode(new), str)
  assert student.config.eos_token_id == tok.eos_token_id == 98  # the generation ids travel


@pytest.mark.parametrize(
  "kwargs, problem",
  [
    ({"student_vocab_rows": 50}, "student_vocab_rows=50 is below the tokenizer's 99 tokens"),
    ({"teacher_vocab_rows": 98}, "teacher_vocab_rows=98 is below the tokenizer's 99 tokens"),
    ({"num_prompts": 0}, "need num_prompts >= 1"),
  ],
)
def test_toy_files_refuse_bad_sizes_before_writing(tmp_path, kwargs, problem):
  with pytest.raises(ValueError, match=problem):
    toy_checkpoints.write_toy_files(str(tmp_path / "out"), **kwargs)
  assert not (tmp_path / "out").exists()  # nothing half-written
