"""Agreement of the admission check's verdicts with the labels, read three ways where a
verdict is too close to call, and on the settings whose labels lie outside the noise of τ.

Agreement. Verdicts a_i (admitted) against labels k_i (kept quality: the setting's mean drop
d̄_i ≤ τ) on n settings: agreement = #{a_i = k_i} / n, with the Wilson score interval at the
level given (`stats.wilson`; `score`).

Too close to call (`too_close_readings`). A verdict is too close when the measured KL lies
inside its limit's band, between the limit at the lower and at the upper end of the bootstrap
intervals (`budget_rules.Verdict.too_close`). Its verdict is read one of four ways:

  as_called   the point verdict (the limit itself), as the study records it;
  admit       every too-close setting admitted;
  refuse      every too-close setting refused;
  apart       a third answer, scored apart: agreement over the n − c settings the check calls,
              the c too-close ones reported beside it (c/n, the share that falls in it).

A pre-registered analysis fixes its reading (`config.analysis.too_close`, default "as_called");
every reading is reported beside it.

Outside the band (`outside_band`). A setting's label is within the noise when |d̄ − τ| ≤ 2·SE
(`ladders.label_band`: SE = sqrt(s²/n + s_ref²/m) over its n runs and the reference's m);
a rerun could flip it. Agreement is scored on all n settings and again on those outside the
band, each with its Wilson interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from opd_jax.experiments import ladders, stats

TOO_CLOSE_READINGS = ("as_called", "admit", "refuse", "apart")
DEFAULT_READING = "as_called"  # the point verdict: round 9's reading, before a config fixed one


def score(admitted: Sequence[bool], labels: Sequence[bool], level: float = stats.LEVEL) -> dict:
  """The confusion table and agreement of verdicts against kept-quality labels, with the
  agreement's Wilson interval."""
  table = stats.confusion_counts(admitted, labels)
  right = table["admitted_kept"] + table["refused_degraded"]
  return {**table, "interval": list(stats.wilson(right, table["n"], level))}


def check_reading(reading: str) -> str:
  """`reading` when it is one of TOO_CLOSE_READINGS.

  Raises:
    ValueError: any other value.
  """
  if reading not in TOO_CLOSE_READINGS:
    raise ValueError(f"too_close reading {reading!r} is not one of {', '.join(TOO_CLOSE_READINGS)}")
  return reading


def read_too_close(
  admitted: Sequence[bool], too_close: Sequence[bool], reading: str
) -> list[bool | None]:
  """Each verdict under `reading` (module docstring): a too-close one becomes True (admit),
  False (refuse), None (apart) or stays as called."""
  check_reading(reading)
  value = {"admit": True, "refuse": False, "apart": None}
  return [
    value[reading] if close and reading != "as_called" else bool(a)
    for a, close in zip(admitted, too_close, strict=True)
  ]


def too_close_flags(rows: Sequence[Mapping]) -> list[bool] | None:
  """Each row's `too_close`; None when some row does not record it (a study before the field)."""
  if any("too_close" not in r for r in rows):
    return None
  return [bool(r["too_close"]) for r in rows]


def too_close_readings(
  admitted: Sequence[bool],
  too_close: Sequence[bool],
  labels: Sequence[bool],
  level: float = stats.LEVEL,
) -> dict[str, Any]:
  """The verdicts scored under every reading of TOO_CLOSE_READINGS, with the number and share
  of too-close settings; "apart" is scored on the settings the check calls."""
  n, c = len(labels), sum(map(bool, too_close))
  readings = {}
  for reading in TOO_CLOSE_READINGS:
    read = read_too_close(admitted, too_close, reading)
    kept = [(v, k) for v, k in zip(read, labels, strict=True) if v is not None]
    readings[reading] = score([v for v, _ in kept], [k for _, k in kept], level)
  return {"n": n, "too_close": c, "share": c / n if n else math.nan, "readings": readings}


def outside_band(result: Mapping, rows: Sequence[Mapping], label: str) -> list[bool]:
  """For each of `rows` (settings of `result`), whether its label under `label` lies outside
  ±BAND_SE·SE of τ (`ladders.label_band`); a row the band does not cover (no runs under the
  label) counts as inside.

  Raises:
    ValueError: the study's runs do not record `label`.
  """
  band = ladders.label_band(result, label)
  if band is None:
    raise ValueError(f"the study's runs do not record the {label} label")
  within = {s["name"]: s["within"] for s in band["settings"]}
  return [not within.get(r["name"], True) for r in rows]


