"""opd_jax's sampler against tunix's, on random Qwen3 checkpoints that both engines and
`transformers` read: greedy, f32, prompts of 64 random tokens, timed only where the tokens agree.

For each model (`--models`: "tiny", 0.14M parameters, and "qwen3-50m", the 58M shape of
`opd_jax.bench.sampler`, both with rope_theta = 1e6, the only θ tunix's Qwen3 attention uses)
the random parameters of `transformer.init_params` are written with `hf.save_checkpoint` and
read by all three engines. Then for each row (`--shapes`, "batch:new_tokens,..."):

1. Tokens. transformers' `generate` (greedy, no EOS, so exactly `new_tokens` tokens) is the
   reference. opd_jax's `sampler.sample` and tunix's `Sampler` each decode the same prompts;
   the row prints the share of each engine's tokens equal to the reference's, and is not timed
   ("tokens differ") unless both shares are 1.0, so speed is compared on verified-identical
   models only.
2. Times. That first call of each engine is its warm-up (it compiles); then `--repeats` calls
   of each, interleaved (opd_jax, tunix, opd_jax, ...), so a load change hits both. The row
   reports each engine's median, min and max seconds per call (prefill + decode, batch ×
   new_tokens tokens) and `ratio` = tunix median s / opd_jax median s (above 1: opd_jax faster).

Both caches hold exactly prompt + new-token slots. tunix gets token ids through a tokenizer
that reads them as text ("5 17 9"), with no BOS and with pad and EOS ids outside the
vocabulary: its decode step masks every cached token equal to the pad id, so a pad id inside
the vocabulary would hide each generated token that happens to equal it.

Runs in a separate environment with tunix installed (never one of the project's
dependencies), with this repository on the path; torch (CPU) for the reference:

    python -m venv /tmp/tunix_venv
    /tmp/tunix_venv/bin/pip install google-tunix torch transformers
    PYTHONPATH=. /tmp/tunix_venv/bin/python docs/bench/vs_tunix.py --json=vs_tunix.json

`--repeats=0` checks the tokens only. Results and method: docs/bench/decode_scaling.md
("Side by side with tunix's sampler").
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import time

import numpy as np
from absl import flags

from opd_jax.bench.sampler import MODELS as BENCH_MODELS
from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file
from opd_jax.model.config import ModelConfig

ROPE_THETA = 1e6  # tunix's Qwen3 attention calls apply_rope with its default θ, whatever the config
MODELS = {
  "tiny": ModelConfig(  # 0.14M parameters
    model_type="qwen3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    rope_theta=ROPE_THETA,
  ),
  "qwen3-50m": dataclasses.replace(BENCH_MODELS["qwen3-50m"], rope_theta=ROPE_THETA),
}
SHAPES = "1:128,16:128,1:1024"


def define_flags(fv: flags.FlagValues) -> None:
  """The harness's flags, on `fv`."""
  cli_flags.define_json_flag(fv, '{"env": {...}, "rows": [...]}')
  flags.DEFINE_string(
    "models", ",".join(MODELS), f"Comma-separated subset of {', '.join(MODELS)}.", flag_values=fv
  )
  flags.DEFINE_string(
    "shapes", SHAPES, "Rows as batch:new_tokens, comma-separated.", flag_values=fv
  )
  flags.DEFINE_integer(
    "repeats",
    5,
    "Timed calls per engine and row after the warm-up; 0 = tokens only.",
    flag_values=fv,
  )
  flags.DEFINE_integer("prompt-len", 64, "Prompt tokens per row.", flag_values=fv)
  flags.DEFINE_float(
    "init-std",
    0.1,
    "Std of the random weights (init_params' scale); at 0.02 the 58M model's greedy decode "
    "falls into a loop of a few tokens, which makes a weak token check.",
    flag_values=fv,
  )


def parse_shapes(text: str) -> list[tuple[int, int]]:
  """ "1:128,16:128" -> [(1, 128), (16, 128)] (batch, new tokens), each at least 1."""
  try:
    shapes = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item.strip()]
  except ValueError:
    raise ValueError(f"--shapes must be batch:new_tokens,..., got {text!r}") from None
  if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
    raise ValueError(f"--shapes must be batch:new_tokens pairs of ints >= 1, got {text!r}")
  return shapes


