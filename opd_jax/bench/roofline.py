"""The device's measured limits, and the train step and the sampler's decode against them.

Command (any backend JAX sees; results: docs/results/benchmarks.md):

    python -m opd_jax.bench.roofline                       # readable table
    python -m opd_jax.bench.roofline --json                # the JSON result only
    python -m opd_jax.bench.roofline --models=qwen3-50m --decode-tokens=8,40   # a CPU's size

Peaks, measured here (medians of `--repeats` calls after two warm-up calls):

* `matmul_flops_per_s`: C = A·B of two [n, n] matrices (`--matmul-size` n; 0 picks 8192 on an
  accelerator, 2048 on a CPU), 2n³ FLOPs per call, per dtype: "float32" at JAX's default
  precision (TF32 on GPUs that have it), "float32_highest" (`Precision.HIGHEST`), "bfloat16",
  and "float8_e4m3fn" (e4m3 × e4m3 with f32 accumulation, as `quant_compute.fp8_matmul` does) where
  `quant_compute.has_native_fp8()`; "n/a" where the device has no FP8 matrix units.
* `copy_bytes_per_s`: x ← x + 1 (donated, in place) over an f32 array of `--copy-mb` MB (0:
  1024 on an accelerator, 256 on a CPU), 2 × its bytes per call (one read, one write).

Rows, per model of `--models` (random weights in the compute dtype `--dtype`; "auto" is
bfloat16 on an accelerator, float32 on a CPU), each with its achieved rate as a fraction of
the peak it is bound by:

* "train": the OPD train step (`train_step.train_step`: reverse KL on sampled tokens, a teacher
  of the same shape whose forward pass runs inside the step, AdamW, state donated) on
  `--train-batch` rows of `--prompt-len` prompt + `--completion-len` completion tokens.
  FLOPs from XLA's cost analysis of the compiled step (`compiled.cost_analysis()["flops"]`:
  every dot 2·M·N·K, elementwise work one per element); `hand_flops` is the cross-check
  8 · W · B · (P + C), with W the matmul weights of `matmul_params` (student forward 2,
  backward 4, teacher forward 2; attention scores not counted). Against the matmul peak of
  the compute dtype.
* "decode": the sampler (`sampler.sample`, greedy, KV cache in the compute dtype, the
  platform's default attention: blockwise on CPU and TPU, the reference on a GPU) at
  `--decode-batches` rows. One decode step's seconds are the difference of two calls, with C₁
  and C₂ new tokens (`--decode-tokens`, same cache of S = P + C₂ slots), over C₂ − C₁ steps, so
  the prefill and the call's fixed costs cancel. Counted by hand per step, with c̄ the mean over
  those steps of the cache slots the attention reads (`slots_read`: all S for the reference;
  the blocks up to the step's position for blockwise, which is all S while S ≤ one block):

      bytes = weight bytes + B · c̄ · 2·L·K·H·itemsize        (against the copy bandwidth)
      FLOPs = B · (2·W + 4·L·N·H·c̄)                          (against the matmul peak)

  where the weight bytes are every weight read once (the unembedding included; the input
  embedding's lookup, B rows, is not counted) and the cache term is K and V of the filled
  prefix of every layer. Batch 1 is read as bytes/s, larger batches as FLOP/s; both figures
  are in every row. A batch-1 row also times `matvec_chain_seconds`: the same weights read
  through a chain of the device's own batch-1 dots and nothing else, with
  `step_over_matvec_chain` the decode step's seconds over it (1.0: the step costs no more
  than its dots; the dots' own rate, `matvec_chain_bytes_per_s`, against the copy bandwidth
  says how much of the gap to the bandwidth lies in the dots), and the same chain with the
  projections that share an input joined (`fused_decode_matrices`: q|k|v and gate|up, 4 dots
  per layer instead of 7), with `fused_chain_over_matvec_chain` its seconds over the unfused
  chain's (below 1: fusing the projections would speed the dots). A larger batch's row times
  the same chain with x of `batch` rows (`dot_chain_seconds`), and `step_over_dot_chain` is
  the step over it: what the step spends beyond its matrix products at that batch.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from absl import flags

from opd_jax.bench import timing
from opd_jax.bench.sampler import MODELS as SAMPLER_MODELS
from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file
from opd_jax.model.config import ModelConfig


def _qwen3(vocab, hidden, inter, layers, heads, kv_heads, head_dim) -> ModelConfig:
  """A Qwen3 shape (q/k norms, tied embeddings, θ = 1e6) with random weights."""
  return ModelConfig(
    "qwen3",
    vocab,
    hidden,
    inter,
    layers,
    heads,
    kv_heads,
    head_dim,
    rope_theta=1e6,
    tie_word_embeddings=True,
    qk_norm=True,
  )


# A decode row's error when its two calls' difference drowned in the machine's noise.
DROWNED = "the longer call was not slower; rerun on a quieter machine"

# The bench's own shapes ("tiny", "qwen3-50m" of bench/sampler.py) and Qwen3's smallest two.
MODELS = {
  **SAMPLER_MODELS,
  "qwen3-0.6b": _qwen3(151936, 1024, 3072, 28, 16, 8, 128),
  "qwen3-1.7b": _qwen3(151936, 2048, 6144, 28, 16, 8, 128),
}
DEFAULT_MODELS = "qwen3-50m,qwen3-0.6b"
FP8 = "float8_e4m3fn"
NOT_AVAILABLE = "n/a"


def resolve_dtype(dtype: str) -> str:
  """`dtype`, with "auto" as bfloat16 on an accelerator and float32 on a CPU.

  Raises:
    ValueError: a dtype other than auto, float32, bfloat16.
  """
  import jax

  if dtype == "auto":
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"
  if dtype not in ("float32", "bfloat16"):
    raise ValueError(f"--dtype must be auto, float32 or bfloat16, got {dtype!r}")
  return dtype


def matmul_params(cfg: ModelConfig) -> int:
  """W: the weights every token multiplies, L·(D·N·H + 2·D·K·H + N·H·D + 3·D·F) + V·D (the
  attention projections, the SwiGLU, the unembedding; no norms, biases or embedding lookup)."""
  d, f, n, k, h = (
    cfg.hidden_size,
    cfg.intermediate_size,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
  )
  return cfg.num_layers * (2 * d * n * h + 2 * d * k * h + 3 * d * f) + cfg.vocab_size * d


BLOCK_PATHS = ("blockwise", "pallas")  # the decode attentions that read only the filled blocks


def slots_read(position: int, slots: int, attention: str, block: int | None = None) -> int:
  """Cache slots one decode step at `position` reads with a cache of `slots`: for the block
  paths (BLOCK_PATHS) ⌈(position + 1) / size⌉ blocks of size = min(block, slots), block
  `decode_attention.BLOCK` unless given (`decode_attention.attend_cache`; its last block may
  overlap the one before); all of them for any other (the reference)."""
  if attention not in BLOCK_PATHS:
    return slots
  if block is None:
    from opd_jax.model import decode_attention

    block = decode_attention.BLOCK
  size = min(block, slots)
  return -(-(position + 1) // size) * size


def decode_counts(cfg: ModelConfig, itemsize: int, batch: int, context: float) -> dict:
  """Bytes and FLOPs of one decode step by hand (module docstring), with `context` the cache
  slots its attention reads per row (the mean over the steps timed).

  Returns:
    {"weight_bytes", "kv_bytes", "bytes", "flops"} per step of `batch` rows.
  """
  weight_params = cfg.num_params() - (
    0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
  )
  kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
  kv_bytes = batch * context * kv_per_token
  attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
  return {
    "weight_bytes": weight_params * itemsize,
    "kv_bytes": kv_bytes,
    "bytes": weight_params * itemsize + kv_bytes,
    "flops": batch * (2 * matmul_params(cfg) + attention),
  }


def _cost_flops(compiled) -> float:
  """`flops` of XLA's cost analysis (a dict, or a list of one dict on older JAX)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, list | tuple):
    cost = cost[0]
  return float(cost["flops"])


