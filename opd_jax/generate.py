"""`python -m opd_jax.generate`: sample completions from a local checkpoint.

Loads a Hugging Face style checkpoint directory, optionally turns the weights into
the rollout engine's FP8 weights and picks the KV-cache numerics, then runs
`sampler.sample` once on every prompt. Example:

    python -m opd_jax.generate --checkpoint /path/to/ckpt --prompt-ids 1,2,3 \
        --prompt-ids 7,7 --max-new-tokens 16 --temperature 0 --weights fp8 \
        --kv-cache fp8 --json

With `--json` (or `--json=-`) it prints one object (`--json=PATH` writes it to PATH)

    {"completions": [[ids...], ...],  # new tokens only, up to and including the stop token
     "logprobs": [[...], ...],        # behaviour log-probs of those tokens
     "text": [...]}                   # only when a tokenizer is available

Stop tokens are the tokenizer's eos (or config.json's `eos_token_id` when there is
no tokenizer), plus `--stop-ids`; `--ignore-eos` drops the eos.

`--weights`, `--kv-cache` and `--dtype` take the trainer's values and defaults
(`rollout.weights`, `rollout.kv_cache`, `student.dtype` in configs/base.py), and mean the
same engine: `--weights trainer --kv-cache auto --dtype float32` by default, and `auto` is
the engine's compute dtype (bf16 with `--weights bf16`, else `--dtype`), as in
`train.setup.engine_config`. The older spellings `--weights dense` (now `trainer`) and
`--kv-cache f32` (a float32 cache whatever the weights) still work, with a deprecation
message on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

from opd_jax.cli import flags as cli_flags
from opd_jax.config import check as config_check
from opd_jax.inference import sampler, transform
from opd_jax.io import build, hf
from opd_jax.io.build import DTYPES
from opd_jax.model import kvcache, tokenizer

WEIGHTS = config_check.RULES["rollout.weights"].options  # rollout.weights, the trainer's formats
KV_CACHES = ("auto", *kvcache.KV_CACHE_NAMES)  # rollout.kv_cache
DEFAULT_WEIGHTS, DEFAULT_KV_CACHE, DEFAULT_DTYPE = "trainer", "auto", "float32"  # as configs/base
# Older spellings -> (the value used, the message printed once per use).
DEPRECATED = {
  ("--weights", "dense"): ("trainer", "--weights dense is deprecated; use --weights trainer"),
  ("--kv-cache", "f32"): (
    "float32",
    "--kv-cache f32 is deprecated; use --kv-cache auto with --dtype float32 "
    "(a float32 cache is still used)",
  ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_parser() -> argparse.ArgumentParser:
  """The command-line interface (see the module docstring)."""
  p = argparse.ArgumentParser(prog="python -m opd_jax.generate", description=__doc__.split("\n")[0])
  p.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json + weights)")
  p.add_argument(
    "--prompt",
    dest="prompts",
    action="append",
    type=lambda s: ("text", s),
    default=[],
    help="a text prompt (needs a tokenizer); repeatable",
  )
  p.add_argument(
    "--prompt-ids",
    dest="prompts",
    action="append",
    type=lambda s: ("ids", s),
    help="a prompt as comma-separated token ids, e.g. 1,2,3; repeatable",
  )
  p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt")
  p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
  p.add_argument("--seed", type=int, default=0, help="PRNG seed")
  p.add_argument(
    "--dtype",
    default=DEFAULT_DTYPE,
    help=f"load/compute dtype, as student.dtype: {', '.join(DTYPES)} (default {DEFAULT_DTYPE})",
  )
  p.add_argument(
    "--weights",
    default=DEFAULT_WEIGHTS,
    help="as rollout.weights: trainer (as loaded in --dtype), bf16, or a quantized format of "
    f"the layer matrices: {', '.join(WEIGHTS[2:])} (default {DEFAULT_WEIGHTS})",
  )
  p.add_argument(
    "--weight-group-size",
    type=int,
    default=None,
    help="as rollout.weight_group_size: one scale per this many inputs of a quantized matrix "
    "(fp4 needs one, e.g. 32); default: one scale per output channel",
  )
  p.add_argument(
    "--kv-cache",
    default=DEFAULT_KV_CACHE,
    help="as rollout.kv_cache: auto (the engine's compute dtype: bf16 with --weights bf16, "
    "else --dtype), bf16, fp8 (e4m3), fp8_e5m2 or fp4 (e2m1, one byte per value) "
    f"(default {DEFAULT_KV_CACHE})",
  )
  p.add_argument(
    "--kv-granularity",
    default="token_head",
    help=f"quantized KV scale granularity: {', '.join(kvcache.KV_GRANULARITIES)}",
  )
  p.add_argument("--stop-ids", default="", help="extra stop token ids, comma-separated")
  p.add_argument("--ignore-eos", action="store_true", help="do not stop at the eos token")
  p.add_argument(
    "--tokenizer", default=None, help="tokenizer directory or 'char' (default: the checkpoint dir)"
  )
  cli_flags.add_json_argument(p, "one JSON object")
  return p


def _parse_ids(text: str, flag: str) -> list[int]:
  """'1, 2,3' -> [1, 2, 3]; a clear ValueError otherwise."""
  parts = [s.strip() for s in text.split(",") if s.strip()]
  try:
    return [int(s) for s in parts]
  except ValueError:
    raise ValueError(f"{flag} {text!r}: expected comma-separated integer token ids") from None


def _choice(value: str, allowed, flag: str) -> str:
  if value not in allowed:
    raise ValueError(f"{flag} {value!r} is not one of: {', '.join(allowed)}")
  return value


def _deprecated(flag: str, value: str, warn) -> str | None:
  """The value an older spelling stands for (after `warn(message)`), or None."""
  if (flag, value) not in DEPRECATED:
    return None
  new, message = DEPRECATED[(flag, value)]
  warn(f"warning: {message}")
  return new


def engine_numerics(weights: str, kv_cache: str, dtype: str) -> tuple[str, str]:
  """(EngineConfig.weights, KV dtype name) for the trainer's option values.

  The rule of `train.setup.engine_config`: the engine computes in bf16 for `weights=bf16`,
  else in `dtype`; `kv_cache=auto` stores the cache in that dtype.
  """
  engine_dtype = "bfloat16" if weights == "bf16" else dtype
  return weights, {"auto": engine_dtype, **kvcache.KV_CACHE_NAMES}[kv_cache]


def _load_tokenizer(args):
  """The tokenizer named by --tokenizer, or the checkpoint's own, or None."""
  if args.tokenizer is not None:
    return tokenizer.load_tokenizer(args.tokenizer)
  if any(os.path.exists(os.path.join(args.checkpoint, f)) for f in TOKENIZER_FILES):
    return tokenizer.load_tokenizer(args.checkpoint)
  return None


