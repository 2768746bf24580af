"""The reference run trained with the sampled-token OPD loss (`reverse_kl_sampled`).

Same engine, task, teacher, student and step budget as `bf16_sync.py`; only the loss
and its optimisation recipe differ. The loss is the study's policy-gradient form:
A_t = sg(log π_T(y_t) − log π_θ(y_t)), loss = −mean r_t · (clip(A_t, −c, c) − b) · log π_θ(y_t)
with a stop-gradient baseline b, sampled at temperature 1 (the estimator is unbiased only
on-policy).

Recipe (measured on the embedded task, every run from the same cached teacher, 95.3%):
- lr 5e-4 (peak; 10 warmup steps, cosine to 10%). 1e-3 collapses the student onto
  confident wrong tokens (its log-prob of its own samples rises to −0.08 while the
  teacher's stays near −2): once π_θ(y) ≈ 1 the gradient (onehot(y) − π_θ) vanishes and
  sampling never visits the teacher's token again. Gradient noise drives that
  sharpening, so it grows with the step size (a warmup to 6e-4 with c = 1 lost accuracy
  as the rate rose). 5e-4 dips deeper early (23% at step 200 against 33% at 3e-4) and
  then overtakes: lower KL from step 800 on and the best final figures measured.
- advantage_clip c = 0.5: bounds the per-token step of the rare tokens the teacher
  rules out (A_t ≈ −10), the heavy tail of the estimator's noise. The clipped
  estimator is the exact gradient of a Huber-like f-divergence with the same
  minimiser π_θ = π_T (`losses.reverse_kl_sampled`), so it changes how hard outliers
  pull, not where training converges.
- advantage_baseline = "batch_mean": subtract the mean clipped advantage of the batch's
  other sequences (unbiased; `losses.reverse_kl_sampled`). It is small here (about
  −0.03: the clipped advantages are nearly centred) and showed no gain of its own at
  3e-4 (73.4% against 74.6%, within noise). At 5e-4 the run without it trailed up to
  step 800 (62.1% against 68.8%) but ended at 82.4% (KL 0.068): the gain is the
  learning rate, not the baseline, which is kept as the lower-variance, unbiased form.

Measured (held-out accuracy at steps 200/400/600/800/1000 in %, final KL(student ‖ teacher)
in nats per token; 256 held-out prompts, so ±3% sampling error). The rows with
batch_mean were run with the current code as `nice -n 5 python -m opd_jax.main
--config=configs/bf16_sync_sampled.py --workdir=W --config.teacher.cache_dir=/tmp/tcache
--config.train.advantage_baseline=batch_mean --config.train.lr=LR`; the others, with
the same teacher, before the baseline existed:
  lr 1e-4, c=1                      step 200: 34.4 (stopped)
  lr 2e-4, c=1                      30.1 / 46.1 / 53.5 / 61.7 / 71.9   KL 0.109
  lr 3e-4, no clip                  18.0 / 34.0 (stopped)
  lr 3e-4, c=1                      30.1 / 38.3 / 53.9 / 65.2 / 70.7   KL 0.087
  lr 3e-4, c=0.5                    32.8 / 43.4 / 52.0 / 64.8 / 74.6   KL 0.080
  lr 3e-4, c=0.25                   23.8 / 40.2 / 50.4 / 65.2 / 75.0   KL 0.089
  lr 3e-4, c=0.5, batch_mean        33.2 / 45.7 / 48.0 / 65.6 / 73.4   KL 0.101
  lr 4e-4, c=0.5                    step 100: 12.9 (stopped)
  lr 5e-4, c=0.5                    23.4 / 29.3 / 48.8 / 62.1 / 82.4   KL 0.068
  lr 5e-4, c=0.5, batch_mean        23.0 / 45.3 / 43.8 / 68.8 / 76.2   KL 0.066
  the same, --config.train.seed=1   21.1 / 32.4 / 47.3 / 68.8 / 80.9   KL 0.056
  the same, --config.train.seed=2   17.2 / 41.8 / 59.0 / 59.8 / 72.3   KL 0.069
  the same, --config.train.seed=3   25.0 / 39.8 / 48.0 / 58.2 / 69.1   KL 0.066
  lr 6e-4 warmup 300, c=1           16.4 / 23.0 (stopped)
  lr 1e-3, c=1                      0.4 / 0.8 (stopped; collapsed)
reverse_kl_full (bf16_sync.py, lr 1e-3): 36.3 / 54.7 / 94.9 / 97.7 / 96.5, KL 0.006.
(train.seed=1 changes the data order and sampling, not the teacher or the warm start.)
The recipe over four seeds ends at 76.2, 80.9, 72.3 and 69.1% (mean 74.6%, 78% of the
teacher; 80% of 95.3% is 76.25%): seed-to-seed spread (±5 points) is larger than the
differences between the settings above, and the recipe does NOT reach 80% of the teacher
on average. Its KL (0.056-0.069) is below the 3e-4 runs' (0.080-0.101).

Command:  python -m opd_jax.main --config=configs/bf16_sync_sampled.py --workdir=/tmp/opd_sampled
Expected: teacher 95.3% held-out accuracy, student 43.4% after its warm start and
          76.2% after 1,000 OPD steps (195 of 256 prompts: 79.9% of the teacher's
          accuracy; reverse_kl_full reaches 96.5%), KL(student ‖ teacher) 0.525 → 0.066
          nats per token. Wall time: about 4 minutes with a cached teacher
          (--config.teacher.cache_dir) on 2 quiet cores (measured 247 s for lr 3e-4
          without the baseline, which adds O(B·T) work); this round's runs took
          36 minutes each (2,167 s and 2,196 s) sharing 2 cores with about ten other
          jobs; a step costs what a bf16_sync.py step costs.
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
  return c
