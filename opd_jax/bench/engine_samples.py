"""Validation of the exported-samples screen on this project's own engines: does the k3 interval
computed from an engine's sampled tokens alone cover the exact KL(engine ‖ trainer)?

Command (CPU; results: docs/results/engine_samples.md):

    python -m opd_jax.bench.engine_samples --config=configs/bf16_sync.py:tiny \\
        --workdir=/tmp/engine_samples --json

For each candidate engine (FP8, INT8, INT4 and FP4 weights, FP8 and FP4 KV caches, BF16
weights, weight noise at two σ, a combination, and a stale student) and each of `--keys`
sampling keys, the engine samples the check's calibration prompts (`measure.engine_rollout`,
the full behaviour distribution kept), and

  1. its completions are written in the plain engine-samples format (token ids and the
     log-probability of each sampled token, nothing else) and read back, checked and scored as
     `python -m opd_jax.admit --engine-samples` reads them (`engine_screen`): the k3 estimate
     K̂ with its percentile and BCa intervals;
  2. the exact KL on the same sampled prefixes, the token mean of Σ_v π_engine(v) (log
     π_engine(v) − log π_θ(v)) over the full vocabulary (`exact_kl`, in float64, from the
     engine's full behaviour distribution and the student's teacher-forced logits).

A case is covered when the exact KL lies in the interval; the target is ≥ 95 % of cases. The
stale engine samples with the student warm-started for `STALE_STEPS` fewer supervised steps
than the student that scores (a weight-version gap without a training run).
"""

from __future__ import annotations

import functools
import os
import time

import numpy as np
from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

CANDIDATES = (
  "rollout.weights=fp8",
  "rollout.weights=fp8,rollout.kv_cache=fp8",
  "rollout.weights=int8",
  "rollout.weights=int4",
  "rollout.weights=fp4,rollout.weight_group_size=32",
  "rollout.kv_cache=fp4",
  "rollout.weights=bf16",
  "rollout.noise_sigma=0.3",
  "rollout.noise_sigma=1.0",
  "rollout.noise_sigma=0.5,rollout.kv_cache=fp8",
)
STALE = "stale"  # the stale engine's name in the table
STALE_STEPS = 2  # how many warm-start steps older the stale engine's student is

_JSON = flags.DEFINE_string("json", None, "Write the result as JSON to PATH (- for stdout).")
_PROMPTS = flags.DEFINE_integer("prompts", 64, "Calibration prompts (completions per case).")
_KEYS = flags.DEFINE_integer("keys", 8, "Sampling keys per engine (cases per engine).")
_BOOTSTRAP = flags.DEFINE_integer("num-bootstrap", 2000, "Bootstrap resamples per interval.")


def _stale_student(config, setup, log):
  """The student warm-started STALE_STEPS supervised steps short (None without a warm start)."""
  import dataclasses

  import ml_collections

  from opd_jax.io import build
  from opd_jax.train import setup as setup_lib

  steps = int(config.student.warmup_steps)
  if config.student.checkpoint or steps <= STALE_STEPS:
    return None
  older = ml_collections.ConfigDict(config.to_dict())
  older.student.warmup_steps = steps - STALE_STEPS
  spec = setup_lib.run_spec(older)
  # Fresh models: the first warm start consumed (donated) the shared random initialisation.
  fresh = dataclasses.replace(setup, models=build.build_models(spec))
  return setup_lib.warm_started_student(spec, fresh, log)


@functools.cache
def _jitted_policy_logits():
  """`measure.policy_logits` jitted once for every case."""
  import jax

  from opd_jax.mismatch import measure as measure_lib

  return jax.jit(measure_lib.policy_logits, static_argnames=("cfg", "temperature"))


def _log_softmax64(x_bcv) -> np.ndarray:
  x = np.asarray(x_bcv, np.float64)
  top = x.max(axis=-1, keepdims=True)
  return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))


def exact_kl(engine_logprobs_bcv, trainer_logits_bcv) -> np.ndarray:
  """KL(π_engine ‖ π_θ) [B, C] over the full vocabulary, in float64:
  Σ_v p_b(v) (log p_b(v) − log p_θ(v)) with both log-softmaxes renormalised in float64 (the
  engine's f32 log-probabilities sum to 1 only to f32 rounding, ~1e-7, which a KL of 1e-8
  would not survive; k3 is insensitive to that offset to first order)."""
  lb = _log_softmax64(engine_logprobs_bcv)
  lq = _log_softmax64(trainer_logits_bcv)
  return np.sum(np.exp(lb) * (lb - lq), axis=-1)


def _case(setup, prompts, trainer, behaviour, cand, key, path):
  """One engine and key: the samples written and screened, beside the exact KL."""
  from opd_jax.cli import engine_check
  from opd_jax.io import engine_samples as samples_io
  from opd_jax.mismatch import admission
  from opd_jax.mismatch import measure as measure_lib

  m = setup.models
  policy_logits = _jitted_policy_logits()
  sampler_cfg = admission.candidate_sampler_config(cand, setup)
  rollout = measure_lib.engine_rollout(
    behaviour, m.student_cfg, cand.engine_cfg, prompts, key, sampler_cfg
  )
  logits_bcv = policy_logits(trainer, rollout, m.student_cfg, sampler_cfg.temperature)
  tokens_bc = np.asarray(rollout.completion_tokens)
  mask_bc = np.asarray(rollout.completion_mask)
  exact_bc = exact_kl(np.asarray(rollout.topk_logprobs), np.asarray(logits_bcv))
  exact = float((exact_bc * mask_bc).sum() / mask_bc.sum())
  logp_bc = np.asarray(rollout.behaviour_logprobs)
  records = []
  for b in range(tokens_bc.shape[0]):
    n = int(mask_bc[b].sum())
    records.append(
      {
        "prompt_id": engine_check.prompt_id(b),
        "completion_token_ids": tokens_bc[b, :n].tolist(),
        "completion_logprobs": logp_bc[b, :n].astype(float).tolist(),
        "temperature": sampler_cfg.temperature,
      }
    )
  samples_io.write_plain(path, records)
  return exact, sampler_cfg


