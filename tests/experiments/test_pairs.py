"""`experiments.pairs`: calibrations side by side, refitted under both labels and axes, and one
pair's limit scored on another's settings, on hand-made calibration directories."""

import json
import os

import pytest

from opd_jax.experiments import pairs, study_report


def _row(name, role, source, kl, accuracy_runs, teacher_kl_runs):
  return {
    "name": name,
    "role": role,
    "source": source,
    "mismatch/kl": kl,
    "accuracy_runs": accuracy_runs,
    "teacher_kl_runs": teacher_kl_runs,
  }


def _write(directory, scale, start_kl):
  """A calibration whose noise settings sit at `scale` × (0.01, 0.1, 1.0) nats/token: the
  first two keep quality, the third loses 30 points and doubles the KL to the teacher."""
  rows = [
    _row("reference_seed0", "reference", "reference", 0.0, [0.80], [0.100]),
    _row("reference_seed1", "reference", "reference", 0.0, [0.82], [0.102]),
    _row("n1", "calibration", "noise", 0.01 * scale, [0.81, 0.80], [0.101, 0.100]),
    _row("n2", "calibration", "noise", 0.1 * scale, [0.80, 0.79], [0.102, 0.103]),
    _row("n3", "calibration", "noise", 1.0 * scale, [0.50, 0.52], [0.200, 0.210]),
  ]
  result = {
    "rows": rows,
    "num_eval": 512,
    "teacher_accuracy": 0.95,
    "student_accuracy_before": 0.44,
    "run_steps": 200,
    "num_runs": 8,
  }
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "study.json"), "w") as f:
    json.dump(result, f)
  for seed in (0, 1):
    run = os.path.join(directory, "runs", f"reference_seed{seed}")
    os.makedirs(run)
    with open(os.path.join(run, "result.json"), "w") as f:
      json.dump({"student_teacher_kl_before": start_kl}, f)
  return pairs.load(directory)


def test_labels_and_axes_by_hand(tmp_path):
  a = _write(tmp_path / "a", 1.0, 0.5)
  assert a["start_kl"] == 0.5
  records, floor = pairs.label_records(a, "teacher_kl", "relative")
  assert floor["mean"] == pytest.approx(-0.101)
  assert [r["mismatch/kl"] for r in records][-2:] == [2.0, 2.0]  # 1.0 / 0.5
  kept = {r["name"]: r["kept"] for r in pairs.settings(a, "accuracy")}
  assert kept == {"n1": True, "n2": True, "n3": False}
  # the knee lies between 0.1 and 1.0 under either label, and scales with the axis
  for label in pairs.LABELS:
    assert 0.1 <= pairs.fit(a, label).max_kl < 1.0
    assert pairs.fit(a, label, "relative").max_kl == pytest.approx(2 * pairs.fit(a, label).max_kl)


def test_transfer_counts_the_target_settings_each_limit_gets_right(tmp_path):
  # B's settings sit at ten times A's KLs, and B starts ten times further from its teacher:
  # A's absolute limit refuses B's kept n2, A's relative limit gets every B setting right.
  results = {"a": _write(tmp_path / "a", 1.0, 0.5), "b": _write(tmp_path / "b", 10.0, 5.0)}
  moves = {
    (m["from"], m["to"], m["axis"]): m for m in pairs.transfer(results, "accuracy", "absolute")
  }
  moves.update(
    {(m["from"], m["to"], m["axis"]): m for m in pairs.transfer(results, "accuracy", "relative")}
  )
  absolute = moves[("a", "b", "absolute")]
  assert absolute["agreement"] == {"right": 2, "n": 3, "rate": pytest.approx(2 / 3)}
  assert absolute["own_agreement"]["right"] == 3 and absolute["admit_all"]["right"] == 2
  assert moves[("a", "b", "relative")]["agreement"]["right"] == 3
  text = study_report.pairs_markdown(
    [pairs.pair_summary(n, r) for n, r in results.items()], list(moves.values())
  )
  assert "| a → b | accuracy | absolute |" in text and "2/3" in text
  # each source's knee is reported with the rungs that bracket it: n2 (0.1) kept, n3 (1.0) not
  noise = pairs.pair_summary("a", results["a"])["labels"]["accuracy"]["sources"]["noise"]
  assert noise["bracket"] == [0.1, 1.0]
  assert noise["interval"][0] <= 0.1 and noise["interval"][1] >= 1.0
  assert "noise " in text and "bracketed by (0.1, 1]" in text
