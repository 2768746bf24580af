"""configs/grpo_practice.py: GRPO as practitioners run it, and its OPD arm from the same warm
start."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from opd_jax.config import check as config_check

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import grpo_practice  # noqa: E402


def test_the_recipe_and_the_shared_warm_start():
  """Groups of 8, 128 completions per step, one update per batch, lr warmup 20, the 475-step
  warm start in both arms, and the T = 1 accuracy beside the greedy one in both."""
  grpo, opd = grpo_practice.get_config(), grpo_practice.get_config("opd")
  for c in (grpo, opd):
    config_check.validate(c)
    assert c.student.warmup_steps == 475 and c.train.eval_sampled
    assert (c.train.steps, c.train.eval_every) == (400, 100)
  assert grpo.train.loss == "grpo" and opd.train.loss == "reverse_kl_full"
  assert grpo.rollout.samples_per_prompt == 8
  assert grpo.data.batch_size * grpo.rollout.samples_per_prompt == 128
  assert grpo.train.ppo_epochs * grpo.train.ppo_minibatches == 1
  assert grpo.train.warmup_steps == 20 and grpo.rollout.temperature == 1.0
  # the arms differ in the method only: same teacher, student, task and rollout engine
  for block in ("teacher", "student", "data"):
    a, b = grpo[block].to_dict(), opd[block].to_dict()
    a.pop("batch_size", None), b.pop("batch_size", None)
    assert a == b, block


@pytest.mark.slow
def test_tiny_variant_runs_plain_on_policy_grpo_with_sampled_accuracy(tmp_path):
  """`:tiny` trains end to end (about 25 s of CPU, mostly compilation and the teacher): one
  update per step at ratio exactly 1 (the single-update path), and every evaluation logs
  quality/student_accuracy_t1 beside quality/student_accuracy."""
  from opd_jax.io import metrics_writer
  from opd_jax.train import trainer

  c = grpo_practice.get_config("tiny")
  c.teacher.cache_dir = str(tmp_path / "cache")
  c.export.dir = "none"
  trainer.run(c, str(tmp_path / "run"), log=lambda *a: None)
  rows = metrics_writer.read_jsonl(str(tmp_path / "run"))
  evals = [r for r in rows.values() if "quality/student_accuracy" in r]
  assert len(evals) >= 2
  assert all(0 <= r["quality/student_accuracy_t1"] <= 1 for r in evals)
  trained = [r for r in rows.values() if "loss/grpo" in r]
  assert trained and all("rl/ppo_updates" not in r for r in trained)  # the K = 1 path
  for key in ("rl/ppo_ratio_mean", "rl/ppo_ratio_abs_dev_max", "rl/ppo_clip_frac"):
    np.testing.assert_array_equal([r[key] for r in trained], 1.0 if key.endswith("mean") else 0.0)
  assert all(r["loss/num_tokens"] > 0 for r in trained)
