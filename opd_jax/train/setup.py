"""A run's setup, from a validated config to the objects the loop and the checks use.

- config → typed settings, done once: `task_config`, `engine_config` (the rollout engine's
  T(θ)), `sampler_config`, `loss_config`;
- the prompt stream: `prompt_source`, `process_prompt_batches` (each process its own rows),
  `prompt_width`;
- the models: `prepare_models` (mesh, tokenizer, student, the teacher from its cache or its
  bootstrap, the held-out set) → `Setup`; `warm_started_student` (the built-in student's
  supervised warm start, cached);
- the train state: `initial_state` (fresh, or resumed from the workdir's latest checkpoint
  after `io.run_history.check_same_run`), `schedule_length` (what a resumed run does with
  another `train.steps`), `run_seed`, `reference_student` (the frozen starting student of
  GRPO's KL penalty, `train.kl_coef`).

The admission check, the sensitivity scan, the prefix-shift measurement and the export build
their models with these same functions, so that what they score is what the trainer trains.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from opd_jax.config import check as config_check
from opd_jax.config import spec as spec_lib
from opd_jax.config.spec import RunSpec
from opd_jax.data import pipeline as data
from opd_jax.data import prompts, task
from opd_jax.inference import sampler, transform
from opd_jax.io import build
from opd_jax.io.run_history import check_same_run, run_fingerprint
from opd_jax.model import kvcache, sharding
from opd_jax.rollout import worker as rollout_worker
from opd_jax.train import evaluate, pretrain, train_step
from opd_jax.train import mismatch_metrics as mismatch
from opd_jax.train import state as train_state


def run_spec(config) -> RunSpec:
  """The run's frozen spec from a ConfigDict that `config.check.validate` accepted: each
  block read into its sub-spec by field name (`spec.from_mapping`), once. `values` keeps
  every key's repr as the ConfigDict held it, which is what a checkpoint records."""
  values = tuple((k, repr(v)) for k, v in config_check.flatten(config))
  return dataclasses.replace(spec_lib.from_mapping(RunSpec, config), values=values)


def task_config(spec: RunSpec) -> task.TaskConfig:
  d = spec.data
  return task.TaskConfig(num_operands=d.num_operands, max_operand=d.max_operand, kind=d.task)


def engine_config(spec: RunSpec, compute_dtype: str) -> transform.EngineConfig:
  """The rollout configuration named by `spec.rollout` (its fields of the same names).

  `kv_cache=auto` stores the cache in the engine's compute dtype: bf16 for
  `weights=bf16`, the trainer's dtype for `trainer` and `fp8` (whose unquantized
  leaves keep the trainer's dtype); any other value names its dtype in
  `kvcache.KV_CACHE_NAMES` (bf16, fp8 e4m3, fp8_e5m2, fp4 e2m1); a block or group size of
  0 is None (per output channel).
  """
  r = spec.rollout
  engine_dtype = "bfloat16" if r.weights == "bf16" else compute_dtype
  kv_dtype = {"auto": engine_dtype, **kvcache.KV_CACHE_NAMES}[r.kv_cache]
  kv = kvcache.KVCacheSpec(
    dtype=kv_dtype, granularity=r.kv_granularity, bf16_layers=tuple(r.kv_bf16_layers)
  )
  return spec_lib.derive(
    transform.EngineConfig,
    r,
    kv=kv,
    weight_block_size=r.weight_block_size or None,
    weight_group_size=r.weight_group_size or None,
  )


def sampler_config(spec: RunSpec, eos_id: int, kv: kvcache.KVCacheSpec, vocab_size: int):
  """The training rollouts' `SamplerConfig` (`spec.rollout`'s fields of the same names); it
  returns the behaviour distribution that `mismatch/kl` needs (full for small vocabularies,
  top-k plus a tail above)."""
  r = spec.rollout
  top = spec.train.mismatch_top_k or mismatch.default_return_topk(vocab_size)
  return spec_lib.derive(
    sampler.SamplerConfig,
    r,
    stop_tokens=(eos_id,),
    kv=kv,
    return_topk=top,
    attention=r.decode_attention,
  )


