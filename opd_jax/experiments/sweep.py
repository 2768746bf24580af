"""A grid of named arms, each a whole run config, over seeds: the logic of
`python -m opd_jax.sweep`.

A sweep config (`configs/grpo_sweep.py`) holds

    arms              name -> run config (a ConfigDict each: the arms may differ in anything)
    seeds             the train.seed of every run (models, teacher and warm start keep `seed`,
                      so every run of every arm starts from the same student)
    reference_arm     the arm the others' gains are shared against (its gain is 1)
    select_from       the arms the selection rule picks among (may be empty)
    select_metric     the rule: the arm of `select_from` with the largest mean gain in this
                      quality metric over the seeds (ties: the earlier arm)
    allow_mixed_code  as in the study: report runs made by different code instead of refusing
    teacher_cache_dir every arm's teacher.cache_dir ("" = <workdir>/teacher_cache): one
                      teacher bootstrap and one warm start for the whole sweep

Each run is `runs.run_once` into <workdir>/runs/<arm>__seed<k>, so a sweep restarted on its
workdir reuses every run it finished. Per run, from its metrics.jsonl, the held-out curve at
each evaluation: (step, training wall seconds so far, one value per metric of METRICS). Per
arm and metric, over seeds:

    gain_s       = a_s(final) − a_s(0), the run's gain over the warm start (points / 100)
    gain         = mean_s gain_s, with Student's t interval (n − 1 degrees of freedom)
    share        = (mean_s a_s − w) / (mean_s r_s − w): `stats.gain_kept` against the
                   reference arm's final accuracies r_s, w the shared warm start, with its
                   percentile bootstrap interval over seeds
    at_ref_wall  = the arm's gain at the reference arm's mean training wall seconds W:
                   a(W) − a(0), a(W) read off the arm's curve by linear interpolation in wall
                   seconds (nan past the arm's last evaluation, where it has no reading)

The report (<workdir>/sweep.json, sweep.md, sweep_curves.png) is rewritten after every run, and
records the provenance of the sweep config and of the code of every run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np
from scipy import stats as scipy_stats

from opd_jax.config import check as config_check
from opd_jax.experiments import plots, runs, stats, study_provenance
from opd_jax.io import json_file, metrics_writer, provenance, table_cells

METRICS = ("quality/student_accuracy", "quality/student_accuracy_t1")  # greedy, T = 1
SHORT = {"quality/student_accuracy": "greedy", "quality/student_accuracy_t1": "t1"}
WALL_KEY = "perf/train_wall_seconds"
REPORT = "sweep"


def run_name(arm: str, seed: int) -> str:
  return f"{arm}__seed{seed}"


def check(config: ml_collections.ConfigDict) -> None:
  """Refuses a sweep config that cannot run, naming what is wrong.

  Raises:
    ValueError: no arms, an arm name that is not a plain word, an arm that is not a run config
      (or one `config_check.validate` refuses), no or repeated seeds, a reference arm or
      selection arm that is not an arm, or an unknown selection metric.
  """
  arms = config.get("arms")
  if not arms:
    raise ValueError("config.arms is empty: give name -> run config for each arm")
  for name, arm in arms.items():
    if not name.replace("_", "").isalnum():
      raise ValueError(f"arm name {name!r}: use letters, digits and underscores only")
    if not isinstance(arm, ml_collections.ConfigDict) or "train" not in arm:
      raise ValueError(f"config.arms.{name} is not a run config (it has no train section)")
    config_check.validate(arm)
  seeds = list(config.get("seeds", ()))
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f"config.seeds must be distinct train seeds, got {seeds}")
  for key in ("reference_arm",):
    if config.get(key) not in arms:
      raise ValueError(f"config.{key}={config.get(key)!r} is not an arm: {', '.join(arms)}")
  for name in config.get("select_from", ()):
    if name not in arms:
      raise ValueError(f"config.select_from names {name!r}, not an arm: {', '.join(arms)}")
  if config.get("select_metric") not in METRICS:
    raise ValueError(
      f"config.select_metric={config.get('select_metric')!r}; known: {', '.join(METRICS)}"
    )


def plan(
  config: ml_collections.ConfigDict, workdir: str
) -> list[tuple[str, int, ml_collections.ConfigDict]]:
  """(arm, seed, run config) for every run, with train.seed = seed and the sweep's teacher
  cache: seeds outermost, so that a sweep stopped early has whole seeds of every arm."""
  check(config)
  cache = config.get("teacher_cache_dir") or os.path.join(workdir, "teacher_cache")
  return [
    (name, seed, runs.with_overrides(arm, {"train.seed": seed, "teacher.cache_dir": cache}))
    for seed in config.seeds
    for name, arm in config.arms.items()
  ]


def curve(run_dir: str) -> list[list[float]]:
  """[[step, training wall seconds, *METRICS]] at each evaluation of the run's metrics.jsonl.

  The trainer logs `perf/train_wall_seconds` (the loop's seconds less its evaluations and
  checkpoints) at every evaluation step; step 0 reads 0.

  Raises:
    ValueError: an evaluation row lacks one of METRICS (the run did not set
      train.eval_sampled for the T = 1 accuracy).
  """
  out = []
  for step, row in sorted(metrics_writer.read_jsonl(run_dir).items()):
    if METRICS[0] not in row:
      continue
    missing = [k for k in METRICS if k not in row]
    if missing:
      raise ValueError(f"{run_dir} step {step}: no {', '.join(missing)} (set train.eval_sampled)")
    wall = 0.0 if step == 0 else float(row.get(WALL_KEY, math.nan))
    out.append([int(step), wall, *(float(row[k]) for k in METRICS)])
  return out


def value_at_wall(curve_rows: Sequence[Sequence[float]], column: int, wall: float) -> float:
  """The curve's `column` at `wall` training seconds, linearly interpolated between its
  evaluations; nan past the last evaluation or without a finite wall."""
  walls = np.asarray([r[1] for r in curve_rows], np.float64)
  ys = np.asarray([r[column] for r in curve_rows], np.float64)
  if not len(walls) or not (math.isfinite(wall) and np.all(np.isfinite(walls))):
    return math.nan
  if wall > walls[-1]:
    return math.nan
  return float(np.interp(wall, walls, ys))


def t_interval(values: Sequence[float], level: float = stats.LEVEL) -> tuple[float, float]:
  """mean ± t_{n−1, (1+level)/2} · s / √n; (nan, nan) with fewer than two values."""
  x = np.asarray(values, np.float64)
  if x.size < 2:
    return (math.nan, math.nan)
  half = float(scipy_stats.t.ppf((1 + level) / 2, x.size - 1)) * x.std(ddof=1) / math.sqrt(x.size)
  return (float(x.mean() - half), float(x.mean() + half))


def run_row(arm: str, seed: int, result: Mapping[str, Any], run_dir: str) -> dict[str, Any]:
  """One run's row: its curve, final values, gains, wall seconds and provenance."""
  rows = curve(run_dir)
  row: dict[str, Any] = {
    "arm": arm,
    "seed": seed,
    "curve": rows,
    "train_wall_seconds": rows[-1][1] if rows else math.nan,
    "wall_seconds": float(result.get("wall_seconds", math.nan)),
    "grad_norm_max": float(result.get("train/perf/grad_norm_max", math.nan)),
    provenance.KEY: result.get(provenance.KEY),
  }
  for i, key in enumerate(METRICS):
    name = SHORT[key]
    row[f"start_{name}"] = rows[0][2 + i] if rows else math.nan
    row[f"final_{name}"] = rows[-1][2 + i] if rows else math.nan
    row[f"gain_{name}"] = row[f"final_{name}"] - row[f"start_{name}"]
  return row


