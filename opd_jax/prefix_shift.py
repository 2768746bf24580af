"""Entry point: prefix shift of perturbed rollout engines.

    python -m opd_jax.prefix_shift --config=configs/<name>.py[:variant] [--config.key=value ...]
        --source=noise:0.01:0.02:0.05 --source=fp8 [--source=rollout.<key>=<value>,...]
        [--params-from=RUN] [--prompts=N] [--json=OUT] [--workdir=DIR]

For each source, the perturbed and the unperturbed engine sample the same calibration prompts
with the same random numbers; the command prints the teacher-forced mismatch (both policies
on the unperturbed engine's samples), the own-prefix mismatch (on the perturbed engine's own
samples), and the first position where the two decodes differ, beside what the per-token
flip probabilities predict for it. A source is `noise:<sigma>[:<sigma>...]`,
`kernel:<name>`, `fp8` (weights and KV cache), `fp8_weights`, `fp8_kv`, or an admission
candidate spec `rollout.<key>=<value>[,...]`. The JSON (default <workdir>/prefix_shift.json)
holds every figure and the first-divergence histograms. The logic is
`opd_jax.mismatch.prefix_shift.run_prefix_shift`.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from opd_jax.cli import flags as cli_flags
from opd_jax.mismatch import admission, prefix_shift

_SOURCES = flags.DEFINE_multi_string("source", None, "A perturbed engine; repeat for several.")
_PROMPTS = flags.DEFINE_integer("prompts", admission.DEFAULT_NUM_PROMPTS, "Calibration prompts.")
_JSON = flags.DEFINE_string("json", None, "Result JSON; default <workdir>/prefix_shift.json.")
_PARAMS_FROM = flags.DEFINE_string(
  "params-from", None, "A trainer workdir: use the student of its latest checkpoint."
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  json_path = _JSON.value or os.path.join(flags.FLAGS.workdir, "prefix_shift.json")
  try:
    prefix_shift.run_prefix_shift(
      flags.FLAGS.config,
      _SOURCES.value,
      params_from=_PARAMS_FROM.value,
      num_prompts=_PROMPTS.value,
      json_path=json_path,
      log=lambda *a: print(*a, flush=True),
    )
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  for name in ("config", "source"):
    flags.mark_flag_as_required(name)
  app.run(main, argv=cli_flags.resolve_config_arg(sys.argv), flags_parser=cli_flags.parse_flags)
