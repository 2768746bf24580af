"""GRPO's learning rate against its completions per step, from the warm start OPD shares
(`python -m opd_jax.sweep`), then the selected arm against OPD over five fresh seeds.

Fixed before any of its runs (issue "An RL baseline that learns"):

Stage 1, the sweep (default variant), seed 0, 400 steps each, every arm from the same
475-step warm start (`grpo_practice.py`: groups of 8, one on-policy update per batch, 20-step
lr warmup, no KL penalty, T = 1):

    grpo_lr1e5_n128   lr 1e-5, 16 prompts × 8 = 128 completions per step (the placeholder)
    grpo_lr3e5_n128   lr 3e-5, 128
    grpo_lr1e4_n128   lr 1e-4, 128
    grpo_lr1e5_n256   lr 1e-5, 32 × 8 = 256
    grpo_lr3e5_n256   lr 3e-5, 256
    grpo_lr1e4_n256   lr 1e-4, 256
    grpo_partial_lr3e5_n128, grpo_partial_lr1e4_n128
                      the same with the partial-credit reward (`train.reward=partial`: each
                      right written step earns a share, `opd_jax/data/rewards.py`)
    opd               the OPD arm (`grpo_practice.py:opd`), the reference

Selection rule: of the GRPO arms, the one with the largest T = 1 held-out accuracy gain at
step 400 (`select_metric`; ties: the earlier arm). Stage 2 (`:confirm`) trains that arm
(CONFIRM_ARM below, filled in from stage 1's report by this rule and committed before stage
2's first run) and `opd` on seeds 1-5, which stage 1 never saw.

Primary metric: the share of OPD's gain the selected GRPO arm reaches in T = 1 accuracy at
step 400, (mean_s a_s − w) / (mean_s o_s − w) over the 5 seeds, with its percentile bootstrap
interval (`stats.gain_kept`); the greedy share and the gain at OPD's training wall time are
reported beside it. The goal (RL gains at least half of what OPD gains) reads as met when the
point estimate is ≥ 0.5, and as shown when the interval's lower end is too. Reported as found.

Stage 1b (`:step`), added after stage 1 and fixed before its runs: stage 1's best arm sat at
its largest batch and lr, and per-step credit (`train.reward=step`: each written step's tokens
get that step's correctness, with a group baseline per step) landed after stage 1 was fixed.
Seed 0, 400 steps, with its own OPD run (the code changed since stage 1):

    grpo_step_lr3e5_n128, grpo_step_lr1e4_n128, grpo_step_lr1e4_n256
                      per-step credit at lr 3e-5 / 1e-4, 128 / 256 completions per step
    grpo_lr1e4_n512   exact match, lr 1e-4, 64 × 8 = 512 completions per step

Rule 1b: the stage-1b arm with the largest T = 1 gain goes to stage 2b (`:confirm_step`, the
arm set in CONFIRM_STEP_ARM, seeds 1-5 against OPD retrained in its own workdir) only when its
seed-0 gain exceeds stage 1's selected arm's (+9.0 T = 1 points); otherwise stage 2 stands as
the primary result and stage 1b is reported as the sweep's extension.

Command:  python -m opd_jax.sweep --config=configs/grpo_sweep.py --workdir=/tmp/grpo_sweep \
              --config.teacher_cache_dir=/tmp/tcache
          python -m opd_jax.sweep --config=configs/grpo_sweep.py:confirm \
              --workdir=/tmp/grpo_confirm --config.teacher_cache_dir=/tmp/tcache
          (`:step` and `:confirm_step` the same, each in its own workdir)
Tiny:     python -m opd_jax.sweep --config=configs/grpo_sweep.py:tiny --workdir=/tmp/sweep_tiny
          (two arms of seconds-long wiring runs; no learning).
Cost:     on 2 CPU cores, with the teacher and warm start cached (the first run makes them:
          about 8 minutes once): a 128-completion GRPO run about 100 s, a 256-completion run
          about twice that, an OPD run about 50 s; stage 1 about 17 minutes, stage 2 about 15.
Expected: docs/results/opd_vs_rl.md ("GRPO that learns"). Over seeds 1-5 the T = 1 share of
          OPD's gain: stage 2 (grpo_lr1e4_n256) 0.27 [0.23, 0.32]; stage 2b (grpo_lr1e4_n512)
          0.41 [0.35, 0.47]; neither reaches the goal of 0.5.
"""

