"""A study's cost plan, read before anything trains: `python -m opd_jax.study --plan`.

From the config alone (no model is built, nothing trains) and what the workdir already holds:

  runs          the reference seeds, one run per setting, and the re-runs of every setting whose
                role is in `rerun_all_roles` (one per `borderline_seeds`); the borderline
                re-runs of `borderline_roles` depend on results, so they are counted apart as
                "at most" (each setting of those roles, once per borderline seed);
  reused        a run whose `result.json` holds this very configuration (`runs.recorded_
                differences` finds no differing key: `runs.run_once` reuses it); one recorded
                for another configuration is listed as refused (the study would stop there);
  probes        one, reused when its checkpoint at `probe_steps` is there;
  measurements  every setting and each part of a combination, once (`study_probe.measure_settings`);
                those in DIR/measurements.json are reused if its fingerprint still matches.

Estimated wall time, from the config's cost constants (defaults below where it has none):

  T = S · c_run / w + P · c_probe + M · c_measure,

S the steps of the runs still to train (each run's `train.steps`), w = `workers`, c_run =
`run_step_seconds` (study wall per step of one run with w runs side by side, start-up and
evaluation included), P the probe's steps when it is still to train, c_probe =
`probe_step_seconds`, M the measurements not cached, c_measure = `measure_seconds`. The
borderline re-runs that may follow add at most their own S · c_run / w, reported apart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from opd_jax.experiments import runs, study_probe, study_setting
from opd_jax.experiments import study as study_lib
from opd_jax.io.json_file import read_json
from opd_jax.mismatch import candidates as candidates_lib

# Cost constants for a config that sets none (round 9's runs on 2 CPU cores: 6,904 s of run
# wall over 109 runs of 200 steps, two side by side, 0.32 s per step with start-up and
# evaluation; the probe and measurement figures are rough guesses, a few percent of a study).
RUN_STEP_SECONDS = 0.3
PROBE_STEP_SECONDS = 0.6
MEASURE_SECONDS = 10.0
COSTS = {
  "run_step_seconds": RUN_STEP_SECONDS,
  "probe_step_seconds": PROBE_STEP_SECONDS,
  "measure_seconds": MEASURE_SECONDS,
}


def cost_constants(
  config: ml_collections.ConfigDict, defaults: dict[str, float] = COSTS, prefix: str = "config."
) -> dict[str, float]:
  """The config's cost constants, each defaulting to `defaults` (COSTS: the study's); `prefix`
  is where the config holds them, for the error.

  Raises:
    ValueError: a constant that is not a number > 0.
  """
  out = {}
  for key, default in defaults.items():
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
      raise ValueError(f"{prefix}{key} must be a number > 0, got {value!r}")
    out[key] = float(value)
  return out


def run_state(config: ml_collections.ConfigDict, run_dir: str) -> str:
  """ "reused" (a result of this configuration), "refused" (a result of another one), or
  "train" (no finished result)."""
  return result_state(config, runs.read_result(run_dir))


def result_state(config: ml_collections.ConfigDict, done: Mapping[str, Any] | None) -> str:
  """`run_state` of a result already read (`runs.read_result`; None when unfinished)."""
  if done is None:
    return "train"
  return "refused" if runs.recorded_differences(config, done)[1] else "reused"


def measurement_specs(config, settings: Sequence[study_setting.Setting]) -> list[str]:
  """Every spec the study measures: each setting, then each part of a combination, once."""
  out = []
  for s in settings:
    candidate = candidates_lib.parse_candidate(s.spec, config.run)
    out += [s.spec, *candidates_lib.source_parts(candidate, config.run).values()]
  return list(dict.fromkeys(out))


def study_plan(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """The plan of `config` in `workdir` (module docstring).

  Returns:
    {"runs": [{"name", "role", "seed", "steps", "state"}...], "borderline": [...] (the re-runs
    that may follow, each with its state), "probe": {"steps", "state"}, "measurements": {"n",
    "cached"}, "costs", "seconds" (T), "borderline_seconds", "counts": runs by state}.

  Raises:
    ValueError: a setting or rerun plan the study would refuse (`study_setting.study_settings`,
      `study.rerun_plan`, `study_probe.probe_config`), or a bad cost constant.
  """
  costs = cost_constants(config)
  settings = study_setting.study_settings(config)
  extra, roles, every = study_lib.rerun_plan(config)
  study_probe.probe_config(config, settings, workdir)  # refuses a probe shorter than a lag
  jobs, maybe = [], []
  for s in settings:
    cfg = study_setting.run_config(config, s, workdir)
    jobs.append((s, s.seed, cfg, os.path.join(workdir, "runs", s.name)))
  for s in settings:
    for seed in extra:
      cfg, run_dir = study_lib.rerun_job(config, s, seed, workdir)
      if s.role in every:
        jobs.append((s, seed, cfg, run_dir))
      elif s.role in roles:
        maybe.append((s, seed, cfg, run_dir))

  def rows(items):
    return [
      {
        "name": os.path.basename(run_dir),
        "role": s.role,
        "seed": int(seed),
        "steps": int(cfg.train.steps),
        "state": run_state(cfg, run_dir),
      }
      for s, seed, cfg, run_dir in items
    ]

  planned, borderline = rows(jobs), rows(maybe)
  specs = measurement_specs(config, settings)
  cached = read_json(os.path.join(workdir, study_probe.MEASUREMENTS_FILE), {}).get(
    "measurements", {}
  )
  num_cached = sum(spec in cached for spec in specs)
  probe = {
    "steps": int(config.probe_steps),
    "state": "reused" if study_probe.probe_done(config, workdir) else "train",
  }
  workers = runs.check_workers(config.get("workers", 1))

  def train_seconds(items):
    steps = sum(r["steps"] for r in items if r["state"] == "train")
    return steps * costs["run_step_seconds"] / workers

  seconds = (
    train_seconds(planned)
    + (probe["steps"] * costs["probe_step_seconds"] if probe["state"] == "train" else 0.0)
    + (len(specs) - num_cached) * costs["measure_seconds"]
  )
  counts = state_counts(planned)
  return {
    "runs": planned,
    "borderline": borderline,
    "probe": probe,
    "measurements": {"n": len(specs), "cached": num_cached},
    "costs": costs,
    "workers": workers,
    "seconds": seconds,
    "borderline_seconds": train_seconds(borderline),
    "counts": counts,
  }


def state_counts(rows) -> dict[str, int]:
  """How many planned runs are to train, reused and refused (`run_state`)."""
  return {state: sum(r["state"] == state for r in rows) for state in ("train", "reused", "refused")}


def hours(seconds: float) -> str:
  """Seconds as the plans print them: "8,619 s (2.39 h)"."""
  return f"{seconds:,.0f} s ({seconds / 3600:.2f} h)"


def reuse_lines(runs, what: str) -> list[str]:
  """The plan's closing lines: the runs reused, and those refused (a result of another
  configuration), after which `what` ("the study", "the comparison") stops."""
  reused = [r["name"] for r in runs if r["state"] == "reused"]
  refused = [r["name"] for r in runs if r["state"] == "refused"]
  lines = ["reused: " + (", ".join(reused) or "none")]
  if refused:
    lines.append(
      f"refused (a result of another configuration; {what} stops there): " + ", ".join(refused)
    )
  return lines


def plan_lines(plan: dict[str, Any]) -> list[str]:
  """The plan as the lines `--plan` prints."""
  n, c, m = len(plan["runs"]), plan["counts"], plan["measurements"]
  steps = sorted({r["steps"] for r in plan["runs"]})
  costs = plan["costs"]
  lines = [
    f"plan: {n} runs of {'/'.join(map(str, steps))} steps ({c['train']} to train, {c['reused']} "
    f"reused, {c['refused']} recorded for another configuration), 1 probe of "
    f"{plan['probe']['steps']} steps ({plan['probe']['state']}), {m['n']} measurements "
    f"({m['cached']} cached)",
    f"estimated wall: {hours(plan['seconds'])} at {costs['run_step_seconds']:g} s per run step "
    f"with {plan['workers']} side by side, {costs['probe_step_seconds']:g} s per probe step, "
    f"{costs['measure_seconds']:g} s per measurement",
  ]
  if plan["borderline"]:
    lines.append(
      f"then at most {len(plan['borderline'])} borderline re-runs, at most "
      f"{hours(plan['borderline_seconds'])} more"
    )
  return lines + reuse_lines(plan["runs"], "the study")
