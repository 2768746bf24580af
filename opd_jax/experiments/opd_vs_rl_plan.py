"""OPD against RL: the cost plan, read before anything trains (`python -m opd_jax.opd_vs_rl
--plan`), and its split into parts that later sittings train one at a time (`--part=K`).

From the config alone (no model is built, nothing trains) and what the workdir holds:

  runs    every run of `opd_vs_rl.plan`, under the first block that plans it, in plan order;
          a run whose `result.json` holds this very configuration is reused, one recorded for
          another configuration refused (`study_plan.run_state`: the comparison stops there);
  cost    of run i, from the config's `costs` (DEFAULT_COSTS where it has none):

              c_i = b_i · steps_i / costs.steps,
              b_i = rl_seconds_per_completion · (completions per step)   GRPO and REINFORCE
                    opd_run_seconds                                      any other loss

          and k_i = compile_seconds for the first run of each (method, setting) cell in plan
          order, 0 for the others (they load its programs from DIR/jax_cache);
  wall    T = Σ_{i to train} (c_i + k_i) / s + teacher_seconds · [not cached], s =
          costs.speedup when `workers` > 1 (runs side by side against one at a time), else 1,
          the teacher term when the teacher cache directory holds nothing yet;
  parts   the runs in plan order, cut where a part's planned wall Σ (c_i + k_i) / s would pass
          costs.part_seconds: fixed by the config alone, so part K names the same runs in every
          sitting, whatever the workdir holds, as long as `workers` and `costs` (which train
          nothing differently but set the cut) stay the same between sittings.
  measured  once runs have finished, the plan checks its constants against them. For each
          family f (RL, OPD) with finished runs, ρ_f = median_i (w_i / c_i) over them, w_i a
          run's recorded `wall_seconds` (its compilation and evaluations included), and the
          runs left would take T_f = Σ_{i of f to train} ρ_f · c_i / W at that rate, W =
          `workers` (the recorded walls are of runs that ran W side by side, so W finish per
          such wall). A family with no finished run keeps its planned term. This changes no
          part: the parts stay fixed by the config.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections
import numpy as np

from opd_jax.experiments import opd_vs_rl, runs, study_plan

# Cost constants for a config that states none (`costs`): one 400-step run alone on 2 quiet CPU
# cores with its evaluations (configs/grpo_sweep.py's measurements).
DEFAULT_COSTS = {
  "steps": 400,
  "opd_run_seconds": 35.0,
  "rl_seconds_per_completion": 200.0 / 256,
  "compile_seconds": 30.0,
  "teacher_seconds": 480.0,
  "speedup": 1.18,
  "part_seconds": 7200.0,
}
RL_LOSSES = ("grpo", "reinforce")  # the losses whose cost scales with completions per step


def run_seconds(run: ml_collections.ConfigDict, costs: dict[str, float]) -> float:
  """c_i of the module docstring: the run's wall seconds alone, compilation left out."""
  if run.train.loss in RL_LOSSES:
    base = costs["rl_seconds_per_completion"] * run.data.batch_size * run.rollout.samples_per_prompt
  else:
    base = costs["opd_run_seconds"]
  return base * run.train.steps / costs["steps"]


def teacher_cached(config: ml_collections.ConfigDict) -> bool:
  """Whether the (resolved) config's teacher cache directory holds anything yet."""
  directory = config.run.teacher.cache_dir
  return bool(directory) and os.path.isdir(directory) and bool(os.listdir(directory))


