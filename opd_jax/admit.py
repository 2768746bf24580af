"""Entry point: the admission check.

    python -m opd_jax.admit --config=configs/<name>.py[:variant] [--config.key=value ...]
        [--budget=FILE] --candidate=SPEC [--candidate=SPEC ...] [--prompts=N] [--json=PATH|-]
        --workdir=DIR [--params-from=RUN] [--force] [--conservative] [--report-only]
        [--extrapolate=refuse|pooled|default]
        [--compilation-cache=DIR] [--nofast-compile]
    python -m opd_jax.admit --config=... --export-prompts=FILE [--prompts=N]
    python -m opd_jax.admit --config=... --workdir=DIR --engine-samples=FILE
        [--engine-format=auto|vllm|sglang|plain] [--engine-temperature=T] [--engine-source=S]
        [--interval=percentile|bca] [--budget=FILE] [--prompts=N] [--json=PATH|-]

A candidate is a rollout configuration in the config's own terms, e.g.
`--candidate=rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor`. Each is
measured on N calibration prompts against the trainer's student, with no training, and
judged by the admission rule the budget file records (docs/budget_rules.md; a combination's
parts are measured alone when the rule reads them); the table goes to stdout, the rows to
--json (a file, or `-` for stdout, the table then on stderr), and one line per measured candidate to
<workdir>/admission_log.jsonl. `--config`, its overrides and `--workdir` are `opd_jax.main`'s
own flags. The logic is `opd_jax.cli.admit_check.run_admission`.

A stale candidate (rollout.stale_k or rollout.max_lag > 0) is measured only from a run's
checkpoints at steps t and t - k (--params-from=RUN); without them its row says what it needs
(verdict "needs --params-from" or "needs checkpoints") and the other candidates are still
measured and judged.

Exit status: 0 when every candidate is admitted, 1 when any is not (refused, or a stale
candidate that could not be measured), 2 on an error (a bad flag or candidate, a missing or
stale budget file, ...). --report-only exits 0 whatever the verdicts (errors still exit 2).

An engine that is not this one (vLLM, SGLang, ...) is screened from its own samples instead of a
--candidate: `--export-prompts=FILE` writes the calibration prompts with the settings to sample
them with (no candidate, no model built), the engine completes them with the log-probability of
every sampled token, and `--engine-samples=FILE [--engine-format=auto|vllm|sglang|plain]`
estimates KL(engine || trainer) from those tokens by k3 with a bootstrap interval and judges it by
the budget's rule (an interval that holds the limit: "too close"). The logic is
`opd_jax.cli.engine_check`; the file formats are `opd_jax.io.engine_samples`'s.

A candidate whose source the budget has no record of ("uncalibrated source"), or whose reading
lies above the largest its source's records reached ("beyond calibrated range"), is refused
unless --extrapolate=pooled or =default judges it against that limit; its call says which
(docs/budget_rules.md, "No silent extrapolation"). The header says how far the check's reading
moved between the budget's probe seeds, or "single probe".

Without --budget (or with --budget=uncalibrated) the candidates are judged against the
uncalibrated default limit, `opd_jax.mismatch.budget.UNCALIBRATED_MAX_KL` nats/token (the lowest
knee over the calibrated student–teacher pairs, at the lower end of its interval), with the
pooled rule and no fingerprint check; the header line, every row ("limit from", "call") and the
JSON ("budget": "uncalibrated default") say so. Calibrate a budget for your own models for
verdicts that are theirs.

Every measured row carries its KL by token position (`kl_by_position`, buckets of
`train.mismatch_bucket_tokens`) and its first crossings of `train.mismatch_cross_kl`
(`first_cross`); --plot=PATH draws the former, one line per candidate, as a PNG.
"""

from __future__ import annotations

import traceback

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.config.values import DEFAULT_NUM_PROMPTS

EXIT_REFUSED = 1  # a candidate was not admitted (module docstring)
EXIT_ERROR = 2  # the check could not run

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
  "prompts", DEFAULT_NUM_PROMPTS, "Calibration prompts per candidate."
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
_FORCE = flags.DEFINE_bool(
  "force",
  False,
  "Check against a stale budget, or one without a fingerprint (fitted from another stack's logs "
  "by opd_jax.fit_budget); the reasons are still shown.",
)
_COMPILATION_CACHE = cli_flags.define_compilation_cache_flag(
  "later checks load the compiled programs instead of compiling them."
)
_FAST_COMPILE = flags.DEFINE_bool(
  "fast-compile",
  True,
  "Compile the check's programs without XLA backend optimisation (and, on CPU, without LLVM's "
  "expensive passes): about half the compile time, the same KLs to ~1e-6 relative "
  "(compile_cache.fast_compilation).",
)
_CONSERVATIVE = flags.DEFINE_bool(
  "conservative",
  False,
  "Take every limit of the file's rule at the lower end of its interval (then no longer the "
  "rule the file was validated with).",
)
_PLOT = flags.DEFINE_string(
  "plot", None, "Also draw each candidate's KL by token position as a PNG at PATH."
)
_EXTRAPOLATE = flags.DEFINE_enum(
  "extrapolate",
  "refuse",
  ["refuse", "pooled", "default"],
  "A candidate the budget never calibrated its source for, or beyond its source's calibrated "
  "range: refuse it, or judge it against the pooled or the uncalibrated default limit (the "
  "table's call says so).",
)
_REPORT_ONLY = flags.DEFINE_bool(
  "report-only",
  False,
  "Exit 0 whatever the verdicts (for a report, not a gate); errors still exit 2.",
)


