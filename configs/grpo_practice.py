"""GRPO as practitioners run it, from a stronger warm start shared with OPD.

The synchronous GRPO run of `grpo_sync.py` in the regime RL with verifiable rewards is used in:
a student warm-started for 475 supervised steps (`student.warmup_steps`), groups of G = 8
completions of each of 16 prompts (128 completions per step), plain on-policy updates (one
update per batch: π_old = sg(π_θ), so the PPO ratio is exactly 1 and the clip never acts), the
exact-match reward, no KL penalty, and a learning rate with a linear warmup of 20 steps. The lr
1e-5 is a placeholder inside the range the 250-step warm start trained stably at (3e-6 to
3e-5; 1e-4 collapsed it): it is to be swept against the completions per step. Every
evaluation reports the held-out accuracy at T = 1 (one sample per prompt,
`quality/student_accuracy_t1`) beside the greedy one (`quality/student_accuracy`), for GRPO
and for the OPD arm `:opd`, which trains the same warm start with the reference OPD run
(`bf16_sync.py`: full-vocabulary reverse KL to the teacher, 32 completions per step, lr 1e-3).

The warm start. Its greedy / T = 1 held-out accuracy (256 prompts, seed 0; the teacher
95.3 %) after N supervised steps, each N its own lr schedule: 300: 10.2 / 2.3 %, 350: 11.7 /
5.9 %, 400: 38.3 / 19.5 %, 450: 55.9 / 30.5 %, 475: 55.9 / 34.4 %, 500: 94.9 / 69.9 %.
500 steps leave OPD no greedy headroom (0.4 points to the teacher), so the shared start is
475: 39 points of greedy headroom, and at T = 1 a group of 8 fails entirely with probability
about 0.66⁸ ≈ 4 %.

Command:  python -m opd_jax.main --config=configs/grpo_practice.py --workdir=/tmp/grpo_practice \
              --config.teacher.cache_dir=/tmp/tcache
          python -m opd_jax.main --config=configs/grpo_practice.py:opd --workdir=/tmp/opd_practice \
              --config.teacher.cache_dir=/tmp/tcache
Tiny:     python -m opd_jax.main --config=configs/grpo_practice.py:tiny --workdir=/tmp/gp_tiny
          (about 25 s of CPU, most of it compilation: a wiring check, not learning).
Step credit: add --config.train.reward=step (to either GRPO command) for per-step credit: each
          written step's tokens get that step's correctness as their return, with GRPO's
          group baseline per step (docs/rl_baseline.md); rl/reward_mean stays exact match and
          rl/step_reward_mean logs the mean step credit. Swept in `grpo_sweep.py:step`.
Cost:     measured on 2 CPU cores shared with other jobs: the teacher bootstrap 7.5 minutes
          once (cached in teacher.cache_dir), the 475-step warm start 35-50 s (then cached
          beside it), a GRPO step at 128 completions about 0.2 s; a whole 400-step run with its
          5 evaluations (greedy and T = 1, 256 prompts) 101 s for GRPO and 46 s for `:opd`
          (32 completions per step).
Expected: one seed (seed 0), greedy / T = 1 held-out accuracy at steps 0, 100, ..., 400:
          GRPO (lr 1e-5)  55.9 / 34.4, 52.7 / 34.8, 56.6 / 35.5, 58.2 / 36.3, 58.2 / 37.9 %
          OPD (:opd)      55.9 / 34.4, 24.2 / 17.6, 41.0 / 29.3, 67.2 / 48.0, 81.6 / 67.2 %
          lr 1e-4         55.9 / 34.4, 42.2 / 31.6, 44.5 / 30.5, 52.3 / 35.5, 55.5 / 36.7 %
          lr 3e-4         collapses: 1.2 / 0.8 % at step 100, 1.2 / 0.8 % at 400
          so at the placeholder lr GRPO gains +2.3 greedy / +3.5 T = 1 points where OPD gains
          +25.7 / +32.8, in about twice OPD's wall time. The sweep (`grpo_sweep.py`) raised it to
          +11.7 T = 1 points over 5 seeds (lr 1e-4, 512 completions per step): 0.41 of OPD's
          gain (docs/results/opd_vs_rl.md, "GRPO that learns").
"""

import bf16_sync
import grpo_sync

VARIANTS = ("tiny", "opd", "opd_tiny")
WARMUP_STEPS = 475  # the warm start every arm shares (student.warmup_steps; docstring)


def get_config(arg=None):
  """GRPO in practice; `:opd` the OPD arm from the same warm start, `:tiny` and `:opd_tiny`
  their seconds-long wiring checks."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of grpo_practice.py; known: {', '.join(VARIANTS)}")
  tiny = arg in ("tiny", "opd_tiny")
  if arg in ("opd", "opd_tiny"):
    c = bf16_sync.get_config("tiny" if tiny else None)
  else:
    c = grpo_sync.get_config("tiny" if tiny else None)
    c.rollout.samples_per_prompt = 8  # G: groups of 8
    c.data.batch_size = 2 if tiny else 16  # prompts per step: 16 × 8 = 128 completions
    c.train.ppo_epochs = 1  # one pass
    c.train.ppo_minibatches = 1  # one update per batch: ratio 1, plain on-policy
    c.train.lr = 1e-5  # peak AdamW lr: a placeholder, to be swept (docstring)
    c.train.warmup_steps = 20  # linear lr warmup
  c.student.warmup_steps = 5 if tiny else WARMUP_STEPS
  c.train.eval_sampled = True  # quality/student_accuracy_t1 beside the greedy accuracy
  if not tiny:
    c.train.steps = 400
    c.train.eval_every = 100
    c.train.log_every = 5
    c.train.checkpoint_every = 200
  return c
