"""The OPD training loop: `run(config, workdir, step_hook=None)`.

    for step: rollout = next(rollouts)             # engine weights T(θ_v), version v
              state, m = train_step(state, teacher, rollout, reference)
              rollouts.publish(state.params, step + 1)
              log / evaluate / checkpoint

`rollouts` is a rollout source (`sources.SyncRollouts` or `async_rollouts.AsyncRollouts`, by
`rollout.mode`); the loop is the same for both (see `rollout.sources` for the weight-version
semantics). `reference` is None, or the frozen starting student of GRPO's KL penalty
(`train.kl_coef` > 0, `setup.reference_student`). The models, the warm start and the resume
come from `train.setup`; a step hook (`train.hooks`), such as the live budget guard, is handed
in, never imported.

Held-out evaluation (`Evaluator`, `train.evaluate`) runs at the start, every
`train.eval_every` steps and at the end, on the set `preflight.check` chose (`evaluate.plan`):
`data.eval_file`, else a held-out slice of `data.prompt_file` (never trained on), else the
built-in task's split when the task is trained. `train.eval_every=0` runs no evaluation (no
greedy decodes), and the run's summary then has no quality fields. Everything written
(TensorBoard, metrics.jsonl, checkpoints' JSON) comes from process 0 only.

SIGTERM and SIGINT stop the run at any point (`train.signals`): in the loop at the next step
boundary, where it saves a checkpoint, stops the rollout producer and returns; during setup at
the next phase boundary or supervised step, keeping what finished (a second SIGINT interrupts at
once). The same command resumes.
"""

from __future__ import annotations

import contextlib
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from opd_jax.config import check as config_check
from opd_jax.config.spec import RunSpec
from opd_jax.data import pipeline as data
from opd_jax.inference import decode_loop
from opd_jax.io import build, metrics_writer, provenance, run_history
from opd_jax.io import progress as progress_lib
from opd_jax.io.run_history import export_dir, run_fingerprint
from opd_jax.model import sharding, teacher_topk
from opd_jax.rollout import async_rollouts, sources
from opd_jax.rollout import worker as rollout_worker
from opd_jax.train import evaluate, hooks, preflight, rl, signals, train_step
from opd_jax.train import state as train_state
from opd_jax.train.export import export_student
from opd_jax.train.setup import (
  Setup,
  check_shapes,
  engine_config,
  initial_state,
  loss_config,
  prepare_models,
  process_prompt_batches,
  prompt_source,
  prompt_width,
  reference_student,
  run_seed,
  run_spec,
  sampler_config,
  schedule_length,
  task_config,
)
from opd_jax.train.signals import StopOnSignal


def _scalars(metrics) -> dict[str, float]:
  """The replicated scalar metrics as floats (per-token arrays stay on device), fetched in one
  device-to-host transfer rather than one blocking `float` per metric."""
  host = jax.device_get({k: v for k, v in metrics.items() if not k.startswith("per_token/")})
  return {k: float(v) for k, v in host.items()}


def _to_host(x) -> np.ndarray:
  """A batch-sharded array as one host array, gathered across processes if needed."""
  return np.asarray(sharding.to_host(x))


class Evaluator:
  """Held-out quality at given steps, written to the metrics writer (`setup.eval_set`, which
  must not be None). The frozen teacher is decoded and scored once."""

  def __init__(self, spec: RunSpec, setup: Setup, writer):
    self._spec, self._setup, self._writer = spec, setup, writer
    self.metric = setup.eval_set.metric  # quality/<who>_<metric>: accuracy or score
    self.teacher_score = None
    m = setup.models
    kv = engine_config(spec, jnp.dtype(spec.student.dtype).name).kv
    self._sampling = sampler_config(spec, m.tokenizer.eos_id, kv, m.student_cfg.real_vocab_size)

  def __call__(self, step: int, params) -> dict[str, float]:
    m = self._setup.models
    metrics, samples = evaluate.evaluate(
      params,
      m.student_cfg,
      m.teacher_params,
      m.teacher_cfg,
      self._setup.eval_set,
      m.tokenizer,
      self._spec.rollout.max_new_tokens,
      self.teacher_score,
      train_sampling=self._sampling,
      teacher_temperature=self._spec.teacher.temperature,
      sampled_seed=self._spec.seed if self._spec.train.eval_sampled else None,
    )
    self.teacher_score = metrics.get(f"quality/teacher_{self.metric}")
    self._writer.write_scalars(step, metrics)
    self._writer.write_text(step, "quality/student_samples", "\n".join(samples))
    return metrics


