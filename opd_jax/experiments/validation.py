"""A study's pre-registered validation scored: the frozen rule beside simple baselines, and the
one-scale and interaction analyses of its calibration runs.

The command is `python -m opd_jax.validation --study=DIR/study.json
--config=configs/validation.py`. Everything here reads a finished `study.json`
(`opd_jax.experiments.study`) and the analysis its config froze (`config.analysis`); nothing
trains. The pieces are pure functions.

Verdicts on the held-out settings. Each row of the study carries the frozen rule's verdict
(`admitted`, reached through `admission.candidate_verdict`, the admission check's own path) and
the pooled rule's (`admitted_pooled`). Beside them:

  admit_all         every setting admitted;
  measure_nothing   a threshold on the settings themselves, read off the calibration labels
                    (`nothing_thresholds`): refuse iff σ ≥ σ* or k ≥ k* or the weights format
                    is one whose lone calibration setting lost quality. σ* (k*) is the
                    smallest σ (k) of a lone noise (stale) calibration setting that lost
                    quality, ∞ when none did;
  lookup            the format lookup table (`format_lookup`): per dose ladder, refuse a part
                    at or coarser than the finest rung that lost quality; a combination is
                    refused iff one of its parts is.

The analysis names the baselines it scores (`baselines`, `mcnemar_against`, `noninferior_to`;
`baseline_verdicts`). Its goal is met when the rule's agreement is ≥ `goal` and, for each
baseline of `must_beat` (none by default), the McNemar test below rejects at α.

A setting kept quality iff the mean drop over its runs d̄ ≤ τ. Agreement a = (true accepts +
true refusals) / n, with the Wilson score interval at level 1 − α (`stats.wilson`), on all the
held-out settings and again on those whose label lies outside ±2 SE of τ (`scoring.outside_
band`: a rerun could flip the rest). A verdict too close to call counts as the analysis fixes
(`analysis.too_close`: "as_called", the default, "admit", "refuse", or "apart", a third answer
scored apart, every table then on the settings the check calls); the frozen rule's agreement
under every reading is reported beside it, with the share of settings too close
(`scoring.too_close_readings`).

Paired comparison of rule R with baseline B on the same n settings: b = settings R gets right
and B wrong, c = the reverse. Exact one-sided McNemar (`stats.mcnemar_one_sided`): p = P(X ≥ b),
X ~ Binomial(b + c, 1/2) (H1: R agrees more often). Non-inferiority of R to B with margin m:
the one-sided Wald lower bound of the paired difference Δ = (b − c)/n
(`stats.paired_lower_bound`) above −m.

One scale. On the single-source calibration records (one per run: x = the check's KL, y = the
drop), drop = g(x) + δ_s with g non-decreasing (isotonic) and δ_reference = 0, fitted by
backfitting (`offset_fit`, from δ = 0); δ_s ≠ 0 says source s degrades at a different level than
the others at the same KL. Where the sources do not overlap in KL, g can absorb part of a shift,
so δ_s is only partly identified: read its sign and interval, with the leave-one-out knees.
Leave one source out (`leave_one_source_out`): the pooled knee fitted without s's
records (`budget_fit.fit_budget`) is s's predicted knee; its score is how many of s's settings it
labels right (kept ⇔ x ≤ knee), beside s's own fitted knee. Both are run on each axis given:
the check's KL, and each run's training-time mean KL.

Interactions (`factorial`): each combination of the calibration set beside its parts' lone
calibration settings (none where the calibration has no such setting): its KL and its parts'
KLs, its drop and the parts' drops, and whether each kept quality.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opd_jax.config import check as config_check
from opd_jax.config import values
from opd_jax.experiments import format_lookup, scoring, stats
from opd_jax.experiments import study as study_lib
from opd_jax.experiments.baselines import baseline_verdicts, kept
from opd_jax.io import provenance
from opd_jax.mismatch import budget, budget_fit
from opd_jax.mismatch import candidates as candidates_lib

LABEL_DROP = study_lib.LABEL_DROP


def compare(rule: Sequence[bool], other: Sequence[bool], labels: Sequence[bool], alpha: float):
  """The paired comparison of two verdict lists on the same settings (module docstring)."""
  right_r = [a == k for a, k in zip(rule, labels, strict=True)]
  right_o = [a == k for a, k in zip(other, labels, strict=True)]
  b = sum(r and not o for r, o in zip(right_r, right_o, strict=True))
  c = sum(o and not r for r, o in zip(right_r, right_o, strict=True))
  n = len(labels)
  return {
    "rule_only_right": b,
    "other_only_right": c,
    "mcnemar_p": stats.mcnemar_one_sided(b, c),
    "difference": (b - c) / n if n else math.nan,
    "difference_lower": stats.paired_lower_bound(b, c, n, alpha),
  }


def accuracy_labels(result: Mapping, rows: Sequence[Mapping]) -> tuple[list[bool], dict]:
  """The held-out rows' kept-quality labels under held-out accuracy, with τ from the reference
  accuracies (2 · max(seed sd, binomial SE))."""
  reference = [a for r in result["rows"] if r["role"] == "reference" for a in r["accuracy_runs"]]
  floor = stats.noise_floor(reference, int(result["num_eval"]), "accuracy")
  labels = [floor["mean"] - float(np.mean(r["accuracy_runs"])) <= floor["tolerance"] for r in rows]
  return labels, floor


def tolerance_interval(
  result: Mapping, num_bootstrap: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
  """τ's bootstrap interval: the reference runs' qualities resampled with replacement and τ
  recomputed from each resample as the study computes it (`stats.noise_floor`)."""
  reference = [
    q for r in result["rows"] if r["role"] == "reference" for q in study_lib.quality_runs(r)
  ]
  rng = np.random.default_rng(seed)
  taus = [
    stats.noise_floor(rng.choice(reference, len(reference)), result["num_eval"], result["label"])[
      "tolerance"
    ]
    for _ in range(num_bootstrap)
  ]
  lo, hi = np.quantile(taus, [(1 - level) / 2, (1 + level) / 2])
  return float(lo), float(hi)


def too_close_blocks(
  result: Mapping, rows: Sequence[Mapping], tolerance: float, reading: str, level: float
) -> dict[str, dict | None]:
  """The frozen rule's verdicts on `rows` under every reading of "too close"
  (`scoring.too_close_readings`), per label (primary, accuracy); None for a study whose rows
  record no too_close, which can then only be read as called.

  Raises:
    ValueError: such a study with another reading fixed.
  """
  flags = scoring.too_close_flags(rows)
  if flags is None:
    if reading != scoring.DEFAULT_READING:
      raise ValueError(f"the study's rows record no too_close: cannot read them as {reading!r}")
    return {"primary_label": None, "accuracy_label": None}
  admitted = [bool(r["admitted"]) for r in rows]
  labels = {
    "primary_label": [kept(r, tolerance) for r in rows],
    "accuracy_label": accuracy_labels(result, rows)[0],
  }
  return {k: scoring.too_close_readings(admitted, flags, v, level) for k, v in labels.items()}


def validate(result: Mapping, config) -> dict[str, Any]:
  """The pre-registered analysis (`config.analysis`) of a study's held-out settings."""
  analysis = config.analysis
  tolerance = float(result["tolerance"])
  level = float(analysis.get("level", 0.95))
  alpha = float(analysis.get("alpha", 0.05))
  rows = [r for r in result["rows"] if r["role"] == "held_out"]
  if not rows:
    raise ValueError("the study has no held-out settings to validate on")
  reading = scoring.check_reading(analysis.get("too_close", scoring.DEFAULT_READING))
  readings = too_close_blocks(result, rows, tolerance, reading, level)
  too_close = scoring.too_close_flags(rows) or [False] * len(rows)
  if reading == "apart":  # a third answer: every table below is on the settings the check calls
    rows = [r for r, close in zip(rows, too_close, strict=True) if not close]
    too_close = [False] * len(rows)
    if not rows:
      raise ValueError("every held-out setting is too close to call: none is left to score")
  tau_band = tolerance_interval(result, level=level)
  primary = [
    bool(v) for v in scoring.read_too_close([bool(r["admitted"]) for r in rows], too_close, reading)
  ]
  baselines, tables = baseline_verdicts(result, rows, config)
  verdicts = {analysis.primary: primary, **baselines}
  primary_labels = [kept(r, tolerance) for r in rows]
  out: dict[str, Any] = {
    "label": result["label"],
    "tolerance": tolerance,
    "too_close_reading": reading,
    "n": len(rows),
    "degraded": primary_labels.count(False),
    "baselines": list(baselines),
    **tables,
    "tolerance_interval": list(tau_band),
    "labels_within_tolerance_interval": len(in_band(result, tau_band)),
    "settings": [
      {
        "spec": r["spec"],
        "source": r["source"],
        "kl": r[budget.KL_KEY],
        "drop": r[LABEL_DROP],
        "kept": primary_labels[i],
        **{name: v[i] for name, v in verdicts.items()},
      }
      for i, r in enumerate(rows)
    ],
  }
  acc_labels, acc_floor = accuracy_labels(result, rows)
  for label_name, labels, label in (
    ("primary_label", primary_labels, result["label"]),
    ("accuracy_label", acc_labels, "accuracy"),
  ):
    block = {name: scoring.score(v, labels, level) for name, v in verdicts.items()}
    outside = scoring.outside_band(result, rows, label)
    block["outside_band"] = scoring.outside_band_scores(verdicts, labels, outside, level)
    block["too_close"] = readings[label_name]
    rule = verdicts[analysis.primary]
    block["tests"] = {
      name: compare(rule, verdicts[name], labels, alpha)
      for name in (*analysis.mcnemar_against, analysis.noninferior_to)
    }
    margin = float(analysis.noninferiority_margin)
    block["beats"] = {
      name: block["tests"][name]["mcnemar_p"] < alpha for name in analysis.mcnemar_against
    }
    must_beat = tuple(analysis.get("must_beat", ()))
    block["must_beat"] = list(must_beat)
    block["goal_met"] = block[analysis.primary]["agreement"] >= float(analysis.goal) and all(
      block["beats"][name] for name in must_beat
    )
    block["noninferior"] = block["tests"][analysis.noninferior_to]["difference_lower"] > -margin
    out[label_name] = block
  out["accuracy_tolerance"] = acc_floor["tolerance"]
  out["labels_agree"] = sum(a == b for a, b in zip(acc_labels, primary_labels, strict=True))
  acc = [a for r in result["rows"] for a in r["accuracy_runs"]]
  kl = [k for r in result["rows"] for k in r["teacher_kl_runs"]]
  out["spearman_accuracy_vs_minus_kl"] = stats.spearman(acc, [-k for k in kl])
  return out


