"""The main job: FP8 rollouts sampled asynchronously, one version ahead of the trainer.

The rollout engine holds FP8 (e4m3) weights with per-output-channel scales, except
the layers the per-layer recipe keeps in BF16, and an FP8 KV cache with one scale
per layer and sequence (`tensor`: the granularity that holds the most tokens, 2× the
BF16 tokens). A producer thread samples batch t + 1 with θ_t, and scores it with the
frozen teacher, while the trainer updates on batch t (`max_lag=1`), so every trained
batch is at most one version old.
Everything else (task, models, loss, steps) is `bf16_sync.py`, the reference this
run is compared with (`python -m opd_jax.bench.async_vs_sync`).

Command:  python -m opd_jax.main --config=configs/fp8_async.py --workdir=runs/fp8_async
Expected: on 2 CPU cores about 6 minutes the first time (3 of them bootstrapping the
          teacher, cached under the workdir); the student goes from 43.4% held-out
          accuracy after its warm start to 96.9% after 1,000 OPD steps (teacher 95.3%; at
          least 95% on any CPU, `teacher.target_accuracy`),
          reaching 90% of the teacher 1.18x sooner than bf16_sync.py
          (docs/results/main_job.md, mean of 3 seeds).
Tiny:     python -m opd_jax.main --config=configs/fp8_async.py:tiny --workdir=/tmp/fp8_tiny

On CPU, XLA emulates e4m3, so this run shows the mismatch FP8 and staleness add and
that OPD keeps its quality under them; the FP8 speed-up needs FP8 matmuls (H100/H200,
recent TPUs). The async overlap works on any backend.
"""

import base

VARIANTS = ("tiny",)


def get_config(arg=None):
  """FP8 weights and KV cache, async rollouts with max_lag=1; `arg="tiny"` for tests."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of fp8_async.py; known: {', '.join(VARIANTS)}")
  c = base.get_config(arg)
  c.rollout.weights = "fp8"
  c.rollout.weight_block_size = 0  # per-output-channel scales
  # The per-layer recipe: layer 0 stays BF16, the layer whose FP8 weights add the most
  # teacher-forced KL on the reference student (docs/history.md).
  c.rollout.bf16_layers = () if arg == "tiny" else (0,)  # tiny has one layer: all FP8
  c.rollout.kv_cache = "fp8"
  c.rollout.kv_granularity = "tensor"  # one scale per layer and sequence: the most tokens
  c.rollout.kv_bf16_layers = ()
  c.rollout.mode = "async"
  c.rollout.max_lag = 1
  c.rollout.stale_policy = "drop"
  c.rollout.score_teacher = True  # the producer also runs the teacher: it overlaps training
  return c
