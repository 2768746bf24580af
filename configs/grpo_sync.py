"""RL baseline: synchronous GRPO on the task's exact-match reward (`opd_jax/train/rl.py`).

The same run as `rl_sync.py` (teacher bootstrap, warm-started student, rollout engine identical
to the trainer) with REINFORCE replaced by GRPO: each of 8 prompts per step is sampled 4 times
(`rollout.samples_per_prompt`; 32 completions per step, as many as `bf16_sync.py` samples), a
row's advantage is its reward minus its group's mean, divided by the group's std, and the
batch is used for two PPO updates (`train.ppo_minibatches = 2` of 16 completions) with the
clip ε = 0.2 against π_old, the student at the start of the step. The engine-mismatch
correction (`train.mismatch_correction`: tis | mis | seq_tis | seq_mis, threshold
`train.mismatch_clip`) is off: with this engine π_old = π_b, and every correction reads 1.
Switch a mismatch source on to use one, e.g.
`--config.rollout.weights=fp8 --config.rollout.kv_cache=fp8 --config.train.mismatch_correction=tis`.
The reward is exact match (`train.reward`; `partial` gives credit for each right written step)
and there is no KL penalty to the initial student (`train.kl_coef` = β > 0 adds β times the k3
estimate of KL(π_θ ‖ π_step0) at the sampled tokens, at the cost of one more copy of the
student's params and one more forward pass per step). See docs/rl_baseline.md.

Command:  python -m opd_jax.main --config=configs/grpo_sync.py --workdir=/tmp/grpo_ref
Tiny:     python -m opd_jax.main --config=configs/grpo_sync.py:tiny --workdir=/tmp/grpo_tiny
          (about 30 s on 2 CPU cores; its student never answers right, so every advantage
          is 0: it checks the wiring, not learning).
Expected: no learning on the built-in task. The warm-started student starts at 43.8 % greedy
          held-out accuracy. Measured at the OPD-against-RL reference (400 steps, 256 held-out
          prompts): lr 3e-6, 1e-5 and 3e-5 end at 43.4, 40.2 and 37.1 %, lr 1e-4 collapses to
          6.6 %; with partial credit 42.2 % (1e-5) and 34.8 % (3e-5); 2000 steps at 3e-6 (exact)
          or 1e-5 (partial) end at 42.6 and 41.8 % while the sampled reward rises from 0.12 to
          0.14 and from 0.16 to 0.19. Groups of 8 or 16 at T = 0.7 (10-24 % of groups without
          signal instead of 61 %) end at 42.2 and 46.9 %, 128 completions per step at 46.9 %,
          and a KL penalty β = 0.1 changes neither (docs/results/opd_vs_rl.md, "GRPO: the
          sweep"). On a smaller model and a two-operand task GRPO does raise the
          training reward (tests/train/test_grpo.py, the slow learning check).
"""

import base

VARIANTS = ("tiny",)


def get_config(arg=None):
  """The GRPO reference config; `arg="tiny"` gives the seconds-long wiring check."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of grpo_sync.py; known: {', '.join(VARIANTS)}")
  c = base.get_config(arg)
  c.rollout.weights = "trainer"  # engine identical to the trainer
  c.rollout.kv_cache = "auto"  # the engine's compute dtype
  c.rollout.mode = "sync"  # sample, then train
  c.rollout.temperature = 1.0  # on-policy sampling
  c.rollout.samples_per_prompt = 4  # G: completions per prompt, the group of the baseline
  c.data.batch_size = 4 if arg == "tiny" else 8  # prompts per step (x G completions)
  c.train.loss = "grpo"  # group baseline, PPO clip (opd_jax/train/rl.py)
  c.train.group_std_normalize = True  # A ÷ (group std + 1e-6)
  c.train.ppo_clip = 0.2  # ε
  c.train.ppo_epochs = 1  # passes over each batch
  c.train.ppo_minibatches = 2  # two updates per step, so π_θ/π_old ≠ 1 in the second
  c.train.mismatch_correction = "none"  # the engine is the trainer: nothing to correct
  c.train.mismatch_clip = 2.0  # C of a correction when one is switched on
  c.train.reward = "exact_match"  # 1 for the right answer, else 0 (partial: per right step too)
  c.train.kl_coef = 0.0  # β of the KL penalty to the initial student: off
  c.train.lr = 1e-5  # peak AdamW lr: unmeasured (1e-4 collapsed this student; docstring)
  return c
