"""`fit_budget`: calibration records to a `Budget`, by an isotonic fit of quality drop against
`mismatch/kl` and its crossing of the tolerance τ, with bootstrap intervals.

Pure: no I/O, no clock, no global state; the bootstrap draws from a numpy Generator seeded
from an argument (default `budget.SEED`), so the same records, in any order, give an equal
Budget (each fit sorts its records before resampling them), and the records passed in are
never modified. The record format and the reasons behind the per-source
limits are in docs/design.md ("Budget and admission").
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opd_jax.mismatch.budget import (
  DROP_KEY,
  KL_KEY,
  LAYER_KEY,
  LEVEL,
  MIN_CROSSING_RECORDS,
  MIN_DISTINCT_KL,
  NUM_BOOTSTRAP,
  REFERENCE_SOURCE,
  SEED,
  SOURCE_KEY,
  Budget,
  Threshold,
  finite_number,
)


def _describe(index: int, record: Any) -> str:
  source = record.get("source", "?") if isinstance(record, Mapping) else "?"
  return f"record {index} (source {source!r})"


def _number(index: int, record: Mapping, key: str) -> float:
  if key not in record:
    raise ValueError(f"fit_budget: {_describe(index, record)} has no {key!r}")
  return finite_number(record[key], f"fit_budget: {_describe(index, record)}", key)


def validate_records(records: Sequence[Mapping[str, Any]]):
  """Checks calibration records.

  A record is a mapping with at least "source" (what was perturbed, str), "mismatch/kl" (the
  mismatch the admission check measures for that configuration, nats per completion token) and
  "quality_drop" (reference quality minus the run's, bigger is worse); an integer "layer": i
  makes it a scan record of decoder layer i (only that layer perturbed), which feeds layer i's
  threshold, not the overall fit. Other keys are kept in `Budget.records` untouched.

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

  With x_1 < … < x_m the distinct kl values and ȳ_j the mean drop of the w_j records at x_j:

    f = argmin_f  Σ_j w_j (ȳ_j − f_j)²   subject to  f_1 ≤ f_2 ≤ … ≤ f_m,

  computed exactly by pool-adjacent-violators: scan j = 1…m keeping a stack of blocks, each
  holding the weighted mean of the points it pooled; push point j as a block, and while the
  block below the top has a larger mean than the top, merge the two. Every point's fitted value
  is its block's mean.

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


def crossing(x: np.ndarray, f: np.ndarray, tolerance: float) -> tuple[float, str]:
  """max_kl and its censoring for a fitted curve (x ascending, f non-decreasing).

  With g the curve interpolated linearly between its points (never extrapolated), max_kl =
  sup{x ∈ [x_1, x_m] : g(x) ≤ τ}; with k the last index such that f_k ≤ τ:

    max_kl = x_k + (τ − f_k) / (f_{k+1} − f_k) · (x_{k+1} − x_k)   when k < m ("none"),
    max_kl = x_m                                                   when k = m ("above"),
    max_kl = 0                                                     when f_1 > τ ("below").

  "above" is a lower bound (the data say nothing past x_m); "below" admits only zero mismatch
  (the budget lies somewhere in [0, x_1)).
  """
  within = np.nonzero(f <= tolerance)[0]
  if within.size == 0:
    return 0.0, "below"
  k = int(within[-1])
  if k == len(x) - 1:
    return float(x[-1]), "above"
  # f[k] <= tolerance < f[k + 1], so the denominator is positive.
  t = (tolerance - f[k]) / (f[k + 1] - f[k])
  return float(x[k] + t * (x[k + 1] - x[k])), "none"


def knee_bracket(x: np.ndarray, f: np.ndarray, tolerance: float) -> tuple[float, float]:
  """The rungs (a, b] that bracket a fitted curve's crossing of τ (x ascending, f
  non-decreasing): with k the last index such that f_k ≤ τ,

    (a, b] = (x_k, x_(k+1)]   when k < m ("none": the last rung the fit keeps, the first it
                              does not; the crossing is somewhere between, whatever the fit
                              interpolates),
    (a, b] = (0, x_1]         when f_1 > τ ("below"),
    (a, b] = (x_m, ∞)         when k = m ("above": no rung degraded).

  The data cannot place the knee more finely than this: any curve through the rungs' drops
  crosses τ inside it.
  """
  x, f = np.asarray(x, np.float64), np.asarray(f, np.float64)
  within = np.nonzero(f <= tolerance)[0]
  if within.size == 0:
    return 0.0, float(x[0])
  k = int(within[-1])
  if k == len(x) - 1:
    return float(x[-1]), math.inf
  return float(x[k]), float(x[k + 1])


def threshold_bracket(threshold: Threshold, tolerance: float) -> tuple[float, float]:
  """`knee_bracket` of a fitted Threshold's curve at τ."""
  return knee_bracket(np.asarray(threshold.curve_kl), np.asarray(threshold.curve_drop), tolerance)


def bracketed_interval(interval, bracket) -> tuple[float, float]:
  """A knee's interval widened to contain its bracket (a, b] when b is finite:
  (min(low, a), max(high, b)). A bootstrap interval can be narrower than the gap between the
  rungs (the resamples interpolate between the same two rungs); the knee is only known to lie
  in the bracket, so the interval reported holds all of it. With b = ∞ ("above") the interval
  is left as it is: the knee is a lower bound there."""
  low, high = interval
  a, b = bracket
  if not math.isfinite(b):
    return float(low), float(high)
  return float(min(low, a)), float(max(high, b))


def _key(name: str) -> int:
  """A source's part of its bootstrap seed: crc32 of its name (stable across runs and sets)."""
  return zlib.crc32(name.encode("utf-8"))


def _fit_one(
  kl: np.ndarray, drop: np.ndarray, tolerance: float, level: float, num_bootstrap: int, seed
) -> Threshold:
  order = np.lexsort((drop, kl))  # canonical: the records' order does not change the draws
  kl, drop = kl[order], drop[order]
  x, f = isotonic_fit(kl, drop)
  max_kl, censored = crossing(x, f, tolerance)
  rng = np.random.default_rng(seed)
  n = len(kl)
  draws = np.empty(num_bootstrap, np.float64)
  for b in range(num_bootstrap):
    idx = rng.integers(0, n, size=n)
    bx, bf = isotonic_fit(kl[idx], drop[idx])
    draws[b] = crossing(bx, bf, tolerance)[0]
  alpha = (1.0 - level) / 2.0
  low, high = np.quantile(draws, [alpha, 1.0 - alpha])
  return Threshold(
    max_kl=max_kl,
    interval=bracketed_interval((low, high), knee_bracket(x, f, tolerance)),
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
  same arguments give an equal Budget, whatever the order of `records`, which is not modified.
  The fit, the censoring rules and the record format are in `crossing` and `validate_records`.
  Each fit's `interval` is the equal-tailed percentile interval at `level` (numpy's linear
  quantile) of max_kl over B = `num_bootstrap` resamples of its records (n draws with
  replacement), each fitted alike, widened to contain the rungs that bracket the crossing
  (`knee_bracket`, `bracketed_interval`).

  Per-source fits: source s's fit uses the records whose "source" is exactly s (one source, no
  "+") plus the "reference" records (the unperturbed runs, the zero-mismatch anchor); combination
  records ("noise+stale") enter the overall fit only. A source whose fit crosses τ ("none" or
  "below") on fewer than c = `min_crossing_records` of its own records (those at kl values
  where its fit is over τ) is censored "unconfirmed" and takes the overall limit.

  Args:
    records: sequence of n mappings, each with "source", "mismatch/kl" (finite, nats per token)
      and "quality_drop" (finite); optionally "layer" (int >= 0) and any other keys.
    tolerance: τ >= 0, the largest acceptable quality drop, in quality_drop's units.
    level: coverage of the bootstrap interval, in (0, 1).
    num_bootstrap: B >= 1 resamples per fit.
    seed: seed of the bootstrap Generator (per-layer fits use the seed sequence (seed, 1 + i)).
    min_crossing_records: c >= 1; a source whose fit crosses τ on fewer than c of its own
      records is "unconfirmed" and takes the overall limit (above).

  Returns:
    A Budget with the overall Threshold (from the records without "layer"), one Threshold per
    layer whose scan records span >= 2 distinct mismatch/kl values, one per source whose own
    records and the reference's span >= 2 (bootstrap seed sequence (seed, 0, crc32 of the
    source's name), so that other sources do not move it), and the records copied.

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
  for name in singles:
    idx = np.nonzero(((layer < 0) & (source == name)) | anchor)[0]
    if np.unique(kl[idx]).size >= MIN_DISTINCT_KL:
      fitted = _fit_one(kl[idx], drop[idx], tolerance, level, num_bootstrap, [seed, 0, _key(name)])
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
