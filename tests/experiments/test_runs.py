"""Runs recorded once, and several trained side by side (`opd_jax.experiments.runs`)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import tiny_config

from opd_jax.experiments import runs

QUIET = lambda *a, **k: None  # noqa: E731


def test_run_many_refuses_bad_workers_and_shared_directories(tmp_path):
  config = tiny_config(str(tmp_path / "cache"))
  for workers in (0, -1, 1.5, True, "2"):
    with pytest.raises(ValueError, match=re.escape(f"workers={workers!r} must be an int >= 1")):
      runs.run_many([(config, str(tmp_path / "a"))], workers)
  same = str(tmp_path / "a")
  with pytest.raises(ValueError, match="two jobs share a run directory: .*/a"):
    runs.run_many([(config, same), (config, same + "/")], 2)
  assert not (tmp_path / "a").exists()  # refused before anything trained
  assert runs.run_many([], 2) == []


@pytest.mark.slow
def test_run_many_side_by_side_gives_the_numbers_of_one_process(tmp_path):
  """The same config trained here and in a worker process ends at the same numbers; a
  worker's error reaches the caller after the running ones finish (their results stay), and
  no queued job starts after it."""
  cache = str(tmp_path / "cache")
  overrides = {"train.steps": 3, "train.eval_every": 3, "train.checkpoint_every": 3}
  config = tiny_config(cache, **overrides)
  here = runs.run_once(config, str(tmp_path / "here"), QUIET)  # also fills the teacher cache
  side = runs.run_many([(config, str(tmp_path / "here")), (config, str(tmp_path / "w0"))], 2, QUIET)
  assert side[0] == here  # recorded: read, not trained
  keys = ("student_accuracy_after", "student_teacher_kl_after", "train/mismatch/kl_mean", "curve")
  assert {k: side[1][k] for k in keys} == {k: here[k] for k in keys}
  assert (tmp_path / "w0" / runs.TRAIN_LOG).read_text().count("done: {") == 1
  # A worker that fails (its prompt file is missing): the error names it, the run beside it
  # still records its result, and the job queued behind them does not start.
  broken = runs.with_overrides(config, {"data.prompt_file": str(tmp_path / "missing.jsonl")})
  other_seed = runs.with_overrides(config, {"train.seed": 1})
  jobs = [(broken, "b0"), (other_seed, "b1"), (config, "b2")]
  with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
    runs.run_many([(c, str(tmp_path / d)) for c, d in jobs], 2, QUIET)
  assert json.loads((tmp_path / "b1" / runs.RESULT_FILE).read_text())["config"]["train.seed"] == "1"
  assert not (tmp_path / "b0" / runs.RESULT_FILE).exists()
  assert not (tmp_path / "b2").exists()
