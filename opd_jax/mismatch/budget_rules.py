"""Admission rules: the verdict of a budget on one measurement (`Verdict`, `admit`, and
`apply_rule`, the one function the admission check, the live guard and the study reach a
verdict through).

The rules (pooled, whole, per_part, sum_of_fractions), what they read and why are in
docs/budget_rules.md; the limits they compare with are `Budget.source_limit` and
`Budget.limit_for`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from opd_jax.mismatch.budget import (
  BEYOND_RANGE,
  EXTRAPOLATE,
  KL_KEY,
  LAYER_KL_PREFIX,
  PART_KL_PREFIX,
  POOLED,
  REFERENCE_SOURCE,
  SOURCE_KEY,
  UNCALIBRATED_SOURCE,
  UNMEASURED_PARTS,
  Budget,
  Rule,
  Threshold,
  finite_number,
  is_uncalibrated,
  uncalibrated_budget,
)


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
    extrapolation: UNCALIBRATED_SOURCE or BEYOND_RANGE when the budget's records do not reach
      the measurement (`extrapolation`), else None.
    extrapolate: what was done then (one of EXTRAPOLATE), None when nothing was extrapolated.
    extrapolation_reasons: one line per part outside the budget's records.
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
  extrapolation: str | None = None
  extrapolate: str | None = None
  extrapolation_reasons: tuple[str, ...] = ()

  @property
  def too_close(self) -> bool:
    """Whether the verdict is too close to call: lower < measured_kl ≤ upper for the limit's
    band, so that the rule at the lower end of the bootstrap intervals refuses and the rule at
    their upper end admits (layer thresholds aside). Never for an extrapolation refused."""
    if self.limit_band is None or self.extrapolate == "refuse":
      return False
    lower, upper = self.limit_band
    return lower < self.measured_kl <= upper


def _measured(measurement: Mapping, key: str) -> float:
  return finite_number(measurement[key], "admit: measurement", key)


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
  per-source fits, limit = min_s L_s over those sources (`Budget.source_limit`):

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
  """The sum_of_fractions verdict (docs/budget_rules.md): F = Σ_s kl_s / L_s, admitted ⇔ F ≤ 1.

  The verdict's limit is the whole's kl at which F would reach 1 with every part scaled alike,
  kl / F, so that for kl > 0 margin = limit − kl ≥ 0 ⇔ F ≤ 1. When F = 0 (nothing measured,
  as where the guard asks for its limit at kl = 0) the parts have no direction, and the limit
  is the one of equal parts, 1 / Σ_s (1 / L_s): the point where parts each standing in for the
  whole's kl (`apply_rule`'s unmeasured_parts="whole") reach F = 1. Its band is that
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
    limits = [limit_of(s, end) for s in kls]
    inverse = sum(1.0 / limit if limit > 0 else math.inf for limit in limits)
    return 1.0 / inverse if inverse > 0 else math.inf

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


def extrapolation(measurement: Mapping, budget: Budget) -> tuple[str | None, tuple[str, ...]]:
  """Whether judging `measurement` extrapolates beyond the budget's records
  (docs/budget_rules.md, "No silent extrapolation"), and why.

  For each source s the measurement names (the reference aside), with R_s = (min, max) its
  `Budget.calibrated_range` and x_s its reading (its part's "mismatch/kl/part/<s>" when
  measured, else the whole's mismatch/kl):

    UNCALIBRATED_SOURCE   some s has no R_s (no record of that source),
    BEYOND_RANGE          else some x_s > max R_s.

  A combination whose parts were not measured but which was itself calibrated ("noise+stale"
  has records) is checked as one source. A budget with no records (the uncalibrated default)
  and a measurement naming no source extrapolate nothing.

  Returns:
    (UNCALIBRATED_SOURCE, BEYOND_RANGE or None; one line per part outside the records).
  """
  parts = [s for s in _sources(measurement) if s != REFERENCE_SOURCE]
  if not parts or is_uncalibrated(budget):
    return None, ()
  ranges = budget.calibrated_range
  kl = _measured(measurement, KL_KEY)
  whole = "+".join(parts)
  measured_parts = all(f"{PART_KL_PREFIX}{s}" in measurement for s in parts)
  if len(parts) > 1 and not measured_parts and whole in ranges:
    parts = [whole]
  missing = [s for s in parts if s not in ranges]
  if missing:
    known = ", ".join(ranges) or "none"
    return UNCALIBRATED_SOURCE, tuple(
      f"{UNCALIBRATED_SOURCE}: the budget has no calibration record of source {s!r} "
      f"(calibrated: {known})"
      for s in missing
    )
  lines = []
  for s in parts:
    key = f"{PART_KL_PREFIX}{s}"
    value = _measured(measurement, key) if len(parts) > 1 and key in measurement else kl
    low, high = ranges[s]
    if value > high:
      lines.append(
        f"{BEYOND_RANGE}: {s} reads {value:.4g}, above {high:.4g}, the largest mismatch/kl "
        f"of its calibration records (range [{low:.4g}, {high:.4g}])"
      )
  return (BEYOND_RANGE, tuple(lines)) if lines else (None, ())


def _extrapolated(verdict: Verdict, measurement, kind, lines, extrapolate) -> Verdict:
  """The verdict on a measurement the budget does not reach, as `extrapolate` says."""
  if extrapolate == "refuse":
    why = (
      f"refused: judging it would extrapolate the budget ({kind}); pass --extrapolate=pooled "
      "or --extrapolate=default to judge it against the pooled or the uncalibrated default "
      "limit instead"
    )
    return dataclasses.replace(
      verdict,
      admitted=False,
      reasons=(*lines, why, *verdict.reasons),
      extrapolation=kind,
      extrapolate=extrapolate,
      extrapolation_reasons=lines,
    )
  if extrapolate == "default":
    verdict = admit(
      measurement, uncalibrated_budget(), conservative=verdict.conservative, per_source=False
    )
  return dataclasses.replace(
    verdict, extrapolation=kind, extrapolate=extrapolate, extrapolation_reasons=lines
  )


def apply_rule(
  measurement: Mapping[str, Any],
  budget: Budget,
  rule: Rule | None = None,
  *,
  unmeasured_parts: str = "refuse",
  extrapolate: str = "refuse",
) -> Verdict:
  """The verdict of `rule` (docs/budget_rules.md) on one measurement: the one
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
    extrapolate: a measurement the budget's records do not reach (`extrapolation`): "refuse"
      it (the default); "pooled": the rule's verdict, in which a source with no fit of its own
      or read past its records is held to the pooled limit (`Budget.source_limit`); "default":
      the pooled rule against the uncalibrated default limit. The verdict's `extrapolation`
      says which case it was either way.

  Returns:
    A Verdict with `rule` set to the rule's name.

  Raises:
    ValueError: an unknown `unmeasured_parts` or `extrapolate`, a rule that is not a Rule, a
      missing part with "refuse", or a measurement `admit` refuses.
  """
  if extrapolate not in EXTRAPOLATE:
    raise ValueError(f"extrapolate={extrapolate!r}: expected one of {', '.join(EXTRAPOLATE)}")
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
  as_measured = measurement  # the parts filled in below were not measured (`extrapolation`)
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
  kind, lines = extrapolation(as_measured, budget)
  if kind is not None:
    verdict = _extrapolated(verdict, measurement, kind, lines, extrapolate)
  return dataclasses.replace(verdict, rule=rule.name)
