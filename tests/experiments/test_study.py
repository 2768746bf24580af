"""The mismatch study: its pure pieces by hand, and `configs/study.py:tiny` end to end."""

import json
import math
import os
import subprocess
import sys

import pytest

from opd_jax.experiments import (
  stats,
  study,
  study_probe,
  study_provenance,
  study_rules,
  study_setting,
)
from opd_jax.io import run_history
from opd_jax.mismatch import admission, budget, budget_file, budget_fit
from opd_jax.train import setup as setup_lib
from opd_jax.train.setup import run_spec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "configs"))

import study as study_config  # noqa: E402  (configs/study.py)


def test_noise_floor_by_hand():
  floor = stats.noise_floor([0.90, 0.94, 0.92], num_eval=100)
  assert floor["mean"] == pytest.approx(0.92)
  assert floor["sd"] == pytest.approx(0.02)  # sample sd of (-0.02, 0.02, 0)
  assert floor["se"] == pytest.approx(math.sqrt(0.92 * 0.08 / 100))  # 0.0271
  assert floor["tolerance"] == pytest.approx(2 * math.sqrt(0.92 * 0.08 / 100))
  one = stats.noise_floor([0.5], num_eval=10_000)
  assert one["sd"] == 0.0 and one["tolerance"] == pytest.approx(2 * 0.005)


def test_confusion_counts_and_agreement():
  rows = [
    {"quality_drop": 0.00, "admitted": True},  # admitted & kept
    {"quality_drop": 0.05, "admitted": True},  # admitted & degraded
    {"quality_drop": 0.01, "admitted": False},  # refused & kept
    {"quality_drop": 0.30, "admitted": False},  # refused & degraded
    {"quality_drop": 0.02, "admitted": True},  # kept: equal to the tolerance
  ]
  c = stats.confusion(rows, tolerance=0.02)
  assert (c["admitted_kept"], c["admitted_degraded"]) == (2, 1)
  assert (c["refused_kept"], c["refused_degraded"]) == (1, 1)
  assert c["n"] == 5 and c["agreement"] == pytest.approx(3 / 5)


def test_spearman_by_hand():
  assert stats.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert stats.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  # ranks x (1,2,3), y (1,3,2): 1 - 6*(0+1+1)/(3*8) = 0.5
  assert stats.spearman([1, 2, 3], [5, 9, 7]) == pytest.approx(0.5)
  assert math.isnan(stats.spearman([1, 2], [1, 2]))


ROUND3_HELD_OUT = (  # configs/study.py's draw as committed in 7de44e6, "rollout." left out
  "weights=fp8,rollout.weight_block_size=32,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,"
  "rollout.kernel=bf16_attention",
  "weights=fp8,rollout.weight_block_size=64,rollout.kv_cache=fp8,"
  "rollout.kv_granularity=token_head,rollout.kernel=bf16_matmul",
  "weights=fp8,rollout.weight_block_size=32,rollout.kernel=bf16_matmul,rollout.stale_k=3",
  "weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=token_head,rollout.stale_k=6,"
  "rollout.noise_sigma=0.4",
  "weights=fp8,rollout.weight_block_size=64,rollout.kernel=bf16_attention,rollout.noise_sigma=0.11",
  "weights=fp8,rollout.weight_block_size=64,rollout.kv_cache=fp8,"
  "rollout.kv_granularity=token_head,rollout.stale_k=4",
  "kernel=bf16_attention,rollout.stale_k=4",
  "weights=fp8,rollout.weight_block_size=32,rollout.kv_cache=fp8,rollout.kv_granularity=tensor",
  "kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kernel=bf16_matmul,rollout.stale_k=5",
  "weights=fp8,rollout.stale_k=2,rollout.noise_sigma=0.33",
  "noise_sigma=0.06",
  "kv_cache=fp8,rollout.kv_granularity=token_head,rollout.kernel=bf16_attention,"
  "rollout.mode=async,rollout.max_lag=2,rollout.noise_sigma=0.43",
)