def run(
  config: ml_collections.ConfigDict,
  workdir: str,
  log=print,
  step_hook: hooks.HookFactory | None = None,
) -> dict:
  """Runs OPD as configured; returns the quality at the start and the end.

  `step_hook` builds the hook the loop drives (`hooks`): the budget guard for a config with
  `budget.file` (`mismatch.live_guard.run` passes it). A config with `budget.file` and no hook is
  refused, so that a guard asked for is never silently left out.
  """
  config_check.validate(config)
  if config.budget.file and step_hook is None:
    raise ValueError(
      f"budget.file={config.budget.file!r} asks for the live budget guard, which this call "
      "was not given: run with opd_jax.mismatch.live_guard.run (as `python -m opd_jax.main` does), "
      "or pass step_hook=opd_jax.mismatch.live_guard.LiveGuard.create"
    )
  start = time.time()
  is_main = jax.process_index() == 0
  log = log if is_main else (lambda *a, **k: None)
  with StopOnSignal() as stop:  # SIGTERM at any point stops cleanly (`train.signals`)
    try:
      return _run(config, workdir, log, step_hook, start, stop)
    except signals.Interrupted as e:
      by = f" by process {e.process}" if jax.process_count() > 1 else ""
      log(
        f"{e.signal_name} received{by} during {e.phase}: stopped before training; what "
        "finished is kept (cached teacher, warm start, checkpoints), rerun to resume"
      )
      return {
        "start_step": None,
        "end_step": None,
        "stopped_by": e.signal_name,
        "stopped_in": e.phase,
        "wall_seconds": time.time() - start,
        provenance.KEY: provenance.provenance(config),
      }


def _run(config, workdir, log, step_hook, start, stop) -> dict:
  """`run` inside its signal handler: the spec, setup, then the loop (`_train`). The
  ConfigDict goes on only to `step_hook` (the guard builds its rungs' configs from it)."""
  spec = run_spec(config)
  checked = preflight.check(spec, workdir, log)  # everything checkable before weights load
  check_shapes(spec, task_config(spec), checked.plan.mesh)
  signals.check("the preflight check")
  setup = prepare_models(spec, workdir, log, checked.plan, checked.eval_prompts, checked.scorer)
  signals.check("the teacher bootstrap")
  m, t = setup.models, spec.train
  log(build.summary(m))
  source = checked.train_prompts
  if source is None:
    source = prompt_source(spec, setup.task_cfg)
  width = prompt_width(source, m.tokenizer, setup.task_cfg, bool(spec.data.prompt_file))
  prompt_iter = iter(process_prompt_batches(source, spec.data.batch_size, run_seed(spec)))
  tx = train_state.make_optimizer(t.lr, t.steps, t.warmup_steps, t.weight_decay, t.grad_clip)
  abstract = jax.eval_shape(lambda p: train_state.init_state(p, tx, spec.seed), m.student_params)
  state_shardings = sharding.tree_shardings(abstract, m.mesh)
  # orbax is imported by the loop that saves: the admission check and the export import this
  # module for its setup and load it only when they restore, so that a check can import it
  # while it compiles (`cli.admit_check.run_admission`).
  from opd_jax.io import checkpointing

  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), t.keep_checkpoints)
  writer = metrics_writer.MetricsWriter(
    workdir,
    enabled=jax.process_index() == 0,
    wandb_project=spec.log.wandb_project,
    wandb_config=run_fingerprint(spec),
  )
  try:
    resumed = {}
    state, next_batch = initial_state(
      spec, setup, tx, abstract, state_shardings, ckpt, prompt_iter, log, resumed
    )
    signals.check("the warm start")
    reference = reference_student(spec, setup, state, state_shardings.params, bool(resumed), log)
    digests = run_history.start_digests(
      m.teacher_params,
      state.params,
      resumed.get(run_history.START_DIGESTS, {}) if resumed else None,
      ckpt.directory,
    )
    schedule_steps = schedule_length(spec, resumed, log)
    if schedule_steps != t.steps:  # a resumed run keeps its checkpoint's schedule
      tx = train_state.make_optimizer(
        t.lr, schedule_steps, t.warmup_steps, t.weight_decay, t.grad_clip
      )
    m.student_params = None  # donated into the train state; the state owns the student now
    hook = step_hook and step_hook(
      config,
      setup,
      state.params,
      resumed,
      lambda rung, st, nb: make_rollouts(rung, setup, prompt_iter, width, st, nb),
      prompt_iter,
      writer,
      log,
    )
    rollout_spec = hook.spec if hook else spec  # e.g. the guard's rung (a resumed run's)
    source = make_rollouts(rollout_spec, setup, prompt_iter, width, state, next_batch)
    # The code of every stretch of the run: a resumed run carries its earlier ones.
    code_keys = _with_code(
      resumed.get(provenance.SEGMENTS, []) if resumed else [],
      provenance.code_key(provenance.code_state()),
    )
    try:
      return _train(
        spec,
        setup,
        state,
        state_shardings,
        tx,
        source,
        ckpt,
        writer,
        start,
        log,
        hook,
        schedule_steps=schedule_steps,
        stop=stop,
        reference=reference,
        digests=digests,
        code_keys=code_keys,
      )
    finally:
      source.close()
      if hook:
        hook.close()  # the source it switched to, if any
  finally:
    writer.close()
    ckpt.close()


