"""The admission check behind `python -m opd_jax.admit`: the driver (`run_admission`), the table
and the log (`<workdir>/admission_log.jsonl`).

For each candidate it measures and judges (`mismatch.admission`: `measure_candidate`,
`candidate_verdict`) and writes one row; a stale candidate that cannot be measured (no
--params-from run, or one without the checkpoints it needs) gets a row saying what it needs and
counts as not admitted, while the others are still judged. The procedure is described in
docs/design.md ("Budget and admission").
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from opd_jax.config import check as config_check
from opd_jax.config.values import DEFAULT_NUM_PROMPTS
from opd_jax.io import provenance
from opd_jax.io.run_history import RunHistory
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_file, budget_rules
from opd_jax.mismatch.admission import (
  ROUNDING_KL,
  TRAIN_LAST_FRACTION,
  calibration_prompts,
  candidate_sampler_config,
  candidate_verdict,
  current_fingerprint,
  initial_student,
  measure_candidate,
  stale_lag_problem,
  start_compiling,
  trained_with,
  training_time_kl,
)
from opd_jax.mismatch.candidates import Candidate, candidate_source, parse_candidate
from opd_jax.mismatch.measure import POSITION_KEY
from opd_jax.train import setup as setup_lib

LOG_FILE = "admission_log.jsonl"


STUDENT_CACHE = "student_cache"  # <workdir>/student_cache: the warm-started student, once

UNCALIBRATED_LABEL = "uncalibrated default"  # a row's "budget" and "limit from" without a file


# Table columns: (header, row key, format). check_kl is the check's KL on held-out prompts,
# not a run's training-time mismatch/kl (docs/guides/budget.md, "Two KLs").
_COLUMNS = (
  ("candidate", "candidate", "s"),
  ("lag", "lag", "d"),
  ("check_kl", "mismatch/kl", ".4g"),
  ("check_kl_p95", "mismatch/kl_p95", ".4g"),
  ("max_kl", "max_kl", ".4g"),
  ("limit from", "limit_from", "s"),
  ("margin", "margin", ".4g"),
  ("verdict", "verdict", "s"),
  ("call", "call", "s"),
)
COLUMNS = _COLUMNS  # the check's columns, for a command that shows its rows beside others


def _settings(candidate: Candidate, source: str, rule: str | None) -> dict[str, Any]:
  """The first fields of a candidate's row: its spec, overrides, engine, lag, sources, rule."""
  return {
    "candidate": candidate.spec,
    "overrides": {
      k: list(v) if isinstance(v, tuple) else v for k, v in candidate.overrides.items()
    },
    "engine_id": candidate.engine_id,
    "lag": candidate.lag,
    "source": source,
    "rule": rule,
  }


NEEDS_PARAMS_FROM = "needs --params-from"  # the verdict of a stale candidate without a run
NEEDS_CHECKPOINTS = "needs checkpoints"  # ... with a run that lacks the checkpoints it needs


def unmeasured_row(
  candidate: Candidate, problem: str, rule: str, budget_label: str, has_run: bool
) -> dict:
  """The row of a stale candidate that cannot be measured: no value, verdict NEEDS_PARAMS_FROM
  (no --params-from run) or NEEDS_CHECKPOINTS (the run lacks step t − k), "admitted" false,
  and `problem` (`stale_lag_problem`: what it needs) as its reason."""
  row = _settings(candidate, candidate_source(candidate), rule)
  row.update(
    {
      budget_lib.KL_KEY: None,
      "mismatch/kl_p95": None,
      "max_kl": None,
      "limit_from": "-",
      "margin": None,
      "admitted": False,
      "verdict": NEEDS_CHECKPOINTS if has_run else NEEDS_PARAMS_FROM,
      "too_close": False,
      "call": "unmeasured",
      "reasons": [problem],
      "budget": budget_label,
    }
  )
  return row


