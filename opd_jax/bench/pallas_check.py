"""The opt-in Pallas decode-attention kernel on this device: its error and its speed.

Command (part of `python -m opd_jax.bench.device_check`, its "pallas" section; alone):

    python -m opd_jax.bench.pallas_check --json

Correctness: the case of tests/model/test_pallas_decode.py (`test_kernel_equals_blockwise`):
GQA with N = 4 query heads over K = 2 KV heads of H = 16, 20 slots in blocks of 8, three rows
stopping at positions 19, 6 and 13, T = 1 and 3 query tokens, in each cache format (f32,
bf16, fp8 per token and head, fp8 per tensor). For every driver this backend compiles
("loop" on a GPU, "grid" on a TPU; both, interpreted, on a CPU) it reports the largest
absolute difference of the kernel from the XLA blockwise path (`decode_attention
.attend_cache`), whether that is within the test's tolerance (atol 2e-6, rtol 1e-5), and both
paths' largest error against softmax(q·kᵀ/√H)·v in float64 (NumPy) on the same dequantized
cache, which says which of the two is off.

Timing: one layer's attention at a decode step (B = 1, T = 1) over a cache of S slots at
position t, the 58M model's heads (N 8, K 4, H 64; S 4096, t 4000 unless smaller sizes are
asked for), BF16 and FP8 per token and head, kernel against blockwise: medians of jitted calls.
"""

from __future__ import annotations

import numpy as np
from absl import flags

from opd_jax.bench import timing
from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file
from opd_jax.model.config import ModelConfig

CFG = ModelConfig("qwen3", 64, 32, 48, 2, 4, 2, 16, qk_norm=True)  # the tests' shape
FP8 = "float8_e4m3fn"
FORMATS = {
  "f32": {"dtype": "float32"},
  "bf16": {"dtype": "bfloat16"},
  "fp8_token_head": {"dtype": FP8, "granularity": "token_head"},
  "fp8_tensor": {"dtype": FP8, "granularity": "tensor"},
}
ATOL, RTOL = 2e-6, 1e-5  # the tests' tolerance


def drivers() -> tuple[tuple[str, bool], ...]:
  """(driver, interpret) pairs this backend runs: its compiled driver, or both interpreted."""
  import jax

  backend = jax.default_backend()
  if backend == "cpu":
    return (("loop", True), ("grid", True))
  return (("grid" if backend == "tpu" else "loop", False),)


def _filled(cfg: ModelConfig, fmt: str, batch: int, slots: int, seed: int):
  """One layer's cache of `fmt` with random keys (scale 2) and values in every slot."""
  import jax.numpy as jnp

  from opd_jax.model import kvcache

  spec = kvcache.KVCacheSpec(**FORMATS[fmt])
  rng = np.random.default_rng(seed)
  entry = kvcache.init_cache(cfg, batch, slots, spec)[0]
  shape = (batch, slots, cfg.num_kv_heads, cfg.head_dim)
  k = jnp.asarray(rng.standard_normal(shape), jnp.float32) * 2.0
  v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return kvcache.write(entry, k, v, jnp.zeros(batch, jnp.int32), spec)


