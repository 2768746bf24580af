"""The second student–teacher pair of the calibration table: a Llama-shaped 4-layer student
with a wide MLP, distilled from the embedded 4-layer teacher.

    python -m opd_jax.main --config=configs/pair_llama4.py --workdir=/tmp/pair_llama4
    python -m opd_jax.calibrate --config=configs/pair_llama4.py --workdir=/tmp/cal_llama4 \
      --quick --run-steps=200

The student is `model_type = "llama"` (no QK norm), 4 layers, D = 128 with 4 query and 2 KV
heads of 32, and a SwiGLU width of 768 (6 D, against the embedded student's and the teacher's
3 D): twice the embedded student's depth, so per-layer error has more layers to compound
through. It is warm-started for 400 supervised steps at 3e-3, the teacher's rate: with the
embedded student's 250 steps at 1e-3 it started at 4.7% and fell to 1% over 200 OPD steps (and a
narrower one, D = 64 with F = 512, started at 1.2%), too far from the teacher to calibrate
on. The teacher, task and OPD settings are `bf16_sync.py`'s, so the teacher cache is shared
with the embedded pair. Expected: the same teacher as `bf16_sync.py`; the student's accuracy
after its warm start and after OPD, and its calibrated limits, are in
docs/results/calibration.md.
"""

import base
import bf16_sync

VARIANTS = ("tiny",)


def get_config(arg=None):
  """The pair's run config; `arg="tiny"` gives the seconds-long wiring check."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of pair_llama4.py; known: {', '.join(VARIANTS)}")
  c = bf16_sync.get_config(arg)
  c.tokenizer = "char"
  if arg != "tiny":
    c.student.arch = base.model_arch(4, 128, 4, 2, 32, 768)
  c.student.arch.model_type = "llama"
  if arg != "tiny":  # the deeper student, warm-started at the teacher's rate (see the docstring)
    c.student.warmup_steps = 400
    c.student.warmup_lr = 3e-3
  return c