def candidate_row(
  candidate: Candidate,
  measurement: dict,
  verdict: budget_rules.Verdict,
  student_step,
  budget_label: str = "",
  uncalibrated: bool = False,
) -> dict:
  """The JSON row of one candidate: its settings, every measured value and the verdict.

  `budget_label` names the budget in the row's "budget" (the file's path, or
  UNCALIBRATED_LABEL); with `uncalibrated` (the default limit, docs/design.md) the row's
  "limit_from" is UNCALIBRATED_LABEL and its "call" "uncalibrated"."""
  row = _settings(candidate, measurement.get("source", ""), verdict.rule)
  if candidate.lag:
    row["behaviour_step"] = student_step - candidate.lag
    row["trainer_step"] = student_step
  row.update({k: v for k, v in measurement.items() if k.startswith(("mismatch/", "measure/"))})
  row.update(measurement.get(POSITION_KEY, {}))  # kl_by_position, first_cross
  row.update(verdict_fields(verdict, budget_label, uncalibrated))
  return row


def verdict_fields(
  verdict: budget_rules.Verdict, budget_label: str, uncalibrated: bool, too_close: bool = False
) -> dict:
  """A row's verdict columns: max_kl (the limit), limit_from, margin, admitted, verdict,
  limit_band, too_close (the verdict's, or `too_close`), call (`_call`), extrapolation, reasons,
  budget, and layer_margins when the verdict has any."""
  too_close = too_close or verdict.too_close
  fields = {
    "max_kl": verdict.limit,
    "limit_from": _limit_from(verdict, uncalibrated),
    "margin": verdict.margin,
    "admitted": verdict.admitted,
    "verdict": "admitted" if verdict.admitted else "rejected",
    "limit_band": list(verdict.limit_band),
    "too_close": too_close,
    "call": _call(verdict, uncalibrated, too_close),
    "extrapolation": verdict.extrapolation,
    "reasons": list(verdict.reasons),
    "budget": budget_label,
  }
  if verdict.layer_margins:
    fields["layer_margins"] = {str(i): v for i, v in verdict.layer_margins.items()}
  return fields


def _limit_from(verdict: budget_rules.Verdict, uncalibrated: bool) -> str:
  """The table's "limit from": the source whose limit was used, "overall", the uncalibrated
  default, or for an extrapolation judged anyway, the limit it was judged against instead."""
  if uncalibrated or verdict.extrapolate == "default":
    return UNCALIBRATED_LABEL
  if verdict.extrapolate == "pooled" and verdict.extrapolation is not None:
    return "pooled"
  return verdict.limit_source or "overall"


def _call(verdict: budget_rules.Verdict, uncalibrated: bool, too_close: bool = False) -> str:
  """The table's "call": "too close" (an interval that holds the limit), "uncalibrated" (no
  budget file), the extrapolation ("uncalibrated source" or "beyond calibrated range", with the
  limit it was judged against when not refused), or "clear"."""
  if too_close:
    return "too close"
  if uncalibrated:
    return "uncalibrated"
  if verdict.extrapolation is not None:
    against = {"pooled": ", pooled limit", "default": ", default limit"}
    return verdict.extrapolation + against.get(verdict.extrapolate, "")
  return "clear"


def format_cell(value, fmt: str) -> str:
  """One table cell: numbers with `fmt`, text as is, "-" for no value."""
  if value is None:
    return "-"
  if fmt == "s":
    return str(value)
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return format(value, fmt)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]] = ()) -> str:
  """The check's table: one line per candidate, then its reasons indented below it.
  `columns`: (header, row key, format) triples; default the check's own (`COLUMNS`)."""
  columns = columns or _COLUMNS
  header = [h for h, _, _ in columns]
  cells = [[format_cell(r.get(key), fmt) for _, key, fmt in columns] for r in rows]
  widths = [max(len(x) for x in col) for col in zip(header, *cells, strict=True)]

  def line(values):
    return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

  out = [line(header), line(["-" * w for w in widths])]
  for row, values in zip(rows, cells, strict=True):
    out.append(line(values))
    out.extend(f"    reason: {reason}" for reason in row["reasons"])
    if "train/mismatch_kl_last" in row:
      out.append(
        f"    training: this run sampled with this configuration; its {row['train/key']} was "
        f"{row['train/mismatch_kl_last']:.4g} over the last {TRAIN_LAST_FRACTION:.0%} of its "
        f"logged steps ({row['train/mismatch_kl_mean']:.4g} over all "
        f"{row['train/logged_steps']}"
        + (
          f"; {row['train/nonfinite_steps']} non-finite steps left out"
          if row.get("train/nonfinite_steps")
          else ""
        )
        + ")"
        + (
          f"; check / training = {row['check_over_training']:.3g}"
          if "check_over_training" in row
          else "; both are f32 rounding"
        )
      )
  return "\n".join(out)


