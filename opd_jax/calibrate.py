"""Entry point: calibrate a mismatch budget for your own student–teacher pair.

    python -m opd_jax.calibrate --config=<your run config> [--config.key=value ...]
        --workdir=DIR [--quick] [--candidate=SPEC ...] [--run-steps=N] [--seeds=0,1]
        [--rule=pooled] [--label=auto|accuracy|teacher_kl] [--prompts=N] [--workers=N]
        [--nosensitivity] [--json=PATH|-] [--compilation-cache=DIR] [--plan-only]

The run config is the one you train with (`opd_jax.main`'s `--config` and overrides: HF
checkpoints with a prompt and an eval file, or the built-in task). The calibration runs the
study's procedure on it: a probe run, the admission check's measurement of a ladder of settings
per mismatch source, short OPD runs of each, and the fit, written as DIR/budget.json,
fingerprinted to your student and teacher and carrying its rule; then each --candidate is
screened against that budget, as `python -m opd_jax.admit --budget=DIR/budget.json` would.
`--quick` is the cheapest design that still crosses τ (weight noise and the candidates' own
sources, two seeds, runs of a quarter of train.steps). The plan and its cost, as a multiple of
one training run of your config, are printed before anything trains (`--plan-only` stops
there); bad input (a config the trainer refuses, a candidate that changes nothing, too few
prompts) is refused first. A restarted calibration reuses every finished run and measurement.
The logic is `opd_jax.experiments.calibrate`.
"""

from __future__ import annotations

from absl import flags

from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.config.values import DEFAULT_NUM_PROMPTS
from opd_jax.io import json_file

_QUICK = flags.DEFINE_bool(
  "quick", False, "The quick design: noise and the candidates' sources, two seeds, short runs."
)
_CANDIDATES = flags.DEFINE_multi_string(
  "candidate",
  None,
  "rollout.<key>=<value>[,rollout.<key>=<value> ...]: a rollout configuration to screen at the "
  "end (its sources get ladders with --quick); repeat for several.",
)
_RUN_STEPS = flags.DEFINE_integer(
  "run-steps", 0, "Steps per calibration run; 0 = train.steps/4 (--quick) or train.steps/2."
)
_SEEDS = flags.DEFINE_list("seeds", [], "Reference seeds; default 0,1 (--quick) or 0,...,4.")
_RULE = flags.DEFINE_string("rule", "pooled", "The admission rule the budget file carries.")
_LABEL = flags.DEFINE_enum(
  "label",
  "auto",
  ["auto", "accuracy", "teacher_kl"],
  "A run's quality: held-out accuracy, held-out KL(student||teacher), or auto (accuracy when "
  "the pair solves the task).",
)
_PROMPTS = flags.DEFINE_integer(
  "prompts", DEFAULT_NUM_PROMPTS, "Calibration prompts per measurement."
)
_WORKERS = flags.DEFINE_integer("workers", 2, "Runs trained side by side.")
_SENSITIVITY = flags.DEFINE_bool(
  "sensitivity", True, "Also the layer-sensitivity scan and FP8 recipe at the probe's student."
)
_JSON = flags.DEFINE_string("json", None, "Also write the result as JSON to PATH; - = stdout.")
_PLAN_ONLY = flags.DEFINE_bool("plan-only", False, "Print the plan and its cost, train nothing.")
_COMPILATION_CACHE = cli_flags.define_compilation_cache_flag(
  "every run and measurement after the first of its kind loads its programs."
)


def main() -> None:
  from opd_jax.experiments import calibrate
  from opd_jax.io import compile_cache

  log = cli_flags.log_for_json(_JSON.value)
  workdir = cli_flags.WORKDIR.value
  plan = calibrate.make_plan(
    cli_flags.CONFIG.value,
    quick=_QUICK.value,
    candidates=_CANDIDATES.value or (),
    run_steps=_RUN_STEPS.value,
    seeds=[int(s) for s in _SEEDS.value],
    rule=_RULE.value,
    label=_LABEL.value,
    num_prompts=_PROMPTS.value,
    workers=_WORKERS.value,
    sensitivity=_SENSITIVITY.value,
  )
  log(plan.describe())
  plan.study.num_eval = calibrate.check_prompts(
    plan.study.run, workdir, plan.study.num_prompts, log
  )
  if _PLAN_ONLY.value:
    return
  compile_cache.compilation_cache_flag(_COMPILATION_CACHE.value, workdir)
  result = calibrate.calibrate(plan, workdir, log)
  if _JSON.value:
    json_file.write_json(_JSON.value, result)


if __name__ == "__main__":
  runner.run_command(main, required=("config", "workdir"))
