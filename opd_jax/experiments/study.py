"""The study: calibrate the mismatch budget on the embedded task, validate the admission check.

    python -m opd_jax.study --config=configs/study.py[:tiny] --workdir=DIR

The procedure (every step writes its result into DIR, and a restarted study reuses it):

1. **Probe.** `probe_steps` steps of the reference run, every step checkpointed
   (`DIR/runs/probe`, `train.stop_after`). Its latest student θ_P is the one every
   candidate is measured at, and its checkpoints θ_(P−k) are the stale engines' weights:
   exactly what `python -m opd_jax.admit --params-from=DIR/runs/probe` does.
2. **Measure.** Each setting (calibration and held-out) is an admission-check candidate:
   `admission.measure_candidate` on `num_prompts` calibration prompts with the check's key,
   no training (`DIR/measurements.json`). This value is the x-axis of the budget.
3. **Train.** Each setting is trained with `runs.run_once` (`DIR/runs/<name>/result.json`):
   the reference over `seeds` (`train.seed`), the others once (seed 0), `workers` runs side by
   side (`runs.run_many`: each in a process of its own; the numbers do not change). Quality q
   is the final held-out accuracy, or with `label = "teacher_kl"` (and "auto" on a pair that
   solves too little) minus the final held-out KL(student ‖ teacher) per token (`run_quality`,
   `choose_label`); the quality drop of a run is d = mean(q_ref) − q.
4. **Fit.** The tolerance τ is `tolerance`, or automatically
   τ = max(2·sd(q_ref), 2·sqrt(q̄(1 − q̄)/n_eval)): twice the larger of the seed-to-seed spread
   and the held-out binomial standard error, so a drop within the noise is never called a
   degradation. One run cannot label a setting whose drop lies within one seed-sd of τ
   (|d − τ| < sd): such a setting, when its role is in `borderline_roles`, is trained again with
   each of `borderline_seeds`, and so is every setting of a role in `rerun_all_roles`,
   borderline or not (one run's label has a heavy tail, docs/study). `budget_fit.fit_budget(records,
   τ)` on the reference and calibration runs (one record per run, so a re-run setting counts by
   its mean) gives the budget, pooled and per source. The same fit on the same runs with each
   run's training-time mean mismatch/kl as x is the budget's training-axis fit
   (`budget.Budget.training`; docs/design.md, "Two axes"), which the live guard compares a
   run's per-step values with.
5. **Validate.** The admission rule is fixed in the config before anything runs (`study_rule`:
   `rule`, else "per_part" with `per_part`, "whole" with `per_source`, "pooled" without).
   For each setting, `admission.candidate_verdict` with that rule is the verdict the check
   would have given (the same function `python -m opd_jax.admit` and the live guard use; the
   parts it reads are measured in step 2), and the pooled rule's verdict is kept beside it; the
   full run says whether quality was kept: d ≤ τ, with d over all its runs. The confusion
   table and the agreement rate go to the report, beside the single-run ones, every other rule
   of the registry (`rule_variants`: for comparison, not pre-set), and the table of the
   verdicts that are not too close to call (`Verdict.too_close`): how many the check calls,
   and how often it is right when it does, with the rule's agreement with each too-close
   verdict read as an admission or a refusal, and on the settings whose label lies outside
   ±2 SE of τ (`scoring.study_scores`, Wilson intervals). The budget is saved as
   `DIR/budget.json` with the fingerprint of θ_P and the teacher and its rule, with the
   held-out result as the rule's validation (`rule_validation`).
6. **Report.** `DIR/study.json` (every number, the ladders under each label:
   `experiments.ladders`, and the code each part was made by:
   `study_provenance`, which refuses parts made by different code unless `allow_mixed_code`),
   `DIR/report.md` (the findings) and PNG plots (`plots`, `study_report`). The check's mismatch
   is also set beside each run's training-time mean `mismatch/kl` (agreement of the two x-axes).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import numpy as np

from opd_jax.config import check as config_check
from opd_jax.experiments import ladders, plots, runs, scoring, stats, study_provenance, study_report
from opd_jax.experiments.study_probe import MEASUREMENTS_FILE, PROBE, measure_settings, run_probe
from opd_jax.experiments.study_rules import (
  LABEL_DROP,  # the drop a held-out verdict is judged by: over its runs (step 5)
  rule_validation,
  rule_variants,
  study_rule,
  verdicts,
)
from opd_jax.experiments.study_setting import REFERENCE, Setting, run_config, study_settings
from opd_jax.io import provenance
from opd_jax.io.json_file import read_json, write_json
from opd_jax.mismatch import (
  admission,
  budget,
  budget_file,
  budget_fit,
  sensitivity,
)

BUDGET_FILE = "budget.json"
STUDY_FILE = "study.json"
# What a run's quality q is (`run_quality`; `config.label`): held-out accuracy, the held-out
# KL(student ‖ teacher) per token (q = −KL, for a pair whose accuracy cannot resolve a drop),
# or "auto", which picks one from the reference runs (`choose_label`).
LABELS = ("accuracy", "teacher_kl", "auto")
# "auto" takes accuracy when the reference's mean held-out accuracy is at least this and the
# teacher's is above it too; below, a drop of a few points is unresolvable and it takes the KL.
AUTO_MIN_ACCURACY = 0.1
TRAIN_KL = "train/mismatch/kl_mean"  # a run's training-time mean mismatch/kl


def result_accuracy(result: dict, when: str = "after", who: str = "student") -> float:
  """A run's held-out accuracy: `<who>_accuracy_<when>` on the built-in task, else the eval
  file's score (`<who>_score_<when>`, exact match by default); NaN when it has neither (an
  eval file without answers)."""
  held = runs.held_out_score(result, when, who)
  return math.nan if held is None else held[1]


def run_quality(result: dict, label: str) -> float:
  """A run's quality q (higher is better) under `label`: its final held-out accuracy, or
  q = −KL(student ‖ teacher), the held-out per-token KL at its end ("teacher_kl")."""
  if label == "accuracy":
    return result_accuracy(result)
  if label == "teacher_kl":
    return -float(result["student_teacher_kl_after"])
  raise ValueError(f"label {label!r} is not one of accuracy, teacher_kl")


def choose_label(label: str, reference_results: Sequence[dict]) -> str:
  """The label a study scores runs by: `label`, or for "auto" accuracy when the reference
  runs' mean accuracy and the teacher's are both at least AUTO_MIN_ACCURACY (else the student
  and teacher solve too little for a drop in accuracy to be seen) and teacher_kl otherwise.

  Raises:
    ValueError: a label not in LABELS.
  """
  if label not in LABELS:
    raise ValueError(f"config.label={label!r} must be one of {', '.join(LABELS)}")
  if label != "auto":
    return label
  student = float(np.mean([result_accuracy(r) for r in reference_results]))
  teacher = result_accuracy(reference_results[0], "", "teacher")
  solves = min(student, teacher) >= AUTO_MIN_ACCURACY  # False with NaN: no answers to score
  return "accuracy" if solves else "teacher_kl"


def quality_runs(row: dict) -> list[float]:
  """A row's quality per run: `quality_runs`, or in a study recorded before labels other than
  accuracy existed, `accuracy_runs`."""
  for key in ("quality_runs", "accuracy_runs"):
    if key in row:
      return row[key]
  return [row["quality"] if "quality" in row else row["accuracy"]]


def budget_records(rows: Sequence[dict], reference_mean: float) -> list[dict]:
  """The fit's records: one per run of the reference and calibration rows, x = the check's
  mismatch/kl, y = mean(q_ref) − that run's quality (`quality_runs`, from `label_runs`); each
  keeps the run's training-time mean mismatch/kl as TRAIN_KL when it logged one, and the
  probe's seed (`budget.PROBE_SEED_KEY`) when the row names it."""
  keep = ("source", "name", budget.KL_KEY, "mismatch/kl_p95", budget.PROBE_SEED_KEY)
  out = []
  for r in rows:
    if r["role"] not in (REFERENCE, "calibration"):
      continue
    train_kl = r.get("train_kl_runs", [r.get(TRAIN_KL)])
    accuracy = r["accuracy_runs"] if "accuracy_runs" in r else [r["accuracy"]]
    for k, quality in enumerate(quality_runs(r)):
      record = {key: r[key] for key in keep if key in r}
      record.update(quality=quality, run=k)
      if k < len(accuracy):
        record["accuracy"] = accuracy[k]
      if k < len(train_kl) and train_kl[k] is not None:
        record[TRAIN_KL] = train_kl[k]
      record[budget.DROP_KEY] = reference_mean - quality
      out.append(record)
  return out


