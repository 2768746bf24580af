"""How the cost of one decode step grows with the cache capacity S and the position t.

Command (CPU; the default run compiles 36 step programs and times 84 rows, most of its time in
the batch-16 reference rows at S = 4096; `--quick` keeps batch 1 only):

    python -m opd_jax.bench.decode_scaling            # readable table and the goal ratios
    python -m opd_jax.bench.decode_scaling --json     # {"rows": [...], "ratios": {...}} only
    python -m opd_jax.bench.decode_scaling --json=PATH  # the JSON to PATH, the table too
    python -m opd_jax.bench.decode_scaling --quick    # batch 1, 3 timed calls per row

One row per attention path × KV format × batch B × capacity S × position t (t < S), on
the Qwen3-shaped 58M model of `bench/sampler.py` ("qwen3-50m": 8 layers, 4 KV heads of 64,
f32 weights and activations):

* `attention`: "blockwise" (`decode_attention.attend_cache`: the blocks of the filled
  prefix only, FP8 dequantized per block) or "reference" (`kvcache.read` of all S slots,
  then `transformer.attend` over them), the two paths of `transformer.forward_with_cache`;
* `kv`: "bf16", "fp8_token_head", "fp8_tensor" (`kvcache.KVCacheSpec`);
* `ms_per_step`: the median wall time (7 calls; 3 with `--quick`) of one jitted
  `forward_with_cache` call that feeds one token per row at position t (cache donated and
  handed back, as in the sampler's loop; the cache content does not change the work). The
  rows of one attention path and batch are timed round-robin (`_group`);
* `kv_bytes_read`: bytes of stored cache the step's attention reads, from the cache's own
  layout (`kvcache.bytes_per_token`) times the slots read per row: all S for the reference,
  ⌈(t + 1) / block⌉ · block for the blockwise path (its last block may overlap the one before
  it when S is not a multiple of the block), times B. The reference also
  writes and reads back a dequantized copy of the whole cache (`dequant_copy_bytes`, S
  slots in the compute dtype) when the storage dtype is not the compute dtype.

`ratios` states the goals within one run (so a loaded machine moves both sides alike):
`s4096_over_s256_at_t32` (per attention, KV format and batch: the step at t = 32 with
S = 4096 over S = 256; goal ≤ 1.3 for the blockwise path) and `fp8_over_bf16_speed` (BF16
ms over FP8 ms at t ≥ 1024, S = 4096; goal ≥ 0.95).

Run on an older tree (a `forward_with_cache` without the `attention` argument) the rows
carry attention="before" and time that tree's one path.
"""

from __future__ import annotations

import inspect
import json
import statistics
import time

from absl import flags

from opd_jax.bench import roofline
from opd_jax.bench.sampler import MODELS
from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

MODEL = "qwen3-50m"
CAPACITIES = (256, 1024, 4096)
POSITIONS = (32, 256, 1024, 4000)
BATCHES = (1, 16)
# The KV-cache formats timed, as `kvcache.KVCacheSpec` arguments.
KV_FORMATS = {
  "bf16": {"dtype": "bfloat16"},
  "fp8_token_head": {"dtype": "float8_e4m3fn", "granularity": "token_head"},
  "fp8_tensor": {"dtype": "float8_e4m3fn", "granularity": "tensor"},
}


def _attention_paths() -> tuple[bool, int]:
  """(whether this tree's `forward_with_cache` takes `attention`, the decode block size)."""
  from opd_jax.model import transformer as model

  if "attention" not in inspect.signature(model.forward_with_cache).parameters:
    return False, 256
  from opd_jax.model import decode_attention

  return True, decode_attention.BLOCK


def _stepper(cfg, spec, attention: str):
  """A jitted one-token step at positions pos_b, the cache donated (as in the decode loop)."""
  import jax

  from opd_jax.model import transformer as model

  extra = {"attention": attention} if _attention_paths()[0] else {}

  def step(params, token_b1, pos_b, cache):
    return model.forward_with_cache(params, token_b1, pos_b, cache, cfg, spec, **extra)

  return jax.jit(step, donate_argnums=3)


def _group(cfg, params, attention: str, batch: int, repeats: int, capacities, positions) -> dict:
  """Median ms per step of every (KV format, S, t) of one attention path and batch.

  The configurations are timed round-robin, one call each per round, so that a machine
  whose load changes during the run slows all of them alike; each is called twice before
  (compiles, and the first write adds the "tensor" clipping counters to the cache).
  """
  import jax
  import jax.numpy as jnp

  from opd_jax.model import kvcache

  token_b1 = jnp.full((batch, 1), 7, jnp.int32)
  steps, caches, configs = {}, {}, []
  for kv, fields in KV_FORMATS.items():
    spec = kvcache.KVCacheSpec(**fields)
    for slots in capacities:
      steps[kv, slots] = _stepper(cfg, spec, attention)
      caches[kv, slots] = kvcache.init_cache(cfg, batch, slots, spec)
      configs += [(kv, slots, t) for t in positions if t < slots]

  def call(kv, slots, t):
    pos_b = jnp.full((batch,), t, jnp.int32)
    start = time.perf_counter()
    logits, caches[kv, slots] = steps[kv, slots](params, token_b1, pos_b, caches[kv, slots])
    jax.block_until_ready((logits, caches[kv, slots]))
    return 1e3 * (time.perf_counter() - start)

  for config in configs:
    call(*config)
    call(*config)
  times = {config: [] for config in configs}
  for _ in range(repeats):
    for config in configs:
      times[config].append(call(*config))
  per_token = {key: kvcache.bytes_per_token(cache) for key, cache in caches.items()}
  return {config: (statistics.median(times[config]), per_token[config[:2]]) for config in configs}


