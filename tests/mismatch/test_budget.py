"""The mismatch budget (fit, admission) and the budget file, on hand-made records.

Every expected number below is worked out by hand in the comment beside it: the isotonic fit by
pool-adjacent-violators, then the linear crossing max_kl = x_k + (τ − f_k)/(f_{k+1} − f_k)·Δx.
"""

import copy
import dataclasses
import hashlib
import json
import subprocess
import sys
import types
import warnings

import jax
import numpy as np
import pytest

from opd_jax import budget as budget_api
from opd_jax.budget import admit, fit_budget
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_file, budget_fit
from opd_jax.model.config import ModelConfig
from opd_jax.model.quant import QuantRecipe, quantize_params
from opd_jax.model.transformer import init_params


def recs(points, source="noise", **extra):
  return [{"source": source, "mismatch/kl": x, "quality_drop": y, **extra} for x, y in points]


STEP = recs([(0.1, 0.0), (0.2, 0.0), (0.3, 1.0), (0.4, 1.0)])


# ---------------------------------------------------------------------------------------------
# The fit


def test_step_function_crosses_halfway_between_the_last_flat_and_the_first_high_point():
  b = fit_budget(STEP, 0.5)
  assert b.overall.curve_kl == (0.1, 0.2, 0.3, 0.4)
  assert b.overall.curve_drop == (0.0, 0.0, 1.0, 1.0)
  # f(0.2) = 0 <= 0.5 < f(0.3) = 1: 0.2 + (0.5 - 0) / (1 - 0) * 0.1 = 0.25.
  assert b.max_kl == pytest.approx(0.25, abs=1e-15)
  assert b.censored == "none"
  assert b.tolerance == 0.5
  assert b.overall.num_records == 4


def test_linear_ramp_crosses_at_tolerance_over_slope():
  # drop = 2·kl on kl = 0, 0.01, …, 0.1; τ = 0.05 crosses at 0.025 (between 0.02 and 0.03).
  b = fit_budget(recs([(0.01 * i, 0.02 * i) for i in range(11)]), 0.05)
  assert b.overall.curve_drop == pytest.approx([0.02 * i for i in range(11)], abs=1e-15)
  assert b.max_kl == pytest.approx(0.025, abs=1e-12)
  assert b.censored == "none"
  # Order of the records does not matter.
  shuffled = recs([(0.01 * i, 0.02 * i) for i in (7, 3, 10, 0, 5, 1, 9, 2, 8, 4, 6)])
  assert fit_budget(shuffled, 0.05).max_kl == pytest.approx(0.025, abs=1e-12)


def test_noisy_points_pool_their_violators():
  # y = 0, .3, .1, .5, .4: PAVA pools (.3, .1) -> .2 and (.5, .4) -> .45.
  b = fit_budget(recs([(1, 0.0), (2, 0.3), (3, 0.1), (4, 0.5), (5, 0.4)]), 0.3)
  assert b.overall.curve_drop == pytest.approx([0.0, 0.2, 0.2, 0.45, 0.45], abs=1e-15)
  # f(3) = .2 <= .3 < f(4) = .45: 3 + (.3 - .2) / .25 * 1 = 3.4.
  assert b.max_kl == pytest.approx(3.4, abs=1e-12)


def test_pava_merges_cascade_backwards():
  # .1 | .6 .5 -> .55 (w 2) | .1 -> .55 > .1, so (.6 + .5 + .1) / 3 = .4 over three points.
  x, f = budget_fit.isotonic_fit(np.array([1.0, 2, 3, 4]), np.array([0.1, 0.6, 0.5, 0.1]))
  assert x.tolist() == [1, 2, 3, 4]
  assert f == pytest.approx([0.1, 0.4, 0.4, 0.4], abs=1e-15)
  # Already monotone data is returned unchanged; a decreasing run becomes its mean.
  assert budget_fit.isotonic_fit(np.array([3.0, 1, 2]), np.array([5.0, 1, 2]))[1].tolist() == [
    1,
    2,
    5,
  ]
  assert budget_fit.isotonic_fit(np.array([1.0, 2, 3]), np.array([3.0, 2, 1]))[1] == pytest.approx(
    [2, 2, 2], abs=1e-15
  )


def test_ties_are_pooled_with_their_counts_as_weights():
  # Ties: kl=1 -> mean(0, .2) = .1 (w 2), kl=2 -> mean(.4, 0) = .2 (w 2), kl=3 -> 1 (w 1).
  b = fit_budget(recs([(1, 0.0), (1, 0.2), (2, 0.4), (2, 0.0), (3, 1.0)]), 0.6)
  assert b.overall.curve_kl == (1.0, 2.0, 3.0)
  assert b.overall.curve_drop == pytest.approx([0.1, 0.2, 1.0], abs=1e-15)
  assert b.max_kl == pytest.approx(2.5, abs=1e-12)  # 2 + (.6 - .2) / .8
  # Weights matter: three records at .3 and one at 0 pool to (3·.3 + 0) / 4 = .225, not .15.
  x, f = budget_fit.isotonic_fit(np.array([1.0, 1, 1, 2]), np.array([0.3, 0.3, 0.3, 0.0]))
  assert x.tolist() == [1, 2]
  assert f == pytest.approx([0.225, 0.225], abs=1e-15)


def test_flat_stretch_at_the_tolerance_gives_its_right_end():
  # f = 0, .5, .5, 1 with τ = .5: every x in [2, 3] predicts exactly τ; the sup is 3.
  b = fit_budget(recs([(1, 0.0), (2, 0.5), (3, 0.5), (4, 1.0)]), 0.5)
  assert b.max_kl == 3.0
  assert b.censored == "none"


def test_censored_above_when_the_largest_mismatch_is_still_within_tolerance():
  b = fit_budget(recs([(0.1, 0.0), (0.2, 0.01), (0.3, 0.02)]), 0.05)
  assert b.max_kl == 0.3
  assert b.censored == "above"
  assert b.overall.interval[1] <= 0.3  # the resamples cannot see beyond the data either


def test_censored_below_when_even_the_smallest_mismatch_is_over_tolerance():
  b = fit_budget(recs([(0.1, 0.2), (0.2, 0.3)]), 0.05)
  assert b.max_kl == 0.0
  assert b.censored == "below"
  # Every resample crosses at 0, but the knee is only known to lie in (0, 0.1]: the first rung
  # already degraded, so the interval holds the whole bracket.
  assert b.interval == (0.0, 0.1)