def make_rollouts(spec: RunSpec, setup: Setup, prompt_iter, width: int, state, next_batch: int):
  """The rollout source `rollout.mode` names, starting at batch `next_batch`."""
  m, r = setup.models, spec.rollout
  ecfg = engine_config(spec, jnp.dtype(spec.student.dtype).name)
  scfg = sampler_config(spec, m.tokenizer.eos_id, ecfg.kv, m.student_cfg.real_vocab_size)
  train_step.check_rollout_loss(scfg, loss_config(spec))
  teacher_topk.check_top_k(spec.train.teacher_top_k, m.teacher_cfg.real_vocab_size)
  worker = rollout_worker.RolloutWorker(
    prompt_iter,
    m.tokenizer,
    width,
    ecfg,
    scfg,
    m.student_cfg,
    jax.random.wrap_key_data(np.asarray(state.rng)),
    m.mesh,
    teacher=(m.teacher_params, m.teacher_cfg) if r.score_teacher else None,
    score_rewards=rl.needs_reward(spec.train.loss),
    rollout_mesh=rollout_worker.rollout_mesh(r, spec.data.batch_size, m.mesh),
    samples_per_prompt=r.samples_per_prompt,
    on_policy_fraction=spec.train.on_policy_fraction,
    teacher_top_k=spec.train.teacher_top_k,
    teacher_temperature=spec.teacher.temperature,
    reward=spec.train.reward,
  )
  if r.mode == "sync":
    return sources.SyncRollouts(worker, first_batch=next_batch, stale_k=r.stale_k)
  return async_rollouts.AsyncRollouts(
    worker,
    max_lag=r.max_lag,
    stale_policy=r.stale_policy,
    max_ahead=None if r.max_ahead < 0 else r.max_ahead,
    first_batch=next_batch,
    producer_timeout_s=r.producer_timeout_s,
    dispatch=r.dispatch,
  )


def make_step_fn(
  spec: RunSpec, setup: Setup, state_shardings, tx, schedule_steps: int | None = None
):
  """The jitted OPD train step, (state, teacher_params, rollout) -> (state, metrics), with the
  state donated and laid out as `state_shardings`."""
  m, t = setup.models, spec.train
  return train_state.jit_step(
    train_step.train_step,
    state_shardings,
    tx=tx,
    student_cfg=m.student_cfg,
    teacher_cfg=m.teacher_cfg,
    loss_cfg=loss_config(spec),
    microbatches=t.microbatches,
    remat=t.remat,
    lr_schedule=train_state.make_schedule(t.lr, schedule_steps or t.steps, t.warmup_steps),
  )


