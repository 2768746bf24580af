"""The admission check: screen candidate rollout configurations against a calibrated budget.

    python -m opd_jax.admit --config=... --budget=FILE --candidate=SPEC [--candidate=SPEC ...]

This module owns the check's logic (docs/design.md, "Budget and admission"); `opd_jax.admit` only
parses flags and calls `run_admission`. For each candidate, with no training:

1. the candidate is a rollout configuration in the config's own terms, a comma-separated list
   of `rollout.<key>=<value>` overrides applied to a copy of the run config and validated by
   `config.check.validate` (so a misspelt key gets the same "did you mean" as `main`);
2. `measure.measure` samples the N calibration prompts with the candidate's engine
   T(θ) (weights, KV numerics, noise, sampling settings) and scores the same tokens under the
   trainer's student θ (`measure_candidate`: the procedure the budget's records must be
   measured with, so the study calls it too);
3. `candidate_verdict` gives the verdict, the margin and the reasons: it names the candidate's
   sources (`candidates.candidate_source`, what its engine changes against the trainer's:
   "noise", "stale+fp8_kv"), measures each part of a combination alone when the budget's rule
   reads parts (`candidates.source_parts`), and applies the rule the budget file records
   (`budget_rules.apply_rule`, docs/budget_rules.md) — the one path the live guard and the study
   take too. `--conservative` sets the rule's "conservative" parameter (every limit at the lower
   end of its interval), which is then not the rule the file was validated with; the summary
   line names the rule and what it scored. A measurement inside the band of its limit (the
   limit at the two ends of the bootstrap intervals) is marked "too close" in the "call"
   column: only a full run can tell there;
4. a table is printed, the same rows go to `--json`, and one JSON line per candidate is
   appended to `<workdir>/admission_log.jsonl` (configuration → measurement).

The student is the one the trainer trains. `--params-from=RUN` restores the student of RUN's
latest checkpoint (`RUN/checkpoints/<step>`, the trainer's orbax layout); without it the
student is the one a run starts from: the HF checkpoint, or for the built-in task the
warm-started student (`config.student.warmup_steps` supervised steps, seed + 7, as
`train.setup.initial_state` does it; cached under `<workdir>/student_cache` by the first check, so
later checks load it instead of training). The teacher is built as the trainer builds it
(`train.setup.prepare_models`, its cache included) because the budget's fingerprint names it.

Calibration prompts. The first N prompts of the built-in task's held-out split (disjoint from
every training prompt by the task's prompt hash) drawn with seed `config.seed + 2`, a stream
of its own (the trainer's evaluation uses `seed + 1`): fixed for a config, the same for every
candidate and for the study that calibrates the budget (`calibration_prompts`). With
`data.prompt_file` they are the file's first N prompts, which the training also visits: the
check trains on nothing, so this does not bias the measurement, but they are not held out.
Every candidate is measured with the same key (`measurement_key`), so candidates share their
sampling uniforms and noise draws: differences between rows come from the configurations.

Staleness. A stale engine samples with θ_{t−k} while the trainer scores with θ_t; its mismatch
is set by what k training steps changed, which no single set of weights holds. The check
measures it only from a training history: with `--params-from=RUN` whose checkpoints hold the
latest step t and step t − k, the candidate's engine T(θ_{t−k}) samples and θ_t scores
(`measure(..., trainer_params=θ_t)`). The lag k is `rollout.stale_k` (sync) or
`rollout.max_lag` (async, the largest lag the bound lets through: the async loop trains on lags
0…max_lag, so this measures its worst batches, not their average). Without such a pair the
candidate is refused with a message naming the steps that are there and the settings that keep
the needed checkpoints (`train.checkpoint_every=1`, `train.keep_checkpoints` ≥ k + 1). The
mismatch of a stale engine depends on where in training it is measured (the update size shrinks
with the learning-rate schedule and as the loss falls): a budget calibrated at one point says
little about staleness at another.

Agreement with training. With `--params-from=RUN`, a candidate whose rollout settings are the
run's own (every rollout.* key equal) also gets the run's training-time `mismatch/kl` beside the
check's value (`training_time_kl`: the per-lag `mismatch/kl/lag_<k>` at the candidate's lag k,
else `mismatch/kl`; the mean over the last 10% of the logged steps and over all of them) and
their ratio `check_over_training` (left out when the training value is below 1e-6, f32
rounding). The check measures at one set of weights on N held-out prompts; training averages
over the weights and prompts of many steps: the two agree when the mismatch changes little
along training, which the ratio shows.

Cost. A check is mostly XLA compilation. The command compiles without backend optimisation
(`io.compile_cache.fast_compilation`: a third of the optimised compile time, the same KLs to
~1e-6 relative), and keeps its compiled programs in `<workdir>/jax_cache`
(`io.compile_cache.enable_compilation_cache`), so only the first check of a config on a machine
compiles. The compiles run beside the Python work: each candidate's three programs are traced
from the student's shapes and compiled on worker threads (`measure.start_compiling`) while this
thread traces the next one and then reads the --params-from student
(`io.run_history.RunHistory.params`: a finished run's last step from its export's safetensors,
other steps from their orbax checkpoints, orbax being imported only then); XLA holds no Python
lock while it compiles. The command ends without the interpreter's teardown
(`cli.flags.exit_at_once`) once its outputs are closed. `python -m opd_jax.bench.admission_cost`
reports the cost of a first and a later check as fractions of a training run of the same config.

Uncalibrated default. Without a budget file (`budget_path` None or "uncalibrated") the check
screens against the uncalibrated default limit (`budget.uncalibrated_budget`:
`budget.UNCALIBRATED_MAX_KL` nats/token, the lowest knee over the calibrated student–teacher
pairs at the lower end of its interval) with the pooled rule, through the same `apply_rule`. It
says so in its header line, in every row's "limit from" ("uncalibrated default") and "call"
("uncalibrated": with no interval, no band to be too close to), and in the JSON ("budget":
"uncalibrated default" in every row and in the result's "budget" entry, with "calibrated":
false). The default belongs to no model: no fingerprint is compared, so nothing is stale and
`force` changes nothing; its interval has zero width, so `conservative` changes nothing either.

Stale budget. The budget file's fingerprint (`budget_file.fingerprint`) names the student
(the params the check scores with), the teacher, the quantization format, the backend and the
jax versions. A mismatch refuses the check with one line per change (`budget_file.
stale_reasons`) unless `force=True`, which still reports them. A budget calibrated on the
warm-started student is stale for a `--params-from` student: its mismatch was measured at
other weights.
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
from opd_jax.data import pipeline as data
from opd_jax.data import prompts as prompts_lib
from opd_jax.data import task
from opd_jax.inference import sampler
from opd_jax.io import metrics_writer
from opd_jax.io.run_history import RunHistory
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_file, budget_rules
from opd_jax.mismatch import measure as measure_lib
from opd_jax.mismatch.candidates import (
  CANDIDATE_PREFIX,
  Candidate,
  candidate_source,
  parse_candidate,
  source_parts,
)
from opd_jax.rollout import worker as rollout_worker
from opd_jax.train import setup as setup_lib

# The FP8 numerics this codebase quantizes with (quant.py: e4m3fn values, f32 scales); a budget
# fingerprints it so that a change of format makes the budget stale.
QUANT_FORMAT = "fp8_e4m3fn"


CALIBRATION_SEED_OFFSET = 2  # calibration prompts: seed + 2 (evaluation uses seed + 1)


DEFAULT_NUM_PROMPTS = 64


LOG_FILE = "admission_log.jsonl"


STUDENT_CACHE = "student_cache"  # <workdir>/student_cache: the warm-started student, once


# Below this (nats/token) a mismatch/kl is f32 rounding (an exact engine reads ~1e-9): no ratio.
ROUNDING_KL = 1e-6


UNCALIBRATED_LABEL = "uncalibrated default"  # a row's "budget" and "limit from" without a file


# Table columns: (header, row key, format).
_COLUMNS = (
  ("candidate", "candidate", "s"),
  ("lag", "lag", "d"),
  ("mismatch/kl", "mismatch/kl", ".4g"),
  ("kl_p95", "mismatch/kl_p95", ".4g"),
  ("max_kl", "max_kl", ".4g"),
  ("limit from", "limit_from", "s"),
  ("margin", "margin", ".4g"),
  ("verdict", "verdict", "s"),
  ("call", "call", "s"),
)


def calibration_prompts(config, tokenizer, task_cfg: task.TaskConfig, num_prompts: int):
  """The N calibration prompts (module docstring) as (texts, tokens [N, P], lens [N])."""
  if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
    raise ValueError(f"the number of calibration prompts must be an int >= 1, got {num_prompts!r}")
  if config.data.prompt_file:
    source = data.JsonlSource(config.data.prompt_file)
    if len(source) < num_prompts:
      raise ValueError(
        f"{config.data.prompt_file} has {len(source)} prompts; fewer than the {num_prompts} asked"
      )
  else:
    seed = config.seed + CALIBRATION_SEED_OFFSET
    source = task.TaskSource("heldout", num_prompts, seed, task_cfg)
  width = setup_lib.prompt_width(source, tokenizer, task_cfg, bool(config.data.prompt_file))
  # A chat record ("messages") is its rendered chat template, as training reads it.
  texts = [prompts_lib.record_text(source[i], tokenizer) for i in range(num_prompts)]
  tokens_bp, lens_b = task.encode_prompts(texts, tokenizer, width)
  return texts, tokens_bp, lens_b


def measurement_key(config):
  """The key every candidate is measured with (and the study's records): key(config.seed)."""
  return rollout_worker.host_key(config.seed)


def current_fingerprint(setup: setup_lib.Setup, student_params) -> dict:
  """`budget_file.fingerprint` of the check's setup: the student it scores with, the teacher."""
  m = setup.models
  return budget_file.fingerprint(
    m.student_cfg, student_params, m.teacher_cfg, m.teacher_params, QUANT_FORMAT
  )


def initial_student(config, setup: setup_lib.Setup, log=print, cache_dir: str | None = None):
  """The student a run starts from: the HF checkpoint's params, or the warm-started built-in
  student, loaded from `cache_dir` when a run or an earlier check saved it there
  (`setup_lib.warm_started_student`, the same function and cache the trainer uses)."""
  return setup_lib.warm_started_student(config, setup, log, cache_dir)


def candidate_sampler_config(candidate: Candidate, setup: setup_lib.Setup) -> sampler.SamplerConfig:
  """The sampler settings the trainer would use with the candidate's config."""
  m = setup.models
  kv = candidate.engine_cfg.kv
  return setup_lib.sampler_config(
    candidate.config, m.tokenizer.eos_id, kv, m.student_cfg.real_vocab_size
  )


def measure_candidate(
  candidate: Candidate, setup: setup_lib.Setup, prompts, student_params, behaviour_params=None
) -> dict:
  """The check's measurement of one candidate: what a budget record's x-axis must be.

  `measure.measure` with the candidate's engine and sampling settings, the key
  `measurement_key(config)` and π_θ = `student_params`; the engine samples with
  T(`behaviour_params`) when given (θ_(t−k) for a stale candidate), else T(`student_params`).
  The study calibrating a budget calls this with the same prompts (`calibration_prompts`) so
  that its records and the check share one procedure.

  Returns:
    `measure.measure`'s dict: the mismatch/* floats, measure/* timings, engine_id.
  """
  return measure_lib.measure(
    *_measure_args(candidate, setup, prompts, student_params, behaviour_params),
    trainer_params=student_params,
  )


def start_compiling(
  candidate: Candidate, setup: setup_lib.Setup, prompts, student_params
) -> measure_lib.Compiling:
  """Starts compiling what `measure_candidate` runs for `candidate`
  (`measure.start_compiling`), from the student's params or their shapes (a stale candidate's
  behaviour params have the same shapes): `measure_candidate` then finds the programs in
  memory."""
  return measure_lib.start_compiling(
    *_measure_args(candidate, setup, prompts, student_params), trainer_params=student_params
  )


def _measure_args(candidate, setup, prompts, student_params, behaviour_params=None) -> tuple:
  """`measure.measure`'s positional arguments for a candidate."""
  return (
    student_params if behaviour_params is None else behaviour_params,
    setup.models.student_cfg,
    candidate.engine_cfg,
    prompts,
    measurement_key(candidate.config),
    candidate_sampler_config(candidate, setup),
  )


def candidate_verdict(
  candidate: Candidate,
  base: ml_collections.ConfigDict,
  measurement: dict,
  budget: budget_lib.Budget,
  measure_part: Callable[[str, Candidate], float] | None,
  rule: budget_lib.Rule | None = None,
) -> tuple[dict, budget_rules.Verdict]:
  """The verdict on one measured candidate: the path the admission check, the live guard and
  the study share.

  Names the candidate's sources in the measurement ("source", `candidate_source`); when the
  rule reads parts (`Rule.needs_parts`) and the candidate has two or more sources, adds
  "mismatch/kl/part/<s>" = `measure_part(s, part)` for each part (`source_parts` against
  `base`, the config the candidate modifies) that the measurement does not already hold; then
  applies the rule (`budget_rules.apply_rule`).

  Args:
    candidate: the parsed candidate.
    base: the config it modifies (its parts are specs against it).
    measurement: `measure_candidate`'s dict for the whole candidate (not modified).
    budget: the loaded Budget.
    measure_part: (source, part candidate) -> that part's mismatch/kl; None when the
      measurement already holds every part it needs.
    rule: the rule to apply; None: the budget's (`budget_rules.apply_rule`).

  Returns:
    (the measurement with "source" and the parts, the Verdict).

  Raises:
    ValueError: a part needed but neither held nor measurable.
  """
  rule = budget.rule if rule is None else rule
  out = {**measurement, budget_lib.SOURCE_KEY: candidate_source(candidate)}
  if rule is not None and rule.needs_parts:
    for source, spec in source_parts(candidate, base).items():
      key = f"{budget_lib.PART_KL_PREFIX}{source}"
      if key in out:
        continue
      if measure_part is None:
        raise ValueError(
          f"candidate {candidate.spec!r}: the {rule.name} rule needs its {source} part "
          f"({spec!r}) measured alone, and no measurement of it was given"
        )
      out[key] = float(measure_part(source, parse_candidate(spec, base)))
  return out, budget_rules.apply_rule(out, budget, rule)


def stale_lag_problem(candidate: Candidate, history: RunHistory | None) -> str | None:
  """Why `candidate`'s lag cannot be measured with this history (None when it can)."""
  k = candidate.lag
  if k == 0:
    return None
  keep = (
    f"a run that keeps them: --config.train.checkpoint_every=1 "
    f"--config.train.keep_checkpoints={k + 1} or more"
  )
  if history is None:
    return (
      f"candidate {candidate.spec!r} samples with weights {k} version(s) old: its mismatch is "
      f"what {k} training step(s) change, so measuring it needs the student at two versions "
      f"{k} apart, θ_(t-{k}) to sample and θ_t to score; pass --params-from=RUN with "
      f"checkpoints at steps t and t-{k} ({keep})"
    )
  t = history.latest
  if t - k not in history.steps:
    lags = sorted(t - s for s in history.steps)
    return (
      f"candidate {candidate.spec!r} samples with weights {k} version(s) old; measuring it "
      f"needs checkpoints at the latest step t={t} and at step {t - k}, but {history.run_dir} "
      f"holds steps {history.steps} (lags available from step {t}: {lags}); use {keep}"
    )
  return None


def trained_with(candidate: Candidate, run_config: dict[str, str]) -> bool:
  """Whether the run (its saved config fingerprint) sampled with exactly this candidate: every
  rollout.* key both know holds the same value."""
  mine = {k: repr(v) for k, v in config_check.flatten(candidate.config)}
  keys = [k for k in run_config if k.startswith(CANDIDATE_PREFIX) and k in mine]
  return bool(keys) and all(run_config[k] == mine[k] for k in keys)


def _refuse_unmeasurable(candidates: Sequence[Candidate], history: RunHistory | None) -> None:
  problems = [p for p in (stale_lag_problem(c, history) for c in candidates) if p]
  if problems:
    raise ValueError("\n".join(problems))


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
  UNCALIBRATED_LABEL); with `uncalibrated` (the default limit, module docstring) the row's
  "limit_from" is UNCALIBRATED_LABEL and its "call" "uncalibrated"."""
  row: dict[str, Any] = {
    "candidate": candidate.spec,
    "overrides": {
      k: list(v) if isinstance(v, tuple) else v for k, v in candidate.overrides.items()
    },
    "engine_id": candidate.engine_id,
    "lag": candidate.lag,
    "source": measurement.get("source", ""),
    "rule": verdict.rule,
  }
  if candidate.lag:
    row["behaviour_step"] = student_step - candidate.lag
    row["trainer_step"] = student_step
  row.update({k: v for k, v in measurement.items() if k.startswith(("mismatch/", "measure/"))})
  row.update(
    {
      "max_kl": verdict.limit,
      "limit_from": UNCALIBRATED_LABEL if uncalibrated else verdict.limit_source or "overall",
      "margin": verdict.margin,
      "admitted": verdict.admitted,
      "verdict": "admitted" if verdict.admitted else "rejected",
      "limit_band": list(verdict.limit_band),
      "too_close": verdict.too_close,
      "call": "uncalibrated" if uncalibrated else "too close" if verdict.too_close else "clear",
      "reasons": list(verdict.reasons),
      "budget": budget_label,
    }
  )
  if verdict.layer_margins:
    row["layer_margins"] = {str(i): v for i, v in verdict.layer_margins.items()}
  return row


def format_cell(value, fmt: str) -> str:
  """One table cell: numbers with `fmt`, text as is."""
  if fmt == "s":
    return str(value)
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return format(value, fmt)


def format_table(rows: Sequence[dict]) -> str:
  """The check's table: one line per candidate, then its reasons indented below it."""
  header = [h for h, _, _ in _COLUMNS]
  cells = [[format_cell(r[key], fmt) for _, key, fmt in _COLUMNS] for r in rows]
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
        f"{row['train/logged_steps']})"
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
  """`stale_reasons` of the budget; raises ValueError listing them unless `force`."""
  reasons = budget_file.stale_reasons(saved_fp, current_fp)
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
) -> dict:
  """Runs the admission check (module docstring) and returns what `--json` writes.

  Args:
    config: the run config the candidates modify (validated here).
    budget_path: a budget file written by `budget_file.save_budget`; None or "uncalibrated":
      the uncalibrated default limit (module docstring).
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
    json_path: also write the result as JSON there.
    log: progress and the table go here.

  Returns:
    {"rows": [one `candidate_row` per candidate], "budget": {"name": the file's path or
     "uncalibrated default", "calibrated": bool, "file": the path or None, "max_kl", ...},
     "student": {...},
     "num_prompts": N, "stale_budget_reasons": [...], "forced": bool, "seconds": {"setup":
     models and student (with `params_from`, the candidates' compiles too: they run beside the
     restore), "measure": one per candidate, "total"}, "log_file": path}.

  Raises:
    ValueError: a bad spec, a stale budget without `force`, a stale candidate without the
      checkpoints it needs, an unusable --params-from run; FileNotFoundError: no budget file.
  """
  start = time.perf_counter()
  if not specs:
    raise ValueError("give at least one --candidate")
  config_check.validate(config)
  budget, saved_fp = budget_file.load_budget_or_default(budget_path or budget_lib.UNCALIBRATED)
  uncalibrated = saved_fp is None
  budget_name = UNCALIBRATED_LABEL if uncalibrated else os.path.abspath(budget_path)
  candidates = [parse_candidate(spec, config) for spec in specs]
  if params_from is None:  # refuse stale candidates before building anything
    _refuse_unmeasurable(candidates, None)

  config = ml_collections.ConfigDict(config.to_dict())
  config.train.eval_every = 0  # the check evaluates nothing: no held-out set to build
  if not config.teacher.cache_dir and params_from:
    run_cache = os.path.join(params_from, "teacher_cache")
    if os.path.isdir(run_cache):
      config.teacher.cache_dir = run_cache
  setup = setup_lib.prepare_models(config, workdir, log)
  history = RunHistory(config, setup, params_from) if params_from else None
  _refuse_unmeasurable(candidates, history)
  m = setup.models
  texts, tokens_bp, lens_b = calibration_prompts(config, m.tokenizer, setup.task_cfg, num_prompts)
  if history is not None:
    # The candidates' programs are traced from the student's shapes and compiled in the
    # background while this thread reads the checkpoint (imports orbax, restores): Python and
    # I/O beside XLA's compiles instead of before them.
    prompts = (tokens_bp, lens_b)
    compiling = [start_compiling(c, setup, prompts, history.abstract_params) for c in candidates]
    student_params, student_step = history.params(history.latest), history.latest
    for job in compiling:
      job.result()
    student = {"source": f"{params_from} checkpoint {student_step}", "step": student_step}
  else:
    cache = os.path.join(workdir, STUDENT_CACHE)
    student_params, student_step = initial_student(config, setup, log, cache), 0
    source = config.student.checkpoint or "warm-started built-in student"
    student = {"source": source, "step": 0}
  setup_seconds = time.perf_counter() - start

  current_fp = current_fingerprint(setup, student_params)
  hint = (
    "(--params-from measures that run's trained student; a budget is tied to the student its "
    "records were measured on.)\n"
    if params_from
    else ""
  )
  stale = [] if uncalibrated else check_budget_fresh(saved_fp, current_fp, force, hint)
  if stale:
    log("warning: the budget is stale (--force):\n  " + "\n  ".join(stale))

  rule = budget.rule or budget_lib.POOLED
  rule = rule.with_params(conservative=True) if conservative else rule

  def measure_one(c: Candidate) -> dict:
    behaviour = history.params(student_step - c.lag) if c.lag else None
    return measure_candidate(c, setup, (tokens_bp, lens_b), student_params, behaviour)

  rows, entries, measure_seconds = [], [], []
  for c in candidates:
    t0 = time.perf_counter()
    whole = measure_one(c)
    measurement, verdict = candidate_verdict(
      c, config, whole, budget, lambda _, part: measure_one(part)[budget_lib.KL_KEY], rule
    )
    measure_seconds.append(time.perf_counter() - t0)
    row = candidate_row(c, measurement, verdict, student_step, budget_name, uncalibrated)
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
      }
    )

  log_path = append_log(workdir, entries)
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
  log(format_table(rows))
  if json_path:
    pathlib.Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(json_path).write_text(json.dumps(_json_safe(result), indent=1) + "\n")
  return result


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


