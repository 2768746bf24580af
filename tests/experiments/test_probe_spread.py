"""How much of a verdict is the probe (`experiments.probe_spread`): the summary and the rule's
call by hand, the study's own probe reused, and the tiny study's probes end to end."""

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from opd_jax.experiments import probe_spread, study_probe, study_setting
from opd_jax.mismatch import budget_fit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import ladders  # noqa: E402

INT4 = "rollout.weights=int4,rollout.weight_per_tensor=true"


def test_summary_by_hand():
  out = probe_spread.summarize({"0": 0.02, "1": 0.03, "2": 0.04})
  assert out["mean"] == pytest.approx(0.03)
  assert out["sd"] == pytest.approx(0.01)  # sample sd of 0.02, 0.03, 0.04
  assert out["spread"] == pytest.approx(0.02)
  assert out["relative_spread"] == pytest.approx(2 / 3)
  assert math.isnan(probe_spread.summarize({"0": 0.5})["sd"])
  with pytest.raises(ValueError, match="no readings"):
    probe_spread.summarize({})


def test_seed_config_puts_the_seed_first_and_pins_the_teacher_cache():
  config = ladders.get_config("tiny")
  out = probe_spread.seed_config(config, 1, "/c")
  assert tuple(out.seeds) == (1, 0) and tuple(config.seeds) == (0, 1)  # input unchanged
  assert out.run.teacher.cache_dir == "/c"
  settings = probe_spread.probe_settings(out, [INT4])
  assert [s.role for s in settings] == [study_setting.REFERENCE, "probe"]
  assert {s.seed for s in settings} == {1}  # the probe trains with seed 1
  assert settings[1].source == "int4_weights"


def test_the_study_s_own_probe_and_measurements_are_reused(tmp_path):
  (tmp_path / "runs" / study_probe.PROBE).mkdir(parents=True)
  (tmp_path / study_probe.MEASUREMENTS_FILE).write_text('{"measurements": {}}')
  directory, own = probe_spread.seed_workdir(str(tmp_path), 0, 0)
  assert own == str(tmp_path / "runs" / study_probe.PROBE)
  assert os.path.exists(os.path.join(directory, study_probe.MEASUREMENTS_FILE))
  directory, own = probe_spread.seed_workdir(str(tmp_path), 0, 1)  # another seed: its own
  assert own is None and directory.endswith("seed1")


def test_repeated_seeds_or_no_candidates_are_refused(tmp_path):
  config = ladders.get_config("tiny")
  with pytest.raises(ValueError, match="repeat a seed"):
    probe_spread.probe_spread(config, str(tmp_path), [0, 0], [INT4])
  with pytest.raises(ValueError, match="at least one probe seed and one candidate"):
    probe_spread.probe_spread(config, str(tmp_path), [0], [])


def test_the_call_at_each_reading_follows_the_budget():
  """A budget whose int4_weights records cross τ between 1e-3 and 2e-3: a reading of 5e-4
  is admitted, one of 3e-3 lies beyond the calibrated range and is refused as such."""
  records = [
    {"source": "int4_weights", "mismatch/kl": x, "quality_drop": y}
    for x, y in [(0.0, 0.0), (5e-4, 0.0), (1e-3, 0.04), (2e-3, 0.2)]
  ]
  fitted = budget_fit.fit_budget(records, 0.1, num_bootstrap=20)
  config = ladders.get_config("tiny")
  low = probe_spread.judge(config, INT4, {"mismatch/kl": 5e-4}, fitted, "refuse")
  high = probe_spread.judge(config, INT4, {"mismatch/kl": 3e-3}, fitted, "refuse")
  assert low["admitted"] and low["call"].startswith("admitted")
  assert not high["admitted"] and high["call"] == "refused (beyond calibrated range)"


@pytest.mark.slow
def test_tiny_probes_end_to_end_and_reused(tmp_path):
  """Two probe seeds of the tiny ladders: each trains its own probe, the readings differ
  between the probes (different students), and a second call measures nothing again."""
  config = ladders.get_config("tiny")
  lines = []
  first = probe_spread.probe_spread(config, str(tmp_path), [0, 1], [INT4], log=lines.append)
  (row,) = first["rows"]
  readings = np.array(list(row["kl_by_seed"].values()))
  assert sorted(row["kl_by_seed"]) == ["0", "1"]
  assert np.all(np.isfinite(readings)) and np.all(readings > 0)
  assert readings[0] != readings[1]  # two students, two readings
  for seed in (0, 1):
    assert (tmp_path / "probe_seeds" / f"seed{seed}" / "runs" / study_probe.PROBE).is_dir()
  again = []
  second = probe_spread.probe_spread(config, str(tmp_path), [0, 1], [INT4], log=again.append)
  assert json.dumps(second) == json.dumps(first)
  assert not any(line.startswith(("probe:", "measured")) for line in again)
  table = "\n".join(probe_spread.markdown_lines(first))
  assert f"`{INT4}`" in table and "KL seed 1" in table
