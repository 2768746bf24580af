"""Entry point: OPD against RL under the same rollout mismatch.

    python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl.py[:tiny|:fair] --workdir=DIR
        (or --config=configs/opd_vs_rl_learns.py[:tiny], on the GRPO baseline that learns)
        [--json=PATH|-] [--config.run.teacher.cache_dir=/tmp/tcache]
        [--config.settings='("rollout.stale_k=2",)'] [--compilation-cache=DIR]
        [--plan] [--part=K]

For the reference engine and each mismatch setting of the config, trains each arm of
`config.methods` (OPD with the full-vocabulary or the sampled-token estimator, REINFORCE, GRPO,
each with or without a correction for the engine's mismatch; `config.blocks` gives arms their
own seeds) into DIR/runs/<method>__<setting>[__seed<k>] (a restart reuses finished runs), then
prints the table and writes DIR/opd_vs_rl.md, DIR/opd_vs_rl.json (every number),
DIR/opd_vs_rl.png (accuracy and drop against the training-time mismatch/kl) and
DIR/opd_vs_rl_curves.png (the reference runs' learning curves). --json=PATH also writes the
JSON there; --json=- (or a bare --json) prints it to stdout. The runs keep their compiled
programs in DIR/jax_cache (--compilation-cache; "" = off), so every run after the first of its
kind loads the sampler, train step and evaluation instead of compiling them. The logic is
`opd_jax.experiments.opd_vs_rl.run_comparison`.

The cost plan is printed first (`experiments.opd_vs_rl_plan`): the runs of each block, those the
workdir already holds (reused), the estimated wall time from the config's per-run costs, and
its split into parts of about `costs.part_seconds`. `--plan` prints it and exits without
training; `--part=K` trains only part K's runs (the report covers every finished run), so that
the comparison can run over several sittings.
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
_PLAN = flags.DEFINE_bool(
  "plan", False, "Print the cost plan (runs per block, reuse, wall time, parts) and exit."
)
_PART = flags.DEFINE_integer(
  "part", 0, "Train only part K (1, 2, ...) of the plan's split; 0 trains every run."
)
_COMPILATION_CACHE = cli_flags.define_compilation_cache_flag(
  "every run after the first of its kind loads its programs instead of compiling them."
)


def main() -> None:
  from opd_jax.experiments import opd_vs_rl, opd_vs_rl_plan
  from opd_jax.io import compile_cache

  log = cli_flags.log_for_json(_JSON.value)
  config, workdir = cli_flags.CONFIG.value, cli_flags.WORKDIR.value
  plan = opd_vs_rl_plan.comparison_plan(config, workdir)
  log("\n".join(opd_vs_rl_plan.plan_lines(plan)))
  if _PLAN.value:
    return
  only = opd_vs_rl_plan.part_names(plan, _PART.value) if _PART.value else None
  compile_cache.compilation_cache_flag(_COMPILATION_CACHE.value, workdir)
  report = opd_vs_rl.run_comparison(config, workdir, log=log, only=only)
  if _JSON.value:
    json_file.write_text(_JSON.value, json.dumps(report, indent=1))


if __name__ == "__main__":
  runner.run_command(main, required=("config", "workdir"))
