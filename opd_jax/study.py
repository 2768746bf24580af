"""Entry point: the mismatch study.

    python -m opd_jax.study --config=configs/study.py[:tiny] [--config.<key>=<value> ...]
        --workdir=DIR [--compilation-cache=DIR]

Calibrates the mismatch budget on the embedded task (a probe run, the admission check's
measurement of every setting, one OPD run per setting, the isotonic fit at a tolerance above
the seed-to-seed noise floor), validates the admission check on held-out settings (confusion
table), and writes `study.json`, `report.md`, `budget.json` and PNG plots into the workdir. A
restarted study reuses every finished run and measurement. The runs and measurements keep their
compiled programs in DIR/jax_cache (--compilation-cache; "" = off), so every run after the first
of its kind loads the sampler, train step and evaluation instead of compiling them (the same
programs, so the same numbers). Each finished setting and run prints `i/n` with an ETA; on a
terminal a status line under the log says where the study is. The logic is
`opd_jax.experiments.study.run_study`.

The cost plan is printed first (`experiments.study_plan`): how many runs, probes and
measurements, the estimated wall time from the config's cost constants, and which runs the
workdir already holds (reused). `--plan` prints it and exits without training.
"""

from __future__ import annotations

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner

_COMPILATION_CACHE = cli_flags.define_compilation_cache_flag(
  "every run and measurement after the first of its kind loads its programs."
)

_PLAN = flags.DEFINE_bool(
  "plan", False, "Print the cost plan (runs, probes, measurements, wall time, reuse) and exit."
)


def main() -> None:
  from opd_jax.experiments import study, study_plan
  from opd_jax.io import compile_cache

  plan = study_plan.study_plan(cli_flags.CONFIG.value, cli_flags.WORKDIR.value)
  print("\n".join(study_plan.plan_lines(plan)), flush=True)
  if _PLAN.value:
    return
  compile_cache.compilation_cache_flag(_COMPILATION_CACHE.value, cli_flags.WORKDIR.value)
  study.run_study(cli_flags.CONFIG.value, cli_flags.WORKDIR.value, cli_flags.ProgressLog())


if __name__ == "__main__":
  runner.run_command(main, required=("config", "workdir"))
