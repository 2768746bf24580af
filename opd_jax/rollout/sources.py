"""Where the trainer's rollouts come from: an iterator of version-tagged `Rollout`s.

The trainer only ever calls `publish(params, version)` after each update (version v
is the student after v updates, so version == the trainer's step) and `next(source)`
before each step. Two sources keep those two calls:

* `SyncRollouts` samples every batch, in the trainer's thread, with the newest
  published weights (lag 0), or with the weights `stale_k` versions old.
* `AsyncRollouts` samples ahead into a double buffer (at most two batches), so sampling
  batch t + 1 overlaps training on batch t: from a producer thread, or dispatched inline by
  the trainer's thread (Dispatch, below).

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
  so its lag t − v ≤ `max_ahead`. With the default `max_ahead = max_lag` the bound
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
  `max_lag = 0` everything is.

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
  run is reproducible at any `max_lag` (with `max_ahead = max_lag` every batch has lag
  exactly `max_lag` once the run is under way).

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

import collections
import dataclasses
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Protocol

import jax
import numpy as np

from opd_jax.data.rollout_types import Rollout
from opd_jax.rollout.worker import RolloutWorker

STALE_POLICIES = ("drop", "correct")
DISPATCH = ("auto", "thread", "inline")  # who issues the sampling programs (module docstring)


QUEUE_SLOTS = 2  # the double buffer


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


@dataclasses.dataclass
class _Batch:
  """A produced batch and its bookkeeping."""

  rollout: Rollout
  index: int  # the producer's batch counter n
  version: int
  data_state: dict  # the prompt iterator's position after this batch's prompts
  stats: dict[str, float]
  produced_at: float = dataclasses.field(default_factory=time.perf_counter)


_END = object()  # the prompts ran out


class ProducerError(RuntimeError):
  """The rollout producer raised; the message carries its traceback."""


class AsyncRollouts:
  """Samples ahead into a two-slot buffer, from a producer thread or inline; see the module
  docstring.

  Args:
    worker: the `RolloutWorker` that samples and scores each batch.
    max_lag: largest lag (step − version) a batch may be trained with uncorrected.
    stale_policy: "drop" or "correct", for batches over `max_lag`.
    max_ahead: how far ahead the producer may run, in versions; None = `max_lag`.
    first_batch: the producer's first batch index (the checkpoint's `next_batch`).
    producer_timeout_s: `next()` raises TimeoutError when no batch arrives for this
      long while the trainer waits.
    engine_shardings: where the engine's copy of the weights lives (a pytree of
      shardings like the params, or one sharding); None = `worker.engine_copy` (the
      rollout devices when `rollout.devices` sets them apart, else the params' own).
    dispatch: "thread", "inline" or "auto" (thread with one process, inline with several);
      Dispatch in the module docstring.
  """

  mode = "async"

  def __init__(
    self,
    worker: RolloutWorker,
    max_lag: int,
    stale_policy: str = "drop",
    max_ahead: int | None = None,
    first_batch: int = 0,
    producer_timeout_s: float = 600.0,
    engine_shardings=None,
    dispatch: str = "auto",
  ):
    if max_lag < 0:
      raise ValueError(f"max_lag must be >= 0, got {max_lag}")
    if stale_policy not in STALE_POLICIES:
      raise ValueError(
        f"stale_policy must be one of {', '.join(STALE_POLICIES)}, got {stale_policy!r}"
      )
    max_ahead = max_lag if max_ahead is None else max_ahead
    if max_ahead < 0:
      raise ValueError(f"max_ahead must be >= 0 (or None for max_lag), got {max_ahead}")
    if producer_timeout_s <= 0:
      raise ValueError(f"producer_timeout_s must be > 0, got {producer_timeout_s}")
    if dispatch not in DISPATCH:
      raise ValueError(f"dispatch must be one of {', '.join(DISPATCH)}, got {dispatch!r}")
    if dispatch == "thread" and jax.process_count() > 1:
      raise ValueError(
        f"rollout.dispatch='thread' runs in one process only ({jax.process_count()} "
        "processes): two host threads issuing multi-process programs can deadlock their "
        "collectives; use rollout.dispatch='auto' or 'inline'"
      )
    self.threaded = dispatch == "thread" or (dispatch == "auto" and jax.process_count() == 1)
    self.worker = worker
    self.max_lag, self.max_ahead, self.stale_policy = max_lag, max_ahead, stale_policy
    self._timeout = producer_timeout_s
    self._engine_shardings = engine_shardings
    self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_SLOTS)
    self._cond = threading.Condition()
    self._stop = threading.Event()
    self._error: tuple[BaseException, str] | None = None
    # Shared under self._cond: the newest published version and its raw params until
    # the producer takes them (self.dropped, the trainer's drop count, too).
    self.version = -1
    self._pending = None
    self._next_batch = first_batch
    self._consumed_data_state = worker.data_state()
    self._thread: threading.Thread | None = None
    # Counters (read by tests and logs).
    self.produced = self.trained = self.dropped = self.corrected = 0
    self._lags = _LagLog()
    self._producer_wait = 0.0
    self._publish_seconds: list[float] = []
    self._time_in_queue: list[float] = []
    self.last_stats: dict[str, float] = {}
    # Inline dispatch: the transformed newest version, the batches dispatched and not yet
    # consumed (at most QUEUE_SLOTS), and the index of the next batch to dispatch.
    self._inline_params: tuple | None = None
    self._dispatched: collections.deque = collections.deque()
    self._inline_index = first_batch

  # -- trainer side -------------------------------------------------------------

  def publish(self, params, version: int) -> None:
    """Hands θ_version to the producer without waiting for it.

    The explicit copy (`may_alias=False`) is what the producer reads, so the
    trainer may donate `params` to its next step right away; the copy is enqueued
    before that step, and the runtime orders the two.
    """
    if self._engine_shardings is None:
      copy = self.worker.engine_copy(params)
    else:
      copy = jax.device_put(params, self._engine_shardings, may_alias=False)
    if not self.threaded:
      self._publish_inline(copy, version)
      return
    with self._cond:
      self._pending = (copy, version)
      self.version = version
      self._cond.notify_all()

  def __iter__(self):
    return self

  def __next__(self) -> Rollout:
    if not self.threaded:
      return self._next_inline()
    if self._thread is None:  # the producer starts when the trainer first asks
      if self.version < 0:
        raise RuntimeError("publish() weights before drawing rollouts")
      self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
      self._thread.start()
    while True:
      item = self._get()
      if item is _END:
        raise StopIteration
      rollout = self._consume(item)
      if rollout is not None:
        return rollout

  def _consume(self, item) -> Rollout | None:
    """Applies the lag bound to a produced batch: the rollout to train on, or None when it
    is dropped (both dispatch modes)."""
    lag = self.version - item.version
    self._consumed_data_state = item.data_state
    self._next_batch = item.index + 1
    if lag > self.max_lag and self.stale_policy == "drop":
      with self._cond:
        self.dropped += 1
        self._cond.notify_all()
      return None
    if lag > self.max_lag:
      self.corrected += 1
    self.trained += 1
    self._lags.lags.append(lag)
    self._time_in_queue.append(time.perf_counter() - item.produced_at)
    self.last_stats = item.stats
    return item.rollout

  # -- inline dispatch (one thread: the trainer's) -------------------------------

  def _publish_inline(self, copy, version: int) -> None:
    """Waits for the engine's copy of θ_version (its time is `rollout/publish_seconds`), then
    dispatches T(θ_version) and every batch the gate now lets through (`_fill`)."""
    start = time.perf_counter()
    jax.block_until_ready(copy)
    self._publish_seconds.append(time.perf_counter() - start)
    self.version = version
    self._inline_params = (self.worker.transform(copy, version), version)
    self._fill()

  def _fill(self) -> None:
    """Dispatches batches while a slot is free and the gate of the next one holds: the same
    gate as the producer thread's, n − dropped − max_ahead ≤ version, so the same batches get
    the same versions; with one thread doing it, every process does it at the same point."""
    while (
      len(self._dispatched) < QUEUE_SLOTS
      and (not self._dispatched or self._dispatched[-1] is not _END)
      and self.version >= self._inline_index - self.dropped - self.max_ahead
    ):
      params_r, version_r = self._inline_params
      try:
        prompts = self.worker.draw_prompts()
      except StopIteration:
        self._dispatched.append(_END)
        return
      index = self._inline_index
      pending = self.worker.dispatch(params_r, prompts, index, version_r)
      self._dispatched.append(_Batch(pending, index, version_r, self.worker.data_state(), {}))
      self.produced += 1
      self._inline_index += 1

  def _next_inline(self) -> Rollout:
    if self._inline_params is None:
      raise RuntimeError("publish() weights before drawing rollouts")
    while True:
      if not self._dispatched:
        self._fill()  # after a drop: the gate holds for the next batch (see `_fill`)
      item = self._dispatched.popleft()
      if item is _END:
        self._dispatched.appendleft(_END)
        raise StopIteration
      start = time.perf_counter()
      item.rollout, item.stats = self.worker.finish(item.rollout)  # waits for the sampler
      self._lags.queue_wait += time.perf_counter() - start
      rollout = self._consume(item)
      if rollout is not None:
        return rollout

  # -- producer thread -------------------------------------------------------------

  def _get(self):
    """The next queue item; raises the producer's error or a timeout."""
    start = time.perf_counter()
    try:
      while True:
        self._raise_if_failed()
        try:
          return self._queue.get(timeout=0.05)
        except queue.Empty:
          waited = time.perf_counter() - start
          if waited > self._timeout:
            alive = self._thread is not None and self._thread.is_alive()
            raise TimeoutError(
              f"no rollout batch from the producer for {waited:.1f}s "
              f"(rollout.producer_timeout_s={self._timeout:g}); producer thread "
              f"{'still running: it hangs' if alive else 'has exited'} after "
              f"{self.produced} batches"
            ) from None
    finally:
      self._lags.queue_wait += time.perf_counter() - start

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      error, trace = self._error
      raise ProducerError(f"the rollout producer failed:\n{trace}") from error

  def window_stats(self) -> tuple[dict[str, float], np.ndarray]:
    """Scalars for the log window since the last call, and the window's lags.

    TRL's async names, for orientation: sample/staleness_mean ↔ version_lag_mean,
    sample/dropped_stale_total ↔ dropped, perf/weight_sync_s ↔ publish_seconds,
    sample/time_in_queue_s ↔ time_in_queue_seconds.
    """
    stats, lags = self._lags.window()
    publish = self._publish_seconds
    in_queue = self._time_in_queue
    stats |= {
      "rollout/queue_depth": float(self._queue.qsize() + len(self._dispatched)),
      "rollout/producer_wait_seconds": self._producer_wait,
      "rollout/publish_seconds": float(np.mean(publish)) if publish else 0.0,
      "rollout/time_in_queue_seconds": float(np.mean(in_queue)) if in_queue else 0.0,
      "rollout/dropped": float(self.dropped),
      "rollout/corrected": float(self.corrected),
    }
    self._producer_wait, self._publish_seconds, self._time_in_queue = 0.0, [], []
    return {**self.last_stats, **stats}, lags

  def describe(self) -> str:
    return (
      f"async ({'producer thread' if self.threaded else 'inline dispatch'}), "
      f"max_lag={self.max_lag}, max_ahead={self.max_ahead}, "
      f"stale_policy={self.stale_policy}, engine {self.worker.engine_cfg.engine_id}"
    )

  def resume_state(self) -> dict:
    """What a checkpoint stores: the position after the last consumed batch."""
    return {"data_state": self._consumed_data_state, "next_batch": self._next_batch}

  def close(self, timeout_s: float = 30.0) -> None:
    """Stops the producer and waits for it (a hung producer is left behind, as a daemon)."""
    self._stop.set()
    self._dispatched.clear()
    self._inline_params = None
    with self._cond:
      self._cond.notify_all()
    while True:  # unblock a producer waiting on a full queue
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    if self._thread is not None:
      self._thread.join(timeout_s)

  # -- producer side ------------------------------------------------------------

  def _take_version(self, index: int):
    """Waits for the gate of batch `index`; returns (raw params or None, version)."""
    start = time.perf_counter()
    with self._cond:
      while not self._stop.is_set() and self.version < index - self.dropped - self.max_ahead:
        self._cond.wait(0.1)
      pending, self._pending = self._pending, None
      version = self.version
    self._producer_wait += time.perf_counter() - start
    return pending, version

  def _put(self, item) -> bool:
    start = time.perf_counter()
    try:
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.05)
          return True
        except queue.Full:
          continue
      return False
    finally:
      self._producer_wait += time.perf_counter() - start

  def _produce(self) -> None:
    params_r, version_r = None, None
    index = self._next_batch
    try:
      while not self._stop.is_set():
        pending, version = self._take_version(index)
        if self._stop.is_set():
          return
        if pending is not None:  # T(θ) once per version: finish the copy, transform
          start = time.perf_counter()
          raw, version = pending
          params_r = jax.block_until_ready(self.worker.transform(raw, version))
          self._publish_seconds.append(time.perf_counter() - start)
          version_r = version
          del raw, pending
        try:
          prompts = self.worker.draw_prompts()
        except StopIteration:
          self._put(_END)
          return
        rollout, stats = self.worker.sample(params_r, prompts, index, version_r)
        item = _Batch(rollout, index, version_r, self.worker.data_state(), stats)
        self.produced += 1
        if not self._put(item):
          return
        index += 1
    except BaseException as e:  # reaches the trainer through _get
      self._error = (e, traceback.format_exc())
