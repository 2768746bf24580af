"""The budget guard demo: the reference run with heavy weight noise, without and with the guard.

The engine samples with W + σ·rms(W)·ε, σ = 1 (`rollout.noise_sigma`), far beyond any mismatch
a budget calibrated on this task admits. Without the guard the run trains on those samples to
the end; with `budget.action=fallback` the guard sees `mismatch/kl` over the budget, and after
`budget.patience` steps switches the engine to the ladder's next rung (BF16 weights without
noise: here the reference engine); `adaptive` measures the ladder at the start and picks the
cheapest rung within budget before the first step; `warn` only logs.

Commands (the budget file from the study, or one fitted with `opd_jax.budget.fit_budget`):

  python -m opd_jax.main --config=configs/guard_demo.py:off --workdir=/tmp/guard_off
  python -m opd_jax.main --config=configs/guard_demo.py:fallback \
      --config.budget.file=budget.json --workdir=/tmp/guard_fallback
  python -m opd_jax.main --config=configs/guard_demo.py:adaptive \
      --config.budget.file=budget.json --workdir=/tmp/guard_adaptive

Variants: off | warn | fallback | adaptive (`budget.action`); append `,tiny` (`:fallback,tiny`)
for the seconds-long wiring check.

Expected: without the guard the student collapses to a few percent held-out accuracy;
`adaptive` trains like the reference run (`bf16_sync.py`) and `fallback` recovers most of it
after its first `patience` steps on noisy samples (figures: `docs/results/guard_demo.md`).
"""

import bf16_sync

GUARDS = ("off", "warn", "fallback", "adaptive")
VARIANTS = (*GUARDS, *(f"{guard},tiny" for guard in GUARDS))
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
