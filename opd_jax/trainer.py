"""The OPD training loop: `run(config, workdir)`.

    for step: rollout = next(rollouts)             # engine weights T(θ_v), version v
              state, m = train_step(state, teacher, rollout)
              rollouts.publish(state.params, step + 1)
              log / evaluate / checkpoint

`rollouts` is `SyncRollouts` or `AsyncRollouts` (`rollout.mode`); the loop is the
same for both (see `opd_jax.rollouts` for the weight-version semantics).

Setup order: models (HF checkpoints or built-in), the teacher bootstrap (cached),
the student warm start, then resume from the latest checkpoint in the workdir if
there is one. Everything written (TensorBoard, metrics.jsonl, checkpoints' JSON)
comes from process 0 only.

Held-out evaluation (`Evaluator`, `opd_jax.evaluate`) runs at the start, every
`train.eval_every` steps and at the end, on the set `preflight.check` chose (`evaluate.plan`):
`data.eval_file`, else a held-out slice of `data.prompt_file` (never trained on), else the
built-in task's split when the task is trained. `train.eval_every=0` runs no evaluation (no
greedy decodes), and the run's summary then has no quality fields.

SIGTERM and SIGINT stop the run at the next step boundary: it saves a checkpoint,
stops the rollout producer and returns (a second SIGINT interrupts at once). The
same command resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from opd_jax import (
  build,
  config_check,
  data,
  engine,
  evaluate,
  hf,
  kvcache,
  metrics_writer,
  mismatch,
  preflight,
  pretrain,
  prompts,
  rl,
  sampler,
  sharding,
  task,
  teacher_topk,
  train_step,
)
from opd_jax import rollouts as rollouts_lib
from opd_jax.mismatch import guard as guard_lib


def task_config(config) -> task.TaskConfig:
  return task.TaskConfig(num_operands=config.data.num_operands, max_operand=config.data.max_operand)


def engine_config(config, compute_dtype: str) -> engine.EngineConfig:
  """The rollout configuration named by `config.rollout`.

  `kv_cache=auto` stores the cache in the engine's compute dtype: bf16 for
  `weights=bf16`, the trainer's dtype for `trainer` and `fp8` (whose unquantized
  leaves keep the trainer's dtype).
  """
  r = config.rollout
  engine_dtype = "bfloat16" if r.weights == "bf16" else compute_dtype
  kv_dtype = {"auto": engine_dtype, "bf16": "bfloat16", "fp8": "float8_e4m3fn"}[r.kv_cache]
  return engine.EngineConfig(
    weights=r.weights,
    weight_block_size=r.weight_block_size or None,
    bf16_layers=tuple(r.bf16_layers),
    noise_sigma=r.noise_sigma,
    kv=kvcache.KVCacheSpec(
      dtype=kv_dtype, granularity=r.kv_granularity, bf16_layers=tuple(r.kv_bf16_layers)
    ),
    noise_layers=tuple(r.noise_layers),
    noise_modules=tuple(r.noise_modules),
    kernel=r.kernel,
  )


def sampler_config(config, eos_id: int, kv: kvcache.KVCacheSpec, vocab_size: int):
  """The training rollouts' `SamplerConfig`; it returns the behaviour distribution
  that `mismatch/kl` needs (full for small vocabularies, top-k plus a tail above)."""
  r = config.rollout
  top = config.train.mismatch_top_k or mismatch.default_return_topk(vocab_size)
  return sampler.SamplerConfig(
    max_new_tokens=r.max_new_tokens,
    temperature=r.temperature,
    top_k=r.top_k,
    top_p=r.top_p,
    stop_tokens=(eos_id,),
    kv=kv,
    return_topk=top,
  )


def loss_config(config) -> train_step.LossConfig:
  t = config.train
  return train_step.LossConfig(
    name=t.loss,
    is_clip=t.is_clip if t.is_clip > 0 else None,
    advantage_clip=t.advantage_clip if t.advantage_clip > 0 else None,
    advantage_baseline=t.advantage_baseline,
    jsd_beta=t.jsd_beta,
    temperature=config.rollout.temperature,
    teacher_top_k=t.teacher_top_k,
    teacher_temperature=config.teacher.temperature,
  )


def prompt_source(config, task_cfg):
  """Training prompts: the JSONL file when given, else the built-in task. (`run` uses the
  file's prepared `prompts.PromptSet` from `preflight.check` instead.)"""
  if config.data.prompt_file:
    return data.JsonlSource(config.data.prompt_file)
  return task.TaskSource("train", config.data.train_size, config.seed, task_cfg)


def process_prompt_batches(source, batch_size: int, seed: int):
  """This process's rows of every global prompt batch, as a resumable grain dataset.

  Every process reads the same global batches (`batch_size` prompts, shuffled by `seed`) and
  keeps the contiguous rows [i·b, (i+1)·b), b = batch_size / n, for process i of n. Gathered
  in process order (`RolloutEngine.draw_prompts`), the slices are the one-process batch row
  for row, so each prompt meets the same sampling key however many processes share the run:
  2 processes x 4 devices reproduce 1 x 8 (tests/test_launch.py). The iterator state (what a
  checkpoint stores) is the global batch position, the same on every process.
  """
  n, i = jax.process_count(), jax.process_index()
  rows = batch_size // n
  batches = data.prompt_batches(source, batch_size, seed)
  return batches.map(lambda batch: {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()})


def prompt_width(source, tokenizer, task_cfg, from_file: bool) -> int:
  """P: the task's longest prompt, or the longest prompt in the file (with bos)."""
  if not from_file:
    return task_cfg.max_prompt_tokens
  if isinstance(source, prompts.PromptSet):
    return source.width
  longest = 0
  for i in range(len(source)):
    try:
      longest = max(longest, len(prompts.record_ids(source[i], tokenizer)[1]))
    except ValueError as e:
      raise ValueError(f"prompt {i} of {getattr(source, 'path', 'the prompts')}: {e}") from e
  return longest


@dataclasses.dataclass
class Setup:
  """Everything the loop needs, built before the first step."""

  models: build.Models
  task_cfg: task.TaskConfig
  teacher_info: dict
  eval_set: evaluate.EvalSet | None  # None: no evaluation (train.eval_every=0)
  cache_dir: str = ""  # bootstrapped teachers and warm-started students; "" = no cache


def prepare_models(
  config,
  workdir: str,
  log=print,
  plan: build.Plan | None = None,
  eval_prompts: prompts.PromptSet | None = None,
  scorer: evaluate.Scorer | None = None,
) -> Setup:
  """Builds models (of `plan`, from `preflight.check`, when given), bootstraps/loads the
  teacher and the held-out set: `eval_prompts` (`preflight.Checked.eval_prompts`, scored by
  `scorer`) when given, else the built-in task's held-out split when the run trains on the
  task, else none (a prompt file without its held-out prompts, or train.eval_every=0)."""
  models = build.build_models(config, plan)
  task_cfg = task_config(config)
  tok = models.tokenizer
  teacher_info = {"cached": True, "seconds": 0.0, "path": config.teacher.checkpoint}
  cache_dir = config.teacher.cache_dir or os.path.join(workdir, "teacher_cache")
  if not config.teacher.checkpoint:
    t = config.teacher
    kwargs = dict(
      task_cfg=task_cfg,
      tokenizer=tok,
      steps=t.pretrain_steps,
      lr=t.pretrain_lr,
      batch_size=t.pretrain_batch_size,
      seed=config.seed,
    )
    key = pretrain.teacher_key(
      t.arch.to_dict(),
      task_cfg,
      t.pretrain_steps,
      t.pretrain_lr,
      t.pretrain_batch_size,
      config.seed,
      build.tokenizer_path(config),
      t.dtype,
    )
    models.teacher_params, teacher_info = pretrain.bootstrap_teacher(
      models.teacher_cfg,
      lambda: build.materialize(models, "teacher"),
      cache_dir=cache_dir,
      key=key,
      dtype=build.DTYPES[t.dtype],
      mesh=models.mesh,
      train_kwargs=kwargs,
      log=log,
    )
  eval_set = None
  if config.train.eval_every and eval_prompts is not None:
    eval_set = evaluate.make_prompt_eval_set(eval_prompts, tok, scorer, config.data.batch_size)
  elif config.train.eval_every and not config.data.prompt_file:  # the task is trained
    heldout = task.TaskSource("heldout", config.data.eval_size, config.seed + 1, task_cfg)
    eval_set = evaluate.make_eval_set(heldout, tok, task_cfg.max_prompt_tokens)
  return Setup(models, task_cfg, teacher_info, eval_set, cache_dir)


def _scalars(metrics) -> dict[str, float]:
  """The replicated scalar metrics as floats (per-token arrays stay on device)."""
  return {k: float(v) for k, v in metrics.items() if not k.startswith("per_token/")}


def _to_host(x) -> np.ndarray:
  """A batch-sharded array as one host array, gathered across processes if needed."""
  if jax.process_count() > 1:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


# Keys that may change between a run and its resumption (how long and how often).
RESUMABLE_KEYS = (
  "train.steps",
  "train.stop_after",
  "train.log_every",
  "train.eval_every",
  "train.checkpoint_every",
  "train.keep_checkpoints",
  "export.dir",  # where the finished student is written, not how it is trained
  "train.resume_schedule",  # what a resume with another train.steps does (schedule_length)
  "data.eval_file",  # what is evaluated; a change of the held-out slice is refused (initial_state)
  "data.eval_metric",
)


def run_fingerprint(config) -> dict[str, str]:
  """Every config value that shapes the training trajectory, as strings; `tokenizer` as the
  tokenizer it resolves to (`build.tokenizer_path`), so "" and "char" agree."""
  out = {k: repr(v) for k, v in config_check.flatten(config) if k not in RESUMABLE_KEYS}
  return out | {"tokenizer": repr(build.tokenizer_path(config))}


def _check_same_run(
  saved: dict[str, str], current: dict[str, str], directory: str, log=print
) -> None:
  """Refuses to resume checkpoints of another config. Keys the saved config lacks (added to
  the config since the checkpoint was written) are named in the log, not compared."""
  added = sorted(set(current) - set(saved))
  if added:
    log(f"checkpoints in {directory} predate the config keys {', '.join(added)}; not compared")
  changed = sorted(k for k in saved if saved[k] != current.get(k))
  if changed:
    details = ", ".join(f"{k}: {saved.get(k)} -> {current.get(k)}" for k in changed[:5])
    raise ValueError(
      f"the checkpoints in {directory} come from a different config ({details}); "
      "resume with the same config or use a new --workdir"
    )


def schedule_length(config, resumed: dict, log=print) -> int:
  """The learning-rate schedule's length (`train_step.make_optimizer`'s total_steps).

  A fresh run: `train.steps`. A resumed run: the length its checkpoint was trained with
  (extra["schedule_steps"]); when `train.steps` differs from it, `train.resume_schedule`
  decides, and the log says which: `keep` keeps the stored schedule (train.steps only moves
  where the run stops; past the stored length the rate stays at its final 10%), `rebuild`
  builds a new schedule over `train.steps` (the rate jumps to the new schedule's value at
  the current step), `error` refuses. Checkpoints written before the length was stored use
  `train.steps`.

  Args:
    config: the run's config.
    resumed: the restored checkpoint's extra data ({} for a fresh run).
    log: where the decision is reported.

  Raises:
    ValueError: `train.resume_schedule=error` and `train.steps` differs from the stored length.
  """
  t = config.train
  if not resumed:
    return t.steps
  if "schedule_steps" not in resumed:
    log(f"the checkpoint does not record its schedule length: using train.steps={t.steps}")
    return t.steps
  stored = int(resumed["schedule_steps"])
  if stored == t.steps:
    return stored
  change = f"train.steps changed from {stored} to {t.steps} on resume"
  if t.resume_schedule == "error":
    raise ValueError(
      f"{change}, but the checkpoints were trained with a {stored}-step learning-rate schedule "
      f"and train.resume_schedule='error'; set train.resume_schedule='keep' (keep it and stop "
      f"at step {t.steps}) or 'rebuild' (a new schedule over {t.steps} steps), or resume with "
      f"train.steps={stored}"
    )
  if t.resume_schedule == "keep":
    log(
      f"{change}: keeping the checkpoint's {stored}-step learning-rate schedule "
      f"(train.resume_schedule='keep'); the run stops at step {t.steps}"
    )
    return stored
  log(
    f"{change}: rebuilding the learning-rate schedule over {t.steps} steps "
    f"(train.resume_schedule='rebuild'); the rate continues from the new schedule's value"
  )
  return t.steps


def initial_state(
  config, setup: Setup, tx, abstract, state_shardings, ckpt, prompt_iter, log, resumed=None
):
  """The TrainState to start from, and the rollout source's next batch index:
  restored from the latest checkpoint (with the data iterator's position), or the
  warm-started student at step 0.

  `abstract` is `eval_shape` of the initial state; `state_shardings` its shardings.
  `resumed`, when given, is updated with the restored checkpoint's extra data.
  """
  latest = ckpt.latest_step()
  if latest is not None:
    target = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings
    )
    state, extra = ckpt.restore(latest, target)
    _check_same_run(extra["config"], run_fingerprint(config), ckpt.directory, log)
    evaluate.check_resumed_slice(extra.get("heldout_slice"), config)
    prompt_iter.set_state(data.state_from_json(extra["data_state"]))
    if resumed is not None:
      resumed.update(extra)
    log(f"resumed from step {latest} in {ckpt.directory}")
    return state, int(extra.get("next_batch", latest))
  params = warm_started_student(config, setup, log, setup.cache_dir or None)
  seed = run_seed(config)
  return jax.device_put(train_step.init_state(params, tx, seed), state_shardings), 0