def matmul_peak(dtype: str, size: int, repeats: int) -> float:
  """FLOP/s of one [n, n]·[n, n] matmul in `dtype` ("float32", "float32_highest", "bfloat16",
  "float8_e4m3fn"): 2n³ over the median seconds."""
  import jax
  import jax.numpy as jnp

  precision = jax.lax.Precision.HIGHEST if dtype == "float32_highest" else None
  stored = "float32" if dtype == "float32_highest" else dtype
  accumulate = jnp.float32 if dtype == FP8 else None
  a, b = (
    (jax.random.normal(jax.random.key(i), (size, size), jnp.float32) / 4).astype(stored)
    for i in (0, 1)
  )
  dims = (((1,), (0,)), ((), ()))
  product = jax.jit(
    lambda a, b: jax.lax.dot_general(
      a, b, dims, precision=precision, preferred_element_type=accumulate
    )
  )
  seconds = timing.median_seconds(lambda: product(a, b).block_until_ready(), repeats)
  return 2 * size**3 / seconds


def copy_bandwidth(megabytes: int, repeats: int) -> float:
  """Bytes/s of x ← x + 1 over an f32 array of `megabytes` MB: 2 × its bytes per call.

  The array is donated and updated in place, so each call reads and writes memory that is
  already mapped; a fresh output buffer per call would also time the first touch of its pages
  (on a CPU that cost more than the copy itself and understated the bandwidth several-fold).
  """
  import jax
  import jax.numpy as jnp

  state = {"x": jnp.zeros((megabytes * 2**20 // 4,), jnp.float32)}
  nbytes = state["x"].nbytes
  step = jax.jit(lambda x: x + 1, donate_argnums=0)

  def call():
    state["x"] = step(state["x"])
    state["x"].block_until_ready()

  seconds = timing.median_seconds(call, repeats)
  return 2 * nbytes / seconds


def peaks(matmul_size: int, copy_mb: int, repeats: int, log=print) -> dict:
  """The device's measured limits (module docstring); sizes 0 pick the backend's default."""
  import jax

  from opd_jax.model import quant_compute

  cpu = jax.default_backend() == "cpu"
  size = matmul_size or (2048 if cpu else 8192)
  megabytes = copy_mb or (256 if cpu else 1024)
  native = quant_compute.has_native_fp8()
  flops = {}
  for dtype in ("float32", "float32_highest", "bfloat16", FP8):
    flops[dtype] = matmul_peak(dtype, size, repeats) if dtype != FP8 or native else NOT_AVAILABLE
    log(f"peak matmul {dtype}: {_human(flops[dtype], 'FLOP/s')}")
  bandwidth = copy_bandwidth(megabytes, repeats)
  log(f"peak copy: {_human(bandwidth, 'B/s')}")
  return {
    "matmul_size": size,
    "copy_mb": megabytes,
    "fp8_native": native,
    "matmul_flops_per_s": flops,
    "copy_bytes_per_s": bandwidth,
  }


def _rollout(cfg: ModelConfig, batch: int, prompt_len: int, completion_len: int):
  """A Rollout of random tokens, every completion token counted, log-probs 0."""
  import jax.numpy as jnp
  import numpy as np

  from opd_jax.data.rollout_types import Rollout

  rng = np.random.default_rng(0)
  zeros = jnp.zeros((batch, completion_len), jnp.float32)
  return Rollout(
    prompt_tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, prompt_len)), jnp.int32),
    prompt_lens=jnp.full((batch,), prompt_len, jnp.int32),
    completion_tokens=jnp.asarray(
      rng.integers(3, cfg.vocab_size, (batch, completion_len)), jnp.int32
    ),
    completion_mask=jnp.ones((batch, completion_len), jnp.int32),
    behaviour_logprobs=zeros,
    model_logprobs=zeros,
    weight_version=jnp.zeros((), jnp.int32),
  )


