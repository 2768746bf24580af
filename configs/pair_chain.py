"""The third student–teacher pair of the calibration table: the embedded models' shapes on the
long-completion task (a counted chain of additions, `data.task = "chain"`), where KV-cache
error has many positions to accumulate over.

    python -m opd_jax.main --config=configs/pair_chain.py --workdir=/tmp/pair_chain
    python -m opd_jax.calibrate --config=configs/pair_chain.py --workdir=/tmp/cal_chain \
      --quick --run-steps=200 --candidate=rollout.kv_cache=fp8,rollout.kv_granularity=tensor

A prompt `a+d*n=` with n = 8 steps asks for a + d·n; the completion writes every step,
"8:45;7:53;...;1:101>101", 43-52 tokens with its eos (the sum task's are 21-25). The teacher is
bootstrapped on this task (its own cache entry), the student warm-started on it; rollouts may
write 72 tokens. Expected: the teacher's and student's accuracies and the calibrated limits are
in docs/results/calibration.md.
"""

import bf16_sync

VARIANTS = ("tiny",)
CHAIN_STEPS = 8


def get_config(arg=None):
  """The pair's run config; `arg="tiny"` gives the seconds-long wiring check."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of pair_chain.py; known: {', '.join(VARIANTS)}")
  c = bf16_sync.get_config(arg)
  c.tokenizer = "char"
  c.data.task = "chain"
  c.data.num_operands = CHAIN_STEPS
  c.rollout.max_new_tokens = 72
  return c
