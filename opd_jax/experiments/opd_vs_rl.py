"""OPD against RL under the same rollout mismatch: the logic of `python -m opd_jax.opd_vs_rl`.

The study behind this project claims that on-policy distillation stays stable under rollout
configurations (FP8, staleness, weight noise) that destabilise RL. This comparison trains, for
the reference engine and each mismatch setting, the methods of `config.methods` (arms) from the
same teacher, warm start and prompts (`configs/opd_vs_rl.py`):

    opd              the run config unchanged (the bf16_sync recipe, reverse_kl_full)
    opd_sampled      the sampled-token estimator with bf16_sync_sampled.py's recipe, ratio 1
    opd_sampled_tis  the same with the truncated ratio min(π_θ/π_b, C)
    rl               REINFORCE on the task reward (`opd_jax.train.rl`), importance ratio 1
    rl_is            REINFORCE with the truncated ratio min(π_θ/π_b, C)
    grpo             GRPO (`rl.grpo`): groups of `group_size` completions per prompt (as many
                     completions per step as the run), two PPO updates per batch, no correction
    grpo_tis, grpo_mis, grpo_seq_tis, grpo_seq_mis
                     GRPO with that correction of π_old/π_b at threshold C (`rl.mismatch_weights`)

C is `config.is_clip` for every arm. The GRPO arms train at `config.grpo_lr` (GRPO_LR when the
config has no such key) and the RL arms at `config.rl_lr`. A config with a `grpo_run`
(`configs/opd_vs_rl_learns.py`) gives the GRPO arms a base run of their own instead: its
recipe is kept whole and only the correction is added (`grpo_correction`), and it must share
the OPD run's teacher, warm start, prompts and length (`check_shared`).

and tabulates, per run: the final held-out accuracy, its drop against the same method's
reference run (in points), the training-time mean `mismatch/kl` (so that settings sit on one
mismatch scale), the final held-out accuracy at T = 1 when the run evaluates it
(`train.eval_sampled`), and `perf/grad_norm` statistics (mean, max, std over the logged steps,
pre-clip). Each run is `experiments.runs.run_once` into <workdir>/runs/<method>__<setting>
(`__seed<k>` appended for train.seed k ≠ 0), so a restarted comparison reuses what finished.
With several `seeds`, each (setting, method) cell is also summarised over its seeds
(`opd_vs_rl_report.summarise`: the mean and sd of the accuracy, the drop with Welch's
interval, the share of its gain kept, grad-norm spikes), and `config.blocks` gives some arms
more seeds than others. The drops at equal training mismatch (`opd_vs_rl_report.matched`) are
read off `config.matched_settings` at `config.matched_kl`. The report
(`opd_vs_rl_report.write_report`: markdown, JSON with every number, opd_vs_rl.png of accuracy
and drop against mismatch/kl, opd_vs_rl_curves.png of the reference runs' learning curves) is
rewritten after every finished run, so a comparison stopped early still reports what it has.
With `workers` > 1 the runs train that many side by side first (`runs.run_many`, the same
numbers), and the report is written once they have, or, when one fails, over the ones that
finished before the error is raised.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection
from typing import Any

import ml_collections
import numpy as np

from opd_jax.experiments import opd_vs_rl_report, runs, study_provenance, study_setting
from opd_jax.experiments.opd_vs_rl_arms import (
  GROUP_SIZE,
  GRPO_LR,
  check_shared,
  grpo_correction,
  grpo_recipe,
  method_overrides,
)
from opd_jax.experiments.opd_vs_rl_report import METHODS, REFERENCE, REPORT_NAME
from opd_jax.io import metrics_writer, provenance
from opd_jax.mismatch import candidates as candidates_lib


def setting_name(spec: str) -> str:
  """A directory name for a setting spec: "rollout.weights=fp8,rollout.kv_cache=fp8" ->
  "weights-fp8_kv_cache-fp8"; the empty spec is the reference."""
  return study_setting.setting_name(spec) if spec else REFERENCE


def grad_norm_stats(run_dir: str) -> dict[str, Any]:
  """Mean, max and std (population) of `perf/grad_norm` over the logged steps of a run, the
  number of steps they cover and the values themselves (for `spike_count`), and the mean and
  max of `loss/total` over the same steps."""
  logged = [r for _, r in sorted(metrics_writer.read_jsonl(run_dir).items())]  # in step order
  values = np.asarray([r["perf/grad_norm"] for r in logged if "perf/grad_norm" in r])
  losses = np.asarray([r["loss/total"] for r in logged if "loss/total" in r])
  out = {
    "loss_mean": float(losses.mean()) if losses.size else math.nan,
    "loss_max": float(losses.max()) if losses.size else math.nan,
  }
  if not values.size:
    return dict(out, grad_norm_mean=math.nan, grad_norm_max=math.nan, grad_norm_std=math.nan)
  return dict(
    out,
    grad_norm_mean=float(values.mean()),
    grad_norm_max=float(values.max()),
    grad_norm_std=float(values.std()),
    grad_norm_logged_steps=int(values.size),
    grad_norms=[float(v) for v in values],
  )


T1_KEY = "quality/student_accuracy_t1"  # the held-out accuracy of one T = 1 sample per prompt
GREEDY_KEY = "quality/student_accuracy"  # the held-out greedy accuracy


def first_logged(run_dir: str, key: str) -> float:
  """The first logged value of `key` (nan when never logged)."""
  rows = metrics_writer.read_jsonl(run_dir)
  values = [r[key] for _, r in sorted(rows.items()) if key in r]
  return float(values[0]) if values else math.nan


def last_logged(run_dir: str, key: str, window: int = 10) -> float:
  """Mean of `key` over its last `window` logged values (nan when never logged)."""
  rows = metrics_writer.read_jsonl(run_dir)
  values = [r[key] for _, r in sorted(rows.items()) if key in r]
  return float(np.mean(values[-window:])) if values else math.nan


def run_row(
  method: str, setting: str, spec: str, run_dir: str, result: dict, seed: int = 0
) -> dict[str, Any]:
  """One table row from a finished run's result and its metrics.jsonl.

  The warm start's accuracies (`accuracy_before`, `accuracy_t1_before`) are the first ones the
  run logged, at step 0: a resumed run's result holds the accuracy at its resumption as
  `student_accuracy_before`, which is not the warm start (the result's value stands in only when
  the log has none).
  """
  greedy_before = first_logged(run_dir, GREEDY_KEY)
  if not math.isfinite(greedy_before):
    greedy_before = result["student_accuracy_before"]
  row = {
    "method": method,
    "setting": setting,
    "spec": spec,
    "seed": seed,
    "run_dir": run_dir,
    "accuracy_before": greedy_before,
    "accuracy": result["student_accuracy_after"],
    "student_teacher_kl": result["student_teacher_kl_after"],
    "teacher_accuracy": result["teacher_accuracy"],
    "mismatch_kl_mean": result.get("train/mismatch/kl_mean", math.nan),
    "mismatch_kl_max": result.get("train/mismatch/kl_max", math.nan),
    "curve": result.get("curve", []),
    "accuracy_t1_before": first_logged(run_dir, T1_KEY),
    "accuracy_t1": last_logged(run_dir, T1_KEY, window=1),
    "train_reward_last": last_logged(run_dir, "rl/reward_mean"),
    "wall_seconds": result.get("wall_seconds", math.nan),
    provenance.KEY: result.get(provenance.KEY),  # the code that trained it
  }
  row.update(grad_norm_stats(run_dir))
  return row


def run_name(method: str, setting: str, seed: int) -> str:
  """<method>__<setting>, with __seed<k> for train.seed k ≠ 0 (seed 0 keeps the plain name)."""
  return f"{method}__{setting}" + (f"__seed{seed}" if seed else "")


def blocks(config: ml_collections.ConfigDict) -> list[tuple[tuple, tuple, list[int]]]:
  """(methods, settings, seeds) of every block: `config.blocks` when it has some (each a dict
  with those three keys, so that the headline arms get more seeds than the rest), else the
  one block of `config.methods`, `config.settings` and `config.seeds`.

  Raises:
    ValueError: a block without methods, with an unknown key, or with no or repeated seeds.
  """
  raw = list(config.get("blocks", None) or [])
  if not raw:
    raw = [
      {"methods": config.methods, "settings": config.settings, "seeds": config.get("seeds", (0,))}
    ]
  out = []
  for i, block in enumerate(raw):
    block = dict(block)
    unknown = set(block) - {"methods", "settings", "seeds"}
    if unknown:
      raise ValueError(f"config.blocks[{i}] has unknown keys {sorted(unknown)}")
    methods = tuple(block.get("methods", ()))
    if not methods:
      raise ValueError("config.methods is empty; give some of: " + ", ".join(METHODS))
    seeds = [int(x) for x in block.get("seeds", (0,))]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
      raise ValueError(
        f"config.seeds must be distinct train seeds >= 0, at least one (a negative train.seed "
        f"means config.seed, a copy of seed 0); got {seeds}"
      )
    out.append((methods, tuple(block.get("settings", ())), seeds))
  return out


def base_runs(config: ml_collections.ConfigDict) -> tuple:
  """(OPD base run, GRPO base run or None): `config.run` and `config.grpo_run` when the config
  has one (checked by `check_shared`)."""
  grpo_run = config.get("grpo_run", None)
  if grpo_run is not None:
    check_shared(config.run, grpo_run)
  return config.run, grpo_run


def arm_config(
  config: ml_collections.ConfigDict, method: str, rollout_overrides: dict, seed: int
) -> ml_collections.ConfigDict:
  """The run config of `method` under a setting's rollout overrides and train seed `seed`:
  the GRPO base run plus the correction for a GRPO arm when the config has a `grpo_run`, else
  the OPD run plus `method_overrides`. A base run's own seed is left as the config states it
  (train.seed = -1 means `seed`), so that its runs keep their recorded configs; other seeds
  set train.seed."""
  base, grpo_run = base_runs(config)
  if grpo_run is not None and method.startswith("grpo"):
    base, arm = grpo_run, grpo_correction(method, config.is_clip)
  else:
    arm = method_overrides(
      method,
      config.rl_lr,
      config.is_clip,
      batch_size=base.data.batch_size * base.rollout.samples_per_prompt,
      group_size=config.get("group_size", GROUP_SIZE),
      grpo_lr=config.get("grpo_lr", GRPO_LR),
      grpo_temperature=config.get("grpo_temperature", 1.0),
      grpo_kl_coef=config.get("grpo_kl_coef", 0.0),
    )
  own_seed = base.train.seed if base.train.seed >= 0 else base.seed
  overrides = dict(rollout_overrides, **arm, **({} if seed == own_seed else {"train.seed": seed}))
  return runs.with_overrides(base, overrides)


def plan_blocks(
  config: ml_collections.ConfigDict,
) -> list[tuple[int, tuple[str, str, str, int, ml_collections.ConfigDict]]]:
  """(block index, `plan` entry) for every run, each under the first block that plans it."""
  base = config.run
  base_runs(config)  # refuses a GRPO base that shares too little, before any arm is built
  out, seen = [], set()
  for b, (methods, specs, seeds) in enumerate(blocks(config)):
    settings = [("", {})]
    for spec in specs:
      settings.append((spec, candidates_lib.parse_candidate(spec, base).overrides))
    names = [setting_name(x) for x, _ in settings]
    if len(set(names)) != len(names):
      raise ValueError(f"config.settings has repeated settings: {names}")
    for seed in seeds:
      for (spec, rollout_overrides), name in zip(settings, names, strict=True):
        for method in methods:
          run_config = arm_config(config, method, rollout_overrides, seed)
          if (method, name, seed) in seen:
            continue
          seen.add((method, name, seed))
          out.append((b, (method, name, spec, seed, run_config)))
  return out


def plan(
  config: ml_collections.ConfigDict,
) -> list[tuple[str, str, str, int, ml_collections.ConfigDict]]:
  """(method, setting name, spec, seed, run config) for every run of every block (`blocks`),
  block by block; in a block, seeds outermost, then settings (the reference first), so that a
  comparison stopped early has whole settings of its first seeds. A run two blocks share is
  planned once. Each run config is `arm_config`'s.

  Raises:
    ValueError: a bad setting spec (named by `candidates_lib.parse_candidate`), an unknown
      method, two settings with the same name, no or repeated seeds, or a `grpo_run` that
      `check_shared` refuses.
  """
  return [entry for _, entry in plan_blocks(config)]


def resolved(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.ConfigDict:
  """A copy of `config` with its teacher cache filled in as `run_comparison` trains it: an empty
  `run.teacher.cache_dir` is <workdir>/teacher_cache, an empty `grpo_run.teacher.cache_dir` the
  run's (so the runs a plan compares against the workdir are the ones it holds)."""
  config = ml_collections.ConfigDict(config.to_dict())
  if not config.run.teacher.cache_dir:
    # absolute: the cache path is part of each run's config, so spelling the workdir another
    # way in a later sitting must not make its finished runs another configuration's
    config.run.teacher.cache_dir = os.path.join(os.path.abspath(workdir), "teacher_cache")
  if config.get("grpo_run", None) is not None and not config.grpo_run.teacher.cache_dir:
    config.grpo_run.teacher.cache_dir = config.run.teacher.cache_dir
  return config


