"""How much of a verdict is the probe: the admission check's KL of a few candidates, each
measured at probes trained from different seeds, and the budget's verdict at each.

A study measures every setting at one probe: `probe_steps` steps of the reference run trained
with the first of its seeds (`study_probe.run_probe`). That student decides the reading x_s of a
candidate, and a verdict that flips with it is partly the probe's. For each seed s, the study's
own probe trained with train.seed = s goes to DIR/probe_seeds/seed<s>/runs/probe, and each
candidate is measured at its latest student by the study's own procedure
(`study_probe.measure_settings`, the same prompts, key and number of prompts; cached in
DIR/probe_seeds/seed<s>/measurements.json). The study's own probe seed (config.seeds[0])
reuses DIR/runs/probe and a copy of DIR/measurements.json when DIR holds them, so no reading
of the study is measured twice.

Per candidate, over the seeds' readings x_s: the mean x̄, the sample sd, the spread
max_s x_s − min_s x_s and the relative spread (spread / x̄). With a budget, the rule's verdict
at each probe (`admission.candidate_verdict`, the path of `python -m opd_jax.admit`) and
whether the probes agree on it.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from opd_jax.experiments import study_probe
from opd_jax.experiments import study_setting as setting_lib
from opd_jax.mismatch import admission, budget, budget_file
from opd_jax.mismatch import candidates as candidates_lib

SEEDS_DIR = "probe_seeds"


def seed_config(config: ml_collections.ConfigDict, seed: int, cache_dir: str):
  """The study config whose probe trains with train.seed = `seed` (the reference's first seed
  is the probe's, `setting_lib.study_settings`), its teacher cache pinned to `cache_dir`."""
  out = copy.deepcopy(config)
  with out.unlocked():
    out.seeds = (int(seed), *(int(s) for s in config.seeds if int(s) != int(seed)))
    out.run.teacher.cache_dir = config.run.teacher.cache_dir or cache_dir
  return out


def probe_settings(config, specs: Sequence[str]) -> list[setting_lib.Setting]:
  """The reference (the probe's run) and one setting per candidate spec."""
  seed = int(config.seeds[0])
  name = f"{setting_lib.REFERENCE}_seed{seed}"
  out = [
    setting_lib.Setting(
      name, setting_lib.REFERENCE_SPEC, setting_lib.REFERENCE, setting_lib.REFERENCE, seed
    )
  ]
  for spec in specs:
    candidate = candidates_lib.parse_candidate(spec, config.run)
    out.append(
      setting_lib.Setting(
        setting_lib.setting_name(spec), spec, setting_lib.source_of(candidate), "probe", seed
      )
    )
  return out


def seed_workdir(workdir: str, study_seed: int, seed: int) -> tuple[str, str | None]:
  """(the directory the seed's probe and measurements go to, the study's own probe when
  `seed` is the study's probe seed and DIR holds it, else None). The study's measurements
  file is then copied there once, so its readings are reused."""
  directory = os.path.join(workdir, SEEDS_DIR, f"seed{seed}")
  os.makedirs(directory, exist_ok=True)
  own = os.path.join(workdir, "runs", study_probe.PROBE)
  if int(seed) != int(study_seed) or not os.path.isdir(own):
    return directory, None
  cached = os.path.join(workdir, study_probe.MEASUREMENTS_FILE)
  mine = os.path.join(directory, study_probe.MEASUREMENTS_FILE)
  if os.path.exists(cached) and not os.path.exists(mine):
    shutil.copyfile(cached, mine)
  return directory, own


def summarize(readings: Mapping[str, float]) -> dict[str, float]:
  """The mean x̄, sample sd, spread max − min and relative spread (spread / x̄) of one
  candidate's readings over probe seeds (sd NaN with a single seed).

  Raises:
    ValueError: no readings.
  """
  if not readings:
    raise ValueError("no readings: give at least one probe seed")
  x = np.asarray(list(readings.values()), dtype=float)
  mean = float(x.mean())
  spread = float(x.max() - x.min())
  return {
    "mean": mean,
    "sd": float(x.std(ddof=1)) if len(x) > 1 else math.nan,
    "spread": spread,
    "relative_spread": spread / mean if mean > 0 else math.nan,
  }


def judge(config, spec: str, measurement: Mapping, fitted: budget.Budget, extrapolate: str):
  """The budget's rule on one reading (the study's and the check's path); the call's words."""
  candidate = candidates_lib.parse_candidate(spec, config.run)
  row = {"spec": spec, **measurement}
  _, verdict = admission.candidate_verdict(
    candidate, config.run, row, fitted, None, fitted.rule, extrapolate
  )
  call = "admitted" if verdict.admitted else "refused"
  if verdict.extrapolation:
    call += f" ({verdict.extrapolation})"
  elif verdict.too_close:
    call += " (too close)"
  return {"admitted": bool(verdict.admitted), "call": call, "limit": verdict.limit}


def probe_spread(
  config: ml_collections.ConfigDict,
  workdir: str,
  seeds: Sequence[int],
  specs: Sequence[str],
  budget_path: str | None = None,
  log: Callable = print,
) -> dict[str, Any]:
  """Measures each spec at each seed's probe (module docstring); returns the rows.

  Raises:
    ValueError: no seeds or no candidates, a seed given twice, or a candidate the check
      refuses (`candidates_lib.parse_candidate`).
  """
  if not seeds or not specs:
    raise ValueError("give at least one probe seed and one candidate")
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"probe seeds {list(seeds)} repeat a seed")
  fitted = budget_file.load_budget(budget_path)[0] if budget_path else None
  extrapolate = config.get("extrapolate", "refuse")
  cache_dir = os.path.join(workdir, "teacher_cache")
  by_seed: dict[str, dict] = {}  # str keys, as in the JSON
  for seed in seeds:
    cfg = seed_config(config, seed, cache_dir)
    settings = probe_settings(cfg, specs)
    directory, probe_dir = seed_workdir(workdir, config.seeds[0], seed)
    probe_dir = probe_dir or study_probe.run_probe(cfg, settings, directory, log)  # reused
    by_seed[str(seed)] = study_probe.measure_settings(cfg, settings, probe_dir, directory, log)[0]
  rows = []
  for spec in specs:
    readings = {s: float(m[spec][budget.KL_KEY]) for s, m in by_seed.items()}
    row = {"spec": spec, "kl_by_seed": readings, **summarize(readings)}
    if fitted is not None:
      calls = {s: judge(config, spec, m[spec], fitted, extrapolate) for s, m in by_seed.items()}
      row["verdict_by_seed"] = calls
      row["probes_agree"] = len({c["admitted"] for c in calls.values()}) == 1
    rows.append(row)
  return {"seeds": [int(s) for s in seeds], "budget": budget_path, "rows": rows}


def markdown_lines(result: Mapping) -> list[str]:
  """The table: one row per candidate, its reading at each probe seed and their spread."""
  seeds = [str(s) for s in result["seeds"]]
  judged = bool(result["rows"]) and "verdict_by_seed" in result["rows"][0]
  head = ["candidate", *(f"KL seed {s}" for s in seeds), "mean", "spread (rel.)"]
  if judged:
    head += [*(f"call seed {s}" for s in seeds), "probes agree"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in result["rows"]:
    cells = [f"`{r['spec']}`", *(f"{r['kl_by_seed'][s]:.4g}" for s in seeds)]
    cells += [f"{r['mean']:.4g}", f"{r['spread']:.3g} ({r['relative_spread']:.0%})"]
    if judged:
      cells += [r["verdict_by_seed"][s]["call"] for s in seeds]
      cells.append("yes" if r["probes_agree"] else "no")
    lines.append("| " + " | ".join(cells) + " |")
  return lines