def _json_safe(value):
  if isinstance(value, dict):
    return {str(k): _json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_safe(v) for v in value]
  return value


def append_log(workdir: str, entries: Sequence[dict]) -> str:
  """Appends one JSON line per entry to `<workdir>/admission_log.jsonl`; returns the path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOG_FILE)
  with open(path, "a", encoding="utf-8") as f:
    for entry in entries:
      f.write(json.dumps(_json_safe(entry), sort_keys=True) + "\n")
  return path


def check_budget_fresh(saved_fp: dict, current_fp: dict, force: bool, hint: str = "") -> list[str]:
  """`stale_reasons` of the budget; raises ValueError listing them unless `force` (for a budget
  without a fingerprint, fitted from imported records, a message that says so)."""
  reasons = budget_file.stale_reasons(saved_fp, current_fp)
  if not saved_fp and not force:
    raise ValueError(
      f"{budget_file.NO_FINGERPRINT}. Pass --force to check against it anyway (the verdicts "
      "then rest on the imported runs' own engines and models, not on this setup's)"
    )
  if reasons and not force:
    lines = "\n  ".join(reasons)
    raise ValueError(
      f"the budget is stale: it was calibrated on another setup. What changed:\n  {lines}\n"
      f"{hint}Recalibrate the budget for this setup, or pass --force to check against it anyway"
    )
  return reasons


def run_admission(
  config: ml_collections.ConfigDict,
  budget_path: str | None,
  specs: Sequence[str],
  *,
  num_prompts: int = DEFAULT_NUM_PROMPTS,
  workdir: str,
  params_from: str | None = None,
  force: bool = False,
  conservative: bool = False,
  json_path: str | None = None,
  log: Callable[..., None] = print,
  extrapolate: str = "refuse",
) -> dict:
  """Runs the admission check (docs/design.md) and returns what `--json` writes.

  Args:
    config: the run config the candidates modify (validated here).
    budget_path: a budget file written by `budget_file.save_budget`; None or "uncalibrated":
      the uncalibrated default limit (`budget.uncalibrated_budget`).
    specs: candidate specs (`parse_candidate`), at least one.
    num_prompts: N calibration prompts.
    workdir: where `admission_log.jsonl` is appended and the warm-started student cached
      (and, when `config.teacher.cache_dir` is empty and no --params-from run has a
      `teacher_cache`, where the teacher is cached, bootstrapped there if missing).
    params_from: a trainer workdir whose latest checkpoint's student is measured; its older
      checkpoints serve stale candidates. Only read (its `teacher_cache` is used when
      `config.teacher.cache_dir` is empty; a teacher missing there would be bootstrapped into
      it, as the trainer does).
    force: check against a stale budget (its reasons are still reported); nothing with the
      uncalibrated default, which has no fingerprint.
    conservative: set the rule's "conservative" parameter (`budget.Rule.with_params`).
    extrapolate: a candidate the budget's records do not reach: "refuse", or judge it against
      the "pooled" or the uncalibrated "default" limit (`budget_rules.apply_rule`).
    json_path: also write the result as JSON there.
    log: progress and the table go here.

  Returns:
    {"rows": [one `candidate_row` or `unmeasured_row` per candidate, in order],
     "budget": `budget_entry`, "student": {"source", "step"}, "num_prompts": N, "prompts",
     "stale_budget_reasons": [...], "forced": bool, "seconds": {"setup": models and student
     (with `params_from`, the candidates' compiles too: they run beside the restore),
     "measure": one per measured candidate, "total"}, "log_file": path or None}.

  A stale candidate that cannot be measured (no `params_from`, or a run without the
  checkpoints it needs) gets an `unmeasured_row`; without `params_from` and with no other
  candidate, nothing is built. Only measured candidates are logged ("log_file" None when none
  was).

  Raises:
    ValueError: a bad spec, a stale budget without `force`, an unusable --params-from run;
      FileNotFoundError: no budget file.
  """
  start = time.perf_counter()
  if not specs:
    raise ValueError("give at least one --candidate")
  config_check.validate(config)
  budget, saved_fp = budget_file.load_budget_or_default(budget_path or budget_lib.UNCALIBRATED)
  uncalibrated = saved_fp is None
  budget_name = UNCALIBRATED_LABEL if uncalibrated else os.path.abspath(budget_path)
  candidates = [parse_candidate(spec, config) for spec in specs]
  rule = budget.rule or budget_lib.POOLED
  rule = rule.with_params(conservative=True) if conservative else rule
  problems = _unmeasurable(candidates, None)  # known before building anything
  if params_from is None and len(problems) == len(candidates):
    setup = history = None
    student = {"source": config.student.checkpoint or "warm-started built-in student", "step": 0}
    texts, stale, current_fp = [], [], None
  else:
    config, setup, history = measuring_setup(config, workdir, params_from, log)
    problems = _unmeasurable(candidates, history)
    measured = [c for i, c in enumerate(candidates) if i not in problems]
    texts, prompts = check_prompts(config, setup, num_prompts)
    student_params, student = check_student(
      config, setup, history, params_from, measured, prompts, workdir, log
    )
    current_fp = current_fingerprint(setup, student_params)
    hint = (
      "(--params-from measures that run's trained student; a budget is tied to the student "
      "its records were measured on.)\n"
      if params_from
      else ""
    )
    stale = [] if uncalibrated else check_budget_fresh(saved_fp, current_fp, force, hint)
    if stale:
      what = "has no fingerprint" if not saved_fp else "is stale"
      log(f"warning: the budget {what} (--force):\n  " + "\n  ".join(stale))
  setup_seconds = time.perf_counter() - start

  def measure_one(c: Candidate) -> dict:
    behaviour = history.params(student["step"] - c.lag) if c.lag else None
    return measure_candidate(c, setup, prompts, student_params, behaviour, position=True)

  rows, entries, measure_seconds = [], [], []
  for i, c in enumerate(candidates):
    if i in problems:
      rows.append(unmeasured_row(c, problems[i], rule.name, budget_name, history is not None))
      continue
    t0 = time.perf_counter()
    whole = measure_one(c)
    measurement, verdict = candidate_verdict(
      c,
      config,
      whole,
      budget,
      lambda _, part: measure_one(part)[budget_lib.KL_KEY],
      rule,
      extrapolate,
    )
    measure_seconds.append(time.perf_counter() - t0)
    row = candidate_row(c, measurement, verdict, student["step"], budget_name, uncalibrated)
    if not uncalibrated:  # how much of its reading comes from the probe
      row["probe"] = budget_lib.probe_note(budget, row["source"].split("+"))
    if history is not None and trained_with(c, history.run_config):
      row.update(training_time_kl(params_from, c.lag) or {})
      if row.get("train/mismatch_kl_last", 0.0) > ROUNDING_KL:
        row["check_over_training"] = row[budget_lib.KL_KEY] / row["train/mismatch_kl_last"]
    rows.append(row)
    entries.append(
      {
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {"candidate": c.spec, "overrides": row["overrides"], "lag": c.lag},
        "engine_id": c.engine_id,
        "sampler": dataclasses.asdict(candidate_sampler_config(c, setup)),
        "measurement": {k: v for k, v in row.items() if k.startswith(("mismatch/", "measure/"))},
        "verdict": {
          k: row[k] for k in ("rule", "admitted", "max_kl", "margin", "too_close", "reasons")
        },
        "num_prompts": num_prompts,
        "student": student,
        "budget_file": None if uncalibrated else budget_name,
        "budget": budget_name,
        "stale_budget_reasons": stale,
        "fingerprint": current_fp,
        "provenance": provenance.provenance(c.config),
      }
    )

  log_path = append_log(workdir, entries) if entries else None
  result = {
    "rows": rows,
    "budget": budget_entry(budget, budget_name, uncalibrated, conservative, rule),
    "student": student,
    "num_prompts": num_prompts,
    "prompts": texts,
    "stale_budget_reasons": stale,
    "forced": bool(stale),
    "seconds": {
      "setup": setup_seconds,
      "measure": measure_seconds,
      "total": time.perf_counter() - start,
    },
    "log_file": log_path,
    "extrapolate": extrapolate,
    "provenance": provenance.provenance(config),
  }
  if uncalibrated:
    head = f"no budget file: using {budget_lib.uncalibrated_note()}"
  else:
    interval = ", ".join(f"{v:.4g}" for v in budget.interval)
    head = (
      f"budget {budget_path}: max_kl {budget.max_kl:.4g} nats/token (interval [{interval}], "
      f"tolerance {budget.tolerance:.4g}, censored {budget.censored})"
    )
  log(
    f"{head}; rule: {rule.describe()}; student: {student['source']}; "
    f"{num_prompts} calibration prompts"
  )
  if not uncalibrated:
    log(budget_lib.probe_note(budget))
  log(format_table(rows))
  if json_path:
    pathlib.Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(json_path).write_text(json.dumps(_json_safe(result), indent=1) + "\n")
  return result


def _unmeasurable(candidates: Sequence[Candidate], history: RunHistory | None) -> dict[int, str]:
  """Candidate index -> what it needs (`stale_lag_problem`), for those that cannot be measured
  with `history` (None: no --params-from run)."""
  found = {i: stale_lag_problem(c, history) for i, c in enumerate(candidates)}
  return {i: problem for i, problem in found.items() if problem}


def measuring_setup(config, workdir: str, params_from: str | None, log):
  """(the check's config, `setup_lib.prepare_models`'s Setup, the --params-from RunHistory or
  None). The check evaluates nothing, and takes a run's teacher cache when the config names
  none."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.train.eval_every = 0  # the check evaluates nothing: no held-out set to build
  if not config.teacher.cache_dir and params_from:
    run_cache = os.path.join(params_from, "teacher_cache")
    if os.path.isdir(run_cache):
      config.teacher.cache_dir = run_cache
  spec = setup_lib.run_spec(config)
  setup = setup_lib.prepare_models(spec, workdir, log)
  history = RunHistory(spec, setup, params_from) if params_from else None
  return config, setup, history


def check_prompts(config, setup: setup_lib.Setup, num_prompts: int):
  """(texts, (tokens [N, P], lens [N])) of the calibration prompts."""
  m = setup.models
  texts, tokens_bp, lens_b = calibration_prompts(config, m.tokenizer, setup.task_cfg, num_prompts)
  return texts, (tokens_bp, lens_b)


def check_student(config, setup, history, params_from, candidates, prompts, workdir: str, log):
  """(the student's params, {"source", "step"}): the --params-from run's latest checkpoint, or
  the student a run starts from (cached under `<workdir>/student_cache`)."""
  if history is None:
    cache = os.path.join(workdir, STUDENT_CACHE)
    source = config.student.checkpoint or "warm-started built-in student"
    return initial_student(config, setup, log, cache), {"source": source, "step": 0}
  # The candidates' programs are traced from the student's shapes and compiled in the
  # background while this thread reads the checkpoint (imports orbax, restores): Python and
  # I/O beside XLA's compiles instead of before them.
  compiling = [start_compiling(c, setup, prompts, history.abstract_params) for c in candidates]
  params = history.params(history.latest)
  for job in compiling:
    job.result()
  return params, {
    "source": f"{history.run_dir} checkpoint {history.latest}",
    "step": history.latest,
  }


def budget_entry(
  budget: budget_lib.Budget, name: str, uncalibrated: bool, conservative: bool, rule
) -> dict:
  """The result's "budget" entry: its name (the file's path, or UNCALIBRATED_LABEL), whether it
  was calibrated, the limit and the rule; a file's tolerance and censoring, or the default's
  provenance (`budget.uncalibrated_note`)."""
  entry = {
    "name": name,
    "calibrated": not uncalibrated,
    "file": None if uncalibrated else name,
    "max_kl": budget.max_kl,
    "interval": list(budget.interval),
    "conservative": conservative,
    "rule": budget_file.rule_dict(rule),
  }
  if uncalibrated:
    entry["note"] = budget_lib.uncalibrated_note()
  else:
    entry.update(tolerance=budget.tolerance, censored=budget.censored)
  return entry
