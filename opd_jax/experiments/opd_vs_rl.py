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
config has no such key) and the RL arms at `config.rl_lr`.

and tabulates, per run: the final held-out accuracy, its drop against the same method's
reference run (in points), the training-time mean `mismatch/kl` (so that settings sit on one
mismatch scale), and `perf/grad_norm` statistics (mean, max, std over the logged steps,
pre-clip). Each run is `mismatch.runs.run_once` into <workdir>/runs/<method>__<setting>
(`__seed<k>` appended for train.seed k ≠ 0), so a restarted comparison reuses what finished.
With several `seeds`, each (setting, method) cell is also summarised over its seeds (`summarise`:
the mean and sd of the accuracy, the drop with Welch's interval, the share of its gain kept,
grad-norm spikes), and `config.blocks` gives some arms more seeds than others. The drops at equal
training mismatch (`matched`) are read off `config.matched_settings` at `config.matched_kl`. The
report (markdown, JSON with every number, opd_vs_rl.png of accuracy and drop against
mismatch/kl, opd_vs_rl_curves.png of the reference runs' learning curves) is rewritten after
every finished run, so a comparison stopped early still reports what it has. With `workers` > 1
the runs train that many side by side first (`runs.run_many`, the same numbers), and the report
is written once they have, or, when one fails, over the ones that finished before the error is
raised.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import numpy as np

from opd_jax.experiments import runs, study
from opd_jax.io import metrics_writer
from opd_jax.mismatch import candidates as candidates_lib

REFERENCE = "reference"
METHODS = (
  "opd",
  "opd_sampled",
  "opd_sampled_tis",
  "rl",
  "rl_is",
  "grpo",
  "grpo_tis",
  "grpo_mis",
  "grpo_seq_tis",
  "grpo_seq_mis",
)
# configs/bf16_sync_sampled.py's recipe over bf16_sync.py (tests/test_opd_vs_rl.py holds the two
# files to it); the arms keep the run's batch so that every arm samples as many completions.
SAMPLED_OPD = {
  "train.loss": "reverse_kl_sampled",
  "train.lr": 5e-4,
  "train.advantage_clip": 0.5,
  "train.advantage_baseline": "batch_mean",
  "rollout.temperature": 1.0,
}
GRPO_LR = 1e-5  # GRPO's peak lr when the config has no grpo_lr (configs/grpo_sync.py's)
GROUP_SIZE = 4  # GRPO's completions per prompt when the config has no group_size
REPORT_NAME = "opd_vs_rl"  # <workdir>/opd_vs_rl.{md,json,png}
F32_ROUNDING_KL = (
  1e-7  # mismatch/kl below this is f32 rounding (the reference engine): plotted at 0
)


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
    "train_reward_last": last_logged(run_dir, "rl/reward_mean"),
    "wall_seconds": result.get("wall_seconds", math.nan),
  }
  row.update(grad_norm_stats(run_dir))
  return row


def reference_runs(rows: Sequence[dict]) -> dict[str, list[dict]]:
  """method -> its finished reference runs (one per seed)."""
  by_method: dict[str, list[dict]] = {}
  for r in rows:
    if r["setting"] == REFERENCE:
      by_method.setdefault(r["method"], []).append(r)
  return by_method


def reference_accuracy(rows: Sequence[dict]) -> dict[str, float]:
  """method -> mean accuracy of its finished reference runs (over seeds)."""
  return {
    m: float(np.mean([r["accuracy"] for r in mine])) for m, mine in reference_runs(rows).items()
  }


def add_drops(rows: Sequence[dict]) -> None:
  """Sets each row's `drop` (points): its method's reference accuracy (the mean over the
  reference's seeds) minus its accuracy; nan while that reference has no finished run."""
  ref = reference_accuracy(rows)
  for r in rows:
    r["drop_points"] = (
      100.0 * (ref[r["method"]] - r["accuracy"]) if r["method"] in ref else math.nan
    )


