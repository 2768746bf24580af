"""Where the trainer's rollouts come from: an iterator of version-tagged `Rollout`s.

The trainer only ever calls `publish(params, version)` after each update (version v
is the student after v updates, so version == the trainer's step) and `next(source)`
before each step. Two sources keep those two calls:

* `SyncRollouts` samples every batch, in the trainer's thread, with the newest
  published weights (lag 0), or with the weights `stale_k` versions old.
* `AsyncRollouts` samples ahead in a producer thread into a double buffer (a queue
  of at most two batches), so sampling batch t + 1 overlaps training on batch t.

Each published version is transformed once, params_r = T(θ_v) (`engine.engine_params`:
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

Devices. The producer is a Python thread that dispatches jitted sampler calls. JAX
releases the GIL while XLA runs, so sampler and train-step programs run at the same
time; on a CPU both compete for the same cores (each op already uses all of them), so
the overlap is partial, while with separate device sets (`engine_shardings` on other
devices) they run fully in parallel. `publish` makes an explicit device copy
(`device_put(..., may_alias=False)`) of the trainer's params onto the engine's
shardings before the train step donates them, so the engine never reads a donated
buffer; the copy is dispatched asynchronously and the trainer does not wait for it.

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
rollout is laid out batch-sharded for the train step. The async source is
single-process for now: two threads issuing multi-process programs in an order that
differs between processes can deadlock their collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
import traceback
import types
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from opd_jax.data import rewards, task
from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import sampler, teacher_forcing
from opd_jax.inference import transform as engine
from opd_jax.model import sharding, teacher_topk
from opd_jax.model.config import ModelConfig
from opd_jax.rollout import off_policy

STALE_POLICIES = ("drop", "correct")
QUEUE_SLOTS = 2  # the double buffer


def host_key(seed: int) -> jax.Array:
  """`jax.random.key(seed)`, built on the host when the default PRNG is threefry.

  threefry's seed key is the pair (seed >> 32, seed mod 2^32); wrapping that pair is the same
  key without the two small programs `jax.random.key` compiles on first use, which a one-off
  process (the admission check) would pay for. Other PRNGs, and seeds outside [0, 2^31), go
  through `jax.random.key`.
  """
  impl = jax.config.jax_default_prng_impl
  if impl != "threefry2x32" or not 0 <= seed < 2**31:
    return jax.random.key(seed)
  return jax.random.wrap_key_data(np.array([0, seed], np.uint32), impl=impl)


def named_stream(key, name: str):
  """An independent key stream for `name`: fold_in(key, crc32(name)).

  Sampling and weight noise each get their own stream of the run's key, so no
  rollout key ever equals a model-initialisation key (those come from split(key)).
  """
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


@functools.partial(jax.jit, static_argnums=1)
def _engine_params(params, cfg: engine.EngineConfig, rng):
  return engine.engine_params(params, cfg, rng)


def rollout_mesh(config, train_mesh):
  """The mesh `config.rollout.mesh_{data,fsdp,tensor}` names over the training mesh's
  devices (-1 takes the devices the others leave), or None when all three are 0 (sample
  on the training mesh).

  Raises:
    ValueError: a shape that does not fit the devices, or a `data.batch_size` that its
      data·fsdp shards do not divide (every shard must get whole rows of every batch).
  """
  r = config.rollout
  shape = (r.get("mesh_data", 0), r.get("mesh_fsdp", 0), r.get("mesh_tensor", 0))
  if shape == (0, 0, 0):
    return None
  if 0 in shape:
    raise ValueError(
      f"config.rollout.mesh_data/mesh_fsdp/mesh_tensor must all be 0 (the training mesh) "
      f"or all be set (positive or one -1), got {shape}"
    )
  mesh = sharding.make_mesh(shape, devices=list(train_mesh.devices.flat))
  shards = sharding.batch_shards(mesh)
  if config.data.batch_size % shards:
    raise ValueError(
      f"data.batch_size={config.data.batch_size} must be a multiple of the rollout mesh's "
      f"data x fsdp shards ({shards}, rollout mesh {dict(mesh.shape)})"
    )
  return mesh


def _to_mesh(tree, mesh):
  """`tree` laid out on `mesh` with the training rules (a no-op when it already is)."""
  return sharding.relayout(tree, sharding.tree_shardings(tree, mesh))


def _rewards(rollout: Rollout, tokenizer) -> jax.Array:
  """`rewards.rollout_rewards`, computed by each process on the rows its devices hold."""

  def rows(start, prompt_bp, lens_b, tokens_bc, mask_bc):
    del start
    part = types.SimpleNamespace(  # host rows of the fields rollout_rewards reads
      prompt_tokens=prompt_bp,
      prompt_lens=lens_b,
      completion_tokens=tokens_bc,
      completion_mask=mask_bc,
    )
    return np.asarray(rewards.rollout_rewards(part, tokenizer))

  r = rollout
  fields = (r.prompt_tokens, r.prompt_lens, r.completion_tokens, r.completion_mask)
  return sharding.map_local_rows(rows, *fields)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "top_k", "temperature"))
def sparse_teacher(params, rollout: Rollout, cfg: ModelConfig, mesh, top_k: int, temperature):
  """The teacher's top-k log-probs plus a tail at the rollout's completion positions
  (`teacher_topk.from_logits` of `teacher_forcing.sharded_completion_logits`), in one program:
  the full
  [B, C, V] logits are a temporary of it and never leave it."""
  logits_bcv, _ = teacher_forcing.sharded_completion_logits(params, rollout, cfg, mesh)
  return teacher_topk.from_logits(logits_bcv, top_k, temperature)


def _shard_rollout(rollout: Rollout, mesh) -> Rollout:
  """Lays the rollout out for the train step: batch over (data, fsdp), scalars replicated.

  On the trainer's own devices this is a jitted reshard, compiled once; from an engine on
  other devices it is a transfer (`sharding.relayout`).
  """
  shardings = jax.tree.map(
    lambda x: sharding.batch_sharding(mesh, x.ndim) if x.ndim else sharding.replicated(mesh),
    rollout,
  )
  return sharding.relayout(rollout, shardings)


class RolloutEngine:
  """Prompts in, sharded `Rollout`s out: the part both sources share.

  Args:
    prompt_batches: iterator of this process's collated prompt batches
      ({"prompt": [B_local strings], ...}); it must support `get_state()`.
    tokenizer: encodes prompts.
    prompt_len: P, padded prompt width.
    engine_cfg: the weight transform (T(θ)) and the KV-cache numerics.
    sampler_cfg: the sampling settings.
    model_cfg: the student's ModelConfig.
    rng: the run's key. Batch n samples with fold_in(stream "rollout/sample", n) and
      version v's weight noise uses fold_in(stream "rollout/noise", v).
    mesh: the device mesh the train step runs on.
    teacher: optional (teacher_params, teacher_cfg). When given, the engine also
      scores every rollout with the frozen teacher (`Rollout.teacher_logits`), as
      verl's and slime's rollout side does, so that forward pass leaves the train
      step; in async mode it then overlaps training. The teacher is only read.
    teacher_top_k: k > 0 (`train.teacher_top_k`): the engine keeps only the teacher's top-k
      log-probs plus a tail bucket (`Rollout.teacher_topk`, at `teacher_temperature`), so
      the rollout carries [B, C, k] instead of the full [B, C, V] logits; 0 keeps the full
      raw logits (`Rollout.teacher_logits`, T = 1; the train step applies the temperature).
    teacher_temperature: τ_T (`teacher.temperature`) of the sparse teacher.
    score_rewards: when True, every rollout also carries `reward_b`, the task's
      exact-match reward of each decoded completion (`rewards.rollout_rewards`), for the RL
      loss; the engine holds the tokenizer, so the reward is computed where the texts are.
    rollout_mesh: None samples on the mesh the published weights live on (the trainer's,
      or the engine's own devices); a ("data", "fsdp", "tensor") mesh lays the engine's
      weights (and the teacher) out on it with the training rules and samples there.
    samples_per_prompt: n, completions sampled per prompt (`rollout.samples_per_prompt`):
      each prompt of a batch of B prompts fills n adjacent rows, so the rollout has B·n rows
      (`data.batch_size` counts prompts). Each row has its own sampling key, so the n
      completions differ under sampling. Process i's B/P prompts become the contiguous
      rows [i·B·n/P, (i+1)·B·n/P), the rows its own devices decode.
    on_policy_fraction: λ (`train.on_policy_fraction`): below 1, a share 1 − λ of each batch's
      prompts train on their reference completions instead of samples (`opd_jax.off_policy`;
      the rows are chosen by the key stream "rollout/on_policy" and the batch index). The
      realised share is logged as `rollout/on_policy_fraction`.
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
    teacher=None,
    score_rewards: bool = False,
    rollout_mesh=None,
    samples_per_prompt: int = 1,
    on_policy_fraction: float = 1.0,
    teacher_top_k: int = 0,
    teacher_temperature: float = 1.0,
  ):
    teacher_topk.check_top_k(teacher_top_k)
    teacher_topk.check_temperature(teacher_temperature)
    self._teacher_top_k, self._teacher_temperature = teacher_top_k, teacher_temperature
    if samples_per_prompt < 1:
      raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    self._mix = None  # λ = 1: every row sampled
    if on_policy_fraction < 1.0:
      seed = off_policy.seed_from_key(named_stream(rng, "rollout/on_policy"))
      self._mix = off_policy.Mix(
        on_policy_fraction, seed, tokenizer, sampler_cfg.max_new_tokens, samples_per_prompt
      )
    self.samples_per_prompt = samples_per_prompt
    self.prompts = prompt_batches
    self._rollout_mesh = rollout_mesh
    if teacher is not None and rollout_mesh is not None:
      teacher = (_to_mesh(teacher[0], rollout_mesh), teacher[1])
    self._score_rewards = score_rewards
    self._teacher = teacher
    self._tokenizer = tokenizer
    self._prompt_len = prompt_len
    self.engine_cfg = engine_cfg
    self._sampler_cfg = sampler_cfg
    self._model_cfg = model_cfg
    self._sample_key = named_stream(rng, "rollout/sample")
    self._noise_key = named_stream(rng, "rollout/noise")
    self._mesh = mesh

  def transform(self, params, version: int):
    """params_r = T(θ_version), computed once per version (laid out on the rollout mesh
    when there is one)."""
    params_r = _engine_params(params, self.engine_cfg, jax.random.fold_in(self._noise_key, version))
    if self._rollout_mesh is not None:
      params_r = _to_mesh(params_r, self._rollout_mesh)
    return params_r

  def data_state(self) -> dict:
    """The prompt iterator's position (what a checkpoint stores)."""
    return self.prompts.get_state()

  def draw_prompts(self) -> tuple:
    """The next prompt batch as (tokens [B·n, P], lens [B·n]), each of the B prompts in n
    adjacent rows (n = `samples_per_prompt`), plus its `off_policy.References` [B·n, C] as a
    third item when λ < 1; StopIteration at the end."""
    batch = next(self.prompts)
    refs = None if self._mix is None else self._mix.references(batch)
    tokens_bp, lens_b = task.encode_prompts(
      list(batch["prompt"]), self._tokenizer, self._prompt_len
    )
    if jax.process_count() > 1:
      tokens_bp = multihost_utils.process_allgather(tokens_bp, tiled=True)
      lens_b = multihost_utils.process_allgather(lens_b, tiled=True)
    n = self.samples_per_prompt  # the gathered batch is in process order: repeats stay local
    prompts = np.repeat(np.asarray(tokens_bp), n, axis=0), np.repeat(np.asarray(lens_b), n, axis=0)
    return prompts if refs is None else (*prompts, refs)

  def sample(self, params_r, prompts, batch_index: int, version: int):
    """Samples one batch; returns (train-sharded Rollout, per-batch stats).

    The batch is decoded on the mesh `params_r` lives on, each data·fsdp shard its rows.
    """
    start = time.perf_counter()
    mesh = sharding.params_mesh(params_r)
    refs = None
    if isinstance(prompts, tuple) and isinstance(prompts[-1], off_policy.References):
      prompts, refs = prompts[:-1], prompts[-1]  # λ < 1: draw_prompts' references
    if (self._mix is None) != (refs is None):
      raise ValueError(
        "sample() needs prompts with references exactly when on_policy_fraction < 1: pass "
        "this engine's own draw_prompts()"
      )
    rollout = sampler.sample(
      params_r,
      prompts,
      jax.random.fold_in(self._sample_key, batch_index),
      self._sampler_cfg,
      self._model_cfg,
      weight_version=version,
      engine_id=self.engine_cfg.engine_id,
      mesh=mesh,
    )
    on_policy = 1.0
    if self._mix is not None:  # before the teacher scores the rows
      rollout, on_policy = self._mix.apply(rollout, refs, batch_index)
    if self._teacher is not None:
      teacher_params, teacher_cfg = self._teacher
      if self._teacher_top_k:
        k, tau = self._teacher_top_k, self._teacher_temperature
        sparse = sparse_teacher(teacher_params, rollout, teacher_cfg, mesh, k, tau)
        rollout = rollout.replace(teacher_topk=sparse)
      else:
        logits_bcv, _ = teacher_forcing.sharded_completion_logits(
          teacher_params, rollout, teacher_cfg, mesh
        )
        rollout = rollout.replace(teacher_logits=logits_bcv)
    if self._score_rewards:
      rollout = rollout.replace(reward_b=_rewards(rollout, self._tokenizer))
    num_tokens = int(jnp.sum(rollout.completion_mask))  # waits for the sampler
    seconds = time.perf_counter() - start
    saturated = rollout.kv_saturated_fraction
    stats = {
      "rollout/kv_saturated_fraction": 0.0 if saturated is None else float(saturated),
      "rollout/seconds": seconds,
      "rollout/tokens_per_s": num_tokens / max(seconds, 1e-9),
      "rollout/mean_completion_len": num_tokens / rollout.batch_size,
      "rollout/on_policy_fraction": on_policy,
    }
    return _shard_rollout(rollout, self._mesh), stats


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
    engine: the `RolloutEngine`.
    first_batch: the index of the next batch (the step when resuming).
    stale_k: the version lag to sample with.
  """

  mode = "sync"

  def __init__(self, engine: RolloutEngine, first_batch: int = 0, stale_k: int = 0):
    if stale_k < 0:
      raise ValueError(f"stale_k must be >= 0, got {stale_k}")
    self.engine = engine
    self.stale_k = stale_k
    self._batch_index = first_batch
    self._versions: dict[int, object] = {}  # version -> params_r, the last k + 1
    self.version = -1
    self._consumed_data_state = engine.data_state()
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
    self._versions[version] = self.engine.transform(params, version)
    for old in [v for v in self._versions if v < version - self.stale_k]:
      del self._versions[old]
    self.version = version

  def __iter__(self):
    return self

  def __next__(self) -> Rollout:
    if not self._versions:
      raise RuntimeError("publish() weights before drawing rollouts")
    use = max(self.version - self.stale_k, min(self._versions))
    prompts = self.engine.draw_prompts()
    rollout, stats = self.engine.sample(self._versions[use], prompts, self._batch_index, use)
    self._batch_index += 1
    self._consumed_data_state = self.engine.data_state()
    self._lags.lags.append(self.version - use)
    self.last_stats = stats
    return rollout

  def window_stats(self) -> tuple[dict[str, float], np.ndarray]:
    """Scalars for the log window since the last call, and the window's lags."""
    stats, lags = self._lags.window()
    return {**self.last_stats, **stats}, lags

  def describe(self) -> str:
    return f"sync, stale_k={self.stale_k}, engine {self.engine.engine_cfg.engine_id}"

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
  """A producer thread samples ahead into a two-slot queue; see the module docstring.

  Args:
    engine: the `RolloutEngine`.
    max_lag: largest lag (step − version) a batch may be trained with uncorrected.
    stale_policy: "drop" or "correct", for batches over `max_lag`.
    max_ahead: how far ahead the producer may run, in versions; None = `max_lag`.
    first_batch: the producer's first batch index (the checkpoint's `next_batch`).
    producer_timeout_s: `next()` raises TimeoutError when no batch arrives for this
      long while the trainer waits.
    engine_shardings: where the engine's copy of the weights lives (a pytree of
      shardings like the params, or one sharding); None keeps the params' own.
  """

  mode = "async"

  def __init__(
    self,
    engine: RolloutEngine,
    max_lag: int,
    stale_policy: str = "drop",
    max_ahead: int | None = None,
    first_batch: int = 0,
    producer_timeout_s: float = 600.0,
    engine_shardings=None,
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
    if jax.process_count() > 1:
      raise ValueError(
        "rollout.mode=async runs in one process for now; use rollout.mode=sync for "
        f"multi-process runs ({jax.process_count()} processes)"
      )
    self.engine = engine
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
    self._consumed_data_state = engine.data_state()
    self._thread: threading.Thread | None = None
    # Counters (read by tests and logs).
    self.produced = self.trained = self.dropped = self.corrected = 0
    self._lags = _LagLog()
    self._producer_wait = 0.0
    self._publish_seconds: list[float] = []
    self._time_in_queue: list[float] = []
    self.last_stats: dict[str, float] = {}

  # -- trainer side -------------------------------------------------------------

  def publish(self, params, version: int) -> None:
    """Hands θ_version to the producer without waiting for it.

    The explicit copy (`may_alias=False`) is what the producer reads, so the
    trainer may donate `params` to its next step right away; the copy is enqueued
    before that step, and the runtime orders the two.
    """
    shardings = self._engine_shardings
    if shardings is None:
      shardings = jax.tree.map(lambda x: x.sharding, params)
    copy = jax.device_put(params, shardings, may_alias=False)
    with self._cond:
      self._pending = (copy, version)
      self.version = version
      self._cond.notify_all()

  def __iter__(self):
    return self

  def __next__(self) -> Rollout:
    if self._thread is None:  # the producer starts when the trainer first asks
      if self.version < 0:
        raise RuntimeError("publish() weights before drawing rollouts")
      self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
      self._thread.start()
    while True:
      item = self._get()
      if item is _END:
        raise StopIteration
      lag = self.version - item.version
      self._consumed_data_state = item.data_state
      self._next_batch = item.index + 1
      if lag > self.max_lag and self.stale_policy == "drop":
        with self._cond:
          self.dropped += 1
          self._cond.notify_all()
        continue
      if lag > self.max_lag:
        self.corrected += 1
      self.trained += 1
      self._lags.lags.append(lag)
      self._time_in_queue.append(time.perf_counter() - item.produced_at)
      self.last_stats = item.stats
      return item.rollout

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
      "rollout/queue_depth": float(self._queue.qsize()),
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
      f"async, max_lag={self.max_lag}, max_ahead={self.max_ahead}, "
      f"stale_policy={self.stale_policy}, engine {self.engine.engine_cfg.engine_id}"
    )

  def resume_state(self) -> dict:
    """What a checkpoint stores: the position after the last consumed batch."""
    return {"data_state": self._consumed_data_state, "next_batch": self._next_batch}

  def close(self, timeout_s: float = 30.0) -> None:
    """Stops the producer and waits for it (a hung producer is left behind, as a daemon)."""
    self._stop.set()
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
          params_r = jax.block_until_ready(self.engine.transform(raw, version))
          self._publish_seconds.append(time.perf_counter() - start)
          version_r = version
          del raw, pending
        try:
          prompts = self.engine.draw_prompts()
        except StopIteration:
          self._put(_END)
          return
        rollout, stats = self.engine.sample(params_r, prompts, index, version_r)
        item = _Batch(rollout, index, version_r, self.engine.data_state(), stats)
        self.produced += 1
        if not self._put(item):
          return
        index += 1
    except BaseException as e:  # reaches the trainer through _get
      self._error = (e, traceback.format_exc())
