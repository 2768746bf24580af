"""The ladder config's settings are legal and the study's cost plan (`--plan`) counts runs,
probes, measurements, wall time and reuse without training anything."""

import json
import os
import subprocess
import sys

import pytest

from opd_jax.config import check as config_check
from opd_jax.experiments import runs, study_plan, study_probe, study_setting
from opd_jax.mismatch import candidates as candidates_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "configs"))

import ladders  # noqa: E402  (configs/ladders.py)


@pytest.mark.parametrize("arg", [None, "tiny"])
def test_every_ladder_setting_is_legal_and_of_one_source(arg):
  config = ladders.get_config(arg)
  config_check.validate(config.run)
  for s in study_setting.study_settings(config):
    candidate = candidates_lib.parse_candidate(s.spec, config.run)
    config_check.validate(candidate.config)
    assert "+" not in s.source  # a ladder rung perturbs one source
  assert config.run.train.steps == (6 if arg else ladders.RUN_STEPS)


def test_the_ladders_are_the_ones_the_docstring_names():
  config = ladders.get_config()
  sources = [s.source for s in study_setting.study_settings(config) if s.role == "calibration"]
  counts = {name: sources.count(name) for name in dict.fromkeys(sources)}
  assert counts == {
    "int4_weights": 5,
    "fp4_weights": 3,
    "fp8_weights": 3,
    "fp8_kv": 4,
    "fp8_e5m2_kv": 4,
    "fp4_kv": 4,
    "stale": 6,
  }
  assert len(config.calibration) == 29 and config.held_out == ()
  assert tuple(config.seeds) == (0, 1, 2, 3, 4) and tuple(config.borderline_seeds) == (1, 2)
  lags = [candidates_lib.parse_candidate(s, config.run).lag for s in ladders.LAG]
  assert lags == [1, 2, 4, 8, 12, 16] and config.probe_steps > max(lags)
  # FP4 has no per-channel recipe: the config check refuses it, so the ladder skips it.
  with pytest.raises(ValueError, match="weight_group_size"):
    candidates_lib.parse_candidate("rollout.weights=fp4", config.run)


def test_full_plan_counts_and_cost_by_hand(tmp_path):
  config = ladders.get_config()
  plan = study_plan.study_plan(config, str(tmp_path / "study"))
  # 5 reference runs + 29 settings x (seed 0 + seeds 1, 2) = 92 runs of 600 steps.
  assert len(plan["runs"]) == 92 and {r["steps"] for r in plan["runs"]} == {600}
  assert plan["counts"] == {"train": 92, "reused": 0, "refused": 0}
  assert plan["borderline"] == [] and plan["measurements"] == {"n": 30, "cached": 0}
  # T = 92·600·0.3/2 + 65·0.6 + 30·10 = 8280 + 39 + 300.
  assert plan["seconds"] == pytest.approx(8619.0)
  assert not os.path.exists(tmp_path / "study")  # the plan writes nothing


def test_length_variant_is_eight_ladder_rungs_at_full_length_and_its_plan_by_hand(tmp_path):
  config = ladders.get_config("length")
  config_check.validate(config.run)
  assert set(config.calibration) <= set(ladders.LADDERS) and len(config.calibration) == 8
  sources = [s.source for s in study_setting.study_settings(config) if s.role == "calibration"]
  assert sorted(sources) == sorted(
    ["int4_weights", "fp4_weights", "fp8_weights", "fp8_kv", "fp8_e5m2_kv", "fp4_kv"]
    + ["stale"] * 2
  )
  # each format ladder's coarsest rung, and both ends of the lag ladder
  assert ladders.LENGTH[:3] == (ladders.INT4[-1], ladders.FP4[-1], ladders.FP8[-1])
  assert ladders.LENGTH[-2:] == (ladders.LAG[0], ladders.LAG[-1])
  assert all(",rollout.kv_bf16_layers" not in kv for kv in ladders.LENGTH[3:6])
  assert config.run.train.steps == ladders.FULL_STEPS == 1000
  assert config.run.train.eval_every == 1000 and config.run.train.checkpoint_every == 250
  assert tuple(config.seeds) == (0, 1, 2, 3, 4) and tuple(config.borderline_seeds) == (1, 2)
  plan = study_plan.study_plan(config, str(tmp_path / "full"))
  # 5 reference runs + 8 settings x 3 seeds = 29 runs of 1000 steps; 9 measurements.
  assert plan["counts"] == {"train": 29, "reused": 0, "refused": 0}
  assert {r["steps"] for r in plan["runs"]} == {1000} and plan["measurements"]["n"] == 9
  # T = 29·1000·0.3/2 + 65·0.6 + 9·10 = 4350 + 39 + 90, the figure the docstring states.
  assert plan["seconds"] == pytest.approx(4479.0)
  assert "4,479 s" in ladders.__doc__
  # the ladders' own run is unchanged by the variant
  assert ladders.get_config().run.train.steps == ladders.RUN_STEPS


