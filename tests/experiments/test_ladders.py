"""Knees bracketed by their rungs, labels within the noise of τ and the plateau check
(`experiments.ladders`, `budget_fit.knee_bracket`), by hand and on round 9's recorded study."""

import json
import math
import os

import numpy as np
import pytest

from opd_jax import ladders as ladders_command
from opd_jax.experiments import ladders, study_report
from opd_jax.mismatch import budget_fit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUND9 = os.path.join(REPO, "docs", "study", "round9", "study.json")


def test_knee_bracket_by_hand():
  x, f = np.array([0.0, 0.1, 0.2, 0.3]), np.array([0.0, 0.01, 0.05, 0.2])
  assert budget_fit.knee_bracket(x, f, 0.03) == (0.1, 0.2)  # last kept 0.1, first over 0.2
  assert budget_fit.knee_bracket(x, f, 0.01) == (0.1, 0.2)  # f = τ keeps
  assert budget_fit.knee_bracket(x, f, -0.1) == (0.0, 0.0)  # below: (0, x_1]
  assert budget_fit.knee_bracket(x[1:], f[1:], 0.001) == (0.0, 0.1)
  assert budget_fit.knee_bracket(x, f, 0.5) == (0.3, math.inf)  # above: no rung degraded


def test_bracketed_interval_widens_only_to_a_finite_bracket():
  assert budget_fit.bracketed_interval((0.14, 0.16), (0.1, 0.2)) == (0.1, 0.2)
  assert budget_fit.bracketed_interval((0.05, 0.25), (0.1, 0.2)) == (0.05, 0.25)
  assert budget_fit.bracketed_interval((0.12, 0.3), (0.1, 0.2)) == (0.1, 0.3)
  assert budget_fit.bracketed_interval((0.2, 0.3), (0.3, math.inf)) == (0.2, 0.3)


def _recs(points):
  return [{"source": "s", "mismatch/kl": x, "quality_drop": y} for x, y in points]


def test_fit_interval_holds_the_gap_between_rungs():
  # Rungs at 0 and 0.1 keep (drop 0), 0.5 degrades (drop 1), four runs each; τ = 0.5. The
  # fit crosses at 0.1 + 0.5·0.4 = 0.3, and every resample crosses inside (0, 0.5], most at
  # 0.3 exactly: the bootstrap alone is far narrower than the gap (0.1, 0.5] the data leave.
  records = _recs([(0.0, 0.0)] * 4 + [(0.1, 0.0)] * 4 + [(0.5, 1.0)] * 4)
  b = budget_fit.fit_budget(records, 0.5)
  assert b.max_kl == pytest.approx(0.3) and b.censored == "none"
  assert b.interval[0] <= 0.1 and b.interval[1] == 0.5
  assert budget_fit.threshold_bracket(b.overall, 0.5) == (0.1, 0.5)
  assert b.sources["s"].interval[0] <= 0.1 and b.sources["s"].interval[1] == 0.5


def _row(name, source, kl, kls, accs, role="calibration"):
  return {
    "name": name,
    "source": source,
    "role": role,
    "mismatch/kl": kl,
    "teacher_kl_runs": list(kls),
    "accuracy_runs": list(accs),
  }


def _result():
  rows = [
    _row("reference_seed0", "reference", 0.0, [0.10], [0.80], "reference"),
    _row("reference_seed1", "reference", 0.0, [0.12], [0.84], "reference"),
    _row("reference_seed2", "reference", 0.0, [0.11], [0.82], "reference"),
    _row("a", "int4_weights", 0.01, [0.11, 0.11, 0.11], [0.82, 0.82, 0.82]),
    _row("b", "int4_weights", 0.05, [0.16, 0.16, 0.16], [0.70, 0.70, 0.70]),
  ]
  return {
    "rows": rows,
    "num_eval": 100,
    "label": "teacher_kl",
    "tolerance": 0.02,
    "min_crossing_records": 2,
  }


def test_label_tolerance_per_label_by_hand():
  result = _result()
  kl = ladders.label_tolerance(result, "teacher_kl")
  assert kl["mean"] == pytest.approx(-0.11) and kl["sd"] == pytest.approx(0.01)
  assert kl["tolerance"] == 0.02  # the study's own τ for its label
  acc = ladders.label_tolerance(result, "accuracy")
  # τ = 2·max(sd 0.02, sqrt(0.82·0.18/100) = 0.038419).
  assert acc["tolerance"] == pytest.approx(2 * math.sqrt(0.82 * 0.18 / 100))


def test_label_band_by_hand():
  result = _result()
  result["rows"] = result["rows"][:3] + [
    _row("a", "int4_weights", 0.01, [0.13, 0.13, 0.14], [0.8] * 3),
    _row("b", "int4_weights", 0.05, [0.30], [0.5]),
    _row("c", "int4_weights", 0.02, [0.11, 0.11], [0.8] * 2),
  ]
  band = ladders.label_band(result, "teacher_kl")
  a, b, c = band["settings"]
  # a: d = 0.13333 − 0.11, s = sd(.13, .13, .14) = 0.0057735, SE = sqrt(s²/3 + 0.01²/3).
  assert a["drop"] == pytest.approx(0.4 / 3 - 0.11)
  assert a["se"] == pytest.approx(math.sqrt((0.01 / math.sqrt(3)) ** 2 / 3 + 0.01**2 / 3))
  assert a["within"]  # |0.02333 − 0.02| = 0.00333 ≤ 2·0.00667
  # b: one run, s = s_ref: SE = sqrt(0.01² + 0.01²/3) = 0.011547; |0.19 − 0.02| > 0.0231.
  assert b["se"] == pytest.approx(math.sqrt(0.01**2 + 0.01**2 / 3)) and not b["within"]
  # c: d = 0, s = 0: SE = 0.01/sqrt(3); |0 − 0.02| > 0.011547.
  assert c["drop"] == pytest.approx(0.0, abs=1e-12) and not c["within"]
  assert (band["within"], band["n"]) == (1, 3) and band["share"] == pytest.approx(1 / 3)
  # One reference seed has no sample sd: its SE is one run's binomial SE, not 0.
  result["rows"] = result["rows"][:1] + result["rows"][4:5]
  (b,) = ladders.label_band(result, "accuracy")["settings"]
  assert b["se"] == pytest.approx(math.sqrt(2 * 0.8 * 0.2 / 100))