def run_seed(config) -> int:
  """The OPD run's own seed (data order, rollout sampling): `train.seed`, or `seed` when it
  is -1. The models, the teacher bootstrap and the warm start keep `seed`, so runs that differ
  only in `train.seed` share their teacher and their starting student."""
  return config.seed if config.train.seed < 0 else config.train.seed


def warm_started_student(config, setup: Setup, log=print, cache_dir: str | None = None):
  """The student a fresh run starts from: the HF checkpoint's params, or the built-in
  student after `student.warmup_steps` supervised steps (seed + 7).

  The warm start is a pure function of its settings, so with `cache_dir` it is saved there
  once (`student-<key>`, an HF checkpoint keyed like the teacher cache by
  `pretrain.teacher_key` of the student's settings) and loaded by later runs and checks:
  bit-identical params (f32 safetensors), without the supervised steps. `cache_dir` is local
  or a URI (`pretrain.is_cached` / `load_cached` / `save_cached`).
  """
  m, s = setup.models, config.student
  if s.checkpoint or not s.warmup_steps:
    return build.materialize(m, "student")
  directory = None
  if cache_dir:
    key = pretrain.teacher_key(
      s.arch.to_dict(),
      setup.task_cfg,
      s.warmup_steps,
      s.warmup_lr,
      s.warmup_batch_size,
      config.seed + 7,
      build.tokenizer_path(config),
      s.dtype,
    )
    directory = os.path.join(cache_dir, f"student-{key}")
    if pretrain.is_cached(directory):
      shardings = build.param_shardings(m.student_cfg, m.mesh, build.DTYPES[s.dtype])
      params = pretrain.load_cached(directory, build.DTYPES[s.dtype], shardings)
      log(f"warm-started student loaded from cache {directory}")
      return params
  log(f"warm-starting the student ({s.warmup_steps} supervised steps)")
  params = pretrain.supervised_train(
    build.materialize(m, "student"),
    m.student_cfg,
    task_cfg=setup.task_cfg,
    tokenizer=m.tokenizer,
    steps=s.warmup_steps,
    lr=s.warmup_lr,
    batch_size=s.warmup_batch_size,
    seed=config.seed + 7,
    mesh=m.mesh,
    log=log,
  )
  # Another run that saved the same warm start first saved the same params: save_cached keeps
  # its entry.
  if directory and jax.process_index() == 0 and not pretrain.is_cached(directory):
    pretrain.save_cached(directory, m.student_cfg, jax.device_get(params))
  return params