def loss_config(spec: RunSpec) -> train_step.LossConfig:
  """`spec.train`'s fields of `LossConfig`'s names, with the loss's name, the clips (<= 0 is
  None: off) and the sampling settings the loss must know."""
  t = spec.train
  return spec_lib.derive(
    train_step.LossConfig,
    t,
    name=t.loss,
    is_clip=t.is_clip if t.is_clip > 0 else None,
    advantage_clip=t.advantage_clip if t.advantage_clip > 0 else None,
    temperature=spec.rollout.temperature,
    teacher_temperature=spec.teacher.temperature,
    group_size=spec.rollout.samples_per_prompt,
  )


def prompt_source(spec: RunSpec, task_cfg):
  """Training prompts: the JSONL file when given, else the built-in task. (`run` uses the
  file's prepared `prompts.PromptSet` from `preflight.check` instead.)"""
  if spec.data.prompt_file:
    return data.JsonlSource(spec.data.prompt_file)
  return task.TaskSource("train", spec.data.train_size, spec.seed, task_cfg)


def process_prompt_batches(source, batch_size: int, seed: int):
  """This process's rows of every global prompt batch, as a resumable grain dataset.

  Every process reads the same global batches (`batch_size` prompts, shuffled by `seed`) and
  keeps the contiguous rows [i·b, (i+1)·b), b = batch_size / n, for process i of n. Gathered
  in process order (`RolloutWorker.draw_prompts`), the slices are the one-process batch row
  for row, so each prompt meets the same sampling key however many processes share the run:
  2 processes x 4 devices reproduce 1 x 8 (tests/cli/test_launch.py). The iterator state (what a
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
  spec: RunSpec,
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
  models = build.build_models(spec, plan)
  task_cfg = task_config(spec)
  tok = models.tokenizer
  teacher_info = {"cached": True, "seconds": 0.0, "path": spec.teacher.checkpoint}
  cache_dir = spec.teacher.cache_dir or os.path.join(workdir, "teacher_cache")
  if not spec.teacher.checkpoint:
    t = spec.teacher
    kwargs = dict(
      task_cfg=task_cfg,
      tokenizer=tok,
      steps=t.pretrain_steps,
      lr=t.pretrain_lr,
      batch_size=t.pretrain_batch_size,
      seed=spec.seed,
    )
    key = pretrain.teacher_key(
      dataclasses.asdict(t.arch),
      task_cfg,
      t.pretrain_steps,
      t.pretrain_lr,
      t.pretrain_batch_size,
      spec.seed,
      build.tokenizer_path(spec),
      t.dtype,
      t.target_accuracy,
      t.max_pretrain_steps,
      t.target_eval_size,
    )
    models.teacher_params, teacher_info = pretrain.bootstrap_teacher(
      models.teacher_cfg,
      lambda: build.materialize(models, "teacher"),
      cache_dir=cache_dir,
      key=key,
      dtype=build.DTYPES[t.dtype],
      mesh=models.mesh,
      train_kwargs=kwargs,
      target_accuracy=t.target_accuracy,
      max_steps=t.max_pretrain_steps,
      accuracy_fn=teacher_accuracy_fn(spec, task_cfg, models),
      log=log,
    )
  eval_set = None
  if spec.train.eval_every and eval_prompts is not None:
    eval_set = evaluate.make_prompt_eval_set(eval_prompts, tok, scorer, spec.data.batch_size)
  elif spec.train.eval_every and not spec.data.prompt_file:  # the task is trained
    heldout = task.TaskSource("heldout", spec.data.eval_size, spec.seed + 1, task_cfg)
    eval_set = evaluate.make_eval_set(heldout, tok, task_cfg.max_prompt_tokens)
  return Setup(models, task_cfg, teacher_info, eval_set, cache_dir)


def teacher_accuracy_fn(spec: RunSpec, task_cfg: task.TaskConfig, models: build.Models):
  """params -> the teacher's held-out accuracy that `teacher.target_accuracy` is held to
  (`pretrain.heldout_accuracy`): greedy exact match on the first `teacher.target_eval_size`
  prompts of the task's held-out split (seed + 1: the prompts of the trainer's
  quality/teacher_accuracy, never a training example), decoded for the task's longest
  completion (`task_cfg.max_completion_tokens`). The set is built on the first call."""
  sets = []

  def accuracy(params) -> float:
    if not sets:
      size = spec.teacher.target_eval_size
      heldout = task.TaskSource("heldout", size, spec.seed + 1, task_cfg)
      sets.append(evaluate.make_eval_set(heldout, models.tokenizer, task_cfg.max_prompt_tokens))
    return pretrain.heldout_accuracy(
      params, models.teacher_cfg, sets[0], models.tokenizer, task_cfg.max_completion_tokens
    )

  return accuracy


def schedule_length(spec: RunSpec, resumed: dict, log=print) -> int:
  """The learning-rate schedule's length (`state.make_optimizer`'s total_steps).

  A fresh run: `train.steps`. A resumed run: the length its checkpoint was trained with
  (extra["schedule_steps"]); when `train.steps` differs from it, `train.resume_schedule`
  decides, and the log says which: `keep` keeps the stored schedule (train.steps only moves
  where the run stops; past the stored length the rate stays at its final 10%), `rebuild`
  builds a new schedule over `train.steps` (the rate jumps to the new schedule's value at
  the current step), `error` refuses. Checkpoints written before the length was stored use
  `train.steps`.

  Args:
    spec: the run's spec.
    resumed: the restored checkpoint's extra data ({} for a fresh run).
    log: where the decision is reported.

  Raises:
    ValueError: `train.resume_schedule=error` and `train.steps` differs from the stored length.
  """
  t = spec.train
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
  spec: RunSpec, setup: Setup, tx, abstract, state_shardings, ckpt, prompt_iter, log, resumed=None
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
    check_same_run(extra["config"], run_fingerprint(spec), ckpt.directory, log)
    evaluate.check_resumed_slice(extra.get("heldout_slice"), spec)
    prompt_iter.set_state(data.state_from_json(extra["data_state"]))
    if resumed is not None:
      resumed.update(extra)
    log(f"resumed from step {latest} in {ckpt.directory}")
    return state, int(extra.get("next_batch", latest))
  params = warm_started_student(spec, setup, log, setup.cache_dir or None)
  seed = run_seed(spec)
  return jax.device_put(train_state.init_state(params, tx, seed), state_shardings), 0


def reference_student(
  spec: RunSpec, setup: Setup, state, param_shardings, resumed: bool, log=print
):
  """π_ref of GRPO's KL penalty (`train.kl_coef` > 0): a frozen copy of the run's starting
  student, laid out as `param_shardings` (the student's); None when the penalty is off.

  It is frozen data beside the train state, like the teacher: never in the optimizer state and
  never checkpointed (one more copy of the student's params in device memory). A fresh run
  copies `state.params` (an explicit copy: the train step donates the state). A resumed run
  rebuilds the starting student (`warm_started_student`: the warm start's cache, the HF
  checkpoint, or the seeded initialisation), which is the step-0 student bit for bit when the
  warm start is read from its cache.
  """
  if not spec.train.kl_coef > 0:
    return None
  if not resumed:
    return jax.device_put(state.params, param_shardings, may_alias=False)
  log("rebuilding the starting student as the reference of train.kl_coef's KL penalty")
  params = warm_started_student(spec, setup, log, setup.cache_dir or None)
  return jax.device_put(params, param_shardings)


def run_seed(spec: RunSpec) -> int:
  """The OPD run's own seed (data order, rollout sampling): `train.seed`, or `seed` when it
  is -1. The models, the teacher bootstrap and the warm start keep `seed`, so runs that differ
  only in `train.seed` share their teacher and their starting student."""
  return spec.seed if spec.train.seed < 0 else spec.train.seed


def warm_started_student(spec: RunSpec, setup: Setup, log=print, cache_dir: str | None = None):
  """The student a fresh run starts from: the HF checkpoint's params, or the built-in
  student after `student.warmup_steps` supervised steps (seed + 7).

  The warm start is a pure function of its settings, so with `cache_dir` it is saved there
  once (`student-<key>`, an HF checkpoint keyed like the teacher cache by
  `pretrain.teacher_key` of the student's settings) and loaded by later runs and checks:
  bit-identical params (f32 safetensors), without the supervised steps. `cache_dir` is local
  or a URI (`pretrain.is_cached` / `load_cached` / `save_cached`).
  """
  m, s = setup.models, spec.student
  if s.checkpoint or not s.warmup_steps:
    return build.materialize(m, "student")
  directory = None
  if cache_dir:
    key = pretrain.teacher_key(
      dataclasses.asdict(s.arch),
      setup.task_cfg,
      s.warmup_steps,
      s.warmup_lr,
      s.warmup_batch_size,
      spec.seed + 7,
      build.tokenizer_path(spec),
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
    seed=spec.seed + 7,
    mesh=m.mesh,
    log=log,
  )
  # Another run that saved the same warm start first saved the same params: save_cached keeps
  # its entry.
  if directory:
    host = sharding.to_host(params)  # every process: params may span them
    if jax.process_index() == 0 and not pretrain.is_cached(directory):
      pretrain.save_cached(directory, m.student_cfg, host)
  return params


def process_count_errors(spec: RunSpec, num_processes: int) -> list[str]:
  """What a config cannot do with `num_processes` processes, each naming what to use instead
  (checked before any weights load; the launch scripts' dry runs are held to it)."""
  r, errors = spec.rollout, []
  if num_processes > 1 and r.mode == "async" and r.dispatch == "thread":
    errors.append(
      f"rollout.dispatch='thread' runs in one process only ({num_processes} processes): two "
      "host threads issuing multi-process programs can deadlock their collectives; use "
      "rollout.dispatch='auto' (inline with several processes) or 'inline'"
    )
  if spec.data.batch_size % num_processes:
    errors.append(
      f"data.batch_size={spec.data.batch_size} must be a multiple of the process count "
      f"({num_processes}): every process reads its own rows of each batch"
    )
  if r.devices % num_processes:
    errors.append(
      f"rollout.devices={r.devices} must be a multiple of the process count ({num_processes}): "
      "every process gives the same number of its devices to rollouts"
    )
  return errors


def check_shapes(spec: RunSpec, task_cfg: task.TaskConfig, mesh) -> None:
  """Refuses settings that would silently truncate completions or not shard."""
  r = spec.rollout
  if not spec.data.prompt_file and r.max_new_tokens < task_cfg.max_completion_tokens:
    raise ValueError(
      f"rollout.max_new_tokens={r.max_new_tokens} is shorter than the task's longest "
      f"completion ({task_cfg.max_completion_tokens} tokens with eos)"
    )
  errors = process_count_errors(spec, jax.process_count())
  if errors:
    raise ValueError("; ".join(errors))
  batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
  if spec.data.batch_size % batch_devices:  # the process count: process_count_errors
    raise ValueError(
      f"data.batch_size={spec.data.batch_size} must be a multiple of the data x fsdp "
      f"devices ({batch_devices})"
    )
  supervised = (  # the supervised batches, placed as the prompts are (`pretrain`)
    ("teacher.pretrain_batch_size", spec.teacher.pretrain_batch_size, not spec.teacher.checkpoint),
    (
      "student.warmup_batch_size",
      spec.student.warmup_batch_size,
      not spec.student.checkpoint and spec.student.warmup_steps > 0,
    ),
  )
  for key, size, used in supervised:
    if used and size % batch_devices:
      raise ValueError(
        f"{key}={size} must be a multiple of the data x fsdp devices ({batch_devices}): its "
        "supervised batches are split over them as the prompts are"
      )
  rollout_worker.rollout_mesh(
    r, spec.data.batch_size, mesh
  )  # a rollout mesh must fit the devices and batch
  rows = spec.data.batch_size * r.samples_per_prompt  # the rollout batch: completions
  if rows % (spec.train.microbatches * batch_devices):
    raise ValueError(
      f"data.batch_size x rollout.samples_per_prompt = {rows} completions must be a multiple "
      f"of train.microbatches ({spec.train.microbatches}) x the data x fsdp devices "
      f"({batch_devices}), so that every micro-batch has rows on every device"
    )
  train_step.check_microbatches(loss_config(spec), spec.train.microbatches, rows)