def offset_fit(x: Sequence[float], drop: Sequence[float], source: Sequence[str], iters: int = 200):
  """drop ≈ g(x) + δ_source with g isotonic non-decreasing and δ_reference = 0, by
  backfitting; returns ({source: δ}, g at each record)."""
  x, drop = np.asarray(x, float), np.asarray(drop, float)
  source = np.asarray(source)
  names = sorted({str(x) for x in source} - {budget.REFERENCE_SOURCE})
  delta = dict.fromkeys(names, 0.0)
  g = np.zeros_like(drop)
  for _ in range(iters):
    shift = np.array([delta.get(s, 0.0) for s in source])
    xs, fs = budget_fit.isotonic_fit(x, drop - shift)
    g = np.interp(x, xs, fs)
    new = {s: float(np.mean((drop - g)[source == s])) for s in names}
    if all(abs(new[s] - delta[s]) < 1e-9 for s in names):
      delta = new
      break
    delta = new
  return delta, g


def offsets_with_interval(records: Sequence[Mapping], axis: str, num_bootstrap=500, seed=0):
  """`offset_fit` on single-source records, with a bootstrap interval per δ_s (records
  resampled within each source)."""
  x = [r[axis] for r in records]
  d = [r[budget.DROP_KEY] for r in records]
  s = [r["source"] for r in records]
  delta, _ = offset_fit(x, d, s)
  rng = np.random.default_rng(seed)
  src = np.asarray(s)
  groups = {name: np.flatnonzero(src == name) for name in sorted(set(s))}
  draws = {name: [] for name in delta}
  for _ in range(num_bootstrap):
    idx = np.concatenate([rng.choice(g, len(g)) for g in groups.values()])
    boot, _ = offset_fit([x[i] for i in idx], [d[i] for i in idx], [s[i] for i in idx])
    for name in delta:
      draws[name].append(boot[name])
  return {
    name: {
      "offset": delta[name],
      "interval": [float(np.quantile(draws[name], 0.025)), float(np.quantile(draws[name], 0.975))],
    }
    for name in delta
  }


