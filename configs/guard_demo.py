"""The budget guard demo: the reference run with heavy weight noise, without and with the guard.

The engine samples with W + σ·rms(W)·ε, σ = 1 (`rollout.noise_sigma`), far beyond any mismatch
a budget calibrated on this task admits. Without the guard the run trains on those samples to
the end; with `budget.action=fallback` the guard sees `mismatch/kl` over the budget, and after
`budget.patience` steps switches the engine to the ladder's next rung (BF16 weights without
noise: here the reference engine); `adaptive` measures the ladder at the start and picks the
cheapest rung within budget before the first step.

Commands (the budget file from the study, or one fitted with `opd_jax.budget.fit_budget`):

  python -m opd_jax.main --config=configs/guard_demo.py:off --workdir=/tmp/guard_off
  python -m opd_jax.main --config=configs/guard_demo.py:fallback \
      --config.budget.file=budget.json --workdir=/tmp/guard_fallback
  python -m opd_jax.main --config=configs/guard_demo.py:adaptive \
      --config.budget.file=budget.json --workdir=/tmp/guard_adaptive

Append `,tiny` to a variant (`:fallback,tiny`) for the seconds-long wiring check.

Measured (1,000 steps, --config.teacher.cache_dir=/tmp/tcache, three runs at once on 2 busy CPU
cores: 65-87 minutes each; about 10 minutes alone). Budget: max_kl 2.58e-3 nats/token, fitted
with `fit_budget(tolerance=0.02)` from the reference run (check-measured mismatch/kl -3e-9,
drop 0) and the σ = 0.05 run (2.58e-3, drop 0): censored above, the largest mismatch shown
harmless. The check measures σ = 1 at 2.88 nats/token at the warm-started student.

  variant    held-out accuracy  KL(student||teacher)  training mismatch/kl  guard
  off        4.3%               1.617                 2.50 (mean)           -
  fallback   75.4%              0.101                 ~0 after step 20      rung 1 at step 20
  adaptive   96.5%              0.0063                ~1e-9                 rung 1 at step 0
  reference  96.5%              0.0063                ~1e-9                 (configs/bf16_sync.py)

Teacher 95.3%; the student starts at 43.4%. The adaptive run picks the noise-free rung before
the first step and is the reference run step for step; fallback switches after 20 steps over
budget, but those 20 steps on σ = 1 samples (loss 6 at step 10) set the student back, and it
ends 21 points under the reference at step 1,000 (63% at 600, 73% at 800: still climbing).
"""

import bf16_sync

GUARDS = ("off", "warn", "fallback", "adaptive")
NOISE_SIGMA = 1.0


def get_config(arg=None):
  """`arg` = "<guard>[,tiny]" with guard one of off | warn | fallback | adaptive."""
  parts = [p for p in (arg or "off").split(",") if p]
  guard, rest = parts[0], parts[1:]
  if guard not in GUARDS or rest not in ([], ["tiny"]):
    raise ValueError(
      f"unknown variant {arg!r} of guard_demo.py; known: <guard>[,tiny] with guard one of "
      f"{', '.join(GUARDS)}"
    )
  c = bf16_sync.get_config("tiny" if rest else None)
  c.rollout.noise_sigma = NOISE_SIGMA  # heavy weight noise: the run degrades without a guard
  if guard != "off":
    c.budget.file = "budget.json"  # the budget to guard; set --config.budget.file=PATH
    c.budget.action = guard  # what the guard does once over budget for `patience` steps
  c.budget.patience = 20  # consecutive over-budget steps of the moving average
  c.budget.smoothing = 0.9  # moving average over about 10 steps
  c.budget.recheck_every = 200  # adaptive: re-measure the ladder every 200 steps
  return c
