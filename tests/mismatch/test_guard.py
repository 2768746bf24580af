"""The budget guard: the state machine on hand-made mismatch/kl sequences, the fallback ladder,
and one tiny training run whose FP8 engine goes over a hand-made budget and is switched.

The budget in the unit tests is fitted on two records, (kl 0, drop 0) and (kl 0.2, drop 1), with
tolerance 0.5: the isotonic fit is the two points themselves, so max_kl = 0 + 0.5/1 · 0.2 = 0.1.
"""

import collections
import dataclasses
import math
import shutil
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from tensorboard.backend.event_processing import event_accumulator

from opd_jax.io import metrics_writer
from opd_jax.mismatch import admission, budget_file, candidates, live_guard
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import guard as guard_lib
from opd_jax.mismatch.budget import Rule
from opd_jax.mismatch.budget_fit import fit_budget
from opd_jax.train import setup as setup_lib
from opd_jax.train import trainer
from opd_jax.train.setup import run_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import base  # noqa: E402
import bf16_sync  # noqa: E402

BUDGET = fit_budget(
  [
    {"source": "noise", "mismatch/kl": 0.0, "quality_drop": 0.0},
    {"source": "noise", "mismatch/kl": 0.2, "quality_drop": 1.0},
  ],
  0.5,
  num_bootstrap=20,
)
OVER, UNDER = 0.2, 0.05  # per-step mismatch/kl above and below max_kl = 0.1


def rollout(**overrides):
  r = base.get_config().rollout
  for key, value in overrides.items():
    r[key] = value
  return r


FULL = rollout(weights="fp8", kv_cache="fp8", noise_sigma=0.1, stale_k=2)


def make_guard(action="fallback", patience=3, smoothing=0.0, ladder=None, **kwargs):
  ladder = guard_lib.fallback_ladder(FULL) if ladder is None else ladder
  return guard_lib.Guard(BUDGET, ladder, action, patience, smoothing=smoothing, **kwargs)


def feed(guard, kls, first_step=1):
  """Observes kls at consecutive steps; returns {step: decision} for the steps that decided."""
  out = {}
  for step, kl in enumerate(kls, first_step):
    decision = guard.observe(step, {"mismatch/kl": kl})
    if decision is not None:
      out[step] = decision
  return out


# ---------------------------------------------------------------------------------------------
# The ladder


def test_budget_of_the_unit_tests_is_a_tenth():
  assert BUDGET.max_kl == pytest.approx(0.1)


def test_ladder_goes_kv_then_weights_and_noise_then_staleness_cumulatively():
  ladder = guard_lib.fallback_ladder(FULL)
  assert [r.name for r in ladder] == [
    "as configured",
    "kv bf16",
    "weights bf16, no noise",
    "no staleness",
  ]
  assert [r.index for r in ladder] == [0, 1, 2, 3]
  assert ladder[0].overrides == {}
  assert ladder[1].overrides == {"kv_cache": "bf16"}
  assert ladder[2].overrides == {"kv_cache": "bf16", "weights": "bf16", "noise_sigma": 0.0}
  assert ladder[3].overrides == {
    "kv_cache": "bf16",
    "weights": "bf16",
    "noise_sigma": 0.0,
    "stale_k": 0,
  }


def test_ladder_skips_rungs_that_change_nothing():
  # The reference engine has nothing to fall back to.
  assert [r.name for r in guard_lib.fallback_ladder(rollout())] == ["as configured"]
  # Noise alone: the weights rung removes it and keeps the trainer's weights.
  noisy = guard_lib.fallback_ladder(rollout(noise_sigma=1.0))
  assert [r.overrides for r in noisy] == [{}, {"noise_sigma": 0.0}]
  # FP8 weights with kv_cache=auto (the engine's compute dtype, not FP8): no KV rung.
  fp8 = guard_lib.fallback_ladder(rollout(weights="fp8"))
  assert [r.overrides for r in fp8] == [{}, {"weights": "bf16"}]
  # Staleness alone, sync and async.
  assert guard_lib.fallback_ladder(rollout(stale_k=4))[1].overrides == {"stale_k": 0}
  lagged = guard_lib.fallback_ladder(rollout(mode="async", max_lag=2))
  assert lagged[1].overrides == {"max_lag": 0, "max_ahead": -1}
  assert len(guard_lib.fallback_ladder(rollout(mode="async", max_lag=0))) == 1


