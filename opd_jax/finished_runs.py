"""Entry point: save a workdir's finished runs and measurements, or restore them, so a long
study runs in parts on machines that keep nothing between sittings.

    python -m opd_jax.finished_runs --workdir=DIR --save=RECORDS      # after a part
    python -m opd_jax.finished_runs --workdir=DIR --restore=RECORDS   # before the next

RECORDS holds every `result.json` and `measurements.json` of DIR at the same relative paths,
with each finished run's `metrics.jsonl` (as `metrics.jsonl.gz`), and nothing else (no
checkpoints, TensorBoard events, compiled programs, or logs of unfinished runs). Restore into the
same DIR path the part ran in: a run's config holds its teacher cache's path, by default under
DIR, and a run is reused only for the same config. A restore that would replace a different
file is refused, naming it, and copies nothing. The study's plan (`python -m opd_jax.study ...
--plan`) then counts the restored runs as reused. The logic is `opd_jax.io.finished_runs`.
"""

from __future__ import annotations

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner

_SAVE = flags.DEFINE_string("save", None, "Copy DIR's records to this directory.")
_RESTORE = flags.DEFINE_string("restore", None, "Copy this directory's records into DIR.")


def main() -> None:
  from opd_jax.io import finished_runs

  if (_SAVE.value is None) == (_RESTORE.value is None):
    raise ValueError("give exactly one of --save=RECORDS and --restore=RECORDS")
  workdir = cli_flags.WORKDIR.value
  if _SAVE.value is not None:
    paths = finished_runs.save(workdir, _SAVE.value)
    print(f"saved {len(paths)} record(s) of {workdir} to {_SAVE.value}")
    return
  done = finished_runs.restore(_RESTORE.value, workdir)
  print(
    f"restored {len(done['copied'])} record(s) from {_RESTORE.value} into {workdir} "
    f"({len(done['present'])} already there, identical)"
  )


if __name__ == "__main__":
  runner.run_command(main, required=("workdir",), shared=("workdir",))
