"""The admission rules a study validates: the one its config fixes before anything runs
(`study_rule`), each rule's verdicts on the study's rows through the admission check's own path
(`verdicts`), and every rule of the registry scored on the same held-out settings beside it
(`rule_variants`). The procedure is `experiments.study`'s (step 5).
"""

from __future__ import annotations

from collections.abc import Sequence

from opd_jax.experiments import stats
from opd_jax.mismatch import admission, budget, budget_fit
from opd_jax.mismatch import candidates as candidates_lib

LABEL_DROP = "label_drop"  # the drop a held-out verdict is judged by: over its runs

# The rules every study scores beside its configured one: each rule of the registry, and the
# pooled and whole ones at the lower ends of their intervals.
RULES = {
  **{name: budget.Rule(name) for name in budget.RULE_NAMES},
  "pooled_conservative": budget.Rule("pooled", {"conservative": True}),
  "whole_conservative": budget.Rule("whole", {"conservative": True}),
}


CROSSING_VARIANTS = (1, 2)  # min_crossing_records of the whole-rule variants refitted beside


def study_rule(config) -> budget.Rule:
  """The admission rule the study validates, fixed by its config: `config.rule` (a name of
  `budget.RULE_NAMES`) when set, else "per_part" with `per_part`, "whole" with `per_source`,
  "pooled" without (no validation yet: `rule_validation` adds it).

  Raises:
    ValueError: an unknown rule name.
  """
  if config.get("rule", ""):
    return budget.Rule(config.rule)
  if config.get("per_part", False):
    return budget.Rule("per_part")
  return budget.Rule("whole" if config.get("per_source", False) else "pooled")


def rule_validation(held_out_confusion: dict, tolerance: float) -> dict:
  """The validation a study gives its configured rule: its confusion table on the held-out
  settings (none of which the budget was fitted on), labelled by their full runs."""
  return {
    **held_out_confusion,
    "tolerance": tolerance,
    "label": "a held-out setting kept quality iff its mean drop over its runs <= tolerance",
  }


def verdicts(
  rows: Sequence[dict], config, fitted: budget.Budget, rule: budget.Rule, extrapolate=None
) -> list:
  """The verdict of `rule` on every row (a setting's measurement, with its parts), through
  `admission.candidate_verdict`: the admission check's own path. A setting the budget's
  records do not reach is handled as `extrapolate` says (default: `config.extrapolate`, else
  "refuse"; `budget_rules.apply_rule`)."""
  extrapolate = extrapolate or config.get("extrapolate", "refuse")
  out = []
  for r in rows:
    candidate = candidates_lib.parse_candidate(r["spec"], config.run)
    out.append(
      admission.candidate_verdict(candidate, config.run, r, fitted, None, rule, extrapolate)[1]
    )
  return out


def rule_variants(rows: Sequence[dict], config, fitted: budget.Budget, tolerance: float) -> dict:
  """The confusion table of every rule in RULES on the same (held-out) rows, so the
  configured rule can be read beside the others; only the configured one is a pre-set test.

  Also "whole_min_crossing_<c>" for each c of CROSSING_VARIANTS other than the budget's own:
  the whole rule on the same records refitted with min_crossing_records = c."""
  out = {}
  for name, rule in RULES.items():
    judged = verdicts(rows, config, fitted, rule)
    labelled = [{**r, "admitted": v.admitted} for r, v in zip(rows, judged, strict=True)]
    out[name] = stats.confusion(labelled, tolerance, LABEL_DROP)
  for c in CROSSING_VARIANTS:
    if c == fitted.min_crossing_records:
      continue
    refit = budget_fit.fit_budget(
      fitted.records,
      tolerance,
      level=fitted.level,
      num_bootstrap=fitted.num_bootstrap,
      seed=fitted.seed,
      min_crossing_records=c,
    )
    judged = verdicts(rows, config, refit, RULES["whole"])
    labelled = [{**r, "admitted": v.admitted} for r, v in zip(rows, judged, strict=True)]
    out[f"whole_min_crossing_{c}"] = stats.confusion(labelled, tolerance, LABEL_DROP)
  return out
