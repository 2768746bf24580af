"""Where the trainer's rollouts come from: an iterator of version-tagged `Rollout`s.

The trainer only ever calls `publish(params, version)` after each update (version v
is the student after v updates, so version == the trainer's step) and `next(source)`
before each step. Two sources keep those two calls:

* `SyncRollouts` samples every batch, in the trainer's thread, with the newest
  published weights (lag 0), or with the weights `stale_k` versions old.
* `AsyncRollouts` (`rollout.async_rollouts`) samples ahead into a double buffer (at most two
  batches), so sampling batch t + 1 overlaps training on batch t: from a producer thread, or
  dispatched inline by the trainer's thread (Dispatch, below).

Each published version is transformed once, params_r = T(θ_v) (`inference.transform.engine_params`:
bf16 cast, fp8 recipe, weight noise), and every rollout sampled from it carries v.

Weight-version semantics of the async loop (the same words are in the README):

* **Lag** of a batch = the trainer's step when it consumes the batch − the batch's
  weight version. `max_lag` bounds it.
* **One batch, one version.** The producer reads the newest published version at a
  batch boundary and samples the whole batch with it. A version published while a
  batch is being sampled serves the next batch, never the rest of this one.
* **The gate.** The producer starts batch n (n counts the batches it has produced)
  only once a version v ≥ (n − dropped) − `max_ahead` is published, where `dropped`
  counts batches the trainer discarded. Batch n is consumed at step t ≤ n − dropped,
  so its lag t − v ≤ `max_ahead`. A source that starts mid-run (a resume, a live-guard
  switch) counts n and v from its own start: v − v₀ ≥ (n − n₀) − dropped − `max_ahead`,
  with n₀ its first batch index and v₀ the first version published to it, which is the
  same gate (`AsyncRollouts._gate_open`). With the default `max_ahead = max_lag` the bound
  holds by construction and nothing is ever stale; `max_lag = 0` is the synchronous
  loop, batch for batch (same prompts, same keys, same weights).
* **Stale batches.** With `max_ahead > max_lag` the producer may run further ahead
  than the bound. A batch whose lag exceeds `max_lag` at consumption is then
  `drop`ped (discarded, counted in `rollout/dropped`; the producer samples a new one
  and the dropped prompts are not revisited) or, with `correct`, trained on: the
  sampled reverse-KL loss weights every token by the truncated importance ratio
  min(π_θ(y)/π_b(y), C) against the batch's behaviour log-probs (counted in
  `rollout/corrected`).
* **Resume.** A checkpoint stores the data position after the last *consumed*
  batch and the producer's next batch index; batches sampled ahead but not consumed
  are sampled again after a restart, with the restored weights. The version counter
  restarts at the restored step. What timing decides (which batches go stale, and so
  the trajectory when `max_lag > 0`) is not reproducible across runs; with
  `max_lag = 0` everything is. `SyncRollouts` with `stale_k = k` starts again from the
  restored version alone: the k batches after a resume at step s sample with version
  max(t − k, s), lags 0 … k − 1, where a straight run has lag k (the trainer says so when it
  resumes such a run).

Dispatch. Who issues the sampling programs (`rollout.dispatch`):

* `thread` (the default with one process): a producer thread dispatches the jitted sampler
  and waits for it, while the trainer's thread dispatches train steps. JAX releases the GIL
  while XLA runs, so the two run at the same time; on a CPU both compete for the same cores
  (each op already uses all of them), so the overlap is partial, while with devices apart
  they run fully in parallel.
* `inline` (the default with several processes): a single controller. The trainer's thread
  dispatches everything: `publish(θ_v)` waits for the engine's copy of the weights, then
  enqueues T(θ_v) and the sampling of every batch the gate now admits, without waiting for
  them, and returns; the train step of the batch in hand is dispatched next. JAX's
  asynchronous dispatch runs the two at once when the rollouts have devices of their own
  (`rollout.devices`): the sampler of batch n + 1 on the rollout devices while step n trains.
  Every process issues the same programs in the same order, so their collectives (the
  prompt exchange, the sampler's and the train step's) always pair up and cannot deadlock,
  which two threads per process could. The gate, the lag bound, `stale_policy` and the
  `rollout/*` metrics are the thread's; what differs is that nothing depends on timing, so a
  run is reproducible at any `max_lag`.

Lag reached. The two-slot buffer, not `max_lag`, caps the lag a batch actually has: inline
dispatch fills a slot only at `publish`, so batch t is sampled with version t − 1 at the oldest
(lag ≤ 1: with `max_ahead = max_lag ≥ 1` every batch after the first has lag exactly 1); the
producer thread holds one more batch in hand while the queue is full (lag ≤ 2). `max_lag`
above the cap bounds nothing more. Staleness beyond it is `SyncRollouts`' `stale_k`.

`publish` makes an explicit copy of the trainer's params for the engine
(`RolloutWorker.engine_copy`): on the rollout devices when they are apart (a transfer between
meshes, shard for shard between mirrored meshes), else `device_put(..., may_alias=False)` on
the trainer's devices, so the engine never reads a buffer the next train step donates.
`rollout/publish_seconds` is the time to finish that copy (inline) or the copy and T(θ)
(thread, which takes versions as it needs them).

Sharding. Rollouts are sampled SPMD on the mesh the engine's weights live on
(`sharding.params_mesh`): the trainer's mesh with the training layout, or the rollout mesh
`rollout_mesh` names (the weights are laid out on it by `transform`). Each data·fsdp shard
decodes only its own prompts (`sampler.sample(..., mesh=)`), the teacher scores them in
place (`teacher_forcing.sharded_completion_logits`), and rewards are decoded and scored on the
host by
the one process whose devices hold the rows (`sharding.map_local_rows`), so no process
decodes prompts that another process also decodes (tensor-parallel peers of one shard
share its rows by design). With several processes, each process reads its own rows of
every batch and the prompt token ids alone (B x P int32) are exchanged, so that every
process can place every device's rows; each device then receives only its own. The
rollout is laid out batch-sharded for the train step (a transfer back to the training mesh
when the rollouts run apart).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import jax
import numpy as np

from opd_jax.data.rollout_types import Rollout
from opd_jax.rollout.worker import RolloutWorker

STALE_POLICIES = ("drop", "correct")
DISPATCH = ("auto", "thread", "inline")  # who issues the sampling programs (module docstring)


class RolloutSource(Protocol):
  """What the training loop asks of a source of rollouts (the module docstring gives the
  semantics): `SyncRollouts` and `AsyncRollouts` are the two the project ships."""

  def publish(self, params, version: int) -> None:
    """Hands the source the student after `version` updates (the trainer's step)."""

  def __iter__(self) -> Iterator[Rollout]: ...

  def __next__(self) -> Rollout:
    """The next batch to train on, tagged with the weight version it was sampled with."""

  def window_stats(self) -> tuple[dict[str, float], np.ndarray]:
    """The `rollout/*` scalars since the last call, and the lags of the batches consumed."""

  def describe(self) -> str:
    """One line for the log: the mode, its lag settings and the engine's id."""

  def resume_state(self) -> dict:
    """What a checkpoint stores to resume the stream after the last consumed batch."""

  def close(self) -> None:
    """Stops any producer and releases what the source holds."""


class _LagLog:
  """Lags of the consumed batches since the last `window()` call."""

  def __init__(self):
    self.lags: list[int] = []
    self.queue_wait = 0.0

  def window(self) -> tuple[dict[str, float], np.ndarray]:
    lags = np.asarray(self.lags, np.float64)
    stats = {
      "rollout/version_lag_mean": float(lags.mean()) if lags.size else 0.0,
      "rollout/version_lag_max": float(lags.max()) if lags.size else 0.0,
      "rollout/queue_wait_seconds": self.queue_wait,
    }
    self.lags, self.queue_wait = [], 0.0
    return stats, lags


class SyncRollouts:
  """Samples each batch in the trainer's thread with version t − k (k = `stale_k`).

  With `stale_k = 0` (the default) every batch uses the newest published weights
  (lag 0). With k > 0 it uses the weights published k versions earlier (or the
  oldest it has, at the start of a run): a deterministic staleness, independent of
  any timing, for placing `stale` on the mismatch scale. It keeps the last k + 1
  transformed versions.

  Args:
    worker: the `RolloutWorker` that samples and scores each batch.
    first_batch: the index of the next batch (the step when resuming).
    stale_k: the version lag to sample with.
  """

  mode = "sync"

  def __init__(self, worker: RolloutWorker, first_batch: int = 0, stale_k: int = 0):
    if stale_k < 0:
      raise ValueError(f"stale_k must be >= 0, got {stale_k}")
    self.worker = worker
    self.stale_k = stale_k
    self._batch_index = first_batch
    self._versions: dict[int, object] = {}  # version -> params_r, the last k + 1
    self.version = -1
    self._consumed_data_state = worker.data_state()
    self._lags = _LagLog()
    self.last_stats: dict[str, float] = {}

  def publish(self, params, version: int) -> None:
    """Makes θ_version available (transformed once here).

    In sync mode the engine may alias the trainer's buffers (the identity transform
    does) when k = 0: the train step that donates them runs only after the rollout is
    drawn. Older versions kept for k > 0 are explicit copies.
    """
    if self.stale_k:
      params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, params), may_alias=False)
    self._versions[version] = self.worker.transform(params, version)
    for old in [v for v in self._versions if v < version - self.stale_k]:
      del self._versions[old]
    self.version = version

  def __iter__(self):
    return self

  def __next__(self) -> Rollout:
    if not self._versions:
      raise RuntimeError("publish() weights before drawing rollouts")
    use = max(self.version - self.stale_k, min(self._versions))
    prompts = self.worker.draw_prompts()
    rollout, stats = self.worker.sample(self._versions[use], prompts, self._batch_index, use)
    self._batch_index += 1
    self._consumed_data_state = self.worker.data_state()
    self._lags.lags.append(self.version - use)
    self.last_stats = stats
    return rollout

  def window_stats(self) -> tuple[dict[str, float], np.ndarray]:
    """Scalars for the log window since the last call, and the window's lags."""
    stats, lags = self._lags.window()
    return {**self.last_stats, **stats}, lags

  def describe(self) -> str:
    return f"sync, stale_k={self.stale_k}, engine {self.worker.engine_cfg.engine_id}"

  def resume_state(self) -> dict:
    """What a checkpoint stores to continue: data position and next batch index."""
    return {"data_state": self._consumed_data_state, "next_batch": self._batch_index}

  def close(self) -> None:
    pass
