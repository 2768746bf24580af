"""Rollout sources on a real tiny model: sync stale-k, the async double buffer's lag
bound, donation safety, producer faults and the resume position.

The "trainer" in these tests is a jitted update that donates its params, like the
real train step, so a source that aliased the trainer's buffers would fail here.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_char_cfg, xla_flags_with

from opd_jax.data import pipeline as data
from opd_jax.data import task
from opd_jax.inference import sampler, transform
from opd_jax.model import sharding, tokenizer
from opd_jax.model import transformer as model
from opd_jax.rollout.async_rollouts import AsyncRollouts, ProducerError
from opd_jax.rollout.sources import SyncRollouts
from opd_jax.rollout.worker import RolloutWorker, host_key

TASK = task.TaskConfig(num_operands=2, max_operand=99)
TOK = tokenizer.CharTokenizer()
CFG = tiny_char_cfg()
BATCH = 4
SAMPLER = sampler.SamplerConfig(max_new_tokens=6, stop_tokens=(TOK.eos_id,))


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh((1, 1, 1))


def _params():
  return model.init_params(jax.random.key(1), CFG, jnp.float32, scale=0.3)


@jax.jit
def _update(params):
  """A stand-in optimizer step with the train step's donation (see `_train`)."""
  return jax.tree.map(lambda w: w * 1.01 + 0.001, params)


_update_donating = jax.jit(lambda p: jax.tree.map(lambda w: w * 1.01 + 0.001, p), donate_argnums=0)


def _prompts(seed=0):
  source = task.TaskSource("train", 10_000, seed, TASK)
  return iter(data.prompt_batches(source, BATCH, seed))


def _engine(mesh, prompts=None, ecfg=None):
  return RolloutWorker(
    prompts if prompts is not None else _prompts(),
    TOK,
    TASK.max_prompt_tokens,
    ecfg or transform.EngineConfig(),
    SAMPLER,
    CFG,
    jax.random.key(7),
    mesh,
  )


def _drive(source, steps, trainer_delay=lambda: 0.0):
  """Runs the trainer side for `steps` steps; returns [(step, rollout)]."""
  params = _params()
  source.publish(params, 0)
  seen = []
  for step in range(steps):
    rollout = next(source)
    seen.append((step, rollout))
    time.sleep(trainer_delay())
    params = _update_donating(params)
    source.publish(params, step + 1)
  return seen


def _host(rollout):
  return {
    "tokens": np.asarray(rollout.completion_tokens),
    "mask": np.asarray(rollout.completion_mask),
    "prompt": np.asarray(rollout.prompt_tokens),
    "lp": np.asarray(rollout.behaviour_logprobs),
    "version": int(rollout.weight_version),
  }


@pytest.mark.parametrize("dispatch", ["thread", "inline"])
def test_async_with_max_lag_0_reproduces_sync_batch_for_batch(mesh, dispatch):
  sync = _drive(SyncRollouts(_engine(mesh)), 5)
  source = AsyncRollouts(_engine(mesh), max_lag=0, dispatch=dispatch)
  try:
    asynchronous = _drive(source, 5)
  finally:
    source.close()
  for (_, a), (_, b) in zip(sync, asynchronous, strict=True):
    a, b = _host(a), _host(b)
    for name in a:
      np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  assert [int(r.weight_version) for _, r in asynchronous] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("dispatch", ["thread", "inline"])
def test_publish_copies_so_a_donated_trainer_buffer_is_never_read(mesh, dispatch):
  params = _params()
  expected = _host(_sample(mesh, params))
  source = AsyncRollouts(_engine(mesh), max_lag=1, dispatch=dispatch)
  try:
    source.publish(params, 0)
    trained = _update_donating(params)  # donates the published buffers at once
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    got = _host(next(source))  # sampled from the engine's own copy
    source.publish(trained, 1)
    next(source)
  finally:
    source.close()
  for name in expected:
    np.testing.assert_array_equal(expected[name], got[name], err_msg=name)


def _sample(mesh, params):
  source = SyncRollouts(_engine(mesh))
  source.publish(params, 0)
  return next(source)


