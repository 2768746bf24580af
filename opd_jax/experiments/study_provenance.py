"""Which code made a study: the provenance of its probe, its measurements and its runs
(`io.provenance`), and the refusal of a study whose parts were made by different code.

A study runs over several sittings and reuses what finished (`experiments.study`), so its runs
may come from different commits, or from one commit with different uncommitted edits. Every
part records its `provenance` entry: each run's `result.json` (the trainer's final record), the
probe's `PROBE_FILE`, and each measurement in `measurements.json` ("provenance": spec -> entry).
`code_versions` groups the parts by `provenance.code_key`; a study whose parts come from more
than one version, or from another version than the code running now, is refused
(`check_code`) unless `config.allow_mixed_code`, and `study.json` reports the versions either
way (`code_summary`).

The same code can still give a study's runs different starting points: a built-in teacher and
warm start are rebuilt from their settings on each machine, and the bits (even the teacher's
number of bootstrap steps) can differ across machines. `check_same_start` refuses to pool runs
whose recorded teachers or warm starts differ (`io.run_history.start_digests`, and for runs that
predate the digests, the teacher's and the warm start's held-out accuracies).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from opd_jax.experiments import runs
from opd_jax.io import json_file, provenance, run_history

PROBE_FILE = "provenance.json"  # in the probe's directory: the code that trained it
NOW = "this sitting"  # the parts the code running now is making


def write_probe(probe_dir: str, entry: Mapping[str, Any] | None) -> None:
  """Records the probe's provenance (the trainer's final record's entry) beside it."""
  json_file.write_json(os.path.join(probe_dir, PROBE_FILE), dict(entry or {}))


def read_probe(probe_dir: str) -> dict | None:
  """The probe's recorded provenance; None when it was trained before it was recorded."""
  entry = json_file.read_json(os.path.join(probe_dir, PROBE_FILE), None)
  return entry or None


def recorded(probe_dir: str, measurements: Mapping[str, Any], results: Mapping[str, Any]):
  """part name -> its provenance entry (None: unrecorded): "probe", "measurement <spec>" for
  each measurement of `measurements` (measurements.json's dict), "run <name>" for each finished
  run of `results` (run name -> result dict, or None when not finished: left out)."""
  out: dict[str, Any] = {"probe": read_probe(probe_dir)} if os.path.isdir(probe_dir) else {}
  entries = measurements.get(provenance.KEY, {}) or {}
  for spec in measurements.get("measurements", {}):
    out[f"measurement {spec}"] = entries.get(spec)
  for name, result in results.items():
    if result is not None:
      out[f"run {name}"] = result.get(provenance.KEY)
  return out


def code_versions(parts: Mapping[str, Any]) -> dict[str, list[str]]:
  """`provenance.code_key` -> the parts made by that code, in the parts' order."""
  out: dict[str, list[str]] = {}
  for name, entry in parts.items():
    out.setdefault(provenance.code_key(entry), []).append(name)
  return out


def _listing(versions: Mapping[str, list[str]]) -> str:
  lines = []
  for key, names in versions.items():
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    lines.append(f"  {provenance.describe(key)}: {len(names)} part(s): {shown}")
  return "\n".join(lines)


def check_code(parts: Mapping[str, Any], current: Mapping[str, Any], allow: bool, log=print):
  """Refuses a study whose recorded parts and the code running now are not one version.

  Args:
    parts: part name -> provenance entry (`recorded`).
    current: the provenance of the code running now (`provenance.provenance`).
    allow: `config.allow_mixed_code`: report the mix in the log instead of refusing.
    log: where the report goes.

  Returns:
    `code_versions` of the parts and the code running now (under NOW).

  Raises:
    ValueError: more than one version, without `allow`; the message lists each version and
      its parts, and says how to go on.
  """
  versions = code_versions({**parts, NOW: current})
  if len(versions) <= 1:
    return versions
  text = f"this study's parts were made by {len(versions)} versions of the code:\n" + _listing(
    versions
  )
  if not allow:
    raise ValueError(
      f"{text}\nA study mixes no code by default: rerun it in a fresh workdir (or remove the "
      "parts made by other code), or pass --config.allow_mixed_code=true to go on and have "
      "study.json report the mix"
    )
  log(f"warning: {text}\n(allow_mixed_code: going on; study.json reports it)")
  return versions