class IdTokenizer:
  """Token ids as text ("5 17 9") for tunix: no BOS, pad and EOS ids outside the vocabulary."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text, **kwargs):
    return [int(x) for x in text.split()]

  def decode(self, ids, **kwargs):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0  # tunix prepends a BOS only when this is truthy

  def eos_id(self):
    return self.vocab_size

  def pad_id(self):
    return self.vocab_size


def load_engines(cfg: ModelConfig, init_std: float):
  """(opd_jax params, tunix model, transformers model) of one random checkpoint."""
  import jax
  import jax.numpy as jnp
  import torch
  import transformers
  from tunix.models.qwen3 import model as tunix_model
  from tunix.models.qwen3 import params as tunix_params

  from opd_jax.io import hf
  from opd_jax.model import transformer as model

  params = model.init_params(jax.random.key(0), cfg, jnp.float32, scale=init_std)
  tcfg = tunix_model.ModelConfig(
    num_layers=cfg.num_layers,
    vocab_size=cfg.vocab_size,
    embed_dim=cfg.hidden_size,
    hidden_dim=cfg.intermediate_size,
    num_heads=cfg.num_heads,
    head_dim=cfg.head_dim,
    num_kv_heads=cfg.num_kv_heads,
    rope_theta=int(cfg.rope_theta),
    norm_eps=cfg.rms_norm_eps,
    use_tied_embedding=cfg.tie_word_embeddings,
  )
  with tempfile.TemporaryDirectory() as directory:
    hf.save_checkpoint(directory, cfg, params)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
      tmodel = tunix_params.create_model_from_safe_tensors(directory, tcfg, mesh, jnp.float32)
  hf_model.eval()
  return params, tmodel, hf_model


def reference_tokens(hf_model, tokens_bp: np.ndarray, new: int) -> np.ndarray:
  """transformers' greedy [B, new] continuation: no EOS, so exactly `new` tokens."""
  import torch
  import transformers

  gen = transformers.GenerationConfig(
    do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0
  )
  ids = torch.from_numpy(tokens_bp.astype(np.int64))
  with torch.inference_mode():
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
  out = out[:, tokens_bp.shape[1] :].numpy()
  if out.shape != (tokens_bp.shape[0], new):
    raise RuntimeError(f"transformers returned {out.shape} tokens, expected {(len(out), new)}")
  return out


def runners(cfg: ModelConfig, params, tmodel, tokens_bp: np.ndarray, new: int) -> dict:
  """{"opd_jax": call, "tunix": call}: each decodes `tokens_bp` greedily into [B, new] ids."""
  import jax
  from tunix.generate import sampler as tunix_sampler

  from opd_jax.inference import sampler
  from opd_jax.model import kvcache

  batch, prompt = tokens_bp.shape
  scfg = sampler.SamplerConfig(
    max_new_tokens=new, temperature=0.0, kv=kvcache.KVCacheSpec("float32"), cache_len=prompt + new
  )
  prompts = (tokens_bp.astype(np.int32), np.full((batch,), prompt, np.int32))
  cache = tunix_sampler.CacheConfig(
    cache_size=prompt + new,
    num_layers=cfg.num_layers,
    num_kv_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
  )
  tsampler = tunix_sampler.Sampler(tmodel, IdTokenizer(cfg.vocab_size), cache)
  texts = [" ".join(map(str, row)) for row in tokens_bp]

  def opd():
    out = sampler.sample(params, prompts, jax.random.key(0), scfg, cfg)
    return np.asarray(out.completion_tokens)  # waits for the device

  def tunix():
    out = tsampler(
      texts,
      max_generation_steps=new,
      max_prompt_length=prompt,
      temperature=0.0,
      eos_tokens=[cfg.vocab_size],
    )
    return np.stack([np.asarray(t)[:new] for t in out.tokens])

  return {"opd_jax": opd, "tunix": tunix}


def _timed(run):
  start = time.perf_counter()
  result = run()
  return time.perf_counter() - start, result