def test_sync_stale_k_samples_with_the_weights_k_versions_old(mesh):
  source = SyncRollouts(_engine(mesh), stale_k=2)
  seen = _drive(source, 5)
  assert [int(r.weight_version) for _, r in seen] == [0, 0, 0, 1, 2]
  # Batch 4 equals a lag-0 sample of the same prompts and key with version 2's weights.
  params = _params()
  for _ in range(2):
    params = _update(params)
  fresh = _engine(mesh)
  for _ in range(4):
    next(fresh.prompts)
  rollout, _ = fresh.sample(fresh.transform(params, 2), fresh.draw_prompts(), 4, 2)
  np.testing.assert_array_equal(_host(rollout)["tokens"], _host(seen[4][1])["tokens"])
  stats, lags = source.window_stats()
  assert lags.tolist() == [0, 1, 2, 2, 2] and stats["rollout/version_lag_max"] == 2


class _FailingPrompts:
  """A prompt iterator that raises on batch `fail_at` (a real input fault)."""

  def __init__(self, fail_at):
    self._inner, self._n, self._fail_at = _prompts(), 0, fail_at

  def __next__(self):
    self._n += 1
    if self._n == self._fail_at:
      raise ValueError(f"prompt batch {self._n} is unreadable")
    return next(self._inner)

  def get_state(self):
    return self._inner.get_state()


def test_producer_exception_reaches_the_trainer_with_its_traceback(mesh):
  source = AsyncRollouts(_engine(mesh, _FailingPrompts(fail_at=3)), max_lag=1)
  start = time.perf_counter()
  with pytest.raises(ProducerError, match="prompt batch 3 is unreadable") as info:
    _drive(source, 10)
  assert time.perf_counter() - start < 30  # seconds, compile included, not a hang
  message = str(info.value)
  assert "Traceback" in message and "__next__" in message and "_produce" in message
  assert isinstance(info.value.__cause__, ValueError)
  source.close()


class _HangingPrompts:
  """Yields one batch, then blocks until released (a stuck data source)."""

  def __init__(self):
    self._inner, self._n, self.release = _prompts(), 0, threading.Event()

  def __next__(self):
    self._n += 1
    if self._n > 1:
      self.release.wait()
    return next(self._inner)

  def get_state(self):
    return self._inner.get_state()


def test_a_hung_producer_is_reported_instead_of_waited_on(mesh):
  prompts = _HangingPrompts()
  source = AsyncRollouts(_engine(mesh, prompts), max_lag=1, producer_timeout_s=1.0)
  try:
    with pytest.raises(TimeoutError, match=r"producer_timeout_s=1\).*still running: it hangs"):
      _drive(source, 3)
  finally:
    prompts.release.set()
    source.close()


SCENARIOS = {
  # name: (trainer delay, producer delay) in seconds, as functions of an rng
  "trainer_slower": (lambda r: r.uniform(0.02, 0.05), lambda r: 0.0),
  "producer_slower": (lambda r: 0.0, lambda r: r.uniform(0.02, 0.05)),
  "both_jittery": (lambda r: r.exponential(0.015), lambda r: r.exponential(0.015)),
}
BOUNDS = [(0, None, "drop"), (1, None, "drop"), (0, 2, "drop"), (1, 2, "correct")]


class _DelayedPrompts:
  def __init__(self, delay):
    self._inner, self._delay = _prompts(), delay

  def __next__(self):
    time.sleep(self._delay())
    return next(self._inner)

  def get_state(self):
    return self._inner.get_state()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_lag_bound_holds_and_every_batch_is_accounted_for_under_random_delays(mesh, scenario):
  """Property: lag ≤ max_lag for every trained batch (≤ max_ahead under `correct`), no
  deadlock (a stuck loop would hit the producer timeout), and produced = trained +
  dropped + left in the queue at shutdown."""
  dropped_anywhere = 0
  trainer_delay, producer_delay = SCENARIOS[scenario]
  for seed, (max_lag, max_ahead, policy) in enumerate(BOUNDS):
    rng = np.random.default_rng(seed)
    source = AsyncRollouts(
      _engine(mesh, _DelayedPrompts(lambda rng=rng: producer_delay(rng))),
      max_lag=max_lag,
      max_ahead=max_ahead,
      stale_policy=policy,
      producer_timeout_s=20.0,
    )
    try:
      seen = _drive(source, 12, lambda rng=rng: trainer_delay(rng))
    finally:
      source.close()
    lags = [step - int(r.weight_version) for step, r in seen]
    bound = max_lag if policy == "drop" else max(max_lag, max_ahead or 0)
    assert max(lags) <= bound, (max_lag, max_ahead, policy, lags)
    assert all(lag >= 0 for lag in lags)
    left = source.produced - source.trained - source.dropped
    assert source.trained == 12 and 0 <= left <= 3, (source.produced, source.dropped)
    assert source.corrected == sum(lag > max_lag for lag in lags)
    dropped_anywhere += source.dropped
  if scenario == "trainer_slower":  # the producer ran ahead of max_lag=0: drops happened
    assert dropped_anywhere > 0


