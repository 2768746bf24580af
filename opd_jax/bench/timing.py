"""Wall-clock timing shared by the benches: the median of repeated calls after warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
  """Median wall seconds of `fn()` over `repeats` calls, after `warmup` untimed calls.

  `fn` must wait for its own result (`jax.block_until_ready`). Two warm-up calls by default:
  the first compiles, the second settles any layout the first call's outputs moved into.

  Raises:
    ValueError: repeats < 1 or warmup < 0.
  """
  if repeats < 1 or warmup < 0:
    raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)