@pytest.mark.parametrize("weights", ["fp8_e5m2", "int8", "int4", "fp4"])
def test_every_quantized_weight_format_and_a_bf16_head_have_a_rung_back(weights):
  """The weights rung removes any quantized format, not only FP8, and a BF16 output head, each
  as a validated config (a grouped format's group size may stay: it acts on quantized weights
  only)."""
  config = base.get_config()
  config.rollout.weights, config.rollout.head_dtype = weights, "bfloat16"
  config.rollout.weight_group_size = 32
  ladder = guard_lib.fallback_ladder(config.rollout)
  assert [r.overrides for r in ladder] == [{}, {"weights": "bf16", "head_dtype": "float32"}]
  switched = guard_lib.apply_rung(config, ladder[1])
  assert (switched.rollout.weights, switched.rollout.head_dtype) == ("bf16", "float32")


def test_apply_rung_gives_a_validated_copy():
  config = base.get_config()
  config.rollout.weights, config.rollout.kv_cache = "fp8", "fp8"
  ladder = guard_lib.fallback_ladder(config.rollout)
  switched = guard_lib.apply_rung(config, ladder[2])
  assert (switched.rollout.weights, switched.rollout.kv_cache) == ("bf16", "bf16")
  assert (config.rollout.weights, config.rollout.kv_cache) == ("fp8", "fp8")  # untouched
  with pytest.raises(ValueError, match="rollout.kv_cache"):
    guard_lib.apply_rung(config, guard_lib.Rung(1, "bad", {"kv_cache": "int4"}))


def test_resumed_rung_reads_the_checkpoint_and_refuses_another_ladder():
  ladder = guard_lib.fallback_ladder(FULL)
  assert live_guard.resumed_rung({}, ladder) == 0
  extra = {"guard": {"rung": 2, "overrides": dict(ladder[2].overrides)}}
  assert live_guard.resumed_rung(extra, ladder) == 2
  with pytest.raises(ValueError, match="the ladder has 4"):
    live_guard.resumed_rung({"guard": {"rung": 7, "overrides": {}}}, ladder)
  with pytest.raises(ValueError, match="with overrides"):
    live_guard.resumed_rung({"guard": {"rung": 1, "overrides": {"kv_cache": "fp8"}}}, ladder)


# ---------------------------------------------------------------------------------------------
# The state machine


def test_patience_counts_consecutive_over_budget_steps_and_a_good_step_resets_it():
  guard = make_guard(patience=3)
  # Over, over, under (reset), over, over, over: the third consecutive one is step 6.
  decisions = feed(guard, [OVER, OVER, UNDER, OVER, OVER, OVER])
  assert list(decisions) == [6]
  d = decisions[6]
  assert (d.kind, d.previous_rung, d.rung) == ("switch", 0, 1)
  assert "3 consecutive steps" in d.reason


def test_margin_and_over_steps_are_reported_per_step():
  guard = make_guard(patience=5)
  feed(guard, [OVER, OVER])
  s = guard.scalars()
  assert s["budget/margin"] == pytest.approx(0.1 - OVER)
  assert s["budget/over_steps"] == 2.0
  assert s["budget/rung"] == 0.0
  assert s["budget/max_kl"] == pytest.approx(0.1)
  feed(guard, [UNDER], first_step=3)
  assert guard.scalars()["budget/margin"] == pytest.approx(0.1 - UNDER)
  assert guard.scalars()["budget/over_steps"] == 0.0


def test_moving_average_is_bias_corrected_and_rides_out_one_spike():
  # α = 0.5: m1 = 0.5·0.04 = 0.02, ema1 = 0.02/0.5 = 0.04; m2 = 0.01 + 0.5·0.4 = 0.21,
  # ema2 = 0.21/0.75 = 0.28 (over); m3 = 0.105 + 0.02 = 0.125, ema3 = 0.125/0.875 = 0.142857.
  guard = make_guard(patience=1, smoothing=0.5, action="warn")
  feed(guard, [0.04])
  assert guard.kl_smoothed == pytest.approx(0.04)
  assert 2 in feed(guard, [0.4], first_step=2)
  assert guard.kl_smoothed == pytest.approx(0.28)
  feed(guard, [0.04], first_step=3)
  assert guard.kl_smoothed == pytest.approx(0.125 / 0.875)
  # α = 0.9 and patience 3: one spike of 1.0 among 0.01s pulls the average over budget for
  # only the steps it dominates, never 3 in a row once the average decays.
  calm = make_guard(patience=5, smoothing=0.9)
  assert feed(calm, [0.01] * 20 + [1.0] + [0.01] * 30) == {}


