"""`python -m opd_jax.generate`: sample completions from a local checkpoint.

Loads a Hugging Face style checkpoint directory, optionally turns the weights into
the rollout engine's FP8 weights and picks the KV-cache numerics, then runs
`sampler.sample` once on every prompt. Example:

    python -m opd_jax.generate --checkpoint=/path/to/ckpt --prompt-ids=1,2,3
        --prompt-ids=7,7 --max-new-tokens=16 --temperature=0
        --rollout=rollout.weights=fp8,rollout.kv_cache=fp8 --json

With `--json` (or `--json=-`) it prints one object (`--json=PATH` writes it to PATH)

    {"completions": [[ids...], ...],  # new tokens only, up to and including the stop token
     "logprobs": [[...], ...],        # behaviour log-probs of those tokens
     "text": [...]}                   # only when a tokenizer is available

Stop tokens are the tokenizer's eos (or config.json's `eos_token_id` when there is
no tokenizer), plus `--stop-ids`; `--ignore-eos` drops the eos.

`--rollout` is a rollout spec in the admission check's syntax, `rollout.<key>=<value>[,...]`
with the keys rollout.weights, rollout.kv_cache, rollout.kv_granularity and
rollout.weight_group_size; they and `--dtype` take the trainer's values and defaults
(configs/base.py) and mean the same engine: trainer weights, `kv_cache=auto` and float32 by
default, and `auto` is the engine's compute dtype (bf16 with `rollout.weights=bf16`, else
`--dtype`), as in `train.setup.engine_config`. The older `--weights`, `--kv-cache`,
`--kv-granularity` and `--weight-group-size` flags still work for this release, with a
warning, as do their old values `dense` (now `trainer`) and `f32` (a float32 cache whatever
the weights).
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.config import check as config_check
from opd_jax.config import values
from opd_jax.io import json_file

WEIGHTS = config_check.RULES["rollout.weights"].options  # rollout.weights, the trainer's formats
KV_CACHES = config_check.RULES["rollout.kv_cache"].options  # rollout.kv_cache
KV_GRANULARITIES = config_check.RULES["rollout.kv_granularity"].options
DTYPE_NAMES = config_check.RULES["student.dtype"].options  # io.build.DTYPES
DEFAULT_WEIGHTS, DEFAULT_KV_CACHE, DEFAULT_DTYPE = "trainer", "auto", "float32"  # as configs/base
# The keys --rollout takes -> the attribute of the parsed arguments each sets, and its default.
ROLLOUT_KEYS = {
  "rollout.weights": ("weights", DEFAULT_WEIGHTS),
  "rollout.kv_cache": ("kv_cache", DEFAULT_KV_CACHE),
  "rollout.kv_granularity": ("kv_granularity", "token_head"),
  "rollout.weight_group_size": ("weight_group_size", 0),
}
OLD_ROLLOUT_FLAGS = ("weights", "kv-cache", "kv-granularity", "weight-group-size")
# Older values -> (the value used, the message printed once per use).
DEPRECATED = {
  ("--weights", "dense"): ("trainer", "--weights dense is deprecated; use --weights trainer"),
  ("--kv-cache", "f32"): (
    "float32",
    "--kv-cache f32 is deprecated; use --kv-cache auto with --dtype float32 "
    "(a float32 cache is still used)",
  ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags (see the module docstring), on `fv`."""
  flags.DEFINE_string(
    "checkpoint", None, "Checkpoint directory (config.json + weights).", flag_values=fv
  )
  flags.DEFINE_multi_string("prompt", [], "A text prompt (needs a tokenizer).", flag_values=fv)
  flags.DEFINE_multi_string(
    "prompt-ids",
    [],
    "A prompt as comma-separated token ids, e.g. 1,2,3.",
    flag_values=fv,
  )
  flags.DEFINE_integer("max-new-tokens", 32, "Tokens to generate per prompt.", flag_values=fv)
  flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 = greedy.", flag_values=fv)
  flags.DEFINE_integer("top-k", 0, "Top-k sampling; 0 = off.", flag_values=fv)
  flags.DEFINE_float("top-p", 1.0, "Nucleus mass in (0, 1].", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "PRNG seed.", flag_values=fv)
  flags.DEFINE_string(
    "dtype",
    DEFAULT_DTYPE,
    f"Load/compute dtype, as student.dtype: {', '.join(DTYPE_NAMES)}.",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "rollout",
    "",
    "rollout.<key>=<value>[,...]: the engine, as the trainer's rollout config names it. "
    f"rollout.weights: trainer (as loaded in --dtype), bf16, or {', '.join(WEIGHTS[2:])}; "
    f"rollout.kv_cache: auto (the engine's compute dtype), {', '.join(KV_CACHES[1:])}; "
    f"rollout.kv_granularity: {', '.join(KV_GRANULARITIES)}; rollout.weight_group_size: one "
    "scale per this many inputs of a quantized matrix (fp4 needs one, e.g. 32), 0 = per "
    "output channel. Default: trainer weights, kv_cache=auto.",
    flag_values=fv,
  )
  for name, key in zip(OLD_ROLLOUT_FLAGS, ROLLOUT_KEYS, strict=True):
    flags.DEFINE_string(name, None, f"Deprecated: --rollout={key}=VALUE.", flag_values=fv)
  flags.DEFINE_string("stop-ids", "", "Extra stop token ids, comma-separated.", flag_values=fv)
  flags.DEFINE_bool("ignore-eos", False, "Do not stop at the eos token.", flag_values=fv)
  flags.DEFINE_string(
    "tokenizer", None, "Tokenizer directory or 'char'; default: the checkpoint's.", flag_values=fv
  )
  flags.DEFINE_string(
    "json",
    None,
    "Write one JSON object to PATH; - (or a bare --json) prints only it to stdout.",
    flag_values=fv,
  )


