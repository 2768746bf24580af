"""The committed study measurements replayed through the admission check's own verdict path.

Each round under docs/study recorded, for every setting, what the admission check measured at
the probe's student (`mismatch/kl`; from round 6 on, each part of a combination measured alone,
`mismatch/kl/part/<source>`) and the verdict of the rule its config fixed before the runs
trained; its budget.json names that rule (`"rule"`) with the held-out result as the rule's
validation. Here every setting goes through `admission.candidate_verdict`, the function
`python -m opd_jax.admit` reaches its verdict through, minus the measurement itself: the
candidate is parsed from its spec against `configs/study.py`'s run config, its sources are
attributed from its engine, its parts are built by `candidates.source_parts` and "measured" by
reading the committed value of that part, and the file's rule is applied.

Which rule each round validated (docs/study/history.md has the rounds):
  round 4 (docs/study)  "whole": the whole combination's KL against the strictest of its
                        sources' limits, min_crossing_records 1; 11 of 12 held-out settings.
  round 5               "whole", min_crossing_records 1; 6 of 12.
  round 6               "whole", min_crossing_records 2; 8 of 12 (per_part scored 10 of 12
                        beside it, a comparison, not the pre-set rule).
  round 7               "per_part": each part alone against its own source's limit,
                        min_crossing_records 2; 11 of 12.
  round 8               round 7's budget and rule on six new combinations of noise and
                        staleness; 6 of 6.
  round 9               "sum_of_fractions": Σ over a combination's parts of part ÷ its own
                        limit ≤ 1, min_crossing_records 2, on the extended sources
                        (configs/validation.py, whose run config it is parsed against); 27 of 30.
Rounds 4 and 5 did not measure parts, so only the rules that read none can be replayed there.
"""

import json
import os
import sys
import warnings

import pytest

from opd_jax.experiments import stats, study_rules
from opd_jax.mismatch import admission, budget, budget_file
from opd_jax.mismatch import candidates as candidates_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "configs"))

import study as study_config  # noqa: E402  (configs/study.py)
import validation as validation_config  # noqa: E402  (configs/validation.py)

# round directory -> (the rule its config fixed, min_crossing_records, held-out agreement)
ROUNDS = {
  "docs/study": ("whole", 1, (11, 12)),
  "docs/study/round5": ("whole", 1, (6, 12)),
  "docs/study/round6": ("whole", 2, (8, 12)),
  "docs/study/round7": ("per_part", 2, (11, 12)),
  "docs/study/round8": ("per_part", 2, (6, 6)),
  "docs/study/round9": ("sum_of_fractions", 2, (27, 30)),
}
WITH_PARTS = ("docs/study/round6", "docs/study/round7", "docs/study/round8", "docs/study/round9")
# rule_variants names each study wrote -> the registry rule that is the same rule
RECORDED_VARIANTS = {
  "pooled": budget.Rule("pooled"),
  "per_source": budget.Rule("whole"),
  "per_part": budget.Rule("per_part"),
  "pooled_conservative": budget.Rule("pooled", {"conservative": True}),
  "per_source_conservative": budget.Rule("whole", {"conservative": True}),
  "whole": budget.Rule("whole"),
  "sum_of_fractions": budget.Rule("sum_of_fractions"),
  "whole_conservative": budget.Rule("whole", {"conservative": True}),
}


def load(directory):
  with open(os.path.join(REPO, directory, "study.json"), encoding="utf-8") as f:
    result = json.load(f)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a committed budget names its rule: no pooled fallback
    fitted, _ = budget_file.load_budget(os.path.join(REPO, directory, "budget.json"))
  return result, fitted


BASE = study_config.get_config().run
# the run config a round's specs are parsed against, where it is not configs/study.py's
BASES = {"docs/study/round9": validation_config.get_config().run}


def replay(row, fitted, rule=None, base=BASE):
  """The check's verdict on a committed row: parse, attribute, measure parts, apply."""
  candidate = candidates_lib.parse_candidate(row["spec"], base)
  calls = []

  def measure_part(source, part):
    assert candidates_lib.candidate_source(part) == source  # the part is that source alone
    calls.append(source)
    return row[f"{budget.PART_KL_PREFIX}{source}"]

  whole = {budget.KL_KEY: row[budget.KL_KEY]}
  # the recorded verdicts predate the extrapolation refusal: a source outside its calibrated
  # range was judged against the pooled limit, as extrapolate="pooled" still does
  measurement, verdict = admission.candidate_verdict(
    candidate, base, whole, fitted, measure_part, rule, extrapolate="pooled"
  )
  assert measurement[budget.SOURCE_KEY] == row["source"]  # the engine gives the same sources
  return verdict, calls