def run(
  batches=BATCHES,
  repeats: int = 7,
  attentions=None,
  log=print,
  model_name: str = MODEL,
  capacities=CAPACITIES,
  positions=POSITIONS,
) -> list[dict]:
  """The rows of the module docstring (`model_name` a shape of `bench.sampler.MODELS`;
  other capacities and positions give a smaller run, e.g. `bench.device_check --cpu-smoke`)."""
  import jax
  import jax.numpy as jnp

  from opd_jax.model import transformer as model

  cfg = MODELS[model_name]
  params = model.init_params(jax.random.key(0), cfg, jnp.float32)
  itemsize = jnp.dtype(model.compute_dtype(params)).itemsize
  # K and V of every layer in the compute dtype, per slot (no format here stores f32).
  dequant = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
  new, block = _attention_paths()
  if attentions is None:
    attentions = ("blockwise", "reference") if new else ("before",)
  groups = [(attention, batch) for attention in attentions for batch in batches]
  rows = []
  for i, (attention, batch) in enumerate(groups):
    timed = _group(cfg, params, attention, batch, repeats, capacities, positions)
    for (kv, slots, t), (ms, per_token) in timed.items():
      read = roofline.slots_read(t, slots, attention, block)
      rows.append(
        {
          "attention": attention,
          "kv": kv,
          "batch": batch,
          "capacity": slots,
          "position": t,
          "ms_per_step": round(ms, 3),
          "kv_bytes_read": int(read * per_token * batch),
          "dequant_copy_bytes": 0 if attention in roofline.BLOCK_PATHS else slots * dequant * batch,
        }
      )
    log(f"[{i + 1}/{len(groups)}] {attention}, batch {batch}: {len(timed)} rows timed")
  return rows


def ratios(rows: list[dict]) -> dict:
  """The goal ratios of the module docstring, from one run's rows."""
  ms = {
    (r["attention"], r["kv"], r["batch"], r["capacity"], r["position"]): r["ms_per_step"]
    for r in rows
  }
  growth, fp8 = {}, {}
  for (attention, kv, batch, slots, t), value in ms.items():
    if slots == 4096 and t == 32 and (attention, kv, batch, 256, 32) in ms:
      growth[f"{attention}/{kv}/b{batch}"] = round(value / ms[(attention, kv, batch, 256, 32)], 3)
    if slots == 4096 and t >= 1024 and kv != "bf16":
      bf16 = ms.get((attention, "bf16", batch, slots, t))
      if bf16:
        fp8[f"{attention}/{kv}/b{batch}/t{t}"] = round(bf16 / value, 3)
  return {"s4096_over_s256_at_t32": growth, "fp8_over_bf16_speed": fp8}


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv, '{"rows": [...], "ratios": {...}}')
  flags.DEFINE_bool("quick", False, "Batch 1 only, 3 timed calls per row.", flag_values=fv)
  flags.DEFINE_string(
    "attention",
    "",
    "Comma-separated subset of blockwise,reference,pallas (default blockwise,reference; "
    "pallas runs in interpret mode on a CPU).",
    flag_values=fv,
  )


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark; prints a table, or {"rows": [...], "ratios": {...}} with --json."""
  args = runner.parse_own_flags(define_flags, argv, __doc__)
  import jax

  from opd_jax.model import transformer as model

  new, block = _attention_paths()
  attentions = tuple(a for a in args.attention.split(",") if a) or None
  if attentions and (not new or set(attentions) - set(model.ATTENTIONS)):
    raise ValueError(f"--attention must name paths of {getattr(model, 'ATTENTIONS', ())}")
  log = cli_flags.log_for_json(args.json)
  log(f"jax {jax.__version__} on {jax.devices()[0].platform}; model {MODEL}, block {block}")
  batches = (1,) if args.quick else BATCHES
  rows = run(batches, 3 if args.quick else 7, attentions, log)
  result = {"rows": rows, "ratios": ratios(rows)}
  if args.json:
    json_file.write_text(args.json, json.dumps(result))
    if args.json == "-":
      return 0
  print(
    f"\n{'attention':>10} {'kv':>15} {'B':>3} {'S':>5} {'t':>5} {'ms/step':>9} {'KV MB read':>11}"
  )
  for r in rows:
    print(
      f"{r['attention']:>10} {r['kv']:>15} {r['batch']:>3} {r['capacity']:>5} "
      f"{r['position']:>5} {r['ms_per_step']:>9.2f} {r['kv_bytes_read'] / 1e6:>11.2f}"
    )
  print(json.dumps(result["ratios"], indent=1))
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