SPIKE_FACTOR = 3.0  # a logged grad-norm above this times its method's reference median spikes
LEVEL = 0.95  # of every interval in the summary


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = LEVEL):
  """Welch's interval for mean(a) − mean(b): d ± t_{ν, (1+level)/2} · √(s_a²/n_a + s_b²/n_b),
  ν by Welch–Satterthwaite; (nan, nan) unless both sides have two values or more."""
  from scipy import stats

  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.size < 2 or b.size < 2:
    return math.nan, math.nan
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  d, se = a.mean() - b.mean(), math.sqrt(va + vb)
  if se == 0:
    return float(d), float(d)
  nu = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
  half = float(stats.t.ppf((1 + level) / 2, nu)) * se
  return float(d - half), float(d + half)


def gain_kept(
  ref: Sequence[float], cell: Sequence[float], warm: float, level=LEVEL, n_boot=2000, seed=0
):
  """The share of its own gain a method keeps: (mean(cell) − w) / (mean(ref) − w), w the warm
  start's accuracy, with a percentile bootstrap interval over seeds (each side resampled).
  nan when the reference gained less than a point: there is no gain to keep."""
  ref, cell = np.asarray(ref, np.float64), np.asarray(cell, np.float64)
  if not ref.size or not cell.size or ref.mean() - warm < 0.01:
    return math.nan, (math.nan, math.nan)
  point = float((cell.mean() - warm) / (ref.mean() - warm))
  if ref.size < 2 or cell.size < 2:
    return point, (math.nan, math.nan)
  rng = np.random.default_rng(seed)
  r = rng.choice(ref, (n_boot, ref.size)).mean(1)
  c = rng.choice(cell, (n_boot, cell.size)).mean(1)
  ok = r - warm >= 0.01
  ratio = (c[ok] - warm) / (r[ok] - warm)
  lo, hi = np.quantile(ratio, [(1 - level) / 2, (1 + level) / 2])
  return point, (float(lo), float(hi))


def spike_count(values: Sequence[float], reference_median: float) -> int:
  """Logged steps whose grad-norm exceeds SPIKE_FACTOR × the method's reference median."""
  if not math.isfinite(reference_median):
    return 0
  return int(np.sum(np.asarray(values, np.float64) > SPIKE_FACTOR * reference_median))


def summarise(rows: Sequence[dict]) -> list[dict[str, Any]]:
  """One entry per (setting, method) cell over its seeds, in the rows' order:

      accuracy = mean_s q_s,  accuracy_sd = sample sd of q_s (nan for one seed),
      drop_points = 100·(mean of the method's reference − accuracy), with Welch's interval
        (`welch_interval`, reference seeds against the cell's),
      gain_kept = (accuracy − w) / (reference − w), w the warm start, with its bootstrap
        interval (`gain_kept`),
      grad_norm_spikes = logged steps over SPIKE_FACTOR × the method's reference median
        grad-norm, summed over seeds, out of grad_norm_logged_steps,

  and the seed means of the training-time mismatch/kl, the grad-norm and loss statistics.
  """
  cells: dict[tuple[str, str], list[dict]] = {}
  for r in rows:
    cells.setdefault((r["setting"], r["method"]), []).append(r)
  references = reference_runs(rows)
  out = []
  for (setting, method), mine in cells.items():
    q = np.asarray([r["accuracy"] for r in mine], np.float64)
    warm = float(np.mean([r["accuracy_before"] for r in mine]))
    ref = [r["accuracy"] for r in references.get(method, [])]
    lo, hi = welch_interval(ref, q) if setting != REFERENCE else (math.nan, math.nan)
    kept, kept_ci = gain_kept(ref, q, warm) if setting != REFERENCE else (1.0, (1.0, 1.0))
    norms = [v for r in references.get(method, []) for v in r.get("grad_norms", [])]
    median = float(np.median(norms)) if norms else math.nan
    entry = {
      "setting": setting,
      "method": method,
      "seeds": [r.get("seed", 0) for r in mine],
      "accuracy": float(q.mean()),
      "accuracy_sd": float(q.std(ddof=1)) if q.size > 1 else math.nan,
      "warm_start": warm,
      "drop_points": 100.0 * (float(np.mean(ref)) - float(q.mean())) if ref else math.nan,
      "drop_ci_points": [100.0 * lo, 100.0 * hi],
      "gain_kept": kept,
      "gain_kept_ci": list(kept_ci),
      "grad_norm_spikes": sum(spike_count(r.get("grad_norms", []), median) for r in mine),
      "grad_norm_logged_steps": sum(r.get("grad_norm_logged_steps", 0) for r in mine),
    }
    for key in (
      "mismatch_kl_mean",
      "grad_norm_mean",
      "grad_norm_max",
      "loss_mean",
      "loss_max",
      "train_reward_last",
    ):
      entry[key] = float(np.mean([r.get(key, math.nan) for r in mine]))
    entry["mismatch_kl_sd"] = float(np.std([r["mismatch_kl_mean"] for r in mine], ddof=0))
    out.append(entry)
  return out