def train_row(
  name: str, dtype: str, batch: int, prompt_len: int, completion_len: int, repeats: int, peak: dict
) -> dict:
  """The "train" row of model `name` (module docstring)."""
  import jax
  import jax.numpy as jnp

  from opd_jax.model import transformer as model
  from opd_jax.train import state as train_state
  from opd_jax.train import train_step

  cfg = MODELS[name]
  student = model.init_params(jax.random.key(0), cfg, jnp.dtype(dtype))
  teacher = model.init_params(jax.random.key(1), cfg, jnp.dtype(dtype))
  rollout = _rollout(cfg, batch, prompt_len, completion_len)
  tx = train_state.make_optimizer(1e-5, 1000, 0, 0.0, 1.0)
  step = functools.partial(
    train_step.train_step,
    tx=tx,
    student_cfg=cfg,
    teacher_cfg=cfg,
    loss_cfg=train_step.LossConfig(),
  )
  holder = [train_state.init_state(student, tx, 0)]
  compiled = jax.jit(step, donate_argnums=0).lower(holder[0], teacher, rollout).compile()
  flops = _cost_flops(compiled)

  def call():
    holder[0], metrics = compiled(holder[0], teacher, rollout)
    jax.block_until_ready((holder[0], metrics))

  seconds = timing.median_seconds(call, repeats)
  tokens = batch * (prompt_len + completion_len)
  bound = peak["matmul_flops_per_s"][dtype]
  return {
    "kind": "train",
    "model": name,
    "params_m": round(cfg.num_params() / 1e6, 2),
    "dtype": dtype,
    "batch": batch,
    "tokens": tokens,
    "seconds": seconds,
    "flops": flops,
    "flops_source": "XLA cost analysis of the compiled step",
    "hand_flops": 8 * matmul_params(cfg) * tokens,
    "flops_per_s": flops / seconds,
    "peak": f"matmul {dtype}",
    "fraction_of_peak": flops / seconds / bound,
  }