def test_resume_state_points_after_the_last_consumed_batch(mesh):
  source = AsyncRollouts(_engine(mesh), max_lag=1)
  try:
    _drive(source, 3)
    time.sleep(0.2)  # let the producer sample ahead of the trainer
    state = source.resume_state()
  finally:
    source.close()
  assert state["next_batch"] == 3
  straight, resumed = _prompts(), _prompts()
  for _ in range(3):
    next(straight)
  resumed.set_state(state["data_state"])
  assert next(resumed)["prompt"] == next(straight)["prompt"]


def test_inline_async_at_max_lag_1_is_sync_stale_1_batch_for_batch(mesh):
  """Inline dispatch decides nothing by timing: at max_lag = max_ahead = 1 batch t is sampled
  with version max(t − 1, 0), exactly what the synchronous stale-1 source does, with the same
  prompts and keys, so every token and log-prob agrees."""
  stale = _drive(SyncRollouts(_engine(mesh), stale_k=1), 6)
  source = AsyncRollouts(_engine(mesh), max_lag=1, dispatch="inline")
  try:
    inline = _drive(source, 6)
    stats, lags = source.window_stats()
  finally:
    source.close()
  assert [int(r.weight_version) for _, r in inline] == [0, 0, 1, 2, 3, 4]
  for (_, a), (_, b) in zip(stale, inline, strict=True):
    a, b = _host(a), _host(b)
    for name in a:
      np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  assert lags.tolist() == [0, 1, 1, 1, 1, 1] and stats["rollout/publish_seconds"] >= 0
  assert source.produced - source.trained == 2  # the double buffer is full at the end


@pytest.mark.parametrize(
  "max_lag,max_ahead,policy", [(0, 1, "drop"), (0, 2, "drop"), (1, 2, "correct")]
)
def test_inline_lag_bound_and_accounting(mesh, max_lag, max_ahead, policy):
  """The lag bound and produced = trained + dropped + still buffered, when the gate lets the
  buffer run ahead of max_lag; the dropped prompts are not revisited."""
  source = AsyncRollouts(
    _engine(mesh), max_lag=max_lag, max_ahead=max_ahead, stale_policy=policy, dispatch="inline"
  )
  try:
    seen = _drive(source, 8)
  finally:
    source.close()
  lags = [step - int(r.weight_version) for step, r in seen]
  assert max(lags) <= (max_lag if policy == "drop" else max_ahead), lags
  assert source.corrected == sum(lag > max_lag for lag in lags)
  assert source.trained == 8 and source.produced - source.trained - source.dropped <= 2
  if policy == "drop":
    assert source.dropped > 0  # the buffer ran ahead of the bound
  prompts = [tuple(np.asarray(r.prompt_tokens)[0]) for _, r in seen]
  assert len(set(prompts)) == len(prompts)


def test_inline_resume_state_points_after_the_last_consumed_batch(mesh):
  source = AsyncRollouts(_engine(mesh), max_lag=1, dispatch="inline")
  try:
    _drive(source, 3)  # batches 3 and 4 are dispatched ahead and not consumed
    state = source.resume_state()
  finally:
    source.close()
  assert state["next_batch"] == 3 and source.produced == 5
  straight, resumed = _prompts(), _prompts()
  for _ in range(3):
    next(straight)
  resumed.set_state(state["data_state"])
  assert next(resumed)["prompt"] == next(straight)["prompt"]