class _LagBreakdown:
  """`mismatch/*` means per version lag over a log window: mismatch/kl/lag_k, ...

  So that staleness and numerics can be told apart in async runs.
  """

  KEYS = ("mismatch/kl", "mismatch/k3", "mismatch/abs_logp_diff")

  def __init__(self):
    self._sums: dict[tuple[str, int], list[float]] = {}

  def add(self, lag: int, scalars: dict[str, float]) -> None:
    for key in self.KEYS:
      if key in scalars:
        self._sums.setdefault((key, lag), []).append(scalars[key])

  def window(self) -> dict[str, float]:
    out = {f"{key}/lag_{lag}": float(np.mean(v)) for (key, lag), v in self._sums.items()}
    self._sums = {}
    return out


def _with_code(code_keys: list[str], key: str) -> list[str]:
  """`code_keys` (the code of each stretch of a run, oldest first) with `key` added when the
  code has changed since the last stretch."""
  return [*code_keys] if code_keys and code_keys[-1] == key else [*code_keys, key]


def _final_provenance(spec: RunSpec, code_keys: list[str]) -> dict:
  """`provenance.provenance(spec)` at the end, with the code of every stretch of the run under
  `provenance.SEGMENTS` when there was more than one (the end's included)."""
  out = provenance.provenance(spec)
  keys = _with_code(code_keys, provenance.code_key(out))
  if len(set(keys)) > 1:
    out[provenance.SEGMENTS] = keys
  return out


