"""Entry point: a mismatch budget fitted from records, this project's or another stack's logs.

    python -m opd_jax.fit_budget --records=FILE.jsonl [--records=FILE2.jsonl ...]
        [--format=opd_jax|verl|slime|trl|nemo|tinker] --tolerance=TAU --out=budget.json
        [--quality-key=KEY] [--kl-key=auto|mismatch/k3|...] [--abs-diff-to-kl=lower_bound|gaussian]
        [--tail=T] [--reference=RUN] [--lower-is-better] [--rule=pooled]

`--format=opd_jax` reads calibration records, one run per line (docs/reference/records.md); the
other formats read a stack's per-step log, one JSON object per line, map its mismatch metrics
onto this project's names and make one record per run (`opd_jax.mismatch.record_import`). The
records are fitted by `fit_budget` (isotonic quality drop against mismatch/kl, its crossing of
the tolerance τ, bootstrap intervals), and the budget file is written with its rule and its
provenance. An imported budget is on the training axis and has no fingerprint: the admission
check and the live guard take it only with --force (--config.budget.force=true). Prints one line
per record and one for the budget; exit 1 with one `error:` line on bad input.
"""

from __future__ import annotations

import dataclasses
import sys

from absl import flags

from opd_jax.cli import runner
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import record_import


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  flags.DEFINE_multi_string(
    "records", [], "A JSONL file of records or of a stack's per-step log", flag_values=fv
  )
  flags.DEFINE_enum(
    "format", "opd_jax", record_import.FORMATS, "What the files hold.", flag_values=fv
  )
  flags.DEFINE_float(
    "tolerance",
    None,
    "τ: the largest acceptable quality drop, in the quality's unit.",
    flag_values=fv,
  )
  flags.DEFINE_string("out", None, "Where the budget file goes.", flag_values=fv)
  flags.DEFINE_string(
    "quality-key",
    None,
    "The runs' quality in a stack's log (e.g. an evaluation score).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "kl-key",
    "auto",
    "The record key read as mismatch/kl: auto (mismatch/kl, then k3, then k1, then the mean "
    "abs log-ratio converted), mismatch/k3, mismatch/k1 or mismatch/abs_logp_diff.",
    flag_values=fv,
  )
  flags.DEFINE_enum(
    "abs-diff-to-kl",
    None,
    record_import.ABS_DIFF_TO_KL,
    "Read a mean abs log-ratio m (slime, TRL) as a KL: lower_bound (m + e^-m - 1, holds for any "
    "engine) or gaussian ((π/4)·m² for a normal log-ratio); without it such a log is refused.",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "tail",
    record_import.DEFAULT_TAIL,
    "A run's figures: the mean of each key's last T values.",
    flag_values=fv,
  )
  flags.DEFINE_multi_string(
    "reference",
    [],
    "A reference run's name (default: the runs whose source or name is 'reference')",
    flag_values=fv,
  )
  flags.DEFINE_bool(
    "lower-is-better", False, "The quality is a loss: drop = run − reference.", flag_values=fv
  )
  flags.DEFINE_enum(
    "rule",
    "pooled",
    budget_lib.RULE_NAMES,
    "The admission rule the file records (not validated).",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "min-crossing-records",
    budget_lib.MIN_CROSSING_RECORDS,
    "c: a source's own records over τ that its own limit needs.",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "num-bootstrap", budget_lib.NUM_BOOTSTRAP, "Bootstrap resamples per fit.", flag_values=fv
  )


def main(argv: list[str] | None = None) -> None:
  """Reads the files, fits and writes the budget (the module docstring)."""
  args = runner.parse_own_flags(
    define_flags,
    sys.argv[1:] if argv is None else argv,
    __doc__,
    required=("records", "tolerance", "out"),
  )
  from opd_jax.mismatch import budget_file, budget_fit

  files = []
  for path in args.records:
    with open(path, encoding="utf-8") as f:
      files.append((path, f.read()))
  records, provenance = record_import.import_records(
    files,
    args.format,
    quality_key=args.quality_key,
    kl_key=args.kl_key,
    abs_diff_to_kl=args.abs_diff_to_kl,
    tail=args.tail,
    reference=args.reference,
    higher_is_better=not args.lower_is_better,
  )
  fit = dict(min_crossing_records=args.min_crossing_records, num_bootstrap=args.num_bootstrap)
  fitted = budget_fit.fit_budget(records, args.tolerance, **fit)
  training = fitted if provenance["axis"] == "training" else None  # x is the training-time value
  fitted = dataclasses.replace(
    fitted, training=training, rule=budget_lib.Rule(args.rule), provenance=provenance
  )
  for r in records:
    kl, drop = r[budget_lib.KL_KEY], r[budget_lib.DROP_KEY]
    name = f"run {r['run']}" if "run" in r else "record"
    print(f"{name} ({r['source']}): mismatch/kl {kl:.4g}, quality_drop {drop:.4g}")
  low, high = fitted.interval
  print(
    f"budget: max_kl {fitted.max_kl:.4g} nats/token [{low:.4g}, {high:.4g}] "
    f"(censored {fitted.censored}), tolerance {fitted.tolerance:g}, rule "
    f"{fitted.rule.describe()}, {len(records)} records, axis {provenance['axis']}"
  )
  budget_file.save_budget(args.out, fitted, {})
  print(f"wrote {args.out} (no fingerprint: python -m opd_jax.admit reads it only with --force)")


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
