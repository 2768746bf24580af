"""The reference run trained with the sampled-token OPD loss (`reverse_kl_sampled`).

Same engine, task, teacher, student and step budget (1,000 steps) as `bf16_sync.py`; the
loss, its optimisation recipe and the batch differ. The loss is the study's
policy-gradient form:
A_t = sg(log π_T(y_t) − log π_θ(y_t)), loss = −mean r_t · (clip(A_t, −c, c) − b) · log π_θ(y_t)
with a stop-gradient baseline b, sampled at temperature 1 (the estimator is unbiased only
on-policy).

Recipe: 64 completions per step (`data.batch_size = 64`, twice `bf16_sync.py`'s, so a step
costs about twice as much: the budget is the same in steps, not in compute); peak lr 5e-4
(10 warmup steps, cosine to 10%); `advantage_clip` c = 0.5, which bounds the per-token step
of tokens the teacher rules out (the exact gradient of a Huber-like f-divergence with the
same minimiser π_θ = π_T, `losses.reverse_kl_sampled`); `advantage_baseline = "batch_mean"`,
the mean clipped advantage of the batch's other sequences (unbiased). The sweeps behind it
are in `docs/history.md`.

Command:  python -m opd_jax.main --config=configs/bf16_sync_sampled.py --workdir=/tmp/opd_sampled
Expected: the student goes from 43.4% held-out accuracy after its warm start to 94.5% after
          1,000 OPD steps (seed 0; 91.8-95.7% over `train.seed` 0-3; teacher 95.3%,
          reverse_kl_full 96.5%), in 5-7 minutes on 2 CPU cores with a cached teacher
          (--config.teacher.cache_dir).
Tiny:     python -m opd_jax.main --config=configs/bf16_sync_sampled.py:tiny --workdir=/tmp/opd_st
          (about a minute, mostly compilation; checks the wiring, not quality).
"""

import base

VARIANTS = ("tiny",)


def get_config(arg=None):
  """The sampled-loss recipe; `arg="tiny"` gives the seconds-long wiring check."""
  if arg not in (None, *VARIANTS):
    raise ValueError(
      f"unknown variant {arg!r} of bf16_sync_sampled.py; known: {', '.join(VARIANTS)}"
    )
  c = base.get_config(arg)
  c.rollout.weights = "trainer"  # engine identical to the trainer, as in bf16_sync.py
  c.rollout.kv_cache = "auto"  # the trainer's compute dtype
  c.rollout.mode = "sync"  # sample, then train
  c.rollout.temperature = 1.0  # on-policy sampling: the sampled estimator needs it
  c.train.loss = "reverse_kl_sampled"  # the study's sampled-token policy-gradient form
  c.train.lr = 5e-4  # 1e-3 collapses onto confident wrong tokens
  c.train.advantage_clip = 0.5  # clip A_t to [-0.5, 0.5]
  c.train.advantage_baseline = "batch_mean"  # subtract the other sequences' mean A_t
  if arg is None:  # the tiny wiring check keeps its own small batch
    c.data.batch_size = 64  # 64 completions per step: at 32 gradient noise held it back
  return c