ROUND4_HELD_OUT = (  # configs/study.py's round-4 draw as committed before it trained
  "weights=fp8,rollout.noise_sigma=0.11",
  "stale_k=4,rollout.noise_sigma=0.21",
  "weights=fp8,rollout.noise_sigma=0.24",
  "weights=fp8,rollout.weight_block_size=64",
  "stale_k=7,rollout.noise_sigma=0.15",
  "weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kernel=bf16_attention,"
  "rollout.noise_sigma=0.18",
  "weights=fp8,rollout.kernel=bf16_matmul,rollout.stale_k=3",
  "kv_cache=fp8,rollout.kv_granularity=token_head,rollout.stale_k=7",
  "mode=async,rollout.max_lag=1,rollout.noise_sigma=0.08",
  "weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kernel=bf16_attention,"
  "rollout.stale_k=1,rollout.noise_sigma=0.16",
  "kv_cache=fp8,rollout.kv_granularity=tensor,rollout.noise_sigma=0.21",
  "weights=fp8,rollout.weight_block_size=64,rollout.kernel=bf16_matmul,rollout.stale_k=3",
)


def test_settings_names_and_sources():
  config = study_config.get_config("rounds")
  settings = study_setting.study_settings(config)
  by_spec = {s.spec: s for s in settings if s.role != "reference"}
  assert [s.seed for s in settings if s.role == "reference"] == list(config.seeds)
  assert by_spec["rollout.noise_sigma=0.2,rollout.stale_k=2"].source == "noise+stale"
  assert by_spec["rollout.noise_sigma=0.2,rollout.stale_k=2"].name == "noise_sigma-0.2_stale_k-2"
  assert by_spec["rollout.kv_cache=fp8,rollout.kv_granularity=tensor"].source == "fp8_kv"
  assert by_spec["rollout.kernel=bf16_matmul"].role == "calibration"
  async_fp8 = next(s for s in by_spec.values() if "mode=async" in s.spec)
  assert async_fp8.source == "stale+fp8_weights+fp8_kv"  # lag 1 is the default max_lag
  assert by_spec["rollout.stale_k=6"].role == "calibration"  # held out in round 1
  assert by_spec["rollout.stale_k=7"].role == "calibration"  # held out in round 2
  # Each round's held-out settings are the seeded draw committed before they trained (pinned
  # here, so that a change to the draw cannot silently change a held-out set), and none
  # restates a calibration setting. Round 3's (drawn against the 42 settings before it) are
  # calibration since round 4.
  held = [s.spec for s in settings if s.role == "held_out"]
  assert held == [f"rollout.{spec}" for spec in ROUND4_HELD_OUT]
  round3 = [f"rollout.{spec}" for spec in ROUND3_HELD_OUT]
  assert list(config.calibration[42:]) == round3
  draw = study_config.draw_held_out
  assert list(draw(study_config.ROUND3_SEED, exclude=config.calibration[:42])) == round3
  assert held != list(draw(1, exclude=config.calibration))
  seen = {study_config._canonical(spec) for spec in config.calibration}
  assert not seen & {study_config._canonical(spec) for spec in held}
  canonical = study_config._canonical
  assert canonical("rollout.kv_cache=fp8") == canonical(
    "rollout.kv_cache=fp8,rollout.kv_granularity=token_head"
  )
  assert canonical("rollout.mode=async") == canonical("rollout.mode=async,rollout.max_lag=1")
  assert len({s.name for s in settings}) == len(settings)


ROUND5_HELD_OUT = (  # configs/study.py's round-5 draw (the default) as committed before it trained
  "weights=fp8,rollout.weight_block_size=64,rollout.noise_sigma=0.41",
  "mode=async,rollout.max_lag=1",
  "weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=token_head,rollout.stale_k=2",
  "weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=token_head,rollout.stale_k=7,"
  "rollout.noise_sigma=0.45",
  "kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kernel=bf16_matmul,rollout.noise_sigma=0.22",
  "noise_sigma=0.34",
  "weights=fp8,rollout.weight_block_size=32,rollout.kernel=bf16_matmul",
  "weights=fp8,rollout.weight_block_size=64,rollout.kv_cache=fp8,rollout.kv_granularity=token_head,"
  "rollout.stale_k=1,rollout.noise_sigma=0.07",
  "kv_cache=fp8,rollout.kv_granularity=token_head,rollout.kernel=bf16_attention",
  "kv_cache=fp8,rollout.kv_granularity=tensor,rollout.stale_k=3",
  "kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kernel=bf16_matmul,rollout.noise_sigma=0.19",
  "kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kernel=bf16_attention",
)


