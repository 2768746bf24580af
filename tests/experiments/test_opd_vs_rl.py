"""The OPD-against-RL comparison: the report's arithmetic, and `:tiny` end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from opd_jax.experiments import opd_vs_rl, opd_vs_rl_arms, opd_vs_rl_report, stats

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))
import opd_vs_rl as opd_vs_rl_config  # noqa: E402


def _row(method, setting, accuracy):
  return {
    "method": method,
    "setting": setting,
    "accuracy": accuracy,
    "accuracy_before": 0.45,
    "mismatch_kl_mean": 0.0 if setting == "reference" else 0.01,
    "grad_norm_mean": 1.0,
    "grad_norm_max": 2.0,
    "grad_norm_std": 0.5,
    "train_reward_last": math.nan,
  }


def test_drops_are_against_the_same_methods_reference():
  rows = [
    _row("opd", "reference", 0.90),
    _row("rl", "reference", 0.50),
    _row("opd", "fp8", 0.85),
    _row("rl", "fp8", 0.60),
    _row("rl_is", "fp8", 0.40),  # its reference has not finished: no drop yet
  ]
  opd_vs_rl_report.add_drops(rows)
  assert [r["drop_points"] for r in rows[:4]] == pytest.approx([0.0, 0.0, 5.0, -10.0])
  assert math.isnan(rows[4]["drop_points"])
  table = opd_vs_rl_report.markdown_table(rows)
  assert (
    "| fp8 | rl | 0 | 60.0 % | -10.0 |" in table and "| fp8 | rl_is | 0 | 40.0 % | — |" in table
  )


def test_method_overrides_and_setting_names():
  assert opd_vs_rl.method_overrides("opd", 1e-4, 2.0) == {}
  assert opd_vs_rl.method_overrides("rl", 1e-4, 2.0)["train.is_clip"] == 0.0
  assert opd_vs_rl.method_overrides("rl_is", 1e-4, 2.0)["train.is_clip"] == 2.0
  with pytest.raises(ValueError, match="unknown method 'ppo'"):
    opd_vs_rl.method_overrides("ppo", 1e-4, 2.0)
  with pytest.raises(ValueError, match="is_clip > 0"):
    opd_vs_rl.method_overrides("rl_is", 1e-4, 0.0)
  assert opd_vs_rl.setting_name("") == "reference"
  assert opd_vs_rl.setting_name("rollout.weights=fp8,rollout.kv_cache=fp8") == (
    "weights-fp8_kv_cache-fp8"
  )


def test_arms_like_for_like_overrides():
  """The sampled-OPD arms are bf16_sync_sampled.py's recipe over bf16_sync.py (but the run's
  batch); the GRPO arms sample as many completions per step as the run, in groups."""
  import bf16_sync
  import bf16_sync_sampled

  full, sampled = bf16_sync.get_config(), bf16_sync_sampled.get_config()
  for key, value in opd_vs_rl_arms.SAMPLED_OPD.items():
    section, name = key.split(".")
    assert sampled[section][name] == value, key
  assert full.train.loss == "reverse_kl_full"
  assert opd_vs_rl.method_overrides("opd_sampled", 1e-4, 2.0)["train.is_clip"] == 0.0
  assert opd_vs_rl.method_overrides("opd_sampled_tis", 1e-4, 2.0)["train.is_clip"] == 2.0
  grpo = opd_vs_rl.method_overrides("grpo", 1e-4, 2.0, batch_size=32, group_size=4, grpo_lr=3e-4)
  assert grpo["data.batch_size"] * grpo["rollout.samples_per_prompt"] == 32
  assert (grpo["train.loss"], grpo["train.lr"], grpo["train.mismatch_correction"]) == (
    "grpo",
    3e-4,
    "none",
  )
  assert grpo["train.ppo_minibatches"] == 2  # K = 2: the clip acts
  for correction in ("tis", "mis", "seq_tis", "seq_mis"):
    arm = opd_vs_rl.method_overrides(f"grpo_{correction}", 1e-4, 2.0)
    assert (arm["train.mismatch_correction"], arm["train.mismatch_clip"]) == (correction, 2.0)
  with pytest.raises(ValueError, match="divide the run's 30"):
    opd_vs_rl.method_overrides("grpo", 1e-4, 2.0, batch_size=30, group_size=4)
  with pytest.raises(ValueError, match="> 1 for grpo"):
    opd_vs_rl.method_overrides("grpo_tis", 1e-4, 1.0)
  with pytest.raises(ValueError, match="unknown method 'grpo_geo'"):
    opd_vs_rl.method_overrides("grpo_geo", 1e-4, 2.0)
  tempered = opd_vs_rl.method_overrides(
    "grpo", 1e-4, 2.0, group_size=8, grpo_temperature=0.7, grpo_kl_coef=0.05
  )
  assert (tempered["rollout.temperature"], tempered["train.kl_coef"]) == (0.7, 0.05)
  assert (tempered["data.batch_size"], tempered["rollout.samples_per_prompt"]) == (4, 8)
  assert (grpo["rollout.temperature"], grpo["train.kl_coef"]) == (1.0, 0.0)  # the defaults
  with pytest.raises(ValueError, match="grpo_temperature must be in"):
    opd_vs_rl.method_overrides("grpo", 1e-4, 2.0, grpo_temperature=0.0)
  with pytest.raises(ValueError, match="grpo_kl_coef must be >= 0"):
    opd_vs_rl.method_overrides("grpo", 1e-4, 2.0, grpo_kl_coef=-0.1)
  config = opd_vs_rl_config.get_config("tiny")
  config.methods = opd_vs_rl.METHODS
  config.grpo_temperature, config.grpo_kl_coef = 0.7, 0.05  # the config keys reach the arms
  from opd_jax.config import check as config_check

  for method, _, _, _, run_config in opd_vs_rl.plan(config):
    config_check.validate(run_config)  # every arm is a valid run
    if method.startswith("grpo"):
      assert run_config.data.batch_size * run_config.rollout.samples_per_prompt == 8
      assert (run_config.rollout.temperature, run_config.train.kl_coef) == (0.7, 0.05)


def test_plan_covers_every_method_and_setting_and_refuses_bad_specs():
  config = opd_vs_rl_config.get_config("tiny")
  plan = opd_vs_rl.plan(config)
  assert [(m, s) for m, s, _, _, _ in plan] == [
    (m, s) for s in ("reference", "noise_sigma-0.5") for m in ("opd", "rl", "rl_is")
  ]
  by_key = {(m, s): c for m, s, _, _, c in plan}
  assert by_key[("rl_is", "noise_sigma-0.5")].rollout.noise_sigma == 0.5
  assert by_key[("rl", "reference")].train.loss == "reinforce"
  assert by_key[("opd", "reference")].train.loss == "reverse_kl_full"
  config.seeds = (0, 3)
  seeded = opd_vs_rl.plan(config)
  assert [seed for _, _, _, seed, _ in seeded] == [0] * 6 + [3] * 6
  # Seed 0 is the run's own (train.seed -1 = seed 0): its config is left as it was recorded.
  assert [c.train.seed for *_, c in seeded] == [-1] * 6 + [3] * 6
  assert opd_vs_rl.run_name("rl", "reference", 0) == "rl__reference"  # earlier runs are reused
  assert opd_vs_rl.run_name("rl", "reference", 3) == "rl__reference__seed3"
  config.seeds = (1, 1)
  with pytest.raises(ValueError, match="distinct train seeds"):
    opd_vs_rl.plan(config)
  config.seeds = (0,)
  config.settings = ("rollout.nois_sigma=0.1",)
  with pytest.raises(ValueError, match="noise_sigma"):
    opd_vs_rl.plan(config)


def test_cells_summarise_seeds_against_the_mean_reference():
  """Two seeds per cell: accuracy 0.9/0.8 (reference, mean 0.85) and 0.7/0.6 (mean 0.65,
  sample sd 0.0707): the cell's drop is 100·(0.85 − 0.65) = 20 points."""
  rows = [
    dict(_row("opd", "reference", 0.9), seed=0),
    dict(_row("opd", "noise", 0.7), seed=0),
    dict(_row("opd", "reference", 0.8), seed=1),
    dict(_row("opd", "noise", 0.6), seed=1),
  ]
  opd_vs_rl_report.add_drops(rows)
  assert [r["drop_points"] for r in rows] == pytest.approx([-5.0, 15.0, 5.0, 25.0])
  ref, noise = opd_vs_rl_report.summarise(rows)
  assert (ref["setting"], noise["setting"]) == ("reference", "noise")
  assert noise["seeds"] == [0, 1] and noise["accuracy"] == pytest.approx(0.65)
  assert noise["accuracy_sd"] == pytest.approx(0.1 / math.sqrt(2))
  assert noise["drop_points"] == pytest.approx(20.0) and ref["drop_points"] == pytest.approx(0.0)
  assert noise["gain_kept"] == pytest.approx((0.65 - 0.45) / (0.85 - 0.45))
  assert "| noise | opd | 2 | 65.0 ± 7.1 % | +20.0 [-10.4, 50.4] | 0.50 [" in (
    opd_vs_rl_report.summary_table([ref, noise])
  )