def leave_one_source_out(records: Sequence[Mapping], axis: str, tolerance: float) -> dict:
  """Each source's knee predicted by the pooled fit without its records, scored on its own
  settings (module docstring), beside its own fit."""
  recs = [{**r, budget.KL_KEY: max(float(r[axis]), 0.0)} for r in records]
  sources = sorted({r["source"] for r in recs} - {budget.REFERENCE_SOURCE})
  out = {}
  for s in sources:
    rest = [r for r in recs if r["source"] != s]
    own = [r for r in recs if r["source"] == s]
    predicted = budget_fit.fit_budget(rest, tolerance, num_bootstrap=200).overall
    try:
      fit = budget_fit.fit_budget(
        own + [r for r in recs if r["source"] == budget.REFERENCE_SOURCE],
        tolerance,
        num_bootstrap=200,
      ).overall
      own_knee, own_censored = fit.max_kl, fit.censored
    except ValueError:
      own_knee, own_censored = math.nan, "unfitted"
    by_setting: dict[str, list] = {}
    for r in own:
      by_setting.setdefault(r["name"], []).append(r)
    right = 0
    for runs_ in by_setting.values():
      kl = float(np.mean([r[budget.KL_KEY] for r in runs_]))
      drop = float(np.mean([r[budget.DROP_KEY] for r in runs_]))
      right += (kl <= predicted.max_kl) == (drop <= tolerance)
    out[s] = {
      "predicted_knee": predicted.max_kl,
      "predicted_censored": predicted.censored,
      "own_knee": own_knee,
      "own_censored": own_censored,
      "settings": len(by_setting),
      "right": right,
    }
  return out


