"""Entry point: prefix shift of perturbed rollout engines.

    python -m opd_jax.prefix_shift --config=configs/<name>.py[:variant] [--config.key=value ...]
        --candidate=rollout.<key>=<value>[,rollout.<key>=<value> ...] [--candidate=...]
        [--params-from=RUN] [--prompts=N] [--json=PATH|-] [--workdir=DIR]

`--workdir` is needed when the JSON goes there (no --json).

For each source, the perturbed and the unperturbed engine sample the same calibration prompts
with the same random numbers; the command prints the teacher-forced mismatch (both policies
on the unperturbed engine's samples), the own-prefix mismatch (on the perturbed engine's own
samples), and the first position where the two decodes differ, beside what the per-token
flip probabilities predict for it. A candidate is a rollout setting in the admission check's
syntax, e.g. `rollout.noise_sigma=0.05` or
`rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor`. A stale candidate
(`rollout.stale_k=K`, or `rollout.mode=async,rollout.max_lag=K`) samples with the student K
steps before the one measured: it needs `--params-from=RUN` with checkpoints at the run's
latest step t and at t - K. The old `--source`
(`noise:<sigma>[:<sigma>...]`, `kernel:<name>`, `fp8`, `fp8_weights`, `fp8_kv` or a spec) still
works for this release, with a warning. The JSON (default <workdir>/prefix_shift.json; `-` for
stdout) holds every figure and the first-divergence histograms. The logic is
`opd_jax.mismatch.prefix_shift.run_prefix_shift`.
"""

from __future__ import annotations

import os

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.config.values import DEFAULT_NUM_PROMPTS

_CANDIDATES = flags.DEFINE_multi_string(
  "candidate", None, "rollout.<key>=<value>[,rollout.<key>=<value> ...]; repeat for several."
)
_SOURCES = flags.DEFINE_multi_string(
  "source", None, "Deprecated: --candidate. noise:<sigma>[:...], kernel:<name>, fp8, ..."
)
_PROMPTS = flags.DEFINE_integer("prompts", DEFAULT_NUM_PROMPTS, "Calibration prompts.")
_JSON = flags.DEFINE_string(
  "json", None, "Result JSON to PATH (- = stdout); default <workdir>/prefix_shift.json."
)
_PARAMS_FROM = flags.DEFINE_string(
  "params-from", None, "A trainer workdir: use the student of its latest checkpoint."
)


def main() -> None:
  from opd_jax.mismatch import candidates, prefix_shift

  if _SOURCES.value:
    cli_flags.warn_deprecated("--source", "--candidate=rollout.<key>=<value>[,...]")
  sources = list(_CANDIDATES.value or [])
  for spec in sources:
    candidates.parse_candidate(spec, cli_flags.CONFIG.value)  # a bad key or value fails here
  sources += _SOURCES.value or []
  if not sources:
    raise ValueError("give at least one --candidate=rollout.<key>=<value>[,...]")
  target = _JSON.value or os.path.join(cli_flags.needed_workdir("the JSON"), "prefix_shift.json")
  with cli_flags.json_output(target) as json_path:
    prefix_shift.run_prefix_shift(
      cli_flags.CONFIG.value,
      sources,
      params_from=_PARAMS_FROM.value,
      num_prompts=_PROMPTS.value,
      json_path=json_path,
      log=cli_flags.log_for_json(_JSON.value),
    )


if __name__ == "__main__":
  runner.run_command(main, required=("config",), hidden=("source",))
