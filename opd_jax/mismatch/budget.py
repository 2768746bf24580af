"""The mismatch budget's types: `Threshold` (one fitted monotone curve and the largest mismatch
it allows), `Rule` (an admission rule and the validation it passed), `Budget`, and the
uncalibrated default.

A Budget is built by `budget_fit.fit_budget` from calibration records, reaches verdicts through
`budget_rules.apply_rule`, and is saved and loaded by `budget_file`. The record format, the fit,
the per-source limits, the rules, the band of a limit and the two axes (check and training) are
described in docs/design.md ("Budget and admission") and docs/budget_rules.md.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

SEED = 0  # default bootstrap seed: a constant, so that fit_budget stays a pure function
NUM_BOOTSTRAP = 1000  # default number of bootstrap resamples
LEVEL = 0.95  # default coverage of the bootstrap interval
MIN_DISTINCT_KL = 2  # a fit needs records at this many distinct mismatch/kl values
KL_KEY = "mismatch/kl"
DROP_KEY = "quality_drop"
LAYER_KEY = "layer"
SOURCE_KEY = "source"
REFERENCE_SOURCE = "reference"  # records of unperturbed runs: every per-source fit's anchor
LAYER_KL_PREFIX = "mismatch/kl/layer_"  # measurement key of layer i: f"{LAYER_KL_PREFIX}{i}"
PART_KL_PREFIX = "mismatch/kl/part/"  # a combination's source s measured alone: f"{…}{s}"
CENSORED = ("none", "above", "below", "unconfirmed")  # "unconfirmed": per-source fits only
MIN_CROSSING_RECORDS = 1  # default: one record over τ is enough for a source's own limit
PROBE_SEED_KEY = "probe_seed"  # a record's probe: the seed of the run its student came from
OVERALL = "overall"  # probe_spread's entry over every setting


RULE_NAMES = ("pooled", "whole", "per_part", "sum_of_fractions")  # docs/budget_rules.md
PARTS_RULES = ("per_part", "sum_of_fractions")  # the rules that read a combination's parts
RULE_PARAMS = {"conservative": False}  # every rule's parameters and their defaults
UNMEASURED_PARTS = ("refuse", "whole")  # what `apply_rule` does with a part it is not given
# What `apply_rule` does with a candidate the budget would extrapolate to (an uncalibrated
# source, or a reading beyond its source's calibrated range): refuse it, or judge it against the
# pooled limit or the uncalibrated default limit, saying so (docs/budget_rules.md).
EXTRAPOLATE = ("refuse", "pooled", "default")
UNCALIBRATED_SOURCE = "uncalibrated source"
BEYOND_RANGE = "beyond calibrated range"


@dataclasses.dataclass(frozen=True)
class Rule:
  """An admission rule, its parameters and the validation it passed (docs/budget_rules.md).

  Attributes:
    name: one of RULE_NAMES.
    params: parameter -> value, every key of RULE_PARAMS (missing ones take their default).
    validation: what the rule scored where it was tested before use (the study that wrote the
      budget: its held-out confusion table and agreement), or None when it was not tested.
  """

  name: str
  params: dict[str, Any] = dataclasses.field(default_factory=dict)
  validation: dict[str, Any] | None = None

  def __post_init__(self):
    if self.name not in RULE_NAMES:
      raise ValueError(f"unknown admission rule {self.name!r}; known: {', '.join(RULE_NAMES)}")
    if not isinstance(self.params, Mapping):
      raise ValueError(f"rule {self.name!r}: params must be a mapping, got {self.params!r}")
    unknown = sorted(set(self.params) - set(RULE_PARAMS))
    if unknown:
      raise ValueError(
        f"rule {self.name!r}: unknown parameter(s) {unknown}; known: {', '.join(RULE_PARAMS)}"
      )
    params = {**RULE_PARAMS, **self.params}
    if not isinstance(params["conservative"], bool):
      raise ValueError(
        f"rule {self.name!r}: conservative must be true or false, got {params['conservative']!r}"
      )
    object.__setattr__(self, "params", params)
    if self.validation is not None and not isinstance(self.validation, Mapping):
      raise ValueError(
        f"rule {self.name!r}: validation must be a mapping or None, got {self.validation!r}"
      )

  @property
  def needs_parts(self) -> bool:
    """Whether the rule reads each part of a combination measured alone."""
    return self.name in PARTS_RULES

  @property
  def conservative(self) -> bool:
    return bool(self.params["conservative"])

  def with_params(self, **params) -> Rule:
    """The rule with `params` changed; it keeps its validation only when nothing changed (a
    rule with other parameters is not the one that was tested)."""
    merged = {**self.params, **params}
    if merged == self.params:
      return self
    return Rule(self.name, merged, None)

  def describe(self) -> str:
    """One line: the name, a non-default parameter, and what it scored where it was tested."""
    text = self.name + (" (conservative)" if self.conservative else "")
    v = self.validation
    if v and "agreement" in v and "n" in v:
      right = round(v["agreement"] * v["n"])
      text += f", validated {right}/{v['n']}" + (f" ({v['study']})" if v.get("study") else "")
    else:
      text += ", not validated"
    return text


POOLED = Rule("pooled")  # the rule of a budget that names none


@dataclasses.dataclass(frozen=True)
class Threshold:
  """One fitted monotone curve and the largest mismatch it allows.

  Attributes:
    max_kl: sup{x in [x_1, x_m] : g(x) <= tolerance}, nats per token; see
      `budget_fit.crossing` for the "above" (= x_m, a lower bound) and "below" (= 0) cases.
    interval: (low, high) bootstrap percentile interval of max_kl at the budget's level, widened
      to contain the rungs that bracket the crossing (`budget_fit.knee_bracket`).
    censored: "none", "above" (the budget is at least max_kl) or "below" (below x_1); a
      per-source fit may also be "unconfirmed" (it crosses τ on too few records, so the source
      takes the overall limit; `Budget.source_limit`).
    curve_kl: [m] the distinct mismatch/kl values x_1 < … < x_m.
    curve_drop: [m] the isotonic fit f_1 <= … <= f_m at those values.
    num_records: how many records the fit used.
  """

  max_kl: float
  interval: tuple[float, float]
  censored: str
  curve_kl: tuple[float, ...]
  curve_drop: tuple[float, ...]
  num_records: int

  def predicted_drop(self, kl: float) -> float:
    """g(kl): the fit interpolated linearly between its points; NaN outside [x_1, x_m]."""
    if not self.curve_kl[0] <= kl <= self.curve_kl[-1]:
      return math.nan
    return float(np.interp(kl, self.curve_kl, self.curve_drop))


@dataclasses.dataclass(frozen=True)
class Budget:
  """The mismatch budget fitted by `fit_budget`.

  Attributes:
    tolerance: τ, the largest acceptable predicted quality drop.
    overall: the fit over every record without a "layer" key.
    layers: layer index -> that layer's Threshold, for layers with enough scan records.
    unfitted_layers: layers that had scan records at fewer than MIN_DISTINCT_KL distinct
      mismatch/kl values, so no threshold (sorted).
    sources: source name -> its own Threshold (`Budget.source_limit`).
    records: the input records, each copied into a dict, in input order.
    level: coverage of the bootstrap intervals.
    num_bootstrap: bootstrap resamples per fit.
    seed: the bootstrap seed.
    training: the same fit with each record's x the run's training-time mean mismatch/kl
      (the check and training read different scales: docs/design.md), or None.
    min_crossing_records: c, how many of a source's own records a crossing needs before the
      source gets its own limit (`budget_fit.fit_budget`).
    rule: the admission rule the budget is used with (`Rule`); None for a budget
      that names none (`apply_rule` then uses the pooled limit).
    provenance: where the records came from when they were not measured by this project's
      check (`record_import.import_records`: the log format, the files and their sha256, the
      key read as x, its conversion, the quality key and the tail), or None.
    calibrated_range: source -> (min, max) of the check's mismatch/kl over its own records
      (`calibrated_ranges`); None (the default) computes it from `records`. A candidate's
      source outside it is an extrapolation (`budget_rules.extrapolation`).
    probe_spread: source -> how far its check KL moved between probe seeds (`probe_spreads`);
      None computes it from `records`; empty when they hold fewer than two probe seeds.
    code_provenance: the `io.provenance` entry of the code that fitted it, or None.
  """

  tolerance: float
  overall: Threshold
  layers: dict[int, Threshold]
  unfitted_layers: tuple[int, ...]
  records: tuple[dict[str, Any], ...]
  sources: dict[str, Threshold] = dataclasses.field(default_factory=dict)
  level: float = LEVEL
  num_bootstrap: int = NUM_BOOTSTRAP
  seed: int = SEED
  training: Budget | None = None
  min_crossing_records: int = MIN_CROSSING_RECORDS
  rule: Rule | None = None
  provenance: dict[str, Any] | None = None
  calibrated_range: dict[str, tuple[float, float]] | None = None
  probe_spread: dict[str, float] | None = None
  code_provenance: dict[str, Any] | None = None

  def __post_init__(self):
    if self.calibrated_range is None:
      object.__setattr__(self, "calibrated_range", calibrated_ranges(self.records))
    if self.probe_spread is None:
      object.__setattr__(self, "probe_spread", probe_spreads(self.records))

  @property
  def probe_seeds(self) -> tuple[int, ...]:
    """The distinct probe seeds its records name (PROBE_SEED_KEY), sorted; () when none does."""
    return tuple(sorted({r[PROBE_SEED_KEY] for r in self.records if PROBE_SEED_KEY in r}))

  @property
  def max_kl(self) -> float:
    """The overall budget in nats per token (`overall.max_kl`)."""
    return self.overall.max_kl

  @property
  def interval(self) -> tuple[float, float]:
    """The bootstrap interval of `max_kl` (`overall.interval`)."""
    return self.overall.interval

  @property
  def censored(self) -> str:
    """ "none", "above" or "below" (`overall.censored`)."""
    return self.overall.censored

  def source_limit(self, source: str, *, end: str = "point") -> float:
    """L_s, the limit of one source s, with L the overall max_kl:

      L_s = max_kl_s                when s's own fit crosses τ (censored "none"),
      L_s = max(x_m,s, L)           when its records never cross τ ("above": they say
                                    nothing past x_m,s, so the pooled budget decides there),
      L_s = 0                       when even its smallest mismatch is over τ ("below"),
      L_s = L                       when s has no fit, or an "unconfirmed" one.

    `end` picks each max_kl involved: "point" (the estimate), "lower" or "upper" (that end of
    its bootstrap interval)."""
    overall = _at(self.overall, end)
    threshold = self.sources.get(source)
    if threshold is None or threshold.censored == "unconfirmed":
      return overall
    if threshold.censored == "above":
      return max(threshold.curve_kl[-1], overall)
    return _at(threshold, end)

  def limit_for(self, sources: Sequence[str], *, end: str = "point") -> tuple[float, str | None]:
    """(min_s L_s over `sources`, the source that sets it) at `end` (`source_limit`); the
    overall limit and None when there are no sources or no per-source fits."""
    named = [s for s in sources if s and s != REFERENCE_SOURCE]
    if not named or not self.sources:
      return _at(self.overall, end), None
    limit, which = min((self.source_limit(s, end=end), s) for s in named)
    return limit, which


def _own_records(records: Sequence[Mapping[str, Any]]):
  """(source, record) for each record of one named source (no "layer", not the reference)."""
  for r in records:
    source = r.get(SOURCE_KEY)
    named = isinstance(source, str) and source and source != REFERENCE_SOURCE
    if named and LAYER_KEY not in r and KL_KEY in r:
      yield source, r


def calibrated_ranges(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[float, float]]:
  """source -> (min, max) of mismatch/kl over the records of exactly that source (a
  combination, "noise+stale", is its own entry; layer scans and the reference are left out).

  A source with no entry was never calibrated; a reading above its max lies beyond what its
  records say (`budget_rules.extrapolation`). Below its min the fit still holds: every
  per-source fit is anchored at the reference's zero mismatch."""
  out: dict[str, tuple[float, float]] = {}
  for source, r in _own_records(records):
    kl = float(r[KL_KEY])
    low, high = out.get(source, (kl, kl))
    out[source] = (min(low, kl), max(high, kl))
  return dict(sorted(out.items()))


