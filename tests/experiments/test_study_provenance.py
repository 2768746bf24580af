"""`experiments.study_provenance`: which code made each part of a study (its probe, its
measurements, its runs, as written in a workdir) and the refusal of a mixed one."""

import json

import ml_collections
import pytest

from opd_jax.experiments import study_provenance
from opd_jax.io import json_file, provenance

A = {**provenance.code_state(), "config_sha256": "x"}  # the code running these tests
KEY = provenance.code_key(A)
B = {"git_sha": "b" * 40, "dirty": True, "diff_sha256": "d" * 12, "config_sha256": "x"}


def _workdir(tmp_path, probe, measured, runs):
  """A study workdir holding a probe, measurements and finished runs with these entries."""
  probe_dir = tmp_path / "runs" / "probe"
  probe_dir.mkdir(parents=True)
  if probe is not None:
    study_provenance.write_probe(str(probe_dir), probe)
  json_file.write_json(
    str(tmp_path / "measurements.json"),
    {
      "fingerprint": {},
      "measurements": {spec: {"mismatch/kl": 0.1} for spec in measured},
      "provenance": {spec: e for spec, e in measured.items() if e is not None},
    },
  )
  for name, entry in runs.items():
    result = {"end_step": 1} | ({} if entry is None else {"provenance": entry})
    json_file.write_json(str(tmp_path / "runs" / name / "result.json"), result)
  return str(tmp_path / "measurements.json"), str(probe_dir)


def _config(allow=False):
  return ml_collections.ConfigDict({"allow_mixed_code": allow, "seeds": (0,)})


def test_parts_of_one_version_pass_and_are_summarised(tmp_path):
  meas, probe = _workdir(tmp_path, A, {"rollout.stale_k=1": A}, {"ref": A})
  dirs = study_provenance.run_dirs(str(tmp_path), ["ref", "missing"], [1])
  assert set(dirs) == {"ref", "ref_seed1", "missing", "missing_seed1"}
  out = study_provenance.study_code(_config(), meas, probe, dirs)
  assert provenance.code_key(out["provenance"]) == KEY
  assert out["provenance"]["config_sha256"] == provenance.config_sha256(_config())
  assert out["code"] == {
    "mixed": False,
    "allow_mixed_code": False,
    "versions": [
      {
        "code": KEY,
        "description": provenance.describe(KEY),
        "parts": ["probe", "measurement rollout.stale_k=1", "run ref", "this sitting"],
      }
    ],
  }


def test_a_mixed_study_is_refused_naming_each_version_unless_allowed(tmp_path):
  # a measurement made by another (dirty) commit, and an old run without provenance
  meas, probe = _workdir(tmp_path, A, {"rollout.stale_k=1": B}, {"ref": A, "old": None})
  dirs = study_provenance.run_dirs(str(tmp_path), ["ref", "old"], [])
  with pytest.raises(ValueError, match="made by 3 versions of the code") as e:
    study_provenance.study_code(_config(), meas, probe, dirs)
  text = str(e.value)
  assert f"commit {'b' * 12} with uncommitted changes (diff {'d' * 12}): 1 part(s)" in text
  assert "unrecorded code (written before provenance was recorded): 1 part(s): run old" in text
  assert "--config.allow_mixed_code=true" in text
  logged = []
  out = study_provenance.study_code(_config(allow=True), meas, probe, dirs, logged.append)
  assert out["code"]["mixed"] and out["code"]["allow_mixed_code"]
  assert [v["code"] for v in out["code"]["versions"]] == [
    KEY,
    f"{'b' * 40}+{'d' * 12}",
    provenance.UNRECORDED,
  ]
  assert logged and logged[0].startswith("warning: this study's parts were made by 3 versions")
  json.dumps(out)  # what study.json holds


def test_the_code_running_now_counts_against_what_the_workdir_holds(tmp_path):
  meas, probe = _workdir(tmp_path, B, {}, {})  # a probe of other code, nothing else
  with pytest.raises(ValueError, match="made by 2 versions"):
    study_provenance.study_code(_config(), meas, probe, {})


def _result(teacher, warm, start_step=0, digests=None):
  out = {"teacher_accuracy": teacher, "student_accuracy_before": warm, "start_step": start_step}
  return out | ({"start_digests": digests} if digests else {})


def test_runs_of_one_start_pass_and_a_resumed_one_is_held_to_its_teacher_only():
  same = {"teacher": "t1", "student": "s1"}
  study_provenance.check_same_start(
    {
      "run a": _result(0.95, 0.55, digests=same),
      "run b": _result(0.95, 0.55, digests=same),
      "run c": _result(0.95, 0.60, start_step=200),  # "before" is its resumption's
      "run d": _result(0.95, 0.55),  # predates the digests
      "run e": None,  # not finished
    }
  )


def test_runs_from_two_teachers_or_warm_starts_are_refused_naming_each_start():
  # The case that motivated the check: 6 of one comparison's runs trained under a teacher
  # bootstrapped on another machine (100 % held-out, warm start 55.9 %) than the rest's.
  with pytest.raises(
    ValueError,
    match=r"(?s)teacher 1.0, warm start 0.559: 1 run\(s\): run a.*"
    r"teacher 0.953, warm start 0.551: 2 run\(s\): run b, run c",
  ):
    study_provenance.check_same_start(
      {"run a": _result(1.0, 0.559), "run b": _result(0.953, 0.551), "run c": _result(0.953, 0.551)}
    )
  with pytest.raises(ValueError, match=r"different teachers or warm starts"):
    study_provenance.check_same_start({"run a": _result(0.95, 0.55), "run b": _result(0.95, 0.56)})
  with pytest.raises(ValueError, match=r"teacher 1.0 \(resumed\)"):
    study_provenance.check_same_start(
      {"run a": _result(0.95, 0.55), "run b": _result(1.0, 0.55, start_step=9)}
    )
  # Equal accuracies, different bits: the digests tell them apart.
  with pytest.raises(ValueError, match=r"teacher t1, student s2: 1 run\(s\): run b"):
    study_provenance.check_same_start(
      {
        "run a": _result(0.95, 0.55, digests={"teacher": "t1", "student": "s1"}),
        "run b": _result(0.95, 0.55, digests={"teacher": "t1", "student": "s2"}),
      }
    )


def test_a_study_whose_runs_started_from_two_teachers_is_refused(tmp_path):
  meas, probe = _workdir(tmp_path, A, {}, {"ref": A, "other": A})
  for name, teacher in (("ref", 0.953), ("other", 1.0)):
    path = tmp_path / "runs" / name / "result.json"
    result = json.loads(path.read_text()) | _result(teacher, 0.55)
    json_file.write_json(str(path), result)
  dirs = study_provenance.run_dirs(str(tmp_path), ["ref", "other"], [])
  with pytest.raises(ValueError, match=r"teacher 1.0, warm start 0.55: 1 run\(s\): run other"):
    study_provenance.study_code(_config(), meas, probe, dirs)