def test_bootstrap_interval_of_a_two_point_censored_fit():
  # Both points within tolerance: a resample's max_kl is the largest kl it drew, 1 with
  # probability 1/4 and 2 with 3/4, so the 2.5% and 97.5% quantiles are 1 and 2.
  b = fit_budget(recs([(1, 0.0), (2, 0.0)]), 0.1)
  assert b.interval == (1.0, 2.0)


def test_bootstrap_interval_brackets_a_sharp_step():
  # drop jumps from 0 to 1 between kl = .5 and .6; every resample crosses somewhere in
  # (.1, 1.0], and the point estimate .55 sits inside the interval.
  b = fit_budget(recs([(0.1 * i, float(i > 5)) for i in range(1, 11)]), 0.5)
  assert b.max_kl == pytest.approx(0.55, abs=1e-12)
  low, high = b.interval
  assert 0.1 <= low < 0.55 < high <= 1.0
  narrower = fit_budget(recs([(0.1 * i, float(i > 5)) for i in range(1, 11)]), 0.5, level=0.5)
  assert low <= narrower.interval[0] <= narrower.interval[1] <= high


def test_predicted_drop_interpolates_inside_the_data_and_is_nan_outside():
  t = fit_budget(STEP, 0.5).overall
  assert t.predicted_drop(0.25) == pytest.approx(0.5, abs=1e-15)
  assert t.predicted_drop(0.1) == 0.0
  assert t.predicted_drop(0.4) == 1.0
  assert np.isnan(t.predicted_drop(0.05))
  assert np.isnan(t.predicted_drop(0.5))


# ---------------------------------------------------------------------------------------------
# Purity


def test_fit_is_pure():
  records = recs([(0.1 * i, 0.1 * i + 0.05 * (-1) ** i) for i in range(1, 9)], setting="x")
  records[0]["mismatch/k3"] = 0.01  # extra keys are kept
  before = copy.deepcopy(records)
  np.random.seed(1)
  global_state = np.random.get_state()[1].tolist()
  first = fit_budget(records, 0.3)
  assert np.random.get_state()[1].tolist() == global_state  # the global numpy RNG is not drawn
  np.random.seed(2)  # and has no say
  second = fit_budget(records, 0.3)
  assert records == before
  assert first == second
  assert first.records == tuple(before)
  assert first.records[0]["mismatch/k3"] == 0.01
  assert first.records[0] is not records[0]  # copied, so later edits of the input do not leak
  # The seed is what drives the interval: another seed moves it, the point estimate stays.
  other = fit_budget(records, 0.3, seed=7)
  assert other.max_kl == first.max_kl
  assert other.interval != first.interval


def test_read_only_records_are_accepted():
  frozen = tuple(types.MappingProxyType(r) for r in STEP)
  assert fit_budget(frozen, 0.5).max_kl == pytest.approx(0.25, abs=1e-15)


# ---------------------------------------------------------------------------------------------
# Per-layer thresholds

LAYERED = (
  recs([(0.1, 0.0), (0.2, 0.0), (0.3, 1.0)])
  + recs([(0.01, 0.0), (0.03, 0.2)], source="layer_sensitivity/noise", layer=0)
  + recs([(0.1, 0.0), (0.3, 0.0), (0.5, 1.0)], source="layer_sensitivity/fp8", layer=1)
  + recs([(0.05, 0.0)], source="layer_sensitivity/noise", layer=4)
)


def test_layer_records_give_per_layer_thresholds_and_leave_the_overall_fit_alone():
  b = fit_budget(LAYERED, 0.1)
  assert sorted(b.layers) == [0, 1]
  # Layer 0: 0.01 + (.1 - 0) / .2 * .02 = 0.02.
  assert b.layers[0].max_kl == pytest.approx(0.02, abs=1e-15)
  # Layer 1: 0.3 + (.1 - 0) / 1 * .2 = 0.32.
  assert b.layers[1].max_kl == pytest.approx(0.32, abs=1e-15)
  assert b.layers[1].num_records == 3
  assert b.unfitted_layers == (4,)  # one point: no curve
  assert b.overall == fit_budget(LAYERED[:3], 0.1).overall  # 0.2 + .1 * .1 = 0.21
  assert b.max_kl == pytest.approx(0.21, abs=1e-15)
  assert len(b.records) == len(LAYERED)


# Per-source fits. Reference (0, 0) twice anchors each source's curve.
#   noise (0.1, 0), (0.2, 1)   -> x (0, .1, .2), f (0, 0, 1): crosses τ = .5 at .1 + .5 · .1 = .15
#   stale (0.1, 0), (0.3, .2)  -> never over τ: censored above at .3
#   kernel (0.01, 0)           -> censored above at .01
#   noise+stale (0.4, 2)       -> the overall fit only
# Overall: x (0, .01, .1, .2, .3, .4), means (0, 0, 0, 1, .2, 2); PAVA pools (1, .2) into .6,
#   so f (0, 0, 0, .6, .6, 2) and max_kl = .1 + (.5 − 0)/(.6 − 0) · .1 = .18333...
SOURCED = (
  recs([(0.0, 0.0), (0.0, 0.0)], source="reference")
  + recs([(0.1, 0.0), (0.2, 1.0)], source="noise")
  + recs([(0.1, 0.0), (0.3, 0.2)], source="stale")
  + recs([(0.01, 0.0)], source="kernel")
  + recs([(0.4, 2.0)], source="noise+stale")
)
OVERALL = 0.1 + 0.5 / 0.6 * 0.1


def test_each_single_source_gets_its_own_fit_anchored_at_the_reference():
  b = fit_budget(SOURCED, 0.5)
  assert b.max_kl == pytest.approx(OVERALL, abs=1e-15)
  assert sorted(b.sources) == ["kernel", "noise", "stale"]  # no "reference", no combination
  assert b.sources["noise"].curve_kl == (0.0, 0.1, 0.2)
  assert b.sources["noise"].max_kl == pytest.approx(0.15, abs=1e-15)
  assert b.sources["noise"].num_records == 4
  assert (b.sources["stale"].censored, b.sources["stale"].max_kl) == ("above", 0.3)
  assert (b.sources["kernel"].censored, b.sources["kernel"].max_kl) == ("above", 0.01)
  assert b.source_limit("noise") == pytest.approx(0.15, abs=1e-15)  # its own crossing
  assert b.source_limit("stale") == 0.3  # its own records vouch for more than the overall
  assert b.source_limit("kernel") == b.max_kl  # nothing past .01: the overall budget decides
  assert b.source_limit("fp8_kv") == b.max_kl  # no records at all
  # A source with one record and no reference records has a single point: no fit.
  lone = fit_budget(recs([(0.1, 0.0), (0.2, 1.0)]) + recs([(0.3, 0.0)], source="x"), 0.5)
  assert sorted(lone.sources) == ["noise"]