ROUND6_HELD_OUT = (  # configs/study.py's round-6 draw (`:round6`) as committed before it trained
  "weights=fp8,rollout.weight_block_size=32,rollout.stale_k=7,rollout.noise_sigma=0.26",
  "weights=fp8,rollout.noise_sigma=0.3",
  "weights=fp8,rollout.weight_block_size=64,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,"
  "rollout.stale_k=5,rollout.noise_sigma=0.05",
  "weights=fp8,rollout.weight_block_size=64,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,"
  "rollout.stale_k=3,rollout.noise_sigma=0.29",
  "weights=fp8,rollout.weight_block_size=64,rollout.stale_k=7,rollout.noise_sigma=0.15",
  "mode=async,rollout.max_lag=1,rollout.noise_sigma=0.35",
  "weights=fp8,rollout.weight_block_size=32,rollout.stale_k=8,rollout.noise_sigma=0.43",
  "kv_cache=fp8,rollout.kv_granularity=token_head,rollout.mode=async,rollout.max_lag=1",
  "weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=token_head,"
  "rollout.kernel=bf16_attention",
  "weights=fp8,rollout.weight_block_size=32,rollout.kv_cache=fp8,"
  "rollout.kv_granularity=token_head,rollout.noise_sigma=0.14",
  "noise_sigma=0.37",
  "noise_sigma=0.43",
)


ROUND7_HELD_OUT = (  # configs/study.py's round-7 draw (the default) as committed before it trained
  "stale_k=4,rollout.noise_sigma=0.42",
  "kv_cache=fp8,rollout.kv_granularity=token_head,rollout.kernel=bf16_matmul,rollout.stale_k=4,"
  "rollout.noise_sigma=0.3",
  "mode=async,rollout.max_lag=2",
  "weights=fp8,rollout.weight_block_size=32,rollout.kv_cache=fp8,rollout.kv_granularity=token_head,"
  "rollout.kernel=bf16_matmul",
  "weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor",
  "weights=fp8,rollout.kernel=bf16_attention,rollout.stale_k=3",
  "weights=fp8,rollout.weight_block_size=32,rollout.noise_sigma=0.13",
  "kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kernel=bf16_matmul,rollout.mode=async,"
  "rollout.max_lag=1",
  "kernel=bf16_attention,rollout.stale_k=8,rollout.noise_sigma=0.39",
  "weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kernel=bf16_matmul,"
  "rollout.noise_sigma=0.37",
  "weights=fp8,rollout.kernel=bf16_matmul",
  "weights=fp8,rollout.weight_block_size=32,rollout.kv_cache=fp8,"
  "rollout.kv_granularity=token_head,rollout.noise_sigma=0.31",
)


def test_default_is_one_round_on_the_grid():
  """The default study (round 7) calibrates on the grid alone and holds out a draw that no
  earlier round used; its run count is what the 90-minute budget is sized for. `:round6` and
  `:round5` are those rounds as they ran: the same grid, each its own draw and rule (round 6:
  two crossing records per source limit, whole-combination KL; round 5: one crossing record)."""
  config, rounds = study_config.get_config(), study_config.get_config("rounds")
  round5, round6 = study_config.get_config("round5"), study_config.get_config("round6")
  assert config.calibration == round5.calibration == study_config.GRID == rounds.calibration[:15]
  assert round6.calibration == study_config.GRID
  assert list(config.held_out) == [f"rollout.{spec}" for spec in ROUND7_HELD_OUT]
  assert list(round6.held_out) == [f"rollout.{spec}" for spec in ROUND6_HELD_OUT]
  assert list(round5.held_out) == [f"rollout.{spec}" for spec in ROUND5_HELD_OUT]
  assert [c.min_crossing_records for c in (config, round6, round5, rounds)] == [2, 2, 1, 1]
  assert [c.per_part for c in (config, round6, round5, rounds)] == [True, False, False, False]
  canonical = study_config._canonical
  earlier = {
    canonical(spec)
    for spec in (*rounds.calibration, *rounds.held_out, *round5.held_out, *round6.held_out)
  }
  assert not earlier & {canonical(spec) for spec in config.held_out}
  assert len(set(config.held_out)) == 12
  seeds = len(config.borderline_seeds)
  assert config.rerun_all_roles == ("held_out",) and config.borderline_roles == ("held_out",)
  assert len(config.seeds) + len(config.calibration) + (1 + seeds) * len(config.held_out) == 44
  # The grid's runs are the same runs in both studies (same spec, name and training config).
  one_round = {s.name: s for s in study_setting.study_settings(config)}
  shared = [s for s in study_setting.study_settings(rounds) if s.name in one_round]
  assert len(shared) == 5 + 15 and all(one_round[s.name] == s for s in shared)