def parse_args(argv: list[str] | None, warn=cli_flags.warn_deprecated):
  """The parsed command line: the flags as attributes, `prompts` as ("text"|"ids", value) in
  the order given, and the engine settings of `--rollout` (or the old flags, with a warning)
  as `weights`, `kv_cache`, `kv_granularity` and `weight_group_size`."""
  args_in = list(sys.argv[1:] if argv is None else argv)
  args = runner.parse_own_flags(
    define_flags, args_in, __doc__, required=("checkpoint",), hidden=OLD_ROLLOUT_FLAGS
  )
  texts, ids = iter(args.prompt), iter(args.prompt_ids)
  given = [
    a.split("=", 1)[0] for a in args_in if a.split("=", 1)[0] in ("--prompt", "--prompt-ids")
  ]
  args.prompts = [("text", next(texts)) if g == "--prompt" else ("ids", next(ids)) for g in given]
  for key, (attr, default) in ROLLOUT_KEYS.items():
    old = getattr(args, attr)
    if old is not None:
      warn(f"--{attr.replace('_', '-')}", f"--rollout={key}=VALUE")
      setattr(args, attr, values.parse_value(old, default))
    else:
      setattr(args, attr, default)
  for item in values.split_spec(args.rollout) if args.rollout else []:
    key, sep, raw = item.partition("=")
    if not sep or key not in ROLLOUT_KEYS:
      raise ValueError(
        f"--rollout {item!r}: expected one of {', '.join(ROLLOUT_KEYS)} as KEY=VALUE"
      )
    attr, default = ROLLOUT_KEYS[key]
    setattr(args, attr, values.parse_value(raw, default))
  args.weight_group_size = args.weight_group_size or None
  return args


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
  from opd_jax.model import kvcache

  engine_dtype = "bfloat16" if weights == "bf16" else dtype
  return weights, {"auto": engine_dtype, **kvcache.KV_CACHE_NAMES}[kv_cache]


def _load_tokenizer(args):
  """The tokenizer named by --tokenizer, or the checkpoint's own, or None."""
  from opd_jax.model import tokenizer

  if args.tokenizer is not None:
    return tokenizer.load_tokenizer(args.tokenizer)
  if any(os.path.exists(os.path.join(args.checkpoint, f)) for f in TOKENIZER_FILES):
    return tokenizer.load_tokenizer(args.checkpoint)
  return None


def _config_eos_ids(checkpoint: str) -> list[int]:
  """`eos_token_id` (an int or a list) from config.json, or []."""
  from opd_jax.io import hf

  with open(os.path.join(checkpoint, hf.CONFIG_FILE)) as f:
    eos = json.load(f).get("eos_token_id")
  if eos is None:
    return []
  return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def generate(args, warn=lambda message: print(message, file=sys.stderr)) -> dict:
  """Runs the sampler for parsed arguments.

  Args:
    args: the parsed command line, `parse_args(argv)`.
    warn: called with each deprecation message (default: printed to stderr).

  Returns:
    {"completions": list[list[int]], "logprobs": list[list[float]], "text"?: list[str],
     "engine_id": str, "stop_tokens": list[int]}.

  Raises:
    ValueError: a bad flag value, no prompt, or a text prompt without a tokenizer.
    FileNotFoundError: a missing checkpoint or tokenizer directory.
  """
  import jax
  import numpy as np

  from opd_jax.inference import sampler, transform
  from opd_jax.io import build, hf
  from opd_jax.io.build import DTYPES
  from opd_jax.model import kvcache, tokenizer

  dtype_name = _choice(args.dtype, DTYPES, "--dtype")
  dtype = DTYPES[dtype_name]
  weights = _deprecated("--weights", args.weights, warn) or _choice(
    args.weights, WEIGHTS, "rollout.weights"
  )
  kv_f32 = _deprecated("--kv-cache", args.kv_cache, warn)
  kv_flag = "auto" if kv_f32 else _choice(args.kv_cache, KV_CACHES, "rollout.kv_cache")
  weights, kv_dtype = engine_numerics(weights, kv_flag, dtype_name)
  kv_dtype = kv_f32 or kv_dtype
  granularity = _choice(args.kv_granularity, KV_GRANULARITIES, "rollout.kv_granularity")
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
  import numpy as np

  args = parse_args(argv)
  result = generate(args)
  if args.json:
    payload = {k: result[k] for k in ("completions", "logprobs", "text") if k in result}
    json_file.write_text(args.json, json.dumps(payload))
    if args.json == "-":
      return 0
  print(f"engine {result['engine_id']}, stop tokens {result['stop_tokens']}")
  for i, ids in enumerate(result["completions"]):
    mean_lp = float(np.mean(result["logprobs"][i])) if ids else 0.0
    shown = repr(result["text"][i]) if "text" in result else " ".join(map(str, ids))
    print(f"[{i}] {len(ids)} tokens, mean logprob {mean_lp:.3f}: {shown}")
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True, error_status=2)