def outside_band_scores(
  verdicts: Mapping[str, Sequence[bool]],
  labels: Sequence[bool],
  outside: Sequence[bool],
  level: float = stats.LEVEL,
) -> dict[str, Any]:
  """Every verdict list of `verdicts` scored on the settings outside the band (`outside`),
  with how many lie within it."""
  keep = [i for i, o in enumerate(outside) if o]
  n = len(labels)
  return {
    "n": len(keep),
    "within": n - len(keep),
    "share_within": (n - len(keep)) / n if n else math.nan,
    "scores": {
      name: score([v[i] for i in keep], [labels[i] for i in keep], level)
      for name, v in verdicts.items()
    },
  }


def _rate(s: Mapping) -> str:
  right = s["admitted_kept"] + s["refused_degraded"]
  if not s["n"]:
    return "0/0"
  lo, hi = s["interval"]
  return f"{right}/{s['n']} = {s['agreement']:.1%} [{lo:.1%}, {hi:.1%}]"


def markdown_lines(
  readings: Mapping | None, band: Mapping | None, primary: str, fixed: str = DEFAULT_READING
) -> list[str]:
  """The agreement of `primary` under each reading of "too close" (`too_close_readings`) and
  every rule's on the settings outside the band (`outside_band_scores`), as markdown."""
  lines = []
  if readings:
    lines += [
      f"Too close to call: {readings['too_close']} of {readings['n']} settings "
      f"({readings['share']:.1%}); the config reads them as {fixed!r}.",
      "",
      "| reading of too close | agreement (95 % Wilson) |",
      "|---|---|",
      *(
        f"| {name}{' (fixed)' if name == fixed else ''} | {_rate(s)} |"
        for name, s in readings["readings"].items()
      ),
      "",
    ]
  if band:
    lines += [
      f"Outside ±{ladders.BAND_SE:g} SE of τ: {band['n']} settings ({band['within']} within "
      f"the band, {band['share_within']:.1%}).",
      "",
      "| rule | agreement outside the band (95 % Wilson) |",
      "|---|---|",
      *(
        f"| {name}{' (primary)' if name == primary else ''} | {_rate(s)} |"
        for name, s in band["scores"].items()
      ),
      "",
    ]
  return lines


def study_scores(result: Mapping, level: float = stats.LEVEL) -> dict[str, Any] | None:
  """A study's held-out verdicts (its rule's, `admitted`, and the pooled one's) against its own
  label (`kept_quality`): the rule under every reading of "too close" and both rules outside
  the band (None when the reference's runs lack the label); None without held-out settings.
  `result` needs "rows", "num_eval", "label" and "tolerance" (what `experiments.study` has
  before it writes study.json)."""
  rows = [r for r in result["rows"] if r["role"] == "held_out"]
  if not rows:
    return None
  labels = [bool(r["kept_quality"]) for r in rows]
  verdicts = {
    "rule": [bool(r["admitted"]) for r in rows],
    "pooled": [bool(r["admitted_pooled"]) for r in rows],
  }
  flags = too_close_flags(rows)
  recorded = ladders.label_band(result, result["label"]) is not None
  return {
    "too_close": None
    if flags is None
    else too_close_readings(verdicts["rule"], flags, labels, level),
    "outside_band": outside_band_scores(
      verdicts, labels, outside_band(result, rows, result["label"]), level
    )
    if recorded
    else None,
  }


def study_sentences(scores: Mapping | None) -> list[str]:
  """`study_scores` as report sentences: agreement under each reading of "too close", and
  outside the band."""
  if not scores:
    return []
  out = []
  t = scores["too_close"]
  if t:
    out.append(
      f"Read as admissions, the {t['too_close']} too-close settings give agreement "
      f"{_rate(t['readings']['admit'])}; as refusals, {_rate(t['readings']['refuse'])}; "
      f"scored apart, {_rate(t['readings']['apart'])} (Wilson 95 %)."
    )
  b = scores["outside_band"]
  if not b:
    return out
  out.append(
    f"On the {b['n']} held-out settings whose label lies outside ±{ladders.BAND_SE:g} SE of τ "
    f"({b['within']} lie within it), agreement {_rate(b['scores']['rule'])}; the pooled "
    f"budget's {_rate(b['scores']['pooled'])} (Wilson 95 %)."
  )
  return out
