"""Entry point: `python -m opd_jax.main --config=configs/<name>.py[:variant] [--workdir=DIR]`.

This file only parses flags, starts the distributed runtime when asked, and calls
`run(config, workdir)`. The logic lives in libraries that are tested on their own.
A bare `--config=fp8_async.py` resolves inside the repository's `configs/`.
"""

from __future__ import annotations

import sys

import jax
from absl import app, flags, logging

from opd_jax.cli import flags as cli_flags

_DISTRIBUTED = flags.DEFINE_bool(
  "distributed", False, "Call jax.distributed.initialize() (multi-host launches)."
)


def run(config, workdir: str) -> dict:
  """Runs on-policy distillation as configured (the trainer validates the config first)."""
  from opd_jax.mismatch import guard

  return guard.run(config, workdir)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:  # keep library INFO chatter (orbax) out of the way
    logging.set_verbosity(logging.WARNING)
  if _DISTRIBUTED.value:
    jax.distributed.initialize(**cli_flags.distributed_args())
  print(
    f"process {jax.process_index()}/{jax.process_count()} holding "
    f"{jax.local_device_count()} of {jax.device_count()} devices ({jax.default_backend()})",
    flush=True,
  )
  try:
    run(cli_flags.CONFIG.value, cli_flags.WORKDIR.value)
  except Exception as e:  # noqa: BLE001 (every failure of a multi-process run ends at once)
    if jax.process_count() > 1:
      cli_flags.exit_multiprocess_error(e)
    if isinstance(e, ValueError | FileNotFoundError):
      sys.exit(f"error: {e}")
    raise
  cli_flags.freeze_heap_for_exit()


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, argv=cli_flags.resolve_config_arg(sys.argv), flags_parser=cli_flags.parse_flags)
