"""Full versus sparse teacher (`train.teacher_top_k`): step time and memory at V = 32k, 150k.

Command:

    python -m opd_jax.bench.sparse_teacher            # readable table
    python -m opd_jax.bench.sparse_teacher --json     # {"shape": {...}, "rows": [...]} only

A tiny-depth, tiny-width decoder (so that the vocabulary dominates, as it does for the
logits of a real model) with a small batch. For each vocabulary V and each teacher
source it compiles the jitted `train_step.train_step` (student forward and backward,
AdamW, state donated) twice, with the full teacher (k = 0) and with the top-k teacher:

* `step`: the step runs the teacher's forward pass itself (`rollout.score_teacher` off);
* `engine`: the rollout engine scored the teacher (`rollout.score_teacher`): the step
  receives [B, C, V] logits (full) or the [B, C, k] top-k plus tail (sparse) as input.
  The engine's own scoring program (`teacher_forcing.sharded_completion_logits` versus
  `rollout_worker.sparse_teacher`) is timed as its own row, `engine_scoring`, since the top-k
  moves there.

Per row: `temp_bytes` and `argument_bytes` from the compiled program's
`memory_analysis()` (XLA's buffer plan, as `bench/remat.py` reads it), the median wall
time of `--repeats` calls after one warm-up call, and the sparse/full ratios of all
three. The loss is `forward_kl` (GKD's, where top-k teachers are usual), `--loss` to change.

Measured figures: docs/results/benchmarks.md ("A top-k teacher against the full one").
"""

from __future__ import annotations

import json
import statistics
import time
from typing import TYPE_CHECKING

import numpy as np
from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

if TYPE_CHECKING:  # annotations only: --help imports no JAX
  from opd_jax.data.rollout_types import Rollout
from opd_jax.model.config import ModelConfig

VOCABS = (32768, 151936)  # 32k (Llama 2), Qwen2.5's 151,936 embedding rows
TOP_K = 64
BATCH, PROMPT, COMPLETION = 4, 16, 32  # rows, prompt width P, completion length C


def bench_config(vocab: int) -> ModelConfig:
  """One small decoder layer, D = 64, tied embeddings: the vocabulary dominates."""
  return ModelConfig(
    model_type="qwen3",
    vocab_size=vocab,
    hidden_size=64,
    intermediate_size=128,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    tie_word_embeddings=True,
  )


def make_rollout(vocab: int, seed: int = 0) -> Rollout:
  """A batch of random prompt and completion tokens (all counted)."""
  import jax.numpy as jnp

  from opd_jax.data.rollout_types import Rollout

  rng = np.random.default_rng(seed)
  i32 = jnp.int32
  return Rollout(
    prompt_tokens=jnp.asarray(rng.integers(0, vocab, (BATCH, PROMPT)), i32),
    prompt_lens=jnp.full((BATCH,), PROMPT, i32),
    completion_tokens=jnp.asarray(rng.integers(0, vocab, (BATCH, COMPLETION)), i32),
    completion_mask=jnp.ones((BATCH, COMPLETION), i32),
    behaviour_logprobs=jnp.full((BATCH, COMPLETION), -1.0, jnp.float32),
    model_logprobs=jnp.full((BATCH, COMPLETION), -1.0, jnp.float32),
    weight_version=jnp.zeros((), i32),
  )


def _timed(fn, args, repeats: int, feed_state: bool) -> float:
  """Median seconds of `repeats` calls after one warm-up (the state fed back when donated)."""
  import jax

  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    if feed_state:
      args = (out[0], *args[1:])
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _memory(compiled) -> dict:
  mem = compiled.memory_analysis()
  return {
    "temp_bytes": int(mem.temp_size_in_bytes),
    "argument_bytes": int(mem.argument_size_in_bytes),
  }


def measure_step(cfg, params, teacher, rollout, loss: str, top_k: int, repeats: int) -> dict:
  """The train step with the full (top_k = 0) or sparse teacher: memory plan and time."""
  import jax
  import jax.numpy as jnp

  from opd_jax.train import state as train_state
  from opd_jax.train import train_step

  tx = train_state.make_optimizer(1e-4, 100, 0, 0.0, 1.0)
  loss_cfg = train_step.LossConfig(loss, is_clip=None, teacher_top_k=top_k)
  fn = jax.jit(
    lambda s, t, r: train_step.train_step(
      s, t, r, tx=tx, student_cfg=cfg, teacher_cfg=cfg, loss_cfg=loss_cfg
    ),
    donate_argnums=0,
  )
  state = train_state.init_state(jax.tree.map(jnp.copy, params), tx, 0)
  row = _memory(fn.lower(state, teacher, rollout).compile())
  row["seconds"] = _timed(fn, (state, teacher, rollout), repeats, feed_state=True)
  return row