def bench_row(name, cfg, engines, batch, new, prompt_len, repeats, log) -> dict:
  """One row: the token check against transformers, then (if both agree) the timings."""
  params, tmodel, hf_model = engines
  tokens_bp = np.random.default_rng(batch).integers(3, cfg.vocab_size, (batch, prompt_len))
  ref = reference_tokens(hf_model, tokens_bp, new)
  calls = runners(cfg, params, tmodel, tokens_bp, new)
  row = {
    "model": name,
    "params_m": round(cfg.num_params() / 1e6, 3),
    "batch": batch,
    "prompt_len": prompt_len,
    "new_tokens": new,
    "distinct_reference_tokens": int(np.unique(ref).size),  # a check that is not trivial
  }
  for engine, run in calls.items():  # the warm-up call (compiles) gives the tokens checked
    first_s, tokens = _timed(run)
    row[f"{engine}_first_s"] = round(first_s, 3)
    row[f"{engine}_equal_transformers"] = float(np.mean(tokens == ref))
  log(
    f"{name} batch {batch} x {new} new: share of tokens equal to transformers' — "
    f"opd_jax {row['opd_jax_equal_transformers']:.4f}, tunix {row['tunix_equal_transformers']:.4f}"
  )
  if min(row["opd_jax_equal_transformers"], row["tunix_equal_transformers"]) < 1.0:
    row["status"] = "tokens differ"
    return row
  row["status"] = "timed" if repeats else "tokens equal"
  if not repeats:
    return row
  times = {engine: [] for engine in calls}
  for _ in range(repeats):
    for engine, run in calls.items():
      times[engine].append(_timed(run)[0])
  for engine, seconds in times.items():
    median = statistics.median(seconds)
    row[f"{engine}_median_s"] = round(median, 4)
    row[f"{engine}_min_s"] = round(min(seconds), 4)
    row[f"{engine}_max_s"] = round(max(seconds), 4)
    row[f"{engine}_tokens_per_s"] = round(batch * new / median, 1)
  row["repeats"] = repeats
  row["ratio"] = round(row["tunix_median_s"] / row["opd_jax_median_s"], 3)
  log(f"  {row}")
  return row


def main(argv: list[str] | None = None) -> int:
  """Checks and times every (model, shape) row; prints a table, or the JSON with --json=-."""
  args = runner.parse_own_flags(define_flags, argv, __doc__)
  names = [m for m in args.models.split(",") if m]
  unknown = [m for m in names if m not in MODELS]
  if unknown or not names:
    raise ValueError(f"unknown or no model(s) {unknown}; choose from {', '.join(MODELS)}")
  shapes = parse_shapes(args.shapes)
  if args.repeats < 0:
    raise ValueError(f"--repeats must be >= 0, got {args.repeats}")
  if args.prompt_len < 1:
    raise ValueError(f"--prompt-len must be >= 1, got {args.prompt_len}")
  import importlib.metadata as metadata

  import jax

  log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json == "-" else print
  env = {
    "platform": jax.devices()[0].platform,
    "device": jax.devices()[0].device_kind,
    **{p: metadata.version(p) for p in ("jax", "google-tunix", "transformers", "torch")},
  }
  log(f"environment: {env}")
  rows = []
  for name in names:
    engines = load_engines(MODELS[name], args.init_std)
    for batch, new in shapes:
      rows.append(
        bench_row(name, MODELS[name], engines, batch, new, args.prompt_len, args.repeats, log)
      )
  if args.json:
    json_file.write_text(args.json, json.dumps({"env": env, "rows": rows}, indent=1))
    if args.json == "-":
      return 0
  print()
  print(
    f"{'model':<10} {'batch':>5} {'new':>5} {'equal opd/tunix':>15} {'opd_jax s':>19} "
    f"{'tunix s':>19} {'ratio':>6}"
  )
  for r in rows:
    equal = f"{r['opd_jax_equal_transformers']:.3f}/{r['tunix_equal_transformers']:.3f}"
    if r["status"] != "timed":
      times = f"{r['status']:>19} {'':>19} {'':>6}"
    else:
      times = " ".join(
        f"{r[f'{e}_median_s']:>7.3f} [{r[f'{e}_min_s']:.3f}-{r[f'{e}_max_s']:.3f}]"
        for e in ("opd_jax", "tunix")
      )
      times += f" {r['ratio']:>6.3f}"
    print(f"{r['model']:<10} {r['batch']:>5} {r['new_tokens']:>5} {equal:>15} {times}")
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
