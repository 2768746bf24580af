"""The mismatch budget: a monotone fit of quality drop against `mismatch/kl`, and admission.

This module owns the pure half of budget and admission (docs/design.md, "Budget and admission"):
`fit_budget` turns calibration records into a `Budget`, and `admit` screens one measured rollout
configuration against it. Neither does I/O, reads a clock or touches global state: the bootstrap
draws from a numpy Generator seeded from an argument (default `SEED`), so the same records give
the same `Budget` on every call, and the records passed in are never modified. Saving, loading
and fingerprinting a budget live in `opd_jax.mismatch.budget_file`.

Records
-------
A calibration record is a mapping with at least

  "source"        what was perturbed (str), e.g. "noise", "fp8", "stale", "kv";
  "mismatch/kl"   the mismatch the admission check measures for that configuration, in nats
                  per completion token (docs/design.md: "the x-axis is what the check measures");
  "quality_drop"  reference quality minus the run's quality, in the quality's own units
                  (bigger is worse; may be negative within the seed-to-seed noise).

Any other keys (other `mismatch/*` metrics, the setting, the seed) are kept in `Budget.records`
untouched. A record that also has an integer "layer": i belongs to the layer-sensitivity scan of
decoder layer i: a run in which only layer i was perturbed, its "mismatch/kl" being the
whole-model KL that perturbation causes. Such records feed layer i's threshold, not the overall
fit; their "source" is free (e.g. "layer_sensitivity/noise"). A measurement given to `admit` may
carry the matching per-layer values as "mismatch/kl/layer_<i>": the KL measured with the
candidate's perturbation restricted to layer i.

Fit
---
Let x_1 < … < x_m be the distinct values of mismatch/kl, ȳ_j the mean quality drop of the w_j
records at x_j. The isotonic (non-decreasing) least-squares fit is

  f = argmin_f  Σ_j w_j (ȳ_j − f_j)²   subject to  f_1 ≤ f_2 ≤ … ≤ f_m,

computed exactly by pool-adjacent-violators (PAVA): scan j = 1…m keeping a stack of blocks,
each holding the weighted mean of the points it pooled; push point j as a block, and while the
block below the top has a larger mean than the top, merge the two (summed weights, weighted
mean). Every point's fitted value is its block's mean. Between the points, the predicted drop
g(x) interpolates linearly between (x_j, f_j) and (x_{j+1}, f_{j+1}); g is not defined beyond
the data (no extrapolation). Given the tolerance τ, the budget is

  max_kl = sup { x ∈ [x_1, x_m] : g(x) ≤ τ }.

Since g is non-decreasing this is, with k the last index such that f_k ≤ τ,

  max_kl = x_k + (τ − f_k) / (f_{k+1} − f_k) · (x_{k+1} − x_k)    when k < m (censored = "none"),
  max_kl = x_m                                                    when k = m (censored = "above"),
  max_kl = 0                                                      when f_1 > τ (censored = "below").

"above": the largest measured mismatch is still within tolerance; the true budget is at least
x_m but the data say nothing about how far beyond it, so `max_kl = x_m` is a lower bound and
`admit` rejects anything above it. "below": even the smallest measured mismatch x_1 predicts a
drop above τ; the true budget lies somewhere in [0, x_1), and the only mismatch the data vouch
for is none at all (the reference itself), so `max_kl = 0`. Below x_1 (when f_1 ≤ τ) the fit is
not extrapolated either: monotonicity alone says g(x) ≤ f_1 ≤ τ there, so such a mismatch is
within budget.

Uncertainty: B bootstrap resamples of the records (n draws with replacement, B = `num_bootstrap`)
are each fitted by the same rule, and `interval` is the equal-tailed percentile interval of their
max_kl at `level` (numpy's linear quantile). With few records the interval is wide and, when
resamples hit the "below"/"above" cases, it mixes in their conventions (0, or a lower bound).

Per-source limits
-----------------
Sources need not share one knee: on the embedded task weight noise degrades quality from a check KL
of about 0.07-0.1 while some stale settings keep it up to 0.2 (docs/study). So the same rule is also
fitted per source. Source s's fit uses the records whose "source" is exactly s (one source, no "+")
plus the records whose source is REFERENCE_SOURCE ("reference": the unperturbed runs, the curve's
zero-mismatch anchor); a source with records at fewer than MIN_DISTINCT_KL distinct values is not
fitted. Combination records ("noise+stale") enter the overall fit only. Source s's limit is

  L_s = max_kl_s                     when its fit crosses τ (censored "none"),
  L_s = max(x_m,s, overall max_kl)   when its records never cross τ (censored "above"): they
                                     say nothing past x_m,s, so the pooled budget decides
                                     there, but never below what s's own records vouch for,
  L_s = 0                            when even its smallest mismatch is over τ ("below"),

(with `conservative=True`, each max_kl is its interval's lower end). A crossing can also be
required to rest on more than one run: with `min_crossing_records` = c > 1, a source whose fit
crosses τ ("none" or "below") on fewer than c of its own records (those at the kl values where
its fit is over τ) is censored "unconfirmed" and takes the overall limit, L_s = max_kl. One
500-step run's drop has a seed sd of 2-4 points on the embedded task against τ of 4-7, so about
one harmless setting in twelve crosses τ on one run; with c = 1 the FP8 limits can be set by
two such runs (docs/study/round5). A measurement that names
its sources ("source": "noise+stale", as the study's settings do) is held to the strictest of
them, min_s L_s, with the overall max_kl for a source that has no fit of its own.

Admission
---------
`admit` admits a measurement iff mismatch/kl ≤ limit and every per-layer value it carries is within
its layer's limit, where limit = max_kl by default, or the interval's lower end with
`conservative=True`; when the measurement names its sources and the budget has per-source fits,
limit is min_s L_s instead (above; `per_source=False` keeps the overall one). The default is the
point estimate: it is the fit's best guess of where the drop crosses τ, which is what a verdict is
validated against (agreement with full runs); the lower end can sit far below it when the records
are few or noisy (a resample that hits the "below" case pulls it to 0), rejecting configurations the
data do not condemn. Choose `conservative=True` when a wrongly admitted configuration (a full
training run that degrades) costs much more than a wrongly rejected one (a slower but safer engine).

Rules
-----
A budget is used through one admission rule, named in its file (`budget_file`) with the
parameters and the validation it passed, and applied by `apply_rule` wherever a verdict is
reached (the admission check, the live guard, the study). With L_s the limit of source s
(above), L the overall max_kl, kl the combination's measured mismatch/kl and kl_s that of its
part s alone (the check run on the combination's overrides of s only):

  pooled            admitted ⇔ kl ≤ L                       one limit, sources ignored;
  whole             admitted ⇔ kl ≤ min_s L_s               the whole combination against the
                                                            strictest of its sources;
  per_part          admitted ⇔ kl_s ≤ L_s for every part s  each part against its own limit;
  sum_of_fractions  admitted ⇔ Σ_s kl_s / L_s ≤ 1           the parts share one budget.

A single source is its own only part, so the last three agree on it (kl ≤ L_s); a measurement
naming no source is held to L by all four. The parameter "conservative" takes every limit at
the lower end of its bootstrap interval. A rule that reads parts (`Rule.needs_parts`) needs
them measured; where they cannot be (a training step logs only the whole), `apply_rule` may
take the whole's kl as each part's (`unmeasured_parts="whole"`), which makes per_part the
whole rule and sum_of_fractions Σ_s kl / L_s ≤ 1.

Too close to call
-----------------
Every verdict also carries the band of its limit: (lower, upper), the same limit taken at the
lower and at the upper end of each bootstrap interval involved (widened to hold the limit the
verdict used, since a percentile interval need not contain its estimate). A measurement with
lower < mismatch/kl ≤ upper is `too_close`: the data cannot say on which side of the knee it
lies, and one full run is the only way to know. The verdict itself is unchanged (point estimate
or lower end); `too_close` is advice beside it.

Two axes
--------
The check's mismatch/kl (before training, at one student) is the x-axis a user can measure, so
it is the budget's. A training run logs another value of the same metric every step, on its
own batches as the student moves, and the two disagree in scale: on the embedded task the
check reads a median 1.7× the training-time mean, most for staleness (docs/study). A budget
compared with training-time values must therefore be fitted on them. `Budget.training`, when
present, is that second fit: `fit_budget` on the same runs with each record's mismatch/kl
replaced by the run's training-time mean (the study writes both into one budget file). The
live guard compares a run's per-step values with `training` and its adaptive measurements,
which use the check's procedure, with the budget itself.

Uncalibrated default
--------------------
A model with no budget of its own can still be screened against one set limit,
`UNCALIBRATED_MAX_KL` on the check's axis (`uncalibrated_budget`): a Budget with no records, no
per-source or per-layer fits, no training-axis fit and the pooled rule, so that `apply_rule`
reaches its verdicts as for any budget (admitted ⇔ kl ≤ UNCALIBRATED_MAX_KL). It is named
UNCALIBRATED ("uncalibrated") where a budget file is asked for. It belongs to no model, so it
has no fingerprint to check, and it is no calibration of the model it screens: a knee measured
on one pair says where a careful user might start, not where another model degrades.
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


RULE_NAMES = ("pooled", "whole", "per_part", "sum_of_fractions")  # "Rules" in the docstring
PARTS_RULES = ("per_part", "sum_of_fractions")  # the rules that read a combination's parts
RULE_PARAMS = {"conservative": False}  # every rule's parameters and their defaults
UNMEASURED_PARTS = ("refuse", "whole")  # what `apply_rule` does with a part it is not given


@dataclasses.dataclass(frozen=True)
class Rule:
  """An admission rule, its parameters and the validation it passed ("Rules").

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
    max_kl: sup{x in [x_1, x_m] : g(x) <= tolerance}, nats per token; see the module docstring
      for the "above" (= x_m, a lower bound) and "below" (= 0) cases.
    interval: (low, high) bootstrap percentile interval of max_kl at the budget's level.
    censored: "none", "above" (the budget is at least max_kl) or "below" (below x_1); a
      per-source fit may also be "unconfirmed" (it crosses τ on too few records, so the source
      takes the overall limit; "Per-source limits" in the module docstring).
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
    sources: source name -> its own Threshold ("Per-source limits" in the module docstring).
    records: the input records, each copied into a dict, in input order.
    level: coverage of the bootstrap intervals.
    num_bootstrap: bootstrap resamples per fit.
    seed: the bootstrap seed.
    training: the same fit on the training-time axis ("Two axes"), or None.
    min_crossing_records: c, how many of a source's own records a crossing needs before the
      source gets its own limit ("Per-source limits").
    rule: the admission rule the budget is used with (`Rule`, "Rules"); None for a budget
      that names none (`apply_rule` then uses the pooled limit).
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
    """L_s, the limit of one source (module docstring); the overall one if s has no fit.

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


UNCALIBRATED = "uncalibrated"  # the name of the default where a budget file is asked for

UNCALIBRATED_MAX_KL = 0.033
"""The uncalibrated default limit, in nats/token of the check's mismatch/kl.

