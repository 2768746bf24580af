"""A second student–teacher pair that differs from the embedded one in the student's shape: a
deeper, narrower Qwen3 student (4 layers, D = 96, 3 query heads and 1 KV head of 32, SwiGLU
width 288) distilled from the chain task's 4-layer D = 128 teacher (`pair_chain.py`'s), on the
long-completion chain task (8 steps, 50-62 tokens), where KV-cache error has that many
positions to accumulate over.

    python -m opd_jax.main --config=configs/pair_deep.py --workdir=/tmp/pair_deep \
        --config.teacher.cache_dir=/tmp/tcache

Against the embedded student (2 layers, D = 128, 4 query / 2 KV heads) it has twice the layers
for per-layer error to compound through, a quarter of the KV heads per query head (grouped
attention 3:1 against 2:1) and 0.75 of the width. It keeps the embedded pair's warm start (250
supervised steps at 1e-3) and OPD settings (`bf16_sync.py`), and the chain teacher's cache.
Expected (seed 0, 2 CPU cores): the chain teacher's bootstrap about 9 minutes once, then the
student from 17.2 % after its warm start to 100 % (the teacher's 100 %) on 256 held-out
prompts after 1,000 steps, held-out KL(student ‖ teacher) 1.04 → 0.0013; about 6 minutes of
OPD. So it reaches 90 % of its teacher; the chain task is easy at the full length, and the
second pair's ladders are to show whether realistic sources cost it quality at all.
"""

import base
import pair_chain

VARIANTS = ("tiny",)


def get_config(arg=None):
  """The pair's run config; `arg="tiny"` gives the seconds-long wiring check."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of pair_deep.py; known: {', '.join(VARIANTS)}")
  c = pair_chain.get_config(arg)
  if arg != "tiny":
    c.student.arch = base.model_arch(4, 96, 3, 1, 32, 288)
  else:
    c.student.arch = base.model_arch(2, 32, 2, 1, 16, 64)
  return c
