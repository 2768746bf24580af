"""Model dependence (`experiments.pair_dependence`): the same ladder on two hand-made pairs, in
the schema `experiments.study` writes, every number checked by hand; and the command's
--second-pair."""

import json
import math

import pytest

from opd_jax import ladders as ladders_command
from opd_jax.experiments import pair_dependence, stats


def _pairs(make):
  # A: reference KL 0.10, 0.12, 0.11 (mean 0.11, sd 0.01), τ_KL 0.02 (configured). Drops
  # a 0, b 0.03 (1.5 τ), c 0.09 (4.5 τ) at check KLs 0.01, 0.02, 0.04.
  a = make(
    600,
    0.02,
    [(0.10, 0.8), (0.12, 0.8), (0.11, 0.8)],
    [
      ("s=1", [(0.11, 0.80)] * 3, 0.01),
      ("s=2", [(0.14, 0.78)] * 3, 0.02),
      ("s=3", [(0.20, 0.70)] * 3, 0.04),
      ("only_a=1", [(0.30, 0.50)] * 3, 0.5),
    ],
  )
  # B: reference KL 0.05, 0.06, 0.07 (mean 0.06), τ_KL 0.015. Drops a 0, b 0.01 (2/3 τ),
  # c 0.10 (20/3 τ) at check KLs twice A's.
  b = make(
    600,
    0.015,
    [(0.05, 0.9), (0.06, 0.9), (0.07, 0.9)],
    [
      ("s=1", [(0.06, 0.90)] * 3, 0.02),
      ("s=2", [(0.07, 0.88)] * 3, 0.04),
      ("s=3", [(0.16, 0.80)] * 3, 0.08),
    ],
  )
  return a, b


def test_two_pairs_by_hand(make_study):
  a, b = _pairs(make_study)
  out = pair_dependence.compare(a, b, ("embedded", "deep"), num_bootstrap=200)
  assert out["names"] == ["embedded", "deep"]
  kl = out["labels"]["teacher_kl"]
  assert kl["n"] == 3 and [s["spec"] for s in kl["settings"]] == ["s=1", "s=2", "s=3"]
  assert (kl["tolerance_a"], kl["tolerance_b"]) == (0.02, 0.015)
  assert [s["kl_ratio"] for s in kl["settings"]] == pytest.approx([2, 2, 2])
  # every ratio is 2, so its geometric mean is 2 in every resample
  assert kl["kl_ratio_geomean"] == pytest.approx(2)
  assert kl["kl_ratio_geomean_interval"] == pytest.approx([2, 2])
  assert kl["kl_spearman"] == pytest.approx(1)
  assert [s["drop_a"] for s in kl["settings"]] == pytest.approx([0, 0.03, 0.09])
  assert [s["drop_over_tau_b"] for s in kl["settings"]] == pytest.approx([0, 2 / 3, 20 / 3])
  assert kl["drop_spearman"] == pytest.approx(1)
  # degraded: A b, c; B c only. Agree on a and c.
  assert (kl["degraded_a"], kl["degraded_b"], kl["verdicts_agree"]) == (2, 1, 2)
  assert kl["agreement_interval"] == pytest.approx(list(stats.wilson(2, 3)))
  # Welch: the setting's runs are equal, the reference's sd is 0.01 over 3 runs, so
  # SE = 0.01/√3 with ν = 2 degrees of freedom, t(0.975, 2) = 4.3027.
  half = 4.302653 * 0.01 / math.sqrt(3)
  assert kl["settings"][2]["drop_a_interval"] == pytest.approx([0.09 - half, 0.09 + half])
  knees = kl["knees"]
  assert set(knees) == {"s", "only_a"} and knees["only_a"]["b"] is None
  assert knees["s"]["a"]["knee"] < knees["s"]["b"]["knee"]  # B crosses τ at a larger KL
  assert pair_dependence.compare(a, b, ("embedded", "deep"), num_bootstrap=200) == out
  assert "accuracy" in out["labels"]


def test_ratio_edges_and_refusals(make_study):
  assert pair_dependence.log_ratio_mean([0.0, 1.0], [1.0, 4.0]) == pytest.approx(4)
  assert math.isnan(pair_dependence.log_ratio_mean([0.0], [1.0]))
  a, b = _pairs(make_study)
  with pytest.raises(ValueError, match="two pair names"):
    pair_dependence.compare(a, b, ("one",))
  b["rows"] = [r for r in b["rows"] if r["role"] == "reference"]
  with pytest.raises(ValueError, match="share no setting"):
    pair_dependence.compare(a, b)


def test_the_command_prints_both_pairs(tmp_path, capsys, make_study):
  a, b = _pairs(make_study)
  pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
  pa.write_text(json.dumps(a))
  pb.write_text(json.dumps(b))
  ladders_command.main(
    [f"--study={pa}", f"--second-pair={pb}", "--pair-names=embedded,deep", f"--json={out}"]
  )
  text = capsys.readouterr().out
  assert "## Model dependence: embedded against deep" in text
  assert "| teacher_kl | 3 | 0.02 | 0.015 | 1 [" in text
  data = json.loads(out.read_text())
  assert data["pair_dependence"]["labels"]["teacher_kl"]["verdicts_agree"] == 2
  assert data["studies_provenance"] == {"study": None, "second_pair": None}
  bad = tmp_path / "bad.json"
  bad.write_text("[]")
  with pytest.raises(ValueError, match="--second-pair=.*not a study.json"):
    ladders_command.main([f"--study={pa}", f"--second-pair={bad}"])