def one_scale(result: Mapping) -> dict[str, Any]:
  """The offset fit and leave-one-source-out knees on the check's axis and the training
  axis, over the single-source calibration runs and the reference."""
  tolerance = float(result["tolerance"])
  records = [
    r
    for r in study_lib.budget_records(result["rows"], result["noise_floor"]["mean"])
    if "+" not in r["source"]
  ]
  out = {}
  for axis in (budget.KL_KEY, study_lib.TRAIN_KL):
    recs = [{**r, axis: max(float(r[axis]), 0.0)} for r in records if r.get(axis) is not None]
    out[axis] = {
      "offsets": offsets_with_interval(recs, axis),
      "leave_one_source_out": leave_one_source_out(recs, axis, tolerance),
    }
  return out


def factorial(result: Mapping, run_cfg) -> list[dict]:
  """Each calibration combination beside its parts' lone calibration settings."""
  tolerance = float(result["tolerance"])
  by_spec = {r["spec"]: r for r in result["rows"] if r["role"] == "calibration"}
  out = []
  for r in result["rows"]:
    if r["role"] != "calibration" or "+" not in r["source"]:
      continue
    candidate = candidates_lib.parse_candidate(r["spec"], run_cfg)
    parts = candidates_lib.source_parts(candidate, run_cfg)
    lone = {s: by_spec.get(spec) for s, spec in parts.items()}
    out.append(
      {
        "spec": r["spec"],
        "kl": r[budget.KL_KEY],
        "part_kl": {s: r.get(f"{budget.PART_KL_PREFIX}{s}") for s in parts},
        "drop": r[LABEL_DROP],
        "part_drop": {s: (None if v is None else v[LABEL_DROP]) for s, v in lone.items()},
        "kept": kept(r, tolerance),
        "parts_kept": {s: (None if v is None else kept(v, tolerance)) for s, v in lone.items()},
      }
    )
  return out


def in_band(result: Mapping, band: Sequence[float]) -> list[Mapping]:
  """The held-out rows whose label τ's interval cannot settle: lower < d̄ ≤ upper."""
  lo, hi = band
  return [r for r in result["rows"] if r["role"] == "held_out" and lo < r[LABEL_DROP] <= hi]


def relabel(
  result: Mapping,
  extra: Mapping[str, Sequence[float]],
  accuracy: Mapping[str, Sequence[float]] | None = None,
  teacher_kl: Mapping[str, Sequence[float]] | None = None,
) -> dict:
  """A copy of `result` whose held-out rows named in `extra` (spec → further qualities; in
  `accuracy` and `teacher_kl`, the same runs' accuracies and KLs to the teacher) are labelled
  by the mean over all their runs: LABEL_DROP = mean(q_ref) − mean(quality_runs)."""
  accuracy, teacher_kl = accuracy or {}, teacher_kl or {}
  rows = []
  for r in result["rows"]:
    more = list(extra.get(r["spec"], ())) if r["role"] == "held_out" else []
    if more:
      runs_ = [*study_lib.quality_runs(r), *more]
      r = {**r, "quality_runs": runs_, LABEL_DROP: result["noise_floor"]["mean"] - np.mean(runs_)}
      r["accuracy_runs"] = [*r["accuracy_runs"], *accuracy.get(r["spec"], ())]
      r["teacher_kl_runs"] = [*r["teacher_kl_runs"], *teacher_kl.get(r["spec"], ())]
    rows.append(r)
  return {**result, "rows": rows}