def matched(
  cells: Sequence[dict], family: Sequence[str], kl_values: Sequence[float]
) -> list[dict[str, Any]]:
  """Each method's drop at equal training-time mismatch: for each κ in `kl_values`, the drop
  (points) and the share of gain kept, interpolated linearly in mismatch/kl between the
  method's cells of `family` (setting names; the reference sits at mismatch/kl 0), nan
  where κ lies beyond the method's largest such mismatch (no extrapolation)."""
  out = []
  for method in dict.fromkeys(c["method"] for c in cells):
    mine = [
      c
      for c in cells
      if c["method"] == method and (c["setting"] in family or c["setting"] == REFERENCE)
    ]
    pts = sorted((0.0 if c["setting"] == REFERENCE else c["mismatch_kl_mean"], c) for c in mine)
    if len(pts) < 2:
      continue
    x = np.asarray([p for p, _ in pts])
    ys = {
      key: np.asarray([c[key] for _, c in pts], np.float64) for key in ("drop_points", "gain_kept")
    }
    for kappa in kl_values:
      entry = {"method": method, "kl": float(kappa)}
      for key, y in ys.items():
        entry[key] = float(np.interp(kappa, x, y)) if kappa <= x.max() else math.nan
      out.append(entry)
  return out


def matched_table(entries: Sequence[dict]) -> str:
  """`matched` as a markdown table: one row per method, one column pair per κ."""
  kls = sorted({e["kl"] for e in entries})
  head = "| method | " + " | ".join(f"drop at KL {k:g} / share kept" for k in kls) + " |\n"
  head += "|---|" + "---:|" * len(kls) + "\n"
  lines = []
  for method in dict.fromkeys(e["method"] for e in entries):
    by_kl = {e["kl"]: e for e in entries if e["method"] == method}
    lines.append(
      f"| {method} | "
      + " | ".join(
        f"{_fmt(by_kl[k]['drop_points'], '+.1f')} / {_fmt(by_kl[k]['gain_kept'], '.2f')}"
        if k in by_kl
        else "—"
        for k in kls
      )
      + " |"
    )
  return head + "\n".join(lines) + "\n"


def summary_table(cells: Sequence[dict]) -> str:
  """The per-cell summary over seeds as a markdown table."""
  head = (
    "| setting | method | seeds | accuracy (mean ± sd) | drop vs own ref (pts) [95 %] | "
    "share of gain kept [95 %] | train mismatch/kl | grad-norm mean / max | spikes | "
    "loss max |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
  )
  lines = [
    f"| {c['setting']} | {c['method']} | {len(c['seeds'])} | "
    f"{_fmt(100 * c['accuracy'], '.1f')} ± {_fmt(100 * c['accuracy_sd'], '.1f')} % | "
    f"{_fmt(c['drop_points'], '+.1f')} {_interval(c.get('drop_ci_points'), '.1f')} | "
    f"{_fmt(c.get('gain_kept', math.nan), '.2f')} {_interval(c.get('gain_kept_ci'), '.2f')} | "
    f"{_fmt(c['mismatch_kl_mean'], '.2e')} | "
    f"{_fmt(c['grad_norm_mean'], '.3g')} / {_fmt(c['grad_norm_max'], '.3g')} | "
    f"{c.get('grad_norm_spikes', 0)}/{c.get('grad_norm_logged_steps', 0)} | "
    f"{_fmt(c.get('loss_max', math.nan), '.3g')} |"
    for c in cells
  ]
  return head + "\n".join(lines) + "\n"