ROUND8_HELD_OUT = (  # configs/study.py's round-8 draw (`:round8`) as committed before it trained
  "stale_k=2,rollout.noise_sigma=0.13",
  "stale_k=4,rollout.noise_sigma=0.14",
  "stale_k=4,rollout.noise_sigma=0.08",
  "kv_cache=fp8,rollout.kv_granularity=tensor,rollout.stale_k=2,rollout.noise_sigma=0.1",
  "kv_cache=fp8,rollout.kv_granularity=token_head,rollout.stale_k=3,rollout.noise_sigma=0.09",
  "stale_k=8,rollout.noise_sigma=0.13",
)


def test_round8_is_the_per_part_rule_where_it_disagrees_with_the_whole_combination():
  """`:round8` holds out six new noise-plus-staleness combinations (pinned), with round 7's
  calibration and rule; every one has a stale part of k >= 2 and a noise part of σ <= 0.16."""
  config, round8 = study_config.get_config(), study_config.get_config("round8")
  assert list(round8.held_out) == [f"rollout.{spec}" for spec in ROUND8_HELD_OUT]
  assert round8.calibration == config.calibration and round8.per_part and config.per_part
  assert round8.min_crossing_records == config.min_crossing_records == 2
  earlier = {study_config._canonical(s) for s in (*config.calibration, *config.held_out)}
  assert not earlier & {study_config._canonical(s) for s in round8.held_out}
  for spec in round8.held_out:
    overrides = dict(kv.split("=") for kv in spec.split(","))
    assert int(overrides["rollout.stale_k"]) >= 2
    assert 0.05 <= float(overrides["rollout.noise_sigma"]) <= 0.16
  with pytest.raises(ValueError, match="size must be an int >= 0"):
    study_config.draw_per_part_test(0, size=-1)


def test_draw_refuses_a_size_it_cannot_fill(monkeypatch):
  with pytest.raises(ValueError, match="size must be an int >= 0"):
    study_config.draw_held_out(0, size=-1)
  monkeypatch.setattr(study_config, "KNOBS", (((1.0, "rollout.stale_k=1"),),))
  monkeypatch.setattr(study_config, "NOISE", (0.0, 0.0, 0.0))
  assert study_config.draw_held_out(0, size=1) == ("rollout.stale_k=1",)
  with pytest.raises(ValueError, match="1 distinct settings in 2000 draws, not 2"):
    study_config.draw_held_out(0, size=2)


def test_settings_refuse_duplicates_and_bad_specs():
  config = study_config.get_config("tiny")
  config.held_out = (config.calibration[0],)
  with pytest.raises(ValueError, match="listed twice"):
    study_setting.study_settings(config)
  config = study_config.get_config("tiny")
  config.calibration = ("rollout.noise_sigmaa=0.1",)
  with pytest.raises(ValueError, match="did you mean 'rollout.noise_sigma'"):
    study_setting.study_settings(config)