@pytest.mark.slow
def test_tiny_comparison_end_to_end(tmp_path):
  """`python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl.py:tiny` writes every file with a
  row for each method and setting; a second call reuses the runs."""
  cmd = [
    sys.executable,
    "-m",
    "opd_jax.opd_vs_rl",
    "--config=configs/opd_vs_rl.py:tiny",
    f"--workdir={tmp_path}",
    "--json",
  ]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
  assert done.returncode == 0, done.stderr[-3000:]
  printed = json.loads(done.stdout)
  for name in ("opd_vs_rl.md", "opd_vs_rl.json", "opd_vs_rl.png", "opd_vs_rl_curves.png"):
    assert (tmp_path / name).stat().st_size > 0
  report = json.loads((tmp_path / "opd_vs_rl.json").read_text())
  assert report["rows"] == printed["rows"]
  cells = {(r["method"], r["setting"]) for r in report["rows"]}
  want = {(m, s) for m in ("opd", "rl", "rl_is") for s in ("reference", "noise_sigma-0.5")}
  assert cells == want
  for r in report["rows"]:
    assert 0.0 <= r["accuracy"] <= 1.0 and r["grad_norm_logged_steps"] == 4
    # RL's gradient is exactly 0 on a batch whose rewards are all equal (all 0 at tiny size).
    assert r["grad_norm_max"] >= r["grad_norm_mean"] >= 0
    assert r["method"] != "opd" or r["grad_norm_mean"] > 0
    assert os.path.exists(os.path.join(r["run_dir"], "result.json"))
  noisy = [r for r in report["rows"] if r["setting"] == "noise_sigma-0.5"]
  assert all(r["mismatch_kl_mean"] > 0 for r in noisy)
  rl = [r for r in report["rows"] if r["method"] != "opd"]
  assert all(0.0 <= r["train_reward_last"] <= 1.0 for r in rl)
  md = (tmp_path / "opd_vs_rl.md").read_text()
  assert md.count("| noise_sigma-0.5 |") == 3
  assert "teacher loaded from cache" in done.stderr  # runs after the first share the cache
  again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0 and json.loads(again.stdout)["rows"] == printed["rows"]