def _interval(ci, spec: str) -> str:
  if not ci or any(x is None or math.isnan(x) for x in ci):
    return ""
  return f"[{format(ci[0], spec)}, {format(ci[1], spec)}]"


def _fmt(x: float, spec: str) -> str:
  return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(rows: Sequence[dict]) -> str:
  """The comparison as a markdown table, one line per (setting, method)."""
  head = (
    "| setting | method | seed | accuracy | drop vs own ref (pts) | train mismatch/kl | "
    "grad-norm mean | grad-norm max | grad-norm std | last reward |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
  )
  lines = [
    f"| {r['setting']} | {r['method']} | {r.get('seed', 0)} | "
    f"{_fmt(100 * r['accuracy'], '.1f')} % | "
    f"{_fmt(r['drop_points'], '+.1f')} | {_fmt(r['mismatch_kl_mean'], '.2e')} | "
    f"{_fmt(r['grad_norm_mean'], '.3g')} | {_fmt(r['grad_norm_max'], '.3g')} | "
    f"{_fmt(r['grad_norm_std'], '.3g')} | {_fmt(r['train_reward_last'], '.3f')} |"
    for r in rows
  ]
  return head + "\n".join(lines) + "\n"


def plot(
  rows: Sequence[dict], path: str, ladder: Sequence[str] = (), cells: Sequence[dict] | None = None
) -> bool:
  """Final accuracy and drop against training-time mismatch/kl, one series per method.

  With `ladder` (setting names, e.g. a noise ladder) each method's line joins its reference
  and ladder cells, and every other setting is a hollow marker labelled with its name, so
  that no line crosses from one source to another; without it the line joins all cells in
  order of mismatch. The x axis is symlog so the reference sits at the left edge: a
  mismatch/kl below `F32_ROUNDING_KL` (an engine identical to the trainer reads ±1e-9) is
  drawn at 0. `cells` is `summarise(rows)` when the caller has it already (else computed).
  Returns False, writing nothing, when matplotlib is not installed.
  """
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False

  def kl(r):
    return r["mismatch_kl_mean"] if r["mismatch_kl_mean"] > F32_ROUNDING_KL else 0.0

  def on_line(r):
    return not ladder or r["setting"] == REFERENCE or r["setting"] in ladder

  if cells is None:
    cells = summarise(rows)  # one point per (setting, method): the mean over seeds, ± sd
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
  positive = [kl(r) for r in cells if kl(r) > 0]
  linthresh = min(positive) / 2 if positive else 1e-4
  labelled: set[str] = set()
  for method, marker in zip(METHODS, "osDv^<>ph*", strict=True):
    mine = sorted((r for r in cells if r["method"] == method), key=kl)
    if not mine:
      continue
    for ax, key, scale in ((axes[0], "accuracy", 100.0), (axes[1], "drop_points", 1.0)):
      line = [r for r in mine if on_line(r)]
      sd = [0.0 if math.isnan(r["accuracy_sd"]) else 100 * r["accuracy_sd"] for r in line]
      drawn = ax.errorbar(
        [kl(r) for r in line],
        [scale * r[key] for r in line],
        yerr=sd,
        marker=marker,
        capsize=3,
        label=method,
      )
      for r in mine:
        if not on_line(r):
          ax.errorbar(
            kl(r),
            scale * r[key],
            yerr=0.0 if math.isnan(r["accuracy_sd"]) else 100 * r["accuracy_sd"],
            marker=marker,
            mfc="none",
            capsize=3,
            color=drawn.lines[0].get_color(),
          )
          if ax is axes[0] and r["setting"] not in labelled:
            labelled.add(r["setting"])  # each hollow setting named once, at its first arm
            ax.annotate(r["setting"], (kl(r), scale * r[key]), fontsize=6)
  for ax, ylabel in zip(
    axes, ("final held-out accuracy (%)", "drop vs own reference (points)"), strict=True
  ):
    ax.set_xscale("symlog", linthresh=linthresh)
    ax.set_xlabel("training-time mean mismatch/kl (nats/token)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  title = "OPD vs RL under rollout mismatch"
  if ladder:
    title += f": lines join the reference and {', '.join(ladder)}; hollow markers are the rest"
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def plot_curves(rows: Sequence[dict], path: str) -> bool:
  """Held-out accuracy against training step at the reference engine, one line per method
  (the mean over its seeds, the band ± one sd), the warm start dashed: the learning curves
  the comparison's drops are taken against. Returns False, writing nothing, without
  matplotlib or without a reference run that logged a curve."""
  curves: dict[str, list] = {}
  for r in rows:
    if r["setting"] == REFERENCE and r.get("curve"):
      curves.setdefault(r["method"], []).append(r)
  if not curves:
    return False
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for method in [m for m in METHODS if m in curves]:
    mine = curves[method]
    steps = sorted({int(p[0]) for r in mine for p in r["curve"]})
    acc = np.asarray(
      [[dict((int(p[0]), p[1]) for p in r["curve"]).get(t, math.nan) for t in steps] for r in mine]
    )
    mean, sd = 100 * np.nanmean(acc, 0), 100 * np.nanstd(acc, 0)
    wall = np.mean([r["wall_seconds"] for r in mine])
    ax.plot(steps, mean, marker="o", label=f"{method} ({len(mine)} seeds, {wall:.0f} s/run)")
    ax.fill_between(steps, mean - sd, mean + sd, alpha=0.2)
  warm = 100 * float(np.mean([r["accuracy_before"] for rs in curves.values() for r in rs]))
  ax.axhline(warm, ls="--", c="gray", label=f"warm start {warm:.1f} %")
  ax.set_xlabel("training step")
  ax.set_ylabel("held-out greedy accuracy (%)")
  ax.set_title("Learning curves at the reference engine")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def write_report(rows: list[dict], workdir: str, meta: dict, log=print) -> dict:
  """Writes <workdir>/opd_vs_rl.{md,json,png} from the finished rows; returns the JSON dict."""
  add_drops(rows)
  table = markdown_table(rows)
  cells = summarise(rows)
  text = f"# OPD vs RL under rollout mismatch\n\n{meta.get('summary', '')}\n\n"
  if any(len(c["seeds"]) > 1 for c in cells):
    text += f"## Over seeds\n\n{summary_table(cells)}\n"
  at_equal_kl = matched(cells, meta.get("matched_settings", ()), meta.get("matched_kl", ()))
  if at_equal_kl:
    text += (
      "## At equal training mismatch\n\nDrop (points) and share of gain kept, interpolated "
      f"in mismatch/kl over {', '.join(meta['matched_settings'])} and the reference (an arm "
      "trained on some of them only, over those it has).\n\n"
      f"{matched_table(at_equal_kl)}\n"
    )
  if text.count("\n## "):
    text += "## Every run\n\n"
  base = os.path.join(workdir, REPORT_NAME)
  with open(base + ".md", "w", encoding="utf-8") as f:
    f.write(text + table)
  report = dict(meta, rows=rows, cells=cells, matched=at_equal_kl, table_markdown=table)
  tmp = base + ".json.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  os.replace(tmp, base + ".json")
  if not plot(rows, base + ".png", meta.get("matched_settings", ()), cells):
    log("matplotlib is not installed: no PNG written")
  plot_curves(rows, base + "_curves.png")
  return report


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


def plan(
  config: ml_collections.ConfigDict,
) -> list[tuple[str, str, str, int, ml_collections.ConfigDict]]:
  """(method, setting name, spec, seed, run config) for every run of every block (`blocks`),
  block by block; in a block, seeds outermost, then settings (the reference first), so that a
  comparison stopped early has whole settings of its first seeds. A run two blocks share is
  planned once.

  Raises:
    ValueError: a bad setting spec (named by `candidates_lib.parse_candidate`), an unknown
      method, two settings with the same name, or no or repeated seeds.
  """
  base = config.run
  # The run's own seed is left as the config states it (train.seed = -1 means `seed`), so that
  # its runs keep their recorded configs; other seeds set train.seed.
  own_seed = base.train.seed if base.train.seed >= 0 else base.seed
  out, seen = [], set()
  for methods, specs, seeds in blocks(config):
    settings = [("", {})]
    for spec in specs:
      settings.append((spec, candidates_lib.parse_candidate(spec, base).overrides))
    names = [setting_name(x) for x, _ in settings]
    if len(set(names)) != len(names):
      raise ValueError(f"config.settings has repeated settings: {names}")
    for seed in seeds:
      for (spec, rollout_overrides), name in zip(settings, names, strict=True):
        for method in methods:
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
          if (method, name, seed) in seen:
            continue
          seen.add((method, name, seed))
          overrides = dict(
            rollout_overrides,
            **arm,
            **({} if seed == own_seed else {"train.seed": seed}),
          )
          out.append((method, name, spec, seed, runs.with_overrides(base, overrides)))
  return out


def run_comparison(
  config: ml_collections.ConfigDict, workdir: str, log: Callable = print
) -> dict[str, Any]:
  """Trains every (setting, method) run once and writes the report after each (with
  `config.workers` > 1, after all of them have trained, that many side by side).

  When `run.teacher.cache_dir` is empty, every run shares <workdir>/teacher_cache (one teacher
  bootstrap and one warm start for the whole comparison).

  Returns:
    The report dict written to <workdir>/opd_vs_rl.json.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  if not config.run.teacher.cache_dir:
    config.run.teacher.cache_dir = os.path.join(workdir, "teacher_cache")
  todo = plan(config)
  os.makedirs(workdir, exist_ok=True)
  run_dirs = [os.path.join(workdir, "runs", run_name(m, s, seed)) for m, s, _, seed, _ in todo]
  workers = runs.check_workers(config.get("workers", 1))
  failed = None  # a side-by-side run's error: raised after the report of the finished ones
  if workers > 1 and any(runs.read_result(d) is None for d in run_dirs):
    # train side by side first; the loop below reads each recorded result
    runs.fill_teacher_cache(todo[0][4], workdir, log)
    try:
      runs.run_many([(t[4], d) for t, d in zip(todo, run_dirs, strict=True)], workers, log)
    except Exception as e:  # noqa: BLE001 - re-raised below, once the report is written
      failed = e
  meta = {
    "steps": config.run.train.steps,
    "eval_size": config.run.data.eval_size,
    "opd_lr": config.run.train.lr,
    "rl_lr": config.rl_lr,
    "grpo_lr": config.get("grpo_lr", GRPO_LR),
    "group_size": config.get("group_size", GROUP_SIZE),
    "grpo_temperature": config.get("grpo_temperature", 1.0),
    "grpo_kl_coef": config.get("grpo_kl_coef", 0.0),
    "is_clip": config.is_clip,
    "teacher_cache_dir": config.run.teacher.cache_dir,
    "seeds": sorted({seed for _, _, _, seed, _ in todo}),
    "planned": [run_name(m, s, seed) for m, s, _, seed, _ in todo],
    "matched_settings": [setting_name(x) for x in config.get("matched_settings", ())],
    "matched_kl": [float(k) for k in config.get("matched_kl", ())],
    "summary": (
      f"{config.run.train.steps} steps per run, {config.run.data.eval_size} held-out prompts; "
      f"opd lr {config.run.train.lr}, rl lr {config.rl_lr}, grpo lr "
      f"{config.get('grpo_lr', GRPO_LR)} (groups of {config.get('group_size', GROUP_SIZE)}), "
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
    report = write_report(rows, workdir, meta, log)
    r = rows[-1]
    log(
      f"  {method} on {name}: accuracy {r['accuracy']:.3f} (drop {r['drop_points']:+.1f} pts), "
      f"mismatch/kl {r['mismatch_kl_mean']:.2e}, grad-norm mean {r['grad_norm_mean']:.3g} "
      f"max {r['grad_norm_max']:.3g}"
    )
  if failed is not None:
    raise failed
  cells = report["cells"]
  log(summary_table(cells) if any(len(c["seeds"]) > 1 for c in cells) else report["table_markdown"])
  log(f"wrote {os.path.join(workdir, REPORT_NAME)}.{{md,json,png}}")
  return report
