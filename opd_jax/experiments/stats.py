"""The experiments' statistics: intervals, paired tests, rank correlation, confusion tables,
and the study's noise floor (its tolerance τ).

Every function is pure (numbers in, numbers out). Where scipy has the test it is scipy's:
Wilson's score interval (`scipy.stats.binomtest(...).proportion_ci(method="wilson")`), the
exact McNemar test (`binomtest` on the discordant pairs), Fisher's exact test
(`scipy.stats.fisher_exact`), the quantiles of Welch's interval
and the Wald bound (`scipy.stats.t`, `scipy.stats.norm`), Spearman's and Pearson's correlations
(`scipy.stats.spearmanr`, `scipy.stats.pearsonr`). The comparisons that use them are in
docs/design.md ("Scoring a pre-registered validation") and `experiments.opd_vs_rl`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

from opd_jax.mismatch import budget

LEVEL = 0.95  # of every interval unless a caller says otherwise
# The teacher_kl label's resolution: one run's KL is taken to be known to within this fraction
# of the reference's mean KL, so τ >= 2 · KL_RELATIVE_SE · mean KL (5%) when the seeds agree
# more closely than that by chance (two seeds give an sd with one degree of freedom).
KL_RELATIVE_SE = 0.025


def wilson(successes: int, n: int, level: float = LEVEL) -> tuple[float, float]:
  """The Wilson score interval of a binomial proportion p̂ = successes/n at `level`:

      (p̂ + z²/2n ± z·sqrt(p̂(1 − p̂)/n + z²/4n²)) / (1 + z²/n),  z = Φ⁻¹((1 + level)/2);

  (nan, nan) for n = 0."""
  if n <= 0:
    return (math.nan, math.nan)
  ci = stats.binomtest(int(successes), int(n)).proportion_ci(level, method="wilson")
  return (float(ci.low), float(ci.high))


def mcnemar_one_sided(b: int, c: int) -> float:
  """Exact one-sided McNemar p = P(X ≥ b), X ~ Binomial(b + c, 1/2), for b settings one rule
  gets right and the other wrong and c the reverse (H1: the first is right more often); 1.0
  with no discordant pair."""
  if b + c == 0:
    return 1.0
  return float(stats.binomtest(int(b), int(b + c), 0.5, alternative="greater").pvalue)


def fisher_greater(hits: int, n: int, ref_hits: int, ref_n: int) -> float:
  """Fisher's exact one-sided p that a rate hits/n exceeds ref_hits/ref_n: the
  hypergeometric P(X ≥ hits) of the 2×2 table [[hits, n − hits], [ref_hits, ref_n − ref_hits]]
  with its margins fixed (`scipy.stats.fisher_exact`, alternative "greater"); 1.0 when either
  count of trials is 0."""
  if n <= 0 or ref_n <= 0:
    return 1.0
  table = [[int(hits), int(n - hits)], [int(ref_hits), int(ref_n - ref_hits)]]
  return float(stats.fisher_exact(table, alternative="greater").pvalue)


def paired_lower_bound(b: int, c: int, n: int, alpha: float = 0.05) -> float:
  """One-sided (1 − α) Wald lower bound of Δ = (b − c)/n, the paired difference in agreement
  of two rules on n settings: Δ − z_(1−α)·sqrt((b + c)/n − Δ²)/sqrt(n); nan for n = 0."""
  if n <= 0:
    return math.nan
  delta = (b - c) / n
  var = max((b + c) / n - delta * delta, 0.0) / n
  return delta - float(stats.norm.ppf(1 - alpha)) * math.sqrt(var)


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = LEVEL):
  """Welch's interval for mean(a) − mean(b): d ± t_{ν, (1+level)/2} · √(s_a²/n_a + s_b²/n_b),
  ν by Welch–Satterthwaite, t's quantile `scipy.stats.t.ppf`; (nan, nan) unless both sides
  have two values or more and some spread (with s_a = s_b = 0, ν is undefined, as in
  `scipy.stats.ttest_ind(equal_var=False)`: seeds that tie say nothing about the noise)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.size < 2 or b.size < 2:
    return math.nan, math.nan
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  d, se = a.mean() - b.mean(), math.sqrt(va + vb)
  if se == 0:
    return math.nan, math.nan
  nu = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
  half = float(stats.t.ppf((1 + level) / 2, nu)) * se
  return float(d - half), float(d + half)


MIN_GAIN = 0.01  # the least reference gain over the warm start that leaves a share defined


def gain_kept(
  ref: Sequence[float], cell: Sequence[float], warm: float, level=LEVEL, n_boot=2000, seed=0
):
  """The share of its own gain a method keeps: (mean(cell) − w) / (mean(ref) − w), w the warm
  start's accuracy, with a percentile bootstrap interval over seeds (each side resampled).
  nan when the reference gained less than a point (`MIN_GAIN`): there is no gain to keep.

  This is the interval `configs/opd_vs_rl_learns.py` fixed. With two to five seeds per side it
  covers well under `level` (simulated normal seeds: 0.62 to 0.88), and it keeps only the
  resamples in which the reference gained, so it is conditional on that gain;
  `fieller_share` is reported beside it."""
  ref, cell = np.asarray(ref, np.float64), np.asarray(cell, np.float64)
  if not ref.size or not cell.size or ref.mean() - warm < MIN_GAIN:
    return math.nan, (math.nan, math.nan)
  point = float((cell.mean() - warm) / (ref.mean() - warm))
  if ref.size < 2 or cell.size < 2:
    return point, (math.nan, math.nan)
  rng = np.random.default_rng(seed)
  r = rng.choice(ref, (n_boot, ref.size)).mean(1)
  c = rng.choice(cell, (n_boot, cell.size)).mean(1)
  ok = r - warm >= MIN_GAIN
  ratio = (c[ok] - warm) / (r[ok] - warm)
  lo, hi = np.quantile(ratio, [(1 - level) / 2, (1 + level) / 2])
  return point, (float(lo), float(hi))


