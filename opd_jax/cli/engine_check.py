"""Screening an engine that is not this one, behind `python -m opd_jax.admit`:
`export_prompts` (--export-prompts=FILE: the check's calibration prompts for the engine to
complete) and `run_engine_screen` (--engine-samples=FILE: its completions, estimated and judged).

The screen builds what the admission check builds (`admit_check.measuring_setup`,
`check_prompts`, `check_student`: the same calibration prompts and the same student), reads
the engine's samples (`io.engine_samples`), refuses what the estimate cannot read, scores the
sampled tokens under the trainer's student and estimates KL(engine ‖ trainer) by k3 with a
bootstrap interval (`mismatch.engine_screen`), and judges it by the budget's rule. Its row has
the check's columns (`admit_check.verdict_fields`) with the interval beside the estimate; an
interval that holds the limit gets the call "too close".
"""

from __future__ import annotations

import datetime
import os
import pathlib
import time
from collections.abc import Callable

import ml_collections

from opd_jax.cli import admit_check
from opd_jax.config import check as config_check
from opd_jax.config.values import DEFAULT_NUM_PROMPTS
from opd_jax.io import build, json_file
from opd_jax.io import engine_samples as samples_io
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_file, engine_screen
from opd_jax.mismatch.admission import calibration_prompts, current_fingerprint
from opd_jax.train import setup as setup_lib

ENGINE_ID = "external"  # the engine_id of a row screened from samples
# The screen's table: the check's columns, the k3 interval in the place of the p95.
COLUMNS = tuple(
  col
  for c in admit_check.COLUMNS
  for col in (
    [("kl_low", "mismatch/kl_low", ".4g"), ("kl_high", "mismatch/kl_high", ".4g")]
    if c[1] == "mismatch/kl_p95"
    else [("k3_kl", c[1], c[2])]
    if c[1] == budget_lib.KL_KEY
    else [c]
  )
)


def prompt_id(i: int) -> str:
  """The id of calibration prompt i in an exported file."""
  return f"calib-{i:05d}"


def screen_sampling(config: ml_collections.ConfigDict, eos_id: int) -> dict:
  """The settings the engine must sample with: the check's temperature and completion budget,
  no top-k / top-p / min-p filter, the stop token, and the sampled token's log-probability.

  Raises:
    ValueError: a config that samples greedily or with a filter (the screen cannot read those).
  """
  r = config.rollout
  if not r.temperature > 0:
    raise ValueError(
      "rollout.temperature is 0 (greedy): greedy decoding has no sampled distribution to "
      "estimate a KL from; screen at --config.rollout.temperature > 0"
    )
  if r.top_k or r.top_p < 1:
    raise ValueError(
      f"rollout.top_k={r.top_k}, rollout.top_p={r.top_p}: an engine's log-probabilities after a "
      "top-k/top-p filter are renormalised over what it kept, where the k3 estimate needs the "
      "model's softmax; screen with --config.rollout.top_k=0 --config.rollout.top_p=1"
    )
  return {
    "temperature": float(r.temperature),
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "max_tokens": int(r.max_new_tokens),
    "stop_token_ids": [int(eos_id)],
    "logprobs": 0,
  }


def _prompt_records(texts, tokens_np, lens_n) -> list[dict]:
  return [
    {"prompt_id": prompt_id(i), "prompt": text, "prompt_token_ids": tokens_np[i, : lens_n[i]]}
    for i, text in enumerate(texts)
  ]


def export_prompts(
  config: ml_collections.ConfigDict,
  path: str,
  *,
  num_prompts: int = DEFAULT_NUM_PROMPTS,
  log: Callable[..., None] = print,
) -> dict:
  """Writes the check's N calibration prompts (`calibration_prompts`, the same ones the check
  measures on) for another engine to complete: one JSON line each with its id, text, token ids
  and the sampling settings (`screen_sampling`). Builds no model.

  Returns:
    {"file": path, "num_prompts": N, "sampling_params": ...}.
  """
  config_check.validate(config)
  spec = setup_lib.run_spec(config)
  plan = build.plan_models(spec)
  sampling = screen_sampling(config, plan.tokenizer.eos_id)
  texts, tokens_np, lens_n = calibration_prompts(
    config, plan.tokenizer, setup_lib.task_config(spec), num_prompts
  )
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  samples_io.write_prompts(path, _prompt_records(texts, tokens_np, lens_n), sampling)
  log(
    f"wrote {num_prompts} calibration prompts to {path}; sample each with {sampling} "
    "(from its prompt_token_ids), then screen the completions with --engine-samples=FILE"
  )
  return {"file": path, "num_prompts": num_prompts, "sampling_params": sampling}