def test_admit_holds_a_measurement_to_its_strictest_source():
  b = fit_budget(SOURCED, 0.5)
  pooled = admit({"mismatch/kl": 0.16}, b)  # no source named: the overall budget
  assert pooled.admitted and pooled.limit_source is None
  noise = admit({"mismatch/kl": 0.16, "source": "noise"}, b)
  assert not noise.admitted
  assert (noise.limit_source, noise.limit) == ("noise", b.sources["noise"].max_kl)
  assert noise.margin == pytest.approx(0.15 - 0.16, abs=1e-15)
  assert noise.reasons == (
    "mismatch/kl 0.16 > 0.15, the limit of source 'noise', where its own fit predicts the "
    "tolerance 0.5: margin -0.01",
  )
  assert admit({"mismatch/kl": 0.16, "source": "noise"}, b, per_source=False).admitted
  stale = admit({"mismatch/kl": 0.25, "source": "stale"}, b)
  assert stale.admitted and stale.limit == 0.3
  combined = admit({"mismatch/kl": 0.25, "source": "stale+noise"}, b)
  assert not combined.admitted and combined.limit_source == "noise"
  over = admit({"mismatch/kl": 0.35, "source": "stale"}, b)
  assert over.reasons == (
    "mismatch/kl 0.35 > 0.3, the limit of source 'stale', the larger of its largest calibrated "
    f"mismatch 0.3 (still within τ) and the overall max_kl {OVERALL:.4g}: margin -0.05",
  )
  unknown = admit({"mismatch/kl": 0.2, "source": "fp8_kv"}, b)
  assert not unknown.admitted and unknown.limit == b.max_kl
  assert "which has no fit of its own" in unknown.reasons[0]
  assert admit({"mismatch/kl": 0.2, "source": "reference"}, b).limit_source is None
  with pytest.raises(ValueError, match="source 3"):
    admit({"mismatch/kl": 0.2, "source": 3}, b)


def test_a_source_crossing_on_fewer_than_c_records_is_unconfirmed_and_takes_the_overall():
  # noise crosses τ = .5 on one record, (0.2, 1): with c = 2 that is one short, so its limit
  # is the overall max_kl (.18333, SOURCED above) and not its own .15. Fit and interval stay.
  one = fit_budget(SOURCED, 0.5)
  two = fit_budget(SOURCED, 0.5, min_crossing_records=2)
  assert two.min_crossing_records == 2 and one.min_crossing_records == 1
  assert two.sources["noise"].censored == "unconfirmed"
  assert dataclasses.replace(two.sources["noise"], censored="none") == one.sources["noise"]
  assert two.source_limit("noise") == two.max_kl == pytest.approx(OVERALL, abs=1e-15)
  assert two.source_limit("noise", end="lower") == two.interval[0]
  assert two.sources["stale"] == one.sources["stale"]  # never crosses: the rule does not apply
  v = admit({"mismatch/kl": 0.19, "source": "noise"}, two)
  assert not v.admitted and v.limit_source == "noise"
  assert v.reasons == (
    f"mismatch/kl 0.19 > {OVERALL:.4g}, the limit of source 'noise', whose own fit crosses τ "
    f"on fewer than 2 of its records (unconfirmed), so the overall max_kl {OVERALL:.4g} "
    f"applies: margin {OVERALL - 0.19:.4g}",
  )
  assert admit({"mismatch/kl": 0.16, "source": "noise"}, two).admitted  # over .15, under .183
  # A second noise record over τ confirms the crossing: (.2, 1), (.2, 0.8) pool to .9 at .2,
  # so x (0, .1, .2), f (0, 0, .9) crosses at .1 + .5/.9 · .1.
  confirmed = fit_budget([*SOURCED, *recs([(0.2, 0.8)])], 0.5, min_crossing_records=2)
  assert confirmed.sources["noise"].censored == "none"
  assert confirmed.source_limit("noise") == pytest.approx(0.1 + 0.5 / 0.9 * 0.1, abs=1e-15)
  # Records of the source under τ do not count: (.1, 0) twice more leaves one over τ.
  extra = fit_budget([*SOURCED, *recs([(0.1, 0.0)] * 2)], 0.5, min_crossing_records=2)
  assert extra.sources["noise"].censored == "unconfirmed"


def test_per_part_holds_each_source_of_a_combination_to_its_own_limit():
  # SOURCED: noise L = .15 (its crossing), stale L = .3 (above, its own records). The whole
  # combination at .25 is over min(.15, .3); its parts alone, stale .2 and noise .1, are within
  # their own limits: margins .1 and .05, so noise binds.
  b = fit_budget(SOURCED, 0.5)
  combo = {
    "mismatch/kl": 0.25,
    "source": "stale+noise",
    "mismatch/kl/part/stale": 0.2,
    "mismatch/kl/part/noise": 0.1,
  }
  assert not admit(combo, b).admitted  # the whole KL against the strictest source
  v = admit(combo, b, per_part=True)
  assert v.admitted and v.reasons == ()
  assert (v.limit_source, v.limit, v.measured_kl) == ("noise", b.source_limit("noise"), 0.1)
  assert v.margin == pytest.approx(0.05, abs=1e-15)
  over = admit({**combo, "mismatch/kl/part/noise": 0.16}, b, per_part=True)
  assert not over.admitted and over.margin == pytest.approx(-0.01, abs=1e-15)
  assert over.reasons == (
    "its noise part alone: mismatch/kl 0.16 > 0.15, the limit of source 'noise', where its own "
    "fit predicts the tolerance 0.5: margin -0.01",
  )
  # A part over its limit fails even when the other has room: stale .35 > .3.
  assert not admit({**combo, "mismatch/kl/part/stale": 0.35}, b, per_part=True).admitted
  # One source: the rule is the per-source one; per_source=False: the pooled one.
  single = {"mismatch/kl": 0.16, "source": "noise"}
  assert admit(single, b, per_part=True) == admit(single, b)
  assert admit(combo, b, per_source=False, per_part=True) == admit(combo, b, per_source=False)
  with pytest.raises(ValueError, match=r"has no 'mismatch/kl/part/noise'"):
    admit({k: v for k, v in combo.items() if k != "mismatch/kl/part/noise"}, b, per_part=True)