def run_comparison(
  config: ml_collections.ConfigDict,
  workdir: str,
  log: Callable = print,
  only: Collection[str] | None = None,
) -> dict[str, Any]:
  """Trains every (setting, method) run once and writes the report after each (with
  `config.workers` > 1, after all of them have trained, that many side by side).

  When `run.teacher.cache_dir` is empty, every run shares <workdir>/teacher_cache (one teacher
  bootstrap and one warm start for the whole comparison; `resolved`). With `only` (run names,
  `run_name`), trains only those runs (a part of the plan, `opd_vs_rl_plan.part_names`) and
  reports them beside every other planned run that has finished. The report records the code
  of the comparison and of every run (`study_provenance.code_summary`); with
  `config.allow_mixed_code` false, finished runs made by other code than the code running now
  are refused before anything trains (`study_provenance.check_code`), and so are finished runs
  that started from different teachers or warm starts (`study_provenance.check_same_start`,
  checked again as each run finishes, before it joins the report).

  Returns:
    The report dict written to <workdir>/opd_vs_rl.json.
  """
  config = resolved(config, workdir)
  planned = plan(config)
  names = [run_name(m, s, seed) for m, s, _, seed, _ in planned]
  if only is not None:
    unknown = sorted(set(only) - set(names))
    if unknown:
      raise ValueError(f"runs not in the plan: {', '.join(unknown[:8])}")
  os.makedirs(workdir, exist_ok=True)
  todo, run_dirs = [], []
  for entry, name in zip(planned, names, strict=True):
    run_dir = os.path.join(workdir, "runs", name)
    if only is None or name in only or runs.read_result(run_dir) is not None:
      todo.append(entry)
      run_dirs.append(run_dir)
  workers = runs.check_workers(config.get("workers", 1))
  if not todo:
    log("nothing to train or report: the part names no run and none has finished")
    return {}
  current = provenance.provenance(config)
  allow = bool(config.get("allow_mixed_code", False))
  finished = {f"run {os.path.basename(d)}": runs.read_result(d) for d in run_dirs}
  study_provenance.check_code(
    {k: r.get(provenance.KEY) for k, r in finished.items() if r is not None}, current, allow, log
  )
  study_provenance.check_same_start(finished)
  failed = None  # a side-by-side run's error: raised after the report of the finished ones
  if workers > 1 and any(runs.read_result(d) is None for d in run_dirs):
    # train side by side first; the loop below reads each recorded result
    runs.fill_teacher_cache(todo[0][4], workdir, log)
    try:
      runs.run_many([(t[4], d) for t, d in zip(todo, run_dirs, strict=True)], workers, log)
    except Exception as e:  # noqa: BLE001 - re-raised below, once the report is written
      failed = e
  recipe = grpo_recipe(config)
  meta = {
    provenance.KEY: current,
    "steps": config.run.train.steps,
    "eval_size": config.run.data.eval_size,
    "opd_lr": config.run.train.lr,
    "rl_lr": config.rl_lr,
    **recipe,
    "is_clip": config.is_clip,
    "teacher_cache_dir": config.run.teacher.cache_dir,
    "seeds": sorted({seed for _, _, _, seed, _ in planned}),
    "planned": names,
    "matched_settings": [setting_name(x) for x in config.get("matched_settings", ())],
    "matched_kl": [float(k) for k in config.get("matched_kl", ())],
    "summary": (
      f"{config.run.train.steps} steps per run, {config.run.data.eval_size} held-out prompts; "
      f"opd lr {config.run.train.lr}, rl lr {config.rl_lr}, grpo "
      + (f"recipe {recipe['grpo_recipe']}: " if recipe.get("grpo_recipe") else "")
      + f"lr {recipe['grpo_lr']} (groups of "
      f"{recipe['group_size']}, {recipe['grpo_completions']} completions per step), "
      f"C={config.is_clip} for every corrected arm. "
      "drop = the method's reference accuracy minus this run's (points); mismatch/kl is the "
      "mean over the logged training steps; grad-norm is pre-clip, over the logged steps."
    ),
  }
  rows: list[dict] = []
  report: dict[str, Any] = {}
  for i, ((method, name, spec, seed, run_config), run_dir) in enumerate(
    zip(todo, run_dirs, strict=True)
  ):
    if failed is not None and runs.read_result(run_dir) is None:
      continue  # not trained: reported as missing by its absence
    log(f"[{i + 1}/{len(todo)}] {method} on {name}, seed {seed} -> {run_dir}")
    result = runs.run_once(run_config, run_dir, log)
    finished[f"run {os.path.basename(run_dir)}"] = result
    study_provenance.check_same_start(finished)  # before the run joins the report
    rows.append(run_row(method, name, spec, run_dir, result, seed))
    meta["finished"] = len(rows)
    parts = {f"run {os.path.basename(r['run_dir'])}": r[provenance.KEY] for r in rows}
    meta["code"] = study_provenance.code_summary(parts, current, allow)
    report = opd_vs_rl_report.write_report(rows, workdir, meta, log)
    r = rows[-1]
    log(
      f"  {method} on {name}: accuracy {r['accuracy']:.3f} (drop {r['drop_points']:+.1f} pts, "
      f"T = 1 {r['accuracy_t1']:.3f}), "
      f"mismatch/kl {r['mismatch_kl_mean']:.2e}, grad-norm mean {r['grad_norm_mean']:.3g} "
      f"max {r['grad_norm_max']:.3g}"
    )
  if failed is not None:
    raise failed
  cells = report["cells"]
  log(
    opd_vs_rl_report.summary_table(cells)
    if any(len(c["seeds"]) > 1 for c in cells)
    else report["table_markdown"]
  )
  log(f"wrote {os.path.join(workdir, REPORT_NAME)}.{{md,json,png}}")
  return report
