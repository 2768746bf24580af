"""Entry point: the verdict of a finished OPD-against-RL comparison, read from its report under
the rule its config fixed before any run.

    python -m opd_jax.opd_vs_rl_verdict --report=DIR/opd_vs_rl.json [--json=PATH|-]

Prints, per setting, the T = 1 and greedy drops of full-vocabulary OPD and GRPO with their
intervals, the criteria that hold for and against the claim, and the verdict (supported,
contradicted, mixed, not shown); then GRPO + TIS against GRPO. Trains nothing and reads only the
report's JSON, so a comparison trained by a frozen commit is read by this code. --json=PATH also
writes every reading, with the report's provenance and this code's; --json=- (or a bare --json)
prints the JSON to stdout and the tables to stderr. The rule, and the choices where its text
leaves one: `opd_jax.experiments.opd_vs_rl_verdict`.
"""

from __future__ import annotations

import json

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

_REPORT = flags.DEFINE_string("report", None, "The comparison's opd_vs_rl.json.")
_JSON = flags.DEFINE_string(
  "json", None, "Also write the readings to PATH; - (or a bare --json) prints them to stdout."
)


def main() -> None:
  from opd_jax.experiments import opd_vs_rl_verdict
  from opd_jax.io import provenance

  report = json_file.read_json(_REPORT.value)
  result = opd_vs_rl_verdict.verdicts(report)
  result["provenance"] = provenance.provenance()
  log = cli_flags.log_for_json(_JSON.value)
  log(opd_vs_rl_verdict.markdown(result))
  if _JSON.value:
    json_file.write_text(_JSON.value, json.dumps(result, indent=1))


if __name__ == "__main__":
  runner.run_command(main, required=("report",), shared=())
