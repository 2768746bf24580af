"""Entry point: a study's pre-registered validation scored against simple baselines.

    python -m opd_jax.validation --study=DIR/study.json --config=configs/validation.py
        [--json=PATH] [--md=PATH] [--third-run=DIR [--config.run.<key>=<value> ...]]
    python -m opd_jax.validation --draw-held-out --study=LADDERS/study.json
        --config=configs/round10.py

Reads a finished `study.json` and the analysis its config froze (`config.analysis`), prints the
markdown tables (the frozen rule beside the baselines, the one-scale and interaction analyses)
and writes them (--md) and their data (--json). Nothing trains, except with --third-run: each
held-out setting whose label lies within τ's interval is trained once more (seed 2) with DIR as
the study's workdir, and the relabelled settings are scored too; `--config.run.<key>=<value>`
then sets a key of the study's run config as the study ran it (e.g.
`--config.run.teacher.cache_dir=DIR`), parsed as `--config.<key>=<value>` is everywhere. The
old `--run-override=KEY=VALUE` still works for this release, with a warning. The logic is
`opd_jax.experiments.validation`.

With --draw-held-out, nothing is scored: the config file's held-out draw (its `draw_config()`)
is made on the calibration labels of the finished study given (a calibration-only study, e.g.
the dose ladders', whose calibration settings are the config's), and printed as the Python
lines to paste into the config before any of its runs (`format_lookup.draw_held_out`).
"""

from __future__ import annotations

import json
import sys

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner

RUN_OVERRIDE = "--config.run."  # the prefix of an override of the study's run config


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv` (the run-config overrides are read before them)."""
  flags.DEFINE_string("study", None, "A finished study's study.json.", flag_values=fv)
  flags.DEFINE_string(
    "config", None, "The study's config file, FILE[:variant] (its analysis).", flag_values=fv
  )
  cli_flags.define_json_flag(fv, "the report's data")
  flags.DEFINE_string("md", None, "Write the markdown tables to PATH.", flag_values=fv)
  flags.DEFINE_bool(
    "draw-held-out",
    False,
    "Print the config's held-out draw on the study's calibration labels, as Python lines to "
    "paste into the config, and exit (nothing is scored).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "third-run",
    None,
    "Post hoc: train each held-out setting whose label lies within τ's interval once more "
    "(seed 2) with DIR as the study's workdir, and score the relabelled settings too.",
    flag_values=fv,
  )


def split_run_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
  """(argv without the run-config overrides, those overrides as KEY=VALUE): each
  `--config.run.KEY=VALUE`, and each old `--run-override=KEY=VALUE` (or `--run-override
  KEY=VALUE`) with a warning."""
  rest, overrides, args, warned = [], [], list(argv), False
  while args:
    arg = args.pop(0)
    if arg.startswith(RUN_OVERRIDE):
      overrides.append(arg[len(RUN_OVERRIDE) :])
    elif arg == "--run-override" or arg.startswith("--run-override="):
      if not warned:
        cli_flags.warn_deprecated("--run-override=KEY=VALUE", f"{RUN_OVERRIDE}KEY=VALUE")
        warned = True
      overrides.append(arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else ""))
    else:
      rest.append(arg)
  return rest, overrides


def main(argv: list[str] | None = None) -> None:
  """Scores the study (the module docstring) and prints the tables."""
  argv, override_items = split_run_overrides(list(sys.argv[1:] if argv is None else argv))
  args = runner.parse_own_flags(define_flags, argv, __doc__, required=("study", "config"))
  from opd_jax.experiments import runs, study_report, validation
  from opd_jax.io import json_file

  if args.draw_held_out:
    with open(args.study, encoding="utf-8") as f:
      print("\n".join(validation.draw_lines(json.load(f), args.config)))
    return
  config = validation.load_config(args.config)
  overrides = validation.run_overrides(override_items, config.run)
  if overrides:
    config.run = runs.with_overrides(config.run, overrides)
  with open(args.study, encoding="utf-8") as f:
    result = json.load(f)
  out = validation.report(result, config)
  if args.third_run:
    out["third_run"] = validation.validate(
      validation.third_runs(result, config, args.third_run), config
    )
  text = study_report.validation_markdown(out)
  if "third_run" in out:
    text += "\n## Post hoc: a third run for the labels within τ's interval\n\n"
    text += study_report.validation_markdown(
      {**out, "validation": out["third_run"], "one_scale": {}, "factorial": []}
    )
  print(text)
  if args.md:
    with open(args.md, "w", encoding="utf-8") as f:
      f.write(text)
  if args.json:
    json_file.write_json(args.json, out)


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
