"""The asynchronous rollout source: `AsyncRollouts` samples ahead into a two-slot buffer, from a
producer thread or dispatched inline by the trainer's thread, with the producer's batch record
(`_Batch`) and its error (`ProducerError`). The weight-version semantics it keeps (lag, the gate,
stale batches, resume) and the two dispatch modes are in `rollout.sources`' docstring.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
import traceback

import jax
import numpy as np

from opd_jax.data.rollout_types import Rollout
from opd_jax.rollout.sources import DISPATCH, STALE_POLICIES, _LagLog
from opd_jax.rollout.worker import RolloutWorker

QUEUE_SLOTS = 2  # the double buffer


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
    # The gate counts batches from where this source started: its first index and the first
    # version published to it (`_gate_open`).
    self._first_batch, self._first_version = first_batch, None
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
    if self._first_version is None:
      self._first_version = version
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

  def _gate_open(self, index: int) -> bool:
    """The gate of batch `index` (`rollout.sources`): the newest version v holds
    v ≥ v₀ + (index − n₀) − dropped − max_ahead, with n₀ this source's first batch index and v₀
    the first version published to it.

    On a fresh run n₀ = v₀ = 0. A resumed source, or one the live guard switches to, starts at
    the checkpoint's next batch n₀ = step + (batches dropped before), with v₀ = step and
    `dropped` counting from 0 again: counted from n₀ and v₀ the gate is the one the run had
    before (its total drops on the right), where the absolute index would demand a version the
    trainer never publishes once more than max_ahead batches had been dropped.
    """
    return self.version >= (
      self._first_version + (index - self._first_batch) - self.dropped - self.max_ahead
    )

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
    """Dispatches batches while a slot is free and the gate of the next one holds
    (`_gate_open`, the producer thread's gate); with one thread doing it, every process does it
    at the same point."""
    while (
      len(self._dispatched) < QUEUE_SLOTS
      and (not self._dispatched or self._dispatched[-1] is not _END)
      and self._gate_open(self._inline_index)
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
      while not self._stop.is_set() and not self._gate_open(index):
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
