"""The teacher bootstrap trained to a held-out accuracy target (`pretrain.train_to_target`,
through `setup.prepare_models`): a first phase that meets the target is the fixed-step teacher
bit for bit; below it, further phases run until the target is met; at the step cap the
bootstrap stops with a warning; the config checks refuse a bad target or cap.

Every run trains a 2-layer d=64 teacher on a two-operand sum task (10..29) for 100 steps and
more (lr 1e-2), and measures it on 32 held-out prompts (13-34 % of them right after 100-200
steps here). The targets are taken from a run's own record (the accuracy after each phase), so
the tests hold on any CPU, whose bits differ. The runs take about a minute on 2 CPU cores.
"""

import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from opd_jax.config import check as config_check
from opd_jax.train import pretrain, setup
from opd_jax.train.setup import run_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import base  # noqa: E402

FIRST_STEPS = 100  # teacher.pretrain_steps: phase 1; later phases are 50 steps each
CAP = 225  # teacher.max_pretrain_steps of the unreachable run: phases 100, 50, 50, 25


def _config(cache_dir, target, cap=CAP):
  """The tiny config with a teacher that learns a small sum task in tens of steps."""
  c = base.get_config("tiny")
  c.data.num_operands = 2
  c.data.max_operand = 29
  c.teacher.arch = base.model_arch(2, 64, 4, 2, 16, 128)
  c.teacher.pretrain_steps = FIRST_STEPS
  c.teacher.pretrain_lr = 1e-2
  c.teacher.pretrain_batch_size = 32
  c.teacher.target_accuracy = target
  c.teacher.max_pretrain_steps = cap
  c.teacher.target_eval_size = 32
  c.teacher.cache_dir = os.fspath(cache_dir)
  c.train.eval_every = 0  # the trainer's own held-out set is not needed here
  config_check.validate(c)
  return c


def _bootstrap(config):
  """(teacher params on the host, teacher_info, log lines) of `prepare_models`."""
  lines = []
  s = setup.prepare_models(run_spec(config), config.teacher.cache_dir, log=lines.append)
  return jax.device_get(s.models.teacher_params), s.teacher_info, lines


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def unreachable(tmp_path_factory):
  """A run held to target 1.0 with a cap of CAP steps: every phase's accuracy is recorded."""
  return _bootstrap(_config(tmp_path_factory.mktemp("cache"), 1.0))


@pytest.mark.slow
def test_an_unreachable_target_stops_at_the_cap_with_a_warning(unreachable):
  _, info, lines = unreachable
  # A cap that is not a whole number of phases cuts the last one short.
  assert [p["steps"] for p in info["phases"]] == [FIRST_STEPS, 50, 50, 25]
  assert info["steps"] == CAP and not info["reached"]
  assert [p["start_index"] for p in info["phases"]] == [0, 100 * 32, 150 * 32, 200 * 32]
  assert [p["lr"] for p in info["phases"]] == [1e-2] + [pytest.approx(0.3 * 1e-2)] * 3
  assert all(0.0 <= p["accuracy"] <= 1.0 for p in info["phases"])
  assert info["accuracy"] == info["phases"][-1]["accuracy"]
  warnings = [line for line in lines if line.startswith("warning:")]
  assert len(warnings) == 1
  assert f"held-out accuracy {info['accuracy']:.4f} after {CAP} steps" in warnings[0]
  assert sum(line.startswith("teacher phase") for line in lines) == 4


@pytest.mark.slow
def test_a_target_met_by_the_first_phase_is_the_fixed_step_teacher(unreachable, tmp_path):
  first = unreachable[1]["phases"][0]["accuracy"]
  assert first > 0, "the first phase must score something for its accuracy to be a target"
  fixed, fixed_info, _ = _bootstrap(_config(tmp_path / "fixed", 0.0))
  assert fixed_info["steps"] == FIRST_STEPS and fixed_info["accuracy"] is None
  met, met_info, lines = _bootstrap(_config(tmp_path / "met", first))
  assert met_info["steps"] == FIRST_STEPS and met_info["reached"]
  assert met_info["accuracy"] == first
  assert fixed_info["path"] != met_info["path"]  # the target is part of the cache key
  _assert_same(met, fixed)
  # A cached load reports the accuracy reached and returns the same params.
  again, again_info, lines = _bootstrap(_config(tmp_path / "met", first))
  assert again_info["cached"] and again_info["accuracy"] == first
  assert any(f"{FIRST_STEPS} steps: held-out accuracy {first:.4f}" in line for line in lines)
  _assert_same(again, fixed)


@pytest.mark.slow
def test_a_target_missed_by_the_first_phase_trains_until_it_is_met(unreachable, tmp_path):
  phases = unreachable[1]["phases"]
  first = phases[0]["accuracy"]
  better = [i for i, p in enumerate(phases) if p["accuracy"] > first]
  assert better, f"no phase improved on the first: {[p['accuracy'] for p in phases]}"
  k = better[0]
  target = phases[k]["accuracy"]
  _, info, lines = _bootstrap(_config(tmp_path, target))
  assert info["reached"] and info["accuracy"] == target
  assert info["phases"] == phases[: k + 1]  # the same phases, stopped at the first to meet it
  assert info["steps"] == sum(p["steps"] for p in phases[: k + 1])
  assert not any(line.startswith("warning:") for line in lines)
  record = pretrain.load_record(info["path"])
  assert record["steps"] == info["steps"] and record["accuracy"] == target


@pytest.mark.parametrize(
  "target,cap,first,message",
  [
    (1.5, 3000, 1000, "config.teacher.target_accuracy must be <= 1, got 1.5"),
    (-0.1, 3000, 1000, "config.teacher.target_accuracy must be >= 0, got -0.1"),
    (0.95, 500, 1000, "config.teacher.max_pretrain_steps=500 must be >= teacher.pretrain_steps"),
  ],
)
def test_bad_targets_and_caps_are_refused(target, cap, first, message):
  c = base.get_config()
  c.teacher.target_accuracy, c.teacher.max_pretrain_steps = target, cap
  c.teacher.pretrain_steps = first
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    config_check.validate(c)


def test_a_cap_below_the_first_phase_is_allowed_with_the_target_off():
  c = base.get_config()
  c.teacher.target_accuracy, c.teacher.max_pretrain_steps = 0.0, 10
  config_check.validate(c)


def test_the_key_keeps_fixed_step_entries_and_hashes_the_target():
  args = ({"n": 1}, base_task(), 10, 1e-3, 4, 0, "char", "float32")
  fixed = pretrain.teacher_key(*args)
  assert pretrain.teacher_key(*args, 0.0, 3000, 256) == fixed  # target off: the old key
  keys = {
    pretrain.teacher_key(*args, 0.95, 3000, 256),
    pretrain.teacher_key(*args, 0.9, 3000, 256),
    pretrain.teacher_key(*args, 0.95, 2000, 256),
    pretrain.teacher_key(*args, 0.95, 3000, 128),
  }
  assert len(keys) == 4 and fixed not in keys


def base_task():
  return setup.task_config(run_spec(base.get_config()))
