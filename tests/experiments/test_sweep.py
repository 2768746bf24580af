"""`python -m opd_jax.sweep`: curves read from metrics.jsonl, the gains, shares, wall-time
readings and the selection rule against hand-computed values, the config checks, and the
`:tiny` sweep end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest

from opd_jax.experiments import sweep
from opd_jax.io import metrics_writer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))
import grpo_sweep  # noqa: E402

GREEDY, T1 = sweep.METRICS


def _write_run(run_dir, evals):
  """A metrics.jsonl with one evaluation row per (step, wall, greedy, t1), plus a training row
  between evaluations (which the curve must skip)."""
  os.makedirs(run_dir, exist_ok=True)
  writer = metrics_writer.JsonlWriter(os.path.join(run_dir, metrics_writer.JSONL_NAME))
  for step, wall, greedy, t1 in evals:
    if step:
      writer.write_scalars(step - 1, {"loss/total": 0.5})
      writer.write_scalars(step, {sweep.WALL_KEY: wall})
    writer.write_scalars(step, {GREEDY: greedy, T1: t1})


def _config(arms=("grpo", "opd"), seeds=(0, 1)):
  c = ml_collections.ConfigDict()
  c.arms = ml_collections.ConfigDict()
  for name in arms:
    c.arms[name] = grpo_sweep.grpo_arm(1e-5, 16, "exact_match", tiny=True)
  c.seeds = seeds
  c.reference_arm = "opd"
  c.select_from = tuple(a for a in arms if a != "opd")
  c.select_metric = T1
  return c


def test_curve_reads_evaluations_with_their_wall_seconds(tmp_path):
  _write_run(tmp_path, [(0, 0.0, 0.5, 0.3), (100, 20.0, 0.6, 0.4), (200, 41.0, 0.7, 0.5)])
  assert sweep.curve(str(tmp_path)) == [
    [0, 0.0, 0.5, 0.3],
    [100, 20.0, 0.6, 0.4],
    [200, 41.0, 0.7, 0.5],
  ]


def test_curve_without_t1_accuracy_names_the_setting(tmp_path):
  os.makedirs(tmp_path, exist_ok=True)
  writer = metrics_writer.JsonlWriter(os.path.join(tmp_path, metrics_writer.JSONL_NAME))
  writer.write_scalars(0, {GREEDY: 0.5})
  with pytest.raises(ValueError, match="eval_sampled"):
    sweep.curve(str(tmp_path))


def test_value_at_wall_interpolates_and_refuses_to_extrapolate():
  rows = [[0, 0.0, 0.5, 0.3], [100, 20.0, 0.6, 0.4], [200, 40.0, 0.8, 0.6]]
  assert sweep.value_at_wall(rows, 2, 30.0) == pytest.approx(0.7)  # halfway from 0.6 to 0.8
  assert sweep.value_at_wall(rows, 3, 10.0) == pytest.approx(0.35)
  assert math.isnan(sweep.value_at_wall(rows, 2, 40.5))  # past the last evaluation
  assert math.isnan(sweep.value_at_wall(rows, 2, math.nan))


def test_t_interval_by_hand():
  # mean 2, s = 1, n = 3: t_{2, 0.975} = 4.302653; half-width 4.302653 / sqrt(3) = 2.484138
  lo, hi = sweep.t_interval([1.0, 2.0, 3.0])
  assert (lo, hi) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-5)
  assert all(math.isnan(x) for x in sweep.t_interval([1.0]))


def test_summary_gains_shares_and_wall_reading_by_hand(tmp_path):
  config = _config()
  runs = {  # (arm, seed) -> evaluations (step, wall, greedy, t1); warm start 0.5 / 0.3
    ("grpo", 0): [(0, 0, 0.5, 0.3), (100, 40, 0.55, 0.36), (200, 80, 0.60, 0.40)],
    ("grpo", 1): [(0, 0, 0.5, 0.3), (100, 40, 0.53, 0.32), (200, 80, 0.56, 0.36)],
    ("opd", 0): [(0, 0, 0.5, 0.3), (100, 20, 0.70, 0.50), (200, 40, 0.90, 0.70)],
    ("opd", 1): [(0, 0, 0.5, 0.3), (100, 20, 0.66, 0.46), (200, 40, 0.86, 0.62)],
  }
  rows = []
  for (arm, seed), evals in runs.items():
    run_dir = str(tmp_path / f"{arm}{seed}")
    _write_run(run_dir, evals)
    rows.append(sweep.run_row(arm, seed, {"wall_seconds": 99.0}, run_dir))
  cells = {c["arm"]: c for c in sweep.summarise(rows, config)}
  grpo, opd = cells["grpo"], cells["opd"]
  assert grpo["gain_greedy"] == pytest.approx(0.08)  # (0.10 + 0.06) / 2
  assert grpo["gain_t1"] == pytest.approx(0.08)  # (0.10 + 0.06) / 2
  assert opd["gain_t1"] == pytest.approx(0.36)  # (0.40 + 0.32) / 2
  assert grpo["share_t1"] == pytest.approx(0.08 / 0.36)
  assert opd["share_t1"] == pytest.approx(1.0)
  # OPD trains 40 s; GRPO at 40 s is at its step-100 evaluation: (0.06 + 0.02) / 2 over 0.3
  assert grpo["reference_wall_seconds"] == pytest.approx(40.0)
  assert grpo["at_ref_wall_t1"] == pytest.approx(0.04)
  assert grpo["train_wall_seconds"] == pytest.approx(80.0)
  assert sweep.select(list(cells.values()), config) == "grpo"
  text = sweep.markdown(list(cells.values()), "grpo", {"summary": "s", **_meta(config)})
  assert "| grpo (selected) | 2 | +8.0" in text


def _meta(config):
  return {
    "reference_arm": config.reference_arm,
    "select_from": list(config.select_from),
    "select_metric": config.select_metric,
  }


def test_select_takes_the_largest_mean_gain_among_select_from_only():
  config = _config(arms=("a", "b", "opd"))
  cells = [
    {"arm": "a", "gain_t1": 0.05},
    {"arm": "b", "gain_t1": 0.09},
    {"arm": "opd", "gain_t1": 0.30},  # the reference is not a candidate
  ]
  assert sweep.select(cells, config) == "b"
  config.select_from = ()
  assert sweep.select(cells, config) is None


@pytest.mark.parametrize(
  "edit, message",
  [
    (lambda c: setattr(c, "seeds", (0, 0)), "distinct"),
    (lambda c: setattr(c, "reference_arm", "nope"), "reference_arm='nope' is not an arm"),
    (lambda c: setattr(c, "select_from", ("missing",)), "names 'missing', not an arm"),
    (lambda c: setattr(c, "select_metric", "loss"), "select_metric='loss'"),
    (lambda c: c.arms.__setitem__("bad name", ml_collections.ConfigDict()), "bad name"),
    (lambda c: setattr(c, "arms", ml_collections.ConfigDict()), "empty"),
  ],
)
def test_check_names_what_is_wrong(edit, message):
  config = _config()
  edit(config)
  with pytest.raises(ValueError, match=message):
    sweep.check(config)


def test_plan_sets_seed_and_cache_per_run(tmp_path):
  todo = sweep.plan(_config(), str(tmp_path))
  assert [(a, s) for a, s, _ in todo] == [("grpo", 0), ("opd", 0), ("grpo", 1), ("opd", 1)]
  assert {c.train.seed for _, s, c in todo if s == 1} == {1}
  assert {c.teacher.cache_dir for *_, c in todo} == {str(tmp_path / "teacher_cache")}


def test_grpo_sweep_config_holds_its_preregistered_grid():
  c = grpo_sweep.get_config()
  assert set(c.arms) == {*grpo_sweep.GRPO_ARMS, "opd"}
  assert c.arms.grpo_lr3e5_n256.train.lr == 3e-5
  assert (
    c.arms.grpo_lr3e5_n256.data.batch_size * c.arms.grpo_lr3e5_n256.rollout.samples_per_prompt
    == 256
  )
  assert c.arms.grpo_partial_lr1e4_n128.train.reward == "partial"
  assert c.arms.opd.train.loss == "reverse_kl_full"
  assert {a.student.warmup_steps for a in c.arms.values()} == {475}  # one shared warm start
  assert tuple(c.seeds) == (0,)
  assert tuple(grpo_sweep.get_config("confirm").seeds) == (1, 2, 3, 4, 5)


@pytest.mark.slow
def test_tiny_sweep_end_to_end_and_restart_reuses_runs(tmp_path):
  cmd = [
    sys.executable,
    "-m",
    "opd_jax.sweep",
    "--config=configs/grpo_sweep.py:tiny",
    f"--workdir={tmp_path}",
    "--json=-",
  ]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout)
  assert [c["arm"] for c in report["arms"]] == ["grpo_lr1e5_n128", "opd"]
  assert report["selected"] == "grpo_lr1e5_n128"
  assert report["provenance"]["config_sha256"]
  assert not report["code"]["mixed"]
  assert (tmp_path / "sweep.md").exists() and (tmp_path / "sweep_curves.png").exists()
  again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert json.loads(again.stdout)["runs"] == report["runs"]  # read back, not retrained
