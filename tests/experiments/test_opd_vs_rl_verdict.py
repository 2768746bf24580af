"""The OPD-against-RL verdict (`experiments.opd_vs_rl_verdict`) on hand-built report cells, each
built so that exactly the criterion under test holds, and the command on a written report."""

import json
import math

import pytest
from conftest import run_module

from opd_jax.experiments import opd_vs_rl_verdict as verdict
from opd_jax.experiments import stats

NAN = math.nan


def cell(setting, method, drop=0.0, ci=(NAN, NAN), seeds=2, spikes=0, steps=160):
  """A report cell with the same drop and interval at T = 1 and greedy."""
  return {
    "setting": setting,
    "method": method,
    "seeds": list(range(seeds)),
    "drop_points": drop,
    "drop_ci_points": list(ci),
    "drop_t1_points": drop,
    "drop_t1_ci_points": list(ci),
    "grad_norm_spikes": spikes,
    "grad_norm_logged_steps": steps,
  }


def report(*cells, matched=(), ladder=()):
  base = [cell("reference", m) for m in ("opd", "grpo", "grpo_tis")]
  return {"cells": base + list(cells), "matched": list(matched), "matched_settings": list(ladder)}


def reading(result, setting, accuracy="T = 1"):
  (r,) = [r for r in result["readings"] if r["setting"] == setting and r["accuracy"] == accuracy]
  return r


def test_fisher_greater_against_hand_computed_values():
  # [[3, 0], [0, 3]]: P(X ≥ 3) of the hypergeometric with margins 3, 3 of 6 = 1 / C(6, 3).
  assert stats.fisher_greater(3, 3, 0, 3) == pytest.approx(1 / 20)
  # [[1, 1], [1, 1]]: P(X ≥ 1) = 1 − P(X = 0) = 1 − C(2,0)C(2,2)/C(4,2) = 5/6.
  assert stats.fisher_greater(1, 2, 1, 2) == pytest.approx(5 / 6)
  assert stats.fisher_greater(0, 0, 1, 2) == 1.0


def test_grpo_interval_above_zero_and_opd_holding_zero_supports():
  r = reading(
    verdict.verdicts(
      report(cell("s", "opd", 1.0, (-2.0, 4.0)), cell("s", "grpo", 9.0, (3.0, 15.0)))
    ),
    "s",
  )
  assert r["verdict"] == "supported" and r["against"] == []
  assert r["for"] == ["GRPO's drop interval lies above 0, OPD's holds 0"]


def test_the_mirror_contradicts_and_both_at_once_are_mixed():
  r = reading(
    verdict.verdicts(
      report(cell("s", "opd", 9.0, (3.0, 15.0)), cell("s", "grpo", 1.0, (-2.0, 4.0)))
    ),
    "s",
  )
  assert r["verdict"] == "contradicted" and r["for"] == []
  # GRPO's interval above 0 with OPD's holding 0 (for), and OPD spiking alone (against).
  mixed = report(cell("s", "opd", 1.0, (-2.0, 4.0), spikes=20), cell("s", "grpo", 9.0, (3.0, 15.0)))
  assert reading(verdict.verdicts(mixed), "s")["verdict"] == "mixed"


def test_one_seed_has_no_interval_so_nothing_is_shown():
  r = reading(
    verdict.verdicts(report(cell("s", "opd", 0.0, (-2.0, 2.0)), cell("s", "grpo", 40.0, seeds=1))),
    "s",
  )
  assert r["verdict"] == "not shown" and r["for"] == r["against"] == []


def test_spikes_count_only_when_the_rate_beats_the_reference_by_fishers_test():
  one_more = report(cell("s", "opd", spikes=0), cell("s", "grpo", spikes=1))  # references 0/160
  assert reading(verdict.verdicts(one_more), "s")["verdict"] == "not shown"
  many = report(cell("s", "opd", spikes=0), cell("s", "grpo", spikes=12))
  r = reading(verdict.verdicts(many), "s")
  assert r["for"] == ["GRPO spikes, OPD does not"] and r["verdict"] == "supported"


def test_equal_mismatch_is_read_on_the_noise_ladder_only():
  # GRPO drops 6 points more than OPD at κ 0.2, OPD's half width is 3: the criterion holds on
  # the ladder's setting and is not read for a setting off it.
  matched = [
    {"method": "opd", "kl": 0.1, "drop_points": 2.0, "drop_t1_points": 2.0},
    {"method": "grpo", "kl": 0.1, "drop_points": 3.0, "drop_t1_points": 3.0},
    {"method": "opd", "kl": 0.2, "drop_points": 4.0, "drop_t1_points": 4.0},
    {"method": "grpo", "kl": 0.2, "drop_points": 10.0, "drop_t1_points": 10.0},
    {"method": "opd", "kl": 0.4, "drop_points": NAN, "drop_t1_points": NAN},
    {"method": "grpo", "kl": 0.4, "drop_points": 30.0, "drop_t1_points": 30.0},
  ]
  both = lambda s: (cell(s, "opd", 5.0, (2.0, 8.0)), cell(s, "grpo", 12.0, (6.0, 18.0)))  # noqa: E731
  result = verdict.verdicts(
    report(*both("noise"), *both("stale"), matched=matched, ladder=("noise",))
  )
  on = reading(result, "noise")
  assert on["for"] == ["at equal mismatch/kl 0.2 GRPO drops more by over OPD's half width"]
  assert on["verdict"] == "supported" and on["on_noise_ladder"]
  assert reading(result, "stale")["verdict"] == "not shown"


def test_tis_against_grpo():
  result = verdict.verdicts(
    report(
      cell("s", "opd"),
      cell("s", "grpo", 10.0, (4.0, 16.0)),
      cell("s", "grpo_tis", 1.0, (-3.0, 5.0)),
    )
  )
  (c,) = [c for c in result["corrections"] if c["accuracy"] == "T = 1"]
  assert c["verdict"] == "recovers" and c["tis_minus_grpo"] == pytest.approx(-9.0)


def test_a_report_without_both_arms_is_refused():
  with pytest.raises(ValueError, match="no setting with both an 'opd' and a 'grpo' cell"):
    verdict.verdicts(report(cell("s", "opd")))


def test_a_file_that_is_not_a_report_is_refused_by_name(tmp_path):
  with pytest.raises(ValueError, match="not an OPD-against-RL report: no 'cells' list"):
    verdict.verdicts({"rows": []})
  path = tmp_path / "budget.json"
  path.write_text(json.dumps({"sources": {}}))
  proc = run_module("opd_jax.opd_vs_rl_verdict", f"--report={path}")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert "error: not an OPD-against-RL report: no 'cells' list" in proc.stderr


def test_the_command_reads_a_written_report(tmp_path):
  path = tmp_path / "opd_vs_rl.json"
  body = report(cell("s", "opd", 1.0, (-2.0, 4.0)), cell("s", "grpo", 9.0, (3.0, 15.0)))
  path.write_text(json.dumps(body))
  out = tmp_path / "verdict.json"
  proc = run_module("opd_jax.opd_vs_rl_verdict", f"--report={path}", f"--json={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "| s | +1.0 [-2.0, +4.0] | +9.0 [+3.0, +15.0] | 2, 2 |" in proc.stdout
  written = json.loads(out.read_text())
  assert {r["verdict"] for r in written["readings"]} == {"supported"}
  assert set(written["provenance"]) >= {"git_sha", "dirty"}