# ---------------------------------------------------------------------------------------------
# Rules


COMBO = {  # a noise+stale combination whose parts were measured alone
  "mismatch/kl": 0.25,
  "source": "noise+stale",
  "mismatch/kl/part/noise": 0.06,
  "mismatch/kl/part/stale": 0.12,
}


def test_each_rule_applies_its_equation():
  # SOURCED: L_noise = .15, L_stale = .3 (above: its own x_m), L = .1 + .5/.6 · .1 = .1833.
  b = fit_budget(SOURCED, 0.5)
  verdicts = {name: budget_api.apply_rule(COMBO, b, budget_api.Rule(name)) for name in RULES}
  # pooled: .25 > L.
  assert not verdicts["pooled"].admitted
  assert verdicts["pooled"].limit == pytest.approx(OVERALL) and verdicts["pooled"].rule == "pooled"
  # whole: .25 > min(.15, .3).
  assert not verdicts["whole"].admitted and verdicts["whole"].limit == pytest.approx(0.15)
  # per_part: noise .06 ≤ .15 (margin .09), stale .12 ≤ .3 (margin .18): noise binds.
  per_part = verdicts["per_part"]
  assert per_part.admitted and per_part.limit_source == "noise"
  assert per_part.margin == pytest.approx(0.09, abs=1e-15)
  # sum_of_fractions: F = .06/.15 + .12/.3 = .4 + .4 = .8 ≤ 1; limit = .25/.8 = .3125.
  fractions = verdicts["sum_of_fractions"]
  assert fractions.admitted and fractions.fraction == pytest.approx(0.8, abs=1e-15)
  assert fractions.limit == pytest.approx(0.3125) and fractions.margin == pytest.approx(0.0625)
  assert fractions.limit_source in ("noise", "stale")
  # Parts at .09 and .18: each within its limit (.6 of it), together F = 1.2 > 1.
  heavier = {**COMBO, "mismatch/kl/part/noise": 0.09, "mismatch/kl/part/stale": 0.18}
  assert budget_api.apply_rule(heavier, b, budget_api.Rule("per_part")).admitted
  over = budget_api.apply_rule(heavier, b, budget_api.Rule("sum_of_fractions"))
  assert not over.admitted and over.fraction == pytest.approx(1.2)
  assert over.reasons == ("Σ part/limit = noise 0.09/0.15 + stale 0.18/0.3 = 1.2 > 1",)
  assert over.margin == pytest.approx(0.25 / 1.2 - 0.25)


RULES = budget_lib.RULE_NAMES


def test_a_single_source_is_its_own_part_and_no_source_is_the_pooled_limit():
  b = fit_budget(SOURCED, 0.5)
  single = {"mismatch/kl": 0.16, "source": "noise"}
  anonymous = {"mismatch/kl": 0.16}
  for name in ("whole", "per_part", "sum_of_fractions"):
    v = budget_api.apply_rule(single, b, budget_api.Rule(name))
    assert not v.admitted and v.limit == pytest.approx(0.15), name  # .16 > L_noise
    assert budget_api.apply_rule(anonymous, b, budget_api.Rule(name)).admitted, name  # ≤ L
  assert budget_api.apply_rule(single, b, budget_api.Rule("pooled")).admitted


def test_the_budgets_own_rule_applies_and_none_is_the_pooled_one():
  b = fit_budget(SOURCED, 0.5)
  assert budget_api.apply_rule(COMBO, b) == budget_api.apply_rule(COMBO, b, budget_lib.POOLED)
  named = dataclasses.replace(b, rule=budget_api.Rule("per_part"))
  assert (
    budget_api.apply_rule(COMBO, named).admitted
    and budget_api.apply_rule(COMBO, named).rule == "per_part"
  )
  # The rule given overrides the budget's.
  assert not budget_api.apply_rule(COMBO, named, budget_api.Rule("whole")).admitted


def test_conservative_takes_every_limit_at_its_lower_end():
  b = fit_budget(SOURCED, 0.5)
  for name in RULES:
    v = budget_api.apply_rule(COMBO, b, budget_api.Rule(name, {"conservative": True}))
    assert v.conservative, name
    assert v.limit <= budget_api.apply_rule(COMBO, b, budget_api.Rule(name)).limit + 1e-15, name
  lower = budget_api.apply_rule(COMBO, b, budget_api.Rule("per_part", {"conservative": True}))
  assert lower.limit == b.source_limit(lower.limit_source, end="lower")


def test_a_part_not_measured_is_refused_or_taken_as_the_whole():
  b = fit_budget(SOURCED, 0.5)
  whole_only = {"mismatch/kl": 0.12, "source": "noise+stale"}
  for name in ("per_part", "sum_of_fractions"):
    with pytest.raises(ValueError, match=rf"the {name} rule needs each source's part measured"):
      budget_api.apply_rule(whole_only, b, budget_api.Rule(name))
  # "whole": kl_s = .12 for both parts: per_part is the whole rule (.12 ≤ .15) ...
  stand_in = budget_api.apply_rule(
    whole_only, b, budget_api.Rule("per_part"), unmeasured_parts="whole"
  )
  assert (
    stand_in.admitted == budget_api.apply_rule(whole_only, b, budget_api.Rule("whole")).admitted
  )
  assert stand_in.limit == pytest.approx(0.15)
  # ... and sum_of_fractions reads .12/.15 + .12/.3 = 1.2 > 1.
  summed = budget_api.apply_rule(
    whole_only, b, budget_api.Rule("sum_of_fractions"), unmeasured_parts="whole"
  )
  assert not summed.admitted and summed.fraction == pytest.approx(1.2)
  # A measured part is kept; the whole only stands in for the missing one.
  half = {**whole_only, "mismatch/kl/part/noise": 0.03}
  kept = budget_api.apply_rule(
    half, b, budget_api.Rule("sum_of_fractions"), unmeasured_parts="whole"
  )
  assert kept.fraction == pytest.approx(0.03 / 0.15 + 0.12 / 0.3)
  with pytest.raises(ValueError, match="unmeasured_parts='guess'"):
    budget_api.apply_rule(whole_only, b, unmeasured_parts="guess")