def training_axis_records(records: Sequence[dict]) -> list[dict]:
  """The records with x = the run's training-time mean mismatch/kl (TRAIN_KL, clipped at 0: an
  exact engine's reads ±1e-9 from f32 rounding), for the records that carry one; the check's
  value is kept as "check/mismatch/kl"."""
  out = []
  for r in records:
    if r.get(TRAIN_KL) is None:
      continue
    out.append(
      {**r, "check/" + budget.KL_KEY: r[budget.KL_KEY], budget.KL_KEY: max(r[TRAIN_KL], 0.0)}
    )
  return out


def is_borderline(drop: float, tolerance: float, spread: float) -> bool:
  """Whether one run's drop d is too close to τ to label its setting: |d − τ| < spread (the
  seed-to-seed sd of the reference)."""
  return abs(drop - tolerance) < spread


def agreement(rows: Sequence[dict]) -> dict[str, Any]:
  """The check's pre-training mismatch/kl against each run's training-time mean."""
  pairs = [
    (r[budget.KL_KEY], r["train/mismatch/kl_mean"])
    for r in rows
    if r["role"] != REFERENCE and "train/mismatch/kl_mean" in r
  ]
  ratios = [c / t for c, t in pairs if t > admission.ROUNDING_KL]
  return {
    "spearman": stats.spearman([c for c, _ in pairs], [t for _, t in pairs]),
    "ratio_median": float(np.median(ratios)) if ratios else math.nan,
    "ratio_min": float(np.min(ratios)) if ratios else math.nan,
    "ratio_max": float(np.max(ratios)) if ratios else math.nan,
    "n": len(pairs),
  }