Where it comes from: the lowest knee measured over the calibrated student–teacher pairs, at the
lower end of its bootstrap interval. Today one pair is calibrated, the embedded task's
(docs/study/round7/budget.json, the same fit as round 6's and round 8's): its lowest knee is the
weight-noise limit, 0.0468 nats/token, interval [0.0333, 0.325] (95 %), where its isotonic fit
crosses τ = 4.3 accuracy points. Its other per-source fits are no knees: FP8 weights and FP8 KV
cross τ on one run each (unconfirmed), kernel and staleness never cross it ("above"); the pooled
limit is 0.233. The constant is that interval's lower end, 0.03325, rounded down to 0.033:
conservative, because a model it screens is not the one it was measured on, and a wrongly
admitted engine costs a degraded run where a wrongly refused one costs a slower engine. A later
pair's calibration with a lower knee lowers it, here and nowhere else.
"""


CALIBRATE_COMMAND = "python -m opd_jax.calibrate"  # how a user calibrates a budget of their own


def uncalibrated_note() -> str:
  """The words a check or a run that uses the default says it with: the limit, where it comes
  from, that it is uncalibrated, and how to calibrate one."""
  return (
    f"the uncalibrated default limit {UNCALIBRATED_MAX_KL:g} nats/token (the lowest knee over "
    "the calibrated pairs, at the lower end of its interval; calibrate your own with "
    f"{CALIBRATE_COMMAND})"
  )


def uncalibrated_budget() -> Budget:
  """The uncalibrated default (module docstring, "Uncalibrated default") as a Budget:
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


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The outcome of `admit` for one measurement.

  Attributes:
    admitted: True iff margin >= 0 and every checked layer margin >= 0.
    margin: limit − measured mismatch/kl, nats per token (negative: over budget).
    limit: the limit used: budget.max_kl (or its interval's lower end if conservative), or
      the strictest per-source limit of the measurement's sources.
    limit_source: the source whose limit was used, None for the overall one.
    limit_band: (the limit at the lower end of the bootstrap intervals, at their upper end),
      widened to hold `limit`; `too_close` says whether the measurement falls between them.
    measured_kl: the measurement's mismatch/kl (with `per_part`, the binding part's).
    conservative: whether the interval's lower end was used.
    reasons: one line per failed threshold (empty when admitted).
    layer_margins: layer -> its limit minus the measured "mismatch/kl/layer_<i>", for the layers
      that have a threshold and a measured value.
    rule: the name of the rule that gave the verdict (`apply_rule`), None from `admit`.
    fraction: sum_of_fractions only: F = Σ_s kl_s / L_s (admitted ⇔ F ≤ 1).
  """

  admitted: bool
  margin: float
  limit: float
  measured_kl: float
  conservative: bool
  reasons: tuple[str, ...]
  layer_margins: dict[int, float]
  limit_source: str | None = None
  limit_band: tuple[float, float] | None = None
  rule: str | None = None
  fraction: float | None = None

  @property
  def too_close(self) -> bool:
    """Whether the verdict is too close to call: lower < measured_kl ≤ upper for the limit's
    band, so that the rule at the lower end of the bootstrap intervals refuses and the rule at
    their upper end admits (layer thresholds aside)."""
    if self.limit_band is None:
      return False
    lower, upper = self.limit_band
    return lower < self.measured_kl <= upper


def _describe(index: int, record: Any) -> str:
  source = record.get("source", "?") if isinstance(record, Mapping) else "?"
  return f"record {index} (source {source!r})"


def _number(index: int, record: Mapping, key: str) -> float:
  if key not in record:
    raise ValueError(f"fit_budget: {_describe(index, record)} has no {key!r}")
  value = record[key]
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"fit_budget: {_describe(index, record)} has {key} {value!r}, not a number")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"fit_budget: {_describe(index, record)} has non-finite {key}: {value}")
  return value


def validate_records(records: Sequence[Mapping[str, Any]]):
  """Checks calibration records (format in the module docstring).

  Returns:
    (kl [n], drop [n], layer [n]) as numpy arrays, layer = -1 for records without "layer".

  Raises:
    ValueError: naming the first bad record (index and source) and its problem.
  """
  if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Sequence):
    raise ValueError(f"fit_budget: records must be a sequence of mappings, got {type(records)}")
  if not records:
    raise ValueError("fit_budget: records is empty; a fit needs records at >= 2 mismatch/kl values")
  kl, drop, layer = [], [], []
  for i, record in enumerate(records):
    if not isinstance(record, Mapping):
      raise ValueError(f"fit_budget: record {i} is a {type(record).__name__}, not a mapping")
    if "source" not in record:
      raise ValueError(f"fit_budget: {_describe(i, record)} has no 'source'")
    kl.append(_number(i, record, KL_KEY))
    drop.append(_number(i, record, DROP_KEY))
    if LAYER_KEY in record:
      value = record[LAYER_KEY]
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
          f"fit_budget: {_describe(i, record)} has layer {value!r}, not a non-negative int"
        )
      layer.append(int(value))
    else:
      layer.append(-1)
  return np.asarray(kl, np.float64), np.asarray(drop, np.float64), np.asarray(layer, np.int64)


def isotonic_fit(kl: np.ndarray, drop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Weighted isotonic regression of drop on kl by pool-adjacent-violators.

  Records at equal kl are pooled first (weight = their count, value = their mean drop); then
  f = argmin Σ_j w_j (ȳ_j − f_j)² subject to f_1 <= … <= f_m, as in the module docstring.

  Args:
    kl: [n] mismatch values, any order, ties allowed.
    drop: [n] quality drops.

  Returns:
    (x [m], f [m]): the distinct kl values ascending and the fitted non-decreasing drops.
  """
  x, inverse, counts = np.unique(kl, return_inverse=True, return_counts=True)
  sums = np.bincount(inverse, weights=drop, minlength=len(x))
  # Stack of blocks (sum of drops, weight, number of distinct points pooled).
  block_sum, block_weight, block_len = [], [], []
  for s, w in zip(sums.tolist(), counts.tolist(), strict=True):
    block_sum.append(s)
    block_weight.append(float(w))
    block_len.append(1)
    # Merge while the block below has a larger mean: s1/w1 > s2/w2 (weights are positive).
    while (
      len(block_sum) > 1 and block_sum[-2] * block_weight[-1] > block_sum[-1] * block_weight[-2]
    ):
      s2, w2, n2 = block_sum.pop(), block_weight.pop(), block_len.pop()
      block_sum[-1] += s2
      block_weight[-1] += w2
      block_len[-1] += n2
  means = [s / w for s, w in zip(block_sum, block_weight, strict=True)]
  f = np.repeat(np.asarray(means, np.float64), block_len)
  return x, f