def test_bad_rules_are_refused_by_name():
  with pytest.raises(ValueError, match="unknown admission rule 'per_parts'; known: pooled, whole"):
    budget_api.Rule("per_parts")
  with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['tau'\]"):
    budget_api.Rule("whole", {"tau": 1})
  with pytest.raises(ValueError, match="conservative must be true or false"):
    budget_api.Rule("whole", {"conservative": "yes"})
  with pytest.raises(ValueError, match="validation must be a mapping or None"):
    budget_api.Rule("whole", validation=0.9)
  with pytest.raises(ValueError, match="rule must be a Rule"):
    budget_api.apply_rule({"mismatch/kl": 0.1}, fit_budget(STEP, 0.5), "pooled")
  tested = budget_api.Rule("per_part", validation={"n": 12, "agreement": 11 / 12})
  assert tested.describe() == "per_part, validated 11/12"
  assert tested.with_params(conservative=False) is tested
  changed = tested.with_params(conservative=True)
  assert (
    changed.validation is None and changed.describe() == "per_part (conservative), not validated"
  )


# ---------------------------------------------------------------------------------------------
# Admission


def test_a_verdict_inside_its_limits_band_is_too_close_to_call():
  b = fit_budget(SOURCED, 0.5)
  b = dataclasses.replace(
    b,
    overall=dataclasses.replace(b.overall, interval=(0.1, 0.25)),
    sources={**b.sources, "noise": dataclasses.replace(b.sources["noise"], interval=(0.12, 0.19))},
  )
  # noise: band (.12, .19) around its point limit .15.
  inside = admit({"mismatch/kl": 0.13, "source": "noise"}, b)
  assert inside.limit_band == (0.12, 0.19)
  assert inside.admitted and inside.too_close
  assert admit({"mismatch/kl": 0.17, "source": "noise"}, b).too_close  # refused, but close
  assert not admit({"mismatch/kl": 0.11, "source": "noise"}, b).too_close
  assert not admit({"mismatch/kl": 0.20, "source": "noise"}, b).too_close
  assert admit({"mismatch/kl": 0.19, "source": "noise"}, b).too_close  # upper end included
  assert not admit({"mismatch/kl": 0.12, "source": "noise"}, b).too_close  # lower end admits
  # stale never crosses τ: max(.3, overall) at both ends, a band of width 0.
  stale = admit({"mismatch/kl": 0.3, "source": "stale"}, b)
  assert stale.limit_band == (0.3, 0.3) and not stale.too_close
  # No source: the overall band; a combination takes the strictest source at each end.
  assert admit({"mismatch/kl": 0.2}, b).limit_band == (0.1, 0.25)
  assert admit({"mismatch/kl": 0.2, "source": "noise+kernel"}, b).limit_band == (0.1, 0.19)
  with pytest.raises(ValueError, match="end='middle'"):
    b.source_limit("noise", end="middle")
  # A percentile interval that misses its estimate: the band still holds the limit used.
  off = dataclasses.replace(b.sources["noise"], interval=(0.16, 0.2))
  b = dataclasses.replace(b, sources={**b.sources, "noise": off})
  refused = admit({"mismatch/kl": 0.155, "source": "noise"}, b)
  assert refused.limit_band == (pytest.approx(0.15), 0.2)
  assert not refused.admitted and refused.too_close


def test_admit_margin_and_reasons():
  b = fit_budget(STEP, 0.5)
  inside = admit({"mismatch/kl": 0.2, "mismatch/k3": 9.0}, b)
  assert inside.admitted
  assert inside.margin == pytest.approx(0.05, abs=1e-15)
  assert inside.limit == b.max_kl
  assert inside.reasons == ()
  # Below the smallest calibrated point: monotonicity says the drop is at most f(0.1) = 0.
  assert admit({"mismatch/kl": 0.0}, b).admitted
  assert admit({"mismatch/kl": 0.25}, b).admitted  # exactly on the budget: margin 0
  over = admit({"mismatch/kl": 0.3}, b)
  assert not over.admitted
  assert over.margin == pytest.approx(-0.05, abs=1e-15)
  assert over.reasons == ("mismatch/kl 0.3 > max_kl 0.25 (tolerance 0.5): margin -0.05",)


def test_admit_conservative_uses_the_lower_end_of_the_interval():
  b = fit_budget(recs([(0.1 * i, float(i > 5)) for i in range(1, 11)]), 0.5)
  low, high = b.interval
  kl = (low + b.max_kl) / 2
  assert admit({"mismatch/kl": kl}, b).admitted
  v = admit({"mismatch/kl": kl}, b, conservative=True)
  assert not v.admitted
  assert v.conservative
  assert v.limit == low
  assert v.margin == pytest.approx(low - kl, abs=1e-15)
  assert v.reasons == (
    f"mismatch/kl {kl:.4g} > {low:.4g}, the lower end of the max_kl interval "
    f"[{low:.4g}, {high:.4g}] (max_kl 0.55, tolerance 0.5): margin {low - kl:.4g}",
  )


def test_admit_refuses_to_extrapolate_a_censored_budget():
  b = fit_budget(recs([(0.1, 0.0), (0.2, 0.0)]), 0.05)
  assert admit({"mismatch/kl": 0.2}, b).admitted
  v = admit({"mismatch/kl": 0.3}, b)
  assert not v.admitted
  assert v.margin == pytest.approx(-0.1, abs=1e-15)
  assert v.reasons == (
    "mismatch/kl 0.3 > 0.2, the largest calibrated mismatch, which is still within the "
    "tolerance 0.05: the budget is at least 0.2 (censored), but no record says how far beyond",
  )


def test_admit_below_censored_budget_admits_only_zero_mismatch():
  b = fit_budget(recs([(0.1, 0.2), (0.2, 0.3)]), 0.05)
  assert admit({"mismatch/kl": 0.0}, b).admitted
  v = admit({"mismatch/kl": 0.01}, b)
  assert not v.admitted
  assert v.reasons == (
    "mismatch/kl 0.01 > 0: every calibrated mismatch is over the tolerance 0.05 (the smallest, "
    "0.1, predicts a drop of 0.2), so the budget is below 0.1 and only zero mismatch is admitted",
  )


