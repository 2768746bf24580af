"""The admission check's library: measure a candidate rollout configuration and judge it.

`measure_candidate` measures one candidate on the calibration prompts (`calibration_prompts`,
the same for every candidate and for the study), with the trainer's student scoring what the
candidate's engine samples; `candidate_verdict` names its sources, measures a combination's
parts when the budget's rule reads them, and applies the rule (`budget_rules.apply_rule`, the
path the live guard and the study take too). `stale_lag_problem` says what a stale candidate
needs; `training_time_kl` reads what a run logged for the same configuration. The command
(`python -m opd_jax.admit`: its driver, table and log) is `opd_jax.cli.admit_check`. The
procedure, staleness, the uncalibrated default and a stale budget are described in
docs/design.md ("Budget and admission").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

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


# Below this (nats/token) a mismatch/kl is f32 rounding (an exact engine reads ~1e-9): no ratio.
ROUNDING_KL = 1e-6


def calibration_prompts(config, tokenizer, task_cfg: task.TaskConfig, num_prompts: int):
  """The N calibration prompts as (texts, tokens [N, P], lens [N]).

  The first N prompts of the built-in task's held-out split (disjoint from every training
  prompt by the task's prompt hash), drawn with seed `config.seed + 2`, a stream of its own (the
  trainer's evaluation uses seed + 1); with `data.prompt_file`, the file's first N prompts (which
  training also visits: not held out, but the check trains on nothing)."""
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
  return setup_lib.warm_started_student(setup_lib.run_spec(config), setup, log, cache_dir)


def candidate_sampler_config(candidate: Candidate, setup: setup_lib.Setup) -> sampler.SamplerConfig:
  """The sampler settings the trainer would use with the candidate's config."""
  m = setup.models
  kv = candidate.engine_cfg.kv
  return setup_lib.sampler_config(
    setup_lib.run_spec(candidate.config), m.tokenizer.eos_id, kv, m.student_cfg.real_vocab_size
  )


def measure_candidate(
  candidate: Candidate,
  setup: setup_lib.Setup,
  prompts,
  student_params,
  behaviour_params=None,
  position: bool = False,
) -> dict:
  """The check's measurement of one candidate: what a budget record's x-axis must be.

  `measure.measure` with the candidate's engine and sampling settings, the key
  `measurement_key(config)` and π_θ = `student_params`; the engine samples with
  T(`behaviour_params`) when given (θ_(t−k) for a stale candidate), else T(`student_params`).
  The study calibrating a budget calls this with the same prompts (`calibration_prompts`) so
  that its records and the check share one procedure.

  With `position`, the dict also holds the KL by position and the first crossings under
  `measure.POSITION_KEY`, with the candidate config's `train.mismatch_bucket_tokens` (when
  > 0) and `train.mismatch_cross_kl`.

  Returns:
    `measure.measure`'s dict: the mismatch/* floats, measure/* timings, engine_id.

  Raises:
    ValueError: the candidate samples greedily (temperature 0) or keeps one token per step
      (top_k 1): π_b and π_θ are then both the point mass on the sampled token, and every
      mismatch reads 0 whatever the engine, so the measurement could not refuse anything.
  """
  r = candidate.config.rollout
  if not r.temperature > 0 or int(r.get("top_k", 0)) == 1:
    raise ValueError(
      f"candidate {candidate.spec!r} samples with rollout.temperature={r.temperature} and "
      f"rollout.top_k={r.get('top_k', 0)}: each step's distribution is the point mass on the "
      "sampled token for both the engine and the trainer, so its mismatch reads 0 whatever the "
      "engine does; measure it at the temperature the run will sample at (> 0, top_k 0 or > 1)"
    )
  t = candidate.config.train
  return measure_lib.measure(
    *_measure_args(candidate, setup, prompts, student_params, behaviour_params),
    trainer_params=student_params,
    position=(t.mismatch_bucket_tokens, t.mismatch_cross_kl)
    if position and t.mismatch_bucket_tokens
    else None,
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
  extrapolate: str = "refuse",
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
    extrapolate: what to do with a candidate the budget's records do not reach
      (`budget_rules.apply_rule`): "refuse", "pooled" or "default".

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
  return out, budget_rules.apply_rule(out, budget, rule, extrapolate=extrapolate)


def stale_lag_problem(candidate: Candidate, history: RunHistory | None) -> str | None:
  """Why `candidate`'s lag cannot be measured with this history (None when it can).

  A stale engine samples with θ_(t−k) while the trainer scores with θ_t, k = `rollout.stale_k`
  (sync) or `rollout.max_lag` (async: its worst batches); its mismatch is what k training steps
  change, so it is measured only from a run's checkpoints at the latest step t and at t − k."""
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


TRAIN_LAST_FRACTION = 0.1  # training-time mismatch/kl: the last 10% of the logged steps


def training_time_kl(run_dir: str, lag: int, last_fraction: float = TRAIN_LAST_FRACTION):
  """The run's training-time `mismatch/kl` (to answer: does the check's
  pre-training measurement agree with what training logged for the same configuration?).

  Reads `run_dir/metrics.jsonl`: the per-lag breakdown `mismatch/kl/lag_<lag>` (the trainer
  logs it for every lag its batches had in a log window), else `mismatch/kl` (older runs).
  The whole-run mean mixes early steps, whose updates (hence stale mismatch) are larger, with
  late ones; the mean over the last `last_fraction` of the logged steps is the one to set beside
  a check at the latest checkpoint.

  A non-finite value (a step whose mismatch overflowed) is left out of both means and counted
  in "train/nonfinite_steps", so that one such step does not make the means NaN.

  Returns:
    {"train/key", "train/mismatch_kl_mean", "train/mismatch_kl_last", "train/logged_steps" (the
    finite values), "train/nonfinite_steps"}, or None when the run logged neither key finitely.
  """
  path = os.path.join(run_dir, metrics_writer.JSONL_NAME)
  if not os.path.exists(path):
    return None
  rows = metrics_writer.read_jsonl(run_dir)
  for key in (f"{budget_lib.KL_KEY}/lag_{lag}", budget_lib.KL_KEY):
    logged = [r[key] for _, r in sorted(rows.items()) if key in r]
    values = [v for v in logged if math.isfinite(v)]
    if values:
      tail = values[-max(1, math.ceil(last_fraction * len(values))) :]
      return {
        "train/key": key,
        "train/mismatch_kl_mean": sum(values) / len(values),
        "train/mismatch_kl_last": sum(tail) / len(tail),
        "train/logged_steps": len(values),
        "train/nonfinite_steps": len(logged) - len(values),
      }
  return None
