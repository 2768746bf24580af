"""One mismatch measurement of a rollout configuration, outside training.

This is the procedure that the layer-sensitivity scan, the prefix-shift study and the
admission check share (docs/design.md, "Admission check", steps 1–3), so that their numbers
sit on one scale:

1. params_r = T(θ) (`transform.engine_params`: bf16 cast, fp8 recipe, weight noise,
   kernel variant) and the KV numerics `engine_cfg.kv`; sample the given prompts with
   `sampler.sample`, returning the behaviour distribution π_b
   (`mismatch.default_return_topk(V)` unless the caller chose one).
2. Score the same tokens under the unperturbed trainer student θ_trainer: the
   teacher-forced logits at the rollout's temperature (`teacher_forcing.completion_logits`)
   under the engine's kept set (`policy.student_policy_logits`; the replayed point
   mass for greedy rollouts, as in `train_step.opd_loss`).
3. `mismatch.mismatch_metrics(π_θ logits, rollout)`: the `mismatch/*` means over every
   counted completion token, plus their tails.

Keys. `rng` is split by name exactly as the trainer's rollout engine splits the run key
(`rollout_worker.RolloutWorker`): the sampling key is fold_in(stream "rollout/sample", 0) and
the weight-noise key fold_in(stream "rollout/noise", 0). Two measurements with the same
`rng` therefore share their random numbers: the same uniforms drive the inverse-CDF
sampling of both engines (what the first-divergence statistic of `prefix_shift` needs),
and the same ε draws the noise of every σ.

An engine identical to the trainer (weights="trainer", the trainer's KV dtype, the
reference kernel) reads 0 on every metric up to the f32 rounding by which the cached
decode differs from the uncached forward.

Programs. `measure` runs three compiled programs, the engine transform with its keys
(`engine_inputs`), the sampler (`sample_prepared`) and the scorer (`score_rollout`), which
`start_compiling` traces one after the other and compiles on worker threads: a one-off check
is mostly compilation, and this way XLA compiles beside the Python work instead of after it.
`engine_rollout` is step 1 alone, through `sampler.sample`, for callers that want the rollout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time

import jax
import numpy as np

from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import sampler, teacher_forcing, transform
from opd_jax.model.config import ModelConfig
from opd_jax.rollout.worker import named_stream
from opd_jax.train import mismatch_metrics as mismatch
from opd_jax.train import policy

PER_TOKEN_KEY = "per_token/kl"  # the optional per-token KL array in `measure`'s result
POSITION_KEY = "position"  # the optional by-position summary in `measure`'s result


@jax.jit
def engine_keys(rng) -> tuple[jax.Array, jax.Array]:
  """(sample key, noise key) for one measurement, named as the trainer names them (one
  program: eager fold_ins would compile one each on first use)."""
  sample_key = jax.random.fold_in(named_stream(rng, "rollout/sample"), 0)
  noise_key = jax.random.fold_in(named_stream(rng, "rollout/noise"), 0)
  return sample_key, noise_key


@functools.partial(jax.jit, static_argnums=1)
def engine_inputs(params, engine_cfg: transform.EngineConfig, rng):
  """(params_r = T(θ) drawn with the noise key, the sampling key): `engine_keys` and
  `transform.engine_params` as one program, one compilation per engine configuration."""
  sample_key, noise_key = engine_keys(rng)
  return transform.engine_params(params, engine_cfg, noise_key), sample_key


def engine_sampler_config(
  engine_cfg: transform.EngineConfig, sampler_cfg: sampler.SamplerConfig, vocab_size: int
) -> sampler.SamplerConfig:
  """`sampler_cfg` with the engine's KV numerics and, when it returns none, the behaviour
  distribution the KL needs (`mismatch.default_return_topk(vocab_size)`)."""
  top = sampler_cfg.return_topk or mismatch.default_return_topk(vocab_size)
  return dataclasses.replace(sampler_cfg, kv=engine_cfg.kv, return_topk=top)


def engine_rollout(
  student_params,
  student_cfg: ModelConfig,
  engine_cfg: transform.EngineConfig,
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
  params_r, sample_key = engine_inputs(student_params, engine_cfg, rng)
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
  raw_bcv, tokens_bc, _ = teacher_forcing.completion_logits(params, rollout, cfg, temperature)
  if temperature > 0:
    return policy.student_policy_logits(raw_bcv, rollout)
  return policy.greedy_policy_logits(raw_bcv, tokens_bc)


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


# The sampler as one program from prepared inputs (`sampler.prepare`): the decode loop and the
# rollout's assembly, so that its output shapes (the scorer's input) are known once it is traced.
sample_prepared = jax.jit(
  sampler.sample_prepared, static_argnames=("prepared", "weight_version", "engine_id")
)


# XLA compiles here, beside the Python work of the caller's thread (`start_compiling`).
_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=3, thread_name_prefix="compile")


@dataclasses.dataclass(frozen=True)
class Compiling:
  """The three programs of one measurement on their way (`start_compiling`).

  Attributes:
    engine, sampler, scorer: futures of `jax.stages.Compiled` programs, called with their array
      arguments only: engine(student_params, rng) -> (params_r, sample_key),
      sampler(params_r, *inputs, sample_key) -> Rollout, scorer(trainer_params, rollout) ->
      (metrics, kl_bc).
    inputs: the prepared prompt arrays (tokens [B', P'], lens [B'], live [B']).
  """

  engine: concurrent.futures.Future
  sampler: concurrent.futures.Future
  scorer: concurrent.futures.Future
  inputs: tuple

  def result(self) -> tuple:
    """Waits for the compiles: ((engine, sampler, scorer), inputs)."""
    return (self.engine.result(), self.sampler.result(), self.scorer.result()), self.inputs


def start_compiling(
  student_params,
  student_cfg: ModelConfig,
  engine_cfg: transform.EngineConfig,
  prompts,
  rng,
  sampler_cfg: sampler.SamplerConfig,
  *,
  trainer_params=None,
) -> Compiling:
  """Starts compiling the three programs `measure` runs: the engine transform
  (`engine_inputs`), the sampler (`sample_prepared`, on the prompts as `sampler.prepare` pads
  them) and the scorer (`score_rollout`).

  Each is traced and lowered on this thread (Python, under the GIL) from the shapes the one
  before it returns, and compiled on a worker thread as soon as it is lowered. XLA compiles
  without the GIL: the sampler compiles while the scorer is traced, and whatever the caller
  does next (load its weights, trace the next candidate) runs beside the compiles instead of
  taking turns with them. On a first check this is most of its time; once the programs are
  cached (in memory, or in the persistent compilation cache) each step is a lookup.

  The params may be arrays or their shapes (`jax.ShapeDtypeStruct`s with the arrays'
  shardings), so a caller can compile before its weights are loaded; `measure` then finds the
  programs in memory.

  Args:
    student_params, student_cfg, engine_cfg, prompts, rng, sampler_cfg, trainer_params: as
      `measure`'s.

  Returns:
    A `Compiling`; its `result()` waits for the programs.
  """
  if trainer_params is None:
    trainer_params = student_params
  sampler_cfg = engine_sampler_config(engine_cfg, sampler_cfg, student_cfg.real_vocab_size)
  engine_low = engine_inputs.trace(student_params, engine_cfg, rng).lower()
  engine_prog = _COMPILER.submit(engine_low.compile)
  params_r, sample_key = engine_low.out_info
  inputs, prepared = sampler.prepare(params_r, prompts, sampler_cfg, student_cfg)
  sample_low = sample_prepared.trace(params_r, *inputs, sample_key, prepared).lower()
  sample_prog = _COMPILER.submit(sample_low.compile)
  score_low = score_rollout.trace(
    trainer_params, sample_low.out_info, student_cfg, sampler_cfg.temperature
  ).lower()
  score_prog = _COMPILER.submit(score_low.compile)
  return Compiling(engine_prog, sample_prog, score_prog, inputs)


def measure(
  student_params,
  student_cfg: ModelConfig,
  engine_cfg: transform.EngineConfig,
  prompts,
  rng,
  sampler_cfg: sampler.SamplerConfig,
  *,
  trainer_params=None,
  return_per_token: bool = False,
  position: tuple[int, float] | None = None,
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
    engine_cfg: the candidate rollout configuration (`transform.EngineConfig`).
    prompts: a list of token-id lists or a (tokens [B, P], lens [B]) pair.
    rng: a PRNG key; the same key gives the same measurement (module docstring).
    sampler_cfg: the sampling settings (temperature, top-k/top-p, max_new_tokens, stop
      tokens); its KV spec is replaced by `engine_cfg.kv`.
    trainer_params: the params π_θ is scored with; default `student_params` (pass the
      current weights here and older ones as `student_params` to measure staleness).
    return_per_token: also return the per-token KL of the counted tokens as a 1-D
      numpy array under `PER_TOKEN_KEY` (row-major over [B, C]).
    position: (w, κ): also return the KL by position and the first crossings under
      `POSITION_KEY` (`mismatch.position_summary`: JSON values); None: not.

  Returns:
    A dict of Python floats: every `mismatch/*` metric, "measure/tokens" (N),
    "measure/compile_seconds" (`start_compiling`: next to nothing once the programs are
    cached), "measure/run_seconds" (the engine transform, decoding and scoring),
    "measure/seconds" (wall time), and "engine_id" (a str).
  """
  if not isinstance(engine_cfg, transform.EngineConfig):
    raise ValueError(
      f"engine_cfg must be a transform.EngineConfig, got {type(engine_cfg).__name__}"
    )
  if not isinstance(sampler_cfg, sampler.SamplerConfig):
    raise ValueError(f"sampler_cfg must be a sampler.SamplerConfig, got {type(sampler_cfg)}")
  if trainer_params is None:
    trainer_params = student_params
  start = time.perf_counter()
  (engine_prog, sample_prog, score_prog), inputs = start_compiling(
    student_params,
    student_cfg,
    engine_cfg,
    prompts,
    rng,
    sampler_cfg,
    trainer_params=trainer_params,
  ).result()
  compiled = time.perf_counter()
  params_r, sample_key = engine_prog(student_params, rng)
  rollout = sample_prog(params_r, *inputs, sample_key)
  metrics, kl_bc = score_prog(trainer_params, rollout)
  mask_bc = np.asarray(rollout.completion_mask)
  metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
  done = time.perf_counter()
  result = dict(metrics)
  result["measure/tokens"] = float(mask_bc.sum())
  result["measure/compile_seconds"] = compiled - start
  result["measure/run_seconds"] = done - compiled
  result["measure/seconds"] = done - start
  result["engine_id"] = engine_cfg.engine_id
  if return_per_token:
    result[PER_TOKEN_KEY] = np.asarray(kl_bc)[mask_bc > 0]
  if position is not None:
    result[POSITION_KEY] = mismatch.position_summary(np.asarray(kl_bc), mask_bc, *position)
  return result