def export_dir(config, workdir: str) -> str | None:
  """Where a finished run writes its student (`export.dir`): "" is `<workdir>/export`,
  "none" is no export (None), anything else that directory."""
  d = config.export.dir
  if d == "none":
    return None
  return d or os.path.join(workdir, "export")


# In an export of a run's checkpoint: {"step": the checkpoint's step, "config": the run's
# `run_fingerprint`}, which lets `admission.RunHistory` read that step's student from the
# export's safetensors instead of the orbax checkpoint.
EXPORT_RECORD = "opd_jax_run.json"


def export_student(
  config, models: build.Models, params, out: str, log=print, *, step: int
) -> list[str]:
  """Writes the student `params` as a Hugging Face checkpoint in `out` (`hf.export_student`):
  the files of the run's tokenizer (`build.tokenizer_path`; the built-in character tokenizer
  when "char"), and the generation defaults of the HF checkpoint the student came from, if any.

  `params` are those of the run's checkpoint `step`: `out` also gets the `EXPORT_RECORD` of
  that step and the run's config, written last, after the weights.

  Every process must call it (params are gathered across processes); process 0 writes.
  Returns the names of the files in `out` (on other processes: []).
  """
  if jax.process_count() > 1:
    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() != 0:
    return []
  tokenizer_path = build.tokenizer_path(config)
  files = hf.export_student(
    out,
    models.student_cfg,
    params,
    models.tokenizer,
    tokenizer_dir=None if tokenizer_path == "char" else tokenizer_path,
    source_dir=config.student.checkpoint or None,
  )
  with open(os.path.join(out, EXPORT_RECORD), "w", encoding="utf-8") as f:
    json.dump({"step": step, "config": run_fingerprint(config)}, f, indent=1, sort_keys=True)
  files = sorted({*files, EXPORT_RECORD})
  log(f"student exported as a Hugging Face checkpoint to {out}: {', '.join(files)}")
  return files