def test_warn_repeats_every_patience_steps_and_never_switches():
  guard = make_guard(action="warn", patience=2)
  decisions = feed(guard, [OVER] * 6)
  assert list(decisions) == [2, 4, 6]
  assert {d.kind for d in decisions.values()} == {"warn"}
  assert guard.rung == 0


def test_fallback_climbs_one_rung_per_patience_then_reports_the_ladder_exhausted():
  guard = make_guard(patience=2)
  decisions = feed(guard, [OVER] * 10)
  kinds = [(s, d.kind, d.rung) for s, d in decisions.items()]
  assert kinds == [
    (2, "switch", 1),
    (4, "switch", 2),
    (6, "switch", 3),
    (8, "exhausted", 3),
    (10, "exhausted", 3),
  ]
  assert "no safer rung" in decisions[8].reason


def test_fallback_stays_on_a_rung_that_is_within_budget():
  guard = make_guard(patience=2)
  decisions = feed(guard, [OVER, OVER] + [UNDER] * 10)
  assert list(decisions) == [2]
  assert guard.rung == 1


def test_adaptive_measures_at_start_picks_the_cheapest_within_budget_and_rechecks():
  guard = make_guard(action="adaptive", patience=3, recheck_every=5)
  start = guard.start(0)
  assert (start.kind, start.candidates) == ("recheck", (0, 1, 2, 3))
  # Rung 0 and 1 over budget, rung 2 within: rung 2; rung 3 was never measured.
  switch = guard.choose(0, start, {0: 0.5, 1: 0.3, 2: 0.08})
  assert (switch.kind, switch.previous_rung, switch.rung) == ("switch", 0, 2)
  assert "the cheapest within budget" in switch.reason
  # Within budget until the periodic re-check at step 5, which looks at every rung again.
  decisions = feed(guard, [UNDER] * 5)
  assert list(decisions) == [5]
  recheck = decisions[5]
  assert (recheck.kind, recheck.candidates) == ("recheck", (0, 1, 2, 3))
  back = guard.choose(5, recheck, {0: 0.01})  # the student moved: rung 0 is now fine
  assert (back.rung, guard.rung) == (0, 0)


def test_adaptive_recheck_that_keeps_the_rung_returns_none():
  guard = make_guard(action="adaptive")
  assert guard.choose(0, guard.start(0), {0: 0.01}) is None
  assert guard.rung == 0


def test_adaptive_early_recheck_only_looks_at_safer_rungs_and_falls_to_the_safest():
  guard = make_guard(action="adaptive", patience=2, recheck_every=100, rung=1)
  decisions = feed(guard, [OVER, OVER])
  d = decisions[2]
  assert (d.kind, d.candidates) == ("recheck", (2, 3))
  switch = guard.choose(2, d, {2: 0.5, 3: 0.4})
  assert switch.rung == 3
  assert "none within budget: the safest" in switch.reason


def test_other_actions_do_not_ask_for_a_measurement():
  assert make_guard(action="warn").start(0) is None
  assert make_guard(action="fallback").start(0) is None


def test_conservative_compares_with_the_lower_end_of_the_interval():
  guard = make_guard(conservative=True)
  assert guard.limit == BUDGET.interval[0]
  assert guard.limit <= BUDGET.max_kl


# Per-source limits (test_budget.py works the same fit by hand): noise crosses τ = .5 at .15,
# stale never does (max(.3, overall) = .3), and the pooled fit crosses at .1 + .5/.6 · .1.
SOURCED = fit_budget(
  [
    {"source": source, "mismatch/kl": kl, "quality_drop": drop}
    for source, kl, drop in (
      ("reference", 0.0, 0.0),
      ("reference", 0.0, 0.0),
      ("noise", 0.1, 0.0),
      ("noise", 0.2, 1.0),
      ("stale", 0.1, 0.0),
      ("stale", 0.3, 0.2),
    )
  ],
  0.5,
  num_bootstrap=20,
)
POOLED = 0.1 + 0.5 / 0.6 * 0.1


def full_config():
  config = base.get_config()
  config.rollout = FULL
  return config


def test_each_rung_is_named_by_the_sources_its_engine_changes():
  ladder = guard_lib.fallback_ladder(FULL)
  assert guard_lib.rung_sources(full_config(), ladder) == (
    "noise+stale+fp8_weights+fp8_kv",  # as configured
    "noise+stale+fp8_weights+bf16_kv",  # KV in bf16: not the trainer's own (f32 here), not FP8
    "stale+bf16_weights",  # weights in bf16 (the cache in the bf16 engine's own dtype), no noise
    "bf16_weights",  # no staleness
  )
  exact = base.get_config()
  assert guard_lib.rung_sources(exact, guard_lib.fallback_ladder(exact.rollout)) == ("reference",)


