"""`experiments.validation`: the pre-registered scoring of a study's held-out settings against
baselines, checked by hand (Wilson, McNemar, the paired bound, the measure-nothing rule, the
confusion tables), and the one-scale and factorial analyses on hand-made study results."""

import json
import math
import sys
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from opd_jax import validation as validation_command
from opd_jax.experiments import baselines, scoring, stats, validation

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))
import bf16_sync  # noqa: E402
import validation as validation_config  # noqa: E402


def test_wilson_by_hand():
  # 27/30 at 95 %: p = 0.9, z = 1.95996; centre (0.9 + z²/60)/(1 + z²/30), half-width
  # z·sqrt(0.09/30 + z²/3600)/(1 + z²/30).
  z = 1.959963984540054
  centre = (0.9 + z * z / 60) / (1 + z * z / 30)
  half = z * math.sqrt(0.09 / 30 + z * z / 3600) / (1 + z * z / 30)
  lo, hi = stats.wilson(27, 30)
  assert lo == pytest.approx(centre - half, abs=1e-12)
  assert hi == pytest.approx(centre + half, abs=1e-12)
  assert lo == pytest.approx(0.7438, abs=1e-4) and hi == pytest.approx(0.9654, abs=1e-4)
  assert stats.wilson(0, 10)[0] == pytest.approx(0.0, abs=1e-12)
  assert stats.wilson(10, 10)[1] == pytest.approx(1.0, abs=1e-12)
  assert all(math.isnan(x) for x in stats.wilson(0, 0))


def test_mcnemar_exact_by_hand():
  assert stats.mcnemar_one_sided(5, 0) == pytest.approx(1 / 32)
  assert stats.mcnemar_one_sided(6, 1) == pytest.approx(8 / 128)  # (1 + 7) / 2^7
  assert stats.mcnemar_one_sided(0, 0) == 1.0
  assert stats.mcnemar_one_sided(0, 3) == 1.0


def test_paired_lower_bound_by_hand():
  # b = 6, c = 1, n = 30: Δ = 1/6, var = (7/30 − 1/36)/30, z_0.95 = 1.644854.
  delta = 5 / 30
  var = (7 / 30 - delta**2) / 30
  want = delta - 1.6448536269514722 * math.sqrt(var)
  assert stats.paired_lower_bound(6, 1, 30) == pytest.approx(want, abs=1e-12)
  assert stats.paired_lower_bound(0, 0, 30) == 0.0


def _run_cfg():
  return bf16_sync.get_config("tiny")


def _row(spec, role, source, kl, drop, admitted=True, admitted_pooled=True, acc=(0.6, 0.6)):
  return {
    "name": spec,
    "spec": spec,
    "role": role,
    "source": source,
    "mismatch/kl": kl,
    "label_drop": drop,
    "admitted": admitted,
    "admitted_pooled": admitted_pooled,
    "accuracy_runs": list(acc),
    "teacher_kl_runs": [0.1 + drop, 0.1 + drop],
    "quality_runs": [-(0.1 + drop), -(0.1 + drop)],
  }


def _result():
  rows = [
    _row("rollout.weights=trainer", "reference", "reference", 0.0, 0.0, acc=(0.6, 0.62)),
    _row("rollout.noise_sigma=0.2", "calibration", "noise", 0.05, 0.001),
    _row("rollout.noise_sigma=0.4", "calibration", "noise", 0.3, 0.05, acc=(0.5, 0.5)),
    _row("rollout.noise_sigma=0.8", "calibration", "noise", 2.0, 0.9, acc=(0.05, 0.05)),
    _row("rollout.stale_k=16", "calibration", "stale", 0.25, 0.0),
    _row("rollout.stale_k=64", "calibration", "stale", 0.5, 0.02, acc=(0.55, 0.55)),
    _row("rollout.weights=int4", "calibration", "int4_weights", 0.01, 0.0),
    # held out: (spec, kl, drop, rule, pooled)
    _row("rollout.noise_sigma=0.3", "held_out", "noise", 0.15, 0.03, False, True),
    _row("rollout.noise_sigma=0.1", "held_out", "noise", 0.01, 0.0, True, True),
    _row("rollout.stale_k=8", "held_out", "stale", 0.2, 0.0, True, True),
    _row("rollout.stale_k=64,rollout.weights=fp8", "held_out", "stale+fp8_weights", 0.6, 0.0),
    _row("rollout.noise_sigma=0.5", "held_out", "noise", 0.5, 0.2, False, False),
  ]
  return {
    "rows": rows,
    "tolerance": 0.01,
    "label": "teacher_kl",
    "num_eval": 256,
    "noise_floor": {"mean": -0.1},
  }


