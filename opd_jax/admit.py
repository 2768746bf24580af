"""Entry point: the admission check.

    python -m opd_jax.admit --config=configs/<name>.py[:variant] [--config.key=value ...]
        [--budget=FILE] --candidate=SPEC [--candidate=SPEC ...] [--prompts=N] [--json=PATH|-]
        [--workdir=DIR] [--params-from=RUN] [--force] [--conservative] [--compilation-cache=DIR]
        [--nofast-compile]

A candidate is a rollout configuration in the config's own terms, e.g.
`--candidate=rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor`. Each is
measured on N calibration prompts against the trainer's student, with no training, and
judged by the admission rule the budget file records (docs/budget_rules.md; a combination's
parts are measured alone when the rule reads them); the table goes to stdout, the rows to
--json (a file, or `-` for stdout, the table then on stderr), and one line per candidate to
<workdir>/admission_log.jsonl. `--config`, its overrides and `--workdir` are `opd_jax.main`'s
own flags. The logic is `opd_jax.mismatch.admission.run_admission`.

Without --budget (or with --budget=uncalibrated) the candidates are judged against the
uncalibrated default limit, `opd_jax.mismatch.budget.UNCALIBRATED_MAX_KL` nats/token (the lowest
knee over the calibrated student–teacher pairs, at the lower end of its interval), with the
pooled rule and no fingerprint check; the header line, every row ("limit from", "call") and the
JSON ("budget": "uncalibrated default") say so. Calibrate a budget for your own models for
verdicts that are theirs.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

from opd_jax.cli import flags as cli_flags
from opd_jax.io import compile_cache
from opd_jax.mismatch import admission

_BUDGET = flags.DEFINE_string(
  "budget",
  None,
  "Budget file (opd_jax.budget.save_budget). Without it (or `uncalibrated`): the uncalibrated "
  "default limit, the lowest knee over the calibrated pairs, with no fingerprint check.",
)
_CANDIDATES = flags.DEFINE_multi_string(
  "candidate", None, "rollout.<key>=<value>[,rollout.<key>=<value> ...]; repeat for several."
)
_PROMPTS = flags.DEFINE_integer(
  "prompts", admission.DEFAULT_NUM_PROMPTS, "Calibration prompts per candidate."
)
_JSON = flags.DEFINE_string(
  "json", None, "Also write the table's rows as JSON to PATH; - prints them to stdout."
)
_PARAMS_FROM = flags.DEFINE_string(
  "params-from",
  None,
  "A trainer workdir: measure the student of its latest checkpoint (older checkpoints serve "
  "stale candidates). Default: the student a run starts from.",
)
_FORCE = flags.DEFINE_bool("force", False, "Check against a stale budget (reasons still shown).")
_COMPILATION_CACHE = cli_flags.define_compilation_cache_flag(
  "later checks load the compiled programs instead of compiling them."
)
_FAST_COMPILE = flags.DEFINE_bool(
  "fast-compile",
  True,
  "Compile the check's programs without XLA backend optimisation (and, on CPU, without the "
  "fusion emitters): a fifth to a half of the compile time, the same KLs to ~1e-6 relative "
  "(compile_cache.fast_compilation).",
)
_CONSERVATIVE = flags.DEFINE_bool(
  "conservative",
  False,
  "Take every limit of the file's rule at the lower end of its interval (then no longer the "
  "rule the file was validated with).",
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if _FAST_COMPILE.value:
    compile_cache.fast_compilation()
  try:
    compile_cache.compilation_cache_flag(_COMPILATION_CACHE.value, flags.FLAGS.workdir)
    with cli_flags.json_output(_JSON.value) as json_path:
      admission.run_admission(
        flags.FLAGS.config,
        _BUDGET.value,
        _CANDIDATES.value,
        num_prompts=_PROMPTS.value,
        workdir=flags.FLAGS.workdir,
        params_from=_PARAMS_FROM.value,
        force=_FORCE.value,
        conservative=_CONSERVATIVE.value,
        json_path=json_path,
        log=cli_flags.log_for_json(_JSON.value),
      )
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  cli_flags.exit_at_once()  # the table is printed; the JSON and the log are closed


if __name__ == "__main__":
  for name in ("config", "candidate"):
    flags.mark_flag_as_required(name)
  app.run(main, argv=cli_flags.resolve_config_arg(sys.argv), flags_parser=cli_flags.parse_flags)