def test_bad_workers_are_refused_before_anything_trains(tmp_path):
  config = opd_vs_rl_config.get_config("tiny")
  config.workers = -1
  with pytest.raises(ValueError, match="workers=-1 must be an int >= 1"):
    opd_vs_rl.run_comparison(config, str(tmp_path / "cmp"), lambda *a: None)
  assert not (tmp_path / "cmp" / "runs").exists()


def test_intervals_gain_kept_and_spikes_by_hand():
  """Welch for 0.9/0.8 against 0.7/0.6: d = 0.2, se = √(0.0025 + 0.0025), ν = 2,
  t_{0.975, 2} = 4.3027, so 0.2 ± 0.3043; gain kept with warm start 0.45: 0.20 / 0.40."""
  lo, hi = stats.welch_interval([0.9, 0.8], [0.7, 0.6])
  assert (lo, hi) == pytest.approx(
    (0.2 - 4.30265 * math.sqrt(0.005), 0.2 + 4.30265 * math.sqrt(0.005)), abs=1e-4
  )
  assert all(math.isnan(x) for x in stats.welch_interval([0.9], [0.7, 0.6]))
  kept, (k_lo, k_hi) = stats.gain_kept([0.9, 0.8], [0.7, 0.6], 0.45)
  assert kept == pytest.approx(0.5) and k_lo <= kept <= k_hi
  assert math.isnan(stats.gain_kept([0.45, 0.452], [0.4, 0.41], 0.45)[0])  # no gain to keep
  assert opd_vs_rl_report.spike_count([1.0, 2.0, 7.0, 10.0], 2.0) == 2  # above 3 × 2
  rows = [
    dict(_row("grpo", "reference", 0.5), seed=0, grad_norms=[1.0, 1.0, 4.0]),
    dict(_row("grpo", "reference", 0.4), seed=1, grad_norms=[1.0, 2.0]),
    dict(_row("grpo", "noise", 0.3), seed=0, grad_norms=[1.0, 3.5, 9.0]),
    dict(_row("grpo", "noise", 0.2), seed=1, grad_norms=[1.0]),
  ]
  ref, noise = opd_vs_rl_report.summarise(rows)  # the reference median is 1.0: spikes are > 3.0
  assert (ref["grad_norm_spikes"], noise["grad_norm_spikes"]) == (1, 2)
  # Without a reference grad-norm there is nothing to count against: unknown, not 0.
  (alone,) = opd_vs_rl_report.summarise([dict(rows[2], method="other")])
  assert alone["grad_norm_spikes"] is None
  assert "| —/" in opd_vs_rl_report.summary_table([alone])
  assert noise["drop_points"] == pytest.approx(20.0)
  assert noise["drop_ci_points"] == pytest.approx(
    [20.0 - 100 * 4.30265 * math.sqrt(0.005), 20.0 + 100 * 4.30265 * math.sqrt(0.005)], abs=0.01
  )
  assert math.isnan(noise["gain_kept"])  # the reference mean 0.45 gained nothing over 0.45
  assert (
    "| noise | grpo | 2 | 25.0 ± 7.1 % | +20.0 [-10.4, 50.4] |"
    in opd_vs_rl_report.summary_table([ref, noise])
  )


