"""Numbers and intervals as the cells of the markdown tables that reports write.

`number(x, spec)` formats x by a `format` spec, or writes "—" when x is None or not finite;
`interval(ci, spec)` writes "[lo, hi]" by the same spec, or "" when the interval is absent or
either end is not finite. Reports compose cells from the two, so that an unknown value reads
the same in every table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MISSING = "—"


def _finite(x) -> bool:
  return x is not None and math.isfinite(x)


def number(x: float | None, spec: str, missing: str = MISSING) -> str:
  """`format(x, spec)`; `missing` for None or a non-finite x."""
  return format(x, spec) if _finite(x) else missing


def interval(ci: Sequence[float] | None, spec: str, missing: str = "") -> str:
  """ "[lo, hi]", each end by `spec`; `missing` for an absent interval or a non-finite end."""
  if not ci or not all(_finite(x) for x in ci):
    return missing
  lo, hi = ci
  return f"[{format(lo, spec)}, {format(hi, spec)}]"