def decode_matrices(params) -> list:
  """Every matrix a decode step multiplies by, as 2-D [in, out] views in the step's order (each
  layer's `quant.LAYER_MATRICES`, then the LM head); a tied head is the embedding table [V, D],
  kept as stored and marked by being the last entry of a params tree without "lm_head_dv"."""
  from opd_jax.model.quant import LAYER_MATRICES

  matrices = [
    layer[key].reshape(math.prod(layer[key].shape[:axes]), -1)
    for layer in params["layers"]
    for key, axes in LAYER_MATRICES.items()
  ]
  return [*matrices, params.get("lm_head_dv", params["embed_vd"])]


FUSED_GROUPS = (("q_dnh", "k_dkh", "v_dkh"), ("o_nhd",), ("gate_df", "up_df"), ("down_fd",))


def fused_decode_matrices(params) -> list:
  """`decode_matrices` with the matrices that share an input joined along their outputs: per
  layer [D, (N + 2K)·H] for q, k and v, o, [D, 2F] for gate and up, and down (FUSED_GROUPS).
  The same bytes in 4 dots per layer instead of 7: what fusing the projections would buy."""
  import jax.numpy as jnp

  from opd_jax.model.quant import LAYER_MATRICES

  unfused = decode_matrices(params)
  keys, out = list(LAYER_MATRICES), []
  for i in range(len(params["layers"])):
    layer = dict(zip(keys, unfused[i * len(keys) : (i + 1) * len(keys)], strict=True))
    out += [jnp.concatenate([layer[k] for k in group], axis=1) for group in FUSED_GROUPS]
  return [*out, unfused[-1]]


