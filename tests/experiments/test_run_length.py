"""The run-length check (`experiments.run_length`): two hand-made studies in the schema
`experiments.study` writes (round 9's recorded study.json gives the key names), paired by
setting, every number checked by hand; and the command's --full-length."""

import json
import math

import pytest

from opd_jax import ladders as ladders_command
from opd_jax.experiments import run_length, stats


def _pair(make):
  # Short: reference KL 0.10, 0.12, 0.11 (mean 0.11), accuracy 0.8; τ_KL 0.02 (configured),
  # τ_acc = 2·sqrt(0.8·0.2/256) = 0.05. KL drops a 0, b 0.01, c 0.03, d 0.09; accuracy drops
  # 0, 0.02, 0.04, 0.10; e is in the short study only.
  short = make(
    600,
    0.02,
    [(0.10, 0.8), (0.12, 0.8), (0.11, 0.8)],
    [
      ("a=1", [(0.11, 0.80)] * 3),
      ("b=1", [(0.11, 0.78), (0.13, 0.78)]),
      ("c=1", [(0.14, 0.76)] * 3),
      ("d=1", [(0.20, 0.70)] * 3),
      ("e=1", [(0.30, 0.50)] * 3),
    ],
  )
  # Full: reference KL 0.05, 0.06, 0.07 (mean 0.06), accuracy 0.9; τ_KL 0.015,
  # τ_acc = 2·sqrt(0.9·0.1/256) = 0.0375. KL drops a 0, b 0.02, c 0.01, d 0.10; accuracy
  # drops 0, 0.02, 0.04, 0.10.
  full = make(
    1000,
    0.015,
    [(0.05, 0.9), (0.06, 0.9), (0.07, 0.9)],
    [
      ("a=1", [(0.06, 0.90)] * 3),
      ("b=1", [(0.08, 0.88)] * 3),
      ("c=1", [(0.07, 0.86)] * 3),
      ("d=1", [(0.16, 0.80)] * 3),
    ],
  )
  return short, full


def test_the_schema_is_the_recorded_one(recorded_study, study_keys):
  top, keys = study_keys
  row = next(r for r in recorded_study["rows"] if r["role"] == "calibration")
  assert set(keys) <= set(row) and set(top) <= set(recorded_study)


def test_length_check_by_hand(make_study):
  short, full = _pair(make_study)
  check = run_length.length_check(short, full, num_bootstrap=200)
  assert (check["short_steps"], check["full_steps"]) == (600, 1000)
  kl = check["labels"]["teacher_kl"]
  assert kl["n"] == 4 and [s["spec"] for s in kl["settings"]] == ["a=1", "b=1", "c=1", "d=1"]
  assert [s["drop_short"] for s in kl["settings"]] == pytest.approx([0, 0.01, 0.03, 0.09])
  assert [s["drop_full"] for s in kl["settings"]] == pytest.approx([0, 0.02, 0.01, 0.10])
  # ranks (1, 2, 3, 4) against (1, 3, 2, 4): Σd² = 2, ρ = 1 − 6·2/(4·15) = 0.8.
  assert kl["spearman"] == pytest.approx(0.8)
  # deviations from the means (0.0325 each): Σdxdy = 0.005275, Σdx² = 0.004875,
  # Σdy² = 0.006275.
  assert kl["pearson"] == pytest.approx(0.005275 / math.sqrt(0.004875 * 0.006275))
  assert kl["slope"] == pytest.approx(0.005275 / 0.004875)
  # degraded at 600 (τ 0.02): c, d; at 1000 (τ 0.015): b, d. Agree on a and d.
  assert (kl["tolerance_short"], kl["tolerance_full"]) == (0.02, 0.015)
  assert (kl["verdicts_agree"], kl["agreement"]) == (2, 0.5)
  assert kl["agreement_interval"] == pytest.approx(list(stats.wilson(2, 4)))
  for key in ("spearman_interval", "pearson_interval"):
    lo, hi = kl[key]
    assert -1 <= lo <= hi <= 1
  acc = check["labels"]["accuracy"]
  assert (acc["tolerance_short"], acc["tolerance_full"]) == pytest.approx(
    (2 * math.sqrt(0.8 * 0.2 / 256), 2 * math.sqrt(0.9 * 0.1 / 256))
  )
  # the same drops at both lengths: ρ = r = b = 1 in every resample; degraded at 600: d
  # (0.10 > 0.05); at 1000: c (0.04 > 0.0375) and d: agree on a, b, d.
  assert (acc["spearman"], acc["pearson"], acc["slope"]) == pytest.approx((1, 1, 1))
  assert acc["slope_interval"] == pytest.approx([1, 1])
  assert acc["verdicts_agree"] == 3
  again = run_length.length_check(short, full, num_bootstrap=200)
  assert again == check  # the bootstrap is seeded


def test_slope_and_bootstrap_edges():
  assert math.isnan(run_length.slope([1.0, 1.0], [0.0, 1.0]))
  assert run_length.slope([0.0, 1.0, 2.0], [1.0, 3.0, 5.0]) == pytest.approx(2.0)
  interval = run_length.bootstrap_interval(stats.spearman, [1.0, 1.0], [1.0, 2.0], 50, 0.95, 0)
  assert all(math.isnan(x) for x in interval)  # every resample's x is constant


def test_studies_that_share_no_setting_are_refused(make_study):
  short, full = _pair(make_study)
  full["rows"] = [r for r in full["rows"] if r["role"] == "reference"]
  with pytest.raises(ValueError, match="share no setting"):
    run_length.length_check(short, full)


def test_the_command_prints_the_run_length_check(tmp_path, capsys, make_study):
  short, full = _pair(make_study)
  a, b = tmp_path / "a.json", tmp_path / "b.json"
  a.write_text(json.dumps(short))
  b.write_text(json.dumps(full))
  out = tmp_path / "out.json"
  ladders_command.main([f"--study={a}", f"--full-length={b}", f"--json={out}"])
  text = capsys.readouterr().out
  assert "## Run length: 600 against 1000 steps" in text
  assert "| teacher_kl | 4 | 0.02 | 0.015 | 0.8 [" in text
  data = json.loads(out.read_text())
  assert data["run_length"]["labels"]["teacher_kl"]["verdicts_agree"] == 2
  # Provenance: this output's own (code and arguments), and each study's as it recorded it.
  assert set(data["provenance"]) == {"git_sha", "dirty", "diff_sha256", "config_sha256"}
  assert len(data["provenance"]["config_sha256"]) == 64
  assert data["studies_provenance"] == {"study": None, "full_length": None}  # none recorded
  short["provenance"] = {"git_sha": "a" * 40, "dirty": False}
  a.write_text(json.dumps(short))
  ladders_command.main([f"--study={a}", f"--full-length={b}", f"--json={out}"])
  assert json.loads(out.read_text())["studies_provenance"]["study"]["git_sha"] == "a" * 40
  bad = tmp_path / "bad.json"
  bad.write_text("{}")
  with pytest.raises(ValueError, match="--full-length=.*not a study.json"):
    ladders_command.main([f"--study={a}", f"--full-length={bad}"])