def _config():
  c = ml_collections.ConfigDict()
  c.run = _run_cfg()
  c.analysis = ml_collections.ConfigDict(validation_config.ANALYSIS)
  return c


def test_measure_nothing_thresholds_from_lone_calibration_labels():
  result = _result()
  t = baselines.nothing_thresholds(result["rows"], result["tolerance"], _run_cfg())
  # noise lost quality from σ 0.4; stale from k 64; int4 kept it.
  assert t == {"sigma": 0.4, "lag": 64, "formats": []}
  run = _run_cfg()
  assert baselines.nothing_admits("rollout.noise_sigma=0.39", t, run)
  assert not baselines.nothing_admits("rollout.noise_sigma=0.4", t, run)
  assert not baselines.nothing_admits("rollout.stale_k=64,rollout.weights=int4", t, run)
  assert baselines.nothing_admits("rollout.stale_k=63,rollout.weights=int4", t, run)


def test_validate_counts_every_table_by_hand():
  out = validation.validate(_result(), _config())
  assert out["n"] == 5 and out["degraded"] == 2  # σ 0.3 (0.03) and σ 0.5 (0.2) over τ 0.01
  block = out["primary_label"]
  rule = block["sum_of_fractions"]
  # kept: σ0.1, k8, k64+fp8 admitted -> 3 admitted_kept; degraded σ0.3, σ0.5 refused.
  assert (rule["admitted_kept"], rule["refused_degraded"], rule["agreement"]) == (3, 2, 1.0)
  pooled = block["pooled"]  # admits σ 0.3 wrongly
  assert (pooled["admitted_degraded"], pooled["agreement"]) == (1, 0.8)
  assert block["admit_all"]["agreement"] == pytest.approx(0.6)
  # measure-nothing: σ* 0.4, k* 64: refuses σ 0.5 (right) and k 64 + fp8 (wrong), admits σ 0.3
  # (wrong): 2/5 wrong.
  assert block["measure_nothing"]["agreement"] == pytest.approx(0.6)
  t = block["tests"]["admit_all"]
  assert (t["rule_only_right"], t["other_only_right"]) == (2, 0)
  assert t["mcnemar_p"] == pytest.approx(0.25)
  assert block["tests"]["pooled"]["difference"] == pytest.approx(0.2)
  assert block["goal_met"] and not block["beats"]["admit_all"] and block["noninferior"]
  assert rule["interval"] == pytest.approx(list(stats.wilson(5, 5)))
  assert [s["kept"] for s in out["settings"]] == [False, True, True, True, False]


def test_too_close_readings_by_hand():
  admitted = [True, True, False, False, True]
  close = [False, True, True, False, False]
  labels = [True, False, True, False, False]
  assert scoring.read_too_close(admitted, close, "admit") == [True, True, True, False, True]
  assert scoring.read_too_close(admitted, close, "refuse") == [True, False, False, False, True]
  assert scoring.read_too_close(admitted, close, "apart") == [True, None, None, False, True]
  out = scoring.too_close_readings(admitted, close, labels)
  assert (out["too_close"], out["n"], out["share"]) == (2, 5, 0.4)
  r = out["readings"]
  # as called: right on rows 0 and 3; admitted: 0, 2, 3; refused: 0, 1, 3; apart: rows 0,
  # 3 right and 4 wrong of the three the check calls.
  assert [r[k]["agreement"] for k in scoring.TOO_CLOSE_READINGS] == pytest.approx(
    [0.4, 0.6, 0.6, 2 / 3]
  )
  assert r["apart"]["n"] == 3 and r["apart"]["interval"] == pytest.approx(stats.wilson(2, 3))
  assert r["admit"]["interval"] == pytest.approx(stats.wilson(3, 5))
  with pytest.raises(ValueError, match="not one of"):
    scoring.read_too_close(admitted, close, "abstain")


def _close_result():
  """_result with σ 0.3 and σ 0.1 too close to call, and σ 0.3's two runs apart (KL 0.11 and
  0.15: d = 0.03, s = 0.028284, SE = s/√2 = 0.02 with the reference's sd 0, so
  |d − τ| = 0.02 ≤ 2·SE: within the band); every other label has SE 0 and lies outside."""
  result = _result()
  for r in result["rows"]:
    r["too_close"] = r["spec"] in ("rollout.noise_sigma=0.3", "rollout.noise_sigma=0.1")
    if r["spec"] == "rollout.noise_sigma=0.3":
      r["teacher_kl_runs"] = [0.11, 0.15]
  return result