def _check_shapes(config, task_cfg: task.TaskConfig, mesh) -> None:
  """Refuses settings that would silently truncate completions or not shard."""
  r = config.rollout
  if not config.data.prompt_file and r.max_new_tokens < task_cfg.max_completion_tokens:
    raise ValueError(
      f"rollout.max_new_tokens={r.max_new_tokens} is shorter than the task's longest "
      f"completion ({task_cfg.max_completion_tokens} tokens with eos)"
    )
  batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
  if config.data.batch_size % int(np.lcm(batch_devices, jax.process_count())):
    raise ValueError(
      f"data.batch_size={config.data.batch_size} must be a multiple of the data x fsdp "
      f"devices ({batch_devices}) and of the process count ({jax.process_count()})"
    )
  rollouts_lib.rollout_mesh(config, mesh)  # a rollout mesh must fit the devices and batch
  rows = config.data.batch_size * r.samples_per_prompt  # the rollout batch: completions
  if rows % (config.train.microbatches * batch_devices):
    raise ValueError(
      f"data.batch_size x rollout.samples_per_prompt = {rows} completions must be a multiple "
      f"of train.microbatches ({config.train.microbatches}) x the data x fsdp devices "
      f"({batch_devices}), so that every micro-batch has rows on every device"
    )
  train_step.check_microbatches(loss_config(config), config.train.microbatches, rows)


