"""No silent extrapolation: a budget's calibrated range per source, the calls "uncalibrated
source" and "beyond calibrated range" (refused by default, or judged against the pooled or the
default limit and flagged), the probe spread, and the round-9 cases of issue 41 on the
shipped round-9 budget."""

import dataclasses
import math
import pathlib
import sys
from pathlib import Path

import pytest

from opd_jax.cli import admit_check
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_file, budget_rules
from opd_jax.mismatch import candidates as candidates_lib
from opd_jax.mismatch.budget_fit import fit_budget

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import base  # noqa: E402

ROUND9 = pathlib.Path(__file__).resolve().parents[2] / "docs" / "study" / "round9" / "budget.json"

RECORDS = [
  {"source": "reference", "mismatch/kl": 0.0, "quality_drop": 0.0},
  {"source": "noise", "mismatch/kl": 0.1, "quality_drop": 0.0},
  {"source": "noise", "mismatch/kl": 0.2, "quality_drop": 1.0},
  {"source": "stale", "mismatch/kl": 0.05, "quality_drop": 0.0},
  {"source": "stale", "mismatch/kl": 0.3, "quality_drop": 0.2},
  {"source": "noise+stale", "mismatch/kl": 0.4, "quality_drop": 2.0},
  {"source": "noise", "layer": 0, "mismatch/kl": 9.0, "quality_drop": 0.0},  # a layer scan
]


@pytest.fixture(scope="module")
def fitted():
  return fit_budget(RECORDS, 0.5, num_bootstrap=10)


@pytest.fixture(scope="module")
def round9():
  """README quickstart 3's budget: the round-9 study's, rule sum_of_fractions."""
  return budget_file.load_budget(ROUND9)[0]


def _judge(budget, kl, source, **kwargs):
  return budget_rules.apply_rule({"mismatch/kl": kl, "source": source}, budget, **kwargs)


def test_the_calibrated_range_is_each_sources_own_records_min_and_max(fitted):
  # the reference and the layer scan are left out; a combination is its own entry
  assert fitted.calibrated_range == {
    "noise": (0.1, 0.2),
    "noise+stale": (0.4, 0.4),
    "stale": (0.05, 0.3),
  }
  assert budget_lib.uncalibrated_budget().calibrated_range == {}


def test_round9_fp4_kv_per_tensor_is_an_uncalibrated_source(round9):
  spec = "rollout.kv_cache=fp4,rollout.kv_granularity=tensor"
  source = candidates_lib.candidate_source(candidates_lib.parse_candidate(spec, base.get_config()))
  assert source == "fp4_kv"
  verdict = _judge(round9, 0.091, source)
  assert verdict.extrapolation == "uncalibrated source" and not verdict.admitted
  assert "no calibration record of source 'fp4_kv'" in verdict.reasons[0]
  assert verdict.rule == "sum_of_fractions"  # the file's rule, refused before it decides
  # Before: admitted against the pooled limit 0.218 with nothing said; now only when asked.
  pooled = _judge(round9, 0.091, source, extrapolate="pooled")
  assert pooled.admitted and pooled.limit == pytest.approx(round9.max_kl)
  assert pooled.extrapolation == "uncalibrated source" and pooled.extrapolate == "pooled"
  default = _judge(round9, 0.091, source, extrapolate="default")
  assert not default.admitted and default.limit == budget_lib.UNCALIBRATED_MAX_KL


def test_round9_int4_per_tensor_is_beyond_its_calibrated_range(round9):
  spec = "rollout.weights=int4,rollout.weight_per_tensor=true"
  source = candidates_lib.candidate_source(candidates_lib.parse_candidate(spec, base.get_config()))
  assert source == "int4_weights"
  low, high = round9.calibrated_range["int4_weights"]
  assert high == pytest.approx(0.0073, abs=1e-4)  # the largest INT4 value ever calibrated
  verdict = _judge(round9, 0.020, source)
  assert verdict.extrapolation == "beyond calibrated range" and not verdict.admitted
  assert verdict.reasons[0].startswith("beyond calibrated range: int4_weights reads 0.02, above")
  assert not verdict.too_close  # an extrapolation refused is a call, not a near miss
  pooled = _judge(round9, 0.020, source, extrapolate="pooled")
  assert pooled.admitted and pooled.limit == pytest.approx(round9.max_kl)  # "clear" before
  assert _judge(round9, 0.020, source, extrapolate="default").admitted  # 0.020 <= 0.033
  # within its range, nothing is flagged
  assert _judge(round9, high, source).extrapolation is None
  assert _judge(round9, 0.5 * low, source).extrapolation is None  # below: anchored at 0


