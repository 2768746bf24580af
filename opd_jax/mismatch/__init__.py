"""Training–inference mismatch on one scale (DESIGN.md, "The common mismatch scale").

This package owns the mismatch measurement, the mismatch budget, the admission check, the
study that calibrates them and the live guard:

- `metrics`: `mismatch_metrics(student_logits_bcv, rollout)`, the per-step
  `mismatch/*` metrics between the engine's distribution π_b and the trainer's
  student π_θ on the rollout's prefixes (per-token KL with mean, p95 and max; k1,
  k3; |Δ log p|), and `default_return_topk(vocab_size)`, the behaviour
  distribution the sampler must return for them.
- `measure`: `measure(...)`, one configuration's mismatch on calibration prompts (the
  procedure the admission check, the sensitivity scan and the study share);
  `sensitivity`: the layer/module scan behind `python -m opd_jax.sensitivity`;
  `prefix_shift`: teacher-forced vs own-prefix mismatch and first divergence
  (`python -m opd_jax.prefix_shift`).
- `budget`: `fit_budget` and `admit` (pure); `budget_file`: the budget file and its
  fingerprint.
- `admission`: the admission check behind `python -m opd_jax.admit` (`run_admission`).
- `runs`: a training run recorded once (`run_once`); `study` and `study_report`: the study
  behind `python -m opd_jax.study`; `opd_vs_rl`: OPD against RL under the same mismatch
  (`python -m opd_jax.opd_vs_rl`).
- `guard`: the budget as a live guard in training (`budget.*` config).
"""

from opd_jax.train.mismatch_metrics import (
  default_return_topk,
  masked_max,
  masked_quantile,
  mismatch_metrics,
  per_token_kl,
)

__all__ = [
  "default_return_topk",
  "masked_max",
  "masked_quantile",
  "mismatch_metrics",
  "per_token_kl",
]