def test_at_equal_mismatch_interpolates_over_the_ladder_without_extrapolating():
  cells = [
    {
      "method": "opd",
      "setting": "reference",
      "mismatch_kl_mean": 1e-9,
      "drop_points": 0.0,
      "gain_kept": 1.0,
    },
    {
      "method": "opd",
      "setting": "mid",
      "mismatch_kl_mean": 0.1,
      "drop_points": 4.0,
      "gain_kept": 0.9,
    },
    {
      "method": "opd",
      "setting": "high",
      "mismatch_kl_mean": 0.3,
      "drop_points": 10.0,
      "gain_kept": 0.7,
    },
    {
      "method": "opd",
      "setting": "fp4",
      "mismatch_kl_mean": 0.5,
      "drop_points": 50.0,
      "gain_kept": 0.0,
    },
  ]
  at = {e["kl"]: e for e in opd_vs_rl_report.matched(cells, ["mid", "high"], [0.05, 0.2, 0.4])}
  assert at[0.05]["drop_points"] == pytest.approx(2.0) and at[0.05]["gain_kept"] == pytest.approx(
    0.95
  )
  assert at[0.2]["drop_points"] == pytest.approx(7.0)
  assert math.isnan(at[0.4]["drop_points"])  # beyond the ladder's largest mismatch (0.3)
  table = opd_vs_rl_report.matched_table(list(at.values()))
  assert "| opd | +2.0 / 0.95 | +7.0 / 0.80 | — / — |" in table


