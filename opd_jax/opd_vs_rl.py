"""Entry point: OPD against RL under the same rollout mismatch.

    python -m opd_jax.opd_vs_rl --config=configs/opd_vs_rl.py[:tiny|:fair] --workdir=DIR
        [--json=PATH|-] [--config.run.teacher.cache_dir=/tmp/tcache]
        [--config.settings='("rollout.stale_k=2",)'] [--compilation-cache=DIR]

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
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging

from opd_jax.cli import flags as cli_flags
from opd_jax.experiments import opd_vs_rl
from opd_jax.io import compile_cache

_JSON = flags.DEFINE_string(
  "json", None, "Also write the report JSON to PATH; - (or a bare --json) prints it to stdout."
)
_COMPILATION_CACHE = cli_flags.define_compilation_cache_flag(
  "every run after the first of its kind loads its programs instead of compiling them."
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  log = cli_flags.log_for_json(_JSON.value)
  try:
    compile_cache.compilation_cache_flag(_COMPILATION_CACHE.value, flags.FLAGS.workdir)
    report = opd_vs_rl.run_comparison(flags.FLAGS.config, flags.FLAGS.workdir, log=log)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  if _JSON.value:
    cli_flags.write_json(json.dumps(report, indent=1), _JSON.value)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, argv=cli_flags.resolve_config_arg(sys.argv), flags_parser=cli_flags.parse_flags)