class Evaluator:
  """Held-out quality at given steps, written to the metrics writer (`setup.eval_set`, which
  must not be None). The frozen teacher is decoded and scored once."""

  def __init__(self, config, setup: Setup, writer):
    self._config, self._setup, self._writer = config, setup, writer
    self.metric = setup.eval_set.metric  # quality/<who>_<metric>: accuracy or score
    self.teacher_score = None
    m = setup.models
    kv = engine_config(config, jnp.dtype(config.student.dtype).name).kv
    self._sampling = sampler_config(config, m.tokenizer.eos_id, kv, m.student_cfg.real_vocab_size)

  def __call__(self, step: int, params) -> dict[str, float]:
    m = self._setup.models
    metrics, samples = evaluate.evaluate(
      params,
      m.student_cfg,
      m.teacher_params,
      m.teacher_cfg,
      self._setup.eval_set,
      m.tokenizer,
      self._config.rollout.max_new_tokens,
      self.teacher_score,
      train_sampling=self._sampling,
      teacher_temperature=self._config.teacher.temperature,
    )
    self.teacher_score = metrics.get(f"quality/teacher_{self.metric}")
    self._writer.write_scalars(step, metrics)
    self._writer.write_text(step, "quality/student_samples", "\n".join(samples))
    return metrics


