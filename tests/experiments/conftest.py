"""Hand-made `study.json` results in the schema `experiments.study` writes (round 9's recorded
study.json gives the key names), for the readings of two studies side by side."""

import copy
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUND9 = os.path.join(REPO, "docs", "study", "round9", "study.json")
STUDY_TOP = ("run_steps", "num_eval", "label", "tolerance", "noise_floor")
STUDY_ROW = ("name", "spec", "source", "role", "accuracy_runs", "teacher_kl_runs", "mismatch/kl")


@pytest.fixture(scope="session")
def recorded_study():
  """Round 9's recorded study.json."""
  with open(ROUND9) as f:
    return json.load(f)


@pytest.fixture(scope="session")
def study_keys():
  """The top-level and row keys `make_study` copies from the recorded study."""
  return STUDY_TOP, STUDY_ROW


@pytest.fixture(scope="session")
def make_study(recorded_study):
  """make(steps, tolerance, reference, settings): a study.json of `steps` whose reference runs
  have (KL, accuracy) pairs `reference` and whose settings are (spec, [(KL, accuracy) per
  run]) or (spec, [(KL, accuracy) per run], check KL); every key copied from a recorded one,
  each setting its own source named by its spec's key."""

  def make(steps, tolerance, reference, settings):
    result = {key: copy.deepcopy(recorded_study[key]) for key in STUDY_TOP}
    result.update(run_steps=steps, tolerance=tolerance, label="teacher_kl", num_eval=256)
    template = next(r for r in recorded_study["rows"] if r["role"] == "calibration")
    rows = []
    for i, (kl, acc) in enumerate(reference):
      rows.append({**template, "name": f"reference_seed{i}", "spec": "", "source": "reference"})
      rows[-1].update(role="reference", teacher_kl_runs=[kl], accuracy_runs=[acc])
      rows[-1]["mismatch/kl"] = 0.0
    for spec, runs, *check_kl in settings:
      rows.append({**template, "name": spec.replace("=", "-"), "spec": spec, "role": "calibration"})
      rows[-1].update(teacher_kl_runs=[k for k, _ in runs], accuracy_runs=[a for _, a in runs])
      if check_kl:
        rows[-1].update({"mismatch/kl": check_kl[0], "source": spec.split("=")[0]})
    result["rows"] = rows
    return result

  return make
