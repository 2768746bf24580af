"""Reference run: synchronous OPD, rollout engine identical to the trainer.

Every later comparison (async, FP8, noise, staleness, the mismatch budget) is
measured against this run. On the built-in arithmetic task it bootstraps a 4-layer
teacher (cached under the workdir), warm-starts a 2-layer student and distills.

Command:  python -m opd_jax.main --config=configs/bf16_sync.py --workdir=/tmp/opd_ref
Expected: on 2 CPU cores about 6 minutes the first time (3 of them bootstrapping the
          teacher, cached afterwards) and 3 minutes after; teacher 95.3% held-out
          accuracy (at least 95% on any CPU: `teacher.target_accuracy`), student 43.4%
          after its warm start and 96.5% after 1,000 OPD steps.
Tiny:     python -m opd_jax.main --config=configs/bf16_sync.py:tiny --workdir=/tmp/opd_tiny
          (about a minute, mostly compilation; checks the wiring, not quality).

The name follows the study: the engine runs at the trainer's own precision (f32 on
CPU, where bf16 matmuls are slower; set --config.student.dtype=bfloat16 on GPU/TPU).
"""

import base

VARIANTS = ("tiny",)


def get_config(arg=None):
  """The reference config; `arg="tiny"` gives the seconds-long wiring check."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of bf16_sync.py; known: {', '.join(VARIANTS)}")
  c = base.get_config(arg)
  c.rollout.weights = "trainer"
  c.rollout.kv_cache = "auto"
  c.rollout.mode = "sync"
  return c
