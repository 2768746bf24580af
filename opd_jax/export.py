"""Entry point: export a run's student as a Hugging Face checkpoint.

    python -m opd_jax.export --workdir=RUN [--step=N] --out=DIR [--config=FILE[:variant]]

Writes DIR with the student of RUN's checkpoint at step N (default: the latest): weights,
config.json and generation_config.json with the bos/eos/pad ids, and the tokenizer; it loads
with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer`. The config
defaults to the one the run saved with its checkpoints; `--config` (with `--config.key=value`
overrides) and `--workdir` are `opd_jax.main`'s own flags. A finished run also exports itself
(`export.dir`). The logic is `opd_jax.train.export.export_run`.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

from opd_jax.cli import flags as cli_flags
from opd_jax.train import export as exporting

_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export; default: the latest.")
_OUT = flags.DEFINE_string("out", None, "Directory to write the Hugging Face checkpoint to.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.ERROR)  # orbax warns about every restore it does
  if not flags.FLAGS["workdir"].present:
    sys.exit("error: pass --workdir=RUN, the training run to export")
  try:
    exporting.export_run(flags.FLAGS.workdir, _OUT.value, _STEP.value, flags.FLAGS.config)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  flags.mark_flag_as_required("out")
  app.run(main, argv=cli_flags.resolve_config_arg(sys.argv), flags_parser=cli_flags.parse_flags)
