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
pre-clip). Each run is `mismatch.runs.run_once` into <workdir>/runs/<method>__<setting>
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

from opd_jax.experiments import opd_vs_rl_report, runs, study
from opd_jax.experiments.opd_vs_rl_report import METHODS, REFERENCE, REPORT_NAME
from opd_jax.io import metrics_writer, provenance
from opd_jax.mismatch import candidates as candidates_lib

# configs/bf16_sync_sampled.py's recipe over bf16_sync.py (tests/experiments/test_opd_vs_rl.py
# holds the two files to it); the arms keep the run's batch so that every arm samples as many
# completions.
SAMPLED_OPD = {
  "train.loss": "reverse_kl_sampled",
  "train.lr": 5e-4,
  "train.advantage_clip": 0.5,
  "train.advantage_baseline": "batch_mean",
  "rollout.temperature": 1.0,
}
GRPO_LR = 1e-5  # GRPO's peak lr when the config has no grpo_lr (configs/grpo_sync.py's)
GROUP_SIZE = 4  # GRPO's completions per prompt when the config has no group_size


def method_overrides(
  method: str,
  rl_lr: float,
  is_clip: float,
  *,
  batch_size: int = 32,
  group_size: int = GROUP_SIZE,
  grpo_lr: float = GRPO_LR,
  grpo_temperature: float = 1.0,
  grpo_kl_coef: float = 0.0,
) -> dict[str, Any]:
  """The config overrides that turn the OPD run into `method` (the module docstring's arms).

  `batch_size` is the run's completions per step (`data.batch_size`); a GRPO arm samples
  batch_size / group_size prompts `group_size` times each, so it samples as many, at
  `grpo_temperature` T (the trainer scores π_θ at the same T: softmax(z / T)), with the KL
  penalty β = `grpo_kl_coef` to the initial student (0: none).

  Raises:
    ValueError: an unknown method, a non-positive is_clip for an arm that corrects (for a
      GRPO correction, C must be > 1), or a group size that does not divide the batch.
  """
  corrected = method in ("rl_is", "opd_sampled_tis") or (
    method.startswith("grpo_") and method in METHODS
  )
  if corrected and not is_clip > (1 if method.startswith("grpo") else 0):
    raise ValueError(f"method {method} needs is_clip > 0 (> 1 for grpo), got {is_clip!r}")
  if method.startswith("grpo") and not 0 < grpo_temperature <= 1:
    raise ValueError(f"grpo_temperature must be in (0, 1], got {grpo_temperature!r}")
  if method.startswith("grpo") and not grpo_kl_coef >= 0:
    raise ValueError(f"grpo_kl_coef must be >= 0, got {grpo_kl_coef!r}")
  if method == "opd":
    return {}
  if method in ("opd_sampled", "opd_sampled_tis"):
    return dict(SAMPLED_OPD, **{"train.is_clip": float(is_clip) if corrected else 0.0})
  if method == "rl":
    return {"train.loss": "reinforce", "train.lr": rl_lr, "train.is_clip": 0.0}
  if method == "rl_is":
    return {"train.loss": "reinforce", "train.lr": rl_lr, "train.is_clip": float(is_clip)}
  if method in METHODS and method.startswith("grpo"):
    if group_size < 2 or batch_size % group_size:
      raise ValueError(
        f"GRPO groups of {group_size} must be >= 2 and divide the run's {batch_size} "
        "completions per step"
      )
    return {
      "train.loss": "grpo",
      "train.lr": grpo_lr,
      "data.batch_size": batch_size // group_size,
      "rollout.samples_per_prompt": group_size,
      "rollout.temperature": float(grpo_temperature),
      "train.ppo_epochs": 1,
      "train.ppo_minibatches": 2,
      "train.mismatch_correction": method.removeprefix("grpo_") if corrected else "none",
      "train.mismatch_clip": float(is_clip) if corrected else 2.0,
      "train.kl_coef": float(grpo_kl_coef),
    }
  raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


# The keys the OPD and GRPO base runs must agree on (`check_shared`): the teacher, the student
# and its warm start, the task and its prompts, the model seed and the run length.
SHARED_PREFIXES = ("teacher.", "student.", "data.")
SHARED_KEYS = ("seed", "train.steps", "train.eval_every")
NOT_SHARED = ("data.batch_size", "teacher.cache_dir")  # GRPO's prompts per step; where it is kept