def measure_scoring(cfg, teacher, rollout, top_k: int, repeats: int) -> dict:
  """The engine's teacher scoring: full logits, or the top-k plus tail in one program."""
  import jax

  from opd_jax.inference import teacher_forcing
  from opd_jax.rollout import worker as rollout_worker

  if top_k:
    fn = jax.jit(lambda t, r: rollout_worker.sparse_teacher(t, r, cfg, None, top_k, 1.0))
  else:
    fn = jax.jit(lambda t, r: teacher_forcing.sharded_completion_logits(t, r, cfg)[0])
  row = _memory(fn.lower(teacher, rollout).compile())
  row["seconds"] = _timed(fn, (teacher, rollout), repeats, feed_state=False)
  out = fn(teacher, rollout)
  row["output_bytes"] = sum(x.nbytes for x in jax.tree.leaves(out))
  return row


def run(vocabs=VOCABS, top_k: int = TOP_K, loss: str = "forward_kl", repeats: int = 5) -> list:
  import jax
  import jax.numpy as jnp

  from opd_jax.inference import teacher_forcing
  from opd_jax.model import teacher_topk
  from opd_jax.model import transformer as model

  rows = []
  for vocab in vocabs:
    cfg = bench_config(vocab)
    student = model.init_params(jax.random.key(1), cfg, jnp.float32, scale=0.5)
    teacher = model.init_params(jax.random.key(2), cfg, jnp.float32, scale=0.8)
    rollout = make_rollout(vocab)
    full_logits = teacher_forcing.sharded_completion_logits(teacher, rollout, cfg)[0]
    sparse = teacher_topk.from_logits(full_logits, top_k)
    sources = {
      "step": (rollout, rollout),
      "engine": (rollout.replace(teacher_logits=full_logits), rollout.replace(teacher_topk=sparse)),
    }
    for source, (full_r, sparse_r) in sources.items():
      full = measure_step(cfg, student, teacher, full_r, loss, 0, repeats)
      top = measure_step(cfg, student, teacher, sparse_r, loss, top_k, repeats)
      rows.append(_pair(vocab, source, full, top))
    full = measure_scoring(cfg, teacher, rollout, 0, repeats)
    top = measure_scoring(cfg, teacher, rollout, top_k, repeats)
    rows.append(_pair(vocab, "engine_scoring", full, top))
    del full_logits
  return rows


def _pair(vocab: int, source: str, full: dict, top: dict) -> dict:
  row = {"vocab": vocab, "source": source}
  for key in full:
    row[f"full_{key}"] = full[key]
    row[f"sparse_{key}"] = top[key]
    row[f"ratio_{key}"] = top[key] / full[key] if full[key] else float("nan")
  return row


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv)
  flags.DEFINE_integer(
    "top-k", TOP_K, "Teacher logits kept per position (train.teacher_top_k).", flag_values=fv
  )
  flags.DEFINE_string(
    "loss", "forward_kl", "The loss both teachers are timed with (train.loss).", flag_values=fv
  )
  flags.DEFINE_integer("repeats", 5, "Timed steps per row (median).", flag_values=fv)
  flags.DEFINE_string(
    "vocabs", ",".join(map(str, VOCABS)), "Comma-separated vocabulary sizes.", flag_values=fv
  )


def main(argv=None) -> int:
  args = runner.parse_own_flags(define_flags, argv, __doc__)
  import jax

  vocabs = tuple(int(v) for v in args.vocabs.split(","))
  rows = run(vocabs, args.top_k, args.loss, args.repeats)
  c = bench_config(vocabs[0])
  shape = {
    "layers": c.num_layers,
    "hidden": c.hidden_size,
    "batch": BATCH,
    "prompt": PROMPT,
    "completion": COMPLETION,
    "top_k": args.top_k,
    "loss": args.loss,
    "repeats": args.repeats,
    "backend": jax.default_backend(),
  }
  if args.json:
    json_file.write_text(args.json, json.dumps({"shape": shape, "rows": rows}))
    if args.json == "-":
      return 0
  mib = 2**20
  print(f"full vs sparse teacher (k={args.top_k}), {shape}")
  print(
    f"{'V':>7} {'source':>15} {'full s':>8} {'sparse s':>9} {'time':>6} {'full temp':>10} "
    f"{'sp temp':>8} {'temp':>6} {'full args':>10} {'sp args':>8} {'args':>6}"
  )
  for r in rows:
    print(
      f"{r['vocab']:>7} {r['source']:>15} {r['full_seconds']:>8.3f} {r['sparse_seconds']:>9.3f} "
      f"{r['ratio_seconds']:>6.2f} {r['full_temp_bytes'] / mib:>10.1f} "
      f"{r['sparse_temp_bytes'] / mib:>8.1f} {r['ratio_temp_bytes']:>6.2f} "
      f"{r['full_argument_bytes'] / mib:>10.1f} {r['sparse_argument_bytes'] / mib:>8.1f} "
      f"{r['ratio_argument_bytes']:>6.2f}"
    )
  print("(MiB; ratios are sparse / full)")
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