def test_admit_checks_sensitive_layers():
  b = fit_budget(LAYERED, 0.1)  # overall 0.21, layer 0: 0.02, layer 1: 0.32
  ok = admit({"mismatch/kl": 0.1, "mismatch/kl/layer_0": 0.01, "mismatch/kl/layer_1": 0.3}, b)
  assert ok.admitted
  assert ok.layer_margins == pytest.approx({0: 0.01, 1: 0.02}, abs=1e-15)
  # Within the overall budget, but layer 0 alone is over its own threshold.
  v = admit(
    {"mismatch/kl": 0.1, "mismatch/kl/layer_0": 0.03, "mismatch/kl/layer_4": 99.0}, b
  )  # layer 4 has no threshold, layer 1 was not measured: neither is checked
  assert not v.admitted
  assert v.margin == pytest.approx(0.11, abs=1e-15)
  assert v.layer_margins == pytest.approx({0: -0.01}, abs=1e-15)
  assert v.reasons == (
    "layer 0: mismatch/kl/layer_0 0.03 > max_kl 0.02 (tolerance 0.1): margin -0.01",
  )
  both = admit({"mismatch/kl": 0.5, "mismatch/kl/layer_1": 0.4}, b)
  assert [r.split(" ")[0] for r in both.reasons] == ["mismatch/kl", "layer"]


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
  "records, message",
  [
    ([], "fit_budget: records is empty; a fit needs records at >= 2 mismatch/kl values"),
    (
      [STEP[0], {"source": "fp8", "quality_drop": 0.1}],
      "fit_budget: record 1 (source 'fp8') has no 'mismatch/kl'",
    ),
    (
      [STEP[0], {"source": "kv", "mismatch/kl": 0.1}],
      "fit_budget: record 1 (source 'kv') has no 'quality_drop'",
    ),
    (
      [{"mismatch/kl": 0.1, "quality_drop": 0.0}],
      "fit_budget: record 0 (source '?') has no 'source'",
    ),
    (
      [*STEP, {"source": "stale", "mismatch/kl": float("nan"), "quality_drop": 0.0}],
      "fit_budget: record 4 (source 'stale') has non-finite mismatch/kl: nan",
    ),
    (
      [{"source": "noise", "mismatch/kl": 0.1, "quality_drop": float("-inf")}],
      "fit_budget: record 0 (source 'noise') has non-finite quality_drop: -inf",
    ),
    (
      [{"source": "noise", "mismatch/kl": "0.1", "quality_drop": 0.0}],
      "fit_budget: record 0 (source 'noise') has mismatch/kl '0.1', not a number",
    ),
    ([STEP[0], [0.1, 0.0]], "fit_budget: record 1 is a list, not a mapping"),
    (
      [*STEP, {"source": "layer_sensitivity", "layer": -1, "mismatch/kl": 0.1, "quality_drop": 0}],
      "fit_budget: record 4 (source 'layer_sensitivity') has layer -1, not a non-negative int",
    ),
    (
      recs([(0.1, 0.0), (0.1, 0.2)], source="fp8"),
      "fit_budget: the overall fit needs records at >= 2 distinct mismatch/kl values; got 2 "
      "records: 0 (source 'fp8', mismatch/kl 0.1), 1 (source 'fp8', mismatch/kl 0.1)",
    ),
    (
      recs([(0.1, 0.0)], source="fp8") + recs([(0.2, 0.1), (0.3, 0.2)], layer=0),
      "fit_budget: the overall fit needs records at >= 2 distinct mismatch/kl values; got 1 "
      "record: 0 (source 'fp8', mismatch/kl 0.1)",
    ),
    (
      recs([(0.2, 0.1), (0.3, 0.2)], layer=0),
      "fit_budget: all 2 records have a 'layer' key; the overall fit needs records without one "
      "at >= 2 distinct mismatch/kl values",
    ),
  ],
)
def test_bad_records_are_refused_by_name(records, message):
  with pytest.raises(ValueError) as e:
    fit_budget(records, 0.1)
  assert str(e.value) == message


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"tolerance": -0.1}, "fit_budget: tolerance must be finite and >= 0, got -0.1"),
    ({"tolerance": float("inf")}, "fit_budget: tolerance must be finite and >= 0, got inf"),
    ({"tolerance": "0.1"}, "fit_budget: tolerance must be a number, got '0.1'"),
    ({"tolerance": 0.1, "level": 1.0}, "fit_budget: level must be in (0, 1), got 1.0"),
    (
      {"tolerance": 0.1, "num_bootstrap": 0},
      "fit_budget: num_bootstrap must be an int >= 1, got 0",
    ),
    ({"tolerance": 0.1, "seed": -1}, "fit_budget: seed must be an int >= 0, got -1"),
    (
      {"tolerance": 0.1, "min_crossing_records": 0},
      "fit_budget: min_crossing_records must be an int >= 1, got 0",
    ),
  ],
)
def test_bad_arguments_are_refused(kwargs, message):
  with pytest.raises(ValueError) as e:
    fit_budget(STEP, **kwargs)
  assert str(e.value) == message


@pytest.mark.parametrize(
  "measurement, message",
  [
    ({"mismatch/k3": 0.1}, "admit: measurement has no 'mismatch/kl'"),
    ({"mismatch/kl": float("nan")}, "admit: measurement has non-finite mismatch/kl: nan"),
    ({"mismatch/kl": None}, "admit: measurement has mismatch/kl None, not a number"),
    (
      {"mismatch/kl": 0.1, "mismatch/kl/layer_1": float("inf")},
      "admit: measurement has non-finite mismatch/kl/layer_1: inf",
    ),
  ],
)
def test_bad_measurements_are_refused(measurement, message):
  with pytest.raises(ValueError) as e:
    admit(measurement, fit_budget(LAYERED, 0.1))
  assert str(e.value) == message


# ---------------------------------------------------------------------------------------------
# The budget file

CFG = ModelConfig("qwen3", 16, 8, 16, 1, 2, 1, 4, qk_norm=True)
TEACHER_CFG = ModelConfig("qwen3", 16, 8, 16, 2, 2, 1, 4, qk_norm=True)


