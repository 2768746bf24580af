"""The OPD training loop: `run(config, workdir)`.

    for step: rollout = next(rollouts)             # engine weights T(θ_v), version v
              state, m = train_step(state, teacher, rollout)
              rollouts.publish(state.params, step + 1)
              log / evaluate / checkpoint

Setup order: models (HF checkpoints or built-in), the teacher bootstrap (cached),
the student warm start, then resume from the latest checkpoint in the workdir if
there is one. Everything written (TensorBoard, metrics.jsonl, checkpoints' JSON)
comes from process 0 only.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from opd_jax import (
  build,
  checkpointing,
  config_check,
  data,
  engine,
  evaluate,
  kvcache,
  metrics_writer,
  pretrain,
  sampler,
  sharding,
  task,
  train_step,
)
from opd_jax.rollouts import SyncRollouts


def task_config(config) -> task.TaskConfig:
  return task.TaskConfig(num_operands=config.data.num_operands, max_operand=config.data.max_operand)


def engine_config(config, compute_dtype: str) -> engine.EngineConfig:
  """The rollout configuration named by `config.rollout`."""
  r = config.rollout
  kv_dtype = {"auto": compute_dtype, "bf16": "bfloat16", "fp8": "float8_e4m3fn"}[r.kv_cache]
  return engine.EngineConfig(
    weights=r.weights,
    weight_block_size=r.weight_block_size or None,
    bf16_layers=tuple(r.bf16_layers),
    noise_sigma=r.noise_sigma,
    kv=kvcache.KVCacheSpec(
      dtype=kv_dtype, granularity=r.kv_granularity, bf16_layers=tuple(r.kv_bf16_layers)
    ),
  )


def sampler_config(config, eos_id: int, kv: kvcache.KVCacheSpec) -> sampler.SamplerConfig:
  r = config.rollout
  return sampler.SamplerConfig(
    max_new_tokens=r.max_new_tokens,
    temperature=r.temperature,
    top_k=r.top_k,
    top_p=r.top_p,
    stop_tokens=(eos_id,),
    kv=kv,
  )


def prompt_source(config, task_cfg):
  """Training prompts: the JSONL file when given, else the built-in task."""
  if config.data.prompt_file:
    return data.JsonlSource(config.data.prompt_file)
  return task.TaskSource("train", config.data.train_size, config.seed, task_cfg)


def prompt_width(source, tokenizer, task_cfg, from_file: bool) -> int:
  """P: the task's longest prompt, or the longest prompt in the file (with bos)."""
  if not from_file:
    return task_cfg.max_prompt_tokens
  bos = 0 if tokenizer.bos_id is None else 1
  longest = 0
  for i in range(len(source)):
    try:
      longest = max(longest, len(tokenizer.encode(source[i]["prompt"])) + bos)
    except ValueError as e:
      raise ValueError(f"prompt file line {i + 1}: {e}") from e
  return longest


@dataclasses.dataclass
class Setup:
  """Everything the loop needs, built before the first step."""

  models: build.Models
  task_cfg: task.TaskConfig
  teacher_info: dict
  eval_set: evaluate.EvalSet


def prepare_models(config, workdir: str, log=print) -> Setup:
  """Builds models, bootstraps/loads the teacher and the held-out set."""
  models = build.build_models(config)
  task_cfg = task_config(config)
  tok = models.tokenizer
  teacher_info = {"cached": True, "seconds": 0.0, "path": config.teacher.checkpoint}
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
      config.tokenizer,
    )
    cache_dir = t.cache_dir or os.path.join(workdir, "teacher_cache")
    models.teacher_params, teacher_info = pretrain.bootstrap_teacher(
      models.teacher_cfg,
      models.teacher_params,
      cache_dir=cache_dir,
      key=key,
      dtype=build.DTYPES[t.dtype],
      mesh=models.mesh,
      train_kwargs=kwargs,
      log=log,
    )
  heldout = task.TaskSource("heldout", config.data.eval_size, config.seed + 1, task_cfg)
  eval_set = evaluate.make_eval_set(heldout, tok, task_cfg.max_prompt_tokens)
  return Setup(models, task_cfg, teacher_info, eval_set)


def _scalars(metrics) -> dict[str, float]:
  return {k: float(v) for k, v in metrics.items() if not k.startswith("per_token/")}


