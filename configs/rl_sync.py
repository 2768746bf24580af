"""RL baseline: synchronous REINFORCE on the task's exact-match reward (`opd_jax/train/rl.py`).

The same run as `bf16_sync.py` (teacher bootstrap, warm-started student, rollout engine
identical to the trainer) with the distillation loss replaced by REINFORCE: reward 1 when
the decoded completion's answer is right, a leave-one-out batch-mean baseline, token-level
log-probs, and the truncated importance ratio min(π_θ/π_b, 2) against the rollout's
behaviour log-probs (`train.is_clip`; 0 turns it off). With this engine the ratio is 1,
so the correction only acts when a mismatch source is switched on, e.g.
`--config.rollout.weights=fp8 --config.rollout.kv_cache=fp8`. The teacher is still
bootstrapped because the held-out evaluation reports the student–teacher KL; the train
step does not score it.

Command:  python -m opd_jax.main --config=configs/rl_sync.py --workdir=/tmp/rl_ref
Tiny:     python -m opd_jax.main --config=configs/rl_sync.py:tiny --workdir=/tmp/rl_tiny
Expected: the warm-started student starts at 43.4 % greedy held-out accuracy and a sampled
          (T = 1) reward near 0.12, and does not improve on it within 400 steps
          (`--config.train.steps=400`, about 8 minutes on 2 CPU cores). lr 3e-5 is the largest
          rate that does not collapse (the learning-rate scan: `docs/history.md`).
"""

import base

VARIANTS = ("tiny",)


def get_config(arg=None):
  """The RL reference config; `arg="tiny"` gives the seconds-long wiring check."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of rl_sync.py; known: {', '.join(VARIANTS)}")
  c = base.get_config(arg)
  c.rollout.weights = "trainer"  # engine identical to the trainer
  c.rollout.kv_cache = "auto"  # the engine's compute dtype
  c.rollout.mode = "sync"  # sample, then train
  c.train.loss = "reinforce"  # REINFORCE, leave-one-out baseline (opd_jax/train/rl.py)
  c.train.is_clip = 2.0  # truncated IS ratio C; 0 = no correction
  c.train.lr = 3e-5  # peak AdamW lr for the RL loss (3e-4 collapses; docs/history.md)
  return c