def test_per_source_guard_holds_each_rung_to_its_sources_limits():
  ladder = guard_lib.fallback_ladder(FULL)
  sources = guard_lib.rung_sources(full_config(), ladder)
  # Every rung has a source the budget never calibrated (fp8_kv, fp8_weights, bf16_*): by
  # default each is refused, so the guard climbs to the last rung.
  whole = dataclasses.replace(SOURCED, rule=Rule("whole"))
  strict = guard_lib.Guard(whole, ladder, "fallback", 2, smoothing=0.0, sources=sources)
  assert strict.verdict(0.0, 3).extrapolation == "uncalibrated source"
  assert not strict.admits(0.0, 0) and not strict.admits(0.0, 3)
  assert [(s, d.rung) for s, d in feed(strict, [0.0] * 6).items()] == [(2, 1), (4, 2), (6, 3)]
  # With extrapolate="pooled", an uncalibrated source takes the pooled limit (and is flagged).
  # A budget that names no rule is held to the pooled limit on every rung.
  unnamed = guard_lib.Guard(
    SOURCED, ladder, "fallback", 2, smoothing=0.0, sources=sources, extrapolate="pooled"
  )
  assert unnamed.rule.name == "pooled"
  assert [unnamed.limit_of(i) for i in range(4)] == pytest.approx([POOLED] * 4)
  guard = guard_lib.Guard(
    whole, ladder, "fallback", 2, smoothing=0.0, sources=sources, extrapolate="pooled"
  )
  assert guard.verdict(0.0, 0).extrapolation == "uncalibrated source"
  assert guard.rule == Rule("whole")
  assert [guard.limit_of(i) for i in range(4)] == pytest.approx([0.15, 0.15, POOLED, POOLED])
  decisions = feed(guard, [0.16] * 6)  # over noise's .15, within the pooled .1833
  assert [(s, d.rung) for s, d in decisions.items()] == [(2, 1), (4, 2)]
  assert guard.rung == 2 and guard.margin == pytest.approx(POOLED - 0.16)
  pooled = guard_lib.Guard(
    whole,
    ladder,
    "fallback",
    2,
    smoothing=0.0,
    sources=sources,
    per_source=False,
    extrapolate="pooled",
  )
  assert pooled.rule.name == "pooled"
  assert feed(pooled, [0.16] * 6) == {} and pooled.limit == pytest.approx(POOLED)
  with pytest.raises(ValueError, match="3 rung sources for a ladder of 4 rungs"):
    guard_lib.Guard(SOURCED, ladder, "warn", 2, sources=sources[:3])


def test_a_rule_that_reads_parts_takes_the_whole_for_an_unmeasured_part():
  # Rung 0 is noise+stale+fp8_weights+fp8_kv: L = .15 (noise), .3 (stale), POOLED (the FP8
  # sources have no fit). A training step logs only the whole: per_part then holds it to the
  # strictest part's limit; sum_of_fractions to Σ_s kl / L_s ≤ 1.
  ladder = guard_lib.fallback_ladder(FULL)
  sources = guard_lib.rung_sources(full_config(), ladder)

  def guard(name, **kwargs):
    return guard_lib.Guard(
      dataclasses.replace(SOURCED, rule=Rule(name)),
      ladder,
      "adaptive",
      2,
      sources=sources,
      extrapolate="pooled",  # the FP8 sources have no record: the pooled limit
      **kwargs,
    )

  assert guard("per_part").limit == pytest.approx(0.15)
  fractions = 1 / 0.15 + 1 / 0.3 + 2 / POOLED  # Σ 1/L_s: the whole at kl = 1 / that is F = 1
  assert guard("sum_of_fractions").verdict(0.05, 0).fraction == pytest.approx(0.05 * fractions)
  assert guard("sum_of_fractions").admits(0.99 / fractions)
  assert not guard("sum_of_fractions").admits(1.01 / fractions)
  # The limit the guard reports (budget/max_kl, its warnings) is the one it applies.
  assert guard("sum_of_fractions").limit == pytest.approx(1 / fractions)
  # A measurement with its parts (adaptive's, on the check's axis) is judged part by part: the
  # whole at .25 is over .15, its noise part alone (.1) and the others are within their own.
  measured = {
    "mismatch/kl": 0.25,
    "mismatch/kl/part/noise": 0.1,
    "mismatch/kl/part/stale": 0.2,
    "mismatch/kl/part/fp8_weights": 0.001,
    "mismatch/kl/part/fp8_kv": 0.002,
  }
  per_part = guard("per_part")
  assert per_part.admits(measured, 0, "check") and not per_part.admits(0.25, 0, "check")
  decision = per_part.start(0)
  assert per_part.choose(0, decision, {0: measured}) is None  # rung 0 is within: stays
  assert not guard("sum_of_fractions").admits(measured, 0, "check")  # .67 + .67 + … > 1
  # budget.conservative sets the rule's parameter, and the result is no longer the tested rule.
  tested = Rule("per_part", validation={"n": 12, "agreement": 11 / 12})
  strict = guard_lib.Guard(
    dataclasses.replace(SOURCED, rule=tested), ladder, "warn", 2, sources=sources, conservative=True
  )
  with pytest.raises(ValueError, match="budget.extrapolate must be one of"):
    guard_lib.Guard(SOURCED, ladder, "warn", 2, extrapolate="guess")
  assert strict.rule == Rule("per_part", {"conservative": True})
  assert strict.rule.validation is None


