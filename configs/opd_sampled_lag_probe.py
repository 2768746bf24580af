"""Exploratory: is sampled-token OPD's collapse under a one-step lag a matter of its step size?

In `opd_vs_rl_learns.py`'s finished runs (seeds 0 and 1), sampled-token OPD without a
correction ended at 0–2.3 % held-out accuracy under the async loop's lag of 1 and under stale
k 4 (its reference 50–54 %), while its engine mismatch was about 0.02. Its reverse KL to the
teacher rose from 0.35 to about 2 within 25 steps and stayed there. The reference run dips too
(55.1 % → 16.4 % at step 100, then back to 53.5 % at step 400), so the recipe (lr 5e-4,
advantages clipped to ±0.5, batch-mean baseline) is unstable early even on-policy. This probe
asks whether a smaller step removes the collapse under the lag. It is not part of the
comparison, changes none of its rules, and its one seed makes it a lead, not a result.

Variants (each one 400-step run, seed 0, the comparison's sampled-token arm from its shared
warm start; `--config.teacher.cache_dir` must name the comparison's teacher cache):
    repro        (the default) the comparison's run `opd_sampled__mode-async_max_lag-1`
                 (lr 5e-4), which must end where it did (2.3 % greedy) for the others to
                 compare with it
    async_lr2e-4, async_lr1e-4   the same under the lag at a smaller lr
    sync_lr2e-4,  sync_lr1e-4    the same lrs on-policy, to see that they still learn
Reading, fixed before the runs: a run *collapsed* when its final greedy accuracy is below
10 %. If neither smaller-lr run under the lag collapses while its on-policy twin learns
(ends above the 55.1 % warm start), the collapse is an instability of step size under
staleness; if both collapse, the step size is not the lever; anything else is unclear.

A second part, fixed after the first ran and before its own runs: the same reading on stale k 4
(the comparison's other collapse) and on the lag with train seed 1 (the comparison's seed-1 run
ended at 0.4 %), each with its own repro of the comparison's run:
    repro_stale4, stale4_lr2e-4, stale4_lr1e-4            rollout.stale_k = 4, seed 0
    repro_seed1, async_lr2e-4_seed1, async_lr1e-4_seed1   the lag of 1, train seed 1
with the on-policy twins of the first part (seed 0) standing for both. The first part's
verdict holds up if neither smaller-lr run collapses in either group.

Command (from a checkout of the comparison's commit, with this file copied outside it, so that
its runs are the comparison's code):
    PYTHONPATH=CHECKOUT/configs python -m opd_jax.main \\
        --config=COPY/opd_sampled_lag_probe.py:repro --workdir=/tmp/lag_probe/repro \\
        --config.teacher.cache_dir=/tmp/tcache
    (/tmp/tcache: a copy of docs/study/opd_vs_rl_learns/teacher_cache)
Cost:     about 90 s per run alone on 2 CPU cores.
Expected: ran once (docs/results/opd_vs_rl.md, "Sampled-token OPD under a one-step lag"):
          repro 2.3 % (as the comparison's run), async_lr2e-4 52.0 %, async_lr1e-4 56.6 %,
          sync_lr2e-4 57.0 %, sync_lr1e-4 57.8 % greedy at step 400 from a 55.1 % warm
          start: read as a step-size instability under staleness, on one seed. Part 2:
          stale k 4 collapsed at 5e-4 (0.0 %) and 2e-4 (0.8 %), learned at 1e-4 (51.2 %);
          the lag at seed 1 collapsed at 5e-4 (0.8 %), learned at 2e-4 (57.8 %) and 1e-4
          (60.5 %): the part-2 reading fails; the tolerated step shrinks with staleness.
"""

import grpo_practice

# variant: (lr, rollouts, train seed); rollouts "async" (the loop's lag of 1), "stale4"
# (rollout.stale_k = 4) or "sync" (on-policy)
RUNS = {
  "repro": (5e-4, "async", 0),
  "async_lr2e-4": (2e-4, "async", 0),
  "async_lr1e-4": (1e-4, "async", 0),
  "sync_lr2e-4": (2e-4, "sync", 0),
  "sync_lr1e-4": (1e-4, "sync", 0),
  "repro_stale4": (5e-4, "stale4", 0),
  "stale4_lr2e-4": (2e-4, "stale4", 0),
  "stale4_lr1e-4": (1e-4, "stale4", 0),
  "repro_seed1": (5e-4, "async", 1),
  "async_lr2e-4_seed1": (2e-4, "async", 1),
  "async_lr1e-4_seed1": (1e-4, "async", 1),
}
VARIANTS = tuple(RUNS)


def get_config(arg=None):
  """One variant of the probe (module docstring); no variant is `repro`."""
  arg = arg or "repro"
  if arg not in RUNS:
    raise ValueError(f"unknown variant {arg!r} of opd_sampled_lag_probe.py; known: {VARIANTS}")
  lr, rollouts, seed = RUNS[arg]
  c = grpo_practice.get_config("opd")
  # the comparison's sampled-token arm (experiments.opd_vs_rl_arms.SAMPLED_OPD, no correction)
  c.train.loss = "reverse_kl_sampled"
  c.train.lr = lr
  c.train.advantage_clip = 0.5
  c.train.advantage_baseline = "batch_mean"
  c.rollout.temperature = 1.0
  c.train.is_clip = 0.0
  if rollouts == "async":
    c.rollout.mode = "async"
    c.rollout.max_lag = 1
  elif rollouts == "stale4":
    c.rollout.stale_k = 4
  if seed:
    c.train.seed = seed  # as the comparison sets a run's seed other than 0
  return c