def grpo_correction(method: str, is_clip: float) -> dict[str, Any]:
  """The overrides that add `method`'s engine correction to a GRPO base run: none for "grpo",
  else train.mismatch_correction = the method's suffix at threshold C = `is_clip`.

  Raises:
    ValueError: a method that is not a GRPO arm, or C <= 1 for a correction.
  """
  if not (method.startswith("grpo") and method in METHODS):
    raise ValueError(f"{method!r} is not a GRPO arm; known: {', '.join(METHODS)}")
  if method == "grpo":
    return {"train.mismatch_correction": "none"}
  if not is_clip > 1:
    raise ValueError(f"method {method} needs is_clip > 1, got {is_clip!r}")
  return {
    "train.mismatch_correction": method.removeprefix("grpo_"),
    "train.mismatch_clip": float(is_clip),
  }


def check_shared(run: ml_collections.ConfigDict, grpo_run: ml_collections.ConfigDict) -> None:
  """Refuses a GRPO base run that does not share the OPD run's teacher, warm start, prompts
  and length (SHARED_PREFIXES and SHARED_KEYS, less NOT_SHARED), or that is not GRPO.

  Raises:
    ValueError: naming the keys that differ (at most eight), or grpo_run's train.loss.
  """
  if grpo_run.train.loss != "grpo":
    raise ValueError(f"config.grpo_run.train.loss is {grpo_run.train.loss!r}, not 'grpo'")
  a, b = runs.config_repr(run), runs.config_repr(grpo_run)
  keys = sorted(
    k
    for k in set(a) | set(b)
    if (k.startswith(SHARED_PREFIXES) or k in SHARED_KEYS) and k not in NOT_SHARED
  )
  differ = [k for k in keys if a.get(k) != b.get(k)]
  if differ:
    raise ValueError(
      "config.grpo_run must share the OPD run's teacher, warm start, prompts and length; "
      "differs in: " + ", ".join(f"{k} ({a.get(k)} vs {b.get(k)})" for k in differ[:8])
    )


def setting_name(spec: str) -> str:
  """A directory name for a setting spec: "rollout.weights=fp8,rollout.kv_cache=fp8" ->
  "weights-fp8_kv_cache-fp8"; the empty spec is the reference."""
  return study.setting_name(spec) if spec else REFERENCE


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
  """One table row from a finished run's result and its metrics.jsonl."""
  row = {
    "method": method,
    "setting": setting,
    "spec": spec,
    "seed": seed,
    "run_dir": run_dir,
    "accuracy_before": result["student_accuracy_before"],
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
    if not seeds or len(set(seeds)) != len(seeds):
      raise ValueError(f"config.seeds must be distinct train seeds, at least one; got {seeds}")
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


def grpo_recipe(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The GRPO arms' lr, group size, temperature, KL coefficient and completions per step: read
  off `config.grpo_run` when the config has one, else the config's keys (their defaults)."""
  grpo_run = config.get("grpo_run", None)
  if grpo_run is not None:
    return {
      "grpo_recipe": config.get("grpo_recipe", ""),
      "grpo_lr": grpo_run.train.lr,
      "group_size": grpo_run.rollout.samples_per_prompt,
      "grpo_temperature": grpo_run.rollout.temperature,
      "grpo_kl_coef": grpo_run.train.kl_coef,
      "grpo_completions": grpo_run.data.batch_size * grpo_run.rollout.samples_per_prompt,
    }
  return {
    "grpo_lr": config.get("grpo_lr", GRPO_LR),
    "group_size": config.get("group_size", GROUP_SIZE),
    "grpo_temperature": config.get("grpo_temperature", 1.0),
    "grpo_kl_coef": config.get("grpo_kl_coef", 0.0),
    "grpo_completions": config.run.data.batch_size * config.run.rollout.samples_per_prompt,
  }


def run_comparison(
  config: ml_collections.ConfigDict,
  workdir: str,
  log: Callable = print,
  only: Collection[str] | None = None,
) -> dict[str, Any]:
  """Trains every (setting, method) run once and writes the report after each (with
  `config.workers` > 1, after all of them have trained, that many side by side).

  When `run.teacher.cache_dir` is empty, every run shares <workdir>/teacher_cache (one teacher
  bootstrap and one warm start for the whole comparison); an empty `grpo_run.teacher.cache_dir`
  is the run's. With `only` (run names, `run_name`), trains only those runs (a part of the
  plan, `opd_vs_rl_plan.part_names`) and reports them beside every other planned run that
  has finished.

  Returns:
    The report dict written to <workdir>/opd_vs_rl.json.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  if not config.run.teacher.cache_dir:
    config.run.teacher.cache_dir = os.path.join(workdir, "teacher_cache")
  if config.get("grpo_run", None) is not None and not config.grpo_run.teacher.cache_dir:
    config.grpo_run.teacher.cache_dir = config.run.teacher.cache_dir
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
    "provenance": provenance.provenance(config),
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
      f"{recipe.get('grpo_recipe') or ''} lr {recipe['grpo_lr']} (groups of "
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
    rows.append(run_row(method, name, spec, run_dir, result, seed))
    meta["finished"] = len(rows)
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
