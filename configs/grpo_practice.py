"""GRPO as practitioners run it, from a stronger warm start shared with OPD.

The synchronous GRPO run of `grpo_sync.py` in the regime RL with verifiable rewards is used in:
a student warm-started for 500 supervised steps (`student.warmup_steps`; the task reports
about 75 % greedy accuracy after 500), groups of G = 8 completions of each of 16 prompts (128
completions per step), plain on-policy updates (one update per batch: π_old = sg(π_θ), so the
PPO ratio is exactly 1 and the clip never acts), the exact-match reward, no KL penalty, and a
learning rate with a linear warmup of 20 steps. The lr 1e-5 is a placeholder inside the range
the 250-step warm start trained stably at (3e-6 to 3e-5; 1e-4 collapsed it): it is to be swept
against the completions per step. Every evaluation reports the held-out accuracy at T = 1
(one sample per prompt, `quality/student_accuracy_t1`) beside the greedy one
(`quality/student_accuracy`), for GRPO and for the OPD arm `:opd`, which trains the same warm
start with the reference OPD run (`bf16_sync.py`: full-vocabulary reverse KL to the teacher,
32 completions per step, lr 1e-3).

Command:  python -m opd_jax.main --config=configs/grpo_practice.py --workdir=/tmp/grpo_practice \
              --config.teacher.cache_dir=/tmp/tcache
          python -m opd_jax.main --config=configs/grpo_practice.py:opd --workdir=/tmp/opd_practice \
              --config.teacher.cache_dir=/tmp/tcache
Tiny:     python -m opd_jax.main --config=configs/grpo_practice.py:tiny --workdir=/tmp/gp_tiny
          (about 40 s on 2 CPU cores, most of it compilation: a wiring check, not learning).
Cost:     measured on 2 CPU cores: the teacher bootstrap about 5 minutes once (cached in
          teacher.cache_dir), the 500-step warm start about 1.5 minutes, a GRPO step at 128
          completions about 1.1 s, so the 400 steps with 5 evaluations of 256 prompts (greedy
          and T = 1) take about 10 minutes per run.
Expected: not yet measured beyond the pilot. The issue's goal: GRPO gains at least half of
          what OPD gains from this warm start in the same wall time (mean over 5 seeds); with
          the placeholder lr that is a hypothesis, the sweep decides it.
"""

import bf16_sync
import grpo_sync

VARIANTS = ("tiny", "opd", "opd_tiny")
WARMUP_STEPS = 500  # the warm start every arm shares (student.warmup_steps)


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
