"""Entry point: export a run's student as a Hugging Face checkpoint.

    python -m opd_jax.export --params-from=RUN [--step=N] --out=DIR [--config=FILE[:variant]]

Writes DIR with the student of RUN's checkpoint at step N (default: the latest): weights,
config.json and generation_config.json with the bos/eos/pad ids, and the tokenizer; it loads
with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer`. The config
defaults to the one the run saved with its checkpoints; `--config` (with `--config.key=value`
overrides) is `opd_jax.main`'s own flag. `--workdir=RUN`, the old spelling of `--params-from`,
still works for this release, with a warning. A finished run also exports itself
(`export.dir`). The logic is `opd_jax.train.export.export_run`.
"""

from __future__ import annotations

from absl import flags, logging

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner

_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export; default: the latest.")
_OUT = flags.DEFINE_string("out", None, "Directory to write the Hugging Face checkpoint to.")
_PARAMS_FROM = flags.DEFINE_string("params-from", None, "The trained run to export (its workdir).")


def main() -> None:
  from opd_jax.train import export as exporting

  run = _PARAMS_FROM.value
  if not run and flags.FLAGS["workdir"].present:
    cli_flags.warn_deprecated("--workdir (the run to export)", "--params-from=RUN")
    run = flags.FLAGS.workdir
  if not run:
    raise ValueError("pass --params-from=RUN, the training run to export")
  exporting.export_run(run, _OUT.value, _STEP.value, cli_flags.CONFIG.value)


if __name__ == "__main__":
  # orbax warns about every restore it does; --workdir is the old spelling of --params-from
  runner.run_command(main, required=("out",), hidden=("workdir",), verbosity=logging.ERROR)
