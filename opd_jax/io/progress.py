"""The progress line of a run: `Progress` formats `step 120/500 | 3.2 steps/s | ETA 1m58s`
from a moving window of (step, time) points, and `format_duration` the durations in it.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from absl import logging

from opd_jax.io.metrics_writer import _scalar_value


def format_duration(seconds: float) -> str:
  """Formats a duration compactly: "42s", "1m58s", "2h03m", "3d04h"; "--" when unknown.

  Args:
    seconds: a non-negative duration, or NaN/inf for unknown.

  Returns:
    The formatted string. Seconds are rounded to the nearest integer first.
  """
  if not math.isfinite(seconds) or seconds < 0:
    return "--"
  total = int(round(seconds))
  days, rem = divmod(total, 86400)
  hours, rem = divmod(rem, 3600)
  minutes, secs = divmod(rem, 60)
  if days:
    return f"{days}d{hours:02d}h"
  if hours:
    return f"{hours}h{minutes:02d}m"
  if minutes:
    return f"{minutes}m{secs:02d}s"
  return f"{secs}s"


class Progress:
  """Formats the progress line `step 120/500 | 3.2 steps/s | ETA 1m58s | loss/opd=0.41`.

  The rate is measured over a moving window of the last `window` calls:

      rate = (step_last − step_first) / (time_last − time_first)
      ETA  = (total_steps − step) / rate

  Until two calls at different steps and times exist, the rate and ETA print as "--". Rates
  below one step per second print as seconds per step ("12.5 s/step"). A step lower than the
  previous one (a restart) clears the window.
  """

  def __init__(
    self, total_steps: int, window: int = 20, clock: Callable[[], float] = time.monotonic
  ):
    """Args:
    total_steps: the last step of the run.
    window: how many recent (step, time) points the rate is measured over (>= 2).
    clock: seconds, monotonic; injectable so the formatting can be checked exactly.
    """
    if total_steps < 1:
      raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if window < 2:
      raise ValueError(f"window must be >= 2, got {window}")
    self.total_steps = int(total_steps)
    self._clock = clock
    self._points: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)

  def rate(self) -> float:
    """Steps per second over the window; NaN when not yet measurable."""
    if len(self._points) < 2:
      return math.nan
    (s0, t0), (s1, t1) = self._points[0], self._points[-1]
    if t1 <= t0 or s1 <= s0:
      return math.nan
    return (s1 - s0) / (t1 - t0)

  def line(self, step: int, metrics: Mapping[str, Any] | None = None) -> str:
    """Records that `step` is done now and returns the progress line.

    Args:
      step: the step just finished.
      metrics: optional name -> scalar to append, formatted with 4 significant digits.

    Returns:
      e.g. "step 120/500 | 3.2 steps/s | ETA 1m58s | loss/opd=0.4100".
    """
    now = self._clock()
    if self._points and step < self._points[-1][0]:
      self._points.clear()
    self._points.append((int(step), now))
    rate = self.rate()
    if math.isnan(rate):
      rate_s = "-- steps/s"
    elif rate >= 1.0:
      rate_s = f"{rate:.1f} steps/s"
    else:
      rate_s = f"{1.0 / rate:.1f} s/step"
    eta = (self.total_steps - step) / rate if not math.isnan(rate) else math.nan
    parts = [f"step {step}/{self.total_steps}", rate_s, f"ETA {format_duration(max(eta, 0.0))}"]
    if metrics:
      parts.append(" ".join(f"{k}={_scalar_value(k, v):.4g}" for k, v in metrics.items()))
    return " | ".join(parts)

  def log(self, step: int, metrics: Mapping[str, Any] | None = None) -> str:
    """Like `line`, and also logs it with `absl.logging.info`. Returns the line."""
    text = self.line(step, metrics)
    logging.info("%s", text)
    return text