def run(config, workdir: str, num_prompts: int, num_keys: int, num_bootstrap: int, log) -> dict:
  """The validation (module docstring): one row per case, and the coverage of each interval."""
  import jax

  from opd_jax.cli import admit_check, engine_check
  from opd_jax.io import engine_samples as samples_io
  from opd_jax.mismatch import admission, engine_screen
  from opd_jax.mismatch.candidates import parse_candidate
  from opd_jax.rollout import worker as rollout_worker

  start = time.perf_counter()
  config, setup, _ = admit_check.measuring_setup(config, workdir, None, log)
  texts, (tokens_np, lens_n) = admit_check.check_prompts(config, setup, num_prompts)
  prompts = (tokens_np, lens_n)
  exported = [
    {"prompt_id": engine_check.prompt_id(i), "prompt_token_ids": tokens_np[i, : lens_n[i]]}
    for i in range(len(texts))
  ]
  cache = os.path.join(workdir, admit_check.STUDENT_CACHE)
  trainer = admission.initial_student(config, setup, log, cache)
  stale = _stale_student(config, setup, log)
  engines = [(spec, parse_candidate(spec, config), trainer) for spec in CANDIDATES]
  if stale is not None:
    engines.append((STALE, parse_candidate("rollout.weights=trainer", config), stale))
  samples_dir = os.path.join(workdir, "samples")
  os.makedirs(samples_dir, exist_ok=True)
  m = setup.models
  rows = []
  for e, (name, cand, behaviour) in enumerate(engines):
    for k in range(num_keys):
      key = rollout_worker.host_key(config.seed + 1000 * (k + 1))
      path = os.path.join(samples_dir, f"engine{e:02d}_key{k}.jsonl")
      exact, sampler_cfg = _case(setup, prompts, trainer, behaviour, cand, key, path)
      matched = engine_screen.check_samples(
        samples_io.read_engine_samples(path, "plain"),
        exported,
        vocab_size=m.student_cfg.real_vocab_size,
        temperature=sampler_cfg.temperature,
        max_new_tokens=sampler_cfg.max_new_tokens,
        stop_tokens=sampler_cfg.stop_tokens,
      )
      trainer_lp = engine_screen.score_samples(
        trainer, m.student_cfg, tokens_np, lens_n, matched, sampler_cfg.max_new_tokens
      )
      engine_lp = [c.logprobs for c in matched.completions]
      row = {"engine": name, "key": k, "exact_kl": exact}
      for method in engine_screen.METHODS:
        est = engine_screen.estimate_kl(
          trainer_lp,
          engine_lp,
          num_bootstrap=num_bootstrap,
          seed=k,
          method=method,
          groups=matched.prompt_index,
        )
        low, high = est["mismatch/kl_low"], est["mismatch/kl_high"]
        row.update(
          {
            "k3_kl": est["mismatch/kl"],
            "tokens": est["measure/tokens"],
            f"{method}_low": low,
            f"{method}_high": high,
            f"{method}_covers": bool(low <= exact <= high),
          }
        )
      rows.append(row)
      log(
        f"[{len(rows)}/{len(engines) * num_keys}] {name} key {k}: exact {exact:.4g}, k3 "
        f"{row['k3_kl']:.4g} [{row['percentile_low']:.4g}, {row['percentile_high']:.4g}] "
        f"bca [{row['bca_low']:.4g}, {row['bca_high']:.4g}]"
      )
  coverage = {
    method: float(np.mean([r[f"{method}_covers"] for r in rows]))
    for method in engine_screen.METHODS
  }
  return {
    "config": "tiny" if config.student.warmup_steps < 50 else "default",
    "num_prompts": num_prompts,
    "keys": num_keys,
    "engines": [name for name, _, _ in engines],
    "rows": rows,
    "coverage": coverage,
    "cases": len(rows),
    "num_bootstrap": num_bootstrap,
    "level": engine_screen.LEVEL,
    "seconds": time.perf_counter() - start,
    "device": jax.devices()[0].platform,
  }


def main():
  log = cli_flags.log_for_json(_JSON.value)
  result = run(
    cli_flags.CONFIG.value,
    cli_flags.WORKDIR.value,
    _PROMPTS.value,
    _KEYS.value,
    _BOOTSTRAP.value,
    log,
  )
  cov = ", ".join(f"{k} {v:.1%}" for k, v in result["coverage"].items())
  log(f"coverage of the exact KL over {result['cases']} cases: {cov} ({result['seconds']:.0f} s)")
  if _JSON.value:
    json_file.write_json(_JSON.value, result)


if __name__ == "__main__":
  runner.run_command(main, required=("config", "workdir"))