def _crossing(x: np.ndarray, f: np.ndarray, tolerance: float) -> tuple[float, str]:
  """max_kl and its censoring for a fitted curve (x ascending, f non-decreasing)."""
  within = np.nonzero(f <= tolerance)[0]
  if within.size == 0:
    return 0.0, "below"
  k = int(within[-1])
  if k == len(x) - 1:
    return float(x[-1]), "above"
  # f[k] <= tolerance < f[k + 1], so the denominator is positive.
  t = (tolerance - f[k]) / (f[k + 1] - f[k])
  return float(x[k] + t * (x[k + 1] - x[k])), "none"


def _fit_one(
  kl: np.ndarray, drop: np.ndarray, tolerance: float, level: float, num_bootstrap: int, seed
) -> Threshold:
  x, f = isotonic_fit(kl, drop)
  max_kl, censored = _crossing(x, f, tolerance)
  rng = np.random.default_rng(seed)
  n = len(kl)
  draws = np.empty(num_bootstrap, np.float64)
  for b in range(num_bootstrap):
    idx = rng.integers(0, n, size=n)
    bx, bf = isotonic_fit(kl[idx], drop[idx])
    draws[b] = _crossing(bx, bf, tolerance)[0]
  alpha = (1.0 - level) / 2.0
  low, high = np.quantile(draws, [alpha, 1.0 - alpha])
  return Threshold(
    max_kl=max_kl,
    interval=(float(low), float(high)),
    censored=censored,
    curve_kl=tuple(float(v) for v in x),
    curve_drop=tuple(float(v) for v in f),
    num_records=n,
  )