def test_borderline_is_within_one_sd_of_the_tolerance_and_seeds_are_checked(tmp_path):
  assert study.is_borderline(0.069, 0.0586, 0.0293)  # |d − τ| = 0.010 < sd
  assert not study.is_borderline(0.0, 0.0586, 0.0293)  # 0.059 away: clearly kept
  assert not study.is_borderline(0.24, 0.0586, 0.0293)  # clearly degraded
  config = study_config.get_config("tiny")
  config.borderline_seeds = (config.seeds[0],)
  with pytest.raises(ValueError, match="exclude the held-out runs' seed"):
    study.label_runs(config, [], [], 0.1, {"sd": 0.1, "se": 0.0, "mean": 0.5}, str(tmp_path))
  config = study_config.get_config("tiny")
  config.borderline_roles = ("held_out", "calibraton")
  with pytest.raises(ValueError, match=r"borderline_roles has \['calibraton'\]"):
    study.label_runs(config, [], [], 0.1, {"sd": 0.1, "se": 0.0, "mean": 0.5}, str(tmp_path))
  config = study_config.get_config("tiny")
  config.rerun_all_roles = ("reference",)
  with pytest.raises(ValueError, match=r"rerun_all_roles has \['reference'\]"):
    study.label_runs(config, [], [], 0.1, {"sd": 0.1, "se": 0.0, "mean": 0.5}, str(tmp_path))


def test_training_axis_records_swap_the_x_axis_and_skip_runs_without_one():
  records = [
    {"source": "reference", "mismatch/kl": 1e-8, "quality_drop": 0.0, study.TRAIN_KL: -1e-9},
    {"source": "noise", "mismatch/kl": 0.3, "quality_drop": 0.1, study.TRAIN_KL: 0.12},
    {"source": "stale", "mismatch/kl": 0.2, "quality_drop": 0.0},  # logged no training KL
  ]
  out = study.training_axis_records(records)
  assert [(r["source"], r["mismatch/kl"], r["check/mismatch/kl"]) for r in out] == [
    ("reference", 0.0, 1e-8),  # f32 rounding below 0 is clipped
    ("noise", 0.12, 0.3),
  ]
  assert records[1]["mismatch/kl"] == 0.3  # the input is not modified


def test_probe_must_cover_the_largest_lag(tmp_path):
  config = study_config.get_config("tiny")
  config.calibration = ("rollout.stale_k=4",)
  with pytest.raises(ValueError, match="raise config.probe_steps"):
    study_probe.probe_config(config, study_setting.study_settings(config), str(tmp_path))


