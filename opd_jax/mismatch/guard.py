"""The mismatch budget as a live guard during training (`--config.budget.file=...`).

A run given a budget file compares its training-time `mismatch/kl` with the budget every step,
logs `budget/margin`, and when it stays over budget acts as `budget.action` says (`warn`,
`fallback` one rung up `fallback_ladder`, or `adaptive`: measure the rungs with the admission
check's procedure and run on the cheapest admitted one). Two layers:

* `Guard`, a pure state machine: `observe(step, scalars) -> Decision | None`, and the ladder
  `fallback_ladder(rollout)`, a pure function of the rollout config. No I/O, no clock, no JAX.
* `LiveGuard`, the trainer's hook: it loads and fingerprints the budget file, feeds `Guard` the
  step's scalars, rebuilds the rollout source when the guard switches rung, measures rungs for
  `adaptive`, and stores the rung in each checkpoint so that a resumed run keeps it.

What is compared, the actions, the uncalibrated default, a stale budget and switching are
described in docs/design.md ("Step hooks and the live guard").
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from opd_jax.config import check as config_check
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_file, budget_rules
from opd_jax.mismatch import candidates as candidates_lib
from opd_jax.train import setup as setup_lib
from opd_jax.train import trainer

ACTIONS = ("warn", "fallback", "adaptive")
AXES = ("training", "check")  # what a compared mismatch/kl is: a training step's, or the check's
KL_KEY = budget_lib.KL_KEY
EXTRA_KEY = "guard"  # the checkpoint extra's entry: {"rung", "name", "overrides", "action"}


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
      measurement, self.on_axis(axis), self.rule, unmeasured_parts="whole"
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


# ---------------------------------------------------------------------------------------------
# The trainer's hook


def uncalibrated_problem(budget_cfg: Mapping[str, Any]) -> str | None:
  """Why `config.budget` cannot run with the uncalibrated default, or None: only
  `budget.action=warn` can (`fallback` and `adaptive` would change the engine on a limit
  measured on another model)."""
  if budget_cfg.get("file") != budget_lib.UNCALIBRATED or budget_cfg.get("action") == "warn":
    return None
  return (
    f"budget.file={budget_lib.UNCALIBRATED!r} (the uncalibrated default limit "
    f"{budget_lib.UNCALIBRATED_MAX_KL:g} nats/token) only warns: budget.action="
    f"{budget_cfg.get('action')!r} would change the run's engine on a limit measured on "
    "another model. Set --config.budget.action=warn, or calibrate a budget for this model "
    f"({budget_lib.CALIBRATE_COMMAND}) and guard with it"
  )


def resumed_rung(extra: Mapping[str, Any], ladder: tuple[Rung, ...]) -> int:
  """The rung a checkpoint's extra data records (0 when it records none).

  Raises:
    ValueError: the recorded rung or its overrides are not this config's ladder's.
  """
  saved = extra.get(EXTRA_KEY)
  if not saved:
    return 0
  rung = saved.get("rung")
  if not isinstance(rung, int) or not 0 <= rung < len(ladder):
    raise ValueError(f"the checkpoint records guard rung {rung!r}; the ladder has {len(ladder)}")
  if dict(saved.get("overrides", {})) != ladder[rung].overrides:
    raise ValueError(
      f"the checkpoint records guard rung {rung} with overrides {saved.get('overrides')}, but "
      f"this config's ladder has {ladder[rung].describe()}"
    )
  return rung


class LiveGuard:
  """The guard inside a training run: the trainer calls `begin` once, `after_step` every step,
  puts `checkpoint_extra()` into each checkpoint and `close()`s it at the end.

  Build it with `LiveGuard.create` (None when `budget.file` is empty). `config` is the run
  config with the current rung's rollout overrides: the one to build the rollout source from.

  Args:
    config: the run config (budget.* and rollout.* as given).
    setup: `train.setup.Setup` (models and task; adaptive measures with them).
    guard: the `Guard`.
    make_source: (spec, state, next_batch) -> a rollout source (`trainer.make_rollouts`
      with the run's setup, prompt iterator and width bound).
    prompt_iter: the run's prompt iterator (rewound to the consumed position on a switch).
    writer: the run's MetricsWriter (switches go to TensorBoard text "budget/events").
    log: the run's log function.
  """

  EXTRA_KEY = EXTRA_KEY  # `hooks.StepHook`: its entry in the checkpoint extra

  def __init__(self, config, setup, guard: Guard, make_source, prompt_iter, writer, log):
    self.base_config, self.setup, self.guard = config, setup, guard
    self.config = apply_rung(config, guard.ladder[guard.rung])
    self._make_source, self._prompt_iter = make_source, prompt_iter
    self._writer, self._log = writer, log
    self._built = None  # the last source this hook built (closed by close())
    self._prompts = None  # adaptive: calibration prompts, encoded once
    lag = rung_lag(config)
    self._history = (
      collections.deque(maxlen=lag + 1) if guard.action == "adaptive" and lag else None
    )

  @property
  def spec(self):
    """The run spec of the current rung's config (`hooks.StepHook.spec`)."""
    return setup_lib.run_spec(self.config)

  @classmethod
  def create(cls, config, setup, params, extra, make_source, prompt_iter, writer, log):
    """Loads `budget.file` and checks its fingerprint; None when no budget file is set.

    A fresh run (no guard entry and step 0 in `extra`) fingerprints the student it starts
    from (`params`) and the teacher; a stale budget (another student, teacher, quantization
    format, backend or jax version) is refused unless `budget.force`, which logs the reasons
    and runs. A resumed run takes its rung from the checkpoint (`resumed_rung`) and does not
    fingerprint again: its student has trained away from the calibrated one by design.
    """
    b = config.budget
    if not b.file:
      return None
    from opd_jax.mismatch import admission

    problem = uncalibrated_problem(b)
    if problem:
      raise ValueError(problem)
    budget, saved_fp = budget_file.load_budget_or_default(b.file)
    ladder = fallback_ladder(config.rollout)
    rung = resumed_rung(extra, ladder)
    if not extra and saved_fp is not None:  # the uncalibrated default has no fingerprint
      m = setup.models
      current = budget_file.fingerprint(
        m.student_cfg, params, m.teacher_cfg, m.teacher_params, admission.QUANT_FORMAT
      )
      stale = budget_file.stale_reasons(saved_fp, current, at_run_start=True)
      if stale and not b.force:
        lines = "\n  ".join(stale)
        raise ValueError(
          f"the budget {b.file} is stale: it was calibrated on another setup. What changed:\n"
          f"  {lines}\nRecalibrate it, or set --config.budget.force=true to run with it anyway"
        )
      if stale:
        log("warning: the budget is stale (budget.force):\n  " + "\n  ".join(stale))
    guard = Guard(
      budget,
      ladder,
      b.action,
      b.patience,
      smoothing=b.smoothing,
      recheck_every=b.recheck_every,
      conservative=b.conservative,
      rung=rung,
      sources=rung_sources(config, ladder),
      per_source=b.per_source,
      rule=budget.rule,
    )
    live = cls(config, setup, guard, make_source, prompt_iter, writer, log)
    rungs = "; ".join(
      f"{r.describe()} [{guard.sources[r.index]}: limit {guard.limit_of(r.index):.4g}"
      + (f", check {guard.limit_of(r.index, 'check'):.4g}" if budget.training else "")
      + "]"
      for r in ladder
    )
    if budget_lib.is_uncalibrated(budget):
      axis = (
        "this check-axis limit: there is no training-axis default, and the check reads higher "
        "than training (docs/study), so this is lenient"
      )
      what = f"{budget_lib.uncalibrated_note()}, rule {guard.rule.describe()}, action {b.action}, "
    else:
      axis = (
        "the budget's training-axis fit"
        if budget.training
        else "the check-axis budget: the file has no training-axis fit, and the check reads "
        "higher than training (docs/study), so this is lenient"
      )
      what = (
        f"{b.file}, rule {guard.rule.describe()}, "
        f"limit {guard.limit:.4g} nats/token (max_kl {budget.max_kl:.4g}, "
        f"interval [{budget.interval[0]:.4g}, {budget.interval[1]:.4g}]), action {b.action}, "
      )
    log(
      f"budget guard: {what}"
      f"patience {b.patience}, smoothing {b.smoothing}; training-time mismatch/kl is compared "
      f"with {axis}; ladder: {rungs}; on rung {rung}"
    )
    return live

  def _event(self, step: int, text: str) -> None:
    self._log(f"step {step}: budget guard: {text}")
    self._writer.write_text(step, "budget/events", text)

  def begin(self, step: int, state, source):
    """Before the first step (after the first publish); returns the source to use."""
    return self._act(self.guard.start(step), step, state, source)

  def after_step(self, step: int, state, scalars: dict, source):
    """After step `step`'s publish: observes its scalars (adding `budget/*` to them) and acts;
    returns the source to use from now on."""
    if self._history is not None:
      copy = jax.device_put(state.params, jax.tree.map(lambda x: x.sharding, state.params))
      self._history.append((step, copy))
    decision = self.guard.observe(step, scalars)
    scalars.update(self.guard.scalars())
    return self._act(decision, step, state, source)

  def checkpoint_extra(self) -> dict:
    """The checkpoint extra's guard entry: the rung the run samples with."""
    rung = self.guard.ladder[self.guard.rung]
    return {
      "rung": rung.index,
      "name": rung.name,
      "overrides": dict(rung.overrides),
      "action": self.guard.action,
    }

  def close(self) -> None:
    if self._built is not None:
      self._built.close()

  def _act(self, decision: Decision | None, step: int, state, source):
    if decision is None:
      return source
    if decision.kind in ("warn", "exhausted"):
      self._event(step, f"{decision.kind}: {decision.reason}")
      return source
    if decision.kind == "recheck":
      measured = self._measure(decision, step, state)
      decision = self.guard.choose(step, decision, measured)
      if decision is None:
        return source
    rung = self.guard.ladder[decision.rung]
    self.config = apply_rung(self.base_config, rung)
    self._event(
      step,
      f"switch rung {decision.previous_rung} -> {rung.describe()}: {decision.reason}",
    )
    return self._switch_source(source, state, step)

  def _switch_source(self, old, state, step: int):
    """Closes `old` and builds the current config's source at old's consumed data position
    and next batch index, publishing the current weights (version `step`) to it."""
    resume = old.resume_state()
    old.close()
    self._prompt_iter.set_state(resume["data_state"])
    new = self._make_source(self.spec, state, resume["next_batch"])
    new.publish(state.params, step)
    self._built = new
    self._log(f"step {step}: rollouts now: {new.describe()}")
    return new

  def _measure(self, decision: Decision, step: int, state) -> dict[int, dict]:
    """Adaptive: the measurements of the candidate rungs (with their parts when the rule reads
    parts: `admission.candidate_verdict`), cheapest first, up to the first within budget, with
    the admission check's procedure at the current student."""
    from opd_jax.mismatch import admission

    m = self.setup.models
    if self._prompts is None:
      _, tokens_bp, lens_b = admission.calibration_prompts(
        self.base_config, m.tokenizer, self.setup.task_cfg, self.base_config.budget.prompts
      )
      self._prompts = (tokens_bp, lens_b)

    def measure(c):
      behaviour = None
      if c.lag and self._history:
        older = [p for s, p in self._history if s <= step - c.lag]
        behaviour = older[-1] if older else self._history[0][1]
      return admission.measure_candidate(c, self.setup, self._prompts, state.params, behaviour)

    measured = {}
    for index in decision.candidates:
      rung = self.guard.ladder[index]
      spec = ",".join(f"rollout.{k}={v}" for k, v in rung.overrides.items())
      spec = spec or f"rollout.weights={self.base_config.rollout.weights}"  # rung 0: as is
      candidate = candidates_lib.parse_candidate(spec, self.base_config)
      measurement, _ = admission.candidate_verdict(
        candidate,
        self.base_config,
        measure(candidate),
        self.guard.on_axis("check"),
        lambda _, part: measure(part)[KL_KEY],
        self.guard.rule,
      )
      measured[index] = {
        k: float(v)
        for k, v in measurement.items()
        if k == KL_KEY or k.startswith(budget_lib.PART_KL_PREFIX)
      }
      within = self.guard.admits(measured[index], index, "check")  # the rung's own limit
      self._log(
        f"step {step}: budget guard measured {rung.describe()}: mismatch/kl "
        f"{measured[index][KL_KEY]:.4g} ({'within' if within else 'over'} "
        f"{self.guard.limit_of(index, 'check'):.4g}; {self.guard.rule.name} rule)"
      )
      if within:
        break
    return measured


def run(config: ml_collections.ConfigDict, workdir: str, log=print) -> dict:
  """`trainer.run` with the live guard as its step hook: what `python -m opd_jax.main` runs.

  Without `budget.file` the hook factory returns None and the run is the plain trainer's. The
  uncalibrated default with an action other than warn is refused here, before anything loads
  (`uncalibrated_problem`).
  """
  problem = uncalibrated_problem(config.budget)
  if problem:
    raise ValueError(problem)
  return trainer.run(config, workdir, log, step_hook=LiveGuard.create)
