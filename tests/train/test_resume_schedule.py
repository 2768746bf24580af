"""Resuming with another `train.steps`: the learning-rate schedule is kept, rebuilt or refused
(`train.resume_schedule`), the log says which, and the checkpoint stores its length."""

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from opd_jax.io import metrics_writer, run_history
from opd_jax.train import setup as setup_lib
from opd_jax.train import trainer
from opd_jax.train.setup import run_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))

import base  # noqa: E402

LR, WARMUP = 1e-3, 1


def _config(teacher_cache, steps, resume_schedule="keep"):
  config = base.get_config("tiny")
  config.teacher.cache_dir = teacher_cache
  config.train.steps = steps
  config.train.lr, config.train.warmup_steps = LR, WARMUP
  config.train.log_every = 1
  config.train.eval_every = 100  # only the evaluations at the start and the end
  config.train.checkpoint_every = 2
  config.train.resume_schedule = resume_schedule
  config.export.dir = "none"
  return config


def _stored_schedule_steps(workdir, step):
  """extra["schedule_steps"] of checkpoint `step`."""
  manager = ocp.CheckpointManager(
    os.path.join(workdir, "checkpoints"), options=ocp.CheckpointManagerOptions(create=False)
  )
  try:
    extra = manager.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))["extra"]
  finally:
    manager.close()
  return extra["schedule_steps"]


def _logged_lr(workdir, steps):
  """`opt/lr` logged at each step: the rate that step's update applied, lr(step - 1)."""
  rows = metrics_writer.read_jsonl(workdir)
  return np.array([rows[s]["opt/lr"] for s in steps])


def _schedule(total_steps, steps):
  """lr(s - 1) for each logged step s: linear warmup over WARMUP steps, then
  lr · (0.1 + 0.9 · ½(1 + cos(π·u))), u = (s' − WARMUP) / (total_steps − WARMUP) capped at 1."""
  out = []
  for s in np.asarray(steps) - 1:
    if s < WARMUP:
      out.append(LR * s / WARMUP)
    else:
      u = min((s - WARMUP) / (total_steps - WARMUP), 1.0)
      out.append(LR * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * u))))
  return np.array(out)


def _resumed_config(resume_schedule, stored=4):
  config = base.get_config("tiny")
  config.train.resume_schedule = resume_schedule
  config.train.steps = 6
  return config, {"schedule_steps": stored, "next_batch": 4}


def test_schedule_length_decisions():
  lines = []
  config, extra = _resumed_config("keep")
  assert setup_lib.schedule_length(run_spec(config), {}, lines.append) == 6  # a fresh run
  assert lines == []
  assert setup_lib.schedule_length(run_spec(config), extra, lines.append) == 4
  assert lines == [
    "train.steps changed from 4 to 6 on resume: keeping the checkpoint's 4-step learning-rate "
    "schedule (train.resume_schedule='keep'); the run stops at step 6"
  ]
  config, extra = _resumed_config("rebuild")
  assert setup_lib.schedule_length(run_spec(config), extra, lines.append) == 6
  assert "rebuilding the learning-rate schedule over 6 steps" in lines[-1]
  config, extra = _resumed_config("error")
  with pytest.raises(ValueError, match=r"train.steps changed from 4 to 6 on resume, but the"):
    setup_lib.schedule_length(run_spec(config), extra, lines.append)
  config, extra = _resumed_config("error", stored=6)
  assert (
    setup_lib.schedule_length(run_spec(config), extra, lines.append) == 6
  )  # unchanged: no decision
  del extra["schedule_steps"]  # a checkpoint from before the length was stored
  assert setup_lib.schedule_length(run_spec(config), extra, lines.append) == 6
  assert lines[-1] == "the checkpoint does not record its schedule length: using train.steps=6"


def test_resume_schedule_is_a_resumable_key_with_a_checked_value():
  from opd_jax.config import check as config_check

  assert "train.resume_schedule" in run_history.RESUMABLE_KEYS
  config = base.get_config("tiny")
  config.train.resume_schedule = "extend"
  with pytest.raises(ValueError, match="train.resume_schedule"):
    config_check.validate(config)


@pytest.fixture(scope="module")
def four_step_run(tmp_path_factory):
  """A finished 4-step run (checkpoints at 2 and 4) and its teacher cache."""
  teacher_cache = str(tmp_path_factory.mktemp("teacher_cache"))
  workdir = str(tmp_path_factory.mktemp("run4"))
  result = trainer.run(_config(teacher_cache, 4), workdir, log=lambda *a: None)
  assert result["end_step"] == 4
  return teacher_cache, workdir


def _resume(four_step_run, tmp_path, resume_schedule, steps=6):
  teacher_cache, source = four_step_run
  workdir = str(tmp_path / "run")
  shutil.copytree(source, workdir)
  lines = []
  config = _config(teacher_cache, steps, resume_schedule)
  result = trainer.run(config, workdir, log=lambda *a: lines.append(" ".join(map(str, a))))
  return workdir, result, lines


@pytest.mark.slow
def test_extended_run_keeps_the_stored_schedule(four_step_run, tmp_path):
  _, first = four_step_run
  assert _stored_schedule_steps(first, 4) == 4
  np.testing.assert_allclose(
    _logged_lr(first, [1, 2, 3, 4]), _schedule(4, [1, 2, 3, 4]), rtol=1e-6, atol=1e-12
  )

  workdir, result, lines = _resume(four_step_run, tmp_path, "keep")
  assert (result["start_step"], result["end_step"]) == (4, 6)
  assert any("keeping the checkpoint's 4-step learning-rate schedule" in line for line in lines)
  # Steps 5 and 6 run at the end of the 4-step schedule (10% of the peak), not on a
  # 6-step cosine.
  np.testing.assert_allclose(_logged_lr(workdir, [5, 6]), [0.1 * LR, 0.1 * LR], rtol=1e-6)
  assert not np.allclose(_schedule(6, [5, 6]), 0.1 * LR)
  assert _stored_schedule_steps(workdir, 6) == 4  # a later resume keeps it again


@pytest.mark.slow
def test_extended_run_rebuilds_or_refuses_when_asked(four_step_run, tmp_path):
  workdir, result, lines = _resume(four_step_run, tmp_path / "rebuild", "rebuild")
  assert result["end_step"] == 6
  assert any("rebuilding the learning-rate schedule over 6 steps" in line for line in lines)
  np.testing.assert_allclose(_logged_lr(workdir, [5, 6]), _schedule(6, [5, 6]), rtol=1e-6)
  assert _stored_schedule_steps(workdir, 6) == 6

  with pytest.raises(ValueError, match=r"train.steps changed from 4 to 6 on resume, but"):
    _resume(four_step_run, tmp_path / "error", "error")
  names = os.listdir(tmp_path / "error" / "run" / "checkpoints")
  latest = sorted(int(d) for d in names if d.isdigit())
  assert latest[-1] == 4  # refused before any step
