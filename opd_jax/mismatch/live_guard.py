"""The budget guard inside a training run: the trainer's step hook and `run`.

`LiveGuard` is the trainer's hook (`train.hooks.StepHook`): it loads and fingerprints the budget
file, feeds `guard.Guard` (the pure state machine) the step's scalars, rebuilds the rollout source
when the guard switches rung, measures rungs for `budget.action=adaptive`, and stores the rung in
each checkpoint so that a resumed run keeps it. `run` is `trainer.run` with this hook: what
`python -m opd_jax.main` runs.

What is compared, the actions, the uncalibrated default, a stale budget and switching are
described in docs/design.md ("Step hooks and the live guard").
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_file
from opd_jax.mismatch import candidates as candidates_lib
from opd_jax.mismatch import guard as guard_lib
from opd_jax.train import setup as setup_lib
from opd_jax.train import trainer

EXTRA_KEY = "guard"  # the checkpoint extra's entry: {"rung", "name", "overrides", "action"}


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


def resumed_rung(extra: Mapping[str, Any], ladder: tuple[guard_lib.Rung, ...]) -> int:
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

  def __init__(self, config, setup, guard: guard_lib.Guard, make_source, prompt_iter, writer, log):
    self.base_config, self.setup, self.guard = config, setup, guard
    self.config = guard_lib.apply_rung(config, guard.ladder[guard.rung])
    self._make_source, self._prompt_iter = make_source, prompt_iter
    self._writer, self._log = writer, log
    self._built = None  # the last source this hook built (closed by close())
    self._prompts = None  # adaptive: calibration prompts, encoded once
    lag = guard_lib.rung_lag(config)
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
    ladder = guard_lib.fallback_ladder(config.rollout)
    rung = resumed_rung(extra, ladder)
    if not extra and saved_fp is not None:  # the uncalibrated default has no fingerprint
      m = setup.models
      current = budget_file.fingerprint(
        m.student_cfg, params, m.teacher_cfg, m.teacher_params, admission.QUANT_FORMAT
      )
      stale = budget_file.stale_reasons(saved_fp, current, at_run_start=True)
      if stale and not b.force:
        lines = "\n  ".join(stale)
        if not saved_fp:
          raise ValueError(
            f"{b.file}: {lines}. Set --config.budget.force=true to run with it anyway"
          )
        raise ValueError(
          f"the budget {b.file} is stale: it was calibrated on another setup. What changed:\n"
          f"  {lines}\nRecalibrate it, or set --config.budget.force=true to run with it anyway"
        )
      if stale:
        what = "has no fingerprint" if not saved_fp else "is stale"
        log(f"warning: the budget {what} (budget.force):\n  " + "\n  ".join(stale))
    guard = guard_lib.Guard(
      budget,
      ladder,
      b.action,
      b.patience,
      smoothing=b.smoothing,
      recheck_every=b.recheck_every,
      conservative=b.conservative,
      rung=rung,
      sources=guard_lib.rung_sources(config, ladder),
      per_source=b.per_source,
      rule=budget.rule,
      extrapolate=b.extrapolate,
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
      f"patience {b.patience}, smoothing {b.smoothing}, extrapolate {b.extrapolate}; "
      "training-time mismatch/kl is compared "
      f"with {axis}; ladder: {rungs}; on rung {rung}"
    )
    return live

  def _event(self, step: int, text: str) -> None:
    self._log(f"step {step}: budget guard: {text}")
    self._writer.write_text(step, "budget/events", text)

  def begin(self, step: int, state, source):
    """Before the first step (after the first publish); returns the source to use. The start's
    weights enter the history, as `SyncRollouts` keeps them: the first k steps of a stale rung
    sample with them."""
    self._remember(step, state)
    return self._act(self.guard.start(step), step, state, source)

  def _remember(self, step: int, state) -> None:
    """Adaptive with a lagged rung: a copy of the weights after `step` (the student of version
    `step`), the oldest k + 1 kept."""
    if self._history is not None:
      copy = jax.device_put(state.params, jax.tree.map(lambda x: x.sharding, state.params))
      self._history.append((step, copy))

  def after_step(self, step: int, state, scalars: dict, source):
    """After step `step`'s publish: observes its scalars (adding `budget/*` to them) and acts;
    returns the source to use from now on."""
    self._remember(step, state)
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

  def _act(self, decision: guard_lib.Decision | None, step: int, state, source):
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
    self.config = guard_lib.apply_rung(self.base_config, rung)
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

  def _measure(self, decision: guard_lib.Decision, step: int, state) -> dict[int, dict]:
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
        lambda _, part: measure(part)[budget_lib.KL_KEY],
        self.guard.rule,
      )
      measured[index] = {
        k: float(v)
        for k, v in measurement.items()
        if k == budget_lib.KL_KEY or k.startswith(budget_lib.PART_KL_PREFIX)
      }
      within = self.guard.admits(measured[index], index, "check")  # the rung's own limit
      self._log(
        f"step {step}: budget guard measured {rung.describe()}: mismatch/kl "
        f"{measured[index][budget_lib.KL_KEY]:.4g} ({'within' if within else 'over'} "
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