@pytest.mark.parametrize("dispatch", ["inline", "thread"])
def test_a_source_resumed_after_more_drops_than_max_ahead_samples_on(mesh, dispatch):
  """A resume (or the live guard's switch) builds a source at the checkpoint's next batch,
  which counts the batches dropped before; its gate counts from that start, so the source
  samples on (it used to wait for a version the trainer never publishes: an empty inline
  buffer, a hung producer), from the prompts after the last consumed batch, within the bound."""
  first = AsyncRollouts(
    _engine(mesh), max_lag=0, max_ahead=1, stale_policy="drop", dispatch="inline"
  )
  try:
    _drive(first, 6)
    state = first.resume_state()
  finally:
    first.close()
  assert first.dropped > 1 and state["next_batch"] == 6 + first.dropped

  prompts = _prompts()
  prompts.set_state(state["data_state"])
  resumed = AsyncRollouts(
    _engine(mesh, prompts),
    max_lag=0,
    max_ahead=1,
    stale_policy="drop",
    dispatch=dispatch,
    first_batch=state["next_batch"],
    producer_timeout_s=20.0,
  )
  params = _params()
  seen = []
  try:
    resumed.publish(params, 6)
    for step in range(6, 10):
      seen.append((step, next(resumed)))
      params = _update_donating(params)
      resumed.publish(params, step + 1)
  finally:
    resumed.close()
  assert [step - int(r.weight_version) for step, r in seen] == [0, 0, 0, 0]
  straight = _prompts()
  for _ in range(state["next_batch"]):
    next(straight)
  sync = SyncRollouts(_engine(mesh, straight))
  sync.publish(_params(), 0)
  expected = next(sync)
  np.testing.assert_array_equal(
    np.asarray(seen[0][1].prompt_tokens), np.asarray(expected.prompt_tokens)
  )


def test_bad_async_settings_are_refused(mesh):
  with pytest.raises(ValueError, match="dispatch must be one of auto, thread, inline"):
    AsyncRollouts(_engine(mesh), max_lag=1, dispatch="process")
  with pytest.raises(ValueError, match="stale_policy must be one of drop, correct"):
    AsyncRollouts(_engine(mesh), max_lag=1, stale_policy="keep")
  with pytest.raises(ValueError, match="max_lag must be >= 0"):
    AsyncRollouts(_engine(mesh), max_lag=-1)
  source = AsyncRollouts(_engine(mesh), max_lag=1)
  with pytest.raises(RuntimeError, match="publish"):
    next(source)


@pytest.mark.slow
def test_engine_on_separate_devices_gives_the_same_rollouts():
  """8 forced CPU devices. Trainer on device 0, producer and sampler on device 1: the same
  rollouts as on one device at max_lag = 0 (the reproducible loop), and at max_lag = 1 every
  batch within the lag bound and handed to the trainer's device. And `rollout.devices` = 4:
  trainer on devices 0-3, sampler on 4-7, inline at max_lag = 1, token for token the rollouts
  of the same run with the sampler on the trainer's devices."""
  flags = xla_flags_with("--xla_force_host_platform_device_count=8")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  script = Path(__file__).with_name("_separate_devices_check.py")
  proc = subprocess.run(
    [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["devices"] == 8
  assert result["apart_same"], result
  assert result["apart_versions"] == [0, 0, 1, 2]
  assert result["apart_engine_devices"] == [4, 5, 6, 7]
  assert result["shared_engine_devices"] == result["apart_rollout_on_train_devices"] == [0, 1, 2, 3]
  assert result["apart_publish_seconds"] > 0
  assert result["same"], result  # at max_lag = 0: placement changes no token
  assert result["versions"] == [0, 1, 2, 3]
  assert result["rollout_devices"] == result["ahead_rollout_devices"] == [0]  # on the trainer's
  # At max_lag = 1 the version each batch gets depends on timing, within the bound.
  assert all(step - 1 <= v <= step for step, v in enumerate(result["ahead_versions"])), result[
    "ahead_versions"
  ]


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 - 1, -3, 2**31])
def test_host_key_is_jax_random_key(seed):
  """The host-built key is `jax.random.key(seed)`: the same key data, and the same draws."""
  key, reference = host_key(seed), jax.random.key(seed)
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(reference))
  assert jax.random.key_impl(key) == jax.random.key_impl(reference)
  np.testing.assert_array_equal(
    jax.random.uniform(jax.random.fold_in(key, 7), (4,)),
    jax.random.uniform(jax.random.fold_in(reference, 7), (4,)),
  )