def test_validate_scores_outside_the_band_and_each_reading_of_too_close():
  out = validation.validate(_close_result(), _config())
  block = out["primary_label"]
  assert out["too_close_reading"] == "as_called" and block["sum_of_fractions"]["agreement"] == 1
  band = block["outside_band"]
  assert (band["n"], band["within"], band["share_within"]) == (4, 1, 0.2)
  # without σ 0.3 (pooled's one miss): pooled 4/4, admit-all 3/4 (σ 0.5), measure-nothing
  # 3/4 (refuses k 64 + fp8).
  got = {k: (s["admitted_kept"] + s["refused_degraded"], s["n"]) for k, s in band["scores"].items()}
  assert got == {
    "sum_of_fractions": (4, 4),
    "pooled": (4, 4),
    "admit_all": (3, 4),
    "measure_nothing": (3, 4),
  }
  assert band["scores"]["admit_all"]["interval"] == pytest.approx(stats.wilson(3, 4))
  t = block["too_close"]
  assert (t["too_close"], t["share"]) == (2, 0.4)
  # σ 0.3 degraded and σ 0.1 kept: admitting both misses σ 0.3, refusing both misses σ 0.1.
  assert [t["readings"][k]["agreement"] for k in scoring.TOO_CLOSE_READINGS] == pytest.approx(
    [1.0, 0.8, 0.8, 1.0]
  )
  assert out["accuracy_label"]["too_close"]["n"] == 5


@pytest.mark.parametrize("reading", ["refuse", "apart"])
def test_the_configured_reading_of_too_close_is_the_primarys(reading):
  config = _config()
  config.analysis.too_close = reading
  out = validation.validate(_close_result(), config)
  rule = out["primary_label"]["sum_of_fractions"]
  if reading == "refuse":  # σ 0.1 (kept) now refused
    assert (out["n"], rule["refused_kept"], rule["agreement"]) == (5, 1, 0.8)
  else:  # σ 0.1 and σ 0.3 scored apart: k 8, k 64 + fp8 and σ 0.5 remain
    assert (out["n"], out["degraded"], rule["agreement"]) == (3, 1, 1.0)
    assert out["primary_label"]["admit_all"]["agreement"] == pytest.approx(2 / 3)
  assert out["primary_label"]["too_close"]["readings"]["refuse"]["agreement"] == 0.8
  text = _validation_markdown(out)
  assert f"| {reading} (fixed) |" in text


def _validation_markdown(validated):
  from opd_jax.experiments import study_report

  return study_report.validation_markdown(
    {"validation": validated, "primary": "sum_of_fractions", "one_scale": {}, "factorial": []}
  )


def test_round9_agreement_outside_the_band():
  with open(ROOT / "docs" / "study" / "round9" / "study.json") as f:
    result = json.load(f)
  config = validation_config.get_config()
  out = validation.validate(result, config)
  block = out["primary_label"]
  # Round 9's two-run labels: 12 of 30 lie within ±2 SE of τ; outside, the frozen rule and
  # measure-nothing agree on all 18, the pooled rule on 17. No verdict was too close to call.
  assert (block["outside_band"]["n"], block["outside_band"]["within"]) == (18, 12)
  right = {
    k: s["admitted_kept"] + s["refused_degraded"]
    for k, s in block["outside_band"]["scores"].items()
  }
  assert right == {"sum_of_fractions": 18, "pooled": 17, "admit_all": 8, "measure_nothing": 18}
  assert block["too_close"]["too_close"] == 0
  assert {s["agreement"] for s in block["too_close"]["readings"].values()} == {0.9}


def test_a_reading_needs_the_too_close_field():
  config = _config()
  config.analysis.too_close = "admit"
  with pytest.raises(ValueError, match="record no too_close"):
    validation.validate(_result(), config)
  config.analysis.too_close = "maybe"
  with pytest.raises(ValueError, match="not one of"):
    validation.validate(_close_result(), config)


def test_validate_refuses_a_study_without_held_out_settings():
  result = _result()
  result["rows"] = [r for r in result["rows"] if r["role"] != "held_out"]
  with pytest.raises(ValueError, match="no held-out settings"):
    validation.validate(result, _config())


