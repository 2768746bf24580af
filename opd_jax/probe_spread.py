"""Entry point: how much of a verdict is the probe.

    python -m opd_jax.probe_spread --config=configs/<study>.py --workdir=DIR
        --candidate=SPEC [--candidate=SPEC ...] [--seeds=0,1,2] [--budget=DIR/budget.json]
        [--json=PATH|-] [--md=PATH] [--compilation-cache=DIR]

Trains the study's probe (`probe_steps` reference steps) once per seed and measures each
candidate at each probe's student with the study's own procedure; DIR is the study's workdir,
whose own probe and measurements are reused for its first seed. Prints per candidate the
check's KL at each probe seed, their mean and spread, and with --budget the rule's call at each
probe and whether the probes agree. The logic is `opd_jax.experiments.probe_spread`.
"""

from __future__ import annotations

import sys

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner

_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Probe seeds (train.seed of each probe).")
_CANDIDATES = flags.DEFINE_multi_string(
  "candidate", None, "rollout.<key>=<value>[,rollout.<key>=<value> ...]; repeat for several."
)
_BUDGET = flags.DEFINE_string(
  "budget", None, "A budget file (the study's DIR/budget.json): its rule's call at each probe."
)
_JSON = flags.DEFINE_string("json", None, "Write the rows as JSON to PATH (`-`: stdout).")
_MD = flags.DEFINE_string("md", None, "Write the markdown table to PATH.")
_COMPILATION_CACHE = cli_flags.define_compilation_cache_flag(
  "the measurements after the first load their programs."
)


def main() -> None:
  from opd_jax.experiments import probe_spread
  from opd_jax.io import compile_cache, json_file

  try:
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError as e:
    raise ValueError(f"--seeds={','.join(_SEEDS.value)}: not integers") from e
  workdir = cli_flags.WORKDIR.value
  compile_cache.compilation_cache_flag(_COMPILATION_CACHE.value, workdir)
  log = cli_flags.log_for_json(_JSON.value)
  config = cli_flags.CONFIG.value
  specs = _CANDIDATES.value or []
  result = probe_spread.probe_spread(config, workdir, seeds, specs, _BUDGET.value, log)
  text = "\n".join(probe_spread.markdown_lines(result))
  print(text, file=sys.stderr if _JSON.value == "-" else sys.stdout)
  if _MD.value:
    with open(_MD.value, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  if _JSON.value:
    json_file.write_json(_JSON.value, result)


if __name__ == "__main__":
  runner.run_command(main, required=("config", "workdir", "candidate"))
