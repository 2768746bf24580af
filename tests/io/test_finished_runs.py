"""A workdir's finished records saved and restored between sittings (`io.finished_runs`, and
`python -m opd_jax.finished_runs`): only the records travel, a restored run is reused by the
study's plan, and a restore never replaces a different file."""

import gzip
import json
import os
import shutil
import sys

import pytest
from conftest import run_module

from opd_jax.experiments import runs, study_plan, study_probe, study_setting
from opd_jax.io import finished_runs, metrics_writer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "configs"))

import ladders  # noqa: E402  (configs/ladders.py)


def _write(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)


def _finished_part(workdir):
  """A ladders:tiny workdir after a part: one finished run (its real config), its checkpoint
  and events, the measurements, and the caches; returns (config, the run's setting)."""
  config = ladders.get_config("tiny")
  first = study_setting.study_settings(config)[2]
  cfg = study_setting.run_config(config, first, workdir)
  run_dir = os.path.join(workdir, "runs", first.name)
  _write(os.path.join(run_dir, runs.RESULT_FILE), json.dumps({"config": runs.config_repr(cfg)}))
  _write(os.path.join(run_dir, "checkpoints", "6", "state"), "weights")
  _write(os.path.join(run_dir, "tb", "events"), "events")
  _write(os.path.join(run_dir, "metrics.jsonl"), '{"step": 0, "quality/student_accuracy": 0.5}\n')
  unfinished = os.path.join(workdir, "runs", "unfinished")  # trains again: its log stays
  _write(os.path.join(unfinished, "metrics.jsonl"), '{"step": 0}\n')
  _write(os.path.join(unfinished, "checkpoints", "2", "state"), "weights")
  _write(os.path.join(workdir, "runs", "probe", "checkpoints", "3", "state"), "probe")
  _write(
    os.path.join(workdir, study_probe.MEASUREMENTS_FILE),
    json.dumps({"measurements": {first.spec: {}}}),
  )
  _write(os.path.join(workdir, "teacher_cache", "t", "result.json"), "{}")  # a cache: skipped
  _write(os.path.join(workdir, "jax_cache", "x"), "compiled")
  return config, first


def test_only_records_travel_and_a_restored_run_is_reused(tmp_path):
  workdir, saved = str(tmp_path / "study"), str(tmp_path / "records")
  config, first = _finished_part(workdir)
  paths = finished_runs.save(workdir, saved)
  run = os.path.join("runs", first.name)
  log, result = os.path.join(run, "metrics.jsonl"), os.path.join(run, "result.json")
  assert paths == [study_probe.MEASUREMENTS_FILE, log, result]
  on_disk = sorted(
    os.path.relpath(os.path.join(r, f), saved) for r, _, fs in os.walk(saved) for f in fs
  )
  # No checkpoint, events, cache, or log of an unfinished run; the finished run's log gzipped.
  assert on_disk == [study_probe.MEASUREMENTS_FILE, log + ".gz", result]
  original_log = (tmp_path / "study" / log).read_bytes()
  assert gzip.decompress((tmp_path / "records" / (log + ".gz")).read_bytes()) == original_log
  before = study_plan.study_plan(config, workdir)["counts"]
  shutil.rmtree(workdir)  # the next sitting's machine starts bare
  assert study_plan.study_plan(config, workdir)["counts"] == {
    "train": 12,
    "reused": 0,
    "refused": 0,
  }
  done = finished_runs.restore(saved, workdir)
  assert done == {"copied": paths, "present": []}
  assert (tmp_path / "study" / log).read_bytes() == original_log
  assert metrics_writer.read_jsonl(os.path.join(workdir, run))[0]["quality/student_accuracy"] == 0.5
  after = study_plan.study_plan(config, workdir)
  assert after["counts"] == before == {"train": 11, "reused": 1, "refused": 0}
  assert after["measurements"]["cached"] == 1
  # A second restore finds every record there already, identical, and copies nothing; saving
  # the same logs again writes the same bytes (no timestamp in the gzip header).
  assert finished_runs.restore(saved, workdir) == {"copied": [], "present": paths}
  finished_runs.save(workdir, str(tmp_path / "again"))
  gz = log + ".gz"
  assert (tmp_path / "again" / gz).read_bytes() == (tmp_path / "records" / gz).read_bytes()


