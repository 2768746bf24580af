"""Entry point: `python -m opd_jax.main --config=configs/<name>.py[:variant] --workdir=DIR`.

This file only parses flags, starts the distributed runtime when asked, and calls
`run(config, workdir)`. The logic lives in libraries that are tested on their own.
A bare `--config=fp8_async.py` resolves inside the repository's `configs/`. `--json=PATH`
writes the final record (the `done:` line) as JSON; `--json=-` prints it to stdout and the
readable lines to stderr.
"""

from __future__ import annotations

import contextlib
import sys

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

_DISTRIBUTED = flags.DEFINE_bool(
  "distributed", False, "Call jax.distributed.initialize() (multi-host launches)."
)
_JSON = flags.DEFINE_string(
  "json", None, "Also write the final record as JSON to PATH; - prints it to stdout."
)


def run(config, workdir: str) -> dict:
  """Runs on-policy distillation as configured (the trainer validates the config first)."""
  from opd_jax.mismatch import live_guard

  return live_guard.run(config, workdir)


def main() -> None:
  import jax

  if _DISTRIBUTED.value:
    jax.distributed.initialize(**cli_flags.distributed_args())
  readable = sys.stderr if _JSON.value == "-" else sys.stdout
  with contextlib.redirect_stdout(readable):
    print(
      f"process {jax.process_index()}/{jax.process_count()} holding "
      f"{jax.local_device_count()} of {jax.device_count()} devices ({jax.default_backend()})",
      flush=True,
    )
    try:
      result = run(cli_flags.CONFIG.value, cli_flags.WORKDIR.value)
    except Exception as e:  # noqa: BLE001 (every failure of a multi-process run ends at once)
      if jax.process_count() > 1:
        cli_flags.exit_multiprocess_error(e)
      raise
    sys.stdout.flush()
  if _JSON.value and jax.process_index() == 0:
    json_file.write_json(_JSON.value, result)
  cli_flags.freeze_heap_for_exit()


if __name__ == "__main__":
  runner.run_command(main, required=("config", "workdir"))