def run(config: ml_collections.ConfigDict, workdir: str, log=print) -> dict:
  """Runs OPD as configured; returns the quality at the start and the end."""
  config_check.validate(config)
  start = time.time()
  is_main = jax.process_index() == 0
  log = log if is_main else (lambda *a, **k: None)
  checked = preflight.check(config, workdir, log)  # everything checkable before weights load
  _check_shapes(config, task_config(config), checked.plan.mesh)
  setup = prepare_models(config, workdir, log, checked.plan, checked.eval_prompts, checked.scorer)
  m, t = setup.models, config.train
  log(build.summary(m))
  source = checked.train_prompts
  if source is None:
    source = prompt_source(config, setup.task_cfg)
  width = prompt_width(source, m.tokenizer, setup.task_cfg, bool(config.data.prompt_file))
  prompt_iter = iter(process_prompt_batches(source, config.data.batch_size, run_seed(config)))
  tx = train_step.make_optimizer(t.lr, t.steps, t.warmup_steps, t.weight_decay, t.grad_clip)
  abstract = jax.eval_shape(lambda p: train_step.init_state(p, tx, config.seed), m.student_params)
  state_shardings = sharding.tree_shardings(abstract, m.mesh)
  # orbax is imported by the loop that saves: the admission check and the export import this
  # module for its setup and load it only when they restore, so that a check can import it
  # while it compiles (`admission.run_admission`).
  from opd_jax import checkpointing

  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), t.keep_checkpoints)
  writer = metrics_writer.MetricsWriter(workdir, enabled=is_main)
  try:
    resumed = {}
    state, next_batch = initial_state(
      config, setup, tx, abstract, state_shardings, ckpt, prompt_iter, log, resumed
    )
    schedule_steps = schedule_length(config, resumed, log)
    if schedule_steps != t.steps:  # a resumed run keeps its checkpoint's schedule
      tx = train_step.make_optimizer(
        t.lr, schedule_steps, t.warmup_steps, t.weight_decay, t.grad_clip
      )
    m.student_params = None  # donated into the train state; the state owns the student now
    guard = guard_lib.LiveGuard.create(
      config,
      setup,
      state.params,
      resumed,
      lambda cfg, st, nb: make_rollouts(cfg, setup, prompt_iter, width, st, nb),
      prompt_iter,
      writer,
      log,
    )
    rollout_config = guard.config if guard else config  # the guard's rung (a resumed run's)
    source = make_rollouts(rollout_config, setup, prompt_iter, width, state, next_batch)
    try:
      return _train(
        config,
        setup,
        state,
        state_shardings,
        tx,
        source,
        ckpt,
        writer,
        start,
        log,
        guard,
        schedule_steps=schedule_steps,
      )
    finally:
      source.close()
      if guard:
        guard.close()  # the source it switched to, if any
  finally:
    writer.close()
    ckpt.close()


def make_rollouts(config, setup: Setup, prompt_iter, width: int, state, next_batch: int):
  """The rollout source `rollout.mode` names, starting at batch `next_batch`."""
  m, r = setup.models, config.rollout
  ecfg = engine_config(config, jnp.dtype(config.student.dtype).name)
  scfg = sampler_config(config, m.tokenizer.eos_id, ecfg.kv, m.student_cfg.real_vocab_size)
  train_step.check_rollout_loss(scfg, loss_config(config))
  teacher_topk.check_top_k(config.train.teacher_top_k, m.teacher_cfg.real_vocab_size)
  engine_ = rollouts_lib.RolloutEngine(
    prompt_iter,
    m.tokenizer,
    width,
    ecfg,
    scfg,
    m.student_cfg,
    jax.random.wrap_key_data(np.asarray(state.rng)),
    m.mesh,
    teacher=(m.teacher_params, m.teacher_cfg) if r.score_teacher else None,
    score_rewards=rl.needs_reward(config.train.loss),
    rollout_mesh=rollouts_lib.rollout_mesh(config, m.mesh),
    samples_per_prompt=r.samples_per_prompt,
    on_policy_fraction=config.train.on_policy_fraction,
    teacher_top_k=config.train.teacher_top_k,
    teacher_temperature=config.teacher.temperature,
  )
  if r.mode == "sync":
    return rollouts_lib.SyncRollouts(engine_, first_batch=next_batch, stale_k=r.stale_k)
  return rollouts_lib.AsyncRollouts(
    engine_,
    max_lag=r.max_lag,
    stale_policy=r.stale_policy,
    max_ahead=None if r.max_ahead < 0 else r.max_ahead,
    first_batch=next_batch,
    producer_timeout_s=r.producer_timeout_s,
  )