def summarise(rows: Sequence[dict], config: ml_collections.ConfigDict) -> list[dict[str, Any]]:
  """Per arm (config order): seeds, mean gains with t intervals, the share of the reference
  arm's gain (`stats.gain_kept`), and the gain at the reference arm's wall time."""
  by_arm: dict[str, list[dict]] = {}
  for r in rows:
    by_arm.setdefault(r["arm"], []).append(r)
  ref = by_arm.get(config.reference_arm, [])
  ref_wall = float(np.mean([r["train_wall_seconds"] for r in ref])) if ref else math.nan
  out = []
  for arm in config.arms:
    mine = by_arm.get(arm, [])
    if not mine:
      continue
    cell: dict[str, Any] = {
      "arm": arm,
      "seeds": [r["seed"] for r in mine],
      "train_wall_seconds": float(np.mean([r["train_wall_seconds"] for r in mine])),
      "reference_wall_seconds": ref_wall,
    }
    for i, key in enumerate(METRICS):
      name = SHORT[key]
      gains = [r[f"gain_{name}"] for r in mine]
      cell[f"gain_{name}"] = float(np.mean(gains))
      cell[f"gain_{name}_ci"] = t_interval(gains)
      cell[f"final_{name}"] = float(np.mean([r[f"final_{name}"] for r in mine]))
      warm = float(np.mean([r[f"start_{name}"] for r in mine]))
      share, share_ci = stats.gain_kept(
        [r[f"final_{name}"] for r in ref], [r[f"final_{name}"] for r in mine], warm
      )
      cell[f"share_{name}"], cell[f"share_{name}_ci"] = share, share_ci
      at = [value_at_wall(r["curve"], 2 + i, ref_wall) - r[f"start_{name}"] for r in mine]
      cell[f"at_ref_wall_{name}"] = float(np.mean(at))
    out.append(cell)
  return out