def comparison_plan(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """The plan of `config` in `workdir` (module docstring).

  Returns:
    {"runs": [{"name", "method", "setting", "seed", "block", "steps", "seconds" (c_i),
    "family" ("RL" or "OPD"), "compile" (k_i), "state", "part", and "wall" (w_i) when
    reused}...],
    "blocks": [{"methods", "settings", "seeds", "runs", "train", "reused", "refused"}...],
    "parts": [{"part", "runs", "train", "reused", "refused", "planned_seconds",
    "seconds"}...], "costs", "workers", "speedup", "teacher_seconds" (0 when cached),
    "seconds" (T), "counts" (runs by state), "measured" (`measured_rates`)}.

  Raises:
    ValueError: a config `opd_vs_rl.plan` refuses, a bad cost constant or bad workers.
  """
  costs = study_plan.cost_constants(config.get("costs", None) or {}, DEFAULT_COSTS, "costs.")
  config = opd_vs_rl.resolved(config, workdir)
  workers = runs.check_workers(config.get("workers", 1))
  speedup = costs["speedup"] if workers > 1 else 1.0
  rows, cells = [], set()
  for block, (method, name, _, seed, run) in opd_vs_rl.plan_blocks(config):
    run_name = opd_vs_rl.run_name(method, name, seed)
    first = (method, name) not in cells
    cells.add((method, name))
    done = runs.read_result(os.path.join(workdir, "runs", run_name))
    rows.append(
      {
        "name": run_name,
        "method": method,
        "setting": name,
        "seed": int(seed),
        "block": block,
        "steps": int(run.train.steps),
        "seconds": run_seconds(run, costs),
        "family": "RL" if run.train.loss in RL_LOSSES else "OPD",
        "compile": costs["compile_seconds"] if first else 0.0,
        "state": study_plan.result_state(run, done),
      }
    )
    if rows[-1]["state"] == "reused" and done.get("wall_seconds"):
      rows[-1]["wall"] = float(done["wall_seconds"])
  parts, total = [], 0.0
  for r in rows:
    wall = (r["seconds"] + r["compile"]) / speedup
    if not parts or (parts[-1] and total + wall > costs["part_seconds"]):
      parts.append([])
      total = 0.0
    parts[-1].append(r)
    total += wall
    r["part"] = len(parts)
  teacher = 0.0 if teacher_cached(config) else costs["teacher_seconds"]
  out_parts = [
    dict(
      {"part": k, "runs": len(mine), "planned_seconds": _wall(mine, speedup)},
      seconds=_wall([r for r in mine if r["state"] == "train"], speedup),
      **study_plan.state_counts(mine),
    )
    for k, mine in enumerate(parts, 1)
  ]
  out_blocks = [
    dict(
      {"methods": list(methods), "settings": list(specs), "seeds": list(seeds)},
      runs=sum(r["block"] == b for r in rows),
      **study_plan.state_counts([r for r in rows if r["block"] == b]),
    )
    for b, (methods, specs, seeds) in enumerate(opd_vs_rl.blocks(config))
  ]
  return {
    "runs": rows,
    "blocks": out_blocks,
    "parts": out_parts,
    "costs": costs,
    "workers": workers,
    "speedup": speedup,
    "teacher_seconds": teacher,
    "seconds": _wall([r for r in rows if r["state"] == "train"], speedup) + teacher,
    "counts": study_plan.state_counts(rows),
    "measured": measured_rates(rows, workers, speedup),
  }


def measured_rates(rows: list[dict], workers: int, speedup: float) -> dict[str, Any]:
  """ρ_f and the wall left at the measured rates (module docstring, "measured").

  Returns:
    {"families": {f: {"runs", "ratio" (ρ_f)}} for the families with a recorded wall,
    "seconds": the runs left, measured families at ρ_f · c_i / W and the others at their
    planned (c_i + k_i) / s}; {} when no finished run records a wall.
  """
  walls: dict[str, list[float]] = {}
  for r in rows:
    if r.get("wall") and r["seconds"] > 0:
      walls.setdefault(r["family"], []).append(r["wall"] / r["seconds"])
  if not walls:
    return {}
  ratio = {f: float(np.median(v)) for f, v in walls.items()}
  left = 0.0
  for r in rows:
    if r["state"] != "train":
      continue
    if r["family"] in ratio:
      left += ratio[r["family"]] * r["seconds"] / workers
    else:
      left += (r["seconds"] + r["compile"]) / speedup
  families = {f: {"runs": len(walls[f]), "ratio": ratio[f]} for f in sorted(walls)}
  return {"families": families, "seconds": left}


def _wall(rows, speedup: float) -> float:
  """Σ (c_i + k_i) / s over the rows (module docstring)."""
  return sum(r["seconds"] + r["compile"] for r in rows) / speedup


def part_names(plan: dict[str, Any], part: int) -> list[str]:
  """The run names of part `part` (1-based) of `comparison_plan`'s split.

  Raises:
    ValueError: a part the plan does not have.
  """
  n = len(plan["parts"])
  if not 1 <= part <= n:
    raise ValueError(f"--part={part}: the plan has parts 1 to {n}")
  return [r["name"] for r in plan["runs"] if r["part"] == part]


def plan_lines(plan: dict[str, Any]) -> list[str]:
  """The plan as the lines `--plan` prints."""
  c, costs, hours = plan["counts"], plan["costs"], study_plan.hours
  lines = [
    f"plan: {len(plan['runs'])} runs ({c['train']} to train, {c['reused']} reused, "
    f"{c['refused']} recorded for another configuration)",
  ]
  for b, block in enumerate(plan["blocks"]):
    lines.append(
      f"  block {b + 1}: {len(block['methods'])} arms x {len(block['settings']) + 1} settings "
      f"(the reference and {len(block['settings'])}) x {len(block['seeds'])} seeds: "
      f"{block['runs']} new runs ({block['train']} to train, {block['reused']} reused)"
    )
  lines.append(
    f"estimated wall: {hours(plan['seconds'])}: a run alone {costs['opd_run_seconds']:g} s "
    f"(OPD) or {costs['rl_seconds_per_completion']:.3g} s per completion per step (RL) per "
    f"{costs['steps']:g} steps, {costs['compile_seconds']:g} s to compile each arm and setting, "
    f"{plan['workers']} side by side at {plan['speedup']:g}x, teacher and warm start "
    f"{plan['teacher_seconds']:g} s"
  )
  measured = plan.get("measured") or {}
  if measured:
    said = ", ".join(
      f"{f} {m['ratio']:.2f}x its planned time alone over {m['runs']} finished run(s)"
      for f, m in measured["families"].items()
    )
    lines.append(
      f"measured: {said} ({plan['workers']} side by side); the runs left at those rates: "
      f"{hours(measured['seconds'])}"
    )
  for p in plan["parts"]:
    names = [r["name"] for r in plan["runs"] if r["part"] == p["part"]]
    lines.append(
      f"  part {p['part']}: {p['runs']} runs ({names[0]} .. {names[-1]}), "
      f"{p['train']} to train, {p['reused']} reused; planned {hours(p['planned_seconds'])}, "
      f"left {hours(p['seconds'])}"
    )
  return lines + study_plan.reuse_lines(plan["runs"], "the comparison")
