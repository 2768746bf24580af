"""`opd_jax.budget`: the stable import path of the mismatch budget and the admission check.

A thin re-export: the code lives in `opd_jax.mismatch.budget` (the Budget, its thresholds and
rules), `opd_jax.mismatch.budget_fit` (`fit_budget`, the pure fit), `opd_jax.mismatch.budget_rules`
(`apply_rule`, the one function that applies a budget's rule, and `admit`) and
`opd_jax.mismatch.budget_file` (the JSON budget file and its fingerprint), which document the
equations, the record format and the file schema.
"""

from opd_jax.mismatch.budget import (
  RULE_NAMES,
  UNCALIBRATED_MAX_KL,
  Budget,
  Rule,
  Threshold,
  uncalibrated_budget,
)
from opd_jax.mismatch.budget_file import (
  budget_from_json,
  budget_to_json,
  fingerprint,
  load_budget,
  load_budget_or_default,
  save_budget,
  stale_reasons,
)
from opd_jax.mismatch.budget_fit import fit_budget
from opd_jax.mismatch.budget_rules import Verdict, admit, apply_rule

__all__ = [
  "RULE_NAMES",
  "UNCALIBRATED_MAX_KL",
  "Budget",
  "Rule",
  "Threshold",
  "Verdict",
  "admit",
  "apply_rule",
  "budget_from_json",
  "budget_to_json",
  "fingerprint",
  "fit_budget",
  "load_budget",
  "load_budget_or_default",
  "save_budget",
  "stale_reasons",
  "uncalibrated_budget",
]