def test_offset_fit_recovers_a_shifted_source():
  # a and b share one curve g(x) = x for x > 0; b's drops sit 0.1 above it.
  x = [0.0, 0.0, 0.1, 0.2, 0.3, 0.1, 0.2, 0.3]
  d = [0.0, 0.0, 0.1, 0.2, 0.3, 0.2, 0.3, 0.4]
  s = ["reference", "reference", "a", "a", "a", "b", "b", "b"]
  delta, g = validation.offset_fit(x, d, s)
  assert delta["b"] - delta["a"] == pytest.approx(0.1, abs=1e-6)
  assert list(g) == sorted(g[:2]) + list(g[2:])  # g is a function of x
  assert g[2] == pytest.approx(g[5]) and g[4] == pytest.approx(g[7])


def test_leave_one_source_out_predicts_each_knee_from_the_others():
  tol = 0.05
  recs = [{"source": "reference", "name": "r", "mismatch/kl": 0.0, "quality_drop": 0.0}]
  for kl, drop in ((0.1, 0.0), (0.2, 0.0), (0.4, 0.2), (0.8, 0.5)):
    recs.append({"source": "noise", "name": f"n{kl}", "mismatch/kl": kl, "quality_drop": drop})
  for kl, drop in ((0.15, 0.0), (0.3, 0.0), (0.6, 0.3)):
    recs.append({"source": "stale", "name": f"s{kl}", "mismatch/kl": kl, "quality_drop": drop})
  out = validation.leave_one_source_out(recs, "mismatch/kl", tol)
  # From stale alone (with the reference) the curve crosses τ between (0.3, 0) and (0.6, 0.3):
  # at 0.35. It labels all four noise settings right (0.4 degraded lies above it).
  assert out["noise"]["predicted_knee"] == pytest.approx(0.35)
  assert (out["noise"]["right"], out["noise"]["settings"]) == (4, 4)
  # From noise alone: between (0.2, 0) and (0.4, 0.2), at 0.25: stale's 0.3 kept is called
  # degraded, the other two are right.
  assert out["stale"]["predicted_knee"] == pytest.approx(0.25)
  assert (out["stale"]["right"], out["stale"]["settings"]) == (2, 3)
  assert out["noise"]["own_knee"] == pytest.approx(0.25)
  assert out["noise"]["own_censored"] == "none"


def test_factorial_pairs_each_combination_with_its_lone_parts():
  result = _result()
  combo = _row(
    "rollout.noise_sigma=0.2,rollout.stale_k=16", "calibration", "noise+stale", 0.4, 0.05
  )
  combo["mismatch/kl/part/noise"] = 0.05
  combo["mismatch/kl/part/stale"] = 0.25
  result["rows"].append(combo)
  (f,) = validation.factorial(result, _run_cfg())
  assert f["part_kl"] == {"noise": 0.05, "stale": 0.25}
  assert f["part_drop"] == {"noise": 0.001, "stale": 0.0}
  assert f["kept"] is False and f["parts_kept"] == {"noise": True, "stale": True}


def test_the_command_scores_a_study_and_refuses_a_config_without_analysis(tmp_path, capsys):
  study = tmp_path / "study.json"
  result = _result()
  for r in result["rows"]:
    r["train/mismatch/kl_mean"] = r["mismatch/kl"] / 2
    r["train_kl_runs"] = [r["mismatch/kl"] / 2] * 2
  study.write_text(json.dumps(result))
  cfg = tmp_path / "cfg.py"
  cfg.write_text(
    "import bf16_sync, ml_collections, validation\n"
    "def get_config():\n"
    "  c = ml_collections.ConfigDict()\n"
    "  c.run = bf16_sync.get_config('tiny')\n"
    "  c.analysis = ml_collections.ConfigDict(validation.ANALYSIS)\n"
    "  return c\n"
  )
  out_json = tmp_path / "v.json"
  validation_command.main(["--study", str(study), "--config", str(cfg), "--json", str(out_json)])
  text = capsys.readouterr().out
  assert "| sum_of_fractions | 5/5 = 100.0%" in text
  assert json.loads(out_json.read_text())["validation"]["n"] == 5
  bare = tmp_path / "bare.py"
  bare.write_text(
    "import ml_collections\ndef get_config():\n  return ml_collections.ConfigDict()\n"
  )
  with pytest.raises(ValueError, match="no `analysis` section"):
    validation_command.main(["--study", str(study), "--config", str(bare)])
  with pytest.raises(ValueError, match="no such file"):
    validation_command.main(["--study", str(study), "--config", str(tmp_path / "none.py")])


