"""Supervised pretraining on the built-in task: the teacher bootstrap and the
student warm start.

The teacher is trained once and cached as a Hugging Face checkpoint directory
under `cache_dir/teacher-<key>/`, where the key hashes every setting that shaped
it (architecture, task, steps, lr, batch, seed, tokenizer). A later run with the
same settings loads it instead of training; any change trains a new one.

The cache directory is any `etils.epath` path (`save_cached`, `load_cached`): a local
one is written to a temporary directory and renamed (when two runs bootstrap the same entry
at once, the first rename wins and the other's copy is dropped); on an object store
(gs://bucket/cache) the files are uploaded with config.json last, and an entry counts
only once its config.json exists, so a killed bootstrap never leaves a half-written
entry that a later run would load. An unreadable entry is an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time

import jax
from etils import epath

from opd_jax.data import task
from opd_jax.io import build, hf
from opd_jax.model import sharding
from opd_jax.model.config import ModelConfig
from opd_jax.train import signals, train_step


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
    signals.check(f"supervised step {s + 1}/{steps}")  # SIGTERM: stop here (`train.signals`)
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


def is_cached(directory: str | os.PathLike) -> bool:
  """True when `directory` holds a complete cached checkpoint (its config.json)."""
  return (epath.Path(directory) / hf.CONFIG_FILE).exists()


def load_cached(directory: str | os.PathLike, dtype, shardings):
  """The params of the cached HF checkpoint in `directory` (local or a URI, copied to a local
  temporary directory first), in `dtype` and `shardings`.

  Raises:
    ValueError: the entry cannot be read (a truncated or corrupt file); the message names the
      directory and says to delete it, so that the next run rebuilds it.
  """
  directory = os.fspath(directory)
  try:
    if "://" not in directory:
      return hf.load_checkpoint(directory, dtype, shardings=shardings)[1]
    with tempfile.TemporaryDirectory(prefix="opd_cache_") as local:
      for path in epath.Path(directory).iterdir():
        with open(os.path.join(local, path.name), "wb") as f:
          f.write(path.read_bytes())
      return hf.load_checkpoint(local, dtype, shardings=shardings)[1]
  except (ValueError, OSError) as e:
    raise ValueError(
      f"the cached checkpoint {directory} cannot be read ({e}); delete that directory and "
      "run again to rebuild it"
    ) from e


def save_cached(directory: str | os.PathLike, cfg: ModelConfig, params) -> None:
  """Writes `params` as an HF checkpoint at `directory` so that `is_cached` turns true only
  once every file is complete (module docstring). Call it from one process."""
  directory = os.fspath(directory)
  if "://" not in directory:
    tmp = f"{directory}.tmp{os.getpid()}"
    hf.save_checkpoint(tmp, cfg, params)
    try:
      os.replace(tmp, directory)
    except OSError as e:  # the directory exists and is not empty
      shutil.rmtree(tmp)
      if not is_cached(directory):
        raise ValueError(
          f"cannot write the cache entry {directory}: it exists without {hf.CONFIG_FILE}; "
          "delete it so that the next run rebuilds it"
        ) from e
      # Another run finished the same entry first: the key hashes every setting that shaped
      # it, so its checkpoint stands for this one.
    return
  target = epath.Path(directory)
  target.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix="opd_cache_") as local:
    hf.save_checkpoint(local, cfg, params)
    names = sorted(os.listdir(local), key=lambda n: n == hf.CONFIG_FILE)  # config.json last
    for name in names:
      with open(os.path.join(local, name), "rb") as f:
        (target / name).write_bytes(f.read())


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
  """Loads the cached teacher for `key`, or trains it from `init_params()` and caches it.

  `init_params` is a zero-argument function giving the params to train from; it is called
  only when the cache has no entry (a random init need not run when it would be discarded).

  Returns:
    (params, info) where info says whether it came from the cache and how long
    training took.
  """
  directory = os.path.join(cache_dir, f"teacher-{key}")
  shardings = build.param_shardings(cfg, mesh, dtype)
  if is_cached(directory):
    params = load_cached(directory, dtype, shardings)
    log(f"teacher loaded from cache {directory}")
    return params, {"cached": True, "seconds": 0.0, "path": directory}
  log(f"bootstrapping teacher ({train_kwargs['steps']} supervised steps) -> {directory}")
  start = time.time()
  params = supervised_train(init_params(), cfg, mesh=mesh, log=log, **train_kwargs)
  seconds = time.time() - start
  if jax.process_index() == 0:  # a killed bootstrap never leaves a half-written cache
    save_cached(directory, cfg, jax.device_get(params))
  return params, {"cached": False, "seconds": seconds, "path": directory}
