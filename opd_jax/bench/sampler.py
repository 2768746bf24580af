"""Sampler throughput: opd_jax against `transformers.generate`, and FP8 against BF16.

Command (CPU, one core; `--quick` runs 2 timed calls per row instead of 3, `--kinds` a
subset; results and timings: docs/results/benchmarks.md):

    python -m opd_jax.bench.sampler            # readable table
    python -m opd_jax.bench.sampler --json     # {"rows": [...]} on stdout only
    python -m opd_jax.bench.sampler --json --models qwen3-50m --kinds fp8_vs_dense

Both engines run in this process on the same weights: our random params are
written with `hf.save_checkpoint` and read back by `from_pretrained`, so the
models are identical. Every run is greedy with a fixed number of new tokens
(transformers gets `min_new_tokens = max_new_tokens`, opd_jax no stop tokens), on
a batch of random prompts of equal length, so both produce exactly
batch × new_tokens tokens. Throughput is that count over the wall time of the
whole call (prefill + decode), the median of several runs. Runs of the two
engines are interleaved, so a load change from other processes hits both; the
ratio is the figure to read. The first call of each engine is a warm-up and is
excluded; for opd_jax its time minus the median run is reported as the compile
time. The greedy tokens of the two engines are compared (`tokens_match`).

Threads: the process is pinned to `--threads` cores (default 1) before either
engine starts, and torch gets that many threads, so both engines have the same
cores. One core is the default because on a shared machine torch's OpenMP
barriers collapse when another process holds one of the cores (a 50M-model
prefill then takes many times longer with 2 threads than with 1), which would
flatter opd_jax; `--threads 0` uses every core.

Rows (kind):
* "vs_transformers": f32 on both sides. Torch on CPU is slow in bf16, so f32 is
  the fair comparison.
* "fp8_vs_dense": the rollout engine as the trainer builds it for
  `rollout.weights = "fp8"` (`transform.engine_params`: per-channel e4m3 weights,
  prepared for this hardware by `quant_compute.prepare_for_compute`) with an FP8 KV cache
  (per-token, per-head scales), against the dense engine of the default run: the
  trainer's f32 weights and an f32 KV cache ("dense" = f32 here). The same run
  also times the unprepared QArrays (`fp8_per_step_*`, the weights dequantized
  inside every decode step, as before `prepare_for_compute`), and checks that
  they decode exactly the prepared engine's tokens (`per_step_tokens_match`).
* "fp8_vs_bf16": FP8 weights quantized from BF16 (so BF16 compute) and prepared
  the same way, with the FP8 KV cache, against BF16 weights and a BF16 KV cache.

On hardware without FP8 matmuls (this CPU) the prepared weights are dense in the
compute dtype, so the FP8 rows measure the FP8 KV cache plus whatever the
preparation left; where FP8 matmuls exist they measure the W8A8 path.

Every row also reports `cpu_ratio_*`: the same ratio from the process's CPU time
(`time.process_time`) instead of wall time. On a shared machine another process
stretches wall time but not CPU time, so when the two disagree the CPU ratio is
the steadier one.

Models: "tiny" (the test-suite shape) and "qwen3-50m" (Qwen3-shaped, 58M params),
each with a 64-token prompt and 128 new tokens, at batch 1 and 16 (`--batches`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import numpy as np
from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

if TYPE_CHECKING:  # annotations only: --help imports no JAX
  from opd_jax.model import kvcache
from opd_jax.model.config import ModelConfig

MODELS = {
  "tiny": ModelConfig(
    model_type="qwen3",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
  ),
  "qwen3-50m": ModelConfig(
    model_type="qwen3",
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    qk_norm=True,
  ),
}
PROMPT_LEN = 64
NEW_TOKENS = 128
BATCHES = (1, 16)
KINDS = ("vs_transformers", "fp8_vs_dense", "fp8_vs_bf16")


def _timed(fn):
  """(wall seconds, CPU seconds of this process, result) of one call."""
  start, cpu = time.perf_counter(), time.process_time()
  result = fn()
  return time.perf_counter() - start, time.process_time() - cpu, result


def _opd_runner(params, prompts, cfg: ModelConfig, kv: kvcache.KVCacheSpec):
  import jax

  from opd_jax.inference import sampler

  scfg = sampler.SamplerConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, kv=kv)

  def run():
    out = sampler.sample(params, prompts, jax.random.key(0), scfg, cfg)
    return np.asarray(out.completion_tokens)  # waits for the device

  return run


def _hf_runner(hf_model, tokens_bp):
  import torch

  ids = torch.from_numpy(tokens_bp.astype(np.int64))
  mask = torch.ones_like(ids)

  def run():
    with torch.inference_mode():
      out = hf_model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        pad_token_id=0,
      )
    return out[:, tokens_bp.shape[1] :].numpy()

  return run


def _interleaved(runners: dict, repeats: int) -> dict:
  """Warm-up call, then `repeats` interleaved timed calls of every runner.

  Returns:
    {name: {"median_s", "median_cpu_s", "first_s", "tokens"}}.
  """
  stats = {}
  for name, run in runners.items():
    first_s, _, tokens = _timed(run)
    stats[name] = {"first_s": first_s, "tokens": tokens, "times": [], "cpu": []}
  for _ in range(repeats):
    for name, run in runners.items():
      seconds, cpu_s, _ = _timed(run)
      stats[name]["times"].append(seconds)
      stats[name]["cpu"].append(cpu_s)
  for s in stats.values():
    s["median_s"] = statistics.median(s.pop("times"))
    s["median_cpu_s"] = statistics.median(s.pop("cpu"))
  return stats


def _vs_transformers_row(name, cfg, batch, params, hf_model, tokens_bp, prompts, kv, repeats, log):
  """The "vs_transformers" row: opd_jax f32 against transformers f32, interleaved."""
  import torch

  num_tokens = batch * NEW_TOKENS
  log(f"{name} batch {batch}: opd_jax f32 vs transformers f32 ...")
  stats = _interleaved(
    {
      "opd_jax": _opd_runner(params, prompts, cfg, kv),
      "transformers": _hf_runner(hf_model, tokens_bp),
    },
    repeats,
  )
  ours, theirs = stats["opd_jax"], stats["transformers"]
  row = {
    "kind": "vs_transformers",
    "model": name,
    "params_m": round(cfg.num_params() / 1e6, 2),
    "batch": batch,
    "dtype": "float32",
    "threads": torch.get_num_threads(),
    "prompt_len": PROMPT_LEN,
    "new_tokens": NEW_TOKENS,
    "opd_jax_tokens_per_s": round(num_tokens / ours["median_s"], 1),
    "transformers_tokens_per_s": round(num_tokens / theirs["median_s"], 1),
    "ratio_vs_transformers": round(theirs["median_s"] / ours["median_s"], 2),
    "opd_jax_compile_s": round(max(ours["first_s"] - ours["median_s"], 0.0), 2),
    "tokens_match": float(np.mean(ours["tokens"] == theirs["tokens"])),
  }
  log(f"  {row}")
  return row


def bench_model(name: str, repeats: int, log, kinds=KINDS, batches=BATCHES) -> list[dict]:
  """The rows of `kinds` for one model shape at each batch size of `batches` (torch and
  transformers are imported only for the "vs_transformers" rows)."""
  import jax
  import jax.numpy as jnp

  from opd_jax.inference import transform
  from opd_jax.io import hf
  from opd_jax.model import kvcache, quant, quant_compute
  from opd_jax.model import transformer as model

  cfg = MODELS[name]
  params = model.init_params(jax.random.key(0), cfg, jnp.float32)
  hf_model = None
  if "vs_transformers" in kinds:
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as directory:
      hf.save_checkpoint(directory, cfg, params)
      hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    hf_model.eval()
  f32_kv = kvcache.KVCacheSpec(dtype="float32")
  bf16_kv = kvcache.KVCacheSpec(dtype="bfloat16")
  fp8_kv = kvcache.KVCacheSpec(dtype="float8_e4m3fn", granularity="token_head")
  fp8_engine = transform.EngineConfig(weights="fp8", kv=fp8_kv)
  fp8_engine_params = transform.engine_params(params, fp8_engine, jax.random.key(0))
  fp8_per_step_params = quant.quantize_params(params, quant.QuantRecipe())
  bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  fp8_bf16_params = quant_compute.prepare_for_compute(
    quant.quantize_params(bf16_params, quant.QuantRecipe())
  )
  native = quant_compute.has_native_fp8()
  rows = []
  for batch in batches:
    tokens_bp = np.random.default_rng(batch).integers(3, cfg.vocab_size, (batch, PROMPT_LEN))
    prompts = (tokens_bp.astype(np.int32), np.full((batch,), PROMPT_LEN, np.int32))
    num_tokens = batch * NEW_TOKENS
    if "vs_transformers" in kinds:
      rows.append(
        _vs_transformers_row(
          name, cfg, batch, params, hf_model, tokens_bp, prompts, f32_kv, repeats, log
        )
      )
    if "fp8_vs_dense" in kinds:
      log(f"{name} batch {batch}: fp8 engine (prepared, fp8 kv) vs dense f32 vs fp8 per step ...")
      stats = _interleaved(
        {
          "fp8": _opd_runner(fp8_engine_params, prompts, cfg, fp8_kv),
          "dense": _opd_runner(params, prompts, cfg, f32_kv),
          "fp8_per_step": _opd_runner(fp8_per_step_params, prompts, cfg, fp8_kv),
        },
        repeats,
      )
      fp8, dense, per_step = stats["fp8"], stats["dense"], stats["fp8_per_step"]
      rows.append(
        {
          "kind": "fp8_vs_dense",
          "model": name,
          "params_m": round(cfg.num_params() / 1e6, 2),
          "batch": batch,
          "dtype": (
            f"{fp8_engine.engine_id} ({'native W8A8' if native else 'prepared: dequantized once'})"
            " vs dense: trainer f32 weights + f32 kv"
          ),
          "prompt_len": PROMPT_LEN,
          "new_tokens": NEW_TOKENS,
          "opd_jax_tokens_per_s": round(num_tokens / fp8["median_s"], 1),
          "dense_tokens_per_s": round(num_tokens / dense["median_s"], 1),
          "fp8_per_step_tokens_per_s": round(num_tokens / per_step["median_s"], 1),
          "ratio_vs_dense": round(dense["median_s"] / fp8["median_s"], 2),
          "ratio_per_step_vs_dense": round(dense["median_s"] / per_step["median_s"], 2),
          "cpu_ratio_vs_dense": round(dense["median_cpu_s"] / fp8["median_cpu_s"], 2),
          "cpu_ratio_per_step_vs_dense": round(dense["median_cpu_s"] / per_step["median_cpu_s"], 2),
          "opd_jax_compile_s": round(max(fp8["first_s"] - fp8["median_s"], 0.0), 2),
          "tokens_match": float(np.mean(fp8["tokens"] == dense["tokens"])),
          "per_step_tokens_match": float(np.mean(fp8["tokens"] == per_step["tokens"])),
        }
      )
      log(f"  {rows[-1]}")
    if "fp8_vs_bf16" not in kinds:
      continue
    log(f"{name} batch {batch}: opd_jax fp8 weights (from bf16, prepared) + fp8 kv vs bf16 ...")
    stats = _interleaved(
      {
        "fp8": _opd_runner(fp8_bf16_params, prompts, cfg, fp8_kv),
        "bf16": _opd_runner(bf16_params, prompts, cfg, bf16_kv),
      },
      repeats,
    )
    fp8, bf16 = stats["fp8"], stats["bf16"]
    rows.append(
      {
        "kind": "fp8_vs_bf16",
        "model": name,
        "params_m": round(cfg.num_params() / 1e6, 2),
        "batch": batch,
        "dtype": "fp8 weights (prepared) + fp8 kv (token_head) vs bf16 weights + bf16 kv",
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "opd_jax_tokens_per_s": round(num_tokens / fp8["median_s"], 1),
        "bf16_tokens_per_s": round(num_tokens / bf16["median_s"], 1),
        "ratio_vs_bf16": round(bf16["median_s"] / fp8["median_s"], 2),
        "cpu_ratio_vs_bf16": round(bf16["median_cpu_s"] / fp8["median_cpu_s"], 2),
        "opd_jax_compile_s": round(max(fp8["first_s"] - fp8["median_s"], 0.0), 2),
        "tokens_match": float(np.mean(fp8["tokens"] == bf16["tokens"])),
      }
    )
    log(f"  {rows[-1]}")
  return rows


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv, '{"rows": [...]}')
  flags.DEFINE_bool("quick", False, "2 timed runs per row instead of 3.", flag_values=fv)
  flags.DEFINE_integer("threads", 1, "Cores for both engines; 0 = all.", flag_values=fv)
  flags.DEFINE_string(
    "models", ",".join(MODELS), f"Comma-separated subset of {', '.join(MODELS)}.", flag_values=fv
  )
  flags.DEFINE_string(
    "kinds", ",".join(KINDS), f"Comma-separated subset of {', '.join(KINDS)}.", flag_values=fv
  )
  flags.DEFINE_string(
    "batches", ",".join(map(str, BATCHES)), "Comma-separated batch sizes.", flag_values=fv
  )


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark; prints a table, or {"rows": [...]} with --json."""
  args = runner.parse_own_flags(define_flags, argv, __doc__)
  import jax

  names = [m for m in args.models.split(",") if m]
  unknown = [m for m in names if m not in MODELS]
  if unknown:
    raise ValueError(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
  kinds = tuple(k for k in args.kinds.split(",") if k)
  unknown = [k for k in kinds if k not in KINDS]
  if unknown or not kinds:
    raise ValueError(f"unknown or no row kind(s) {unknown}; choose from {', '.join(KINDS)}")
  if args.threads < 0:
    raise ValueError(f"--threads must be >= 0, got {args.threads}")
  try:
    batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
  except ValueError:
    raise ValueError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
  if not batches or min(batches) < 1:
    raise ValueError(f"--batches must name batch sizes >= 1, got {args.batches!r}")
  cores = sorted(os.sched_getaffinity(0))
  if args.threads:
    cores = cores[: args.threads]
    for tid in os.listdir("/proc/self/task"):  # threads started later inherit it
      os.sched_setaffinity(int(tid), cores)
  import torch

  torch.set_num_threads(len(cores))
  log = (lambda msg: print(msg, file=sys.stderr)) if args.json == "-" else print
  log(
    f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__}; both "
    f"pinned to {len(cores)} core(s), torch with {torch.get_num_threads()} threads; f32 for "
    "the transformers comparison (torch CPU bf16 is slow, so it would flatter opd_jax)"
  )
  repeats = 2 if args.quick else 3
  rows = [row for name in names for row in bench_model(name, repeats, log, kinds, batches)]
  if args.json:
    json_file.write_text(args.json, json.dumps({"rows": rows}))
    if args.json == "-":
      return 0
  print()
  header = ("model", "batch", "kind", "opd_jax tok/s", "baseline tok/s", "ratio", "compile s")
  print("{:<10} {:>5} {:<16} {:>13} {:>14} {:>6} {:>9}".format(*header))
  for r in rows:
    base = next(r[k] for k in r if k.endswith("_tokens_per_s") and k != "opd_jax_tokens_per_s")
    ratio = next(r[k] for k in r if k.startswith("ratio_vs_"))
    print(
      f"{r['model']:<10} {r['batch']:>5} {r['kind']:<16} {r['opd_jax_tokens_per_s']:>13} "
      f"{base:>14} {ratio:>6} {r['opd_jax_compile_s']:>9}"
    )
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