def test_the_committed_draw_is_fixed_and_disjoint_from_calibration():
  held = validation_config.draw_extended()
  assert held == validation_config.HELD_OUT and len(held) == validation_config.HELD_OUT_SIZE
  calibration = {frozenset(s.split(",")) for s in validation_config.CALIBRATION}
  assert not calibration & {frozenset(s.split(",")) for s in held}
  assert len({frozenset(s.split(",")) for s in held}) == len(held)
  c = validation_config.get_config()
  assert c.rule == c.analysis.primary == "sum_of_fractions" and c.label == "teacher_kl"


def test_tolerance_interval_resamples_the_reference_seeds():
  result = _result()
  # identical reference runs: every resample gives τ = 2 · 2.5 % · 0.1
  assert validation.tolerance_interval(result, num_bootstrap=50) == pytest.approx((0.005, 0.005))
  out = validation.validate(result, _config())
  assert out["tolerance_interval"] == pytest.approx([0.005, 0.005])
  assert out["labels_within_tolerance_interval"] == 0
  # five seeds that disagree: τ's interval brackets the point estimate 2 · sd
  ref = result["rows"][0]
  ref["quality_runs"] = [-0.10, -0.11, -0.12, -0.10, -0.13]
  lo, hi = validation.tolerance_interval(result, num_bootstrap=500)
  sd = float(np.std(ref["quality_runs"], ddof=1))
  assert lo >= 2 * 0.025 * 0.10  # never below the relative floor of the smallest mean
  assert lo < 2 * sd < hi


def test_a_third_run_relabels_only_the_settings_inside_taus_interval():
  result = _result()
  # no held-out label lies in (0.01, 0.02]
  assert validation.in_band(result, (0.01, 0.02)) == []
  (row,) = validation.in_band(result, (0.02, 0.04))  # σ 0.3 at 0.03
  assert row["spec"] == "rollout.noise_sigma=0.3"
  # a third run at q = −0.1 (no drop) brings the mean drop to (0.03 + 0.03 + 0) / 3 = 0.02
  spec = "rollout.noise_sigma=0.3"
  out = validation.relabel(result, {spec: [-0.1]}, {spec: [0.7]}, {spec: [0.1]})
  new = next(r for r in out["rows"] if r["spec"] == "rollout.noise_sigma=0.3")
  assert new["accuracy_runs"] == [0.6, 0.6, 0.7]
  assert new["teacher_kl_runs"] == pytest.approx([0.13, 0.13, 0.1])
  scored = validation.validate(out, _config())  # every run list the same length: it scores
  assert scored["n"] == 5
  assert new["label_drop"] == pytest.approx(0.02)
  assert new["quality_runs"] == pytest.approx([-0.13, -0.13, -0.1])
  assert result["rows"][7]["label_drop"] == 0.03  # the input is not modified
  # a calibration row of the same spec would not be touched
  out = validation.relabel(result, {"rollout.noise_sigma=0.4": [-0.1]})
  assert out["rows"] == result["rows"]


def test_run_overrides_parse_as_the_config_flags_do():
  """A float key takes "1" as 1.0, a str key keeps a path, a bool key reads "false"; a value
  that does not parse as its key's type is refused, naming it."""
  run = validation.load_config(str(ROOT / "configs" / "validation.py")).run
  out = validation.run_overrides(
    ["train.lr=1", "teacher.cache_dir=/tmp/x", "rollout.score_teacher=false"], run
  )
  assert out["train.lr"] == 1.0 and isinstance(out["train.lr"], float)
  assert out["teacher.cache_dir"] == "/tmp/x"
  assert out["rollout.score_teacher"] is False
  with pytest.raises(ValueError):
    validation.run_overrides(["train.steps=many"], run)


def test_the_command_refuses_a_malformed_run_override(tmp_path, capsys):
  study = tmp_path / "study.json"
  study.write_text(json.dumps(_result()))
  with pytest.raises(ValueError, match="expected --config.run.KEY=VALUE"):
    validation_command.main(
      [
        "--study",
        str(study),
        "--config",
        str(ROOT / "configs" / "validation.py"),
        "--run-override",
        "teacher.cache_dir",
      ]
    )
  assert "--run-override=KEY=VALUE is deprecated" in capsys.readouterr().err
  with pytest.raises(ValueError, match="config.run.train.steps"):  # the new spelling
    validation_command.main(
      [
        f"--study={study}",
        f"--config={ROOT / 'configs' / 'validation.py'}",
        "--config.run.train.steps=many",
      ]
    )
