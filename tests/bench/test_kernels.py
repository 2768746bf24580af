"""bench.kernels on tiny sizes: its rows cover the decode step's distinct matrix shapes, the
FP8 routes through bf16 and the cache readers' route (kvcache.as_wide_values) equal the
direct casts bit for bit, and bad arguments are refused."""

from __future__ import annotations

import pytest

from opd_jax.bench import kernels


def test_rows_cover_the_shapes_and_every_fp8_route_is_exact():
  out = kernels.run("tiny", matvec_mb=0.05, elements=4096, repeats=1, log=lambda *a: None)
  matvec = [r for r in out["rows"] if r["kind"] == "matvec"]
  # "tiny" (D 32, F 64, N 4, K 2, H 8, V 128, untied): q [32, 32], k and v [32, 16],
  # o [32, 32], gate and up [32, 64], down [64, 32], head [32, 128].
  assert [tuple(r["shape"]) for r in matvec] == [(32, 16), (32, 32), (32, 64), (32, 128), (64, 32)]
  assert all(r["bytes_per_s"] > 0 and r["fraction_of_copy"] > 0 for r in matvec)
  # Enough distinct matrices for 0.05 MB: ⌈0.05 MiB / (32 · 16 · 4 bytes)⌉ = 26 of the smallest.
  assert matvec[0]["matrices"] == 26
  convert = [r for r in out["rows"] if r["kind"] == "convert"]
  assert [r["route"] for r in convert] == [
    "float32 -> float32",
    "bfloat16 -> float32",
    "float8_e4m3fn -> float32",
    "float8_e4m3fn -> bfloat16 -> float32",
    "float8_e4m3fn -> as_wide_values",
    "float8_e5m2 -> float32",
    "float8_e5m2 -> bfloat16 -> float32",
    "float8_e5m2 -> as_wide_values",
  ]
  assert all(r["exact"] and r["ns_per_element"] > 0 and r["elements"] == 4096 for r in convert)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"model": "qwen9"}, "unknown model 'qwen9'"),
    ({"repeats": 0}, "must be > 0"),
    ({"matvec_mb": 0}, "must be > 0"),
  ],
)
def test_bad_arguments_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    kernels.run(**({"model": "tiny"} | kwargs), log=lambda *a: None)
