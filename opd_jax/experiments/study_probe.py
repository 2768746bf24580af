"""The study's probe and measurements (steps 1 and 2 of `experiments.study`): the reference run
stopped after `probe_steps` with the checkpoints the stale settings need (`probe_config`,
`run_probe`), and the admission check's measurement of every setting at its student, cached in
DIR/measurements.json (`measure_settings`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import ml_collections

from opd_jax.experiments import runs, study_provenance
from opd_jax.experiments.study_setting import REFERENCE, Setting, run_config
from opd_jax.io import provenance, run_history
from opd_jax.io.json_file import read_json, write_json
from opd_jax.mismatch import admission, budget, budget_file
from opd_jax.mismatch import candidates as candidates_lib
from opd_jax.train import setup as setup_lib
from opd_jax.train import trainer

PROBE = "probe"
MEASUREMENTS_FILE = "measurements.json"


def probe_config(config: ml_collections.ConfigDict, settings: Sequence[Setting], workdir: str):
  """The reference run stopped after `probe_steps`, keeping every checkpoint the stale
  candidates need (θ_P and θ_(P−k) for each lag k)."""
  lags = [candidates_lib.parse_candidate(s.spec, config.run).lag for s in settings]
  lags.append(int(config.get("probe_lag", 0)))  # a lag measured but not trained (a screen)
  reference = next(s for s in settings if s.role == REFERENCE)
  base = run_config(config, reference, workdir)
  if not 0 < config.probe_steps < base.train.steps:
    raise ValueError(
      f"config.probe_steps={config.probe_steps} must be in (0, run.train.steps={base.train.steps})"
    )
  if max(lags) >= config.probe_steps:
    raise ValueError(
      f"a stale setting has lag {max(lags)} but the probe runs only {config.probe_steps} steps; "
      "raise config.probe_steps"
    )
  return runs.with_overrides(
    base,
    {
      "train.stop_after": config.probe_steps,
      "train.checkpoint_every": 1,
      "train.keep_checkpoints": max(lags) + 1,
      "train.eval_every": base.train.steps,
    },
  )


def probe_done(config, workdir: str) -> bool:
  """Whether DIR/runs/probe holds its checkpoint at `probe_steps` (what `run_probe` reuses and
  the plan reports)."""
  directory = os.path.join(workdir, "runs", PROBE, "checkpoints")
  return os.path.isdir(directory) and str(int(config.probe_steps)) in os.listdir(directory)


def run_probe(config, settings, workdir: str, log: Callable = print) -> str:
  """Trains the probe once; returns its directory. It is done when `probe_done`; a probe stopped
  before that (even before its first checkpoint, leaving an empty checkpoints folder) trains
  on."""
  directory = os.path.join(workdir, "runs", PROBE)
  if not probe_done(config, workdir):
    log(f"probe: {config.probe_steps} reference steps into {directory}")
    done = trainer.run(probe_config(config, settings, workdir), directory, log)
    study_provenance.write_probe(directory, done.get(provenance.KEY))
  return directory


def measure_settings(config, settings, probe_dir: str, workdir: str, log: Callable = print):
  """The admission check's measurement of every setting at the probe's student, and of each
  part of a combination alone (`candidates_lib.source_parts`: what the per-part rule reads).

  Returns:
    (setting spec -> its measurement dict, with "mismatch/kl/part/<source>" for each part of a
    combination; the budget fingerprint of the measured student and teacher, with the student
    the runs start from as its run-start student: `budget_file.with_run_start`). Measurements
    (parts too) are cached in DIR/measurements.json together with the fingerprint of the
    measured setup, and reused when it still matches and the spec's own entry agrees: its
    "provenance" holds each one's `io.provenance` entry (the code that measured it, the
    candidate config's hash) with the number of prompts, and a spec whose config hash or
    prompt count differs from now is measured again (an older file without them is reused).
  """
  path = os.path.join(workdir, MEASUREMENTS_FILE)
  cached = read_json(path, {"fingerprint": None, "measurements": {}})
  run_cfg = run_config(config, settings[0], workdir)
  run = setup_lib.run_spec(run_cfg)
  setup = setup_lib.prepare_models(run, workdir, log)
  history = run_history.RunHistory(run, setup, probe_dir)
  student = history.params(history.latest)
  fingerprint = admission.current_fingerprint(setup, student)
  same = cached["fingerprint"] == fingerprint
  measured = cached["measurements"] if same else {}
  made_by = cached.get(provenance.KEY, {}) if same else {}  # absent in older files
  m = setup.models
  prompts = admission.calibration_prompts(run_cfg, m.tokenizer, setup.task_cfg, config.num_prompts)
  parts = {
    s.spec: candidates_lib.source_parts(candidates_lib.parse_candidate(s.spec, run_cfg), run_cfg)
    for s in settings
  }
  specs = [spec for s in settings for spec in (s.spec, *parts[s.spec].values())]
  for spec in dict.fromkeys(specs):  # in order, once each
    candidate = candidates_lib.parse_candidate(spec, run_cfg)
    entry = made_by.get(spec) or {}
    if (
      spec in measured
      and entry.get("config_sha256") in (None, provenance.config_sha256(candidate.config))
      and entry.get("num_prompts") in (None, int(config.num_prompts))
    ):
      continue
    problem = admission.stale_lag_problem(candidate, history)
    if problem:
      raise ValueError(problem)
    behaviour = history.params(history.latest - candidate.lag) if candidate.lag else None
    result = admission.measure_candidate(candidate, setup, prompts[1:], student, behaviour)
    measured[spec] = {k: v for k, v in result.items() if isinstance(v, int | float | str)}
    made_by[spec] = {
      **provenance.provenance(candidate.config),
      "num_prompts": int(config.num_prompts),
    }
    log(f"measured {spec}: mismatch/kl {measured[spec][budget.KL_KEY]:.4g}")
    write_json(path, {"fingerprint": fingerprint, "measurements": measured, "provenance": made_by})
  run_start = admission.initial_student(run_cfg, setup, log, setup.cache_dir or None)
  by_setting = {
    spec: {
      **measured[spec],
      **{f"{budget.PART_KL_PREFIX}{src}": measured[p][budget.KL_KEY] for src, p in own.items()},
    }
    for spec, own in parts.items()
  }
  return by_setting, budget_file.with_run_start(fingerprint, run_start)