@pytest.mark.slow
def test_tiny_study_end_to_end_and_resume(tmp_path):
  """`python -m opd_jax.study --config=configs/study.py:tiny` writes every output; a second
  invocation trains nothing again."""
  workdir = tmp_path / "study"
  cmd = [
    sys.executable,
    "-m",
    "opd_jax.study",
    f"--config={os.path.join(REPO, 'configs', 'study.py')}:tiny",
    f"--workdir={workdir}",
  ]
  first = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1200)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  for name in (
    "study.json",
    "report.md",
    "budget.json",
    "measurements.json",
    "quality_vs_mismatch.png",
    "training_curves.png",
    "check_vs_training.png",
  ):
    assert (workdir / name).exists(), name
  assert any((workdir / "jax_cache").iterdir())  # compiled programs kept for the runs after
  result = json.loads((workdir / "study.json").read_text())
  config = study_config.get_config("tiny")
  names = {r["name"] for r in result["rows"]}
  assert len(result["rows"]) == len(config.seeds) + len(config.calibration) + len(config.held_out)
  assert {"reference_seed0", "reference_seed1", "noise_sigma-0.5", "stale_k-1"} <= names
  assert result["confusion"]["n"] == len(config.held_out)
  assert config.min_crossing_records == result["min_crossing_records"] == 2
  assert sorted(result["rule_variants"]) == sorted([*study_rules.RULES, "whole_min_crossing_1"])
  assert result["rule"]["name"] == "per_part"  # the configured rule, fixed before the runs
  assert result["rule_variants"]["per_part"] == result["confusion"]
  held_pooled = [{**r, "admitted": r["admitted_pooled"]} for r in result["rows"]]
  held_pooled = [r for r in held_pooled if r["role"] == "held_out"]
  assert result["rule_variants"]["pooled"] == stats.confusion(
    held_pooled, result["tolerance"], "label_drop"
  )
  held_rows = [r for r in result["rows"] if r["role"] == "held_out"]
  called = [r for r in held_rows if not r["too_close"]]
  expected = stats.confusion(called, result["tolerance"], "label_drop")
  assert json.dumps(result["confusion_called"], sort_keys=True) == json.dumps(  # NaN == NaN
    expected, sort_keys=True
  )
  scores = result["held_out_scores"]  # one held-out setting: both readings and the band
  assert scores["too_close"]["n"] == 1 and scores["outside_band"]["n"] <= 1
  assert scores["too_close"]["readings"]["as_called"]["n"] == result["confusion"]["n"]
  assert "outside ±2 SE of τ" in (workdir / "report.md").read_text()
  for r in result["rows"]:
    assert math.isfinite(r["mismatch/kl"]) and 0.0 <= r["accuracy"] <= 1.0
    # noise σ 0.2 reads below the calibrated σ 0.5 (the fits are anchored at 0), and stale
    # k = 1 is the calibrated setting itself: nothing is extrapolated
    assert r["extrapolation"] is None and r["probe_seed"] == config.seeds[0]
    lower, upper = r["limit_band"]
    assert r["too_close"] == (lower < r["mismatch/kl"] <= upper)
  # a combination's parts are measured alone, as the per-part rule reads them
  measurements = json.loads((workdir / "measurements.json").read_text())["measurements"]
  (combo,) = held_rows
  assert combo["source"] == "noise+stale"
  for source, spec in (("noise", "rollout.noise_sigma=0.2"), ("stale", "rollout.stale_k=1")):
    assert combo[f"mismatch/kl/part/{source}"] == measurements[spec]["mismatch/kl"]
  (stale,) = [r for r in result["rows"] if r["name"] == "stale_k-1"]  # measured once
  assert combo["mismatch/kl/part/stale"] == stale["mismatch/kl"]
  reference_kl = [r["mismatch/kl"] for r in result["rows"] if r["role"] == "reference"]
  noisy_kl = [r["mismatch/kl"] for r in result["rows"] if r["name"] == "noise_sigma-0.5"]
  assert max(abs(k) for k in reference_kl) < 1e-6 < noisy_kl[0]  # an exact engine reads ~0
  saved, fingerprint = budget_file.load_budget(str(workdir / "budget.json"))
  assert saved.max_kl == pytest.approx(result["budget"]["max_kl"])
  # the budget records the rule the study validated, with its held-out result
  assert budget_file.rule_dict(saved.rule) == result["rule"]
  assert saved.rule.validation == {
    **result["confusion"],
    "tolerance": result["tolerance"],
    "label": "a held-out setting kept quality iff its mean drop over its runs <= tolerance",
  }
  # every run's wall time counts, the re-runs' too
  assert result["num_runs"] == sum(len(r["accuracy_runs"]) for r in result["rows"])
  assert result["train_seconds"] == pytest.approx(
    sum(sum(r["wall_seconds_runs"]) for r in result["rows"])
  )
  # the training-axis fit: the same runs at their training-time mean mismatch/kl
  assert saved.training is not None
  assert saved.training.max_kl == pytest.approx(result["budget"]["training"]["max_kl"])
  by_name = {r["name"]: r for r in result["rows"]}
  for record in saved.training.records:
    row = by_name[record["name"]]
    assert record["check/mismatch/kl"] == row["mismatch/kl"]
    assert record["mismatch/kl"] == max(row["train_kl_runs"][record["run"]], 0.0)
  assert fingerprint["student"]["weights_sha256"]
  # ... and records the student every run started from, which a guarded run compares with
  run_cfg = study_setting.run_config(config, study_setting.study_settings(config)[0], str(workdir))
  setup = setup_lib.prepare_models(run_spec(run_cfg), str(tmp_path / "fp"), lambda *a: None)
  start = admission.initial_student(run_cfg, setup, lambda *a: None, setup.cache_dir)
  assert fingerprint["student"][budget_file.RUN_START_KEY] == budget_file.weights_sha256(start)
  assert (
    fingerprint["student"][budget_file.RUN_START_KEY] != fingerprint["student"]["weights_sha256"]
  )
  # the budget is tied to the probe's student: the admission check finds it fresh there
  assert run_history.checkpoint_steps(str(workdir / "runs" / "probe"))[-1] == config.probe_steps

  # Provenance: every part records the code that made it, all one version here, and the
  # budget the code that fitted it.
  assert result["provenance"]["git_sha"] and len(result["provenance"]["config_sha256"]) == 64
  assert result["code"]["mixed"] is False and len(result["code"]["versions"]) == 1
  (version,) = result["code"]["versions"]
  assert "probe" in version["parts"] and "run reference_seed0" in version["parts"]
  assert saved.code_provenance == result["provenance"]
  made_by = json.loads((workdir / "measurements.json").read_text())["provenance"]
  assert set(made_by) == set(measurements)
  assert saved.probe_seeds == (config.seeds[0],) and saved.probe_spread == {}

  mtimes = {p: p.stat().st_mtime for p in (workdir / "runs").glob("*/result.json")}
  second = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1200)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  assert "OPD step" not in second.stdout and "done: {" not in second.stdout  # nothing retrained
  assert {p: p.stat().st_mtime for p in mtimes} == mtimes
  again = json.loads((workdir / "study.json").read_text())
  assert [r["accuracy"] for r in again["rows"]] == [r["accuracy"] for r in result["rows"]]

  # A run made by other code (another commit) makes a mixed study: refused before anything
  # runs, naming both versions; --config.allow_mixed_code=true goes on and reports it.
  other = workdir / "runs" / "stale_k-1" / "result.json"
  original = other.read_text()
  run = json.loads(original)
  run["provenance"] = {**run["provenance"], "git_sha": "0" * 40, "dirty": False}
  other.write_text(json.dumps(run))
  mixed = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1200)
  assert mixed.returncode != 0 and "made by 2 versions of the code" in mixed.stderr
  assert "commit 000000000000: 1 part(s): run stale_k-1" in mixed.stderr
  assert "--config.allow_mixed_code=true" in mixed.stderr
  config.allow_mixed_code = True
  dirs = study_provenance.run_dirs(
    str(workdir), [s.name for s in study_setting.study_settings(config)], []
  )
  code = study_provenance.study_code(
    config, str(workdir / "measurements.json"), str(workdir / "runs" / "probe"), dirs, print
  )["code"]
  assert code["mixed"] and code["allow_mixed_code"] and len(code["versions"]) == 2
  other.write_text(original)

  # A run whose drop is within one seed-sd of τ is trained again with the borderline seeds
  # (the floor is set so that one held-out and one calibration setting are borderline and no
  # other is): the held-out one is labelled by the mean of its runs, and the calibration one
  # gives the budget one record per run.
  settings = study_setting.study_settings(config)
  assert "calibration" in config.borderline_roles
  rows = [{**r, budget.DROP_KEY: 1.0} for r in result["rows"]]
  held = next(i for i, st in enumerate(settings) if st.role == "held_out")
  cal = next(i for i, st in enumerate(settings) if st.role == "calibration")
  floor = {"mean": rows[held]["accuracy"] + 0.1, "sd": 0.05, "se": 0.01}
  rows[held][budget.DROP_KEY] = rows[cal][budget.DROP_KEY] = 0.1
  study.label_runs(config, settings, rows, 0.1, floor, str(workdir), lambda *a: None)
  for i in (held, cal):
    runs_q = rows[i]["accuracy_runs"]
    assert len(runs_q) == 1 + len(config.borderline_seeds)
    assert rows[i]["label_drop"] == pytest.approx(floor["mean"] - sum(runs_q) / len(runs_q))
    for seed in config.borderline_seeds:
      assert (workdir / "runs" / f"{settings[i].name}_seed{seed}" / "result.json").exists()
  assert all(len(r["accuracy_runs"]) == 1 for i, r in enumerate(rows) if i not in (held, cal))
  # rerun_all_roles: a held-out setting far from τ is trained again too (its runs are the ones
  # above, so nothing trains here), and a calibration one outside borderline_roles is not.
  config.rerun_all_roles, config.borderline_roles = ("held_out",), ()
  clear = [{**r, budget.DROP_KEY: 0.5} for r in result["rows"]]
  study.label_runs(config, settings, clear, 0.1, floor, str(workdir), lambda *a: None)
  assert clear[held]["accuracy_runs"] == rows[held]["accuracy_runs"]
  assert [len(r["accuracy_runs"]) for r in clear] == [
    3 if st.role == "held_out" else 1 for st in settings
  ]
  records = study.budget_records(rows, floor["mean"])
  mine = [r for r in records if r["name"] == settings[cal].name]
  assert [r["run"] for r in mine] == [0, 1, 2]
  assert [r[budget.DROP_KEY] for r in mine] == pytest.approx(
    [floor["mean"] - q for q in rows[cal]["accuracy_runs"]]
  )
  assert not any(r["name"] == settings[held].name for r in records)  # held out: never fitted
  assert len(records) == len(config.seeds) + len(config.calibration) + 2