def _train(
  spec: RunSpec,
  setup,
  state,
  state_shardings,
  tx,
  rollouts,
  ckpt,
  writer,
  start,
  log,
  hook=None,
  schedule_steps: int | None = None,
  stop: StopOnSignal | None = None,
  reference=None,
  digests: dict | None = None,
  code_keys: list[str] | None = None,
) -> dict:
  """The step loop: sample, update, publish, log, evaluate, checkpoint.

  `code_keys` (`provenance.code_key`s, oldest first) names the code of each stretch of the run
  so far; every checkpoint keeps it, and the result's provenance lists it when the run was
  trained by more than one version (a resume under other code, or code changed while it ran).

  `schedule_steps` is the length of `tx`'s learning-rate schedule (`schedule_length`;
  None = train.steps), stored in every checkpoint for a resumed run to keep. `reference` is
  the frozen starting student of GRPO's KL penalty (`setup.reference_student`; None without
  one), passed to every step and never saved. `digests` (`run_history.start_digests`) goes
  into every checkpoint and into the result, as "start_digests".

  `hook` (a `hooks.StepHook`: the budget guard with `budget.file`) sees every step's scalars
  after the
  publish, adds `budget/*` to them and may switch the rollout source it returns.
  """
  m, t = setup.models, spec.train
  step_fn = make_step_fn(spec, setup, state_shardings, tx, schedule_steps)
  step = int(state.step)
  rollouts.publish(state.params, step)
  stale_k = getattr(rollouts, "stale_k", 0)
  if step > 0 and stale_k > 0:
    log(
      f"resumed at step {step} with rollout.stale_k={stale_k}: the versions before step {step} "
      f"are not kept, so the next {min(stale_k, step)} batches sample with a lag below "
      f"{stale_k} (a straight run differs there; rollout/sources.py, Resume)"
    )
  if hook:
    rollouts = hook.begin(step, state, rollouts)
  writer.write_text(step, "rollout/engine", rollouts.describe())
  evaluator = Evaluator(spec, setup, writer) if setup.eval_set is not None else None
  initial = evaluator(step, state.params) if evaluator else None
  quality = initial
  log(
    f"step {step}: "
    + (evaluate.summary(initial, evaluator.metric) if evaluator else "evaluation off")
    + f" (setup {time.time() - start:.0f}s, teacher bootstrap "
    f"{setup.teacher_info['seconds']:.0f}s)\nrollouts: {rollouts.describe()}"
  )

  def save(step):
    resume = rollouts.resume_state()
    extra = {
      "data_state": data.state_to_json(resume["data_state"]).decode(),
      "next_batch": resume["next_batch"],
      "weight_version": step,
      "config": run_fingerprint(spec),
      "schedule_steps": schedule_steps or t.steps,  # the learning-rate schedule's length
      "heldout_slice": evaluate.takes_heldout_slice(spec),  # trained without it (resume check)
      run_history.START_DIGESTS: digests or {},  # the teacher and warm start it started from
      provenance.SEGMENTS: code_keys or [],  # the code of each stretch so far
    }
    if hook:
      extra[hook.EXTRA_KEY] = hook.checkpoint_extra()  # the rung a resumed run keeps
    ckpt.save(step, state, extra)

  progress = progress_lib.Progress(t.steps)
  lag_breakdown = _LagBreakdown()
  loop_start, first_step, stopped_by = time.time(), step, None
  paused = 0.0  # seconds spent evaluating and checkpointing, left out of train_wall
  with contextlib.nullcontext(stop) if stop else StopOnSignal() as stop:
    while step < t.steps:
      signalled = stop.agreed()  # the same answer on every process
      if signalled is not None or 0 < t.stop_after <= step:
        if signalled is None:
          stopped_by, why = "stop_after", f"train.stop_after={t.stop_after} reached"
        else:
          stopped_by, by = signalled
          why = f"{stopped_by} received" + (f" by process {by}" if jax.process_count() > 1 else "")
        if ckpt.latest_step() != step:
          save(step)
        log(f"{why}: stopped at step {step}; checkpoint saved, rerun to resume")
        break
      rollout = next(rollouts)
      train_start = time.perf_counter()
      state, metrics = step_fn(state, m.teacher_params, rollout, reference)
      scalars = _scalars(metrics)
      train_seconds = time.perf_counter() - train_start
      lag_breakdown.add(step - int(rollout.weight_version), scalars)
      step += 1
      if not np.isfinite(scalars["loss/total"]):
        raise ValueError(
          f"non-finite loss {scalars['loss/total']} at step {step}; stopping. The last good "
          f"checkpoint ({ckpt.latest_step()}) in {ckpt.directory} is kept"
        )
      rollouts.publish(state.params, step)
      if hook:
        rollouts = hook.after_step(step, state, scalars, rollouts)
      if step % t.log_every == 0 or step == t.steps:
        window, lags = rollouts.window_stats()
        scalars.update(window)
        scalars.update(lag_breakdown.window())
        scalars.update(
          {
            "perf/train_seconds": train_seconds,
            "perf/sampler_traces": decode_loop.trace_count(),
            "perf/steps_per_s": (step - first_step) / (time.time() - loop_start),
            "perf/train_wall_seconds": time.time() - loop_start - paused,
          }
        )
        writer.write_scalars(step, scalars)
        writer.write_histogram(step, "rollout/version_lag", lags)
        mask = _to_host(rollout.completion_mask) > 0
        advantages = _to_host(metrics["per_token/advantage_bc"])[mask]
        writer.write_histogram(step, "loss/advantage", advantages)
        shown = ("loss/total", "teacher/reverse_kl", "rl/reward_mean")  # those the loss logs
        log(progress.line(step, {k: scalars[k] for k in shown if k in scalars}))
      pause_start = time.time()
      if evaluator and (step % t.eval_every == 0 or step == t.steps):
        writer.write_scalars(step, {"perf/train_wall_seconds": pause_start - loop_start - paused})
        quality = evaluator(step, state.params)
        log(f"step {step}: {evaluate.summary(quality, evaluator.metric, teacher=False)}")
      if step % t.checkpoint_every == 0 or step == t.steps:
        save(step)
      paused += time.time() - pause_start
  writer.write_scalars(step, {"perf/wall_seconds": time.time() - start})
  result = {
    "start_step": first_step,
    "end_step": step,
    "stopped_by": stopped_by,
    **(evaluate.before_after(initial, quality, evaluator.metric) if evaluator else {}),
    "teacher_bootstrap_seconds": setup.teacher_info["seconds"],
    run_history.START_DIGESTS: digests or {},
    "wall_seconds": time.time() - start,
    provenance.KEY: _final_provenance(spec, code_keys or []),  # the code and config
  }
  out = export_dir(spec, writer.workdir)
  if stopped_by is None and out is not None:  # a finished run exports its student
    export_student(spec, m, state.params, out, log, step=step)
    result["export_dir"] = out
  log(f"done: {result}")
  return result
