"""Table cells: a number or an interval by its format spec, and one mark for an unknown."""

import math

from opd_jax.io import table_cells


def test_number_formats_by_spec_and_marks_unknowns():
  assert table_cells.number(1.234, "+.1f") == "+1.2"
  assert table_cells.number(-0.05, ".2e") == "-5.00e-02"
  for unknown in (None, math.nan, math.inf, -math.inf):
    assert table_cells.number(unknown, ".1f") == "—"
  assert table_cells.number(None, ".3g", missing="n/a") == "n/a"


def test_interval_needs_both_ends_finite():
  assert table_cells.interval((1.0, 2.25), ".1f") == "[1.0, 2.2]"
  assert table_cells.interval([-3.0, 0.5], "+.1f") == "[-3.0, +0.5]"
  assert table_cells.interval(None, ".1f") == ""
  assert table_cells.interval((), ".1f") == ""
  assert table_cells.interval((0.1, math.nan), ".1f") == ""
  assert table_cells.interval((None, 1.0), ".1f", missing="—") == "—"