TRAIN_LAST_FRACTION = 0.1  # training-time mismatch/kl: the last 10% of the logged steps


def training_time_kl(run_dir: str, lag: int, last_fraction: float = TRAIN_LAST_FRACTION):
  """The run's training-time `mismatch/kl` (to answer: does the check's
  pre-training measurement agree with what training logged for the same configuration?).

  Reads `run_dir/metrics.jsonl`: the per-lag breakdown `mismatch/kl/lag_<lag>` (the trainer
  logs it for every lag its batches had in a log window), else `mismatch/kl` (older runs).
  The whole-run mean mixes early steps, whose updates (hence stale mismatch) are larger, with
  late ones; the mean over the last `last_fraction` of the logged steps is the one to set beside
  a check at the latest checkpoint.

  Returns:
    {"train/key", "train/mismatch_kl_mean", "train/mismatch_kl_last", "train/logged_steps"}, or
    None when the run logged neither key.
  """
  path = os.path.join(run_dir, metrics_writer.JSONL_NAME)
  if not os.path.exists(path):
    return None
  rows = metrics_writer.read_jsonl(run_dir)
  for key in (f"{budget_lib.KL_KEY}/lag_{lag}", budget_lib.KL_KEY):
    values = [r[key] for _, r in sorted(rows.items()) if key in r]
    if values:
      tail = values[-max(1, math.ceil(last_fraction * len(values))) :]
      return {
        "train/key": key,
        "train/mismatch_kl_mean": sum(values) / len(values),
        "train/mismatch_kl_last": sum(tail) / len(tail),
        "train/logged_steps": len(values),
      }
  return None