def _too_few(what: str, records: Sequence[Mapping], indices: np.ndarray) -> str:
  named = ", ".join(
    f"{i} (source {records[i]['source']!r}, mismatch/kl {records[i][KL_KEY]!r})"
    for i in indices[:5].tolist()
  )
  more = f" and {len(indices) - 5} more" if len(indices) > 5 else ""
  count = f"{len(indices)} record" + ("s" if len(indices) != 1 else "")
  return (
    f"fit_budget: {what} needs records at >= {MIN_DISTINCT_KL} distinct mismatch/kl values; "
    f"got {count}: {named}{more}"
  )


def fit_budget(
  records: Sequence[Mapping[str, Any]],
  tolerance: float,
  *,
  level: float = LEVEL,
  num_bootstrap: int = NUM_BOOTSTRAP,
  seed: int = SEED,
  min_crossing_records: int = MIN_CROSSING_RECORDS,
) -> Budget:
  """Fits the mismatch budget: the largest mismatch/kl whose predicted quality drop <= tolerance.

  Pure: no I/O, no clock, no global state; the bootstrap Generator is seeded from `seed`, so the
  same arguments give an equal Budget, and `records` is not modified. The fit, the censoring
  rules and the record format (overall records, and per-layer scan records with "layer": i) are
  in the module docstring.

  Args:
    records: sequence of n mappings, each with "source", "mismatch/kl" (finite, nats per token)
      and "quality_drop" (finite); optionally "layer" (int >= 0) and any other keys.
    tolerance: τ >= 0, the largest acceptable quality drop, in quality_drop's units.
    level: coverage of the bootstrap interval, in (0, 1).
    num_bootstrap: B >= 1 resamples per fit.
    seed: seed of the bootstrap Generator (per-layer fits use the seed sequence (seed, 1 + i)).
    min_crossing_records: c >= 1; a source whose fit crosses τ on fewer than c of its own
      records is "unconfirmed" and takes the overall limit ("Per-source limits").

  Returns:
    A Budget with the overall Threshold (from the records without "layer"), one Threshold per
    layer whose scan records span >= 2 distinct mismatch/kl values, one per source whose own
    records and the reference's span >= 2 ("Per-source limits"; bootstrap seed sequence
    (seed, 0, 1 + j) for the j-th source in sorted order), and the records copied.

  Raises:
    ValueError: empty records, a record that is not a mapping, a missing key, a non-numeric or
      non-finite value, a bad "layer", overall records at fewer than 2 distinct mismatch/kl
      values, or a bad tolerance/level/num_bootstrap/seed/min_crossing_records; the message
      names the record (index and source) where there is one.
  """
  if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real):
    raise ValueError(f"fit_budget: tolerance must be a number, got {tolerance!r}")
  tolerance = float(tolerance)
  if not (math.isfinite(tolerance) and tolerance >= 0):
    raise ValueError(f"fit_budget: tolerance must be finite and >= 0, got {tolerance}")
  if not 0.0 < level < 1.0:
    raise ValueError(f"fit_budget: level must be in (0, 1), got {level}")
  if isinstance(num_bootstrap, bool) or not isinstance(num_bootstrap, int) or num_bootstrap < 1:
    raise ValueError(f"fit_budget: num_bootstrap must be an int >= 1, got {num_bootstrap!r}")
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"fit_budget: seed must be an int >= 0, got {seed!r}")
  if (
    isinstance(min_crossing_records, bool)
    or not isinstance(min_crossing_records, int)
    or min_crossing_records < 1
  ):
    raise ValueError(
      f"fit_budget: min_crossing_records must be an int >= 1, got {min_crossing_records!r}"
    )
  kl, drop, layer = validate_records(records)

  overall_idx = np.nonzero(layer < 0)[0]
  if overall_idx.size == 0:
    raise ValueError(
      f"fit_budget: all {len(records)} records have a 'layer' key; the overall fit needs "
      f"records without one at >= {MIN_DISTINCT_KL} distinct mismatch/kl values"
    )
  if np.unique(kl[overall_idx]).size < MIN_DISTINCT_KL:
    raise ValueError(_too_few("the overall fit", records, overall_idx))
  overall = _fit_one(kl[overall_idx], drop[overall_idx], tolerance, level, num_bootstrap, seed)

  layers, unfitted = {}, []
  for i in np.unique(layer[layer >= 0]).tolist():
    idx = np.nonzero(layer == i)[0]
    if np.unique(kl[idx]).size < MIN_DISTINCT_KL:
      unfitted.append(i)
      continue
    layers[i] = _fit_one(kl[idx], drop[idx], tolerance, level, num_bootstrap, [seed, 1 + i])

  source = np.asarray(
    [r[SOURCE_KEY] if isinstance(r[SOURCE_KEY], str) else "" for r in records], dtype=object
  )
  anchor = (layer < 0) & (source == REFERENCE_SOURCE)
  singles = sorted(
    {s for s in source[overall_idx].tolist() if s and s != REFERENCE_SOURCE and "+" not in s}
  )
  sources = {}
  for j, name in enumerate(singles):
    idx = np.nonzero(((layer < 0) & (source == name)) | anchor)[0]
    if np.unique(kl[idx]).size >= MIN_DISTINCT_KL:
      fitted = _fit_one(kl[idx], drop[idx], tolerance, level, num_bootstrap, [seed, 0, 1 + j])
      own = np.nonzero((layer < 0) & (source == name))[0]
      crosses = fitted.censored in ("none", "below")
      if crosses and _crossing_records(fitted, kl[own], tolerance) < min_crossing_records:
        fitted = dataclasses.replace(fitted, censored="unconfirmed")
      sources[name] = fitted

  return Budget(
    tolerance=tolerance,
    overall=overall,
    layers=layers,
    unfitted_layers=tuple(unfitted),
    records=tuple(dict(r) for r in records),
    sources=sources,
    level=float(level),
    num_bootstrap=num_bootstrap,
    seed=seed,
    min_crossing_records=min_crossing_records,
  )


