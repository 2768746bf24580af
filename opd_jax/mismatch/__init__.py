"""The mismatch budget and what is built on it, above the trainer (docs/design.md, "The
common mismatch scale" and "Budget and admission").

- `candidates`: rollout configurations named as `rollout.<key>=<value>` overrides, and the
  mismatch sources each one changes.
- `measure`: one configuration's mismatch on calibration prompts, with no training (the
  procedure the admission check, the sensitivity scan and the study share).
- `budget`: the Budget, its thresholds and rules; `budget_fit`: `fit_budget`, and
  `budget_rules`: `apply_rule` and `admit`, pure functions of the logged divergences;
  `budget_file`: the budget file and its fingerprint.
- `admission`: the admission check's measurement and verdict (`measure_candidate`,
  `candidate_verdict`); the command's driver, table and log are `cli.admit_check`.
- `sensitivity`: the per-layer/module scan behind `python -m opd_jax.sensitivity`;
  `prefix_shift`: teacher-forced against own-prefix mismatch and the first divergence.
- `guard`: the fallback ladder and the guard's pure state machine; `live_guard`: the budget as a
  live guard, a step hook handed to the trainer (`live_guard.run`).

The per-step `mismatch/*` metrics the trainer logs are below it, in `train.mismatch_metrics`.
"""