def run_engine_screen(
  config: ml_collections.ConfigDict,
  budget_path: str | None,
  samples_path: str,
  *,
  engine_format: str = "auto",
  engine_temperature: float | None = None,
  engine_source: str | None = None,
  num_prompts: int = DEFAULT_NUM_PROMPTS,
  workdir: str,
  params_from: str | None = None,
  force: bool = False,
  conservative: bool = False,
  extrapolate: str = "refuse",
  method: str = "percentile",
  num_bootstrap: int = engine_screen.NUM_BOOTSTRAP,
  seed: int = engine_screen.SEED,
  json_path: str | None = None,
  log: Callable[..., None] = print,
) -> dict:
  """Screens an engine from its samples of the exported prompts (module docstring).

  Args:
    config, budget_path, num_prompts, workdir, params_from, force, conservative, extrapolate,
      json_path, log: as `admit_check.run_admission`'s (the same prompts, student and budget).
    samples_path: the engine's completions (`io.engine_samples.read_engine_samples`).
    engine_format: one of `io.engine_samples.FORMATS`.
    engine_temperature: the temperature the engine sampled at, for records that do not say.
    engine_source: the engine's mismatch sources ("fp8_weights+fp8_kv"), for a rule with
      per-source limits; None: the overall limit.
    method, num_bootstrap, seed: the interval (`engine_screen.bootstrap_interval`).

  Returns:
    {"rows": [the engine's row], "budget", "student", "num_prompts", "samples", "format",
     "temperature", "stale_budget_reasons", "forced", "seconds", "log_file"}.

  Raises:
    ValueError: samples the estimate cannot read (`engine_screen.check_samples`), a stale
      budget without `force`; FileNotFoundError: no samples or budget file.
  """
  start = time.perf_counter()
  config_check.validate(config)
  if not os.path.exists(samples_path):
    raise FileNotFoundError(f"no engine samples file {samples_path}")
  budget, saved_fp = budget_file.load_budget_or_default(budget_path or budget_lib.UNCALIBRATED)
  uncalibrated = saved_fp is None
  budget_name = admit_check.UNCALIBRATED_LABEL if uncalibrated else os.path.abspath(budget_path)
  rule = budget.rule or budget_lib.POOLED
  rule = rule.with_params(conservative=True) if conservative else rule
  completions = samples_io.read_engine_samples(samples_path, engine_format)
  # The samples are checked against the prompts before any weights load (`build.plan_models`).
  plan = build.plan_models(setup_lib.run_spec(config))
  sampling = screen_sampling(config, plan.tokenizer.eos_id)
  texts, tokens_np, lens_n = calibration_prompts(
    config, plan.tokenizer, setup_lib.task_config(setup_lib.run_spec(config)), num_prompts
  )
  matched = engine_screen.check_samples(
    completions,
    _prompt_records(texts, tokens_np, lens_n),
    vocab_size=plan.student_cfg.real_vocab_size,
    temperature=sampling["temperature"],
    max_new_tokens=sampling["max_tokens"],
    stop_tokens=sampling["stop_token_ids"],
    engine_temperature=engine_temperature,
  )
  config, setup, history = admit_check.measuring_setup(config, workdir, params_from, log)
  m = setup.models
  params, student = admit_check.check_student(
    config, setup, history, params_from, [], None, workdir, log
  )
  current_fp = current_fingerprint(setup, params)
  stale = [] if uncalibrated else admit_check.check_budget_fresh(saved_fp, current_fp, force)
  if stale:
    log("warning: the budget is stale (--force):\n  " + "\n  ".join(stale))
  setup_seconds = time.perf_counter() - start
  t0 = time.perf_counter()
  trainer_lp = engine_screen.score_samples(
    params, m.student_cfg, tokens_np, lens_n, matched, sampling["max_tokens"]
  )
  estimate = engine_screen.estimate_kl(
    trainer_lp,
    [c.logprobs for c in matched.completions],
    num_bootstrap=num_bootstrap,
    seed=seed,
    method=method,
    groups=matched.prompt_index,
  )
  _, verdict, straddles = engine_screen.screen_verdict(
    estimate, budget, rule, engine_source, extrapolate
  )
  row = {
    "candidate": f"engine samples {os.path.basename(samples_path)}",
    "overrides": {},
    "engine_id": ENGINE_ID,
    "lag": None,
    "source": engine_source or "unnamed",
    "rule": rule.name,
    "estimator": "k3",
    **{k: v for k, v in estimate.items() if k.startswith(("mismatch/", "measure/"))},
    "interval": estimate["interval"],
    **admit_check.verdict_fields(verdict, budget_name, uncalibrated, straddles),
  }
  if straddles:
    low, high = estimate["mismatch/kl_low"], estimate["mismatch/kl_high"]
    row["reasons"].append(
      f"the k3 interval [{low:.4g}, {high:.4g}] holds the limit {verdict.limit:.4g}: too close "
      "to call from these samples (more completions narrow it)"
    )
  measure_seconds = time.perf_counter() - t0
  entry = {
    "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "config": {"engine_samples": os.path.abspath(samples_path), "format": engine_format},
    "engine_id": ENGINE_ID,
    "sampler": sampling,
    "measurement": {k: v for k, v in row.items() if k.startswith(("mismatch/", "measure/"))},
    "verdict": {
      k: row[k] for k in ("rule", "admitted", "max_kl", "margin", "too_close", "reasons")
    },
    "num_prompts": num_prompts,
    "student": student,
    "budget": budget_name,
    "stale_budget_reasons": stale,
    "fingerprint": current_fp,
  }
  log_path = admit_check.append_log(workdir, [entry])
  result = {
    "rows": [row],
    "budget": admit_check.budget_entry(budget, budget_name, uncalibrated, conservative, rule),
    "student": student,
    "num_prompts": num_prompts,
    "samples": os.path.abspath(samples_path),
    "format": engine_format,
    "temperature": sampling["temperature"],
    "stale_budget_reasons": stale,
    "forced": bool(stale),
    "seconds": {
      "setup": setup_seconds,
      "measure": [measure_seconds],
      "total": time.perf_counter() - start,
    },
    "log_file": log_path,
  }
  head = (
    f"no budget file: using {budget_lib.uncalibrated_note()}"
    if uncalibrated
    else f"budget {budget_path}: max_kl {budget.max_kl:.4g} nats/token"
  )
  log(
    f"{head}; rule: {rule.describe()}; student: {student['source']}; engine samples: "
    f"{estimate['measure/completions']} completions, {estimate['measure/tokens']} tokens at "
    f"temperature {sampling['temperature']:g}; k3 estimate of KL(engine || trainer) with its "
    f"{estimate['interval']['level']:.0%} {method} bootstrap interval"
  )
  log(admit_check.format_table([row], COLUMNS))
  if json_path:
    json_file.write_json(json_path, result)
  return result
