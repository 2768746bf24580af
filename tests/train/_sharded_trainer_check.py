"""The OPD loop on a (data, fsdp, tensor) mesh of 8 host devices.

Run by tests/train/test_trainer.py in a subprocess whose environment sets
XLA_FLAGS=--xla_force_host_platform_device_count=8. Usage:

    python tests/train/_sharded_trainer_check.py WORKDIR TEACHER_CACHE DATA FSDP TENSOR

Runs two OPD steps of the tiny config (no student warm start, so both meshes start
from bit-identical weights) and prints one JSON line with the step-1 metrics and
the train state's parameter shardings.
"""

import json
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import bf16_sync  # noqa: E402

from opd_jax.io import metrics_writer  # noqa: E402
from opd_jax.train import trainer  # noqa: E402


def main(workdir, teacher_cache, data, fsdp, tensor):
  config = bf16_sync.get_config("tiny")
  config.teacher.cache_dir = teacher_cache
  config.student.warmup_steps = 0
  config.train.steps = 2
  config.train.log_every = 1
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = int(data), int(fsdp), int(tensor)
  trainer.run(config, workdir, log=lambda *a: None)
  rows = metrics_writer.read_jsonl(workdir)
  print(json.dumps({"devices": jax.device_count(), "step1": rows[1]}))


if __name__ == "__main__":
  main(*sys.argv[1:])
