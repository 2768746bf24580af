"""Async rollouts with the engine on devices of its own.

Run by tests/rollout/test_rollouts.py in a subprocess whose environment sets
XLA_FLAGS=--xla_force_host_platform_device_count=8. Prints one JSON line comparing:

* `engine_shardings`: trainer on device 0, sampler on device 1, against both on device 0;
* `rollout.devices` = 4 (`sharding.split_devices`): a trainer on a 4-device mesh and the
  rollouts on the other 4 devices (a mirrored mesh), dispatched inline at max_lag = 1, against
  the same run with the rollouts on the trainer's 4 devices.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the conftest test_rollouts uses
sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_rollouts as t  # noqa: E402

from opd_jax.inference import transform
from opd_jax.model import sharding
from opd_jax.rollout.async_rollouts import AsyncRollouts
from opd_jax.rollout.worker import RolloutWorker


def run(engine_shardings, max_lag):
  trainer_mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  source = AsyncRollouts(
    t._engine(trainer_mesh), max_lag=max_lag, engine_shardings=engine_shardings
  )
  try:
    seen = t._drive(source, 4)
  finally:
    source.close()
  devices = sorted({d.id for _, r in seen for d in r.completion_tokens.sharding.device_set})
  return [t._host(r) for _, r in seen], devices


def run_apart(apart: bool):
  """Four inline async steps at max_lag = 1 with a trainer on the first 4 devices; the rollouts
  on the last 4 (`apart`) or on the trainer's. Returns the host rollouts, the devices the
  sampler's params lived on and the publish times."""
  train_devices, rollout_devices = sharding.split_devices(4)
  train_mesh = sharding.make_mesh((4, 1, 1), train_devices)
  rollout_mesh = sharding.make_mesh((4, 1, 1), rollout_devices) if apart else None
  worker = RolloutWorker(
    t._prompts(),
    t.TOK,
    t.TASK.max_prompt_tokens,
    transform.EngineConfig(),
    t.SAMPLER,
    t.CFG,
    jax.random.key(7),
    train_mesh,
    rollout_mesh=rollout_mesh,
  )
  source = AsyncRollouts(worker, max_lag=1, dispatch="inline")
  params = sharding.relayout(t._params(), sharding.tree_shardings(t._params(), train_mesh))
  update = jax.jit(
    lambda p: jax.tree.map(lambda w: w * 1.01 + 0.001, p),
    donate_argnums=0,
    out_shardings=sharding.tree_shardings(params, train_mesh),
  )
  source.publish(params, 0)
  engine_devices = sorted(d.id for d in jax.tree.leaves(source._inline_params[0])[0].devices())
  seen = []
  for step in range(4):
    rollout = next(source)
    train_devices_of_rollout = sorted(d.id for d in rollout.completion_tokens.devices())
    seen.append(t._host(rollout))
    params = update(params)
    source.publish(params, step + 1)
  stats, _ = source.window_stats()
  source.close()
  return seen, engine_devices, train_devices_of_rollout, stats["rollout/publish_seconds"]


def main():
  engine = NamedSharding(Mesh(np.array(jax.devices()[1:2]), ("x",)), PartitionSpec())
  # max_lag = 0 is reproducible batch for batch, so the two placements must agree exactly.
  separate, separate_devices = run(engine, 0)
  shared, _ = run(None, 0)
  same = all(np.array_equal(a[k], b[k]) for a, b in zip(separate, shared, strict=True) for k in a)
  # max_lag = 1 overlaps the two devices; which version each batch gets depends on timing.
  ahead, ahead_devices = run(engine, 1)
  apart, apart_engine, apart_train, publish_s = run_apart(True)
  shared, shared_engine, _, _ = run_apart(False)
  same_apart = all(
    np.array_equal(a[k], b[k]) for a, b in zip(apart, shared, strict=True) for k in a
  )
  print(
    json.dumps(
      {
        "apart_same": same_apart,
        "apart_versions": [r["version"] for r in apart],
        "apart_engine_devices": apart_engine,
        "shared_engine_devices": shared_engine,
        "apart_rollout_on_train_devices": apart_train,
        "apart_publish_seconds": publish_s,
        "devices": jax.device_count(),
        "same": same,
        "versions": [r["version"] for r in separate],
        "rollout_devices": separate_devices,
        "ahead_versions": [r["version"] for r in ahead],
        "ahead_rollout_devices": ahead_devices,
      }
    )
  )


if __name__ == "__main__":
  main()