def run(config: ml_collections.ConfigDict, workdir: str, log=print) -> dict:
  """Runs OPD as configured; returns the final quality metrics."""
  config_check.validate(config)
  start = time.time()
  os.makedirs(workdir, exist_ok=True)
  is_main = jax.process_index() == 0
  log = log if is_main else (lambda *a, **k: None)
  setup = prepare_models(config, workdir, log)
  m, tok = setup.models, setup.models.tokenizer
  mesh, t = m.mesh, config.train
  tx = train_step.make_optimizer(t.lr, t.steps, t.warmup_steps, t.weight_decay, t.grad_clip)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), t.keep_checkpoints)
  writer = metrics_writer.MetricsWriter(workdir, enabled=is_main)
  from_file = bool(config.data.prompt_file)
  source = prompt_source(config, setup.task_cfg)
  width = prompt_width(source, tok, setup.task_cfg, from_file)
  shards = jax.process_count()
  if config.data.batch_size % shards:
    raise ValueError(f"data.batch_size {config.data.batch_size} must divide by {shards} processes")
  prompts = data.prompt_batches(
    source,
    config.data.batch_size // shards,
    config.seed,
    shard_index=jax.process_index(),
    shard_count=shards,
  )
  prompt_iter = iter(prompts)

  abstract = jax.eval_shape(lambda p: train_step.init_state(p, tx, config.seed), m.student_params)
  state_shardings = sharding.tree_shardings(abstract, mesh)
  latest = ckpt.latest_step()
  if latest is None:
    params = m.student_params
    if not config.student.checkpoint and config.student.warmup_steps:
      log(f"warm-starting the student ({config.student.warmup_steps} supervised steps)")
      params = pretrain.supervised_train(
        params,
        m.student_cfg,
        task_cfg=setup.task_cfg,
        tokenizer=tok,
        steps=config.student.warmup_steps,
        lr=config.student.warmup_lr,
        batch_size=config.teacher.pretrain_batch_size,
        seed=config.seed + 7,
        mesh=mesh,
        log=log,
      )
    state = jax.device_put(train_step.init_state(params, tx, config.seed), state_shardings)
  else:
    restored, extra = ckpt.restore(
      latest,
      jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings
      ),
    )
    state = restored
    prompt_iter.set_state(data.state_from_json(extra["data_state"]))
    log(f"resumed from step {latest} in {ckpt.directory}")

  compute_dtype = jnp.dtype(config.student.dtype).name
  ecfg = engine_config(config, compute_dtype)
  scfg = sampler_config(config, tok.eos_id, ecfg.kv)
  loss_cfg = train_step.LossConfig(
    name=t.loss,
    is_clip=t.is_clip if t.is_clip > 0 else None,
    jsd_beta=t.jsd_beta,
    temperature=config.rollout.temperature,
  )
  step_fn = train_step.jit_step(
    train_step.train_step,
    mesh,
    state_shardings,
    tx=tx,
    student_cfg=m.student_cfg,
    teacher_cfg=m.teacher_cfg,
    loss_cfg=loss_cfg,
  )
  rollouts = SyncRollouts(
    prompt_iter,
    tok,
    width,
    ecfg,
    scfg,
    m.student_cfg,
    jax.random.wrap_key_data(np.asarray(state.rng)),
  )
  step = int(state.step)
  rollouts.publish(state.params, step)

  def run_eval(step, teacher_acc=None):
    metrics, samples = evaluate.evaluate(
      state.params,
      m.student_cfg,
      m.teacher_params,
      m.teacher_cfg,
      setup.eval_set,
      tok,
      config.rollout.max_new_tokens,
      teacher_acc,
    )
    writer.write_scalars(step, metrics)
    writer.write_text(step, "quality/student_samples", "\n".join(samples))
    return metrics

  quality = run_eval(step)
  teacher_acc = quality["quality/teacher_accuracy"]
  log(
    f"step {step}: teacher accuracy {teacher_acc:.3f}, "
    f"student accuracy {quality['quality/student_accuracy']:.3f} "
    f"(setup {time.time() - start:.0f}s, teacher bootstrap {setup.teacher_info['seconds']:.0f}s)"
  )
  initial = dict(quality)
  progress = metrics_writer.Progress(t.steps)
  loop_start, first_step = time.time(), step
  while step < t.steps:
    wait_start = time.perf_counter()
    rollout = next(rollouts)
    queue_wait = time.perf_counter() - wait_start
    train_start = time.perf_counter()
    state, metrics = step_fn(state, m.teacher_params, rollout)
    scalars = _scalars(jax.device_get(metrics))
    train_seconds = time.perf_counter() - train_start
    step += 1
    if not np.isfinite(scalars["loss/total"]):
      raise ValueError(
        f"non-finite loss {scalars['loss/total']} at step {step}; stopping. The last good "
        f"checkpoint ({ckpt.latest_step()}) in {ckpt.directory} is kept"
      )
    rollouts.publish(state.params, step)
    if step % t.log_every == 0 or step == t.steps:
      scalars.update(rollouts.last_stats)
      scalars.update(
        {
          "perf/train_seconds": train_seconds,
          "rollout/queue_wait_seconds": queue_wait,
          "perf/sampler_traces": sampler.trace_count(),
          "perf/steps_per_s": (step - first_step) / (time.time() - loop_start),
        }
      )
      writer.write_scalars(step, scalars)
      mask = np.asarray(rollout.completion_mask) > 0
      writer.write_histogram(
        step, "loss/advantage", np.asarray(metrics["per_token/advantage_bc"])[mask]
      )
      log(progress.line(step, {k: scalars[k] for k in ("loss/total", "teacher/reverse_kl")}))
    if step % t.eval_every == 0 or step == t.steps:
      quality = run_eval(step, teacher_acc)
      log(
        f"step {step}: student accuracy {quality['quality/student_accuracy']:.3f} "
        f"KL(student||teacher) {quality['quality/student_teacher_kl']:.4f}"
      )
    if step % t.checkpoint_every == 0 or step == t.steps:
      ckpt.save(
        step,
        state,
        {
          "data_state": data.state_to_json(prompt_iter.get_state()).decode(),
          "weight_version": step,
        },
      )
  writer.write_scalars(step, {"perf/wall_seconds": time.time() - start})
  writer.close()
  ckpt.close()
  result = {
    "teacher_accuracy": teacher_acc,
    "student_accuracy_before": initial["quality/student_accuracy"],
    "student_accuracy_after": quality["quality/student_accuracy"],
    "student_teacher_kl_before": initial["quality/student_teacher_kl"],
    "student_teacher_kl_after": quality["quality/student_teacher_kl"],
    "teacher_bootstrap_seconds": setup.teacher_info["seconds"],
    "wall_seconds": time.time() - start,
  }
  log(f"done: {result}")
  return result
