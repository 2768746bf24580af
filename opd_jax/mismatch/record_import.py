"""Calibration records from the logs other RL stacks already write: their mismatch metrics mapped
onto this project's names, with units, and one record per run for `budget_fit.fit_budget`.

Pure: every function takes the logs' text and returns records; no file is read here (the command
`python -m opd_jax.fit_budget` reads them). The record schema and the name-mapping table are in
docs/reference/records.md, generated from `PEER_METRICS` below (the metrics glossary's
"TRL / verl" column comes from the same table, so the two cannot disagree).

**The peers' divergences.** Every stack that samples with one engine (vLLM, SGLang) and trains
with another logs, per step, a statistic of Δ = log π_b(y) − log π_θ(y) over the sampled tokens
y ~ π_b (π_b the rollout engine, π_θ the trainer). With r = π_θ(y)/π_b(y) = e^{−Δ}:

  k1 = mean Δ                  (verl `rollout_corr/kl`, tinker `optim/kl_sample_train_v1`)
  k3 = mean (r − 1 − log r)    (verl `rollout_corr/k3_kl`, NeMo-RL `gen_kl_error` at its
                                default k3 estimator)
  m  = mean |Δ|                (slime `train_rollout_logprob_abs_diff`, TRL
                                `sampling/sampling_logp_difference/mean`)

k1 and k3 are both unbiased estimators of KL(π_b ‖ π_θ), the budget's axis (this project's
`mismatch/k1`, `mismatch/k3`); m is not a KL and becomes one only through a stated conversion
(`abs_diff_to_kl`).

**Runs.** A log is one JSON object per line: a step's metrics, flat
({"step": 3, "rollout_corr/k3_kl": 0.002, ...}, the console and JSONL loggers' shape) or under
"data" ({"step": 3, "data": {...}}, verl's file logger). A line's "run" names its run; lines
without one belong to a run named after their file (its name without folder and extension, or
its whole path without the extension when two files share that name, as `a/metrics.jsonl` and
`b/metrics.jsonl` do), so a file per run needs no "run" key.
Within a run, lines that share a "step" are merged (a later key wins) and the steps ordered; a
run where some line has no "step" keeps the file's order. A run's "source" (what was changed,
e.g. "fp8"; default "imported") is read from its lines; the reference runs (the unperturbed
setting every other run is compared with) are the runs named in `reference`, or whose source
or name is "reference".

**One record per run.** Each figure is the mean of its last T values (`tail`; a key is counted
over the steps that carry it, so a quality evaluated every 50 steps averages its last T
evaluations). quality_drop = mean reference quality − the run's quality (`higher_is_better`;
the other way round for a loss). The record's x, "mismatch/kl", is the chosen estimator's value:
the runs' training-time mean, so the fitted budget is on the training axis (docs/design.md,
"Two axes"); the check reads higher than training, so an admission check against it is strict.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from opd_jax.mismatch.budget import DROP_KEY, KL_KEY, REFERENCE_SOURCE, SOURCE_KEY

FORMATS = ("opd_jax", "verl", "slime", "trl", "nemo", "tinker")
PEER_NAMES = {
  "verl": "verl",
  "slime": "slime",
  "trl": "TRL",
  "nemo": "NeMo-RL",
  "tinker": "tinker-cookbook",
}
K1_KEY, K3_KEY, ABS_KEY = "mismatch/k1", "mismatch/k3", "mismatch/abs_logp_diff"
KL_KEYS = (KL_KEY, K3_KEY, K1_KEY)  # the estimators of KL(π_b ‖ π_θ) a record's x may be
ABS_DIFF_TO_KL = ("lower_bound", "gaussian")
DEFAULT_SOURCE = "imported"
DEFAULT_TAIL = 10
RUN_KEY, STEP_KEY, DATA_KEY = "run", "step", "data"


@dataclasses.dataclass(frozen=True)
class PeerMetric:
  """One peer metric and the project's name for it.

  Attributes:
    format: the stack (one of FORMATS).
    names: the peer's name, then the other spellings its loggers write (a "train/" prefix).
    metric: the record key it maps onto: a `mismatch/*` metric, or "peer/<name>" where this
      project has no equivalent (kept in the record, never a budget's x).
    unit: its unit.
    definition: what the peer computes, in the terms of the module docstring.
  """

  format: str
  names: tuple[str, ...]
  metric: str
  unit: str
  definition: str


PEER_METRICS = (
  PeerMetric(
    "verl",
    ("rollout_corr/kl",),
    K1_KEY,
    "nats/token",
    "token mean of log π_rollout(y) − log π_train(y): k1",
  ),
  PeerMetric(
    "verl",
    ("rollout_corr/k3_kl",),
    K3_KEY,
    "nats/token",
    "token mean of r − 1 − log r, r = π_train(y)/π_rollout(y): k3",
  ),
  PeerMetric(
    "verl",
    ("rollout_corr/chi2_token",),
    "peer/chi2_token",
    "ratio",
    "token mean of r² − 1: χ²(π_θ ‖ π_b), the other direction; no `mismatch/*` equivalent",
  ),
  PeerMetric(
    "slime",
    ("train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff"),
    ABS_KEY,
    "nats",
    "mean over samples of each sample's token mean of abs(Δ): m, not a KL",
  ),
  PeerMetric(
    "trl",
    ("sampling/sampling_logp_difference/mean", "train/sampling/sampling_logp_difference/mean"),
    ABS_KEY,
    "nats",
    "token mean of abs(Δ) (GRPO with vLLM importance-sampling correction): m, not a KL",
  ),
  PeerMetric(
    "trl",
    ("sampling/sampling_logp_difference/max", "train/sampling/sampling_logp_difference/max"),
    "mismatch/abs_logp_diff_max",
    "nats",
    "largest abs(Δ) in the batch",
  ),
  PeerMetric(
    "nemo",
    ("gen_kl_error", "train/gen_kl_error"),
    K3_KEY,
    "nats/token",
    "token mean of KL(P_gen ‖ P_train) by `loss_fn.reference_policy_kl_type` (default k3)",
  ),
  PeerMetric(
    "tinker",
    ("optim/kl_sample_train_v1",),
    K1_KEY,
    "nats/token",
    "token mean of log π_sampler(y) − log π_train(y): k1",
  ),
  PeerMetric(
    "tinker",
    ("optim/kl_sample_train_v2",),
    "peer/k2",
    "nats/token",
    "token mean of Δ²/2: k2, a biased second-order estimate; no `mismatch/*` equivalent",
  ),
)


def peer_column(metric: str) -> str:
  """The metrics glossary's "TRL / verl" cell of `metric`: every peer name mapped onto it."""
  names = [f"{PEER_NAMES[p.format]} `{p.names[0]}`" for p in PEER_METRICS if p.metric == metric]
  if metric == ABS_KEY:
    names = [n + (" (mean per sample)" if "slime" in n else "") for n in names]
  return "; ".join(names)


def lower_bound_kl(m: float) -> float:
  """KL(π_b ‖ π_θ) ≥ ψ(m) = m + e^{−m} − 1 for m = E|Δ| over tokens sampled from π_b.

  Why: Σ_y π_θ(y) ≤ 1 gives E_b[e^{−Δ}] ≤ 1, so KL = E_b[Δ] ≥ E_b[h(Δ)] with
  h(Δ) = Δ + e^{−Δ} − 1 (the k3 term). h(−a) − h(a) = e^a − e^{−a} − 2a ≥ 0 for a ≥ 0, so
  h(Δ) ≥ ψ(|Δ|), and ψ is convex, so Jensen's inequality gives E_b[ψ(|Δ|)] ≥ ψ(E_b|Δ|). The same
  holds for any weighted mean over tokens (slime's per-sample means), since the KL is then the
  same weighting of the per-token KLs. ψ(m) ≈ m²/2 for small m. Pinsker's inequality
  (KL ≥ 2 TV²) does not serve: E|Δ| bounds no total variation from below.
  """
  return m + math.expm1(-m)


def _folded_mean(sigma: float) -> float:
  """E|Δ| for Δ ~ N(σ²/2, σ²): σ√(2/π)·e^{−σ²/8} + (σ²/2)·(1 − 2Φ(−σ/2))."""
  mu = sigma * sigma / 2
  return sigma * math.sqrt(2 / math.pi) * math.exp(-sigma * sigma / 8) + mu * math.erf(
    sigma / (2 * math.sqrt(2))
  )


def gaussian_kl(m: float) -> float:
  """KL(π_b ‖ π_θ) = σ²/2 for a normal Δ with E|Δ| = m, solved exactly.

  The model: Δ ~ N(μ, σ²) over tokens sampled from π_b. Normalisation, E_b[e^{−Δ}] = 1, gives
  e^{−μ + σ²/2} = 1, so μ = σ²/2 and KL = E_b[Δ] = σ²/2. σ solves m = E|Δ| (`_folded_mean`, by
  bisection); to leading order m ≈ σ√(2/π), so KL ≈ (π/4)·m² ≈ 0.785·m², about 1.57 times
  `lower_bound_kl`. An estimate, not a bound: heavy-tailed Δ (a few tokens far off) has a larger
  KL at the same m.
  """
  if m == 0:
    return 0.0
  low, high = 0.0, max(4.0 * m, 1.0)
  while _folded_mean(high) < m:
    high *= 2
  for _ in range(200):
    mid = (low + high) / 2
    low, high = (mid, high) if _folded_mean(mid) < m else (low, mid)
  sigma = (low + high) / 2
  return sigma * sigma / 2


CONVERSIONS = {"lower_bound": lower_bound_kl, "gaussian": gaussian_kl}


def _number(value: Any, where: str, key: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{where}: {key} is {value!r}, not a number")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(
      f"{where}: {key} is {value} (a run whose figures are not finite cannot be fitted)"
    )
  return value


def parse_lines(name: str, text: str) -> list[tuple[int, dict]]:
  """The (line number, flattened object) of each non-empty line of file `name`; a "data"
  mapping is merged into its line. Raises ValueError naming the file and line."""
  out = []
  for number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{name} line {number}: not a JSON object ({e.msg})") from e
    if not isinstance(obj, Mapping):
      raise ValueError(f"{name} line {number}: a {type(obj).__name__}, not a JSON object")
    obj = dict(obj)
    data = obj.pop(DATA_KEY, None)
    if isinstance(data, Mapping):
      obj.update(data)
    out.append((number, obj))
  return out


def group_runs(files: Sequence[tuple[str, str]]) -> dict[str, list[tuple[str, dict]]]:
  """Run name -> its steps in order, each as (where, metrics) with where = "file line n"
  (module docstring: "run", "step", a file per run)."""
  runs: dict[str, list[tuple[str, int, dict]]] = {}

  def bare(name: str, keep_folder: bool) -> str:
    name = name if keep_folder else name.rsplit("/", 1)[-1]
    return name.removesuffix(".jsonl").removesuffix(".json")

  stems = collections.Counter(bare(name, False) for name, _ in files)
  for name, text in files:
    stem = bare(name, stems[bare(name, False)] > 1)  # two a/m.jsonl, b/m.jsonl: "a/m", "b/m"
    for number, obj in parse_lines(name, text):
      run = obj.get(RUN_KEY, stem)
      if not isinstance(run, str) or not run:
        raise ValueError(f"{name} line {number}: run is {run!r}, not a non-empty string")
      runs.setdefault(run, []).append((f"{name} line {number}", number, obj))
  out = {}
  for run, lines in runs.items():
    steps = [obj.get(STEP_KEY) for _, _, obj in lines]
    if all(isinstance(s, numbers.Real) and not isinstance(s, bool) for s in steps):
      merged: dict[float, tuple[str, dict]] = {}
      for where, _, obj in lines:
        previous = merged.get(obj[STEP_KEY], (where, {}))[1]
        merged[obj[STEP_KEY]] = (where, {**previous, **obj})
      out[run] = [merged[s] for s in sorted(merged)]
    else:
      out[run] = [(where, obj) for where, _, obj in lines]
  return out


def _peer_values(fmt: str, obj: Mapping) -> dict[str, tuple[str, Any]]:
  """The project key -> (the peer name found, its value) of one step's metrics."""
  if fmt == "opd_jax":
    return {k: (k, obj[k]) for k in (*KL_KEYS, ABS_KEY) if k in obj}
  found = {}
  for p in PEER_METRICS:
    if p.format != fmt:
      continue
    for name in p.names:
      if name in obj and obj[name] is not None:
        found[p.metric] = (name, obj[name])
        break
  return found


def _tail_mean(steps, key, tail: int, read, run: str) -> tuple[float, int, str] | None:
  """(the mean of the last `tail` values of `key`, how many, the name read) or None; only those
  values must be finite numbers (an early NaN the figure does not read is no reason to drop the
  run)."""
  found, name = [], None
  for where, obj in steps:
    got = read(obj)
    if key in got:
      name = got[key][0]
      found.append((where, got[key][1]))
  if not found:
    return None
  last = [_number(value, f"{where} (run {run!r})", name) for where, value in found[-tail:]]
  return math.fsum(last) / len(last), len(last), name


def _source(run: str, steps) -> str:
  sources = {obj[SOURCE_KEY] for _, obj in steps if SOURCE_KEY in obj}
  if len(sources) > 1:
    raise ValueError(f"run {run!r} names several sources: {sorted(map(str, sources))}")
  source = sources.pop() if sources else DEFAULT_SOURCE
  if not isinstance(source, str) or not source:
    raise ValueError(f"run {run!r}: source is {source!r}, not a non-empty string")
  return source


def _choose_x(fmt: str, present: set[str], kl_key: str, abs_diff_to_kl: str | None) -> str:
  """The record key read as x: `kl_key`, or with "auto" the first of KL_KEYS present, else the
  mean abs(Δ) when a conversion is chosen; a ValueError says what is missing or refused."""
  peer = PEER_NAMES.get(fmt, fmt)
  if kl_key != "auto":
    if kl_key not in (*KL_KEYS, ABS_KEY):
      raise ValueError(
        f"--kl-key={kl_key}: expected auto or one of {', '.join((*KL_KEYS, ABS_KEY))}"
      )
    wanted = kl_key
  else:
    wanted = next((k for k in KL_KEYS if k in present), ABS_KEY if ABS_KEY in present else None)
  if wanted is None or wanted not in present:
    names = [f"`{n}` ({p.metric})" for p in PEER_METRICS if p.format == fmt for n in p.names[:1]]
    known = ", ".join(names) or ", ".join(f"`{k}`" for k in (*KL_KEYS, ABS_KEY))
    what = wanted or "a mismatch metric"
    raise ValueError(f"the {peer} log has no {what}; the keys this format reads: {known}")
  if wanted == ABS_KEY and abs_diff_to_kl is None:
    name = next(
      (p.names[0] for p in PEER_METRICS if p.format == fmt and p.metric == ABS_KEY), ABS_KEY
    )
    raise ValueError(
      f"{peer}'s `{name}` is a mean abs(log π_b − log π_θ) in nats, not a KL; pick a conversion: "
      "--abs-diff-to-kl=lower_bound (KL ≥ m + e^(−m) − 1, a bound that holds for any engine) or "
      "--abs-diff-to-kl=gaussian (KL ≈ (π/4)·m² for a normal log-ratio)"
    )
  return wanted


def import_records(
  files: Sequence[tuple[str, str]],
  fmt: str,
  *,
  quality_key: str | None = None,
  kl_key: str = "auto",
  abs_diff_to_kl: str | None = None,
  tail: int = DEFAULT_TAIL,
  reference: Sequence[str] = (),
  higher_is_better: bool = True,
) -> tuple[list[dict], dict]:
  """Calibration records from logs, one per run, and where they came from.

  Args:
    files: (name, text) of each log file; for "opd_jax" the text is records as
      `budget_fit.fit_budget` takes them, one per line, kept as they are.
    fmt: one of FORMATS.
    quality_key: the key of the runs' quality (an evaluation score; required but for "opd_jax").
    kl_key: the record key read as x: "auto" (mismatch/kl, then mismatch/k3, then mismatch/k1,
      then mismatch/abs_logp_diff converted), or one of them.
    abs_diff_to_kl: "lower_bound" or "gaussian" (`lower_bound_kl`, `gaussian_kl`), needed to
      read a mean abs(Δ) as a KL; None refuses it.
    tail: T >= 1, the last values of each key that a run's figure averages.
    reference: the names of the reference runs (default: source or name "reference").
    higher_is_better: quality_drop = reference − run (True) or run − reference (False).

  Returns:
    (records, provenance): each record {"source", "run", "mismatch/kl", "quality",
    "quality_drop", "x_from", the mapped figures ("mismatch/k3", ...), "steps"}, in the order
    the runs first appear; provenance {"format", "files": [{"name", "sha256"}], "x_from",
    "abs_diff_to_kl", "quality_key", "higher_is_better", "tail", "reference_runs",
    "reference_quality", "axis": "training"}.

  Raises:
    ValueError: an unknown format, a line that is no JSON object, a non-number or non-finite
      figure, a run without the x or quality key, a mean abs(Δ) without a conversion, no
      reference run or no run besides it; the message names the file, line or run.
  """
  if fmt not in FORMATS:
    raise ValueError(f"unknown log format {fmt!r}; known: {', '.join(FORMATS)}")
  if isinstance(tail, bool) or not isinstance(tail, int) or tail < 1:
    raise ValueError(f"tail must be an int >= 1, got {tail!r}")
  if abs_diff_to_kl is not None and abs_diff_to_kl not in ABS_DIFF_TO_KL:
    raise ValueError(
      f"--abs-diff-to-kl={abs_diff_to_kl}: expected one of {', '.join(ABS_DIFF_TO_KL)}"
    )
  provenance: dict[str, Any] = {
    "format": fmt,
    "files": [
      {"name": name, "sha256": hashlib.sha256(text.encode()).hexdigest()} for name, text in files
    ],
  }
  if not files:
    raise ValueError("no log files given")
  if fmt == "opd_jax":
    ignored = {
      "--quality-key": quality_key,
      "--kl-key": None if kl_key == "auto" else kl_key,
      "--abs-diff-to-kl": abs_diff_to_kl,
      "--reference": ",".join(reference or ()) or None,
      "--lower-is-better": None if higher_is_better else True,
    }
    given = [flag for flag, value in ignored.items() if value is not None]
    if given:
      raise ValueError(
        f"{', '.join(given)} apply to peer logs only: --format=opd_jax reads records as "
        "budget_fit takes them (their own mismatch/kl and quality_drop), kept as they are"
      )
    records = [obj for name, text in files for _, obj in parse_lines(name, text)]
    return records, {**provenance, "axis": "as recorded"}
  if not quality_key:
    raise ValueError(f"the {PEER_NAMES[fmt]} log needs --quality-key (the runs' evaluation score)")
  runs = group_runs(files)

  def read(obj):
    return _peer_values(fmt, obj)

  present = set().union(*(read(obj) for steps in runs.values() for _, obj in steps))
  x_key = _choose_x(fmt, present, kl_key, abs_diff_to_kl)
  figures = sorted({p.metric for p in PEER_METRICS if p.format == fmt})
  records, x_from = [], set()
  for run, steps in runs.items():
    x = _tail_mean(steps, x_key, tail, read, run)
    if x is None:
      raise ValueError(f"run {run!r} has no {x_key} (read from {PEER_NAMES[fmt]}'s names)")
    quality = _tail_mean(
      steps, quality_key, tail, lambda o: {k: (k, v) for k, v in o.items() if v is not None}, run
    )
    if quality is None:
      raise ValueError(f"run {run!r} has no {quality_key!r} (--quality-key)")
    record = {SOURCE_KEY: _source(run, steps), RUN_KEY: run}
    for metric in figures:
      got = _tail_mean(steps, metric, tail, read, run)
      if got is not None:
        record[metric] = got[0]
    kl = CONVERSIONS[abs_diff_to_kl](x[0]) if x_key == ABS_KEY else x[0]
    x_from.add(x[2])
    record.update({KL_KEY: kl, "x_from": x[2], "quality": quality[0], "steps": len(steps)})
    records.append(record)
  names = set(reference)
  unknown = sorted(names - set(runs))
  if unknown:
    raise ValueError(f"--reference names no run: {unknown}; runs: {sorted(runs)}")
  refs = [
    r
    for r in records
    if r[RUN_KEY] in names or (not names and REFERENCE_SOURCE in (r[SOURCE_KEY], r[RUN_KEY]))
  ]
  ref_runs = {r[RUN_KEY] for r in refs}
  stray = [
    r[RUN_KEY]
    for r in records
    if names and r[RUN_KEY] not in ref_runs and r[SOURCE_KEY] == REFERENCE_SOURCE
  ]
  if stray:
    raise ValueError(
      f'runs {stray} say "source": "reference" but --reference names {sorted(names)}: the '
      "fit would anchor at them with drops measured against another run; name them all in "
      "--reference or change their source"
    )
  if not refs:
    raise ValueError(
      f"no reference run among {sorted(runs)}: name one with --reference=RUN, or give its lines "
      f'"source": "reference"'
    )
  if len(refs) == len(records):
    raise ValueError("every run is a reference run; a fit needs runs with a mismatch besides them")
  ref_quality = math.fsum(r["quality"] for r in refs) / len(refs)
  for r in refs:
    r[SOURCE_KEY] = REFERENCE_SOURCE
  for r in records:
    r[DROP_KEY] = ref_quality - r["quality"] if higher_is_better else r["quality"] - ref_quality
  provenance.update(
    x_from=sorted(x_from),
    abs_diff_to_kl=abs_diff_to_kl if x_key == ABS_KEY else None,
    quality_key=quality_key,
    higher_is_better=higher_is_better,
    tail=tail,
    reference_runs=[r[RUN_KEY] for r in refs],
    reference_quality=ref_quality,
    axis="training",
  )
  return records, provenance


def schema_page() -> str:
  """docs/reference/records.md's body after its title: the record schema, the peer-name table and
  the conversions (tools/gen_reference.py writes it)."""
  rows = "".join(
    f"| {PEER_NAMES[p.format]} (`--format={p.format}`) | "
    + ", ".join(f"`{n}`" for n in p.names)
    + f" | `{p.metric}` | {p.unit} | {p.definition} |\n"
    for p in PEER_METRICS
  )
  return (
    "A calibration record is one run: the setting, its mismatch and its quality against the "
    "reference runs. `python -m opd_jax.fit_budget --records=FILE.jsonl` fits a budget from "
    "them (`budget_fit.fit_budget`); `--format=opd_jax` reads records as below, one JSON object "
    "per line, and the other formats build them from a stack's per-step log "
    "(`mismatch/record_import.py`).\n\n"
    "| key | type | meaning |\n|---|---|---|\n"
    f"| `{SOURCE_KEY}` | string | what was changed (`fp8`, `noise`, `noise+stale`); "
    f"`{REFERENCE_SOURCE}` for an unperturbed run, the anchor of every per-source fit |\n"
    f"| `{KL_KEY}` | nats/token | the budget's x: KL(π_b ‖ π_θ) of the run's engine against the "
    "trainer (the check's value, or an imported run's training-time estimate) |\n"
    f"| `{DROP_KEY}` | quality's unit | mean reference quality − this run's (bigger is worse) |\n"
    "| `layer` | int, optional | a scan record of that decoder layer alone |\n"
    "| any other key | | kept in the budget file as it is |\n\n"
    "An imported record also has `run`, `quality`, `x_from` (the peer name read as x), "
    "`steps` and the run's mapped figures (`mismatch/k3`, ...), each the mean of the run's "
    f"last `--tail` values (default {DEFAULT_TAIL}). Runs: a line's `run` (else its file's "
    "name), its `source` (default `imported`), the reference runs by `--reference` or source "
    "`reference`. A line is flat or holds its metrics under `data` (verl's file logger).\n\n"
    "## Peer metrics\n\n"
    "Δ = log π_b(y) − log π_θ(y) over the tokens the engine sampled, r = π_θ(y)/π_b(y).\n\n"
    "| stack | name in its log | record key | unit | what it computes |\n|---|---|---|---|---|\n"
    f"{rows}\n"
    "`--kl-key=auto` reads `mismatch/kl`, else `mismatch/k3`, else `mismatch/k1` (both "
    "unbiased for KL(π_b ‖ π_θ)), else the mean abs(Δ) converted, which needs "
    "`--abs-diff-to-kl`:\n\n"
    "- `lower_bound`: KL ≥ m + e^(−m) − 1 ≈ m²/2, for m the mean abs(Δ). It holds for any "
    "engine: KL = E[Δ] ≥ E[Δ + e^(−Δ) − 1] since E[e^(−Δ)] ≤ 1, the term is at least its value at "
    "abs(Δ), and Jensen's inequality applies to that convex function. A budget on this axis is "
    "strict for a candidate measured by its KL.\n"
    "- `gaussian`: KL = σ²/2 with σ solving E|Δ| = m for Δ ~ N(σ²/2, σ²) (normalisation fixes "
    "the mean at σ²/2), ≈ (π/4)·m². An estimate: a heavy-tailed Δ has more KL at the same m.\n\n"
    "The fitted budget is on the training axis (the runs' logged values; the check reads "
    "higher), carries `provenance` (the format, each file's sha256, `x_from`, the conversion, "
    "the quality key, the tail, the reference runs) and has no fingerprint, so "
    "`python -m opd_jax.admit` and the live guard use it only with `--force` "
    "(`--config.budget.force=true`).\n"
  )