def dot_chain_seconds(
  matrices: list, repeats: int, passes: int, last_transposed=False, batch: int = 1
) -> float:
  """Seconds of one pass of dots through `matrices` in turn: x·W for x [batch, in] and each
  [in, out] W, or W·xᵀ for the last when `last_transposed` (a [V, D] head). Each x is built
  from the previous product's first element, so no dot can be skipped or run ahead; `passes`
  passes run in one `lax.fori_loop`, and the median call over `passes` is one pass."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def chain(matrices):
    def one_pass(_, s):
      for i, w in enumerate(matrices):
        if last_transposed and i == len(matrices) - 1:
          product = (w @ jnp.full((w.shape[1], batch), s, w.dtype)).reshape(-1)
        else:
          product = (jnp.full((batch, w.shape[0]), s, w.dtype) @ w).reshape(-1)
        s = s + product[0].astype(s.dtype) * 1e-9
      return s

    return jax.lax.fori_loop(0, passes, one_pass, jnp.float32(0.0))

  seconds = timing.median_seconds(lambda: chain(matrices).block_until_ready(), repeats)
  return seconds / passes


def matvec_chain_seconds(params, repeats: int, passes: int = 8) -> float:
  """Seconds to read every matmul weight of `params` once through batch-1 XLA dots: one pass of
  `dot_chain_seconds` over `decode_matrices` (W·x for a tied [V, D] head). This is the floor of
  a decode step built from the device's own unfused dots: the weight bytes over these seconds
  is the rate XLA's matrix-vector products reach on these shapes.
  """
  tied = "lm_head_dv" not in params
  return dot_chain_seconds(decode_matrices(params), repeats, passes, last_transposed=tied)


def decode_row(
  name: str,
  dtype: str,
  batch: int,
  prompt_len: int,
  new_tokens: tuple[int, int],
  repeats: int,
  peak: dict,
) -> dict:
  """The "decode" row of model `name` at `batch` rows (module docstring)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from opd_jax.inference import sampler
  from opd_jax.model import transformer as model

  short, long = new_tokens
  cfg = MODELS[name]
  params = model.init_params(jax.random.key(0), cfg, jnp.dtype(dtype))
  tokens_bp = np.random.default_rng(batch).integers(3, cfg.vocab_size, (batch, prompt_len))
  prompts = (tokens_bp.astype(np.int32), np.full((batch,), prompt_len, np.int32))
  seconds = {}
  for count in (short, long):
    scfg = sampler.SamplerConfig(max_new_tokens=count, temperature=0.0, cache_len=prompt_len + long)

    def call(scfg=scfg):
      out = sampler.sample(params, prompts, jax.random.key(0), scfg, cfg)
      jax.block_until_ready(out.completion_tokens)

    seconds[count] = timing.median_seconds(call, repeats)
  step_s = (seconds[long] - seconds[short]) / (long - short)
  attention = model.resolve_attention("auto")
  positions = range(prompt_len + short, prompt_len + long)  # the steps the difference times
  context = float(np.mean([slots_read(t, prompt_len + long, attention) for t in positions]))
  counts = decode_counts(cfg, jnp.dtype(dtype).itemsize, batch, context)
  row = {
    "kind": "decode",
    "model": name,
    "params_m": round(cfg.num_params() / 1e6, 2),
    "dtype": dtype,
    "batch": batch,
    "new_tokens": list(new_tokens),
    "call_seconds": {str(k): v for k, v in seconds.items()},
    "step_seconds": step_s,
    "mean_context": context,
    **counts,
    "counted_by": "hand: weights once + K and V of the filled prefix per step",
  }
  tied = "lm_head_dv" not in params
  if batch == 1:  # the same weights through the device's own unfused dots, no other work
    chain_s = matvec_chain_seconds(params, repeats)
    fused_s = dot_chain_seconds(fused_decode_matrices(params), repeats, 8, tied)
    row |= {
      "matvec_chain_seconds": chain_s,
      "matvec_chain_bytes_per_s": counts["weight_bytes"] / chain_s,
      "fused_chain_seconds": fused_s,
      "fused_chain_over_matvec_chain": fused_s / chain_s,
    }
  else:  # the same weights through the device's own dots at this batch, no other work
    chain_s = dot_chain_seconds(decode_matrices(params), repeats, 4, tied, batch)
    row["dot_chain_seconds"] = chain_s
  if step_s <= 0:  # the two calls' difference drowned in noise: no rate to report
    return row | {"error": DROWNED}
  row["step_over_matvec_chain" if batch == 1 else "step_over_dot_chain"] = step_s / chain_s
  bytes_per_s, flops_per_s = counts["bytes"] / step_s, counts["flops"] / step_s
  bound = "bandwidth" if batch == 1 else f"matmul {dtype}"
  fraction = (
    bytes_per_s / peak["copy_bytes_per_s"]
    if batch == 1
    else flops_per_s / peak["matmul_flops_per_s"][dtype]
  )
  return row | {
    "tokens_per_s": batch / step_s,
    "bytes_per_s": bytes_per_s,
    "flops_per_s": flops_per_s,
    "peak": bound,
    "fraction_of_peak": fraction,
  }


def run(
  models: list[str],
  dtype: str = "auto",
  repeats: int = 3,
  matmul_size: int = 0,
  copy_mb: int = 0,
  train_batch: int = 16,
  prompt_len: int = 64,
  completion_len: int = 128,
  decode_batches: tuple[int, ...] = (1, 64),
  decode_tokens: tuple[int, int] = (32, 160),
  log=print,
) -> dict[str, Any]:
  """{"device", "peaks", "rows"}: the module docstring's peaks and rows.

  Raises:
    ValueError: an unknown model, a non-positive size, or decode_tokens not two increasing
      counts ≥ 1.
  """
  import jax

  unknown = [m for m in models if m not in MODELS]
  if unknown or not models:
    raise ValueError(f"unknown or no model(s) {unknown}; choose from {', '.join(MODELS)}")
  if min(repeats, train_batch, prompt_len, completion_len, *decode_batches) < 1:
    raise ValueError("repeats, batches and lengths must be >= 1")
  if len(decode_tokens) != 2 or not 1 <= decode_tokens[0] < decode_tokens[1]:
    raise ValueError(f"decode_tokens must be two counts 1 <= C1 < C2, got {decode_tokens}")
  dtype = resolve_dtype(dtype)
  device = jax.devices()[0]
  result = {
    "device": {
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
    },
    "dtype": dtype,
    "peaks": peaks(matmul_size, copy_mb, repeats, log),
    "rows": [],
  }
  for name in models:
    row = train_row(name, dtype, train_batch, prompt_len, completion_len, repeats, result["peaks"])
    result["rows"].append(row)
    log(row_line(row))
    for batch in decode_batches:
      row = decode_row(name, dtype, batch, prompt_len, decode_tokens, repeats, result["peaks"])
      result["rows"].append(row)
      log(row_line(row))
  return result