def _crossing_records(threshold: Threshold, kl: np.ndarray, tolerance: float) -> int:
  """How many of `kl` (a source's own records) sit where the fit is over τ."""
  x, f = np.asarray(threshold.curve_kl), np.asarray(threshold.curve_drop)
  over = x[f > tolerance]
  return int(np.isin(kl, over).sum())


def _measured(measurement: Mapping, key: str) -> float:
  value = measurement[key]
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"admit: measurement has {key} {value!r}, not a number")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"admit: measurement has non-finite {key}: {value}")
  return value


def _over(
  name: str, kl: float, threshold: Threshold, limit: float, conservative: bool, tolerance: float
) -> str:
  """The reason line for a mismatch `kl` above `limit` under `threshold`."""
  if threshold.num_records == 0:
    return (
      f"{name} {kl:.4g} > {limit:.4g}, the uncalibrated default limit (no calibration record "
      f"of this model behind it): margin {limit - kl:.4g}"
    )
  if threshold.censored == "below":
    return (
      f"{name} {kl:.4g} > 0: every calibrated mismatch is over the tolerance {tolerance:.4g} "
      f"(the smallest, {threshold.curve_kl[0]:.4g}, predicts a drop of "
      f"{threshold.curve_drop[0]:.4g}), so the budget is below {threshold.curve_kl[0]:.4g} "
      "and only zero mismatch is admitted"
    )
  if conservative:
    low, high = threshold.interval
    return (
      f"{name} {kl:.4g} > {limit:.4g}, the lower end of the max_kl interval "
      f"[{low:.4g}, {high:.4g}] (max_kl {threshold.max_kl:.4g}, tolerance {tolerance:.4g}): "
      f"margin {limit - kl:.4g}"
    )
  if threshold.censored == "above":
    return (
      f"{name} {kl:.4g} > {limit:.4g}, the largest calibrated mismatch, which is still within "
      f"the tolerance {tolerance:.4g}: the budget is at least {limit:.4g} (censored), but no "
      "record says how far beyond"
    )
  return (
    f"{name} {kl:.4g} > max_kl {limit:.4g} (tolerance {tolerance:.4g}): margin {limit - kl:.4g}"
  )