def test_the_study_rule_is_the_configs():
  assert study_rules.study_rule(study_config.get_config()) == budget.Rule("per_part")
  assert study_rules.study_rule(study_config.get_config("round6")) == budget.Rule("whole")
  assert study_rules.study_rule({"per_source": False}) == budget.Rule("pooled")
  named = study_config.get_config()
  named.rule = "sum_of_fractions"
  assert study_rules.study_rule(named) == budget.Rule("sum_of_fractions")
  named.rule = "per_parts"
  with pytest.raises(ValueError, match="unknown admission rule 'per_parts'; known: pooled"):
    study_rules.study_rule(named)


def test_study_verdicts_go_through_the_checks_path_with_the_parts_measured():
  """`study_rules.verdicts` judges a row as the admission check does: per_part reads the parts the
  study measured; a row without them is refused, not judged on its whole."""
  config = study_config.get_config()
  records = [
    {"source": "reference", "mismatch/kl": 0.0, "quality_drop": 0.0},
    {"source": "noise", "mismatch/kl": 0.1, "quality_drop": 0.0},
    {"source": "noise", "mismatch/kl": 0.2, "quality_drop": 1.0},
    {"source": "stale", "mismatch/kl": 0.1, "quality_drop": 0.0},
    {"source": "stale", "mismatch/kl": 0.3, "quality_drop": 0.2},
  ]
  fitted = budget_fit.fit_budget(records, 0.5, num_bootstrap=20)
  row = {
    "spec": "rollout.noise_sigma=0.1,rollout.stale_k=2",
    "mismatch/kl": 0.25,
    "mismatch/kl/part/noise": 0.1,
    "mismatch/kl/part/stale": 0.2,
  }
  (per_part,) = study_rules.verdicts([row], config, fitted, budget.Rule("per_part"))
  (whole,) = study_rules.verdicts([row], config, fitted, budget.Rule("whole"))
  assert (per_part.admitted, per_part.limit_source, per_part.measured_kl) == (True, "noise", 0.1)
  assert not whole.admitted and whole.measured_kl == 0.25
  unmeasured = {k: v for k, v in row.items() if k != "mismatch/kl/part/stale"}
  with pytest.raises(ValueError, match="needs its stale part"):
    study_rules.verdicts([unmeasured], config, fitted, budget.Rule("per_part"))


def test_bad_workers_are_refused_before_anything_trains(tmp_path):
  config = study_config.get_config("tiny")
  config.workers = 0
  with pytest.raises(ValueError, match="workers=0 must be an int >= 1"):
    study.run_study(config, str(tmp_path / "study"), lambda *a: None)
  assert not (tmp_path / "study" / "runs").exists()  # not even the probe


def test_a_setting_without_a_label_is_left_out_not_called_degraded():
  from opd_jax.experiments import baselines

  rows = [
    {"admitted": True, "label_drop": math.nan, "spec": "rollout.noise_sigma=0.3"},
    {"admitted": True, "label_drop": 0.01},
    {"admitted": False, "label_drop": 0.2},
  ]
  c = stats.confusion(rows, 0.05, "label_drop")
  assert c["n"] == 2 and c["unlabelled"] == 1 and c["agreement"] == 1.0
  assert "unlabelled" not in stats.confusion(rows[1:], 0.05, "label_drop")
  with pytest.raises(ValueError, match="'rollout.noise_sigma=0.3' has no label"):
    baselines.kept(rows[0], 0.05)