def start_signatures(results: Mapping[str, Any]) -> dict[str, dict[str, list[str]]]:
  """What each finished run started from, grouped: {"accuracies": {"teacher a, warm start b":
  runs}, "digests": {"teacher t, student s": runs}}.

  The accuracies are the result's teacher_accuracy and student_accuracy_before (the warm
  start's, left out for a resumed run, whose "before" is its resumption's); the digests are its
  "start_digests" (`io.run_history.start_digests`), for the runs that record them.

  Args:
    results: run name -> the run's result dict, or None when not finished (left out).
  """
  accuracies: dict[str, list[str]] = {}
  digests: dict[str, list[str]] = {}
  for name, result in results.items():
    if result is None:
      continue
    key = f"teacher {result.get('teacher_accuracy')}"
    if result.get("start_step"):
      key += " (resumed)"
    else:
      key += f", warm start {result.get('student_accuracy_before')}"
    accuracies.setdefault(key, []).append(name)
    start = result.get(run_history.START_DIGESTS) or {}
    if start.get("teacher") or start.get("student"):
      key = f"teacher {start.get('teacher')}, student {start.get('student')}"
      digests.setdefault(key, []).append(name)
  return {"accuracies": accuracies, "digests": digests}


def check_same_start(results: Mapping[str, Any]) -> None:
  """Refuses runs that started from different teachers or warm starts (`start_signatures`).

  Two starts differ when their teacher accuracies differ, when two runs that did not resume
  differ in their warm start's accuracy, or when two recorded digests differ. A resumed run is
  held to the others' teacher accuracy only.

  Raises:
    ValueError: more than one start among the finished runs; the message lists each start and
      its runs, and says how to go on.
  """
  groups = start_signatures(results)
  finished = [r for r in results.values() if r is not None]
  teachers = {r.get("teacher_accuracy") for r in finished}
  warm_starts = {
    (r.get("teacher_accuracy"), r.get("student_accuracy_before"))
    for r in finished
    if not r.get("start_step")
  }
  if len(teachers) > 1 or len(warm_starts) > 1:
    bad = groups["accuracies"]
  else:
    bad = groups["digests"] if len(groups["digests"]) > 1 else {}
  if not bad:
    return
  lines = []
  for key, names in bad.items():
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    lines.append(f"  {key}: {len(names)} run(s): {shown}")
  raise ValueError(
    "these runs started from different teachers or warm starts (rebuilt on different machines "
    "from the same settings, or from different caches):\n" + "\n".join(lines) + "\nOne "
    "comparison pools runs of one start only: move the records of the runs that differ from "
    "the rest aside (they train again from the teacher cache in use), or carry one teacher "
    "cache (teacher.cache_dir) between machines"
  )


def code_summary(
  parts: Mapping[str, Any], current: Mapping[str, Any], allow: bool
) -> dict[str, Any]:
  """study.json's "code": the versions (`provenance.describe` and the parts of each), whether
  they are mixed, and whether that was allowed."""
  versions = code_versions({**parts, NOW: current})
  return {
    "mixed": len(versions) > 1,
    "allow_mixed_code": bool(allow),
    "versions": [
      {"code": key, "description": provenance.describe(key), "parts": names}
      for key, names in versions.items()
    ],
  }


def run_dirs(workdir: str, names, extra_seeds) -> dict[str, str]:
  """Run name -> directory of every run a study may hold: each setting's, and each setting's
  re-run with each of `extra_seeds` (`experiments.study.rerun_job`'s names)."""
  out = {}
  for name in names:
    out[name] = os.path.join(workdir, "runs", name)
    for seed in extra_seeds:
      out[f"{name}_seed{seed}"] = os.path.join(workdir, "runs", f"{name}_seed{seed}")
  return out


def study_code(
  config, measurements_path: str, probe_dir: str, dirs: Mapping[str, str], log: Callable = print
) -> dict[str, Any]:
  """`check_code` and `check_same_start` on what a study's workdir holds (the probe, the
  measurements in `measurements_path`, the finished runs among `dirs`: run name -> directory),
  then {"provenance": the code running now with the study config's hash, "code":
  `code_summary`}.

  Raises:
    ValueError: as `check_code`, or as `check_same_start` (finished runs of different teachers
      or warm starts).
  """
  measurements = json_file.read_json(measurements_path, {})
  results = {name: runs.read_result(d) for name, d in dirs.items()}
  parts = recorded(probe_dir, measurements, results)
  current = provenance.provenance(config)
  allow = bool(config.get("allow_mixed_code", False))
  check_code(parts, current, allow, log)
  check_same_start({f"run {name}": r for name, r in results.items()})
  return {provenance.KEY: current, "code": code_summary(parts, current, allow)}