def _config_eos_ids(checkpoint: str) -> list[int]:
  """`eos_token_id` (an int or a list) from config.json, or []."""
  with open(os.path.join(checkpoint, hf.CONFIG_FILE)) as f:
    eos = json.load(f).get("eos_token_id")
  if eos is None:
    return []
  return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def generate(args, warn=lambda message: print(message, file=sys.stderr)) -> dict:
  """Runs the sampler for parsed arguments.

  Args:
    args: the `argparse.Namespace` from `build_parser()`.
    warn: called with each deprecation message (default: printed to stderr).

  Returns:
    {"completions": list[list[int]], "logprobs": list[list[float]], "text"?: list[str],
     "engine_id": str, "stop_tokens": list[int]}.

  Raises:
    ValueError: a bad flag value, no prompt, or a text prompt without a tokenizer.
    FileNotFoundError: a missing checkpoint or tokenizer directory.
  """
  dtype_name = _choice(args.dtype, DTYPES, "--dtype")
  dtype = DTYPES[dtype_name]
  weights = _deprecated("--weights", args.weights, warn) or _choice(
    args.weights, WEIGHTS, "--weights"
  )
  kv_f32 = _deprecated("--kv-cache", args.kv_cache, warn)
  kv_flag = "auto" if kv_f32 else _choice(args.kv_cache, KV_CACHES, "--kv-cache")
  weights, kv_dtype = engine_numerics(weights, kv_flag, dtype_name)
  kv_dtype = kv_f32 or kv_dtype
  granularity = _choice(args.kv_granularity, kvcache.KV_GRANULARITIES, "--kv-granularity")
  if not args.prompts:
    raise ValueError("no prompt given: pass --prompt TEXT or --prompt-ids 1,2,3 (repeatable)")
  if not os.path.isdir(args.checkpoint):
    raise FileNotFoundError(f"checkpoint directory {args.checkpoint!r} does not exist")
  tok = _load_tokenizer(args)
  prompts = []
  for kind, value in args.prompts:
    if kind == "ids":
      prompts.append(_parse_ids(value, "--prompt-ids"))
    elif tok is None:
      raise ValueError(
        f"--prompt {value!r} needs a tokenizer, but {args.checkpoint} has none "
        f"({' / '.join(TOKENIZER_FILES)}); pass --tokenizer DIR or use --prompt-ids"
      )
    else:
      bos = [] if tok.bos_id is None else [tok.bos_id]
      prompts.append(bos + tok.encode(value))

  stops = _parse_ids(args.stop_ids, "--stop-ids")
  if not args.ignore_eos:
    stops += [tok.eos_id] if tok is not None else _config_eos_ids(args.checkpoint)
  model_cfg, params = hf.load_checkpoint(args.checkpoint, dtype)
  if tok is not None and tokenizer.real_vocab_size(tok) < model_cfg.vocab_size:
    # A padded table: like the trainer, sample over the tokenizer's ids only.
    model_cfg = build.with_real_vocab(model_cfg, tokenizer.real_vocab_size(tok))
  engine_cfg = transform.EngineConfig(
    weights=weights,
    kv=kvcache.KVCacheSpec(dtype=kv_dtype, granularity=granularity),
    weight_group_size=args.weight_group_size,
  )
  params = transform.engine_params(params, engine_cfg, jax.random.key(args.seed))
  cfg = sampler.SamplerConfig(
    max_new_tokens=args.max_new_tokens,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    stop_tokens=tuple(dict.fromkeys(stops)),
    kv=engine_cfg.kv,
  )
  out = sampler.sample(
    params, prompts, jax.random.key(args.seed), cfg, model_cfg, engine_id=engine_cfg.engine_id
  )
  tokens, mask, logprobs = jax.device_get(
    (out.completion_tokens, out.completion_mask, out.behaviour_logprobs)
  )
  keep = [np.asarray(m, bool) for m in mask]
  result = {
    "completions": [t[k].tolist() for t, k in zip(tokens, keep, strict=True)],
    "logprobs": [lp[k].tolist() for lp, k in zip(logprobs, keep, strict=True)],
  }
  if tok is not None:
    result["text"] = [tok.decode(ids) for ids in result["completions"]]
  result["engine_id"] = out.engine_id
  result["stop_tokens"] = list(cfg.stop_tokens)
  return result


def main(argv: list[str] | None = None) -> int:
  """Parses `argv`, samples, and prints the result (JSON with --json)."""
  args = build_parser().parse_args(argv)
  result = generate(args)
  if args.json:
    payload = {k: result[k] for k in ("completions", "logprobs", "text") if k in result}
    cli_flags.write_json(json.dumps(payload), args.json)
    if args.json == "-":
      return 0
  print(f"engine {result['engine_id']}, stop tokens {result['stop_tokens']}")
  for i, ids in enumerate(result["completions"]):
    mean_lp = float(np.mean(result["logprobs"][i])) if ids else 0.0
    shown = repr(result["text"][i]) if "text" in result else " ".join(map(str, ids))
    print(f"[{i}] {len(ids)} tokens, mean logprob {mean_lp:.3f}: {shown}")
  return 0


if __name__ == "__main__":
  try:
    sys.exit(main())
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
