"""The mismatch budget guard: the fallback ladder and the guard's state machine.

A run given a budget file (`--config.budget.file=...`) compares its training-time `mismatch/kl`
with the budget every step, logs `budget/margin`, and when it stays over budget acts as
`budget.action` says (`warn`, `fallback` one rung up `fallback_ladder`, or `adaptive`: measure
the rungs with the admission check's procedure and run on the cheapest admitted one). This
module is the pure part:

* `fallback_ladder(rollout)`, a pure function of the rollout config, and its rungs.
* `Guard`, a pure state machine: `observe(step, scalars) -> Decision | None`. No I/O, no clock,
  no JAX.

The trainer's hook that drives it, and `run`, are in `mismatch.live_guard`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import ml_collections

from opd_jax.config import check as config_check
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_rules
from opd_jax.mismatch import candidates as candidates_lib

ACTIONS = ("warn", "fallback", "adaptive")
AXES = ("training", "check")  # what a compared mismatch/kl is: a training step's, or the check's
KL_KEY = budget_lib.KL_KEY


# ---------------------------------------------------------------------------------------------
# The ladder


@dataclasses.dataclass(frozen=True)
class Rung:
  """One engine setting of the fallback ladder.

  Attributes:
    index: 0 for the run's own config, then 1, 2, … from cheapest to safest.
    name: what the rung changes, e.g. "kv bf16" (rung 0: "as configured").
    overrides: rollout key (without "rollout.") -> value, cumulative over rungs 1…index.
  """

  index: int
  name: str
  overrides: dict[str, Any]

  def describe(self) -> str:
    changes = ", ".join(f"rollout.{k}={v!r}" for k, v in self.overrides.items())
    return f"rung {self.index} ({self.name}{': ' + changes if changes else ''})"


def fallback_ladder(rollout: Mapping[str, Any]) -> tuple[Rung, ...]:
  """The rungs for a rollout config, rung 0 first.

  Rung 0 is the run's own rollout config; every later rung adds the overrides of one step,
  skipping a step that changes nothing for this config:

    1. a quantized KV cache (fp8, fp8_e5m2, fp4) -> `kv_cache="bf16"`;
    2. quantized weights (fp8, fp8_e5m2, int8, int4, fp4), a BF16 head or weight noise ->
       `weights="bf16"`, `head_dtype="float32"`, `noise_sigma=0` (the noise models a
       perturbation of the engine's weights, so the rung that restores them removes it too);
    3. no staleness: `stale_k=0` (sync); `max_lag=0`, `max_ahead=-1` (async).

  Rungs are cumulative (rung i holds the overrides of rungs 1…i), from the cheapest engine to
  the safest; `rollout.kernel`, `bf16_layers` and the sampling settings are left as they are.

  Args:
    rollout: `config.rollout` (or a mapping with weights, kv_cache, noise_sigma, mode, stale_k,
      max_lag, max_ahead).

  Returns:
    (rung 0, …): rung 0 has no overrides; each later rung changes at least one value.
  """
  steps = []
  if rollout["kv_cache"] not in ("auto", "bf16"):  # a quantized cache: fp8, fp8_e5m2, fp4
    steps.append(("kv bf16", {"kv_cache": "bf16"}))
  weights = {}
  if rollout["weights"] not in ("trainer", "bf16"):  # any quantized format: fp8, int4, fp4, ...
    weights["weights"] = "bf16"
  if rollout.get("head_dtype", "float32") != "float32":
    weights["head_dtype"] = "float32"
  if rollout["noise_sigma"] > 0:
    weights["noise_sigma"] = 0.0
  if weights:
    steps.append(("weights bf16, no noise", weights))
  if rollout["mode"] == "sync" and rollout["stale_k"] > 0:
    steps.append(("no staleness", {"stale_k": 0}))
  elif rollout["mode"] == "async" and (rollout["max_lag"] > 0 or rollout["max_ahead"] > 0):
    steps.append(("no staleness", {"max_lag": 0, "max_ahead": -1}))
  rungs = [Rung(0, "as configured", {})]
  for name, changes in steps:
    rungs.append(Rung(len(rungs), name, {**rungs[-1].overrides, **changes}))
  return tuple(rungs)


def apply_rung(config: ml_collections.ConfigDict, rung: Rung) -> ml_collections.ConfigDict:
  """A validated copy of `config` with the rung's rollout overrides."""
  out = ml_collections.ConfigDict(config.to_dict())
  for key, value in rung.overrides.items():
    out.rollout[key] = value
  config_check.validate(out)
  return out


def rung_lag(config: ml_collections.ConfigDict) -> int:
  """k, the weight-version lag a config samples with: stale_k (sync) or max_lag (async)."""
  r = config.rollout
  return int(r.max_lag) if r.mode == "async" else int(r.stale_k)


def rung_sources(config: ml_collections.ConfigDict, ladder: tuple[Rung, ...]) -> tuple[str, ...]:
  """The mismatch sources of each rung's engine against the trainer's, "+"-joined as the
  admission check names a candidate's (`candidates.config_source`): the budget's per-source
  limits apply to them."""
  return tuple(candidates_lib.config_source(apply_rung(config, rung)) for rung in ladder)


# ---------------------------------------------------------------------------------------------
# The state machine


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the guard asks the trainer to do after a step.

  Attributes:
    step: the step it was decided at.
    kind: "warn" (log only), "switch" (rebuild the rollout source on `rung`), "recheck"
      (adaptive: measure the rungs in `candidates` and call `Guard.choose`) or "exhausted"
      (fallback on the last rung: log only).
    rung: the rung to run on (switch) or the current one.
    previous_rung: the rung before the decision.
    reason: one line for the log.
    candidates: the rungs to measure, cheapest first (recheck only).
  """

  step: int
  kind: str
  rung: int
  previous_rung: int
  reason: str
  candidates: tuple[int, ...] = ()


class Guard:
  """The budget guard's state machine.

  Each step it updates a bias-corrected exponential moving average of the step's mismatch/kl,

    m_n = α m_{n−1} + (1 − α) kl_n,   m_0 = 0,   ema_n = m_n / (1 − α^n)   (α = smoothing),

  and holds it to the current rung's verdict (`verdict`: the rule on a measurement naming the
  rung's sources, a rule that reads parts taking the whole's kl for each part) on the training
  axis (`Budget.training`, else the check-axis budget). A step is over budget when the rule
  refuses ema_n; after `patience` consecutive such steps (one within budget resets the count)
  the action fires. After a switch the average and the count start again.

  Args:
    budget: the fitted `Budget` (`budget_file.load_budget`).
    ladder: `fallback_ladder(config.rollout)`.
    action: "warn", "fallback" or "adaptive".
    patience: consecutive over-budget steps before acting (>= 1).
    smoothing: α in [0, 1) of the moving average compared with the budget (0 = per step).
    recheck_every: adaptive: steps between periodic re-measurements (>= 1).
    conservative: set the rule's "conservative" parameter (every limit at the lower end of
      its interval).
    rung: the rung the run is on (a resumed run's).
    sources: the mismatch sources of each rung (`rung_sources`), for per-source limits; None
      names no source, so that every rule holds a rung to the pooled limit.
    per_source: False replaces the rule by the pooled one.
    rule: the admission rule (`budget.Rule`); None: the budget's (`budget_rules.apply_rule`).
    extrapolate: a rung's mismatch beyond the budget's records (an uncalibrated source, or
      above its source's calibrated range: `budget_rules.extrapolation`) is over budget
      ("refuse"), or judged against the pooled or the uncalibrated default limit
      (`budget.EXTRAPOLATE`), as the admission check does.
  """

  def __init__(
    self,
    budget: budget_lib.Budget,
    ladder: tuple[Rung, ...],
    action: str,
    patience: int,
    smoothing: float = 0.9,
    recheck_every: int = 200,
    conservative: bool = False,
    rung: int = 0,
    sources: tuple[str, ...] | None = None,
    per_source: bool = True,
    rule: budget_lib.Rule | None = None,
    extrapolate: str = "refuse",
  ):
    if action not in ACTIONS:
      raise ValueError(f"budget.action must be one of {', '.join(ACTIONS)}; got {action!r}")
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
      raise ValueError(f"budget.patience must be an int >= 1, got {patience!r}")
    if not 0.0 <= smoothing < 1.0:
      raise ValueError(f"budget.smoothing must be in [0, 1), got {smoothing!r}")
    if isinstance(recheck_every, bool) or not isinstance(recheck_every, int) or recheck_every < 1:
      raise ValueError(f"budget.recheck_every must be an int >= 1, got {recheck_every!r}")
    if not ladder or not 0 <= rung < len(ladder):
      raise ValueError(f"rung {rung} is not on the ladder (rungs 0…{len(ladder) - 1})")
    if sources is not None and len(sources) != len(ladder):
      raise ValueError(f"{len(sources)} rung sources for a ladder of {len(ladder)} rungs")
    if extrapolate not in budget_lib.EXTRAPOLATE:
      raise ValueError(
        f"budget.extrapolate must be one of {', '.join(budget_lib.EXTRAPOLATE)}; "
        f"got {extrapolate!r}"
      )
    self.extrapolate = extrapolate
    self.budget, self.ladder, self.action = budget, ladder, action
    self.patience, self.smoothing = patience, float(smoothing)
    self.recheck_every, self.conservative = recheck_every, conservative
    self.rung = rung
    self.sources, self.per_source = sources, per_source
    rule = rule or budget.rule or budget_lib.POOLED
    rule = rule if per_source else budget_lib.POOLED
    self.rule = rule.with_params(conservative=True) if conservative else rule
    self.over_steps = 0
    self.margin = math.nan  # limit − the step's mismatch/kl
    self.margin_smoothed = math.nan  # limit − the moving average
    self.kl_smoothed = math.nan
    self._sum, self._count = 0.0, 0
    self._next_recheck: int | None = None

  def on_axis(self, axis: str) -> budget_lib.Budget:
    """The budget a value on `axis` is compared with: "training" (a training step's
    mismatch/kl) uses the budget's training-axis fit when it has one, "check" (an admission
    check measurement) the budget itself (docs/design.md, "Two axes")."""
    if axis not in AXES:
      raise ValueError(f"axis={axis!r}: expected one of {AXES}")
    if axis == "training" and self.budget.training is not None:
      return self.budget.training
    return self.budget

  def verdict(self, kl, rung: int, axis: str = "training") -> budget_rules.Verdict:
    """The rule's verdict (`budget_rules.apply_rule`) on a mismatch on `axis` of `rung`'s engine.

    Args:
      kl: the whole combination's mismatch/kl (a float), or a measurement (a mapping with
        "mismatch/kl" and any "mismatch/kl/part/<s>" measured); a part not given is taken as
        the whole (a training step logs only the whole: per_part then holds it to the
        strictest part's limit, sum_of_fractions to Σ_s kl / L_s ≤ 1).
      rung: the rung whose sources name the measurement.
      axis: "training" or "check" (`on_axis`).
    """
    measurement = dict(kl) if isinstance(kl, Mapping) else {KL_KEY: kl}
    if self.sources is not None:
      measurement[budget_lib.SOURCE_KEY] = self.sources[rung]
    return budget_rules.apply_rule(
      measurement,
      self.on_axis(axis),
      self.rule,
      unmeasured_parts="whole",
      extrapolate=self.extrapolate,
    )

  def limit_of(self, rung: int, axis: str = "training") -> float:
    """The kl the guard admits on `rung` for a value on `axis` (`verdict`'s limit)."""
    return self.verdict(0.0, rung, axis).limit

  @property
  def limit(self) -> float:
    """The training-time kl the guard admits on the current rung."""
    return self.limit_of(self.rung)

  def admits(self, kl, rung: int | None = None, axis: str = "training") -> bool:
    """Whether a mismatch on `axis` of `rung` (default: the current one) is within budget
    (`kl` as for `verdict`)."""
    return self.verdict(kl, self.rung if rung is None else rung, axis).admitted

  def _restart(self) -> None:
    self._sum, self._count, self.over_steps = 0.0, 0, 0

  def start(self, step: int) -> Decision | None:
    """Before the first step: adaptive asks to measure every rung; other actions nothing."""
    if self.action != "adaptive":
      return None
    return Decision(
      step, "recheck", self.rung, self.rung, "initial check", tuple(range(len(self.ladder)))
    )

  def observe(self, step: int, scalars: Mapping[str, Any]) -> Decision | None:
    """Feeds one training step's scalars; returns what to do, or None.

    Args:
      step: the step just taken (the trainer's step counter after it).
      scalars: the step's metrics; must hold a finite "mismatch/kl".

    Raises:
      ValueError: no or a non-finite "mismatch/kl" (the engine returns no behaviour
        distribution, so the guard has nothing to compare).
    """
    if KL_KEY not in scalars:
      raise ValueError(
        f"the budget guard needs {KL_KEY!r} every step, but the step's metrics have none "
        "(the rollouts carry no behaviour distribution)"
      )
    kl = scalars[KL_KEY]
    if isinstance(kl, bool) or not isinstance(kl, numbers.Real) or not math.isfinite(kl):
      raise ValueError(f"the budget guard got a non-finite {KL_KEY} at step {step}: {kl!r}")
    kl = float(kl)
    a = self.smoothing
    self._sum = a * self._sum + (1.0 - a) * kl
    self._count += 1
    self.kl_smoothed = self._sum / (1.0 - a**self._count)
    verdict = self.verdict(self.kl_smoothed, self.rung)
    self.margin = verdict.limit - kl
    self.margin_smoothed = verdict.margin
    self.over_steps = 0 if verdict.admitted else self.over_steps + 1

    if self.action == "adaptive" and self._next_recheck is not None and step >= self._next_recheck:
      return Decision(
        step, "recheck", self.rung, self.rung, "periodic re-check", tuple(range(len(self.ladder)))
      )
    if self.over_steps < self.patience:
      return None
    what = (
      "the uncalibrated default limit" if budget_lib.is_uncalibrated(self.budget) else "the budget"
    )
    over = (
      f"mismatch/kl (moving average {self.kl_smoothed:.4g}) over {what} "
      f"{self.limit:.4g} for {self.over_steps} consecutive steps"
    )
    self.over_steps = 0
    if self.action == "warn":
      return Decision(step, "warn", self.rung, self.rung, over)
    safer = tuple(range(self.rung + 1, len(self.ladder)))
    if not safer:
      return Decision(
        step, "exhausted", self.rung, self.rung, f"{over}; no safer rung is left on the ladder"
      )
    if self.action == "fallback":
      return self._switch(step, self.rung + 1, over)
    return Decision(step, "recheck", self.rung, self.rung, f"{over}; early re-check", safer)

  def _switch(self, step: int, rung: int, reason: str) -> Decision:
    previous, self.rung = self.rung, rung
    self._restart()
    return Decision(step, "switch", rung, previous, reason)

  def choose(self, step: int, decision: Decision, measured: Mapping[int, float]) -> Decision | None:
    """Adaptive: settles a recheck given the measured mismatch/kl of rungs in its candidates.

    Picks the first candidate (cheapest first) whose measurement `admit`s on the check's axis, else
    the last candidate (the safest); returns a switch when that differs from the current rung, else
    None. The next periodic re-check is `recheck_every` steps later.

    Args:
      step: the current step.
      decision: the "recheck" Decision being settled.
      measured: rung -> its measured mismatch/kl, or its measurement with the parts the rule
        reads (`verdict`); every candidate up to the chosen one.
    """
    if decision.kind != "recheck":
      raise ValueError(f"choose settles a recheck, got a {decision.kind!r} decision")
    self._next_recheck = step + self.recheck_every
    pick, admitted, verdicts = decision.candidates[-1], False, []
    for rung in decision.candidates:
      if rung not in measured:
        break
      verdict = self.verdict(measured[rung], rung, "check")
      verdicts.append(f"rung {rung}: {verdict.measured_kl:.4g} (margin {verdict.margin:.4g})")
      if verdict.admitted:
        pick, admitted = rung, True
        break
    if pick == self.rung:
      self._restart()
      return None
    why = "the cheapest within budget" if admitted else "none within budget: the safest"
    reason = f"{decision.reason}: measured {'; '.join(verdicts)}; {why}"
    return self._switch(step, pick, reason)

  def scalars(self) -> dict[str, float]:
    """The `budget/*` scalars of the last observed step."""
    return {
      "budget/margin": self.margin,
      "budget/margin_smoothed": self.margin_smoothed,
      "budget/kl_smoothed": self.kl_smoothed,
      "budget/max_kl": self.limit,
      "budget/over_steps": float(self.over_steps),
      "budget/rung": float(self.rung),
    }