# The two axes: a training-axis fit on the same runs read at half the check's KL, so its
# max_kl is half the check's 0.1 (the isotonic fit is the two points, crossing τ at 0.05).
TWO_AXES = dataclasses.replace(
  BUDGET,
  training=fit_budget(
    [
      {"source": "noise", "mismatch/kl": 0.0, "quality_drop": 0.0},
      {"source": "noise", "mismatch/kl": 0.1, "quality_drop": 1.0},
    ],
    0.5,
    num_bootstrap=20,
  ),
)


def test_training_steps_use_the_training_axis_and_measurements_the_checks():
  guard = guard_lib.Guard(TWO_AXES, guard_lib.fallback_ladder(FULL), "adaptive", 2, smoothing=0.0)
  assert guard.limit == pytest.approx(0.05) and guard.limit_of(0, "check") == pytest.approx(0.1)
  # a training step at 0.07 is over the training-axis 0.05 (within the check's 0.1) ...
  decisions = feed(guard, [0.07, 0.07])
  assert [d.kind for d in decisions.values()] == ["recheck"] and guard.margin == pytest.approx(
    -0.02
  )
  assert guard.scalars()["budget/max_kl"] == pytest.approx(0.05)
  # ... while a check measurement of 0.07 on a safer rung is within the check-axis 0.1
  switch = guard.choose(2, decisions[2], {1: 0.07})
  assert switch.kind == "switch" and switch.rung == 1
  # a budget without a training-axis fit compares training steps with the check's axis
  plain = make_guard()
  assert plain.on_axis("training") is BUDGET and plain.limit == pytest.approx(0.1)
  with pytest.raises(ValueError, match="axis='train'"):
    plain.on_axis("train")


def test_bad_arguments_and_missing_metrics_are_named():
  ladder = guard_lib.fallback_ladder(FULL)
  with pytest.raises(ValueError, match="budget.action"):
    guard_lib.Guard(BUDGET, ladder, "panic", 3)
  with pytest.raises(ValueError, match="budget.patience"):
    guard_lib.Guard(BUDGET, ladder, "warn", 0)
  with pytest.raises(ValueError, match="budget.smoothing"):
    guard_lib.Guard(BUDGET, ladder, "warn", 3, smoothing=1.0)
  with pytest.raises(ValueError, match="not on the ladder"):
    guard_lib.Guard(BUDGET, ladder, "warn", 3, rung=4)
  guard = make_guard()
  with pytest.raises(ValueError, match="needs 'mismatch/kl'"):
    guard.observe(1, {"loss/total": 1.0})
  with pytest.raises(ValueError, match="non-finite"):
    guard.observe(1, {"mismatch/kl": math.nan})
  with pytest.raises(ValueError, match="settles a recheck"):
    guard.choose(1, guard_lib.Decision(1, "warn", 0, 0, ""), {})


def test_config_check_knows_the_budget_keys():
  config = base.get_config()
  config.budget.action = "panic"
  config.budget.smoothing = 1.0
  with pytest.raises(ValueError) as e:
    trainer.config_check.validate(config)
  assert "config.budget.action must be one of warn, fallback, adaptive" in str(e.value)
  assert "config.budget.smoothing must be < 1" in str(e.value)


