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
from jax.experimental import multihost_utils

from opd_jax import engine, sampler, sharding, task
from opd_jax.model_config import ModelConfig
from opd_jax.rollout import Rollout


@functools.partial(jax.jit, static_argnums=1)
def _engine_params(params, cfg: engine.EngineConfig, rng):
  return engine.engine_params(params, cfg, rng)


def _shard_rollout(rollout: Rollout, mesh) -> Rollout:
  """Lays the rollout out for the train step: batch over (data, fsdp), scalars replicated."""
  shardings = jax.tree.map(
    lambda x: sharding.batch_sharding(mesh, x.ndim) if x.ndim else sharding.replicated(mesh),
    rollout,
  )
  return jax.jit(lambda r: r, out_shardings=shardings)(rollout)


class SyncRollouts:
  """Samples each prompt batch with the latest published weights (lag 0).

  Args:
    prompt_batches: iterator of this process's collated prompt batches
      ({"prompt": [B_local strings], ...}).
    tokenizer: encodes prompts.
    prompt_len: P, padded prompt width.
    engine_cfg: the weight transform (T(θ)) and the KV-cache numerics.
    sampler_cfg: the sampling settings.
    model_cfg: the student's ModelConfig.
    rng: base key; batch i samples with fold_in(rng, i), and version v's weight
      noise uses fold_in(rng, 2**30 + v).
    mesh: the device mesh the train step runs on.
    first_batch: the index of the next batch (the step when resuming).

  With several processes, every process gathers all processes' prompts so the
  sampler's inputs are identical everywhere (JAX treats host arrays as replicated),
  and the rollout is then laid out batch-sharded for the train step.
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
    mesh,
    first_batch: int = 0,
  ):
    self._prompts = prompt_batches
    self._tokenizer = tokenizer
    self._prompt_len = prompt_len
    self.engine_cfg = engine_cfg
    self._sampler_cfg = sampler_cfg
    self._model_cfg = model_cfg
    self._rng = rng
    self._mesh = mesh
    self._batch_index = first_batch
    self._params_r = None
    self.version = -1
    self.last_stats: dict[str, float] = {}

  def publish(self, params, version: int) -> None:
    """Makes θ_version the weights for the next rollouts (transformed once here).

    In sync mode the engine may alias the trainer's buffers (the identity transform
    does): the train step that donates them runs only after the rollout is drawn.
    """
    noise_key = jax.random.fold_in(self._rng, 2**30 + version)
    self._params_r = _engine_params(params, self.engine_cfg, noise_key)
    self.version = version

  def __iter__(self):
    return self

  def _next_prompts(self) -> tuple[np.ndarray, np.ndarray]:
    batch = next(self._prompts)
    tokens_bp, lens_b = task.encode_prompts(
      list(batch["prompt"]), self._tokenizer, self._prompt_len
    )
    if jax.process_count() > 1:
      tokens_bp = multihost_utils.process_allgather(tokens_bp, tiled=True)
      lens_b = multihost_utils.process_allgather(lens_b, tiled=True)
    return tokens_bp, lens_b

  def __next__(self) -> Rollout:
    if self._params_r is None:
      raise RuntimeError("publish() weights before drawing rollouts")
    tokens_bp, lens_b = self._next_prompts()
    start = time.perf_counter()
    rollout = sampler.sample(
      self._params_r,
      (tokens_bp, lens_b),
      jax.random.fold_in(self._rng, self._batch_index),
      self._sampler_cfg,
      self._model_cfg,
      weight_version=self.version,
      engine_id=self.engine_cfg.engine_id,
    )
    self._batch_index += 1
    num_tokens = int(np.asarray(rollout.completion_mask).sum())  # waits for the sampler
    seconds = time.perf_counter() - start
    self.last_stats = {
      "rollout/seconds": seconds,
      "rollout/tokens_per_s": num_tokens / max(seconds, 1e-9),
      "rollout/mean_completion_len": num_tokens / rollout.batch_size,
      "rollout/weight_lag": float(self._batch_index - 1 - self.version),
    }
    return _shard_rollout(rollout, self._mesh)