def test_blocks_give_the_headline_arms_more_seeds_and_plan_each_run_once():
  config = opd_vs_rl_config.get_config("fair")
  todo = opd_vs_rl.plan(config)
  names = [opd_vs_rl.run_name(m, s, seed) for m, s, _, seed, _ in todo]
  assert len(names) == len(set(names)) == 92
  by_cell: dict = {}
  for m, s, _, seed, _ in todo:
    by_cell.setdefault((m, s), []).append(seed)
  assert by_cell[("grpo_tis", "kv_cache-fp4_kv_granularity-tensor")] == [0, 1, 2, 3, 4]
  assert by_cell[("grpo_seq_mis", "noise_sigma-0.4")] == [0, 1]
  assert (
    by_cell[("opd", "noise_sigma-0.2")] == [0, 1] and ("grpo_mis", "noise_sigma-0.2") not in by_cell
  )
  assert by_cell[("opd", "reference")] == [
    0,
    1,
    2,
    3,
    4,
  ]  # the third block's reference is the first's
  config.blocks = ({"methods": ("opd",), "settings": (), "seed": (0,)},)
  with pytest.raises(ValueError, match=r"blocks\[0\] has unknown keys \['seed'\]"):
    opd_vs_rl.plan(config)


def test_report_sections_come_in_order(tmp_path):
  """Over seeds, then at equal mismatch, then every run; the JSON holds the matched drops."""
  rows = [
    dict(_row("opd", "reference", 0.9), seed=0),
    dict(_row("opd", "reference", 0.8), seed=1),
    dict(_row("opd", "noise", 0.7), seed=0),
    dict(_row("opd", "noise", 0.6), seed=1),
  ]
  meta = {"summary": "s", "matched_settings": ["noise"], "matched_kl": [0.005]}
  report = opd_vs_rl_report.write_report(rows, str(tmp_path), meta, log=lambda *_: None)
  text = (tmp_path / "opd_vs_rl.md").read_text()
  heads = [line for line in text.splitlines() if line.startswith("## ")]
  assert heads == ["## Over seeds", "## At equal training mismatch", "## Every run"]
  assert report["matched"][0]["drop_points"] == pytest.approx(10.0)  # half of 20 at half the KL


def test_fieller_share_by_hand_unbounded_and_undefined():
  """Fieller's set {θ : (a − θb)² ≤ t²(v_a + θ²v_b)} for ref 0.44/0.47/0.45 and cell
  0.38/0.40/0.36 over a warm start of 0.30 (t_{0.975, 2}), its ends found by a grid over θ;
  unbounded when the reference's gain is not told from 0; none for one seed or no spread."""
  lo, hi = stats.fieller_share([0.44, 0.47, 0.45], [0.38, 0.40, 0.36], 0.30)
  assert (lo, hi) == pytest.approx((0.19418, 0.91737), abs=2e-5)
  kept, _ = stats.gain_kept([0.44, 0.47, 0.45], [0.38, 0.40, 0.36], 0.30)
  assert lo < kept < hi
  assert stats.fieller_share([0.30, 0.36], [0.31, 0.33], 0.30) == (-math.inf, math.inf)
  assert all(math.isnan(x) for x in stats.fieller_share([0.5], [0.4, 0.45], 0.3))
  assert all(math.isnan(x) for x in stats.fieller_share([0.5, 0.5], [0.4, 0.4], 0.3))
  # Welch's interval is undefined, not zero-wide, when neither side has any spread.
  assert all(math.isnan(x) for x in stats.welch_interval([0.5, 0.5], [0.4, 0.4]))