def third_runs(result: Mapping, config, workdir: str, seed: int = 2, log=print) -> dict:
  """Post hoc, beside the pre-registered labels: each held-out setting whose two-run label lies
  within τ's interval (`in_band`) trained once more with `seed` into `workdir`
  (`study.rerun_job`; a finished run is reused), and the result relabelled (`relabel`)."""
  from opd_jax.experiments import runs

  rows = in_band(result, tolerance_interval(result))
  settings = [
    study_lib.Setting(r["name"], r["spec"], r["source"], r["role"], int(r["seed"])) for r in rows
  ]
  jobs = [study_lib.rerun_job(config, s, seed, workdir) for s in settings]
  trained = runs.run_many(jobs, int(config.get("workers", 1)), log)
  pairs = list(zip(settings, trained, strict=True))
  extra = {s.spec: [study_lib.run_quality(t, result["label"])] for s, t in pairs}
  accuracy = {s.spec: [study_lib.result_accuracy(t)] for s, t in pairs}
  teacher_kl = {s.spec: [float(t["student_teacher_kl_after"])] for s, t in pairs}
  return relabel(result, extra, accuracy, teacher_kl)


def run_overrides(items: Sequence[str], run_cfg) -> dict[str, Any]:
  """`KEY=VALUE` texts as dotted-key overrides of `run_cfg`, each value parsed as
  `--config.KEY=VALUE` would parse it for the key's current value (`config.values.parse_value`);
  `runs.with_overrides` then refuses an unknown key or a value the config check refuses.

  Raises:
    ValueError: an item without `=`, or a value that does not parse as its key's type.
  """
  current = dict(config_check.flatten(run_cfg))
  out = {}
  for item in items:
    key, sep, raw = item.partition("=")
    if not sep:
      raise ValueError(f"--config.run.{item}: expected --config.run.KEY=VALUE")
    try:
      out[key] = values.parse_value(raw, current.get(key))
    except ValueError as e:
      raise ValueError(f"--config.run.{key}={raw}: {e}") from None
  return out


def load_module(path: str):
  """A config file as a module, its directory importable (configs import their siblings)."""
  import importlib.util
  import os
  import sys

  if not os.path.isfile(path):
    raise ValueError(f"--config={path!r}: no such file")
  directory = os.path.dirname(os.path.abspath(path))
  if directory not in sys.path:
    sys.path.insert(0, directory)
  spec = importlib.util.spec_from_file_location("opd_jax_validation_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config(path: str):
  """A config file's `get_config()` (`path[:arg]`, `load_module`)."""
  path, _, arg = path.partition(":")
  module = load_module(path)
  config = module.get_config(arg) if arg else module.get_config()
  if "analysis" not in config:
    raise ValueError(f"{path} has no `analysis` section: nothing was pre-registered to score")
  return config


def draw_lines(result: Mapping, path: str) -> list[str]:
  """The held-out draw of the config file `path` (its `draw_config()`: "run", "calibration",
  "draw" with `format_lookup.draw_held_out`'s parameters) on the calibration labels of the
  finished study `result`, as the Python lines to paste into the config
  (`format_lookup.literal_lines`).

  Raises:
    ValueError: a config file without `draw_config`, or a study whose calibration settings are
      not the config's (named).
  """
  module = load_module(path.partition(":")[0])
  if not hasattr(module, "draw_config"):
    raise ValueError(f"{path} defines no draw_config(): it has no held-out draw")
  c = module.draw_config()
  verdicts = format_lookup.calibration_verdicts(result["rows"], result["tolerance"], LABEL_DROP)
  missing = sorted(set(c.calibration) - set(verdicts))
  extra = sorted(set(verdicts) - set(c.calibration))
  if missing or extra:
    raise ValueError(
      f"the study's calibration settings are not {path}'s: missing {missing[:4]}, "
      f"not in the config {extra[:4]}"
    )
  d = c.draw
  drawn = format_lookup.draw_held_out(
    verdicts,
    c.run,
    seed=int(d.seed),
    size=int(d.size),
    degraded_share=float(d.degraded_share),
    singles=tuple(d.singles),
    knobs=tuple((float(p), tuple(v)) for p, v in d.knobs),
  )
  return format_lookup.literal_lines(drawn, format_lookup.table_from_verdicts(verdicts, c.run))


def report(result: Mapping, config) -> dict[str, Any]:
  """Everything this module scores, from one study result and its config, with the
  provenance of the code scoring it and of the study's parts (`study_provenance`)."""
  return {
    "provenance": provenance.provenance(config),
    "study_provenance": result.get("provenance"),  # None for a study.json before it
    "study_code": result.get("code"),
    "primary": config.analysis.primary,
    "validation": validate(result, config),
    "one_scale": one_scale(result),
    "factorial": factorial(result, config.run),
  }


if __name__ == "__main__":  # the command moved up, above the library it runs
  raise SystemExit("error: the command is `python -m opd_jax.validation` (the same flags)")