class StopOnSignal(contextlib.AbstractContextManager):
  """Turns SIGTERM and the first SIGINT into a flag the loop checks at step boundaries.

  A second SIGINT raises KeyboardInterrupt as usual. Outside the main thread (where
  Python cannot install handlers) it installs nothing and never fires.

  In a multi-process run the signal may reach one process only (a maintenance event on one
  host, `kill` of one task), so the loop asks `agreed()`, which every process calls at the
  same step boundary: it gathers each process's flag (one int32 per process) and all of them
  stop at that step when any of them was signalled.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: int | None = None
    self._old = {}

  def _handle(self, signum, frame):
    if self.received == signal.SIGINT and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.received = signum

  def agreed(self) -> tuple[str, int] | None:
    """(signal name, index of the first signalled process), the same on every process, or
    None when no process was signalled. A collective when there are several processes: every
    process must call it at the same point of the loop."""
    if jax.process_count() == 1:
      return None if self.received is None else (signal.Signals(self.received).name, 0)
    flags_p = np.asarray(multihost_utils.process_allgather(np.int32(self.received or 0)))
    signalled = np.flatnonzero(flags_p)
    if not signalled.size:
      return None
    first = int(signalled[0])
    return signal.Signals(int(flags_p[first])).name, first

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc_info):
    for s, handler in self._old.items():
      signal.signal(s, handler)


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


def _train(
  config,
  setup,
  state,
  state_shardings,
  tx,
  rollouts,
  ckpt,
  writer,
  start,
  log,
  guard=None,
  schedule_steps: int | None = None,
) -> dict:
  """The step loop: sample, update, publish, log, evaluate, checkpoint.

  `schedule_steps` is the length of `tx`'s learning-rate schedule (`schedule_length`;
  None = train.steps), stored in every checkpoint for a resumed run to keep.

  `guard` (`guard_lib.LiveGuard`, with `budget.file`) sees every step's scalars after the
  publish, adds `budget/*` to them and may switch the rollout source it returns.
  """
  m, t = setup.models, config.train
  loss_cfg = loss_config(config)
  step_fn = train_step.jit_step(
    train_step.train_step,
    state_shardings,
    tx=tx,
    student_cfg=m.student_cfg,
    teacher_cfg=m.teacher_cfg,
    loss_cfg=loss_cfg,
    microbatches=t.microbatches,
    remat=t.remat,
    lr_schedule=train_step.make_schedule(t.lr, schedule_steps or t.steps, t.warmup_steps),
  )
  step = int(state.step)
  rollouts.publish(state.params, step)
  if guard:
    rollouts = guard.begin(step, state, rollouts)
  writer.write_text(step, "rollout/engine", rollouts.describe())
  evaluator = Evaluator(config, setup, writer) if setup.eval_set is not None else None
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
      "config": run_fingerprint(config),
      "schedule_steps": schedule_steps or t.steps,  # the learning-rate schedule's length
      "heldout_slice": evaluate.takes_heldout_slice(config),  # trained without it (resume check)
    }
    if guard:
      extra[guard_lib.EXTRA_KEY] = guard.checkpoint_extra()  # the rung a resumed run keeps
    ckpt.save(step, state, extra)

  progress = metrics_writer.Progress(t.steps)
  lag_breakdown = _LagBreakdown()
  loop_start, first_step, stopped_by = time.time(), step, None
  paused = 0.0  # seconds spent evaluating and checkpointing, left out of train_wall
  with StopOnSignal() as stop:
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
      state, metrics = step_fn(state, m.teacher_params, rollout)
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
      if guard:
        rollouts = guard.after_step(step, state, scalars, rollouts)
      if step % t.log_every == 0 or step == t.steps:
        window, lags = rollouts.window_stats()
        scalars.update(window)
        scalars.update(lag_breakdown.window())
        scalars.update(
          {
            "perf/train_seconds": train_seconds,
            "perf/sampler_traces": sampler.trace_count(),
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
    "wall_seconds": time.time() - start,
  }
  out = export_dir(config, writer.workdir)
  if stopped_by is None and out is not None:  # a finished run exports its student
    export_student(config, m, state.params, out, log, step=step)
    result["export_dir"] = out
  log(f"done: {result}")
  return result
