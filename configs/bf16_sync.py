"""Reference run: synchronous OPD, rollout engine identical to the trainer.

Every later comparison (async, FP8, noise, staleness, the mismatch budget) is
measured against this run. On the built-in arithmetic task it bootstraps a 4-layer
teacher (cached under the workdir), warm-starts a 2-layer student and distills.

Command:  python -m opd_jax.main --config=configs/bf16_sync.py --workdir=/tmp/opd_ref
Tiny:     python -m opd_jax.main --config=configs/bf16_sync.py:tiny --workdir=/tmp/opd_tiny
Expected: see README "Results" (teacher accuracy, student accuracy before and after).

The name follows the study: the engine runs at the trainer's own precision (f32 on
CPU, where bf16 matmuls are slower; set --config.student.dtype=bfloat16 on GPU/TPU).
"""

import base

VARIANTS = ("tiny",)


def get_config(arg=None):
  c = base.get_config()
  c.rollout.weights = "trainer"
  c.rollout.kv_cache = "auto"
  c.rollout.mode = "sync"
  if arg == "tiny":
    base.shrink_to_tiny(c)
  elif arg is not None:
    raise ValueError(f"unknown variant {arg!r} of bf16_sync.py; known: {', '.join(VARIANTS)}")
  return c