_EXPORT_PROMPTS = flags.DEFINE_string(
  "export-prompts",
  None,
  "Write the calibration prompts (JSONL: ids, text, token ids, the sampling settings) for "
  "another engine to complete, and exit; needs no --candidate.",
)
_ENGINE_SAMPLES = flags.DEFINE_string(
  "engine-samples",
  None,
  "Screen another engine from its completions of the exported prompts with the log-probability "
  "of every sampled token (instead of --candidate).",
)
_ENGINE_FORMAT = flags.DEFINE_enum(
  "engine-format", "auto", ["auto", "vllm", "sglang", "plain"], "The --engine-samples format."
)
_ENGINE_TEMPERATURE = flags.DEFINE_float(
  "engine-temperature",
  None,
  "The temperature the engine sampled at, for samples whose records do not say (must be the "
  "check's rollout.temperature).",
)
_ENGINE_SOURCE = flags.DEFINE_string(
  "engine-source",
  None,
  "The engine's mismatch sources, e.g. fp8_weights+fp8_kv, for a budget with per-source "
  "limits; default: the overall limit.",
)
_INTERVAL = flags.DEFINE_enum(
  "interval",
  "percentile",
  ["percentile", "bca"],
  "--engine-samples: the bootstrap interval of the k3 estimate.",
)


def _engine_main() -> int:
  """--export-prompts or --engine-samples: the exit status (module docstring)."""
  from opd_jax.cli import engine_check

  if _CANDIDATES.value:
    raise ValueError("give either --candidate or --export-prompts / --engine-samples, not both")
  if _EXPORT_PROMPTS.value:
    engine_check.export_prompts(
      cli_flags.CONFIG.value, _EXPORT_PROMPTS.value, num_prompts=_PROMPTS.value
    )
    return 0
  workdir = cli_flags.needed_workdir("the admission log")
  from opd_jax.io import compile_cache

  compile_cache.compilation_cache_flag(_COMPILATION_CACHE.value, workdir)
  with cli_flags.json_output(_JSON.value) as json_path:
    result = engine_check.run_engine_screen(
      cli_flags.CONFIG.value,
      _BUDGET.value,
      _ENGINE_SAMPLES.value,
      engine_format=_ENGINE_FORMAT.value,
      engine_temperature=_ENGINE_TEMPERATURE.value,
      engine_source=_ENGINE_SOURCE.value,
      num_prompts=_PROMPTS.value,
      workdir=workdir,
      params_from=_PARAMS_FROM.value,
      force=_FORCE.value,
      conservative=_CONSERVATIVE.value,
      extrapolate=_EXTRAPOLATE.value,
      method=_INTERVAL.value,
      json_path=json_path,
      log=cli_flags.log_for_json(_JSON.value),
    )
  admitted = all(row["admitted"] for row in result["rows"])
  return 0 if admitted or _REPORT_ONLY.value else EXIT_REFUSED


def main() -> int:
  """Runs the check; its exit status (module docstring). A ValueError or FileNotFoundError
  reaches the runner, which exits EXIT_ERROR; any other failure is an error too."""
  from opd_jax.cli import admit_check
  from opd_jax.io import compile_cache

  if _FAST_COMPILE.value:
    compile_cache.fast_compilation()
  if _EXPORT_PROMPTS.value or _ENGINE_SAMPLES.value:
    if _EXPORT_PROMPTS.value and _ENGINE_SAMPLES.value:
      raise ValueError("give --export-prompts or --engine-samples, not both")
    cli_flags.exit_at_once(_engine_main())
  if not _CANDIDATES.value:
    raise ValueError(
      "--candidate is required (or --export-prompts / --engine-samples to screen another engine)"
    )
  if not cli_flags.WORKDIR.value:
    raise ValueError("--workdir is required: where the admission log goes")
  try:
    compile_cache.compilation_cache_flag(_COMPILATION_CACHE.value, cli_flags.WORKDIR.value)
    with cli_flags.json_output(_JSON.value) as json_path:
      result = admit_check.run_admission(
        cli_flags.CONFIG.value,
        _BUDGET.value,
        _CANDIDATES.value,
        num_prompts=_PROMPTS.value,
        workdir=cli_flags.WORKDIR.value,
        params_from=_PARAMS_FROM.value,
        force=_FORCE.value,
        conservative=_CONSERVATIVE.value,
        extrapolate=_EXTRAPOLATE.value,
        json_path=json_path,
        log=cli_flags.log_for_json(_JSON.value),
      )
  except (ValueError, FileNotFoundError):
    raise
  except Exception:  # noqa: BLE001 (a failure of the check is an error, not a refusal)
    traceback.print_exc()
    cli_flags.exit_at_once(EXIT_ERROR)
  if _PLOT.value:
    from opd_jax.experiments import plots

    plots.kl_by_position(result["rows"], _PLOT.value)
  admitted = all(row["admitted"] for row in result["rows"])
  # The table is printed; the JSON and the log are closed.
  cli_flags.exit_at_once(0 if admitted or _REPORT_ONLY.value else EXIT_REFUSED)
  return 0  # not reached


if __name__ == "__main__":
  runner.run_command(main, required=("config",), error_status=EXIT_ERROR)
