"""Entry point: a grid of named arms over seeds, each a whole training run.

    python -m opd_jax.sweep --config=configs/grpo_sweep.py[:confirm|:tiny] --workdir=DIR
        [--json=PATH|-] [--compilation-cache=DIR]

Trains every (arm, seed) run of the config into DIR/runs/<arm>__seed<k> (a restart reuses the
finished runs), then prints the table and writes DIR/sweep.md, DIR/sweep.json (every curve and
number, the provenance of the config and of each run's code) and DIR/sweep_curves.png. Each
arm's gain over the shared warm start is reported with its t interval over seeds, as a share
of the reference arm's gain, and at the reference arm's wall time; the config's selection rule
names the arm it picks. --json=PATH also writes the JSON there; --json=- prints it. The logic
is `opd_jax.experiments.sweep.run_sweep`.
"""

from __future__ import annotations

import json

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

_JSON = flags.DEFINE_string(
  "json", None, "Also write the report JSON to PATH; - (or a bare --json) prints it to stdout."
)
_COMPILATION_CACHE = cli_flags.define_compilation_cache_flag(
  "every run after the first of its kind loads its programs instead of compiling them."
)


def main() -> None:
  from opd_jax.experiments import sweep
  from opd_jax.io import compile_cache

  log = cli_flags.log_for_json(_JSON.value)
  compile_cache.compilation_cache_flag(_COMPILATION_CACHE.value, cli_flags.WORKDIR.value)
  report = sweep.run_sweep(cli_flags.CONFIG.value, cli_flags.WORKDIR.value, log=log)
  if _JSON.value:
    json_file.write_text(_JSON.value, json.dumps(report, indent=1))


if __name__ == "__main__":
  runner.run_command(main, required=("config", "workdir"))