def _over_source(kl: float, budget: Budget, source: str, limit: float) -> str:
  """The reason line for a mismatch `kl` above source `source`'s limit L_s."""
  threshold = budget.sources.get(source)
  head = f"{KL_KEY} {kl:.4g} > {limit:.4g}, the limit of source {source!r}"
  if threshold is None:
    why = "which has no fit of its own, so the overall budget applies"
  elif threshold.censored == "none":
    why = f"where its own fit predicts the tolerance {budget.tolerance:.4g}"
  elif threshold.censored == "unconfirmed":
    why = (
      f"whose own fit crosses τ on fewer than {budget.min_crossing_records} of its records "
      f"(unconfirmed), so the overall max_kl {budget.overall.max_kl:.4g} applies"
    )
  elif threshold.censored == "below":
    why = f"whose smallest calibrated mismatch, {threshold.curve_kl[0]:.4g}, is already over τ"
  else:
    why = (
      f"the larger of its largest calibrated mismatch {threshold.curve_kl[-1]:.4g} (still "
      f"within τ) and the overall max_kl {budget.overall.max_kl:.4g}"
    )
  return f"{head}, {why}: margin {limit - kl:.4g}"


def _limits(budget: Budget, sources: Sequence[str], conservative: bool):
  """((limit, its source), band) for a measurement naming `sources` (`Budget.limit_for`)."""
  limit, limit_source = budget.limit_for(sources, end="lower" if conservative else "point")
  lower = limit if conservative else budget.limit_for(sources, end="lower")[0]
  upper = budget.limit_for(sources, end="upper")[0]
  band = (min(lower, limit), max(upper, limit))  # a percentile interval may miss the estimate
  return (limit, limit_source), band


