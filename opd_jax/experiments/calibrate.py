"""A mismatch budget for any student–teacher pair: the study's procedure on the user's run.

    python -m opd_jax.calibrate --config=<your run config> --workdir=DIR [--quick]
        [--candidate=SPEC ...]

`make_plan` turns the run config a user trains with (HF checkpoints with a prompt and an eval
file, or the built-in task) into a study config (`opd_jax.experiments.study`), and `calibrate`
runs it: a probe run, the admission check's measurement of every ladder setting at the probe's
student, short OPD runs of each, the isotonic fit over τ, written as a budget file fingerprinted
to this student and teacher and carrying its rule; then each `--candidate` is screened against
that budget (measured at the probe's student, not trained). A restarted calibration reuses every
finished run and measurement (the study's resume).

The two designs:

                     quick                                  full
    reference        2 seeds                                5 seeds
    ladders          weight noise, and one ladder per       every source's ladder (LADDERS)
                     source of the candidates
    runs per setting 2 (seeds 0 and 1)                      1, and a borderline one again
                                                            with seeds 1 and 2
    run length       train.steps / 4                        train.steps / 2
    label            `auto`: held-out accuracy when the pair solves the task, else the
                     held-out KL(student ‖ teacher) (`study.choose_label`)

Weight noise is the one source known to cross τ on every pair measured so far; the quantized
formats and kernels measure far below it on small models, so their ladders mostly give
censored limits that bound them from below. A source with no ladder in LADDERS (a format
combination typed by the user) is calibrated on the candidate's own part.

The cost is reported up front as a multiple of one training run of the config, in optimizer
steps: (probe steps + Σ runs · run steps) / train.steps (`Plan.cost_runs`), and measured at the
end as the wall seconds of every trained run, summed, over the reference runs' mean wall seconds
scaled to train.steps (`measured_cost`). The measured figure leaves out the probe, the
measurements and the sensitivity scan, and it moves with how long each run's setup and
compilation took (the first runs compile, later ones load programs from the cache).

The rule written into the budget file is "pooled" by default: one limit on the check's
per-token KL for every source. On the study's recorded rounds (4 to 8) it was never worse than
the rule each round had fixed beforehand (docs/budget_rules.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np

from opd_jax.config import check as config_check
from opd_jax.config.values import DEFAULT_NUM_PROMPTS
from opd_jax.experiments import runs, study_probe, study_rules, study_setting
from opd_jax.experiments import study as study_lib
from opd_jax.io import json_file
from opd_jax.mismatch import budget, budget_file
from opd_jax.mismatch import candidates as candidates_lib

QUICK, FULL = "quick", "full"
NOISE = "noise"
# The settings calibrated for each source, from harmless to as hard as the source gets. The
# quick design takes noise's QUICK ladder and each other source's mildest and hardest setting
# (its QUICK ladder where it has one): noise is the source that crosses τ, the others mostly
# bound their limit from below.
LADDERS = {
  NOISE: {
    QUICK: tuple(f"rollout.noise_sigma={s}" for s in (0.1, 0.2, 0.4, 0.8)),
    FULL: tuple(f"rollout.noise_sigma={s}" for s in (0.05, 0.1, 0.2, 0.4, 0.8)),
  },
  "stale": {
    QUICK: tuple(f"rollout.stale_k={k}" for k in (4, 16)),
    FULL: tuple(f"rollout.stale_k={k}" for k in (1, 2, 4, 8, 16)),
  },
  "bf16_weights": ("rollout.weights=bf16",),
  "fp8_weights": (
    "rollout.weights=fp8",
    "rollout.weights=fp8,rollout.weight_block_size=32",
    "rollout.weights=fp8,rollout.weight_per_tensor=true",
  ),
  "fp8_e5m2_weights": (
    "rollout.weights=fp8_e5m2",
    "rollout.weights=fp8_e5m2,rollout.weight_per_tensor=true",
  ),
  "int8_weights": ("rollout.weights=int8,rollout.weight_group_size=32", "rollout.weights=int8"),
  "int4_weights": (
    "rollout.weights=int4,rollout.weight_group_size=32",
    "rollout.weights=int4,rollout.weight_group_size=128",
    "rollout.weights=int4",
  ),
  "fp4_weights": (
    "rollout.weights=fp4,rollout.weight_group_size=16",
    "rollout.weights=fp4,rollout.weight_group_size=32",
  ),
  "fp8_kv": ("rollout.kv_cache=fp8", "rollout.kv_cache=fp8,rollout.kv_granularity=tensor"),
  "kernel": ("rollout.kernel=bf16_matmul", "rollout.kernel=bf16_attention"),
  "bf16_head": ("rollout.head_dtype=bfloat16",),
}
SEEDS = {QUICK: (0, 1), FULL: (0, 1, 2, 3, 4)}
RUN_FRACTION = {QUICK: 4, FULL: 2}  # a run is train.steps // this
MIN_EVAL_PROMPTS = 16  # fewer held-out prompts cannot resolve a drop of a few points
DEFAULT_RULE = "pooled"


def ladder(source: str, design: str) -> tuple[str, ...]:
  """The calibration settings of `source` under `design` (LADDERS; () for a source it lacks):
  its ladder for the design, or in the quick design its first and last setting."""
  entry = LADDERS.get(source, ())
  if isinstance(entry, dict):
    return entry[design]
  return entry if design == FULL or len(entry) <= 2 else (entry[0], entry[-1])


@dataclasses.dataclass(frozen=True)
class Plan:
  """A calibration, fixed before anything trains.

  Attributes:
    study: the study config `study.run_study` runs.
    design: "quick" or "full".
    candidates: the specs screened at the end (measured, not trained).
    sources: the sources calibrated, in order.
    num_runs: OPD runs the design trains (a borderline re-run of the full design not counted).
    cost_runs: (probe steps + num_runs · run steps) / full_steps.
    full_steps: the run config's own train.steps: one training run.
  """

  study: ml_collections.ConfigDict
  design: str
  candidates: tuple[str, ...]
  sources: tuple[str, ...]
  num_runs: int
  cost_runs: float
  full_steps: int

  def describe(self) -> str:
    s = self.study
    return (
      f"calibration ({self.design}): sources {', '.join(self.sources)}; "
      f"{len(s.seeds)} reference seeds, {len(s.calibration)} ladder settings, "
      f"{self.num_runs} runs of {s.run.train.steps} steps and a {s.probe_steps}-step probe; "
      f"cost ≈ {self.cost_runs:.1f}× one training run of the config (in optimizer steps)"
    )


def _sources(spec: str, run_cfg) -> list[str]:
  """The sources of a candidate, refusing one that changes nothing the engine does."""
  candidate = candidates_lib.parse_candidate(spec, run_cfg)
  source = candidates_lib.candidate_source(candidate)
  if source == study_setting.REFERENCE:
    raise ValueError(
      f"candidate {spec!r} changes nothing the rollout engine does: it has no mismatch source "
      "to calibrate (it is the trainer's own engine)"
    )
  return source.split("+")


def _parts(spec: str, run_cfg) -> list[tuple[str, str]]:
  """(source, the spec of the candidate's part of it alone) for each source of a candidate;
  a one-source candidate is its own part."""
  candidate = candidates_lib.parse_candidate(spec, run_cfg)
  parts = candidates_lib.source_parts(candidate, run_cfg)
  return list(parts.items()) or [(candidates_lib.candidate_source(candidate), spec)]


def check_prompts(run_cfg, workdir: str, num_prompts: int, log: Callable = print) -> int:
  """Refuses, before anything trains, a run config whose files, tokenizers or evaluation do
  not check (`train.preflight.check`), one with no held-out evaluation or fewer than
  MIN_EVAL_PROMPTS held-out prompts, and a prompt file with fewer than `num_prompts` + 1
  prompts for the admission check's measurements. Returns the number of held-out prompts a
  run is scored on (the binomial noise floor's n)."""
  from opd_jax.train import preflight
  from opd_jax.train import setup as setup_lib

  checked = preflight.check(setup_lib.run_spec(run_cfg), workdir, log)
  if run_cfg.data.prompt_file:
    held = checked.eval_prompts
    num_eval = 0 if held is None else len(held)
    if num_eval < MIN_EVAL_PROMPTS:
      raise ValueError(
        f"the run config gives {num_eval} held-out prompts; a calibration needs at least "
        f"{MIN_EVAL_PROMPTS} to score its runs (set data.eval_file, or data.eval_size with a "
        "larger prompt file)"
      )
    train = checked.train_prompts
    if train is not None and len(train) < num_prompts + 1:
      raise ValueError(
        f"{run_cfg.data.prompt_file} leaves {len(train)} training prompts; the admission "
        f"check measures each setting on {num_prompts} (--prompts)"
      )
    return num_eval
  if run_cfg.data.eval_size < MIN_EVAL_PROMPTS:
    raise ValueError(
      f"data.eval_size={run_cfg.data.eval_size}: a calibration needs at least "
      f"{MIN_EVAL_PROMPTS} held-out prompts to score its runs"
    )
  return int(run_cfg.data.eval_size)


def make_plan(
  run_cfg: ml_collections.ConfigDict,
  *,
  quick: bool,
  candidates: Sequence[str] = (),
  run_steps: int = 0,
  seeds: Sequence[int] = (),
  rule: str = DEFAULT_RULE,
  label: str = "auto",
  num_prompts: int = DEFAULT_NUM_PROMPTS,
  workers: int = 2,
  sensitivity: bool = True,
) -> Plan:
  """The study config of a calibration of `run_cfg` (module docstring), checked.

  Args:
    run_cfg: the run config the user trains with; it is not modified.
    quick: the quick design, else the full one.
    candidates: specs to screen at the end; their sources get ladders in the quick design.
    run_steps: steps per calibration run; 0 = train.steps // RUN_FRACTION[design] (the
      schedule is compressed to it, as the study's runs are).
    seeds: the reference seeds; () = SEEDS[design].
    rule: the admission rule the budget file carries (`budget.RULE_NAMES`).
    label: "auto" | "accuracy" | "teacher_kl" (`study.choose_label`).
    num_prompts: calibration prompts per measurement.
    workers: runs trained side by side.
    sensitivity: also the layer-sensitivity scan and FP8 recipe at the probe's student.

  Raises:
    ValueError: a run config the trainer refuses, a candidate that does not parse or has no
      source, a rule or label that does not exist, or runs too short for the ladders' lags.
  """
  config_check.validate(run_cfg)
  design = QUICK if quick else FULL
  if rule not in budget.RULE_NAMES:
    raise ValueError(f"rule {rule!r} must be one of {', '.join(budget.RULE_NAMES)}")
  if label not in study_lib.LABELS:
    raise ValueError(f"label {label!r} must be one of {', '.join(study_lib.LABELS)}")
  candidates = tuple(candidates)
  sources = [NOISE]
  for spec in candidates:
    sources += [s for s in _sources(spec, run_cfg) if s not in sources]
  if not quick:
    sources += [s for s in LADDERS if s not in sources]
  calibration = []
  for source in sources:
    own = ladder(source, design)
    if not own:  # a source LADDERS lacks: the candidates' own parts of it
      parts = [p for spec in candidates for p in _parts(spec, run_cfg)]
      own = tuple(part for src, part in parts if src == source)
    calibration += [s for s in own if s not in calibration]
  steps = run_steps or max(run_cfg.train.steps // RUN_FRACTION[design], 1)
  lags = [candidates_lib.parse_candidate(s, run_cfg).lag for s in (*calibration, *candidates)]
  probe_steps = max(max(lags, default=0) + 1, steps // 10, 2)
  if probe_steps >= steps:
    raise ValueError(
      f"calibration runs of {steps} steps are too short for a probe of {probe_steps} steps "
      f"(the ladders reach lag {max(lags, default=0)}); raise --run-steps or train.steps"
    )
  seeds = tuple(int(s) for s in (seeds or SEEDS[design]))
  c = ml_collections.ConfigDict()
  run = runs.with_overrides(
    run_cfg,
    {
      "train.steps": steps,
      "train.stop_after": 0,
      "train.eval_every": steps,
      "train.checkpoint_every": max(steps // 4, 1),
      "export.dir": "none",
    },
  )
  c.run = run
  c.seeds = seeds
  c.probe_steps = probe_steps
  c.probe_lag = max(lags, default=0)  # the screened candidates' lags need checkpoints too
  c.num_eval = 0  # held-out prompts scored per run; 0 = data.eval_size (`check_prompts` sets it)
  c.num_prompts = num_prompts
  c.tolerance = 0.0
  c.sensitivity = sensitivity
  c.workers = workers
  c.label = label
  c.rule = rule
  c.per_source = True
  c.per_part = False
  c.min_crossing_records = 2
  c.calibration = tuple(calibration)
  c.held_out = ()
  if quick:  # every setting twice: a second seed for each ladder point
    c.borderline_roles = ()
    c.borderline_seeds = (seeds[1],) if len(seeds) > 1 else ()
    c.rerun_all_roles = ("calibration",) if len(seeds) > 1 else ()
  else:
    c.borderline_roles = ("calibration",)
    c.borderline_seeds = tuple(seeds[1:3])
    c.rerun_all_roles = ()
  runs_per_setting = 1 + len(c.borderline_seeds) if quick else 1
  num_runs = len(seeds) + runs_per_setting * len(calibration)
  cost = (probe_steps + num_runs * steps) / run_cfg.train.steps
  return Plan(c, design, candidates, tuple(sources), num_runs, cost, run_cfg.train.steps)


def measured_cost(result: dict, full_steps: int) -> float:
  """The calibration's training as a multiple of one full training run: the wall seconds of
  every run it trained, summed (each run's own, so runs side by side count in full and a
  restart loses nothing), over one run of the config, taken as the reference runs' mean wall
  seconds scaled from the runs' steps to `full_steps` (so a run's fixed setup is scaled too)."""
  reference = [
    s
    for r in result["rows"]
    if r["role"] == study_setting.REFERENCE
    for s in r["wall_seconds_runs"]
  ]
  one_run = float(np.mean(reference)) * full_steps / result["run_steps"]
  return result["train_seconds"] / one_run if one_run > 0 else math.nan


def screen(plan: Plan, workdir: str, log: Callable = print) -> list[dict]:
  """Each candidate measured at the probe's student and judged against the calibrated budget
  with its rule (`admission.candidate_verdict`, the admission check's own path)."""
  if not plan.candidates:
    return []
  config = plan.study
  settings = [
    study_setting.Setting(
      study_setting.setting_name(spec),
      spec,
      study_setting.source_of(candidates_lib.parse_candidate(spec, config.run)),
      "screen",
      int(config.seeds[0]),
    )
    for spec in plan.candidates
  ]
  probe_dir = os.path.join(workdir, "runs", study_probe.PROBE)
  measured, _ = study_probe.measure_settings(config, settings, probe_dir, workdir, log)
  fitted, _ = budget_file.load_budget(os.path.join(workdir, study_lib.BUDGET_FILE))
  rows = [{"spec": s.spec, "source": s.source, **measured[s.spec]} for s in settings]
  out = []
  for row, verdict in zip(
    rows, study_rules.verdicts(rows, config, fitted, fitted.rule), strict=True
  ):
    out.append(
      {
        "spec": row["spec"],
        "source": row["source"],
        budget.KL_KEY: row[budget.KL_KEY],
        "admitted": verdict.admitted,
        "limit": verdict.limit,
        "limit_source": verdict.limit_source,
        "margin": verdict.margin,
        "too_close": verdict.too_close,
        "extrapolation": verdict.extrapolation,
        "reasons": list(verdict.reasons),
      }
    )
  return out


def calibrate(plan: Plan, workdir: str, log: Callable = print) -> dict:
  """Runs `plan` in `workdir` (the study, then the screen); returns the study's result with
  "calibration": the design, the planned and measured cost, and the screened candidates."""
  result = study_lib.run_study(plan.study, workdir, log)
  screened = screen(plan, workdir, log)
  summary = {
    "design": plan.design,
    "sources": list(plan.sources),
    "num_runs_planned": plan.num_runs,
    "cost_runs_planned": plan.cost_runs,
    "cost_runs_measured": measured_cost(result, plan.full_steps),
    "screen": screened,
  }
  for row in screened:
    verdict = "admit" if row["admitted"] else "refuse"
    close = ", too close to call" if row["too_close"] else ""
    log(
      f"{verdict}: {row['spec']} (mismatch/kl {row[budget.KL_KEY]:.3g}, limit "
      f"{row['limit']:.3g} from {row['limit_source'] or 'the pooled limit'}{close})"
    )
  log(
    f"budget: {result['budget']['file']}; cost {summary['cost_runs_measured']:.1f}× one training "
    f"run measured ({plan.cost_runs:.1f}× planned in steps)"
  )
  result["calibration"] = summary
  json_file.write_json(os.path.join(workdir, study_lib.STUDY_FILE), result)
  return result