ROLES = ("calibration", "held_out")  # the roles whose settings can be re-run


def _roles(config, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
  roles = tuple(config.get(key, default))
  unknown = [r for r in roles if r not in ROLES]
  if unknown:
    raise ValueError(
      f"config.{key} has {unknown}; the roles that can be re-run are 'calibration' and 'held_out'"
    )
  return roles


def rerun_plan(config) -> tuple[list[int], tuple[str, ...], tuple[str, ...]]:
  """(borderline seeds, `borderline_roles`, `rerun_all_roles`) of the config, checked.

  Raises:
    ValueError: a borderline seed that repeats one or is the held-out runs' own seed, or a
      role in `borderline_roles` or `rerun_all_roles` other than "calibration" and "held_out".
  """
  extra = [int(x) for x in config.get("borderline_seeds", ())]
  if len(set(extra)) != len(extra) or int(config.seeds[0]) in extra:
    raise ValueError(
      f"config.borderline_seeds={tuple(extra)} must be distinct and exclude the held-out runs' "
      f"seed {config.seeds[0]}"
    )
  return (
    extra,
    _roles(config, "borderline_roles", ("held_out",)),
    _roles(config, "rerun_all_roles", ()),
  )


def rerun_job(config, setting: Setting, seed: int, workdir: str):
  """(training config, run directory) of `setting` trained again with `seed`."""
  again = dataclasses.replace(setting, seed=seed)
  return run_config(config, again, workdir), os.path.join(
    workdir, "runs", f"{setting.name}_seed{seed}"
  )


def label_runs(
  config,
  settings,
  rows,
  tolerance: float,
  floor: dict,
  workdir: str,
  log=print,
  label: str = "accuracy",
):
  """Sets each row's `accuracy_runs`, `teacher_kl_runs` (the held-out KL(student ‖ teacher)
  at each run's end, whatever the label), `quality_runs` (`run_quality` under `label`) and
  LABEL_DROP = mean(q_ref) − mean(quality_runs).

  A row whose role is in `config.borderline_roles` (default: held-out only) and whose
  single-run drop is borderline (`is_borderline` with the reference's sd, or the binomial SE
  with one reference seed), and every row whose role is in `config.rerun_all_roles` (default:
  none), is trained again with each of `config.borderline_seeds` into
  DIR/runs/<name>_seed<k> (`config.workers` at a time); every other row keeps its one run.

  Raises:
    ValueError: as `rerun_plan`.
  """
  extra, roles, every = rerun_plan(config)
  spread = floor["sd"] or floor["se"]
  planned = []  # (setting, its row, seed)
  for s, row in zip(settings, rows, strict=True):
    row["accuracy_runs"] = [row["accuracy"]]
    row["quality_runs"] = [row.get("quality", row["accuracy"])]
    row["teacher_kl_runs"] = [row.get("student_teacher_kl")]
    row["train_kl_runs"] = [row.get(TRAIN_KL)]
    row["wall_seconds_runs"] = [row["wall_seconds"]]
    borderline = is_borderline(row[budget.DROP_KEY], tolerance, spread)
    if extra and ((s.role in roles and borderline) or s.role in every):
      why = "borderline" if borderline and s.role in roles else "rerun_all_roles"
      log(f"{why} {s.name} (drop {row[budget.DROP_KEY]:.3f}, τ {tolerance:.3f}): seeds {extra}")
      planned += [(s, row, seed) for seed in extra]
  jobs = [rerun_job(config, s, seed, workdir) for s, _, seed in planned]
  for (_, row, _), result in zip(planned, runs.run_many(jobs, _workers(config), log), strict=True):
    row["accuracy_runs"].append(result_accuracy(result))
    row["quality_runs"].append(run_quality(result, label))
    row["teacher_kl_runs"].append(result.get("student_teacher_kl_after"))
    row["train_kl_runs"].append(result.get(TRAIN_KL))
    row["wall_seconds_runs"].append(result["wall_seconds"])
  for row in rows:
    row[LABEL_DROP] = floor["mean"] - float(np.mean(row["quality_runs"]))


def _workers(config) -> int:
  return runs.check_workers(config.get("workers", 1))


def run_study(config: ml_collections.ConfigDict, workdir: str, log: Callable = print) -> dict:
  """Runs the study (module docstring) in `workdir`; returns what `study.json` holds."""
  start = time.time()
  os.makedirs(workdir, exist_ok=True)
  config_check.validate(config.run)
  rule = study_rule(config)  # fixed before anything runs
  if config.get("label", "accuracy") not in LABELS:
    raise ValueError(f"config.label={config.label!r} must be one of {', '.join(LABELS)}")
  settings = study_settings(config)
  extra, _, every = rerun_plan(config)  # checked before anything trains
  workers = _workers(config)
  dirs = study_provenance.run_dirs(workdir, [s.name for s in settings], extra)
  meas_path = os.path.join(workdir, MEASUREMENTS_FILE)
  study_provenance.study_code(config, meas_path, os.path.join(workdir, "runs", PROBE), dirs, log)
  probe_dir = run_probe(config, settings, workdir, log)
  measured, fingerprint = measure_settings(config, settings, probe_dir, workdir, log)

  # Every run known before any finishes trains now, `workers` side by side: each setting, and
  # the re-runs of the roles in `rerun_all_roles` (label_runs reads them; it trains only the
  # borderline re-runs, which need these results first).
  jobs = [(run_config(config, s, workdir), os.path.join(workdir, "runs", s.name)) for s in settings]
  jobs += [
    rerun_job(config, s, seed, workdir) for s in settings if s.role in every for seed in extra
  ]
  for i, s in enumerate(settings):
    log(f"setting {i + 1}/{len(settings)}: {s.role} {s.name}: {s.spec}")
  trained = runs.run_many(jobs, workers, log)
  results = {s.name: r for s, r in zip(settings, trained[: len(settings)], strict=True)}
  label = choose_label(
    config.get("label", "accuracy"), [results[s.name] for s in settings if s.role == REFERENCE]
  )
  reference = [run_quality(results[s.name], label) for s in settings if s.role == REFERENCE]
  num_eval = int(config.get("num_eval", 0) or config.run.data.eval_size)  # held-out prompts
  floor = stats.noise_floor(reference, num_eval, label)
  tolerance = config.tolerance or floor["tolerance"]

  rows = []
  for s in settings:
    res, meas = results[s.name], measured[s.spec]
    row = {**dataclasses.asdict(s), **{k: v for k, v in meas.items() if k.startswith("mismatch/")}}
    row[budget.PROBE_SEED_KEY] = int(config.seeds[0])  # measured at the probe: seed 0's run
    row["accuracy"] = result_accuracy(res)
    row["student_teacher_kl"] = res["student_teacher_kl_after"]
    row["quality"] = run_quality(res, label)
    row["label"] = label
    row[budget.DROP_KEY] = floor["mean"] - row["quality"]
    row["wall_seconds"] = res["wall_seconds"]
    row.update({k: v for k, v in res.items() if k.startswith("train/")})
    rows.append(row)

  label_runs(config, settings, rows, tolerance, floor, workdir, log, label)
  records = budget_records(rows, floor["mean"])
  min_crossing = int(config.get("min_crossing_records", budget.MIN_CROSSING_RECORDS))
  fitted = budget_fit.fit_budget(records, tolerance, min_crossing_records=min_crossing)
  try:
    on_training = budget_fit.fit_budget(
      training_axis_records(records), tolerance, min_crossing_records=min_crossing
    )
    fitted = dataclasses.replace(fitted, training=on_training)
  except ValueError as e:  # e.g. runs that logged no mismatch/kl: the guard then uses the check's
    log(f"no training-axis budget: {e}")
  per_source = bool(config.get("per_source", False))
  per_part = bool(config.get("per_part", False))
  judged = verdicts(rows, config, fitted, rule)
  pooled_judged = verdicts(rows, config, fitted, budget.POOLED, "pooled")  # one threshold
  for row, verdict, pooled in zip(rows, judged, pooled_judged, strict=True):
    row.update(admitted=verdict.admitted, margin=verdict.margin, reasons=list(verdict.reasons))
    row.update(limit=verdict.limit, limit_source=verdict.limit_source)
    row.update(limit_band=list(verdict.limit_band), too_close=verdict.too_close)
    row["extrapolation"] = verdict.extrapolation
    row.update(admitted_pooled=pooled.admitted, margin_pooled=pooled.margin)
    row["kept_quality"] = row[LABEL_DROP] <= tolerance
  held_out = [r for r in rows if r["role"] == "held_out"]
  validated = stats.confusion(held_out, tolerance, LABEL_DROP)
  if held_out:
    rule = dataclasses.replace(rule, validation=rule_validation(validated, tolerance))
  code = study_provenance.study_code(config, meas_path, probe_dir, dirs, log)  # mixed: refused
  fitted = dataclasses.replace(fitted, rule=rule, code_provenance=code[provenance.KEY])
  budget_path = os.path.join(workdir, BUDGET_FILE)
  budget_file.save_budget(budget_path, fitted, fingerprint)

  result: dict[str, Any] = {
    "workdir": os.path.abspath(workdir),
    **code,  # "provenance" (the code running now, the config's hash), "code" (its parts')
    "run_steps": config.run.train.steps,
    "num_eval": num_eval,
    "num_prompts": config.num_prompts,
    "probe": {"dir": probe_dir, "steps": config.probe_steps, "seed": int(config.seeds[0])},
    "teacher_accuracy": result_accuracy(results[settings[0].name], "", "teacher"),
    "student_accuracy_before": result_accuracy(results[settings[0].name], "before"),
    "label": label,
    "noise_floor": floor,
    "tolerance": tolerance,
    "tolerance_rule": "config"
    if config.tolerance
    else "2 max(sd of seeds, "
    + ("binomial SE)" if label == "accuracy" else f"{stats.KL_RELATIVE_SE:g} x mean KL)"),
    "budget": study_report.budget_summary(fitted, budget_path),
    "rule": budget_file.rule_dict(rule),
    "per_source": per_source,
    "min_crossing_records": min_crossing,
    "per_part": per_part,
    "borderline_seeds": [int(x) for x in config.get("borderline_seeds", ())],
    "rerun_all_roles": list(config.get("rerun_all_roles", ())),
    "confusion": validated,
    "confusion_single_run": stats.confusion(held_out, tolerance),
    "confusion_called": stats.confusion(
      [r for r in held_out if not r["too_close"]], tolerance, LABEL_DROP
    ),
    "held_out_scores": scoring.study_scores(
      {"rows": rows, "num_eval": num_eval, "label": label, "tolerance": tolerance}
    ),
    "rule_variants": rule_variants(held_out, config, fitted, tolerance),
    "check_vs_training": agreement(rows),
    "rows": rows,
    "curves": {s.name: results[s.name].get("curve", []) for s in settings},
  }
  if config.sensitivity:
    sens_json = os.path.join(workdir, "sensitivity.json")
    if not os.path.exists(sens_json):
      sensitivity.run_sensitivity(
        run_config(config, settings[0], workdir),
        params_from=probe_dir,
        num_prompts=config.num_prompts,
        json_path=sens_json,
        png_path=os.path.join(workdir, "sensitivity.png"),
        log=log,
      )
    result["sensitivity"] = read_json(sens_json, None)
  result["ladders"] = ladders.ladder_report(
    result,
    config.get("full_run_accuracy"),
    config.get("min_plateau_share", ladders.MIN_PLATEAU_SHARE),
  )
  result["plots"] = plots.study_plots(result, workdir)
  result["seconds"] = time.time() - start
  result["num_runs"] = sum(len(r["accuracy_runs"]) for r in rows)
  result["train_seconds"] = sum(sum(r["wall_seconds_runs"]) for r in rows)  # every run
  write_json(os.path.join(workdir, STUDY_FILE), result)
  report = study_report.markdown(result)
  with open(os.path.join(workdir, "report.md"), "w", encoding="utf-8") as f:
    f.write(report)
  log(report)
  return result