def test_a_reference_that_did_not_gain_leaves_every_share_undefined():
  rows = [
    dict(_row("grpo", "reference", 0.455), seed=0),
    dict(_row("grpo", "reference", 0.450), seed=1),
    dict(_row("grpo", "noise", 0.40), seed=0),
    dict(_row("grpo", "noise", 0.35), seed=1),
  ]
  ref, noise = opd_vs_rl_report.summarise(rows)  # warm start 0.45: the reference gained 0.25 pt
  assert math.isnan(ref["gain_kept"]) and math.isnan(noise["gain_kept"])
  assert all(math.isnan(x) for x in ref["drop_ci_points"])
  gained = opd_vs_rl_report.summarise(
    [dict(r, accuracy=r["accuracy"] + 0.2) if r["setting"] == "reference" else r for r in rows]
  )
  assert gained[0]["gain_kept"] == 1.0 and "; [" in opd_vs_rl_report.summary_table(gained)


def test_cells_at_the_same_mismatch_are_matched_without_comparing_dicts():
  cells = [
    {"method": "opd", "setting": "reference", "drop_points": 0.0, "gain_kept": 1.0},
    {"method": "opd", "setting": "a", "mismatch_kl_mean": 0.1, "drop_points": 2.0},
    {"method": "opd", "setting": "b", "mismatch_kl_mean": 0.1, "drop_points": 4.0},
  ]
  at = opd_vs_rl_report.matched(cells, ["a", "b"], [0.05])
  assert len(at) == 1 and math.isfinite(at[0]["drop_points"])


def test_a_resumed_runs_warm_start_is_its_first_logged_accuracy(tmp_path):
  """A resumed run's result holds the accuracy at its resumption as student_accuracy_before;
  the row's warm start is the step-0 accuracy its log holds."""
  lines = [
    {"step": 0, "quality/student_accuracy": 0.55, "quality/student_accuracy_t1": 0.4},
    {"step": 200, "quality/student_accuracy": 0.25, "quality/student_accuracy_t1": 0.2},
    {"step": 400, "quality/student_accuracy": 0.6, "quality/student_accuracy_t1": 0.5},
  ]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  result = {
    "student_accuracy_before": 0.25,
    "student_accuracy_after": 0.6,
    "student_teacher_kl_after": 0.1,
    "teacher_accuracy": 0.95,
    "start_step": 200,
  }
  row = opd_vs_rl.run_row("grpo", "reference", "", str(tmp_path), result)
  assert row["accuracy_before"] == 0.55 and row["accuracy_t1_before"] == 0.4
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 400, "other": 1.0}) + "\n")
  assert (
    opd_vs_rl.run_row("grpo", "reference", "", str(tmp_path), result)["accuracy_before"] == 0.25
  )


def test_fieller_covers_the_share_where_the_fixed_bootstrap_does_not():
  """Simulated normal seeds with a true share of 0.5 (warm start 0.30, reference gain 0.15,
  seed sd 0.02), 200 draws per case: the percentile bootstrap the config fixed covers well
  under 95 % with few seeds, Fieller's interval at least 95 % (conservative ν)."""
  rng = np.random.default_rng(0)
  for n_ref, n_cell in ((5, 5), (2, 2)):
    boot = fieller = 0
    for _ in range(200):
      ref = rng.normal(0.45, 0.02, n_ref)
      cell = rng.normal(0.375, 0.02, n_cell)
      _, (lo, hi) = stats.gain_kept(ref, cell, 0.30)
      boot += lo <= 0.5 <= hi
      lo, hi = stats.fieller_share(ref, cell, 0.30)
      fieller += lo <= 0.5 <= hi
    assert boot / 200 < 0.9 and fieller / 200 >= 0.95, (n_ref, n_cell, boot, fieller)


def test_negative_seeds_are_refused_and_the_default_cache_path_is_absolute(tmp_path, monkeypatch):
  config = opd_vs_rl_config.get_config("tiny")
  config.seeds = (-1,)
  with pytest.raises(ValueError, match="distinct train seeds >= 0"):
    opd_vs_rl.blocks(config)
  config.run.teacher.cache_dir = ""
  monkeypatch.chdir(tmp_path)
  cache = opd_vs_rl.resolved(config, "ovr").run.teacher.cache_dir
  assert cache == os.path.join(str(tmp_path), "ovr", "teacher_cache")