def admit(
  measurement: Mapping[str, Any],
  budget: Budget,
  *,
  conservative: bool = False,
  per_source: bool = True,
  per_part: bool = False,
) -> Verdict:
  """Screens one measured rollout configuration against a budget.

  With limit = budget.max_kl (or, if `conservative`, the lower end of budget.interval), or,
  when `per_source` and the measurement has "source" (sources joined by "+") and the budget has
  per-source fits, limit = min_s L_s over those sources (module docstring):

    margin = limit − measurement["mismatch/kl"]            (nats per token)
    admitted ⇔ margin >= 0  and  limit_i − measurement["mismatch/kl/layer_<i>"] >= 0
               for every layer i that has a threshold in the budget and a value in the
               measurement (limit_i likewise max_kl or the interval's lower end of layer i).

  Layers measured but not in the budget, and budget layers not measured, are not checked.

  Per part (`per_part`, for a combination of sources): each source s of the measurement's
  "source" is held to its own limit with the mismatch of its part alone, kl_s =
  measurement["mismatch/kl/part/<s>"] (the check run on the combination's overrides of that
  source only), instead of min_s L_s on the whole combination's mismatch/kl:

    margin = min_s (L_s − kl_s),   admitted ⇔ margin >= 0 (and the layers, as above).

  A combination's mismatch is not the sum of its parts', but a source with a generous limit
  (staleness) can contribute most of it, and holding that to the strictest source's limit
  refuses what that source's own records allow (docs/study/round6). The verdict's limit,
  limit_source, limit_band and measured_kl are then the binding part's (least margin). A
  single-source measurement is checked as without `per_part`.

  Args:
    measurement: mapping with "mismatch/kl" (finite) and optionally "mismatch/kl/layer_<i>"
      and "source" (str).
    budget: from fit_budget (or load_budget).
    conservative: use the lower end of each bootstrap interval instead of the point estimate.
    per_source: use the measurement's per-source limits when it names its sources.
    per_part: hold each part of a combination to its own source's limit (above); needs
      `per_source` and a "mismatch/kl/part/<s>" for every source s the measurement names.

  Returns:
    A Verdict; `reasons` names each threshold that failed.

  Raises:
    ValueError: "mismatch/kl" missing, a part missing for `per_part`, or a checked value
      non-numeric or non-finite.
  """
  if not isinstance(measurement, Mapping):
    raise ValueError(f"admit: measurement must be a mapping, got {type(measurement).__name__}")
  if KL_KEY not in measurement:
    raise ValueError(f"admit: measurement has no {KL_KEY!r}")
  kl = _measured(measurement, KL_KEY)
  sources = _sources(measurement) if per_source else ()
  parts, part = [s for s in sources if s != REFERENCE_SOURCE], None
  if per_part and per_source and len(parts) > 1:
    _require_parts(measurement, parts, "per_part")
    by_margin = []
    for s in parts:
      part_kl = _measured(measurement, f"{PART_KL_PREFIX}{s}")
      by_margin.append((_limits(budget, [s], conservative)[0][0] - part_kl, s, part_kl))
    _, part, kl = min(by_margin)
    sources = (part,)
  (limit, limit_source), band = _limits(budget, sources, conservative)
  margin = limit - kl
  reasons = []
  if margin < 0 and limit_source is None:
    reasons.append(_over(KL_KEY, kl, budget.overall, limit, conservative, budget.tolerance))
  elif margin < 0:
    line = _over_source(kl, budget, limit_source, limit)
    reasons.append(line if part is None else f"its {part} part alone: {line}")
  layer_margins, layer_reasons = _layer_check(measurement, budget, conservative)
  reasons += layer_reasons
  return Verdict(
    admitted=not reasons,
    margin=margin,
    limit=limit,
    measured_kl=kl,
    conservative=conservative,
    reasons=tuple(reasons),
    layer_margins=layer_margins,
    limit_source=limit_source,
    limit_band=band,
  )


def _layer_check(measurement: Mapping, budget: Budget, conservative: bool):
  """(layer -> margin, reason lines) of the measurement's per-layer values (`admit`)."""
  margins, reasons = {}, []
  for i in sorted(budget.layers):
    key = f"{LAYER_KL_PREFIX}{i}"
    if key not in measurement:
      continue
    value = _measured(measurement, key)
    threshold = budget.layers[i]
    layer_limit = threshold.interval[0] if conservative else threshold.max_kl
    margins[i] = layer_limit - value
    if margins[i] < 0:
      line = _over(key, value, threshold, layer_limit, conservative, budget.tolerance)
      reasons.append(f"layer {i}: {line}")
  return margins, reasons


def _sources(measurement: Mapping) -> tuple[str, ...]:
  """The sources a measurement names ("source", "+"-joined), () when it names none."""
  named = measurement.get(SOURCE_KEY)
  if named is not None and not isinstance(named, str):
    raise ValueError(f"admit: measurement has source {named!r}, not a '+'-joined string")
  return tuple(named.split("+")) if named else ()


def measurement_parts(measurement: Mapping) -> tuple[str, ...]:
  """The parts a rule that reads parts needs measured: the measurement's named sources other
  than "reference" when there are two or more, else () (a single source is its own part)."""
  parts = tuple(s for s in _sources(measurement) if s != REFERENCE_SOURCE)
  return parts if len(parts) > 1 else ()


def _require_parts(measurement: Mapping, parts: Sequence[str], rule: str) -> None:
  missing = [s for s in parts if f"{PART_KL_PREFIX}{s}" not in measurement]
  if missing:
    raise ValueError(
      f"admit: the {rule} rule needs each source's part measured alone; the measurement of "
      f"{measurement.get(SOURCE_KEY)!r} has no "
      f"{', '.join(repr(PART_KL_PREFIX + s) for s in missing)}"
    )