def float64_attention(q_btnh, entry, q_pos_bt, cfg: ModelConfig) -> np.ndarray:
  """softmax(q·kᵀ/√H + mask)·v in float64 over the dequantized cache (`kvcache.read`),
  query (b, t) seeing slots s ≤ q_pos[b, t], query head n on KV head n // G."""
  import jax.numpy as jnp

  from opd_jax.model import kvcache

  k, v = (np.asarray(x, np.float64) for x in kvcache.read(entry, jnp.float32))
  q = np.asarray(q_btnh.astype(jnp.float32), np.float64)
  k = np.repeat(k, cfg.num_groups, axis=2)  # [B, S, N, H]
  v = np.repeat(v, cfg.num_groups, axis=2)
  s = np.einsum("btnh,bsnh->btns", q, k) / np.sqrt(cfg.head_dim)
  visible = np.arange(k.shape[1])[None, None, :] <= np.asarray(q_pos_bt)[:, :, None]
  s = np.where(visible[:, :, None, :], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("btns,bsnh->btnh", p / p.sum(-1, keepdims=True), v)


def correctness(tokens: tuple[int, ...] = (1, 3)) -> list[dict]:
  """One row per driver × format × T of `tokens` (module docstring)."""
  import jax.numpy as jnp

  from opd_jax.model import decode_attention, pallas_decode

  rows = []
  for driver, interpret in drivers():
    for fmt in FORMATS:
      entry = _filled(CFG, fmt, 3, 20, seed=0)
      for count in tokens:
        rng = np.random.default_rng(1)
        shape = (3, count, CFG.num_heads, CFG.head_dim)
        q = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        last_b = np.array([19, 6, 13])
        q_pos_bt = jnp.asarray(last_b[:, None] - np.arange(count)[::-1][None, :], jnp.int32)
        want = np.asarray(decode_attention.attend_cache(q, entry, q_pos_bt, CFG, block=8))
        got = np.asarray(
          pallas_decode.attend_cache(
            q, entry, q_pos_bt, CFG, block=8, driver=driver, interpret=interpret
          )
        )
        exact = float64_attention(q, entry, q_pos_bt, CFG)
        rows.append(
          {
            "driver": driver,
            "interpret": interpret,
            "kv": fmt,
            "tokens": count,
            "max_abs_err_vs_blockwise": float(np.abs(got - want).max()),
            "within_test_tolerance": bool(np.allclose(got, want, atol=ATOL, rtol=RTOL)),
            "kernel_max_abs_err_vs_float64": float(np.abs(got - exact).max()),
            "blockwise_max_abs_err_vs_float64": float(np.abs(want - exact).max()),
            "finite": bool(np.isfinite(got).all()),
          }
        )
  return rows


def _ms(fn, inputs, repeats: int) -> float:
  """Median milliseconds of `fn(*inputs)`, waited for."""
  return 1e3 * timing.median_seconds(lambda: fn(*inputs).block_until_ready(), repeats)


def speed(slots: int = 4096, position: int = 4000, repeats: int = 5) -> list[dict]:
  """Kernel against blockwise ms per call, per driver this backend runs (module docstring)."""
  import jax
  import jax.numpy as jnp

  from opd_jax.bench.sampler import MODELS
  from opd_jax.model import decode_attention, pallas_decode

  if not 0 <= position < slots:
    raise ValueError(f"position must be in [0, slots), got {position} with {slots} slots")
  cfg = MODELS["qwen3-50m"]
  rows = []
  for fmt in ("bf16", "fp8_token_head"):
    entry = _filled(cfg, fmt, 1, slots, seed=2)
    q = jnp.asarray(
      np.random.default_rng(3).standard_normal((1, 1, cfg.num_heads, cfg.head_dim)), jnp.bfloat16
    )
    q_pos_bt = jnp.full((1, 1), position, jnp.int32)
    inputs = (q, entry, q_pos_bt)
    blockwise = jax.jit(lambda q, e, p: decode_attention.attend_cache(q, e, p, cfg))
    ms = {"blockwise": _ms(blockwise, inputs, repeats)}
    for driver, interpret in drivers():
      kernel = jax.jit(
        lambda q, e, p, driver=driver, interpret=interpret: pallas_decode.attend_cache(
          q, e, p, cfg, driver=driver, interpret=interpret
        )
      )
      ms[f"pallas_{driver}"] = _ms(kernel, inputs, repeats)
    for name, value in ms.items():
      if name != "blockwise":
        rows.append(
          {
            "kv": fmt,
            "slots": slots,
            "position": position,
            "path": name,
            "interpret": jax.default_backend() == "cpu",
            "ms": value,
            "blockwise_ms": ms["blockwise"],
            "speedup_vs_blockwise": ms["blockwise"] / value,
          }
        )
  return rows


def run(
  slots: int = 4096, position: int = 4000, repeats: int = 5, tokens: tuple[int, ...] = (1, 3)
) -> dict:
  """{"tolerance", "correctness": [...], "all_within_tolerance", "speed": [...]} (`tokens`: the
  query counts T of the correctness rows)."""
  rows = correctness(tokens)
  return {
    "tolerance": {"atol": ATOL, "rtol": RTOL},
    "correctness": rows,
    "all_within_tolerance": all(r["within_test_tolerance"] for r in rows),
    "speed": speed(slots, position, repeats),
  }


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv)
  flags.DEFINE_integer("slots", 4096, "Cache slots S of the timing.", flag_values=fv)
  flags.DEFINE_integer("position", 4000, "Query position t of the timing.", flag_values=fv)
  flags.DEFINE_integer("repeats", 5, "Timed calls (medians).", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
  """Runs the check; prints or writes the JSON."""
  args = runner.parse_own_flags(define_flags, argv, __doc__)
  json_file.write_json(args.json or "-", run(args.slots, args.position, args.repeats))
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