def test_a_restore_that_would_replace_a_different_file_copies_nothing(tmp_path):
  workdir, saved = str(tmp_path / "study"), str(tmp_path / "records")
  _, first = _finished_part(workdir)
  finished_runs.save(workdir, saved)
  target = tmp_path / "other"
  result = target / "runs" / first.name / "result.json"
  _write(str(result), '{"config": {}}')
  with pytest.raises(
    ValueError, match=f"1 record.*runs/{first.name}/result.json.*nothing was copied"
  ):
    finished_runs.restore(saved, str(target))
  assert result.read_text() == '{"config": {}}'
  assert not (target / study_probe.MEASUREMENTS_FILE).exists()
  # A different log is a clash too: compared after decompressing the saved one.
  result.unlink()
  _write(str(result.parent / "metrics.jsonl"), '{"step": 0, "quality/student_accuracy": 0.25}\n')
  with pytest.raises(ValueError, match=f"runs/{first.name}/metrics.jsonl.*nothing was copied"):
    finished_runs.restore(saved, str(target))
  assert not result.exists()


def test_empty_and_missing_directories_are_refused(tmp_path):
  (tmp_path / "empty" / "runs" / "a" / "checkpoints").mkdir(parents=True)
  with pytest.raises(ValueError, match="holds no finished record"):
    finished_runs.save(str(tmp_path / "empty"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()
  with pytest.raises(ValueError, match="outside the workdir: .*/empty/records is inside"):
    finished_runs.save(str(tmp_path / "empty"), str(tmp_path / "empty" / "records"))
  with pytest.raises(FileNotFoundError, match="missing is not a directory"):
    finished_runs.restore(str(tmp_path / "missing"), str(tmp_path / "w"))
  with pytest.raises(ValueError, match="no record"):
    finished_runs.restore(str(tmp_path / "empty"), str(tmp_path / "w"))


def _command(*args):
  return run_module("opd_jax.finished_runs", *args)


def test_command_saves_restores_and_refuses_an_unclear_request(tmp_path):
  workdir, saved = str(tmp_path / "study"), str(tmp_path / "records")
  _finished_part(workdir)
  out = _command(f"--workdir={workdir}", f"--save={saved}")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == f"saved 3 record(s) of {workdir} to {saved}"
  shutil.rmtree(workdir)
  out = _command(f"--workdir={workdir}", f"--restore={saved}")
  assert out.returncode == 0, out.stderr
  assert "restored 3 record(s)" in out.stdout and "(0 already there, identical)" in out.stdout
  both = _command(f"--workdir={workdir}", f"--save={saved}", f"--restore={saved}")
  assert both.returncode == 1
  assert both.stderr.strip() == "error: give exactly one of --save=RECORDS and --restore=RECORDS"


def test_runs_behind_a_linked_folder_travel_and_no_temporary_file_is_left(tmp_path):
  """A workdir whose runs/ is a symbolic link saves those runs too (a link back into the tree
  is visited once), and every record is written whole by a rename."""
  real, workdir = str(tmp_path / "elsewhere"), str(tmp_path / "study")
  _write(os.path.join(real, "a", "result.json"), "{}")
  _write(os.path.join(real, "a", "metrics.jsonl"), '{"step": 0}\n')
  os.makedirs(workdir)
  os.symlink(real, os.path.join(workdir, "runs"))
  os.symlink(workdir, os.path.join(real, "loop"))
  saved = str(tmp_path / "records")
  paths = finished_runs.save(workdir, saved)
  assert os.path.join("runs", "a", "result.json") in paths
  assert not any("loop" in p for p in paths)
  left = [f for _, _, files in os.walk(saved) for f in files if ".tmp" in f]
  assert left == []
