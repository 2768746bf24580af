"""Entry point: a finished study's dose ladders under each label.

    python -m opd_jax.ladders --study=DIR/study.json [--full-run-accuracy=0.965]
        [--min-plateau-share=0.85] [--full-length=FULL/study.json]
        [--second-pair=OTHER/study.json --pair-names=embedded,deep] [--json=PATH] [--md=PATH]

Reads a `study.json` and prints, for each label (teacher_kl, accuracy), τ, the share of the
settings' labels within ±2 SE of τ, and per source its rungs (the check's KL and the mean
drop), its knee and the knee's interval widened to the rungs that bracket it ("bracketed by
(a, b]"); with --full-run-accuracy, the reference's accuracy against its plateau. Nothing
trains. A study run by `python -m opd_jax.study` writes the same section into its report.md
and study.json ("ladders"). The logic is `opd_jax.experiments.ladders`.

With --full-length, the run-length check: FULL is a study of some of the same settings
trained to full length (`configs/ladders.py:length`, 1,000 steps); for the settings in both,
per label, the Spearman and Pearson correlations of the two lengths' mean drops and the slope
of the full-length drop on the short one (bootstrap intervals over settings), and how often
the two lengths' verdicts (drop > τ, each length with its own τ) agree, with its Wilson
interval (`opd_jax.experiments.run_length`; under "run_length" in the JSON).

With --second-pair, model dependence: OTHER is a study of the same ladders on another
student–teacher pair (`configs/ladders.py:deep`); for the settings in both, per label, each
setting's check KL and drop (with Welch's interval) on both pairs, the Spearman correlation and
the geometric-mean ratio of the two pairs' check KLs, the Spearman correlation of the drops
over each pair's τ, how often the two pairs' verdicts agree, and both pairs' knees per source
(`opd_jax.experiments.pair_dependence`; under "pair_dependence" in the JSON). --pair-names
names the two pairs in the tables (--study's first).

The JSON records its own `provenance` (the code, and a hash of the arguments) and, under
"studies_provenance", the entry each study it read recorded (None where it recorded none).
"""

from __future__ import annotations

import json
import sys

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  flags.DEFINE_string("study", None, "A finished study's study.json.", flag_values=fv)
  flags.DEFINE_float(
    "full-run-accuracy",
    0.0,
    "The reference's accuracy after a full run (0 = none: no plateau check).",
    flag_values=fv,
  )
  flags.DEFINE_float(
    "min-plateau-share",
    0.85,
    "The share of the full run's accuracy the reference should reach.",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "full-length",
    None,
    "A study.json of the same settings at full length: print the run-length check too.",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "second-pair",
    None,
    "A study.json of the same ladders on another pair: print the two side by side.",
    flag_values=fv,
  )
  flags.DEFINE_list(
    "pair-names", ["A", "B"], "The two pairs' names, --study's first.", flag_values=fv
  )
  cli_flags.define_json_flag(fv, "the ladders' data")
  flags.DEFINE_string("md", None, "Write the markdown to PATH.", flag_values=fv)


def read_study(path: str, flag: str) -> dict:
  """The study.json at `path`.

  Raises:
    ValueError: a file that is not a study.json (no "rows"), named by its flag.
  """
  with open(path, encoding="utf-8") as f:
    result = json.load(f)
  if not isinstance(result, dict) or "rows" not in result:
    raise ValueError(f"--{flag}={path}: not a study.json (no 'rows')")
  return result


def main(argv: list[str] | None = None) -> None:
  """Prints the ladders of the study (the module docstring)."""
  args = runner.parse_own_flags(define_flags, argv, __doc__, required=("study",))
  from opd_jax.experiments import ladders
  from opd_jax.io import json_file, provenance

  result = read_study(args.study, "study")
  out = ladders.ladder_report(result, args.full_run_accuracy or None, args.min_plateau_share)
  lines = ladders.markdown_lines(out)
  # The code and arguments that made this output, and the code that made each study it read.
  read = {"study": result.get(provenance.KEY)}
  if args.full_length:
    from opd_jax.experiments import run_length

    full = read_study(args.full_length, "full-length")
    read["full_length"] = full.get(provenance.KEY)
    out["run_length"] = run_length.length_check(result, full)
    lines += run_length.markdown_lines(out["run_length"])
  if args.second_pair:
    from opd_jax.experiments import pair_dependence

    other = read_study(args.second_pair, "second-pair")
    read["second_pair"] = other.get(provenance.KEY)
    out["pair_dependence"] = pair_dependence.compare(result, other, args.pair_names)
    lines += pair_dependence.markdown_lines(out["pair_dependence"])
  arguments = ("study", "full_length", "full_run_accuracy", "min_plateau_share")
  if args.second_pair:  # outputs made without it keep the hash they recorded
    arguments += ("second_pair", "pair_names")
  options = {k: getattr(args, k) for k in arguments}
  out[provenance.KEY] = provenance.provenance(options)
  out["studies_provenance"] = read
  text = "\n".join(lines)
  print(text, file=sys.stderr if args.json == "-" else sys.stdout)  # the JSON alone on stdout
  if args.md:
    with open(args.md, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  if args.json:
    json_file.write_json(args.json, out)


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
