"""KV-cache capacity per recipe: bytes per cached token and tokens in a memory budget.

Command (CPU):

    python -m opd_jax.bench.kv_capacity            # readable table and floor checks
    python -m opd_jax.bench.kv_capacity --json     # {"rows": [...]} on stdout only (or =PATH)

One row per model shape × recipe × scale granularity. Bytes always come from the
cache layout that `kvcache.init_cache` builds, never from a formula:

* "tiny" (the CPU test model): a cache is really allocated and measured with
  `kvcache.bytes_per_token` (its arrays' `nbytes`).
* "qwen3-1.7b", "qwen3-8b" (shapes from the public `config.json`s): the same
  `init_cache` traced by `jax.eval_shape`, which gives exact sizes without
  allocating.

Recipes: "bf16" (the baseline), "fp8_all" (e4m3 KV on every layer) and "fp8_paper"
(e4m3 with layer 0 kept in BF16: one of 28 layers for Qwen3-1.7B). FP8 rows come in
both granularities, "token_head" (per-token, per-head scales: 4 extra bytes per
head per K and V) and "tensor" (one scale per layer and sequence, amortised over
`--seq-len` slots). `ratio_vs_bf16` is the BF16 bytes per token over the row's, i.e.
how many times as many tokens fit in the same memory.

Floors (checked here and in tests/model/test_kvcache.py; a failed floor exits 1):
fp8_all with "tensor" scales holds ≥ 1.99× the BF16 tokens on every model, and
fp8_paper on Qwen3-1.7B with its best granularity holds ≥ 1.93×.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

if TYPE_CHECKING:  # annotations only: --help imports no JAX
  from opd_jax.model import kvcache
from opd_jax.model.config import ModelConfig

# The tiny CPU model: small enough to allocate, 4 layers so that fp8_paper keeps 1 of 4.
TINY_CONFIG = ModelConfig(
  model_type="qwen3",
  vocab_size=128,
  hidden_size=64,
  intermediate_size=128,
  num_layers=4,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
)

# Values from the public Hugging Face config.json of each model.
QWEN3_1_7B = ModelConfig.from_hf_dict(
  {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
  }
)
QWEN3_8B = ModelConfig.from_hf_dict(
  {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
  }
)

# name -> (config, whether the cache is really allocated)
MODELS = {
  "tiny": (TINY_CONFIG, True),
  "qwen3-1.7b": (QWEN3_1_7B, False),
  "qwen3-8b": (QWEN3_8B, False),
}
PAPER_BF16_LAYERS = (0,)  # the one layer fp8_paper keeps in BF16, on every model
TENSOR_FLOOR = 1.99  # fp8_all, "tensor" scales, every model
PAPER_FLOOR = 1.93  # fp8_paper on Qwen3-1.7B, best granularity
PAPER_FLOOR_MODEL = "qwen3-1.7b"


def recipe_specs() -> list[tuple[str, str | None, kvcache.KVCacheSpec]]:
  """(recipe, granularity, spec) for every benchmarked cache configuration."""
  from opd_jax.model import kvcache

  out = [("bf16", None, kvcache.KVCacheSpec(dtype="bfloat16"))]
  for recipe, layers in (("fp8_all", ()), ("fp8_paper", PAPER_BF16_LAYERS)):
    for granularity in kvcache.KV_GRANULARITIES:
      spec = kvcache.KVCacheSpec("float8_e4m3fn", granularity, bf16_layers=layers)
      out.append((recipe, granularity, spec))
  return out


def capacity_rows(budget_bytes: int, seq_len: int = 4096) -> list[dict]:
  """One row per model × recipe × granularity.

  tokens_in_budget = floor(budget_bytes / kv_bytes_per_token);
  ratio_vs_bf16 = bf16 bytes per token / the row's bytes per token.

  Args:
    budget_bytes: KV memory budget in bytes.
    seq_len: slots per sequence (per-sequence scales are amortised over them).

  Returns:
    A list of dicts with keys model, recipe, granularity, num_layers,
    num_bf16_layers (layers whose cache is BF16), seq_len, source,
    kv_bytes_per_token, budget_bytes, tokens_in_budget, ratio_vs_bf16.
  """
  from opd_jax.model import kvcache

  if budget_bytes <= 0:
    raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
  if seq_len <= 0:
    raise ValueError(f"seq_len must be positive, got {seq_len}")
  rows = []
  for model, (cfg, allocate) in MODELS.items():
    baseline = None
    for recipe, granularity, spec in recipe_specs():
      per_token = kvcache.measure_bytes_per_token(cfg, spec, seq_len, allocate)
      baseline = per_token if baseline is None else baseline
      rows.append(
        {
          "model": model,
          "recipe": recipe,
          "granularity": granularity,
          "num_layers": cfg.num_layers,
          "num_bf16_layers": sum(spec.layer_dtype(i) == "bfloat16" for i in range(cfg.num_layers)),
          "seq_len": seq_len,
          "source": "allocated" if allocate else "eval_shape",
          "kv_bytes_per_token": per_token,
          "budget_bytes": budget_bytes,
          "tokens_in_budget": int(budget_bytes // per_token),
          "ratio_vs_bf16": baseline / per_token,
        }
      )
  return rows


def check_floors(rows: list[dict]) -> list[dict]:
  """The capacity floors (module docstring) evaluated on `rows`.

  Returns:
    One dict per floor: name, model, value (the ratio), floor, ok.
  """
  checks = []
  for model in MODELS:
    tensor = [
      r for r in rows if (r["model"], r["recipe"], r["granularity"]) == (model, "fp8_all", "tensor")
    ]
    for r in tensor:
      checks.append(
        {
          "name": "fp8_all/tensor",
          "model": model,
          "value": r["ratio_vs_bf16"],
          "floor": TENSOR_FLOOR,
          "ok": r["ratio_vs_bf16"] >= TENSOR_FLOOR,
        }
      )
  paper = [r for r in rows if (r["model"], r["recipe"]) == (PAPER_FLOOR_MODEL, "fp8_paper")]
  if paper:
    best = max(paper, key=lambda r: r["ratio_vs_bf16"])
    checks.append(
      {
        "name": f"fp8_paper/best ({best['granularity']})",
        "model": PAPER_FLOOR_MODEL,
        "value": best["ratio_vs_bf16"],
        "floor": PAPER_FLOOR,
        "ok": best["ratio_vs_bf16"] >= PAPER_FLOOR,
      }
    )
  return checks


def format_table(rows: list[dict], checks: list[dict]) -> str:
  """The rows and floor checks as aligned text."""
  head = f"{'model':<11} {'recipe':<10} {'granularity':<11} {'bf16 layers':<11} "
  head += f"{'bytes/token':>12} {'tokens in budget':>17} {'x bf16':>7}"
  lines = [head, "-" * len(head)]
  for r in rows:
    layers = f"{r['num_bf16_layers']}/{r['num_layers']}"
    lines.append(
      f"{r['model']:<11} {r['recipe']:<10} {r['granularity'] or '-':<11} {layers:<11} "
      f"{r['kv_bytes_per_token']:>12.3f} {r['tokens_in_budget']:>17,} {r['ratio_vs_bf16']:>7.4f}"
    )
  if rows:
    gib = rows[0]["budget_bytes"] / 2**30
    lines.append(
      f"budget: {rows[0]['budget_bytes']:,} bytes ({gib:g} GiB) of KV memory; "
      f"per-sequence scales amortised over {rows[0]['seq_len']} slots"
    )
  for c in checks:
    verdict = "ok" if c["ok"] else "FAIL"
    lines.append(f"floor {c['name']} on {c['model']}: {c['value']:.4f} >= {c['floor']}: {verdict}")
  return "\n".join(lines)


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv, "the rows")
  flags.DEFINE_float("budget-gib", 16.0, "KV memory budget, GiB.", flag_values=fv)
  flags.DEFINE_integer("seq-len", 4096, "Slots per sequence.", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
  """Prints the capacity table (or JSON rows); returns 1 when a floor fails."""
  args = runner.parse_own_flags(define_flags, argv, __doc__)
  if args.budget_gib <= 0:
    raise ValueError(f"--budget-gib must be positive, got {args.budget_gib}")
  if args.seq_len <= 0:
    raise ValueError(f"--seq-len must be positive, got {args.seq_len}")
  rows = capacity_rows(int(args.budget_gib * 2**30), args.seq_len)
  checks = check_floors(rows)
  if args.json:
    json_file.write_text(args.json, json.dumps({"rows": rows}))
  if args.json == "-":
    for c in checks:
      if not c["ok"]:
        print(f"floor {c['name']} on {c['model']} failed: {c['value']:.4f}", file=sys.stderr)
  else:
    print(format_table(rows, checks))
  return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
