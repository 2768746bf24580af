"""The baselines a pre-registered validation scores the admission rule against, each a list of
verdicts on the held-out settings (`baseline_verdicts`), and the label they are all judged by.

  pooled            one limit on the check's KL, the budget's overall one (the study's
                    `admitted_pooled`);
  admit_all         every setting admitted;
  measure_nothing   round 9's threshold on the settings themselves, read off the lone
                    calibration settings' labels (`nothing_thresholds`): refuse iff σ ≥ σ* or
                    k ≥ k* or the weights format is one whose lone calibration setting lost
                    quality; σ* (k*) is the smallest σ (k) of a lone noise (stale) calibration
                    setting that lost quality, ∞ when none did;
  lookup            the format lookup table (`format_lookup`): per dose ladder, refuse a part
                    at or coarser than the finest rung that lost quality.

A setting kept quality iff its mean drop over its runs d̄ ≤ τ (`kept`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from opd_jax.experiments import format_lookup
from opd_jax.experiments import study as study_lib
from opd_jax.mismatch import candidates as candidates_lib

LABEL_DROP = study_lib.LABEL_DROP
INF = math.inf


def kept(row: Mapping, tolerance: float, key: str = LABEL_DROP) -> bool:
  """A setting kept quality iff its drop over its runs is ≤ τ.

  Raises:
    ValueError: the drop is not finite (the setting has no label; `nan <= τ` would read as
      degraded).
  """
  if not math.isfinite(row[key]):
    raise ValueError(
      f"setting {row.get('spec', row.get('source', '?'))!r} has no label: its {key} is "
      f"{row[key]!r}; rerun or leave out the setting before scoring"
    )
  return bool(row[key] <= tolerance)


def _engine(spec: str, run_cfg) -> tuple[float, int, str]:
  """(σ, k, weights format) of a candidate's engine."""
  c = candidates_lib.parse_candidate(spec, run_cfg)
  return float(c.engine_cfg.noise_sigma), int(c.lag), str(c.engine_cfg.weights)


def nothing_thresholds(rows: Sequence[Mapping], tolerance: float, run_cfg) -> dict[str, Any]:
  """σ*, k* and the refused weight formats of the measure-nothing rule, from the lone
  calibration settings' labels (module docstring)."""
  sigma, lag, formats = INF, INF, set()
  for r in rows:
    if r["role"] != "calibration" or "+" in r["source"] or kept(r, tolerance):
      continue
    s, k, w = _engine(r["spec"], run_cfg)
    if r["source"] == "noise":
      sigma = min(sigma, s)
    elif r["source"] == "stale":
      lag = min(lag, k)
    elif r["source"].endswith("_weights"):
      formats.add(w)
  return {"sigma": sigma, "lag": lag, "formats": sorted(formats)}


def nothing_admits(spec: str, thresholds: Mapping, run_cfg) -> bool:
  """The measure-nothing rule's verdict on one setting."""
  s, k, w = _engine(spec, run_cfg)
  return s < thresholds["sigma"] and k < thresholds["lag"] and w not in thresholds["formats"]


BASELINES = ("pooled", "admit_all", "measure_nothing", "lookup")


def baseline_verdicts(result: Mapping, rows: Sequence[Mapping], config):
  """The verdicts on `rows` of each baseline the analysis names (`baselines`, `mcnemar_against`
  and `noninferior_to`, in BASELINES order), and the tables the measure-nothing ones were read
  off ("thresholds", "lookup": `format_lookup.table_from_rows` on the calibration rows).

  Raises:
    ValueError: a name that is not one of BASELINES.
  """
  a = config.analysis
  named = {*a.get("baselines", ()), *a.get("mcnemar_against", ())}
  named |= {a.noninferior_to} if a.get("noninferior_to") else set()
  unknown = sorted(named - set(BASELINES))
  if unknown:
    raise ValueError(f"config.analysis names {unknown}: the baselines are {', '.join(BASELINES)}")
  tolerance = float(result["tolerance"])
  out, tables = {}, {}
  for name in (b for b in BASELINES if b in named):
    if name == "pooled":
      out[name] = [bool(r["admitted_pooled"]) for r in rows]
    elif name == "admit_all":
      out[name] = [True] * len(rows)
    elif name == "measure_nothing":
      tables["thresholds"] = nothing_thresholds(result["rows"], tolerance, config.run)
      out[name] = [nothing_admits(r["spec"], tables["thresholds"], config.run) for r in rows]
    else:
      table = format_lookup.table_from_rows(result["rows"], tolerance, config.run, LABEL_DROP)
      tables["lookup"] = table
      out[name] = [format_lookup.admits(r["spec"], table, config.run) for r in rows]
  return out, tables