def test_deep_variant_runs_the_same_ladders_on_the_second_pair(tmp_path):
  config = ladders.get_config("deep")
  config_check.validate(config.run)
  assert tuple(config.calibration) == ladders.LADDERS and config.held_out == ()
  for s in study_setting.study_settings(config):  # every rung is legal on the D = 96 student too
    config_check.validate(candidates_lib.parse_candidate(s.spec, config.run).config)
  student = config.run.student.arch
  assert (student.num_layers, student.hidden_size, student.num_kv_heads) == (4, 96, 1)
  assert config.run.data.task == "chain"
  assert config.run.teacher.target_accuracy == 0.95  # the chain teacher's own: its cache reused
  assert config.run.train.steps == ladders.DEEP_STEPS == 600
  assert config.full_run_accuracy == ladders.FULL_RUN_ACCURACY_DEEP == 1.0
  assert tuple(config.seeds) == (0, 1, 2, 3, 4) and config.probe_steps == ladders.PROBE_STEPS
  plan = study_plan.study_plan(config, str(tmp_path / "deep"))
  assert plan["counts"] == {"train": 92, "reused": 0, "refused": 0}


def test_tiny_plan_reuse_and_refusal(tmp_path):
  config = ladders.get_config("tiny")
  workdir = str(tmp_path)
  settings = study_setting.study_settings(config)
  first = settings[2]  # the first ladder rung, seed 0
  cfg = study_setting.run_config(config, first, workdir)
  run_dir = os.path.join(workdir, "runs", first.name)
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, runs.RESULT_FILE), "w") as f:
    json.dump({"config": runs.config_repr(cfg)}, f)
  other = runs.with_overrides(cfg, {"train.lr": cfg.train.lr * 2})
  ref_dir = os.path.join(workdir, "runs", "reference_seed1")
  os.makedirs(ref_dir)
  with open(os.path.join(ref_dir, runs.RESULT_FILE), "w") as f:
    json.dump({"config": runs.config_repr(other)}, f)
  with open(os.path.join(workdir, study_probe.MEASUREMENTS_FILE), "w") as f:
    json.dump({"measurements": {first.spec: {}}}, f)
  plan = study_plan.study_plan(config, workdir)
  # 2 reference + 5 rungs x 2 seeds = 12 runs of 6 steps.
  assert len(plan["runs"]) == 12
  assert plan["counts"] == {"train": 10, "reused": 1, "refused": 1}
  state = {r["name"]: r["state"] for r in plan["runs"]}
  assert state[first.name] == "reused" and state["reference_seed1"] == "refused"
  assert plan["measurements"] == {"n": 6, "cached": 1}
  # 10 runs x 6 steps x 0.3 / 1 worker + 3 probe steps x 0.6 + 5 measurements x 10.
  assert plan["seconds"] == pytest.approx(18.0 + 1.8 + 50.0)
  lines = study_plan.plan_lines(plan)
  assert lines[0].startswith("plan: 12 runs of 6 steps (10 to train, 1 reused, 1 recorded")
  assert f"reused: {first.name}" in lines
  assert any(line.startswith("refused") and "reference_seed1" in line for line in lines)


def test_borderline_reruns_are_counted_apart(tmp_path):
  config = ladders.get_config("tiny")
  config.rerun_all_roles = ()
  config.borderline_roles = ("calibration",)
  plan = study_plan.study_plan(config, str(tmp_path))
  assert len(plan["runs"]) == 7 and len(plan["borderline"]) == 5
  assert plan["borderline_seconds"] == pytest.approx(5 * 6 * 0.3)
  assert "then at most 5 borderline re-runs" in study_plan.plan_lines(plan)[2]


def test_bad_cost_constant_is_refused(tmp_path):
  config = ladders.get_config("tiny")
  config.run_step_seconds = 0.0
  with pytest.raises(ValueError, match="run_step_seconds"):
    study_plan.study_plan(config, str(tmp_path))


def test_plan_flag_prints_and_exits_without_training(tmp_path):
  workdir = tmp_path / "w"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "opd_jax.study",
      "--config=configs/ladders.py:tiny",
      f"--workdir={workdir}",
      "--plan",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "PYTHONPATH": REPO},
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("plan: 12 runs of 6 steps")
  assert not workdir.exists()


def test_a_probe_stopped_before_its_checkpoint_is_not_done(tmp_path):
  """The trainer makes the checkpoints folder before its first save: an empty folder (or one
  without the probe's last step) means the probe trains on, as the plan reports."""
  import ml_collections

  from opd_jax.experiments import study_probe

  config = ml_collections.ConfigDict({"probe_steps": 3})
  checkpoints = tmp_path / "runs" / study_probe.PROBE / "checkpoints"
  assert not study_probe.probe_done(config, str(tmp_path))
  checkpoints.mkdir(parents=True)
  assert not study_probe.probe_done(config, str(tmp_path))
  (checkpoints / "2").mkdir()
  assert not study_probe.probe_done(config, str(tmp_path))
  (checkpoints / "3").mkdir()
  assert study_probe.probe_done(config, str(tmp_path))