import grpo_practice
import ml_collections

VARIANTS = ("confirm", "step", "confirm_step", "tiny")
STAGES = {
  None: "stage 1",
  "confirm": "stage 2",
  "step": "stage 1b",
  "confirm_step": "stage 2b",
  "tiny": "the wiring check",
}
SWEEP_SEEDS = (0,)
CONFIRM_SEEDS = (1, 2, 3, 4, 5)
# stage 1's selection by the rule (its report: T = 1 gain +9.0 points, the next +4.3), set
# before stage 2's first run
CONFIRM_ARM = "grpo_lr1e4_n256"
# name -> (lr, prompts per step (× 8 completions), reward)
GRPO_ARMS = {
  "grpo_lr1e5_n128": (1e-5, 16, "exact_match"),
  "grpo_lr3e5_n128": (3e-5, 16, "exact_match"),
  "grpo_lr1e4_n128": (1e-4, 16, "exact_match"),
  "grpo_lr1e5_n256": (1e-5, 32, "exact_match"),
  "grpo_lr3e5_n256": (3e-5, 32, "exact_match"),
  "grpo_lr1e4_n256": (1e-4, 32, "exact_match"),
  "grpo_partial_lr3e5_n128": (3e-5, 16, "partial"),
  "grpo_partial_lr1e4_n128": (1e-4, 16, "partial"),
}
STEP_ARMS = {  # stage 1b (docstring)
  "grpo_step_lr3e5_n128": (3e-5, 16, "step"),
  "grpo_step_lr1e4_n128": (1e-4, 16, "step"),
  "grpo_step_lr1e4_n256": (1e-4, 32, "step"),
  "grpo_lr1e4_n512": (1e-4, 64, "exact_match"),
}
STAGE1_BEST_T1_GAIN = 0.090  # stage 1's selected arm, seed 0: what a stage-1b arm must exceed
# stage 1b's selection by rule 1b (its report: T = 1 gain +10.2 points > +9.0), set before
# stage 2b's first run
CONFIRM_STEP_ARM = "grpo_lr1e4_n512"


def grpo_arm(lr: float, prompts: int, reward: str, tiny: bool = False) -> ml_collections.ConfigDict:
  """grpo_practice.py's GRPO run at peak lr `lr`, `prompts` × 8 completions per step."""
  c = grpo_practice.get_config("tiny" if tiny else None)
  c.train.lr = lr
  c.data.batch_size = 2 if tiny else prompts
  c.train.reward = reward
  return c


def get_config(arg=None):
  """Stage 1 (default), stage 2 `:confirm`, stage 1b `:step`, stage 2b `:confirm_step` (OPD
  alone until CONFIRM_STEP_ARM is set), or `:tiny`."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of grpo_sweep.py; known: {', '.join(VARIANTS)}")
  tiny = arg == "tiny"
  table = {**GRPO_ARMS, **STEP_ARMS}
  names = {
    None: tuple(GRPO_ARMS),
    "confirm": (CONFIRM_ARM,),
    "step": tuple(STEP_ARMS),
    "confirm_step": (CONFIRM_STEP_ARM,) if CONFIRM_STEP_ARM else (),
    "tiny": tuple(GRPO_ARMS)[:1],
  }[arg]
  c = ml_collections.ConfigDict()
  c.arms = ml_collections.ConfigDict()
  for name in names:
    c.arms[name] = grpo_arm(*table[name], tiny=tiny)
  c.arms.opd = grpo_practice.get_config("opd_tiny" if tiny else "opd")
  c.teacher_cache_dir = ""  # every arm's teacher.cache_dir ("" = <workdir>/teacher_cache)
  c.seeds = CONFIRM_SEEDS if arg in ("confirm", "confirm_step") else SWEEP_SEEDS
  c.reference_arm = "opd"
  c.select_from = names
  c.select_metric = "quality/student_accuracy_t1"
  c.allow_mixed_code = False
  c.summary = (
    f"{STAGES[arg]} of configs/grpo_sweep.py: GRPO arms against OPD from the shared warm "
    f"start, {c.arms.opd.train.steps} steps"
  )
  return c
