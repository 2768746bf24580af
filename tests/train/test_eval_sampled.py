"""`train.eval_sampled`: the held-out score of one T = 1 sample per prompt beside the greedy one
(`evaluate.evaluate(..., sampled_seed=)`, quality/student_<metric>_t1)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import tiny_char_cfg

from opd_jax.data import task
from opd_jax.inference import sampler
from opd_jax.model import transformer as model
from opd_jax.model.tokenizer import CharTokenizer
from opd_jax.train import evaluate

MAX_NEW = 12
PROMPTS = ["3+4=", "12+5=", "7+7+1=", "20+9=", "6+1=", "15+15="]


def same_text(prompt: str, completion: str, answer: str) -> float:
  """1 when the completion is the answer, character for character."""
  del prompt
  return float(completion == answer)


def _texts(rollout, tok):
  tokens, mask = np.asarray(rollout.completion_tokens), np.asarray(rollout.completion_mask)
  return [tok.decode(row[m > 0].tolist()) for row, m in zip(tokens, mask, strict=True)]


def test_sampled_score_is_the_hand_counted_score_of_t1_samples():
  """Answers are chosen from the student's own greedy and T = 1 completions (drawn here with
  the sampler directly, at T = 1 with no filter and key fold_in(key(seed), 0)); the greedy and
  the sampled scores are the hand-counted fractions, and the sampled one differs from the
  greedy one, so the sample is not the greedy decode."""
  tok, cfg = CharTokenizer(), tiny_char_cfg()
  student = model.init_params(jax.random.key(0), cfg, scale=0.3)
  teacher = model.init_params(jax.random.key(1), cfg, scale=0.3)
  tokens_bp, lens_b = task.encode_prompts(PROMPTS, tok, 8)
  bare = evaluate.EvalSet(PROMPTS, tokens_bp, lens_b, scorer=None)
  greedy = _texts(evaluate.greedy_rollout(student, cfg, bare, MAX_NEW, tok.eos_id), tok)
  scfg = sampler.SamplerConfig(max_new_tokens=MAX_NEW, temperature=1.0, stop_tokens=(tok.eos_id,))
  key = jax.random.fold_in(jax.random.key(5), 0)
  sampled = _texts(sampler.sample(student, (tokens_bp, lens_b), key, scfg, cfg), tok)
  differ = [i for i in range(len(PROMPTS)) if sampled[i] != greedy[i]]
  assert len(differ) >= 2  # T = 1 samples of a random model leave the greedy path
  # every row answered by its greedy text but the first that differs, answered by its sample
  answers = [sampled[i] if i == differ[0] else greedy[i] for i in range(len(PROMPTS))]
  eval_set = dataclasses.replace(bare, answers=answers, scorer=same_text)
  want_greedy = np.mean([g == a for g, a in zip(greedy, answers, strict=True)])
  want_t1 = np.mean([s == a for s, a in zip(sampled, answers, strict=True)])
  assert want_greedy != want_t1
  metrics, _ = evaluate.evaluate(student, cfg, teacher, cfg, eval_set, tok, MAX_NEW, sampled_seed=5)
  assert metrics["quality/student_accuracy"] == pytest.approx(want_greedy)
  assert metrics["quality/student_accuracy_t1"] == pytest.approx(want_t1)
  assert "quality/teacher_accuracy_t1" not in metrics  # the teacher's score stays greedy
  # without a seed there is no sampled score, and the rest is unchanged
  plain, _ = evaluate.evaluate(student, cfg, teacher, cfg, eval_set, tok, MAX_NEW)
  assert "quality/student_accuracy_t1" not in plain
  assert {k: v for k, v in metrics.items() if not k.endswith("_t1")} == pytest.approx(plain)
