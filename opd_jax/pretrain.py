"""Supervised pretraining on the built-in task: the teacher bootstrap and the
student warm start.

The teacher is trained once and cached as a Hugging Face checkpoint directory
under `cache_dir/teacher-<key>/`, where the key hashes every setting that shaped
it (architecture, task, steps, lr, batch, seed, tokenizer). A later run with the
same settings loads it instead of training; any change trains a new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import jax

from opd_jax import build, hf, sharding, task, train_step
from opd_jax.model_config import ModelConfig


def supervised_train(
  params,
  cfg: ModelConfig,
  *,
  task_cfg: task.TaskConfig,
  tokenizer,
  steps: int,
  lr: float,
  batch_size: int,
  seed: int,
  mesh,
  log=print,
):
  """Trains `params` for `steps` next-token steps on fresh task examples.

  Example i of step s is `task.make_example(seed, s * batch_size + i)`, so the data is
  a pure function of the seed. Returns the trained params (same shardings).
  """
  if steps == 0:
    return params
  tx = train_step.make_optimizer(lr, steps, min(100, steps // 10), 0.0, 1.0)
  state = train_step.init_state(params, tx, seed)
  state_shardings = sharding.tree_shardings(jax.eval_shape(lambda: state), mesh)
  state = jax.device_put(state, state_shardings)
  step_fn = train_step.jit_step(train_step.sft_step, state_shardings, tx=tx, cfg=cfg)
  batch_sharding = sharding.batch_sharding(mesh, 2)
  start = time.time()
  for s in range(steps):
    examples = [
      task.make_example(seed, s * batch_size + i, "train", task_cfg) for i in range(batch_size)
    ]
    batch = task.encode_batch(examples, tokenizer, task_cfg.seq_len)
    tokens = jax.device_put(batch["tokens"], batch_sharding)
    mask = jax.device_put(batch["loss_mask"], batch_sharding)
    state, metrics = step_fn(state, tokens, mask)
    if (s + 1) % max(steps // 10, 1) == 0 or s + 1 == steps:
      m = jax.device_get(metrics)
      log(
        f"  sft step {s + 1}/{steps} loss={m['loss/sft']:.4f} "
        f"token_acc={m['quality/token_accuracy']:.3f} ({time.time() - start:.0f}s)"
      )
  return state.params


def teacher_key(
  arch: dict,
  task_cfg: task.TaskConfig,
  steps: int,
  lr: float,
  batch_size: int,
  seed: int,
  tokenizer_name: str,
  dtype: str,
) -> str:
  """A stable hash of everything that shapes the bootstrapped teacher."""
  blob = json.dumps(
    {
      "arch": arch,
      "task": repr(task_cfg),
      "steps": steps,
      "lr": lr,
      "batch": batch_size,
      "seed": seed,
      "tokenizer": tokenizer_name,
      "dtype": dtype,
      "format": 1,
    },
    sort_keys=True,
  )
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def bootstrap_teacher(
  cfg: ModelConfig,
  init_params,
  *,
  cache_dir: str,
  key: str,
  dtype,
  mesh,
  train_kwargs: dict,
  log=print,
):
  """Loads the cached teacher for `key`, or trains it from `init_params` and caches it.

  Returns:
    (params, info) where info says whether it came from the cache and how long
    training took.
  """
  directory = os.path.join(cache_dir, f"teacher-{key}")
  shardings = build.param_shardings(cfg, mesh, dtype)
  if os.path.exists(os.path.join(directory, hf.CONFIG_FILE)):
    _, params = hf.load_checkpoint(directory, dtype, shardings=shardings)
    log(f"teacher loaded from cache {directory}")
    return params, {"cached": True, "seconds": 0.0, "path": directory}
  log(f"bootstrapping teacher ({train_kwargs['steps']} supervised steps) -> {directory}")
  start = time.time()
  params = supervised_train(init_params, cfg, mesh=mesh, log=log, **train_kwargs)
  seconds = time.time() - start
  if jax.process_index() == 0:
    tmp = directory + ".tmp"
    hf.save_checkpoint(tmp, cfg, jax.device_get(params))
    os.replace(tmp, directory)  # a killed bootstrap never leaves a half-written cache
  return params, {"cached": False, "seconds": seconds, "path": directory}
