"""`opd_jax.calibrate`: the plan of a calibration for any run config, its refusals, the
continuous label, and a quick calibration end to end on toy Hugging Face checkpoints."""

import json
import math
import os
import sys

import pytest
from conftest import run_module

from opd_jax.data import toy_checkpoints
from opd_jax.experiments import calibrate, stats, study_probe, study_setting
from opd_jax.experiments import study as study_lib
from opd_jax.mismatch import budget_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import base  # noqa: E402
import bf16_sync  # noqa: E402


def _embedded(steps=1000):
  config = bf16_sync.get_config()
  config.tokenizer = "char"
  config.train.steps = steps
  return config


def test_quick_plan_is_noise_and_the_candidates_sources_twice_each():
  plan = calibrate.make_plan(
    _embedded(),
    quick=True,
    candidates=["rollout.weights=fp8,rollout.kv_cache=fp8", "rollout.stale_k=4"],
  )
  s = plan.study
  assert plan.sources == ("noise", "fp8_weights", "fp8_kv", "stale")
  assert s.calibration == (
    *calibrate.LADDERS["noise"]["quick"],
    "rollout.weights=fp8",  # the fp8 weights ladder's mildest and hardest setting
    "rollout.weights=fp8,rollout.weight_per_tensor=true",
    "rollout.kv_cache=fp8",
    "rollout.kv_cache=fp8,rollout.kv_granularity=tensor",
    "rollout.stale_k=4",
    "rollout.stale_k=16",
  )
  assert s.seeds == (0, 1) and s.borderline_seeds == (1,) and s.rerun_all_roles == ("calibration",)
  assert s.run.train.steps == 250 and s.run.train.eval_every == 250  # a quarter of 1000
  assert s.probe_steps == 25 and s.held_out == () and s.rule == "pooled" and s.label == "auto"
  # 2 reference runs + 10 settings twice, and the probe, over one 1000-step run
  assert plan.num_runs == 22
  assert plan.cost_runs == pytest.approx((25 + 22 * 250) / 1000)
  assert "cost ≈ 5.5× one training run" in plan.describe()


def test_full_plan_ladders_every_source_with_five_seeds_and_borderline_reruns():
  plan = calibrate.make_plan(_embedded(), quick=False)
  s = plan.study
  assert set(plan.sources) == set(calibrate.LADDERS)
  assert len(s.seeds) == 5 and s.borderline_roles == ("calibration",)
  assert s.borderline_seeds == (1, 2) and s.rerun_all_roles == ()
  assert s.run.train.steps == 500 and "rollout.stale_k=16" in s.calibration
  assert s.probe_steps == 50  # > the largest lag, 16


def test_a_source_without_a_ladder_is_calibrated_on_the_candidates_own_part():
  plan = calibrate.make_plan(
    _embedded(), quick=True, candidates=["rollout.kv_cache=fp8,rollout.noise_sigma=0.1"]
  )
  assert "fp8_kv" in plan.sources and "rollout.kv_cache=fp8" in plan.study.calibration
  plan = calibrate.make_plan(_embedded(), quick=True, candidates=["rollout.kv_cache=bf16"])
  assert plan.sources == ("noise", "bf16_kv") and plan.study.calibration[-1] == (
    "rollout.kv_cache=bf16"
  )


def test_a_screened_candidates_lag_is_covered_by_the_probe():
  """A stale candidate is measured at the probe (not trained), so the probe runs longer than
  its lag and keeps that many checkpoints."""
  plan = calibrate.make_plan(_embedded(), quick=True, candidates=["rollout.stale_k=32"])
  assert plan.study.probe_steps == 33 and plan.study.probe_lag == 32
  settings = study_setting.study_settings(plan.study)
  probe = study_probe.probe_config(plan.study, settings, "/tmp/unused")
  assert probe.train.keep_checkpoints == 33 and probe.train.stop_after == 33


def test_the_kl_label_drop_is_positive_when_the_kl_to_the_teacher_rises():
  rows = [
    {"role": "reference", "source": "reference", "mismatch/kl": 0.0, "accuracy": 0.0},
    {"role": "calibration", "source": "noise", "mismatch/kl": 0.3, "accuracy": 0.0},
  ]
  rows[0]["quality_runs"] = [-0.10]
  rows[1]["quality_runs"] = [-0.15, -0.13]  # KL 0.15 and 0.13 against the reference's 0.10
  records = study_lib.budget_records(rows, reference_mean=-0.10)
  assert [r["quality_drop"] for r in records] == pytest.approx([0.0, 0.05, 0.03])
  scored = {"student_score_after": 0.5, "teacher_score": 0.25}
  assert study_lib.run_quality(scored, "accuracy") == 0.5  # an eval file's score


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"candidates": ["rollout.weights=trainer"]}, "changes nothing the rollout engine does"),
    ({"candidates": ["rollout.wieghts=fp8"]}, "weights"),
    ({"rule": "loose"}, "rule 'loose' must be one of"),
    ({"label": "bleu"}, "label 'bleu' must be one of"),
    ({"run_steps": 16, "candidates": ["rollout.stale_k=4"]}, "too short for a probe of 17 steps"),
  ],
)
def test_bad_input_is_refused_before_anything_trains(kwargs, match):
  with pytest.raises(ValueError, match=match):
    calibrate.make_plan(_embedded(), quick=True, **kwargs)


