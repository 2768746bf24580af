"""Entry point: calibrations of several student–teacher pairs side by side.

    python -m opd_jax.pairs --pair=embedded=/tmp/cal_A --pair=chain=/tmp/cal_C
        --pair=deep=/tmp/cal_D [--json=PATH] [--md=PATH]

Each DIR is an `opd_jax.calibrate` workdir (its `study.json` and `runs/`). Prints, and writes
with --md, the markdown tables: each pair's limits under both labels (held-out accuracy and
KL(student ‖ teacher)) on the absolute and relative axes, its layer sensitivity and FP8 recipe,
and whether one pair's budget predicts another's runs; --json writes their data. The logic is
`opd_jax.experiments.pairs`.
"""

from __future__ import annotations

import sys

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  flags.DEFINE_multi_string(
    "pair", [], "NAME=DIR: a calibration's workdir and its name; repeat.", flag_values=fv
  )
  cli_flags.define_json_flag(fv, "the tables' data")
  flags.DEFINE_string("md", None, "Write the markdown tables to PATH.", flag_values=fv)


def main(argv: list[str] | None = None) -> None:
  """Loads each pair, prints the tables and writes them (the module docstring)."""
  args = runner.parse_own_flags(define_flags, sys.argv[1:] if argv is None else argv, __doc__)
  if not args.pair:
    raise ValueError("give --pair=NAME=DIR, once per calibration")
  from opd_jax.experiments import pairs, study_report
  from opd_jax.io import json_file

  results = {}
  for spec in args.pair:
    name, sep, directory = spec.partition("=")
    if not sep:
      raise ValueError(f"--pair={spec!r}: expected NAME=DIR")
    results[name] = pairs.load(directory)
  summaries = [pairs.pair_summary(n, r) for n, r in results.items()]
  moves = [
    m for label in pairs.LABELS for axis in pairs.AXES for m in pairs.transfer(results, label, axis)
  ]
  text = study_report.pairs_markdown(summaries, moves)
  print(text)
  if args.md:
    with open(args.md, "w", encoding="utf-8") as f:
      f.write(text)
  if args.json:
    json_file.write_json(args.json, {"pairs": summaries, "transfer": moves})


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