def fieller_share(ref: Sequence[float], cell: Sequence[float], warm: float, level=LEVEL):
  """Fieller's interval for the share of gain kept θ = (mean(cell) − w) / (mean(ref) − w), the
  two seed means independent and w fixed: the θ with

      (a − θ·b)² ≤ t² · (v_a + θ²·v_b),   a = mean(cell) − w,  b = mean(ref) − w,  v = s²/n,

  t = t_{ν, (1+level)/2} with ν = min(n_ref, n_cell) − 1 (the smaller side's, conservative).
  When the reference's gain is distinguishable from 0 at that level (b² > t²·v_b) the set is
  the interval (a·b ± t·√(a²·v_b + b²·v_a − t²·v_a·v_b)) / (b² − t²·v_b); otherwise it is
  unbounded and (−inf, inf) is returned. Exact for normal seed means, where the percentile
  bootstrap of `gain_kept` covers well under `level` with two to five seeds
  (docs/results/opd_vs_rl.md). (nan, nan) with fewer than two seeds on a side, or no spread on
  either."""
  ref, cell = np.asarray(ref, np.float64), np.asarray(cell, np.float64)
  if ref.size < 2 or cell.size < 2:
    return math.nan, math.nan
  a, b = cell.mean() - warm, ref.mean() - warm
  va, vb = cell.var(ddof=1) / cell.size, ref.var(ddof=1) / ref.size
  if va + vb == 0:
    return math.nan, math.nan
  t2 = float(stats.t.ppf((1 + level) / 2, min(ref.size, cell.size) - 1)) ** 2
  den = b * b - t2 * vb
  if den <= 0:
    return -math.inf, math.inf
  half = math.sqrt(t2 * (a * a * vb + b * b * va - t2 * va * vb))
  return float((a * b - half) / den), float((a * b + half) / den)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
  """Spearman rank correlation (average ranks for ties); nan with fewer than 3 points or a
  constant side."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
    return math.nan
  return float(stats.spearmanr(x, y).statistic)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
  """Pearson correlation r = Σ(x − x̄)(y − ȳ) / sqrt(Σ(x − x̄)² Σ(y − ȳ)²)
  (`scipy.stats.pearsonr`); nan with fewer than 3 points or a constant side."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
    return math.nan
  return float(stats.pearsonr(x, y).statistic)


def confusion_counts(admitted: Sequence[bool], kept: Sequence[bool]) -> dict[str, Any]:
  """The confusion table of verdicts against kept-quality labels, with n and the agreement
  (true accepts + true refusals) / n."""
  table = {"admitted_kept": 0, "admitted_degraded": 0, "refused_kept": 0, "refused_degraded": 0}
  for a, k in zip(admitted, kept, strict=True):
    table[("admitted" if a else "refused") + ("_kept" if k else "_degraded")] += 1
  n = sum(table.values())
  agree = table["admitted_kept"] + table["refused_degraded"]
  return {**table, "n": n, "agreement": agree / n if n else math.nan}


def confusion(
  rows: Sequence[dict], tolerance: float, drop_key: str = budget.DROP_KEY
) -> dict[str, Any]:
  """Verdicts (`row["admitted"]`) against what training showed (`confusion_counts`): a setting
  "kept quality" iff its drop `row[drop_key]` ≤ τ. Counts: admitted & kept (true accept),
  admitted & degraded (false accept), refused & kept (false refuse), refused & degraded (true
  refuse). A row whose drop is not finite (no label: a run that did not finish evaluating) is
  left out and counted as "unlabelled" (the key is there only when some are), where
  `nan <= τ` would have called it degraded."""
  labelled = [r for r in rows if math.isfinite(r[drop_key])]
  out = confusion_counts(
    [r["admitted"] for r in labelled], [r[drop_key] <= tolerance for r in labelled]
  )
  if len(labelled) < len(rows):
    out["unlabelled"] = len(rows) - len(labelled)
  return out


def noise_floor(
  reference_quality: Sequence[float], num_eval: int, label: str = "accuracy"
) -> dict[str, float]:
  """The seed-to-seed noise of the reference and the tolerance it implies.

  sd = sample standard deviation of q_ref over seeds (0 with one seed);
  se = sqrt(q̄(1 − q̄)/n_eval), the binomial standard error of one run's held-out accuracy,
  or for the teacher_kl label (q = −KL) KL_RELATIVE_SE·|q̄|;
  τ = 2·max(sd, se).
  """
  q = np.asarray(reference_quality, np.float64)
  mean = float(q.mean())
  sd = float(q.std(ddof=1)) if q.size > 1 else 0.0
  if label == "teacher_kl":
    se = KL_RELATIVE_SE * abs(mean)
  else:
    se = math.sqrt(max(mean * (1.0 - mean), 0.0) / num_eval)
  return {"mean": mean, "sd": sd, "se": se, "tolerance": 2.0 * max(sd, se), "n": int(q.size)}