def probe_spreads(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """How much of the check's reading comes from the probe: for each setting (a record's
  "name", else its source) measured at two or more probe seeds (PROBE_SEED_KEY), with m_p its
  mismatch/kl at probe seed p (the mean of its records there),

    spread = (max_p m_p − min_p m_p) / mean_p m_p       (relative: 0.2 = 20 %),

  and per source the largest spread of its settings, with OVERALL the largest of all.
  Empty when the records name fewer than two probe seeds (one probe: not measured)."""
  if len({r[PROBE_SEED_KEY] for r in records if PROBE_SEED_KEY in r}) < 2:
    return {}
  by_setting: dict[tuple[str, str], dict[Any, list[float]]] = {}
  for source, r in _own_records(records):
    if PROBE_SEED_KEY in r:
      at = by_setting.setdefault((source, str(r.get("name", source))), {})
      at.setdefault(r[PROBE_SEED_KEY], []).append(float(r[KL_KEY]))
  out: dict[str, float] = {}
  for (source, _), at in by_setting.items():
    means = [float(np.mean(v)) for v in at.values()]
    if len(means) < 2 or np.mean(means) <= 0:
      continue
    spread = (max(means) - min(means)) / float(np.mean(means))
    out[source] = max(out.get(source, 0.0), spread)
    out[OVERALL] = max(out.get(OVERALL, 0.0), spread)
  return dict(sorted(out.items()))


def probe_note(budget: Budget, sources: Sequence[str] = ()) -> str:
  """One line on how much of a reading comes from the probe: the largest probe spread of
  `sources` (else the overall one), or "single probe" when the budget was fitted at one."""
  seeds = budget.probe_seeds
  if not budget.probe_spread:
    at = f" (seed {seeds[0]})" if len(seeds) == 1 else ""
    return (
      f"single probe: the budget was fitted at one probe{at}, so how far a reading moves with "
      "the probe is not measured"
    )
  named = [budget.probe_spread[s] for s in sources if s in budget.probe_spread]
  spread = max(named) if named else budget.probe_spread.get(OVERALL, 0.0)
  return f"probe spread: the check KL moved up to {spread:.0%} between {len(seeds)} probe seeds"


UNCALIBRATED = "uncalibrated"  # the name of the default where a budget file is asked for

UNCALIBRATED_MAX_KL = 0.033
"""The uncalibrated default limit, in nats/token of the check's mismatch/kl: the lowest knee
measured over the calibrated student–teacher pairs, at the lower end of its bootstrap interval,
rounded down (where it comes from: docs/design.md, "Budget and admission")."""


CALIBRATE_COMMAND = "python -m opd_jax.calibrate"  # how a user calibrates a budget of their own


def finite_number(value: Any, where: str, key: str) -> float:
  """`value` as a float. Raises ValueError naming `where` and `key` when it is a bool, not a
  real number, or not finite (records and measurements are checked alike)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{where} has {key} {value!r}, not a number")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{where} has non-finite {key}: {value}")
  return value


def uncalibrated_note() -> str:
  """The words a check or a run that uses the default says it with: the limit, where it comes
  from, that it is uncalibrated, and how to calibrate one."""
  return (
    f"the uncalibrated default limit {UNCALIBRATED_MAX_KL:g} nats/token (the lowest knee over "
    "the calibrated pairs, at the lower end of its interval; calibrate your own with "
    f"{CALIBRATE_COMMAND})"
  )


def uncalibrated_budget() -> Budget:
  """The uncalibrated default (docs/design.md, "Budget and admission") as a Budget:
  max_kl = UNCALIBRATED_MAX_KL with a zero-width interval (so `conservative` changes nothing and
  no verdict is too close to call), no records, no per-source or per-layer fits, no
  training-axis fit, the pooled rule, and tolerance NaN (the limit is set, not fitted)."""
  limit = UNCALIBRATED_MAX_KL
  threshold = Threshold(
    max_kl=limit,
    interval=(limit, limit),
    censored="none",
    curve_kl=(limit,),
    curve_drop=(math.nan,),
    num_records=0,
  )
  return Budget(
    tolerance=math.nan,
    overall=threshold,
    layers={},
    unfitted_layers=(),
    records=(),
    rule=POOLED,
  )


def is_uncalibrated(budget: Budget) -> bool:
  """Whether `budget` is a set limit with no calibration record behind it (a fitted budget
  always has records: `fit_budget` refuses none)."""
  return budget.overall.num_records == 0


ENDS = ("point", "lower", "upper")


def _at(threshold: Threshold, end: str) -> float:
  """A threshold's max_kl at `end` of ENDS."""
  if end == "point":
    return threshold.max_kl
  if end in ENDS:
    return threshold.interval[ENDS.index(end) - 1]
  raise ValueError(f"end={end!r}: expected one of {ENDS}")