def random_params(cfg, seed):
  """Params with the model's tree and shapes, drawn in numpy (init_params compiles per op)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
  return jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)


@pytest.fixture(scope="module")
def setup():
  student = random_params(CFG, 0)
  teacher = random_params(TEACHER_CFG, 1)
  return (
    student,
    teacher,
    budget_file.fingerprint(CFG, student, TEACHER_CFG, teacher, "fp8/channel"),
  )


def test_round_trip(tmp_path, setup):
  fp = setup[2]
  records = [dict(r) for r in LAYERED]
  records[0]["mismatch/kl_p95"] = np.float32(0.5)  # numpy scalars come back as Python floats
  b = fit_budget(records, 0.1)
  path = tmp_path / "sub" / "budget.json"
  budget_file.save_budget(path, b, fp)
  loaded, loaded_fp = budget_file.load_budget(path)
  assert loaded == b
  assert loaded_fp == fp
  assert budget_file.stale_reasons(loaded_fp, fp) == []
  v = {"mismatch/kl": 0.15, "mismatch/kl/layer_0": 0.03}
  assert admit(v, loaded) == admit(v, b)
  doc = json.loads(path.read_text())
  assert doc["budget"]["max_kl"] == b.max_kl
  assert doc["budget"]["curve"] == {"mismatch/kl": [0.1, 0.2, 0.3], "quality_drop": [0, 0, 1]}
  assert doc["fingerprint"]["backend"] == jax.default_backend()
  assert doc["fingerprint"]["jax_version"] == jax.__version__
  assert budget_api.budget_from_json(budget_api.budget_to_json(b, fp)) == (b, fp)


def test_per_source_fits_round_trip_and_older_files_load_without_them(tmp_path, setup):
  fp = setup[2]
  b = fit_budget(SOURCED, 0.5)
  path = tmp_path / "budget.json"
  budget_file.save_budget(path, b, fp)
  loaded, _ = budget_file.load_budget(path)
  assert loaded == b and sorted(loaded.sources) == ["kernel", "noise", "stale"]
  doc = json.loads(path.read_text())
  del doc["budget"]["sources"]  # as written before per-source limits existed
  older, _ = budget_api.budget_from_json(json.dumps(doc))
  assert older.sources == {}
  v = admit({"mismatch/kl": 0.16, "source": "noise"}, older)
  assert v.admitted and v.limit == b.max_kl


def test_min_crossing_records_round_trips_and_older_files_load_with_one(tmp_path, setup):
  fp = setup[2]
  b = fit_budget(SOURCED, 0.5, min_crossing_records=2)
  text = budget_file.budget_to_json(b, fp)
  assert budget_api.budget_from_json(text) == (b, fp)
  doc = json.loads(text)
  assert doc["budget"]["min_crossing_records"] == 2
  assert doc["budget"]["sources"][1]["censored"] == "unconfirmed"  # kernel, noise, stale
  del doc["budget"]["min_crossing_records"]  # as written before the rule existed
  older, _ = budget_api.budget_from_json(json.dumps(doc))
  assert older.min_crossing_records == 1
  doc["budget"]["min_crossing_records"] = 0
  with pytest.raises(ValueError, match=r"budget.min_crossing_records: expected an integer >= 1"):
    budget_api.budget_from_json(json.dumps(doc))


def test_a_training_axis_fit_round_trips_and_is_absent_by_default(tmp_path, setup):
  fp = setup[2]
  on_training = fit_budget(recs([(0.0, 0.0), (0.1, 1.0)], source="noise"), 0.5)
  b = dataclasses.replace(fit_budget(SOURCED, 0.5), training=on_training)
  path = tmp_path / "budget.json"
  budget_file.save_budget(path, b, fp)
  loaded, _ = budget_file.load_budget(path)
  assert loaded == b and loaded.training.max_kl == pytest.approx(0.05)
  doc = json.loads(path.read_text())
  assert doc["budget"]["training"]["max_kl"] == on_training.max_kl
  assert "training" not in doc["budget"]["training"]
  assert (
    "training" not in json.loads(budget_file.budget_to_json(fit_budget(SOURCED, 0.5), fp))["budget"]
  )


def test_the_rule_round_trips_and_a_file_without_one_is_read_pooled_with_a_warning(tmp_path, setup):
  fp = setup[2]
  rule = budget_api.Rule("per_part", validation={"n": 12, "agreement": 11 / 12, "tolerance": 0.04})
  b = dataclasses.replace(fit_budget(SOURCED, 0.5), rule=rule)
  path = tmp_path / "budget.json"
  budget_file.save_budget(path, b, fp)
  doc = json.loads(path.read_text())
  assert doc["rule"] == {
    "name": "per_part",
    "params": {"conservative": False},
    "validation": rule.validation,
  }
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    loaded, _ = budget_file.load_budget(path)
  assert loaded == b and loaded.rule == rule
  del doc["rule"]  # as written before rules were recorded
  path.write_text(json.dumps(doc))
  with pytest.warns(
    UserWarning,
    match=rf"budget file {path} names no admission rule, so it is read with the pooled limit",
  ):
    older, _ = budget_file.load_budget(path)
  assert older.rule is None
  assert budget_api.apply_rule(COMBO, older).rule == "pooled"
  doc["rule"] = {"name": "everything", "params": {}}
  path.write_text(json.dumps(doc))
  with pytest.raises(
    ValueError, match=rf"budget file {path}: rule: unknown admission rule 'everything'"
  ):
    budget_file.load_budget(path)


def test_weights_hash_follows_the_documented_recipe_and_tree_order():
  a = np.arange(3, dtype=np.float32)
  c = np.ones((2, 1), np.int8)
  expected = hashlib.sha256()
  expected.update(b"['a']|float32|(3,)\n" + a.tobytes())
  expected.update(b"['c']|int8|(2, 1)\n" + c.tobytes())
  assert budget_file.weights_sha256({"c": c, "a": a}) == expected.hexdigest()
  assert budget_file.weights_sha256({"a": a, "c": c}) == expected.hexdigest()
  # Same bytes, other shape or dtype: another hash.
  assert budget_file.weights_sha256({"a": a, "c": c.reshape(1, 2)}) != expected.hexdigest()
  assert budget_file.weights_sha256({"a": a.view(np.int32), "c": c}) != expected.hexdigest()


def test_fingerprint_is_stable_and_fp8_weights_hash_differently(setup):
  student, teacher, fp = setup
  again = budget_file.fingerprint(CFG, student, TEACHER_CFG, teacher, "fp8/channel")
  assert again == fp
  on_device = jax.device_put(student)  # jax arrays hash like the numpy arrays they hold
  assert budget_file.weights_sha256(on_device) == fp["student"]["weights_sha256"]
  assert fp["student"]["architecture"]["num_layers"] == 1
  qstudent = quantize_params(student, QuantRecipe())
  q = budget_file.fingerprint(CFG, qstudent, TEACHER_CFG, teacher, "fp8/channel")
  assert q["student"]["weights_sha256"] != fp["student"]["weights_sha256"]
  assert q["teacher"] == fp["teacher"]


def test_stale_reasons_say_what_changed(setup):
  student, teacher, fp = setup
  edited = jax.tree.map(np.copy, student)
  edited["embed_vd"][0, 0] += 1e-3
  current = budget_file.fingerprint(CFG, edited, TEACHER_CFG, teacher, "fp8/block128")
  old_hash, new_hash = fp["student"]["weights_sha256"], current["student"]["weights_sha256"]
  assert budget_file.stale_reasons(fp, current) == [
    f"student weights hash changed: {old_hash[:12]}… -> {new_hash[:12]}…",
    "quantization format fp8/channel -> fp8/block128",
  ]
  saved = json.loads(json.dumps(fp))
  saved["jax_version"] = "0.10.1"
  saved["teacher"]["architecture"]["num_layers"] = 3
  del saved["device_kind"]
  assert budget_file.stale_reasons(saved, fp) == [
    "teacher architecture num_layers changed: 3 -> 2",
    f"jax version 0.10.1 -> {jax.__version__}",
    "device kind is in the current fingerprint but not in the saved one",
  ]


def test_a_guarded_run_compares_its_start_with_the_runs_start_student(tmp_path, setup):
  """A study's budget records two students: the measured one (the admission check's) and the
  one its runs started from (a guarded run's). Each comparison uses its own; a file without
  the run-start student falls back to the measured one."""
  student, teacher, fp = setup
  start = jax.tree.map(np.copy, student)
  start["embed_vd"][0, 0] -= 1e-3  # the probe trained away from the start
  at_start = budget_file.fingerprint(CFG, start, TEACHER_CFG, teacher, "fp8/channel")
  saved = budget_file.with_run_start(fp, start)
  assert saved["student"][budget_file.RUN_START_KEY] == at_start["student"]["weights_sha256"]
  assert budget_file.stale_reasons(saved, fp) == []  # the check, at the measured student
  assert budget_file.stale_reasons(saved, at_start, at_run_start=True) == []  # a fresh run
  measured, begun = fp["student"]["weights_sha256"], at_start["student"]["weights_sha256"]
  assert budget_file.stale_reasons(saved, fp, at_run_start=True) == [
    f"student weights hash changed: {begun[:12]}… -> {measured[:12]}…"
  ]
  assert budget_file.stale_reasons(saved, at_start) == [
    f"student weights hash changed: {measured[:12]}… -> {begun[:12]}…"
  ]
  assert budget_file.stale_reasons(fp, fp, at_run_start=True) == []  # no run start recorded
  path = tmp_path / "budget.json"
  budget_file.save_budget(path, fit_budget(STEP, 0.5), saved)
  assert budget_file.load_budget(path)[1] == saved


def test_a_model_field_newer_than_the_budget_is_no_change_at_its_default(setup):
  """A budget saved before ModelConfig had `logical_vocab_size` (0: every row is real) still
  matches an unpadded model, and is stale for a padded one."""
  _, _, fp = setup
  saved = json.loads(json.dumps(fp))
  del saved["student"]["architecture"]["logical_vocab_size"]
  assert budget_file.stale_reasons(saved, fp) == []
  padded = json.loads(json.dumps(fp))
  padded["student"]["architecture"]["logical_vocab_size"] = 3
  assert budget_file.stale_reasons(saved, padded) == [
    "student architecture logical_vocab_size is in the current fingerprint but not in the saved one"
  ]


def _write_edited(tmp_path, setup, edit):
  doc = json.loads(budget_file.budget_to_json(fit_budget(STEP, 0.5), setup[2]))
  edit(doc)
  path = tmp_path / "budget.json"
  path.write_text(json.dumps(doc))
  return path


def _drop_max_kl(doc):
  del doc["budget"]["max_kl"]


def _short_interval(doc):
  doc["budget"]["interval"] = [0.1]


def _bad_censoring(doc):
  doc["budget"]["censored"] = "maybe"


def _bad_record(doc):
  doc["budget"]["records"][2]["quality_drop"] = None


def _other_schema(doc):
  doc["schema"] = "something.else"


def _unnamed_source(doc):
  doc["budget"]["sources"][0]["source"] = 3


def _sources_not_a_list(doc):
  doc["budget"]["sources"] = 5


def _training_without_curve(doc):
  doc["budget"]["training"] = {k: v for k, v in doc["budget"].items() if k != "curve"}


def _nested_training(doc):
  inner = dict(doc["budget"])
  doc["budget"]["training"] = {**inner, "training": inner}


@pytest.mark.parametrize(
  "edit, problem",
  [
    (_drop_max_kl, "budget: missing key 'max_kl'"),
    (_short_interval, "budget.interval: expected 2 finite numbers, got [0.1]"),
    (
      _bad_censoring,
      "budget.censored: expected one of ('none', 'above', 'below', 'unconfirmed'), got 'maybe'",
    ),
    (_bad_record, "budget.records: record 2 (source 'noise') has quality_drop None, not a number"),
    (_other_schema, "schema: expected 'opd_jax.budget', got 'something.else'"),
    (_unnamed_source, "budget.sources[0].source: expected a non-empty string, got 3"),
    (_sources_not_a_list, "budget.sources: expected a list, got 5"),
    (_training_without_curve, "budget.training: missing key 'curve'"),
    (_nested_training, "budget.training: expected a budget object without its own training fit"),
  ],
)
def test_wrong_schema_is_refused_naming_the_file(tmp_path, setup, edit, problem):
  path = _write_edited(tmp_path, setup, edit)
  with pytest.raises(ValueError) as e:
    budget_file.load_budget(path)
  assert str(e.value) == f"budget file {path}: {problem}"


def test_corrupt_file_is_refused_naming_the_file(tmp_path, setup):
  path = tmp_path / "budget.json"
  path.write_text(budget_file.budget_to_json(fit_budget(STEP, 0.5), setup[2])[:-40])
  with pytest.raises(ValueError, match=f"^budget file {path}: not valid JSON"):
    budget_file.load_budget(path)
  path.write_bytes(b"\xff\xfe")
  with pytest.raises(ValueError, match=f"^budget file {path}: not UTF-8 text"):
    budget_file.load_budget(path)


def test_same_budget_in_a_fresh_process():
  """The fit depends on its arguments only: a second interpreter computes the same numbers."""
  code = (
    "from opd_jax.budget import fit_budget\n"
    "r = [{'source': 's', 'mismatch/kl': 0.1 * i, 'quality_drop': float(i > 5)}\n"
    "     for i in range(1, 11)]\n"
    "b = fit_budget(r, 0.5)\n"
    "print(repr((b.max_kl, b.interval)))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  b = fit_budget(recs([(0.1 * i, float(i > 5)) for i in range(1, 11)], source="s"), 0.5)
  assert out.stdout.strip() == repr((b.max_kl, b.interval))
