"""Peak memory of the train step under `train.remat` and `train.microbatches`.

Command (compiles only, nothing is allocated):

    python -m opd_jax.bench.remat            # readable table
    python -m opd_jax.bench.remat --json     # {"shape": {...}, "rows": [...]} on stdout only

Each row compiles the jitted `train_step.train_step` (student forward and backward, the
teacher's forward, AdamW update, state donated) for abstract inputs of one shape, and
reads XLA's buffer assignment from `jax.jit(...).lower(...).compile().memory_analysis()`:

* `temp_bytes`: the step's scratch memory (activations kept for the backward pass,
  gradients, logits), the part remat and micro-batches change;
* `argument_bytes`, `output_bytes`: state, teacher and rollout in, state out (the same for
  every row);
* `temp_vs_none`: temp_bytes over the remat="none", K=1 row's.

The numbers are the compiler's plan for the backend it runs on (CPU by default); on an
accelerator the same command gives that backend's plan. Measured plans:
docs/results/main_job.md ("Training controls").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

if TYPE_CHECKING:  # annotations only: --help imports no JAX
  from opd_jax.data.rollout_types import Rollout
from opd_jax.model.config import ModelConfig

# Small but not tiny: 8 layers, so that what each layer keeps for the backward pass counts.
BENCH_CONFIG = ModelConfig(
  model_type="qwen3",
  vocab_size=2048,
  hidden_size=256,
  intermediate_size=1024,
  num_layers=8,
  num_heads=8,
  num_kv_heads=4,
  head_dim=32,
  qk_norm=True,
)
BATCH, PROMPT, COMPLETION = 16, 32, 96  # rows, prompt width P, completion length C
ROWS = [("none", 1), ("layer", 1), ("dots", 1), ("dots_no_batch", 1), ("none", 4), ("layer", 4)]


def abstract_rollout(batch: int, prompt: int, completion: int) -> Rollout:
  """Shapes and dtypes of a sampled batch (no teacher logits: the step scores the teacher)."""
  import jax
  import jax.numpy as jnp

  from opd_jax.data.rollout_types import Rollout

  i32, f32 = jnp.int32, jnp.float32
  s = jax.ShapeDtypeStruct
  return Rollout(
    prompt_tokens=s((batch, prompt), i32),
    prompt_lens=s((batch,), i32),
    completion_tokens=s((batch, completion), i32),
    completion_mask=s((batch, completion), i32),
    behaviour_logprobs=s((batch, completion), f32),
    model_logprobs=s((batch, completion), f32),
    weight_version=s((), i32),
  )


def measure(remat: str, microbatches: int, cfg: ModelConfig = BENCH_CONFIG) -> dict:
  """The compiled step's memory analysis for one setting, as a row."""
  import jax

  from opd_jax.model import transformer as model
  from opd_jax.train import state as train_state
  from opd_jax.train import train_step

  tx = train_state.make_optimizer(1e-3, 100, 10, 0.0, 1.0)
  params = jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg))
  state = jax.eval_shape(lambda p: train_state.init_state(p, tx, 0), params)
  fn = jax.jit(
    lambda s, t, r: train_step.train_step(
      s,
      t,
      r,
      tx=tx,
      student_cfg=cfg,
      teacher_cfg=cfg,
      loss_cfg=train_step.LossConfig("reverse_kl_sampled"),
      microbatches=microbatches,
      remat=remat,
    ),
    donate_argnums=0,
  )
  compiled = fn.lower(state, params, abstract_rollout(BATCH, PROMPT, COMPLETION)).compile()
  mem = compiled.memory_analysis()
  return {
    "remat": remat,
    "microbatches": microbatches,
    "temp_bytes": int(mem.temp_size_in_bytes),
    "argument_bytes": int(mem.argument_size_in_bytes),
    "output_bytes": int(mem.output_size_in_bytes),
  }


def run(rows=ROWS) -> list[dict]:
  out = [measure(remat, k) for remat, k in rows]
  base = next(r["temp_bytes"] for r in out if r["remat"] == "none" and r["microbatches"] == 1)
  for r in out:
    r["temp_vs_none"] = r["temp_bytes"] / base
  return out


def main(argv=None) -> int:
  args = runner.parse_own_flags(cli_flags.define_json_flag, argv, __doc__)
  import jax

  rows = run()
  c = BENCH_CONFIG
  shape = {
    "layers": c.num_layers,
    "hidden": c.hidden_size,
    "mlp": c.intermediate_size,
    "heads": f"{c.num_heads}/{c.num_kv_heads}x{c.head_dim}",
    "vocab": c.vocab_size,
    "batch": BATCH,
    "tokens": PROMPT + COMPLETION,
    "backend": jax.default_backend(),
  }
  if args.json:
    json_file.write_text(args.json, json.dumps({"shape": shape, "rows": rows}))
    if args.json == "-":
      return 0
  print(f"train step, {shape}")
  print(f"{'remat':>14} {'K':>3} {'temp MiB':>10} {'vs none':>8} {'args MiB':>9}")
  for r in rows:
    print(
      f"{r['remat']:>14} {r['microbatches']:>3} {r['temp_bytes'] / 2**20:>10.1f} "
      f"{r['temp_vs_none']:>8.2f} {r['argument_bytes'] / 2**20:>9.1f}"
    )
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