def select(cells: Sequence[dict], config: ml_collections.ConfigDict) -> str | None:
  """The selection rule (module docstring): the arm of `select_from` with the largest mean
  gain in `select_metric`; None when none of them has run."""
  name = f"gain_{SHORT[config.select_metric]}"
  candidates = [c for c in cells if c["arm"] in tuple(config.get("select_from", ()))]
  if not candidates:
    return None
  return max(candidates, key=lambda c: (c[name], -list(config.arms).index(c["arm"])))["arm"]


def _cell(x: float, ci, spec: str, scale: float = 1.0) -> str:
  """scale·x by `spec`, then its interval when both ends are finite: "+3.1 [+0.2, +6.0]";
  "n/a" when x is not finite (the report's footnote says why)."""
  value = table_cells.number(scale * x, spec, missing="n/a")
  if value == "n/a":
    return value
  lo, hi = ci
  bounds = table_cells.interval((scale * lo, scale * hi), spec)
  return f"{value} {bounds}" if bounds else value


def _points(x: float, ci=(math.nan, math.nan)) -> str:
  """A gain in accuracy points (x a fraction), with its interval."""
  return _cell(x, ci, "+.1f", scale=100.0)


def markdown(cells: Sequence[dict], selected: str | None, meta: Mapping[str, Any]) -> str:
  """The report's table: per arm the gains (points, t interval over seeds), the share of the
  reference arm's gain, the gain at the reference arm's wall time, and the wall seconds."""
  lines = [
    f"# Sweep: {meta['summary']}",
    "",
    "| arm | seeds | gain greedy | gain T=1 | share greedy | share T=1 | at ref wall "
    "greedy / T=1 | train wall s |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for c in cells:
    lines.append(
      f"| {c['arm']}{' (selected)' if c['arm'] == selected else ''} | {len(c['seeds'])} | "
      f"{_points(c['gain_greedy'], c['gain_greedy_ci'])} | "
      f"{_points(c['gain_t1'], c['gain_t1_ci'])} | "
      f"{_cell(c['share_greedy'], c['share_greedy_ci'], '.2f')} | "
      f"{_cell(c['share_t1'], c['share_t1_ci'], '.2f')} | {_points(c['at_ref_wall_greedy'])} / "
      f"{_points(c['at_ref_wall_t1'])} | {c['train_wall_seconds']:.0f} |"
    )
  lines += [
    "",
    "Gains in accuracy points over the shared warm start (mean over seeds, 95 % t interval); "
    f"share = the arm's gain over {meta['reference_arm']}'s (bootstrap interval over seeds); "
    f"'at ref wall' = the gain at {meta['reference_arm']}'s mean training wall seconds "
    "(n/a: the arm's last evaluation came earlier).",
    f"Selection rule (fixed in the config): the arm of {', '.join(meta['select_from'])} with "
    f"the largest mean {meta['select_metric']} gain: {selected or 'none yet'}.",
  ]
  return "\n".join(lines) + "\n"


def run_sweep(config: ml_collections.ConfigDict, workdir: str, log: Callable = print) -> dict:
  """Trains every (arm, seed) run once and rewrites the report after each.

  Raises:
    ValueError: a bad config (`check`), a run directory holding another configuration
      (`runs.run_once`), or finished runs made by different code without allow_mixed_code.
  """
  todo = plan(config, workdir)
  os.makedirs(workdir, exist_ok=True)
  current = provenance.provenance(config)
  rows: list[dict] = []
  report: dict[str, Any] = {}
  meta = {
    "summary": config.get("summary", ""),
    "reference_arm": config.reference_arm,
    "select_from": list(config.get("select_from", ())),
    "select_metric": config.select_metric,
    "seeds": list(config.seeds),
    "planned": [run_name(a, s) for a, s, _ in todo],
  }
  for i, (arm, seed, run_config) in enumerate(todo):
    run_dir = os.path.join(workdir, "runs", run_name(arm, seed))
    log(f"[{i + 1}/{len(todo)}] {arm}, seed {seed} -> {run_dir}")
    result = runs.run_once(run_config, run_dir, log)
    rows.append(run_row(arm, seed, result, run_dir))
    parts = {f"run {r['arm']} seed {r['seed']}": r[provenance.KEY] for r in rows}
    allow = bool(config.get("allow_mixed_code", False))
    study_provenance.check_code(parts, current, allow, log)
    cells = summarise(rows, config)
    selected = select(cells, config)
    report = {
      **meta,
      provenance.KEY: current,
      "code": study_provenance.code_summary(parts, current, allow),
      "selected": selected,
      "arms": cells,
      "runs": rows,
    }
    json_file.write_json(os.path.join(workdir, f"{REPORT}.json"), report)
    json_file.write_text(os.path.join(workdir, f"{REPORT}.md"), markdown(cells, selected, meta))
    plots.sweep_curves(rows, list(config.arms), os.path.join(workdir, f"{REPORT}_curves.png"))
  log(markdown(report.get("arms", []), report.get("selected"), meta))
  return report