# ---------------------------------------------------------------------------------------------
# End to end: a tiny FP8 run over a hand-made budget


def quiet(*args, **kwargs):
  pass


def tiny_fp8_config(teacher_cache, budget_path, **budget):
  c = bf16_sync.get_config("tiny")
  c.teacher.cache_dir = teacher_cache
  c.rollout.weights, c.rollout.kv_cache = "fp8", "fp8"
  c.budget.file = str(budget_path)
  c.budget.action, c.budget.patience, c.budget.smoothing = "fallback", 1, 0.0
  for key, value in budget.items():
    c.budget[key] = value
  return c


@pytest.fixture(scope="module")
def teacher_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("teacher_cache"))


@pytest.fixture(scope="module")
def tiny_setup(teacher_cache, tmp_path_factory):
  """(config, setup_lib.Setup, the warm-started student) of the tiny reference config."""
  config = bf16_sync.get_config("tiny")
  config.teacher.cache_dir = teacher_cache
  setup = setup_lib.prepare_models(run_spec(config), str(tmp_path_factory.mktemp("fp")), quiet)
  return config, setup, admission.initial_student(config, setup, quiet)


@pytest.fixture(scope="module")
def budget_path(tiny_setup, tmp_path_factory):
  """A budget of max_kl = 1e-7 nats/token (records (0, 0) and (1e-6, 1), tolerance 0.1): far
  below what an FP8 engine measures, above the f32 rounding (~1e-9) of an exact one. Its
  fingerprint is the tiny setup's, built as the admission check builds it."""
  _, setup, student = tiny_setup
  fp = admission.current_fingerprint(setup, student)
  records = [
    {"source": "hand", "mismatch/kl": 0.0, "quality_drop": 0.0},
    {"source": "hand", "mismatch/kl": 1e-6, "quality_drop": 1.0},
  ]
  path = tmp_path_factory.mktemp("budget") / "budget.json"
  budget_file.save_budget(path, fit_budget(records, 0.1, num_bootstrap=20), fp)
  return path


def test_the_trainer_refuses_a_budget_file_without_a_hook_before_anything_loads(tmp_path):
  """The loop never imports the guard: a config asking for it through `trainer.run` alone would
  train unguarded, so it is refused, naming the way that runs the guard."""
  config = tiny_fp8_config(str(tmp_path / "teacher_cache"), tmp_path / "budget.json")
  with pytest.raises(ValueError, match=r"asks for the live budget guard.*guard\.run"):
    trainer.run(config, str(tmp_path / "run"), log=lambda *a: None)
  assert not (tmp_path / "run").exists() and not (tmp_path / "teacher_cache").exists()


