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
  if arg == "tiny":  # seconds on a CPU: wiring checks, not quality
    c.teacher.arch.num_layers = 1
    c.teacher.arch.hidden_size = 32
    c.teacher.arch.head_dim = 8
    c.teacher.arch.intermediate_size = 64
    c.teacher.pretrain_steps = 20
    c.teacher.pretrain_batch_size = 16
    c.student.arch.num_layers = 1
    c.student.arch.hidden_size = 32
    c.student.arch.head_dim = 8
    c.student.arch.intermediate_size = 64
    c.student.warmup_steps = 5
    c.data.batch_size = 8
    c.data.eval_size = 16
    c.rollout.max_new_tokens = 28
    c.train.steps = 6
    c.train.log_every = 2
    c.train.eval_every = 3
    c.train.checkpoint_every = 3
  elif arg is not None:
    raise ValueError(f"unknown variant {arg!r} of bf16_sync.py; known: {', '.join(VARIANTS)}")
  return c
