"""The two device operations a batch-1 decode step is made of, timed alone: matrix-vector
products on a model's own weight shapes, and the casts that widen a stored KV cache.

Command (results: docs/results/benchmarks.md):

    python -m opd_jax.bench.kernels --json                  # qwen3-50m's shapes, 16M elements
    python -m opd_jax.bench.kernels --model=qwen3-0.6b      # another shape of bench.roofline

* "matvec" rows: x·W for x [1, in] and W [in, out] in `--dtype` (f32 by default), for each
  distinct matrix shape of the decode step (`roofline.decode_matrices`). Enough distinct
  matrices of the shape to hold `--matvec-mb` MB are multiplied in a chain
  (`roofline.dot_chain_seconds`: each vector built from the previous product, so none is
  skipped) inside one `lax.fori_loop`, so the weights come from memory, not from a cache that
  held the last call's. `bytes_per_s` is W's bytes over the seconds of one product; against
  `copy_bytes_per_s` (`roofline.copy_bandwidth`, measured in the same run) it says how much of
  the memory's bandwidth XLA's dot reaches at that shape.
* "convert" rows: y = sum over the last axis of x.astype(f32) for x of `--elements` elements
  in rows of 64, for x in f32, bf16, FP8 E4M3 and E5M2 (and FP8 through bf16, which is exact:
  every FP8 value is a bf16 value, and FP8 by the cache readers' route from the stored bits,
  `kvcache.as_wide_values`, through f16 on CPU; `exact` says whether the routes agree bit for
  bit).
  `ns_per_element` is the median seconds over the elements. The reduction keeps the output
  small, so the figure is the read and the cast.
"""

from __future__ import annotations

import math
from typing import Any

from absl import flags

from opd_jax.bench import roofline, timing
from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

CHAIN_PASSES = 4
WIDE = "as_wide_values"  # the cache readers' route: the stored bits through kvcache.as_wide_values
# Stored dtype -> the casts timed (each ends in f32).
CONVERSIONS = {
  "float32": [("float32",)],
  "bfloat16": [("float32",)],
  "float8_e4m3fn": [("float32",), ("bfloat16", "float32"), (WIDE,)],
  "float8_e5m2": [("float32",), ("bfloat16", "float32"), (WIDE,)],
}


def matvec_row(shape: tuple[int, int], dtype: str, megabytes: float, repeats: int) -> dict:
  """One "matvec" row (module docstring) for W of `shape`."""
  import jax
  import jax.numpy as jnp

  rows, cols = shape
  itemsize = jnp.dtype(dtype).itemsize
  count = max(2, math.ceil(megabytes * 2**20 / (rows * cols * itemsize)))
  matrices = [
    jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype) for i in range(count)
  ]
  per_product = roofline.dot_chain_seconds(matrices, repeats, CHAIN_PASSES) / count
  return {
    "kind": "matvec",
    "shape": [rows, cols],
    "dtype": dtype,
    "matrices": count,
    "us_per_product": 1e6 * per_product,
    "bytes_per_s": rows * cols * itemsize / per_product,
  }


def convert_rows(stored: str, elements: int, repeats: int) -> list[dict]:
  """The "convert" rows (module docstring) of one stored dtype."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from opd_jax.model import kvcache

  x = (jax.random.normal(jax.random.key(0), (elements // 64, 64), jnp.float32)).astype(stored)
  rows, outputs = [], []
  for route in CONVERSIONS[stored]:

    def widen(x, route=route):
      if route == (WIDE,):
        bits = jax.lax.bitcast_convert_type(x, kvcache.storage_dtype(stored))
        values, factor = kvcache.as_wide_values(bits)
        return values.astype(jnp.float32) * factor
      for dtype in route:
        x = x.astype(dtype)
      return x

    reduce = jax.jit(lambda x, widen=widen: widen(x).sum(-1))
    seconds = timing.median_seconds(lambda reduce=reduce: reduce(x).block_until_ready(), repeats)
    outputs.append(np.asarray(jax.jit(widen)(x)))
    rows.append(
      {
        "kind": "convert",
        "stored": stored,
        "route": " -> ".join((stored, *route)),
        "elements": x.size,
        "ns_per_element": 1e9 * seconds / x.size,
      }
    )
  exact = all(np.array_equal(outputs[0], other) for other in outputs[1:])
  return [row | {"exact": exact} for row in rows]


def run(
  model: str = "qwen3-50m",
  dtype: str = "float32",
  matvec_mb: float = 160,
  elements: int = 16 * 2**20,
  repeats: int = 5,
  log=print,
) -> dict[str, Any]:
  """{"device", "copy_bytes_per_s", "rows"} (module docstring).

  Raises:
    ValueError: an unknown model, a size not positive, or repeats below 1.
  """
  import jax
  import jax.numpy as jnp

  from opd_jax.model import transformer as model_lib

  if model not in roofline.MODELS:
    raise ValueError(f"unknown model {model!r}; choose from {', '.join(roofline.MODELS)}")
  if matvec_mb <= 0 or min(elements, repeats) < 1:
    raise ValueError("--matvec-mb must be > 0, --elements and --repeats >= 1")
  matrices = jax.eval_shape(
    lambda: roofline.decode_matrices(
      model_lib.init_params(jax.random.key(0), roofline.MODELS[model], jnp.dtype(dtype))
    )
  )
  shapes = sorted({tuple(m.shape) for m in matrices})
  copy = roofline.copy_bandwidth(max(1, min(256, round(matvec_mb))), repeats)
  log(f"copy: {copy / 1e9:.1f} GB/s")
  rows = []
  for shape in shapes:
    rows.append(matvec_row(shape, dtype, matvec_mb, repeats) | {"model": model})
    log(f"matvec {shape}: {rows[-1]['bytes_per_s'] / 1e9:.1f} GB/s")
  for stored in CONVERSIONS:
    for row in convert_rows(stored, elements, repeats):
      rows.append(row)
      log(f"convert {row['route']}: {row['ns_per_element']:.3f} ns/element")
  device = jax.devices()[0]
  return {
    "device": {"backend": jax.default_backend(), "device_kind": device.device_kind},
    "copy_bytes_per_s": copy,
    "rows": [
      row | {"fraction_of_copy": row["bytes_per_s"] / copy} if row["kind"] == "matvec" else row
      for row in rows
    ],
  }


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv, '{"device", "copy_bytes_per_s", "rows"}')
  flags.DEFINE_string(
    "model",
    "qwen3-50m",
    f"Whose matrix shapes: one of {', '.join(roofline.MODELS)}.",
    flag_values=fv,
  )
  flags.DEFINE_string("dtype", "float32", "The matrices' dtype.", flag_values=fv)
  flags.DEFINE_float("matvec-mb", 160, "MB of distinct matrices per shape.", flag_values=fv)
  flags.DEFINE_integer("elements", 16 * 2**20, "Elements of each conversion.", flag_values=fv)
  flags.DEFINE_integer("repeats", 5, "Timed calls per figure (medians).", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark; prints its progress, and the JSON with --json."""
  args = runner.parse_own_flags(define_flags, argv, __doc__)
  log = cli_flags.log_for_json(args.json)
  result = run(args.model, args.dtype, args.matvec_mb, args.elements, args.repeats, log)
  if args.json:
    json_file.write_json(args.json, result)
  return 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