def _human(value, unit: str) -> str:
  if not isinstance(value, int | float):
    return str(value)
  exponent = min(max(int(math.log10(abs(value)) // 3), 0), 5) if value else 0
  return f"{value / 10 ** (3 * exponent):.3g} {' kMGTP'[exponent].strip()}{unit}"


def row_line(row: dict) -> str:
  """One row as a table line."""
  what = f"{row['kind']:<6} {row['model']:<11} {row['dtype']:<8} B={row['batch']:<3}"
  if "fraction_of_peak" not in row:
    return f"{what} {row.get('error', '')}"
  rate = (
    _human(row["bytes_per_s"], "B/s")
    if row["peak"] == "bandwidth"
    else _human(row["flops_per_s"], "FLOP/s")
  )
  line = f"{what} {rate:>14} = {100 * row['fraction_of_peak']:5.1f}% of {row['peak']}"
  for key in ("step_over_matvec_chain", "step_over_dot_chain"):
    if key in row:
      line += f" ({row[key]:.2f}x its chain of dots)"
  return line


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv, '{"device", "peaks", "rows"}')
  flags.DEFINE_string(
    "models", DEFAULT_MODELS, f"Comma-separated subset of {', '.join(MODELS)}.", flag_values=fv
  )
  flags.DEFINE_string(
    "dtype", "auto", "auto | float32 | bfloat16 (module docstring).", flag_values=fv
  )
  flags.DEFINE_integer("repeats", 3, "Timed calls per figure (medians).", flag_values=fv)
  flags.DEFINE_integer("matmul-size", 0, "n of the peak matmul; 0 = by backend.", flag_values=fv)
  flags.DEFINE_integer("copy-mb", 0, "MB of the bandwidth copy; 0 = by backend.", flag_values=fv)
  flags.DEFINE_integer("train-batch", 16, "Rows of the train step.", flag_values=fv)
  flags.DEFINE_integer("prompt-len", 64, "Prompt tokens per row.", flag_values=fv)
  flags.DEFINE_integer("completion-len", 128, "Completion tokens per train row.", flag_values=fv)
  flags.DEFINE_string("decode-batches", "1,64", "Decode batch sizes.", flag_values=fv)
  flags.DEFINE_string(
    "decode-tokens", "32,160", "C1,C2 new tokens of the two calls.", flag_values=fv
  )


def _ints(text: str, flag: str) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in text.split(",") if x)
  except ValueError:
    raise ValueError(f"--{flag} must be comma-separated integers, got {text!r}") from None


def args_to_kwargs(args) -> dict:
  """`run`'s keyword arguments from the parsed flags (shared with `bench.device_check`)."""
  return {
    "models": [m for m in args.models.split(",") if m],
    "dtype": args.dtype,
    "repeats": args.repeats,
    "matmul_size": args.matmul_size,
    "copy_mb": args.copy_mb,
    "train_batch": args.train_batch,
    "prompt_len": args.prompt_len,
    "completion_len": args.completion_len,
    "decode_batches": _ints(args.decode_batches, "decode-batches"),
    "decode_tokens": _ints(args.decode_tokens, "decode-tokens"),
  }


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark; prints a table, or the JSON with --json."""
  args = runner.parse_own_flags(define_flags, argv, __doc__)
  log = cli_flags.log_for_json(args.json)
  result = run(**args_to_kwargs(args), log=log)
  if args.json:
    json_file.write_json(args.json, result)
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
