"""The study's outputs: PNG plots and the markdown report, from the `study.json` dict.

Plots (`plot_all`):
- `quality_vs_mismatch.png`: quality drop d against the check's mismatch/kl (log axis), one
  marker per source, calibration filled and held-out hollow; the isotonic fit, the budget
  max_kl with its bootstrap interval, each source's own crossing of τ (dotted, in the source's
  colour) and the tolerance τ;
- `training_curves.png`: held-out accuracy against step for the reference seeds and the
  worst run of each source;
- `check_vs_training.png`: the check's mismatch/kl against each run's training-time mean;
- the sensitivity bar chart is written by the scan itself (`sensitivity.png`).
"""

from __future__ import annotations

import math
import os
from typing import Any

KL_FLOOR = 1e-8  # exact engines read ~1e-9 (f32 rounding); drawn at this floor on log axes
MARKERS = "osD^v<>pXhP"


def _plt():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def _x(kl: float) -> float:
  return max(kl, KL_FLOOR)


def plot_quality(result: dict, path: str) -> str:
  """Quality drop against the check's mismatch/kl with the fit and the budget. A held-out
  setting is drawn at the drop it was judged by (`label_drop`: the mean of its runs when it was
  borderline)."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(7.5, 4.6))
  sources = sorted({r["source"] for r in result["rows"]})
  for i, source in enumerate(sources):
    for role, fill in (("reference", True), ("calibration", True), ("held_out", False)):
      rs = [r for r in result["rows"] if r["source"] == source and r["role"] == role]
      if not rs:
        continue
      ax.scatter(
        [_x(r["mismatch/kl"]) for r in rs],
        [100 * r.get("label_drop", r["quality_drop"]) for r in rs],
        marker=MARKERS[i % len(MARKERS)],
        facecolors=f"C{i}" if fill else "none",
        edgecolors=f"C{i}",
        label=f"{source}{' (held out)' if not fill else ''}",
        s=36,
      )
  b = result["budget"]
  ax.plot(
    [_x(x) for x in b["curve_kl"]],
    [100 * d for d in b["curve_drop"]],
    "k-",
    lw=1,
    label="isotonic fit",
  )
  for i, source in enumerate(sources):
    own = b.get("sources", {}).get(source)
    if own and own["censored"] == "none":
      ax.axvline(_x(own["max_kl"]), color=f"C{i}", ls=":", lw=1.2, label=f"{source} limit")
  ax.axhline(100 * result["tolerance"], color="gray", ls=":", lw=1, label="tolerance τ")
  if b["max_kl"] > 0:
    ax.axvline(_x(b["max_kl"]), color="r", ls="--", lw=1, label=f"budget {b['max_kl']:.3g}")
  low, high = b["interval"]
  if high > 0:
    ax.axvspan(_x(low), _x(high), color="r", alpha=0.1, label="95% interval")
  ax.set_xscale("log")
  ax.set_xlabel("mismatch/kl measured by the admission check (nats/token)")
  ax.set_ylabel(
    "quality drop (KL to the teacher, nats/token × 100)"
    if result.get("label") == "teacher_kl"
    else "quality drop (accuracy points)"
  )
  ax.set_title(f"OPD quality against mismatch ({result['run_steps']} steps per run)", fontsize=10)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _worst_per_source(rows: list[dict]) -> list[dict]:
  worst: dict[str, dict] = {}
  for r in rows:
    if r["role"] == "reference":
      continue
    if r["source"] not in worst or r["quality_drop"] > worst[r["source"]]["quality_drop"]:
      worst[r["source"]] = r
  return list(worst.values())


def plot_curves(result: dict, path: str) -> str:
  """Held-out accuracy against step: the reference seeds and each source's worst run."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(7, 4.2))
  shown = [r for r in result["rows"] if r["role"] == "reference"] + _worst_per_source(
    result["rows"]
  )
  for r in shown:
    curve = result["curves"].get(r["name"], [])
    if curve:
      ref = r["role"] == "reference"
      ax.plot(
        [c[0] for c in curve],
        [100 * c[1] for c in curve],
        color="k" if ref else None,
        alpha=0.5 if ref else 1.0,
        lw=1,
        marker=".",
        label=r["name"],
      )
  ax.axhline(100 * result["teacher_accuracy"], color="gray", ls=":", lw=1, label="teacher")
  ax.set_xlabel("OPD step")
  ax.set_ylabel("held-out accuracy (%)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_agreement(result: dict, path: str) -> str:
  """The check's mismatch/kl against the run's training-time mean, log-log, with y = x."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(5, 4.4))
  rs = [r for r in result["rows"] if r["role"] != "reference" and "train/mismatch/kl_mean" in r]
  for i, source in enumerate(sorted({r["source"] for r in rs})):
    pts = [r for r in rs if r["source"] == source]
    ax.scatter(
      [_x(r["mismatch/kl"]) for r in pts],
      [_x(r["train/mismatch/kl_mean"]) for r in pts],
      marker=MARKERS[i % len(MARKERS)],
      label=source,
      s=30,
    )
  if rs:
    values = [_x(r["mismatch/kl"]) for r in rs] + [_x(r["train/mismatch/kl_mean"]) for r in rs]
    lo, hi = min(values), max(values)
    ax.plot([lo, hi], [lo, hi], "k:", lw=1, label="y = x")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("admission check, before training")
  ax.set_ylabel("training-time mean")
  ax.set_title("mismatch/kl (nats/token)", fontsize=10)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_all(result: dict, workdir: str) -> list[str]:
  """Writes every plot into `workdir`; returns their paths (empty without matplotlib)."""
  try:
    _plt()
  except ImportError:
    return []
  paths = [
    plot_quality(result, os.path.join(workdir, "quality_vs_mismatch.png")),
    plot_curves(result, os.path.join(workdir, "training_curves.png")),
    plot_agreement(result, os.path.join(workdir, "check_vs_training.png")),
  ]
  sens = result.get("sensitivity") or {}
  if sens.get("png"):
    paths.append(sens["png"])
  return paths


def _pct(x: float) -> str:
  return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def _g(x: Any) -> str:
  return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.3g}"


def _drop_value(x: float, r: dict) -> str:
  """A drop as the row's label reads: accuracy points, or nats/token of KL(student ‖ teacher)
  for the teacher_kl label."""
  return _g(x) if r.get("label") == "teacher_kl" else _pct(x)


def rows_table(rows: list[dict]) -> list[str]:
  unit = "KL nats" if rows and rows[0].get("label") == "teacher_kl" else "pts"
  lines = [
    f"| setting | role | source | check mismatch/kl | training mean | accuracy % | drop {unit} |"
    " drop over runs | limit (set by) | verdict | pooled verdict | kept |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    runs = r.get("accuracy_runs", [r["accuracy"]])
    over = f"{_drop_value(r.get('label_drop', r['quality_drop']), r)} ({len(runs)})"
    lines.append(
      f"| {r['name']} | {r['role']} | {r['source']} | {_g(r['mismatch/kl'])} | "
      f"{_g(r.get('train/mismatch/kl_mean'))} | {_pct(r['accuracy'])} | "
      f"{_drop_value(r['quality_drop'], r)} | {over} | "
      f"{_g(r.get('limit'))} ({r.get('limit_source') or 'overall'}) | "
      f"{'admit' if r['admitted'] else 'refuse'}{' (too close)' if r.get('too_close') else ''} | "
      f"{'admit' if r.get('admitted_pooled', r['admitted']) else 'refuse'} | "
      f"{'yes' if r['kept_quality'] else 'no'} |"
    )
  return lines


def _drop(r: dict) -> str:
  """A row's drop as judged: over its runs when it has several ("mean of n")."""
  n = len(r.get("accuracy_runs", [r["accuracy"]]))
  drop = _drop_value(r.get("label_drop", r["quality_drop"]), r)
  return drop if n == 1 else f"{drop} (mean of {n})"


def _counts(c: dict) -> str:
  """A confusion table's four counts as one phrase."""
  return (
    f"admitted & kept {c['admitted_kept']}, admitted & degraded {c['admitted_degraded']}, "
    f"refused & kept {c['refused_kept']}, refused & degraded {c['refused_degraded']}"
  )


RULE_TEXT = {
  "per_part": "per-part limits",
  "whole": "the whole combination against per-source limits",
  "sum_of_fractions": "the parts' fractions of their limits summed",
  "pooled": "the pooled budget",
}


def configured_rule(result: dict) -> str:
  """The study's configured admission rule (`budget.RULE_NAMES`): the result's "rule", or for a
  result written before rules were recorded, "per_part", "whole" (per-source limits on the
  whole combination) or "pooled" from its flags."""
  if result.get("rule"):
    return result["rule"]["name"]
  if result.get("per_part"):
    return "per_part"
  return "whole" if result.get("per_source") else "pooled"


def findings(result: dict) -> list[str]:
  """One sentence per finding, each with its numbers."""
  floor, b, conf = result["noise_floor"], result["budget"], result["confusion"]
  if result.get("label") == "teacher_kl":  # q = −KL(student ‖ teacher): drops in nats/token
    reference = [
      f"Reference: {floor['n']} seeds end at a held-out KL(student ‖ teacher) of "
      f"{_g(-floor['mean'])} nats/token (sd {_g(floor['sd'])}; resolution "
      f"{_g(floor['se'])}; teacher accuracy {_pct(result['teacher_accuracy'])} %, warm start "
      f"{_pct(result['student_accuracy_before'])} %).",
      f"Tolerance τ = {_g(result['tolerance'])} nats/token of KL to the teacher "
      f"({result['tolerance_rule']}).",
    ]
  else:
    reference = [
      f"Reference: {floor['n']} seeds reach {_pct(floor['mean'])} % held-out accuracy (sd "
      f"{_pct(floor['sd'])} points; binomial SE of one run {_pct(floor['se'])} points; teacher "
      f"{_pct(result['teacher_accuracy'])} %, warm start "
      f"{_pct(result['student_accuracy_before'])} %).",
      f"Tolerance τ = {_pct(result['tolerance'])} accuracy points ({result['tolerance_rule']}).",
    ]
  out = [
    *reference,
    f"Budget: max_kl = {_g(b['max_kl'])} nats/token, 95 % bootstrap interval "
    f"[{_g(b['interval'][0])}, {_g(b['interval'][1])}], censored: {b['censored']}.",
  ]
  if b.get("sources"):
    out.append(
      "Per-source limits L_s (own crossing of τ, or the larger of the source's largest kept "
      "mismatch and the pooled max_kl when its records never cross τ"
      + (
        f", or the pooled max_kl when fewer than {c} of its records are over τ (unconfirmed)"
        if (c := result.get("min_crossing_records", 1)) > 1
        else ""
      )
      + "): "
      + ", ".join(
        f"{name} {_g(t['limit'])} ({'own fit' if t['censored'] == 'none' else t['censored']}"
        f", interval [{_g(t['interval'][0])}, {_g(t['interval'][1])}])"
        for name, t in b["sources"].items()
      )
      + "."
    )
  by_source: dict[str, list[dict]] = {}
  for r in result["rows"]:
    if r["role"] == "calibration":
      by_source.setdefault(r["source"], []).append(r)
  for source, rs in sorted(by_source.items()):
    rs = sorted(rs, key=lambda r: r["mismatch/kl"])
    kept = [r for r in rs if r["kept_quality"]]
    lost = [r for r in rs if not r["kept_quality"]]
    text = ", ".join(f"{r['name']} kl {_g(r['mismatch/kl'])} drop {_drop(r)}" for r in rs)
    verdict = (
      "no setting degraded quality"
      if not lost
      else f"quality degraded from kl {_g(lost[0]['mismatch/kl'])} on"
      if kept
      else "every setting degraded quality"
    )
    out.append(f"{source}: {verdict} ({text}).")
  rule = RULE_TEXT[configured_rule(result)]
  out.append(
    f"Admission check ({rule}) on {conf['n']} held-out settings: agreement "
    f"{_pct(conf['agreement'])} % ({_counts(conf)})."
  )
  pooled = result.get("rule_variants", {}).get("pooled")
  if pooled and configured_rule(result) != "pooled":
    out.append(
      f"The pooled budget alone on the same settings: agreement {_pct(pooled['agreement'])} % "
      f"({_counts(pooled)})."
    )
  called = result.get("confusion_called")
  if called:
    out.append(
      f"Too close to call (the measured KL inside the band of its limit, between the two ends "
      f"of the bootstrap intervals): {conf['n'] - called['n']} of {conf['n']} held-out "
      f"settings. On the {called['n']} the check calls, agreement "
      f"{_pct(called['agreement'])} % ({_counts(called)})."
    )
  single = result.get("confusion_single_run")
  rerun = [r for r in result["rows"] if len(r.get("accuracy_runs", [])) > 1]
  if single and result.get("borderline_seeds"):
    every = result.get("rerun_all_roles") or []
    which = (
      "had a single-run drop within one seed-sd of τ"
      + (f" or a role re-run in full ({', '.join(every)})" if every else "")
      + ", and were"
    )
    out.append(
      f"{len(rerun)} settings {which} "
      f"trained again with seeds {result['borderline_seeds']} (a held-out one labelled by the "
      "mean, a calibration one giving one record per run): "
      + (
        ", ".join(
          f"{r['name']} {_drop_value(r['quality_drop'], r)} -> {_drop_value(r['label_drop'], r)}"
          for r in rerun
        )
        or "none"
      )
      + f". Judged by single runs, held-out agreement would be {_pct(single['agreement'])} %."
    )
  a = result["check_vs_training"]
  out.append(
    f"Check against training-time mismatch ({a['n']} runs): Spearman {_g(a['spearman'])}, "
    f"check/training ratio median {_g(a['ratio_median'])} (range {_g(a['ratio_min'])}–"
    f"{_g(a['ratio_max'])}). The budget's x-axis is the check's value, because it is what a "
    "user can measure before training; the training-time mean is logged beside it."
  )
  t = b.get("training")
  if t:
    out.append(
      f"The same fit on the training-time axis (what the live guard compares a run's "
      f"per-step mismatch/kl with): max_kl = {_g(t['max_kl'])} [{_g(t['interval'][0])}, "
      f"{_g(t['interval'][1])}], censored: {t['censored']}; per source "
      + (", ".join(f"{name} {_g(v)}" for name, v in t["limits"].items()) or "none")
      + "."
    )
  return out


def confusion_table(conf: dict) -> list[str]:
  return [
    "| | kept quality | degraded |",
    "|---|---|---|",
    f"| admitted | {conf['admitted_kept']} | {conf['admitted_degraded']} |",
    f"| refused | {conf['refused_kept']} | {conf['refused_degraded']} |",
  ]


def rules_table(result: dict) -> list[str]:
  """Every admission rule's agreement on the held-out settings (`study.rule_variants`)."""
  variants = result.get("rule_variants")
  if not variants:
    return []
  configured = configured_rule(result)
  lines = [
    f"Every admission rule on the same held-out settings (the configured rule, {configured}, "
    "is the one fixed before they ran; the others are for comparison only):",
    "",
    "| rule | agreement | admitted & kept | admitted & degraded | refused & kept | "
    "refused & degraded |",
    "|---|---|---|---|---|---|",
  ]
  for name, c in variants.items():
    lines.append(
      f"| {name} | {_pct(c['agreement'])} % | {c['admitted_kept']} | {c['admitted_degraded']} | "
      f"{c['refused_kept']} | {c['refused_degraded']} |"
    )
  return lines + [""]


def markdown(result: dict) -> str:
  """The report: findings, the confusion table, every run, the plots."""
  lines = [
    "# Mismatch study",
    "",
    f"{result.get('num_runs', len(result['rows']))} OPD runs ({len(result['rows'])} settings) "
    f"of {result['run_steps']} steps, quality = held-out "
    + (
      "KL(student ‖ teacher) per token (drops in nats: the pair solves too little for accuracy)"
      if result.get("label") == "teacher_kl"
      else "accuracy"
    )
    + f" on {result['num_eval']} prompts; the check measured each setting on "
    f"{result['num_prompts']} calibration prompts at the probe's student (step "
    f"{result['probe']['steps']}). Training took {result['train_seconds'] / 60:.1f} min of "
    f"run wall time, the whole study {result['seconds'] / 60:.1f} min in this invocation.",
    "",
    "## Findings",
    "",
    *[f"- {f}" for f in findings(result)],
    "",
    "## Admission check on held-out settings",
    "",
    *confusion_table(result["confusion"]),
    "",
    *(
      ["The pooled budget alone:", "", *confusion_table(result["rule_variants"]["pooled"]), ""]
      if configured_rule(result) != "pooled" and "pooled" in result.get("rule_variants", {})
      else []
    ),
    *rules_table(result),
    "## Every run",
    "",
    *rows_table(result["rows"]),
    "",
  ]
  sens = result.get("sensitivity")
  if sens and sens.get("recipe"):
    rec = sens["recipe"]
    lines += [
      "## Layer sensitivity (at the probe's student)",
      "",
      f"Suggested FP8 recipe: keep layers {rec['bf16_layers']} in BF16; mismatch/kl "
      f"{_g(rec['mismatch/kl'])}; KV capacity {_g(rec['capacity_ratio'])}× BF16.",
      "",
    ]
  lines += ["## Plots", ""] + [f"- `{os.path.basename(p)}`" for p in result.get("plots", [])]
  return "\n".join(lines) + "\n"