@pytest.mark.parametrize("directory", list(ROUNDS))
def test_each_committed_budget_names_the_rule_its_study_applied(directory):
  result, fitted = load(directory)
  name, crossing, (right, n) = ROUNDS[directory]
  # a study.json written since budgets carry their rule records it; earlier ones, the flags
  recorded = result["rule"] if isinstance(result.get("rule"), dict) else None
  assert (
    fitted.rule.name == name == (recorded or {"name": study_rules.study_rule(result).name})["name"]
  )
  assert fitted.rule.params == {"conservative": False}
  assert fitted.min_crossing_records == crossing
  validation = fitted.rule.validation
  assert {k: validation[k] for k in result["confusion"]} == result["confusion"]
  assert (validation["admitted_kept"] + validation["refused_degraded"], validation["n"]) == (
    right,
    n,
  )
  assert validation["tolerance"] == result["tolerance"]


@pytest.mark.parametrize("directory", list(ROUNDS))
def test_the_check_reproduces_every_recorded_verdict(directory):
  result, fitted = load(directory)
  for row in result["rows"]:
    verdict, calls = replay(row, fitted, base=BASES.get(directory, BASE))
    what = f"{directory}: {row['spec']}"
    assert verdict.admitted == row["admitted"], what
    assert verdict.rule == fitted.rule.name
    assert verdict.limit == pytest.approx(row["limit"], rel=1e-12, abs=1e-15), what
    assert verdict.limit_source == row["limit_source"], what
    assert verdict.margin == pytest.approx(row["margin"], rel=1e-9, abs=1e-12), what
    assert verdict.too_close == row["too_close"], what
    parts = sorted(k.removeprefix(budget.PART_KL_PREFIX) for k in row if "/part/" in k)
    assert sorted(calls) == (parts if fitted.rule.needs_parts and len(parts) > 1 else []), what
  held_out = [
    {**r, "admitted": replay(r, fitted, base=BASES.get(directory, BASE))[0].admitted}
    for r in result["rows"]
    if r["role"] == "held_out"
  ]
  assert (
    stats.confusion(held_out, result["tolerance"], study_rules.LABEL_DROP) == result["confusion"]
  )


@pytest.mark.parametrize("directory", list(ROUNDS))
def test_every_recorded_rule_variant_is_reproduced(directory):
  result, fitted = load(directory)
  held_out = [r for r in result["rows"] if r["role"] == "held_out"]
  base = BASES.get(directory, BASE)
  pooled = [replay(r, fitted, budget.POOLED, base)[0].admitted for r in result["rows"]]
  assert pooled == [r["admitted_pooled"] for r in result["rows"]]
  replayable = [
    name
    for name, rule in RECORDED_VARIANTS.items()
    if name in result["rule_variants"] and (directory in WITH_PARTS or not rule.needs_parts)
  ]
  assert "pooled" in replayable and ("per_source" in replayable or "whole" in replayable)
  for name in replayable:
    judged = [
      {**r, "admitted": replay(r, fitted, RECORDED_VARIANTS[name], base)[0].admitted}
      for r in held_out
    ]
    scored = stats.confusion(judged, result["tolerance"], study_rules.LABEL_DROP)
    assert scored == result["rule_variants"][name], f"{directory}: {name}"


def test_a_part_that_was_not_measured_is_refused_by_the_rules_that_read_parts():
  result, fitted = load("docs/study/round7")
  row = next(r for r in result["rows"] if r["source"] == "noise+stale")
  candidate = candidates_lib.parse_candidate(row["spec"], BASE)
  whole = {budget.KL_KEY: row[budget.KL_KEY]}
  with pytest.raises(ValueError, match=r"per_part rule needs its noise part .* measured alone"):
    admission.candidate_verdict(candidate, BASE, whole, fitted, None)
  # The whole rule reads no part, so the same measurement is judged without one.
  admission.candidate_verdict(candidate, BASE, whole, fitted, None, budget.Rule("whole"))