def test_ladder_table_by_hand():
  table = ladders.ladder_table(_result(), "teacher_kl")
  s = table["sources"]["int4_weights"]
  # Records: reference drops (−0.01, 0.01, 0) at 0, a's 0 at 0.01, b's 0.05 at 0.05; the
  # fit (0, 0, 0.05) crosses τ = 0.02 at 0.01 + 0.4·0.04 = 0.026, between a and b.
  assert s["knee"] == pytest.approx(0.026) and s["censored"] == "none"
  assert s["bracket"] == [0.01, 0.05]
  assert s["interval"][0] <= 0.01 and s["interval"][1] >= 0.05
  assert [(r["name"], r["kept"]) for r in s["rungs"]] == [("a", True), ("b", False)]
  assert s["rungs"][1]["drop"] == pytest.approx(0.05)
  # Under accuracy (τ = 0.0768): b's drop 0.12 degrades too.
  acc = ladders.ladder_table(_result(), "accuracy")["sources"]["int4_weights"]
  assert acc["bracket"] == [0.01, 0.05]


def test_plateau_by_hand():
  p = ladders.plateau(_result(), 0.965, 0.85)
  assert p["reference_accuracy"] == pytest.approx(0.82)
  assert p["share"] == pytest.approx(0.82 / 0.965) and not p["near_plateau"]  # 84.97 %
  assert ladders.plateau(_result(), None, 0.85) is None


def test_round9_noise_knee_is_reported_with_its_bracket():
  with open(ROUND9) as f:
    result = json.load(f)
  report = ladders.ladder_report(result, 0.965)
  noise = report["labels"]["teacher_kl"]["table"]["sources"]["noise"]
  recorded = result["budget"]["sources"]["noise"]
  # The same records and seed as round 9's budget: the same knee, 0.054, whose bootstrap
  # interval [0.048, 0.069] was narrower than the rungs σ 0.2 (0.0291) and σ 0.3 (0.0920).
  assert noise["knee"] == pytest.approx(recorded["max_kl"])
  assert recorded["interval"][0] > noise["bracket"][0]
  assert noise["bracket"] == pytest.approx([0.029149, 0.092025], abs=1e-6)
  assert noise["interval"] == pytest.approx(noise["bracket"])
  assert ladders.bracket_text(noise["bracket"]) == "bracketed by (0.0291, 0.092]"
  assert not report["plateau"]["near_plateau"]  # 200 steps: about 61 % of the full run
  text = "\n".join(ladders.markdown_lines(report))
  assert "bracketed by (0.0291, 0.092]" in text and "of the full run's 96.5 %" in text
  result["ladders"] = report  # as run_study records it
  assert "## Ladders" in study_report.markdown(result)


def test_a_run_without_a_label_leaves_it_out():
  result = _result()
  result["rows"][4]["accuracy_runs"] = [math.nan] * 3
  assert ladders.label_runs(result["rows"][4], "accuracy") is None
  assert ladders.label_runs(result["rows"][4], "teacher_kl") == [-0.16] * 3
  with pytest.raises(ValueError, match="not one of"):
    ladders.label_runs(result["rows"][4], "reward")
  # b has no accuracy: under accuracy the source's ladder is a's rung alone, never crossing
  acc = ladders.ladder_table(result, "accuracy")["sources"]["int4_weights"]
  assert [r["name"] for r in acc["rungs"]] == ["a"] and acc["censored"] == "above"


def test_study_budget_summary_names_each_sources_bracket():
  records = _recs([(0.0, 0.0)] * 4 + [(0.1, 0.0)] * 4 + [(0.5, 1.0)] * 4)
  summary = study_report.budget_summary(budget_fit.fit_budget(records, 0.5), "budget.json")
  assert summary["sources"]["s"]["bracket"] == [0.1, 0.5]


def test_the_command_writes_the_ladders_of_a_study(tmp_path, capsys):
  md, out = tmp_path / "ladders.md", tmp_path / "ladders.json"
  ladders_command.main(
    [f"--study={ROUND9}", "--full-run-accuracy=0.965", f"--md={md}", f"--json={out}"]
  )
  assert "bracketed by (0.0291, 0.092]" in capsys.readouterr().out
  assert "## Ladders" in md.read_text()
  data = json.loads(out.read_text())
  assert data["plateau"]["share"] == pytest.approx(data["plateau"]["reference_accuracy"] / 0.965)
  bad = tmp_path / "bad.json"
  bad.write_text("[]")
  with pytest.raises(ValueError, match="not a study.json"):
    ladders_command.main([f"--study={bad}"])
