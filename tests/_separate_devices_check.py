"""Async rollouts with the engine on its own device: trainer on device 0, sampler on 1.

Run by tests/test_rollouts.py in a subprocess whose environment sets
XLA_FLAGS=--xla_force_host_platform_device_count=2. Prints one JSON line comparing the
rollouts with the same steps run with trainer and sampler sharing device 0.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_rollouts as t  # noqa: E402

from opd_jax.rollout.sources import AsyncRollouts


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


def main():
  engine = NamedSharding(Mesh(np.array(jax.devices()[1:2]), ("x",)), PartitionSpec())
  # max_lag = 0 is reproducible batch for batch, so the two placements must agree exactly.
  separate, separate_devices = run(engine, 0)
  shared, _ = run(None, 0)
  same = all(np.array_equal(a[k], b[k]) for a, b in zip(separate, shared, strict=True) for k in a)
  # max_lag = 1 overlaps the two devices; which version each batch gets depends on timing.
  ahead, ahead_devices = run(engine, 1)
  print(
    json.dumps(
      {
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