@pytest.fixture(scope="module")
def fallback_run(teacher_cache, budget_path, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("guarded")
  lines = []
  config = tiny_fp8_config(teacher_cache, budget_path)
  result = live_guard.run(config, str(workdir), log=lambda *a: lines.append(" ".join(map(str, a))))
  return workdir, result, lines


@pytest.mark.slow
def test_fp8_run_over_budget_falls_back_logs_each_switch_and_finishes(fallback_run, budget_path):
  workdir, result, lines = fallback_run
  assert result["end_step"] == 6
  text = "\n".join(lines)
  assert "budget guard: " + str(budget_path) in text
  # patience 1, per-step: step 1 over -> kv bf16, step 2 over -> bf16 weights, then the
  # bf16-weights engine (against the f32 trainer) is still over 1e-7: the ladder is exhausted.
  assert "step 1: budget guard: switch rung 0 -> rung 1 (kv bf16" in text
  assert "step 2: budget guard: switch rung 1 -> rung 2 (weights bf16, no noise" in text
  assert "step 3: budget guard: exhausted" in text
  assert "step 2: rollouts now: sync, stale_k=0, engine w=bf16" in text
  rows = metrics_writer.read_jsonl(workdir)
  logged = {s: r for s, r in rows.items() if "budget/rung" in r}
  assert sorted(logged) == [2, 4, 6]  # every logged step (log_every=2)
  assert logged[6]["budget/rung"] == 2.0
  for r in logged.values():
    assert r["budget/margin"] == pytest.approx(r["budget/max_kl"] - r["mismatch/kl"])
    assert r["budget/margin"] < 0
  events = event_accumulator.EventAccumulator(str(workdir / "tb"))
  events.Reload()
  texts = [t.tensor_proto.string_val[0].decode() for t in events.Tensors("budget/events")]
  assert texts[0].startswith("switch rung 0 -> rung 1 (kv bf16: rollout.kv_cache='bf16')")
  assert texts[1].startswith("switch rung 1 -> rung 2 (weights bf16, no noise: ")
  assert texts[2].startswith("exhausted: mismatch/kl")


@pytest.mark.slow
def test_adaptive_run_measures_each_rung_against_its_own_per_source_limit(
  tiny_setup, teacher_cache, tmp_path
):
  """Per-source limits differ between rungs: FP8 KV crosses τ at 1e-7 (records (0, 0) and
  (1e-6, 1), tolerance 0.1), FP8 weights and BF16 KV never cross it up to 1.0. Under the
  budget's per_part rule each rung's parts are measured alone: rung 0's FP8 KV part is held to
  1e-7, rung 1's parts (FP8 weights, BF16 KV) to 1.0, so the initial check stops at rung 1:
  within its own limits, though over rung 0's."""
  _, setup, student = tiny_setup
  records = [
    {"source": "reference", "mismatch/kl": 0.0, "quality_drop": 0.0},
    {"source": "fp8_kv", "mismatch/kl": 1e-6, "quality_drop": 1.0},
    {"source": "fp8_weights", "mismatch/kl": 1.0, "quality_drop": 0.0},
    {"source": "bf16_kv", "mismatch/kl": 1.0, "quality_drop": 0.0},
  ]
  path = tmp_path / "budget.json"
  fitted = dataclasses.replace(fit_budget(records, 0.1, num_bootstrap=20), rule=Rule("per_part"))
  budget_file.save_budget(path, fitted, admission.current_fingerprint(setup, student))
  config = tiny_fp8_config(teacher_cache, path, action="adaptive")
  lines = []
  live_guard.run(config, str(tmp_path / "run"), log=lambda *a: lines.append(" ".join(map(str, a))))
  text = "\n".join(lines)
  measured = [line for line in lines if "budget guard measured" in line]
  assert len(measured) == 2, text  # rung 2 is never measured
  assert "measured rung 0 (as configured): mismatch/kl" in measured[0]
  assert measured[0].endswith("(over 1e-07; per_part rule)")
  assert "measured rung 1 (kv bf16: rollout.kv_cache='bf16'): mismatch/kl" in measured[1]
  assert measured[1].endswith("(within 1; per_part rule)")
  assert "rule per_part, not validated" in text
  assert "step 0: budget guard: switch rung 0 -> rung 1" in text


@pytest.mark.slow
def test_a_resumed_run_keeps_the_switched_rung(fallback_run, teacher_cache, budget_path, tmp_path):
  workdir, _, _ = fallback_run
  shutil.copytree(workdir, tmp_path / "run")
  lines = []
  config = tiny_fp8_config(teacher_cache, budget_path)
  config.train.steps = 8
  result = live_guard.run(config, str(tmp_path / "run"), log=lambda *a: lines.append(str(a[0])))
  assert (result["start_step"], result["end_step"]) == (6, 8)
  text = "\n".join(lines)
  assert "on rung 2" in text
  assert "rollouts: sync, stale_k=0, engine w=bf16" in text  # not FP8 again
  assert "switch" not in text  # already on the last rung: nothing to switch


@pytest.mark.slow
def test_a_study_budget_is_fresh_for_a_run_from_its_runs_start(tiny_setup, budget_path, tmp_path):
  """A study's budget is measured at a probe student but records the student its runs started
  from: a run from that student takes it without `budget.force`, and the admission check,
  at that student, finds it stale (its measured student is another)."""
  config, setup, student = tiny_setup
  budget, fp = budget_file.load_budget(budget_path)
  probe = jax.tree.map(lambda x: x + 1e-3, student)
  measured_at_probe = admission.current_fingerprint(setup, probe)
  path = tmp_path / "study_budget.json"
  budget_file.save_budget(path, budget, budget_file.with_run_start(measured_at_probe, student))
  config = tiny_fp8_config(config.teacher.cache_dir, path)
  lines = []
  live = live_guard.LiveGuard.create(config, setup, student, {}, None, None, None, lines.append)
  assert live.guard.rung == 0 and not any("stale" in line for line in lines)
  saved = budget_file.load_budget(path)[1]
  assert budget_file.stale_reasons(saved, fp)[0].startswith("student weights hash changed")


@pytest.mark.slow
def test_a_stale_budget_is_refused_unless_forced(tiny_setup, budget_path, tmp_path):
  config, setup, student = tiny_setup
  budget, fp = budget_file.load_budget(budget_path)
  fp["backend"] = "tpu"
  stale = tmp_path / "stale.json"
  budget_file.save_budget(stale, budget, fp)
  config = tiny_fp8_config(config.teacher.cache_dir, stale)

  def create(config, extra, log=quiet):
    return live_guard.LiveGuard.create(config, setup, student, extra, None, None, None, log)

  with pytest.raises(ValueError, match="is stale(.|\\n)*backend tpu -> cpu"):
    create(config, {})
  lines = []
  config.budget.force = True
  live = create(config, {}, lines.append)
  assert lines[0].startswith("warning: the budget is stale (budget.force):\n  backend tpu -> cpu")
  assert live.guard.rung == 0 and live.config.rollout.weights == "fp8"
  # A resumed run is not fingerprinted again (its student has trained on): no refusal, and it
  # keeps the checkpoint's rung.
  config.budget.force = False
  resumed = create(config, {"guard": {"rung": 1, "overrides": {"kv_cache": "bf16"}}})
  assert resumed.guard.rung == 1 and resumed.config.rollout.kv_cache == "bf16"
  config.budget.file = ""  # no budget file: no guard
  assert create(config, {}) is None


@pytest.mark.slow
def test_a_budget_without_a_fingerprint_needs_budget_force(tiny_setup, budget_path, tmp_path):
  """A budget fitted from another stack's logs (`python -m opd_jax.fit_budget`) has an empty
  fingerprint: a fresh guarded run refuses it, saying why, unless `budget.force`."""
  config, setup, student = tiny_setup
  budget, _ = budget_file.load_budget(budget_path)
  imported = tmp_path / "imported.json"
  budget_file.save_budget(imported, budget, {})
  config = tiny_fp8_config(config.teacher.cache_dir, imported)

  def create(log=quiet):
    return live_guard.LiveGuard.create(config, setup, student, {}, None, None, None, log)

  with pytest.raises(ValueError, match="has no fingerprint(.|\\n)*budget.force=true"):
    create()
  lines = []
  config.budget.force = True
  assert create(lines.append).guard.rung == 0
  assert lines[0].startswith("warning: the budget has no fingerprint (budget.force)")


def test_the_adaptive_history_holds_the_start_as_stale_rollouts_do(monkeypatch):
  """A stale rung measured at step t ≤ k uses the start's weights, as `SyncRollouts` samples
  with them (lag t), not the oldest weights after a step (lag t − 1)."""
  k = 2
  used = []

  def measure_candidate(candidate, setup, prompts, params, behaviour):
    used.append(int(behaviour["v"]))
    return {"mismatch/kl": 0.0}

  monkeypatch.setattr(admission, "calibration_prompts", lambda *a, **kw: (None, None, None))
  monkeypatch.setattr(admission, "measure_candidate", measure_candidate)
  monkeypatch.setattr(admission, "candidate_verdict", lambda c, base, m, *a, **kw: (m, None))
  monkeypatch.setattr(
    candidates, "parse_candidate", lambda spec, base: types.SimpleNamespace(lag=k)
  )

  class Quiet:  # a guard that never acts on its own
    ladder = (guard_lib.Rung(0, "as configured", {}),)
    rule = budget_lib.POOLED

    def start(self, step):
      return None

    def observe(self, step, scalars):
      return None

    def scalars(self):
      return {}

    def on_axis(self, axis):
      return None

    def admits(self, *a):
      return True

    def limit_of(self, *a):
      return 0.0

  hook = live_guard.LiveGuard.__new__(live_guard.LiveGuard)
  hook.guard, hook._prompts, hook._log = Quiet(), None, lambda *a: None
  hook.setup = types.SimpleNamespace(models=types.SimpleNamespace(tokenizer=None), task_cfg=None)
  hook.base_config = types.SimpleNamespace(
    budget=types.SimpleNamespace(prompts=1), rollout=types.SimpleNamespace(weights="fp8")
  )
  hook._history = collections.deque(maxlen=k + 1)  # as __init__ builds it: adaptive, lag k

  def state(version):
    return types.SimpleNamespace(params={"v": jnp.asarray(version)})

  hook.begin(0, state(0), None)
  recheck = guard_lib.Decision(0, "recheck", 0, 0, "test", (0,))
  for step in range(1, 5):
    hook.after_step(step, state(step), {}, None)
    used.clear()
    hook._measure(recheck, step, state(step))
    assert used == [max(step - k, 0)], step  # SyncRollouts: version max(t − k, 0)