def test_parts_combinations_and_budgets_without_records(fitted):
  # A combination's parts are checked against their own ranges with their own readings.
  parts = {"mismatch/kl": 0.5, "mismatch/kl/part/noise": 0.15, "mismatch/kl/part/stale": 0.29}
  measured = {**parts, "source": "noise+stale"}
  assert budget_rules.extrapolation(measured, fitted) == (None, ())
  kind, lines = budget_rules.extrapolation({**measured, "mismatch/kl/part/stale": 0.31}, fitted)
  assert kind == "beyond calibrated range" and len(lines) == 1 and "stale reads 0.31" in lines[0]
  # Unmeasured parts of a calibrated combination: the whole against the combination's range.
  assert (
    budget_rules.extrapolation({"mismatch/kl": 0.4, "source": "noise+stale"}, fitted)[0] is None
  )
  assert budget_rules.extrapolation({"mismatch/kl": 0.41, "source": "noise+stale"}, fitted)[0] == (
    "beyond calibrated range"
  )
  # So does a rule that reads parts when they stand in for the whole (a training step's
  # unmeasured_parts="whole"): filled-in parts are not measured ones.
  for name in ("whole", "per_part", "sum_of_fractions"):
    rule = budget_lib.Rule(name)
    assert (
      _judge(fitted, 0.4, "noise+stale", rule=rule, unmeasured_parts="whole").extrapolation is None
    )
    assert _judge(
      fitted, 0.41, "noise+stale", rule=rule, unmeasured_parts="whole"
    ).extrapolation == ("beyond calibrated range")
  # An uncalibrated part wins over a range: it is named.
  kind, lines = budget_rules.extrapolation({"mismatch/kl": 0.1, "source": "noise+fp8_kv"}, fitted)
  assert kind == "uncalibrated source" and "'fp8_kv'" in lines[0]
  # The reference, no source, and the uncalibrated default extrapolate nothing.
  assert budget_rules.extrapolation({"mismatch/kl": 5.0, "source": "reference"}, fitted)[0] is None
  assert budget_rules.extrapolation({"mismatch/kl": 5.0}, fitted)[0] is None
  default = budget_lib.uncalibrated_budget()
  assert _judge(default, 0.01, "fp4_kv").extrapolation is None
  with pytest.raises(ValueError, match="extrapolate='guess': expected one of refuse"):
    _judge(fitted, 0.1, "noise", extrapolate="guess")


def test_the_admit_table_calls_say_what_was_done(round9):
  calls = {
    mode: admit_check._call(_judge(round9, 0.091, "fp4_kv", extrapolate=mode), False)
    for mode in budget_lib.EXTRAPOLATE
  }
  assert calls == {
    "refuse": "uncalibrated source",
    "pooled": "uncalibrated source, pooled limit",
    "default": "uncalibrated source, default limit",
  }
  pooled = _judge(round9, 0.020, "int4_weights", extrapolate="pooled")
  assert admit_check._limit_from(pooled, False) == "pooled"
  assert admit_check._call(_judge(round9, 0.001, "fp8_kv"), False) in ("clear", "too close")
  assert admit_check._call(_judge(round9, 0.001, "fp8_kv"), True) == "uncalibrated"


def test_probe_spread_and_the_single_probe_note(fitted, round9):
  assert round9.probe_spread == {} and round9.probe_seeds == ()
  assert budget_lib.probe_note(round9).startswith("single probe: ")
  one = fit_budget([{**r, "probe_seed": 3} for r in RECORDS], 0.5, num_bootstrap=10)
  assert one.probe_spread == {} and "(seed 3)" in budget_lib.probe_note(one)
  # The same settings at a second probe read noise 0.12 / 0.2 and stale 0.05 / 0.3.
  second = [{**r, "probe_seed": 1, "name": f"{r['source']}{k}"} for k, r in enumerate(RECORDS)]
  first = [{**r, "probe_seed": 0} for r in second]
  second[1] = {**second[1], "mismatch/kl": 0.12}  # noise0: 0.1 at seed 0, 0.12 at seed 1
  two = fit_budget(first + second, 0.5, num_bootstrap=10)
  assert two.probe_seeds == (0, 1)
  spread = (0.12 - 0.1) / 0.11
  assert two.probe_spread == pytest.approx(
    {"noise": spread, "noise+stale": 0.0, "stale": 0.0, "overall": spread}
  )
  assert "moved up to 18% between 2 probe seeds" in budget_lib.probe_note(two, ["noise"])
  assert "up to 0%" in budget_lib.probe_note(two, ["stale"])


def test_the_file_keeps_the_range_and_the_code_provenance(fitted, tmp_path):
  entry = {"git_sha": "a" * 40, "dirty": False, "diff_sha256": None, "config_sha256": "c"}
  budget = dataclasses.replace(fitted, rule=budget_lib.Rule("whole"), code_provenance=entry)
  path = tmp_path / "budget.json"
  budget_file.save_budget(path, budget, {})
  loaded, _ = budget_file.load_budget(path)
  assert loaded == budget
  assert loaded.code_provenance == entry and loaded.calibrated_range["stale"] == (0.05, 0.3)
  assert math.isclose(loaded.calibrated_range["noise"][1], 0.2)
