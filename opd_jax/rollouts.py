"""Where the trainer's rollouts come from: an iterator of version-tagged `Rollout`s.

The trainer only ever calls `publish(params, version)` after each update and
`next(source)` before each step. `SyncRollouts` samples every batch with the newest
published weights (lag 0); an async source keeps the same two calls and samples
ahead on older versions.

Each published version is transformed once, params_r = T(θ_v) (`engine.engine_params`:
bf16 cast, fp8 recipe, weight noise), and every rollout sampled from it carries v.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import jax
import numpy as np

from opd_jax import engine, sampler, task
from opd_jax.model_config import ModelConfig
from opd_jax.rollout import Rollout


@functools.partial(jax.jit, static_argnums=1)
def _engine_params(params, cfg: engine.EngineConfig, rng):
  return engine.engine_params(params, cfg, rng)


class SyncRollouts:
  """Samples each prompt batch with the latest published weights.

  Args:
    prompt_batches: iterator of collated prompt batches ({"prompt": [B strings], ...}).
    tokenizer: encodes prompts.
    prompt_len: P, padded prompt width.
    engine_cfg: the weight transform and KV-cache numerics.
    sampler_cfg: the sampling settings (its `kv` is taken from `engine_cfg`).
    model_cfg: the student's ModelConfig.
    rng: base key; batch i samples with fold_in(rng, i) and version v is
      transformed with fold_in(rng, -1 - v).
  """

  def __init__(
    self,
    prompt_batches: Iterator,
    tokenizer,
    prompt_len: int,
    engine_cfg: engine.EngineConfig,
    sampler_cfg: sampler.SamplerConfig,
    model_cfg: ModelConfig,
    rng,
  ):
    self._prompts = prompt_batches
    self._tokenizer = tokenizer
    self._prompt_len = prompt_len
    self.engine_cfg = engine_cfg
    self._sampler_cfg = sampler_cfg
    self._model_cfg = model_cfg
    self._rng = rng
    self._params_r = None
    self.version = -1
    self.last_prompts: list[str] = []
    self.last_stats: dict[str, float] = {}

  def publish(self, params, version: int) -> None:
    """Makes θ_version the weights for the next rollouts (transformed once here)."""
    noise_key = jax.random.fold_in(self._rng, 2**30 + version)
    self._params_r = _engine_params(params, self.engine_cfg, noise_key)
    self.version = version

  def __iter__(self):
    return self

  def __next__(self) -> Rollout:
    if self._params_r is None:
      raise RuntimeError("publish() weights before drawing rollouts")
    batch = next(self._prompts)
    self.last_prompts = list(batch["prompt"])
    tokens_bp, lens_b = task.encode_prompts(self.last_prompts, self._tokenizer, self._prompt_len)
    start = time.perf_counter()
    rollout = sampler.sample(
      self._params_r,
      (tokens_bp, lens_b),
      jax.random.fold_in(self._rng, self.version),
      self._sampler_cfg,
      self._model_cfg,
      weight_version=self.version,
      engine_id=self.engine_cfg.engine_id,
    )
    num_tokens = int(np.asarray(rollout.completion_mask).sum())  # waits for the sampler
    seconds = time.perf_counter() - start
    self.last_stats = {
      "rollout/seconds": seconds,
      "rollout/tokens_per_s": num_tokens / max(seconds, 1e-9),
      "rollout/mean_completion_len": num_tokens / rollout.batch_size,
      "rollout/weight_lag": 0.0,
    }
    return rollout
