"""The study's reports: study.json's budget block and the markdown of a study
(`markdown`, with its ladders: `ladders.markdown_lines`), of its pre-registered validation
(`validation_markdown`) and of several calibrated pairs side by side (`pairs_markdown`). The
plots are `plots.study_plots`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from opd_jax.experiments import format_lookup, ladders, scoring
from opd_jax.mismatch import budget_fit


def budget_summary(fitted, path: str) -> dict[str, Any]:
  """study.json's "budget": the fitted `budget.Budget`'s pooled and per-source limits with
  their intervals, censoring and isotonic curves, its training-axis fit (None without), and
  the file it was saved to."""
  return {
    "file": path,
    "max_kl": fitted.max_kl,
    "interval": list(fitted.interval),
    "censored": fitted.censored,
    "curve_kl": list(fitted.overall.curve_kl),
    "curve_drop": list(fitted.overall.curve_drop),
    "sources": {
      name: {
        "max_kl": t.max_kl,
        "interval": list(t.interval),
        "bracket": list(budget_fit.threshold_bracket(t, fitted.tolerance)),
        "censored": t.censored,
        "limit": fitted.source_limit(name),
        "curve_kl": list(t.curve_kl),
        "curve_drop": list(t.curve_drop),
      }
      for name, t in sorted(fitted.sources.items())
    },
    "training": None
    if fitted.training is None
    else {
      "max_kl": fitted.training.max_kl,
      "interval": list(fitted.training.interval),
      "censored": fitted.training.censored,
      "limits": {
        name: fitted.training.source_limit(name) for name in sorted(fitted.training.sources)
      },
    },
  }


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
        f", interval [{_g(t['interval'][0])}, {_g(t['interval'][1])}]"
        + (f", {ladders.bracket_text(t['bracket'])})" if "bracket" in t else ")")
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
  out += scoring.study_sentences(result.get("held_out_scores"))
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
  """Every admission rule's agreement on the held-out settings (`study_rules.rule_variants`)."""
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
    *(ladders.markdown_lines(result["ladders"]) if result.get("ladders") else []),
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


def _num(x) -> str:
  """A validation table's number: – for none, ∞, 3 significant digits, else as it is."""
  if x is None:
    return "–"
  if isinstance(x, float) and math.isinf(x):
    return "∞"
  return f"{x:.3g}" if isinstance(x, float) else str(x)


def _baseline_tables(v: Mapping) -> list[str]:
  """What the measure-nothing baselines of a scored validation were read off, in words."""
  out = []
  if "thresholds" in v:
    t = v["thresholds"]
    out.append(
      f"Measure-nothing thresholds: σ* = {_num(t['sigma'])}, k* = {_num(t['lag'])}, refused "
      f"formats: {', '.join(t['formats']) or 'none'}."
    )
  if "lookup" in v:
    refused = format_lookup.refusal_text(v["lookup"]) or "nothing"
    out.append(f"Format lookup table: refuses {refused}.")
  return out