def _sum_of_fractions(measurement: Mapping, budget: Budget, conservative: bool) -> Verdict:
  """The sum_of_fractions verdict ("Rules"): F = Σ_s kl_s / L_s, admitted ⇔ F ≤ 1.

  The verdict's limit is the whole's kl at which F would reach 1 with every part scaled alike,
  kl / F (min_s L_s when F = 0), so that margin = limit − kl ≥ 0 ⇔ F ≤ 1; its band is that
  limit with every L_s at the lower and at the upper end of its interval, and limit_source the
  part with the largest share of F. A term with L_s = 0 is 0 for kl_s = 0, else infinite.
  """
  kl = _measured(measurement, KL_KEY)
  parts = measurement_parts(measurement)
  if parts:
    _require_parts(measurement, parts, "sum_of_fractions")
    kls = {s: _measured(measurement, f"{PART_KL_PREFIX}{s}") for s in parts}
  else:
    named = [s for s in _sources(measurement) if s != REFERENCE_SOURCE]
    kls = {named[0] if named else None: kl}

  def limit_of(source: str | None, end: str) -> float:
    return budget.limit_for([source] if source else [], end=end)[0]

  def terms(end: str) -> dict:
    out = {}
    for s, value in kls.items():
      limit = limit_of(s, end)
      out[s] = value / limit if limit > 0 else (0.0 if value <= 0 else math.inf)
    return out

  def whole_limit(fraction: float, end: str) -> float:
    if fraction > 0:
      return kl / fraction
    return min(limit_of(s, end) for s in kls)

  end = "lower" if conservative else "point"
  shares = terms(end)
  fraction = float(sum(shares.values()))
  limit = whole_limit(fraction, end)
  lower = limit if conservative else whole_limit(float(sum(terms("lower").values())), "lower")
  upper = whole_limit(float(sum(terms("upper").values())), "upper")
  binding = max(shares, key=lambda s: shares[s])
  reasons = []
  if fraction > 1:
    listed = " + ".join(
      f"{s or 'overall'} {kls[s]:.4g}/{limit_of(s, end):.4g}" for s in sorted(kls, key=str)
    )
    reasons.append(f"Σ part/limit = {listed} = {fraction:.4g} > 1")
  layer_margins, layer_reasons = _layer_check(measurement, budget, conservative)
  reasons += layer_reasons
  return Verdict(
    admitted=not reasons,
    margin=limit - kl,
    limit=limit,
    measured_kl=kl,
    conservative=conservative,
    reasons=tuple(reasons),
    layer_margins=layer_margins,
    limit_source=binding,
    limit_band=(min(lower, limit), max(upper, limit)),
    fraction=fraction,
  )


def apply_rule(
  measurement: Mapping[str, Any],
  budget: Budget,
  rule: Rule | None = None,
  *,
  unmeasured_parts: str = "refuse",
) -> Verdict:
  """The verdict of `rule` ("Rules" in the module docstring) on one measurement: the one
  function the admission check, the live guard and the study reach a verdict through.

    pooled            admitted ⇔ kl ≤ L
    whole             admitted ⇔ kl ≤ min_s L_s
    per_part          admitted ⇔ kl_s ≤ L_s for every part s   (margin = min_s (L_s − kl_s))
    sum_of_fractions  admitted ⇔ F = Σ_s kl_s / L_s ≤ 1        (margin = kl / F − kl)

  and, for every rule, every measured layer within its own limit (`admit`).

  Args:
    measurement: as for `admit`: "mismatch/kl", "source" ("+"-joined), and for a rule that
      reads parts and a measurement naming two or more sources, "mismatch/kl/part/<s>" for
      each of them (`measurement_parts`).
    budget: the fitted or loaded Budget.
    rule: the rule to apply; None takes `budget.rule`, and the pooled rule when that is None.
    unmeasured_parts: "refuse" (a missing part raises) or "whole" (a missing part is taken
      as the whole's kl: the stand-in where parts cannot be measured, as in a training step).

  Returns:
    A Verdict with `rule` set to the rule's name.

  Raises:
    ValueError: an unknown `unmeasured_parts`, a rule that is not a Rule, a missing part with
      "refuse", or a measurement `admit` refuses.
  """
  if unmeasured_parts not in UNMEASURED_PARTS:
    raise ValueError(
      f"unmeasured_parts={unmeasured_parts!r}: expected one of {', '.join(UNMEASURED_PARTS)}"
    )
  rule = budget.rule if rule is None else rule
  rule = POOLED if rule is None else rule
  if not isinstance(rule, Rule):
    raise ValueError(f"apply_rule: rule must be a Rule, got {rule!r}")
  if not isinstance(measurement, Mapping):
    raise ValueError(f"admit: measurement must be a mapping, got {type(measurement).__name__}")
  conservative = rule.conservative
  if rule.needs_parts and unmeasured_parts == "whole" and KL_KEY in measurement:
    whole = measurement[KL_KEY]
    filled = {f"{PART_KL_PREFIX}{s}": whole for s in measurement_parts(measurement)}
    measurement = {**filled, **measurement}
  if rule.name == "pooled":
    verdict = admit(measurement, budget, conservative=conservative, per_source=False)
  elif rule.name == "whole":
    verdict = admit(measurement, budget, conservative=conservative, per_source=True)
  elif rule.name == "per_part":
    verdict = admit(measurement, budget, conservative=conservative, per_part=True)
  else:
    verdict = _sum_of_fractions(measurement, budget, conservative)
  return dataclasses.replace(verdict, rule=rule.name)