def test_a_config_the_trainer_refuses_is_refused():
  config = _embedded()
  config.rollout.mode = "sideways"
  with pytest.raises(ValueError, match="sideways"):
    calibrate.make_plan(config, quick=True)


def test_the_label_by_hand():
  accuracy = {"student_accuracy_after": 0.8, "teacher_accuracy": 0.95}
  scored = {"student_score_after": 0.5, "teacher_score": 0.0, "student_teacher_kl_after": 0.25}
  assert study_lib.run_quality(accuracy, "accuracy") == 0.8
  assert study_lib.run_quality(scored, "teacher_kl") == -0.25
  assert study_lib.choose_label("auto", [accuracy]) == "accuracy"
  assert study_lib.choose_label("auto", [scored]) == "teacher_kl"  # the teacher solves nothing
  assert study_lib.choose_label("auto", [{"student_teacher_kl_after": 0.1}]) == "teacher_kl"
  assert study_lib.choose_label("accuracy", [scored]) == "accuracy"
  with pytest.raises(ValueError, match="must be one of"):
    study_lib.choose_label("bleu", [accuracy])
  # KL label: sd of (−0.2, −0.22) = 0.01414; se = 0.025 · 0.21 = 0.00525; τ = 2 · sd
  floor = stats.noise_floor([-0.2, -0.22], 512, "teacher_kl")
  assert floor["se"] == pytest.approx(0.00525)
  assert floor["tolerance"] == pytest.approx(2 * math.sqrt(2) * 0.01)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  out = tmp_path_factory.mktemp("mine")
  return toy_checkpoints.write_toy_files(str(out), num_prompts=64, num_eval=16)


def _toy_args(toy, workdir):
  return [
    "--config=configs/base.py",
    f"--workdir={workdir}",
    f"--config.student.checkpoint={toy['student']}",
    f"--config.teacher.checkpoint={toy['teacher']}",
    f"--config.data.prompt_file={toy['prompts']}",
    f"--config.data.eval_file={toy['eval']}",
    "--config.rollout.max_new_tokens=16",
    "--config.data.batch_size=4",
  ]


def _calibrate(*args):
  return run_module("opd_jax.calibrate", *args, timeout=900)


def test_too_few_eval_prompts_are_refused_before_anything_loads(toy, tmp_path):
  small = toy_checkpoints.write_toy_files(str(tmp_path / "small"), num_prompts=64, num_eval=8)
  proc = _calibrate(*_toy_args(small, tmp_path / "cal"), "--quick", "--plan-only")
  assert proc.returncode != 0
  assert "gives 8 held-out prompts; a calibration needs at least 16" in proc.stderr


@pytest.mark.slow  # a probe, 2 runs of 4 steps and the screen, on toy checkpoints
def test_quick_calibration_on_toy_checkpoints_writes_a_budget_and_screens(toy, tmp_path):
  """The library path the command takes (`make_plan`, `check_prompts`, `calibrate`), on a plan
  cut to one ladder setting and one seed so the suite stays short; the command line is the
  refusal test's, and a restart reusing every run is the study's own test
  (tests/experiments/test_study.py)."""
  import dataclasses

  config = base.get_config()
  for key, value in {
    "student.checkpoint": toy["student"],
    "teacher.checkpoint": toy["teacher"],
    "data.prompt_file": toy["prompts"],
    "data.eval_file": toy["eval"],
    "rollout.max_new_tokens": 16,
    "data.batch_size": 4,
    "train.steps": 16,
  }.items():
    section, leaf = key.split(".")
    config[section][leaf] = value
  workdir = str(tmp_path / "cal")
  plan = calibrate.make_plan(
    config,
    quick=True,
    candidates=["rollout.weights=fp8"],
    seeds=[0],
    num_prompts=8,
    workers=1,
    sensitivity=False,
  )
  assert plan.sources == ("noise", "fp8_weights") and plan.study.run.train.steps == 4
  study = plan.study
  study.calibration = ("rollout.noise_sigma=0.8",)
  plan = dataclasses.replace(plan, study=study)
  calibrate.check_prompts(plan.study.run, workdir, plan.study.num_prompts, lambda *a: None)
  result = calibrate.calibrate(plan, workdir, lambda *a: None)
  # The random toy teacher solves nothing, so runs are scored by the KL to it.
  assert result["label"] == "teacher_kl" and result["run_steps"] == 4
  assert result["num_runs"] == 2  # one seed: no re-runs
  assert all(r["quality_runs"][0] < 0 for r in result["rows"])  # q = −KL
  fitted, fingerprint = budget_file.load_budget(os.path.join(workdir, "budget.json"))
  assert fitted.rule.name == "pooled" and "student" in fingerprint
  (screened,) = result["calibration"]["screen"]
  assert screened["spec"] == "rollout.weights=fp8"
  assert screened["limit"] == pytest.approx(fitted.max_kl)
  # The plan was cut to noise alone: fp8_weights was never calibrated, so it is refused.
  assert screened["extrapolation"] == "uncalibrated source" and not screened["admitted"]
  assert screened["reasons"][0].startswith("uncalibrated source: ")
  # Every part was made by the code running now, and the budget records it.
  assert not result["code"]["mixed"] and len(result["code"]["versions"]) == 1
  assert fitted.code_provenance == result["provenance"]
  assert result["calibration"]["cost_runs_measured"] > 0
  with open(os.path.join(workdir, "study.json")) as f:
    assert json.load(f)["calibration"]["screen"] == result["calibration"]["screen"]