def validation_markdown(report: Mapping) -> str:
  """The tables of a study's scored validation (`experiments.validation.report`)."""
  v = report["validation"]
  baselines = v.get("baselines", ["pooled", "admit_all", "measure_nothing"])  # before the field
  lines = [
    f"Held-out settings: {v['n']}, of which {v['degraded']} degraded "
    f"(label {v['label']}, τ = {_num(v['tolerance'])}).",
    *_baseline_tables(v),
    f"τ's 95 % interval over the reference seeds: [{_num(v['tolerance_interval'][0])}, "
    f"{_num(v['tolerance_interval'][1])}]; {v['labels_within_tolerance_interval']} held-out "
    "labels lie within it.",
    f"Accuracy label: τ = {_num(v['accuracy_tolerance'])}; the two labels agree on "
    f"{v['labels_agree']}/{v['n']} settings; Spearman(accuracy, −KL) over every run "
    f"{_num(v['spearman_accuracy_vs_minus_kl'])}.",
    "",
  ]
  for key, title in (("primary_label", "primary label"), ("accuracy_label", "accuracy label")):
    block = v[key]
    lines += [
      f"**{title}**",
      "",
      "| rule | agreement | 95 % Wilson | admitted kept | admitted degraded | refused kept "
      "| refused degraded |",
      "|---|---|---|---|---|---|---|",
    ]
    for name in (report["primary"], *baselines):
      s = block[name]
      lo, hi = s["interval"]
      lines.append(
        f"| {name} | {s['admitted_kept'] + s['refused_degraded']}/{s['n']} = "
        f"{s['agreement']:.1%} | [{lo:.1%}, {hi:.1%}] | {s['admitted_kept']} | "
        f"{s['admitted_degraded']} | {s['refused_kept']} | {s['refused_degraded']} |"
      )
    lines += [
      "",
      "| against | rule only right | other only right | McNemar p (one-sided) | Δ | Δ lower |",
      "|---|---|---|---|---|---|",
    ]
    for name, t in block["tests"].items():
      lines.append(
        f"| {name} | {t['rule_only_right']} | {t['other_only_right']} | "
        f"{t['mcnemar_p']:.3g} | {t['difference']:+.3f} | {t['difference_lower']:+.3f} |"
      )
    lines += [
      "",
      *scoring.markdown_lines(
        block.get("too_close"),
        block.get("outside_band"),
        report["primary"],
        v.get("too_close_reading", scoring.DEFAULT_READING),
      ),
      f"goal (≥ 90 %{''.join(f', beats {m}' for m in block.get('must_beat', ()))}) met: "
      f"{block['goal_met']}; beats "
      + ", ".join(f"{k}: {b}" for k, b in block["beats"].items())
      + f"; non-inferior to pooled: {block['noninferior']}",
      "",
    ]
  shown = [n for n in baselines if n != "admit_all"]
  lines += [
    "| setting | source | check KL | drop | kept | "
    + " | ".join([report["primary"], *shown])
    + " |",
    "|---" * (6 + len(shown)) + "|",
  ]
  for s in v["settings"]:
    lines.append(
      f"| `{s['spec']}` | {s['source']} | {_num(s['kl'])} | {_num(s['drop'])} | {s['kept']} | "
      + " | ".join(str(s[n]) for n in [report["primary"], *shown])
      + " |"
    )
  for axis, block in report["one_scale"].items():
    lines += [
      "",
      f"**one scale, axis {axis}**",
      "",
      "| source | offset δ_s | 95 % interval | LOSO knee | own knee | LOSO right |",
      "|---|---|---|---|---|---|",
    ]
    for s, loso in block["leave_one_source_out"].items():
      o = block["offsets"].get(s, {"offset": math.nan, "interval": [math.nan, math.nan]})
      lines.append(
        f"| {s} | {_num(o['offset'])} | [{_num(o['interval'][0])}, {_num(o['interval'][1])}] | "
        f"{_num(loso['predicted_knee'])} ({loso['predicted_censored']}) | "
        f"{_num(loso['own_knee'])} ({loso['own_censored']}) | {loso['right']}/{loso['settings']} |"
      )
  lines += [
    "",
    "| combination | KL | parts' KL | Σ parts | drop | parts' drops | kept | parts kept |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for f in report["factorial"]:
    parts = f["part_kl"]
    total = sum(x for x in parts.values() if x is not None)
    lines.append(
      f"| `{f['spec']}` | {_num(f['kl'])} | "
      + ", ".join(f"{s} {_num(x)}" for s, x in parts.items())
      + f" | {_num(total)} | {_num(f['drop'])} | "
      + ", ".join(f"{s} {_num(x)}" for s, x in f["part_drop"].items())
      + f" | {f['kept']} | "
      + ", ".join(f"{s} {x}" for s, x in f["parts_kept"].items())
      + " |"
    )
  return "\n".join(lines) + "\n"


def _limit(entry: dict) -> str:
  lo, hi = entry["interval"]
  flag = "" if entry["censored"] == "none" else f" ({entry['censored']})"
  return f"{_g(entry['max_kl'])} [{_g(lo)}, {_g(hi)}]{flag}"


def pairs_markdown(summaries: Sequence[dict], moves: Sequence[dict]) -> str:
  """Calibrated pairs side by side (`experiments.pairs`): the pairs table, the sensitivity
  table and the transfer table."""
  lines = [
    "| pair | teacher | student start → end (ref) | start KL | label | τ | pooled limit "
    "(nats/token) [95% interval] | relative limit | per-source limits |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for s in summaries:
    for label, e in s["labels"].items():
      tau = f"{100 * e['tolerance']:.1f} pts" if label == "accuracy" else _g(e["tolerance"])
      per_source = "; ".join(
        f"{k} {_g(v['limit'])}{'' if v['censored'] == 'none' else ' (' + v['censored'] + ')'}"
        + (f", {ladders.bracket_text(v['bracket'])}" if "bracket" in v else "")
        for k, v in e["sources"].items()
      )
      lines.append(
        f"| {s['pair']} | {100 * s['teacher_accuracy']:.1f}% | "
        f"{100 * s['student_accuracy_before']:.1f}% → {100 * s['student_accuracy_after']:.1f}% | "
        f"{_g(s['start_kl'])} | {label} | {tau} | {_limit(e)} | {_g(e['relative_max'])} | "
        f"{per_source} |"
      )
  lines += [
    "",
    "| pair | Spearman(accuracy, −KL) over runs | settings both labels call alike |",
    "|---|---|---|",
  ]
  for s in summaries:
    a = s["label_agreement"]
    lines.append(
      f"| {s['pair']} | {_g(a['spearman'])} ({a['runs']} runs) | {a['same_call']}/{a['settings']} |"
    )
  lines += [
    "",
    "| pair | FP8-weight layers, most sensitive first | FP8-KV layers | noise modules (top 3) | "
    "FP8 recipe: BF16 layers | its mismatch/kl | KV capacity vs BF16 |",
    "|---|---|---|---|---|---|---|",
  ]
  for s in summaries:
    if "ranking" not in s:
      continue
    rank, recipe = s["ranking"], s["recipe"]
    lines.append(
      f"| {s['pair']} | {', '.join(rank.get('fp8_weights', []))} | "
      f"{', '.join(rank.get('fp8_kv', []))} | {', '.join(rank.get('noise_modules', [])[:3])} | "
      f"{recipe['bf16_layers']} | {_g(recipe['mismatch/kl'])} | {recipe['capacity_ratio']:.2f}× |"
    )
  lines += [
    "",
    "| from → to | label | axis | limit | agreement on the target's settings | target's own "
    "limit (in sample) | admit-all |",
    "|---|---|---|---|---|---|---|",
  ]
  for m in moves:
    a, o = m["agreement"], m["own_agreement"]
    lines.append(
      f"| {m['from']} → {m['to']} | {m['label']} | {m['axis']} | {_g(m['limit'])} | "
      f"{a['right']}/{a['n']} | {_g(m['own_limit'])}: {o['right']}/{o['n']} | "
      f"{m['admit_all']['right']}/{m['admit_all']['n']} |"
    )
  return "\n".join(lines) + "\n"
