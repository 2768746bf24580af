"""One mismatch measurement of a rollout configuration, outside training.

This is the procedure that the layer-sensitivity scan, the prefix-shift study and the
admission check share (DESIGN.md, "Admission check", steps 1–3), so that their numbers
sit on one scale:

1. params_r = T(θ) (`engine.engine_params`: bf16 cast, fp8 recipe, weight noise,
   kernel variant) and the KV numerics `engine_cfg.kv`; sample the given prompts with
   `sampler.sample`, returning the behaviour distribution π_b
   (`mismatch.default_return_topk(V)` unless the caller chose one).
2. Score the same tokens under the unperturbed trainer student θ_trainer: the
   teacher-forced logits at the rollout's temperature (`train_step.completion_logits`)
   under the engine's kept set (`train_step.student_policy_logits`; the replayed point
   mass for greedy rollouts, as in `train_step.opd_loss`).
3. `mismatch.mismatch_metrics(π_θ logits, rollout)`: the `mismatch/*` means over every
   counted completion token, plus their tails.

Keys. `rng` is split by name exactly as the trainer's rollout engine splits the run key
(`rollouts.RolloutEngine`): the sampling key is fold_in(stream "rollout/sample", 0) and
the weight-noise key fold_in(stream "rollout/noise", 0). Two measurements with the same
`rng` therefore share their random numbers: the same uniforms drive the inverse-CDF
sampling of both engines (what the first-divergence statistic of `prefix_shift` needs),
and the same ε draws the noise of every σ.

An engine identical to the trainer (weights="trainer", the trainer's KV dtype, the
reference kernel) reads 0 on every metric up to the f32 rounding by which the cached
decode differs from the uncached forward.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from opd_jax import engine, mismatch, sampler, train_step
from opd_jax.model_config import ModelConfig
from opd_jax.rollout import Rollout
from opd_jax.rollouts import named_stream

PER_TOKEN_KEY = "per_token/kl"  # the optional per-token KL array in `measure`'s result


@jax.jit
def engine_keys(rng) -> tuple[jax.Array, jax.Array]:
  """(sample key, noise key) for one measurement, named as the trainer names them (one
  program: eager fold_ins would compile one each on first use)."""
  sample_key = jax.random.fold_in(named_stream(rng, "rollout/sample"), 0)
  noise_key = jax.random.fold_in(named_stream(rng, "rollout/noise"), 0)
  return sample_key, noise_key


@functools.partial(jax.jit, static_argnums=1)
def engine_params(params, engine_cfg: engine.EngineConfig, rng):
  """`engine.engine_params` under jit (one compilation per engine configuration)."""
  return engine.engine_params(params, engine_cfg, rng)


def engine_sampler_config(
  engine_cfg: engine.EngineConfig, sampler_cfg: sampler.SamplerConfig, vocab_size: int
) -> sampler.SamplerConfig:
  """`sampler_cfg` with the engine's KV numerics and, when it returns none, the behaviour
  distribution the KL needs (`mismatch.default_return_topk(vocab_size)`)."""
  top = sampler_cfg.return_topk or mismatch.default_return_topk(vocab_size)
  return dataclasses.replace(sampler_cfg, kv=engine_cfg.kv, return_topk=top)


def engine_rollout(
  student_params,
  student_cfg: ModelConfig,
  engine_cfg: engine.EngineConfig,
  prompts,
  rng,
  sampler_cfg: sampler.SamplerConfig,
) -> Rollout:
  """Step 1: samples `prompts` with the engine T(θ) described by `engine_cfg`.

  Args:
    student_params: θ, the dense params the engine is derived from.
    student_cfg: the student's ModelConfig.
    engine_cfg: the weight transform, KV numerics and kernel.
    prompts: a list of token-id lists or a (tokens [B, P], lens [B]) pair.
    rng: the measurement key (see the module docstring for how it is split).
    sampler_cfg: the sampling settings; its `kv` is replaced by `engine_cfg.kv`.

  Returns:
    The Rollout, with the behaviour distribution and `engine_id = engine_cfg.engine_id`.
  """
  sample_key, noise_key = engine_keys(rng)
  params_r = engine_params(student_params, engine_cfg, noise_key)
  cfg = engine_sampler_config(engine_cfg, sampler_cfg, student_cfg.real_vocab_size)
  return sampler.sample(
    params_r, prompts, sample_key, cfg, student_cfg, engine_id=engine_cfg.engine_id
  )


def policy_logits(params, rollout: Rollout, cfg: ModelConfig, temperature: float):
  """π_θ's logits [B, C, V] on the rollout's prefixes, under the rollout's transform.

      z = forward(θ)/T restricted to the engine's kept set   (T > 0)
      the point mass on the sampled token                    (T = 0, greedy)

  exactly as `train_step.opd_loss` scores the student for `mismatch/*`.
  """
  raw_bcv, tokens_bc, _ = train_step.completion_logits(params, rollout, cfg, temperature)
  if temperature > 0:
    return train_step.student_policy_logits(raw_bcv, rollout)
  return train_step.greedy_policy_logits(raw_bcv, tokens_bc)


@functools.partial(jax.jit, static_argnames=("cfg", "temperature"))
def score_rollout(params, rollout: Rollout, cfg: ModelConfig, temperature: float):
  """Steps 2–3: the `mismatch/*` metrics of π_θ = `params` against the rollout's π_b.

  Args:
    params: θ_trainer, the unperturbed student (dense).
    rollout: a Rollout carrying its behaviour distribution.
    cfg: the student's ModelConfig (static).
    temperature: the rollout's sampling temperature (static; 0 = greedy).

  Returns:
    (metrics: dict of f32 scalars as `mismatch.mismatch_metrics`, kl_bc: f32 [B, C] the
    per-token KL(π_b ‖ π_θ), meaningful where `rollout.completion_mask` is 1).
  """
  logits_bcv = policy_logits(params, rollout, cfg, temperature)
  metrics = mismatch.mismatch_metrics(logits_bcv, rollout)
  kl_bc = mismatch.per_token_kl(logits_bcv, rollout)
  return metrics, kl_bc


def measure(
  student_params,
  student_cfg: ModelConfig,
  engine_cfg: engine.EngineConfig,
  prompts,
  rng,
  sampler_cfg: sampler.SamplerConfig,
  *,
  trainer_params=None,
  return_per_token: bool = False,
) -> dict:
  """Measures the mismatch of one rollout configuration on calibration prompts.

  Samples `prompts` with params_r = T(`student_params`) and the KV numerics of
  `engine_cfg`, scores the same tokens under the unperturbed trainer student, and
  returns the `mismatch/*` metrics over all counted completion tokens:

      mismatch/kl = (1/N) Σ_t KL(π_b(·|prefix_t) ‖ π_θ(·|prefix_t))     (N tokens)

  and likewise kl_p95, kl_max, k1, k3, abs_logp_diff{,_p95,_max} (`mismatch.metrics`).

  Args:
    student_params: the dense params θ_v the engine samples from.
    student_cfg: the student's ModelConfig.
    engine_cfg: the candidate rollout configuration (`engine.EngineConfig`).
    prompts: a list of token-id lists or a (tokens [B, P], lens [B]) pair.
    rng: a PRNG key; the same key gives the same measurement (module docstring).
    sampler_cfg: the sampling settings (temperature, top-k/top-p, max_new_tokens, stop
      tokens); its KV spec is replaced by `engine_cfg.kv`.
    trainer_params: the params π_θ is scored with; default `student_params` (pass the
      current weights here and older ones as `student_params` to measure staleness).
    return_per_token: also return the per-token KL of the counted tokens as a 1-D
      numpy array under `PER_TOKEN_KEY` (row-major over [B, C]).

  Returns:
    A dict of Python floats: every `mismatch/*` metric, "measure/tokens" (N),
    "measure/sample_seconds" (until the sampler is launched: its compilation on a first call),
    "measure/score_seconds" (the rest: decoding, and the scorer's compilation beside it, then
    scoring), "measure/seconds" (wall time), and "engine_id" (a str).
  """
  if not isinstance(engine_cfg, engine.EngineConfig):
    raise ValueError(f"engine_cfg must be an engine.EngineConfig, got {type(engine_cfg).__name__}")
  if not isinstance(sampler_cfg, sampler.SamplerConfig):
    raise ValueError(f"sampler_cfg must be a sampler.SamplerConfig, got {type(sampler_cfg)}")
  if trainer_params is None:
    trainer_params = student_params
  start = time.perf_counter()
  rollout = engine_rollout(student_params, student_cfg, engine_cfg, prompts, rng, sampler_cfg)
  dispatched = time.perf_counter()  # the sampler compiled and launched, not finished
  # Scoring is dispatched before the samples are waited for, so that its compilation (on a
  # first call) runs while the sampler decodes. engine_id is a static field: scoring without
  # it compiles once for every engine.
  metrics, kl_bc = score_rollout(
    trainer_params, rollout.replace(engine_id=""), student_cfg, sampler_cfg.temperature
  )
  mask_bc = np.asarray(rollout.completion_mask)
  metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
  scored = time.perf_counter()
  result = dict(metrics)
  result["measure/tokens"] = float(mask_bc.sum())
  result["measure/sample_seconds"] = dispatched - start
  result["measure/score_seconds"] = scored - dispatched
  result["measure/seconds"] = scored - start
  result["engine_id"] = engine_cfg.engine_id
  if return_per_token:
    result[PER_TOKEN_KEY] = np.asarray(kl_bc)[mask_bc > 0]
  return result
