"""Supervised pretraining on the built-in task: the supervised step (`sft_step`), the teacher
bootstrap and the student warm start.

The teacher is trained once and cached as a Hugging Face checkpoint directory
under `cache_dir/teacher-<key>/`, where the key hashes every setting that shaped
it (architecture, task, steps, lr, batch, seed, tokenizer, and the accuracy target
with its step cap and held-out size). A later run with the same settings loads it
instead of training; any change trains a new one. Beside config.json the entry holds
`bootstrap.json` (`BOOTSTRAP_RECORD`): the steps trained and the held-out accuracy
reached, which a cached load reports.

Training to a target (`train_to_target`): the first phase is the fixed-step bootstrap
(`teacher.pretrain_steps`); when its held-out accuracy is below `teacher.target_accuracy`,
further phases continue from it until the target is met or `teacher.max_pretrain_steps`
is reached. A different CPU (its vector width, its thread count) reduces in another order
and so trains other bits; the target makes the result, not the step count, the same.

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
import jax.numpy as jnp
from etils import epath

from opd_jax.data import task
from opd_jax.io import build, hf, staged_dir
from opd_jax.model import sharding
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.train import evaluate, losses, signals
from opd_jax.train import state as train_state


def sft_loss(params, tokens_bt, loss_mask_bt, cfg: ModelConfig):
  """Next-token cross-entropy −mean_{t: m_t=1} log π_θ(x_t | x_<t), for pretraining."""
  logits_btv = model.forward(params, tokens_bt[:, :-1], cfg)
  logp_bt = losses.token_logprobs(logits_btv, tokens_bt[:, 1:])
  mask_bt = loss_mask_bt[:, 1:]
  loss = -losses.masked_mean(logp_bt, mask_bt)
  correct = jnp.argmax(logits_btv, axis=-1) == tokens_bt[:, 1:]
  return loss, {"loss/sft": loss, "quality/token_accuracy": losses.masked_mean(correct, mask_bt)}


def sft_step(state: train_state.TrainState, tokens_bt, loss_mask_bt, *, tx, cfg: ModelConfig):
  """One supervised update; `loss_mask_bt[b, t]` marks tokens that are targets."""
  (loss, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(
    state.params, tokens_bt, loss_mask_bt, cfg
  )
  return train_state.apply_gradients(state, grads, tx, loss, metrics)


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
  start_index: int = 0,
):
  """Trains `params` for `steps` next-token steps on fresh task examples.

  Example i of step s is `task.make_example(seed, start_index + s * batch_size + i)`, so the
  data is a pure function of the seed; a later phase passes the index after the last one
  used, so that it never repeats an example. The optimizer is AdamW with warmup to `lr` and
  cosine decay to lr/10 over `steps` (`state.make_optimizer`), fresh at every call.
  Returns the trained params (same shardings).
  """
  if steps == 0:
    return params
  tx = train_state.make_optimizer(lr, steps, min(100, steps // 10), 0.0, 1.0)
  state = train_state.init_state(params, tx, seed)
  state_shardings = sharding.tree_shardings(jax.eval_shape(lambda: state), mesh)
  state = jax.device_put(state, state_shardings)
  step_fn = train_state.jit_step(sft_step, state_shardings, tx=tx, cfg=cfg)
  batch_sharding = sharding.batch_sharding(mesh, 2)
  start = time.time()
  for s in range(steps):
    signals.check(f"supervised step {s + 1}/{steps}")  # SIGTERM: stop here (`train.signals`)
    examples = [
      task.make_example(seed, start_index + s * batch_size + i, "train", task_cfg)
      for i in range(batch_size)
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


BOOTSTRAP_RECORD = "bootstrap.json"  # in a teacher entry: `train_to_target`'s record


def save_cached(
  directory: str | os.PathLike, cfg: ModelConfig, params, record: dict | None = None
) -> None:
  """Writes `params` as an HF checkpoint at `directory` so that `is_cached` turns true only
  once every file is complete (module docstring), with `record` as `BOOTSTRAP_RECORD` beside
  it when given. Call it from one process."""
  directory = os.fspath(directory)

  def write(local):
    hf.save_checkpoint(local, cfg, params)
    if record is not None:
      with open(os.path.join(local, BOOTSTRAP_RECORD), "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)

  if "://" not in directory:
    tmp = f"{directory}.tmp{os.getpid()}"
    write(tmp)
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
  with tempfile.TemporaryDirectory(prefix="opd_cache_") as local:
    write(local)  # a new entry's key: nothing of another entry to delete
    staged_dir.upload(local, directory, owned=lambda name: False, last=hf.CONFIG_FILE)


def load_record(directory: str | os.PathLike) -> dict | None:
  """The `BOOTSTRAP_RECORD` of a cache entry, or None when it has none (a student warm start,
  or an entry written before the record existed)."""
  path = epath.Path(directory) / BOOTSTRAP_RECORD
  return json.loads(path.read_text()) if path.exists() else None


def teacher_key(
  arch: dict,
  task_cfg: task.TaskConfig,
  steps: int,
  lr: float,
  batch_size: int,
  seed: int,
  tokenizer_name: str,
  dtype: str,
  target_accuracy: float = 0.0,
  max_steps: int = 0,
  eval_size: int = 0,
) -> str:
  """A stable hash of everything that shapes the bootstrapped teacher.

  With `target_accuracy` > 0 the target, the step cap `max_steps` and the held-out size
  `eval_size` that decide when training stops are hashed too; at 0 (fixed steps, and every
  student warm start) they are left out, so those keys are the ones fixed-step entries
  always had.
  """
  fields = {
    "arch": arch,
    "task": repr(task_cfg),
    "steps": steps,
    "lr": lr,
    "batch": batch_size,
    "seed": seed,
    "tokenizer": tokenizer_name,
    "dtype": dtype,
    "format": 1,
  }
  if target_accuracy > 0:
    fields |= {"target_accuracy": target_accuracy, "max_steps": max_steps, "eval_size": eval_size}
  blob = json.dumps(fields, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


# Phases after the first (`train_to_target`): each this fraction of `pretrain_steps` long,
# with a fresh schedule peaking at this fraction of `pretrain_lr`.
CONTINUE_STEPS_FRACTION = 0.5
CONTINUE_LR_FRACTION = 0.3


def heldout_accuracy(params, cfg: ModelConfig, eval_set, tokenizer, max_new_tokens: int) -> float:
  """The built-in task's greedy exact-match accuracy of `params` on `eval_set`
  (`evaluate.greedy_rollout` and `evaluate.accuracy`, as quality/teacher_accuracy measures it):

      accuracy = (1/N) Σ_b 1[completion_b ends with eos and task.score(prompt_b, completion_b)]
  """
  mesh = sharding.params_mesh(params)
  rollout = evaluate.greedy_rollout(params, cfg, eval_set, max_new_tokens, tokenizer.eos_id, mesh)
  return evaluate.accuracy(rollout, eval_set, tokenizer)[0]


def train_to_target(
  params,
  cfg: ModelConfig,
  *,
  mesh,
  train_kwargs: dict,
  target_accuracy: float,
  max_steps: int,
  accuracy_fn,
  log=print,
):
  """Supervised phases until the held-out accuracy reaches `target_accuracy` or `max_steps`.

  Phase 1 is `supervised_train(**train_kwargs)` exactly (its `steps` and `lr`, data from
  example 0), so a first phase that meets the target gives the fixed-step teacher bit for
  bit. While accuracy_fn(params) < target and fewer than `max_steps` steps are done, phase
  k ≥ 2 trains

      steps_k = min(max(⌊CONTINUE_STEPS_FRACTION · steps_1⌋, 1), max_steps − done)
      lr_k    = CONTINUE_LR_FRACTION · lr_1   (warmup, then cosine decay to lr_k / 10)

  on the examples after the last one used (start index done · batch_size), with a fresh
  AdamW state. Why: the first schedule ended at lr_1 / 10 in a good basin; restarting at the
  full peak would throw much of that away (a warm restart), while a peak between the first
  schedule's start and end moves the params enough to fix the held-out errors left, and new
  examples keep it from memorising the first phase's. Accuracy is measured after every
  phase and logged; the last phase's params are returned (the first to meet the target, or
  those at the cap, with a warning naming the accuracy reached). `target_accuracy` = 0 is
  the fixed-step bootstrap: one phase, not evaluated.

  Args:
    params: the params to train from.
    cfg: their model config.
    mesh: the training mesh.
    train_kwargs: `supervised_train`'s task_cfg, tokenizer, steps, lr, batch_size, seed.
    target_accuracy: in [0, 1]; 0 = off.
    max_steps: the cap on the steps of all phases together (≥ train_kwargs["steps"]).
    accuracy_fn: params -> held-out accuracy (`heldout_accuracy` on a fixed set).
    log: where the phases are reported.

  Returns:
    (params, record) with record = {"steps": total steps, "accuracy": the last measured
    (None when off), "target_accuracy", "max_pretrain_steps", "reached": bool, "phases":
    [{"steps", "lr", "start_index", "accuracy"}, ...]}.
  """
  first_steps, first_lr = train_kwargs["steps"], train_kwargs["lr"]
  batch_size = train_kwargs["batch_size"]
  record = {
    "target_accuracy": target_accuracy,
    "max_pretrain_steps": max_steps,
    "steps": 0,
    "accuracy": None,
    "reached": True,
    "phases": [],
  }
  steps, lr = first_steps, first_lr
  while True:
    k = len(record["phases"]) + 1
    start_index = record["steps"] * batch_size
    kwargs = train_kwargs | {"steps": steps, "lr": lr}
    params = supervised_train(params, cfg, mesh=mesh, log=log, start_index=start_index, **kwargs)
    record["steps"] += steps
    phase = {"steps": steps, "lr": lr, "start_index": start_index, "accuracy": None}
    record["phases"].append(phase)
    if not target_accuracy > 0:
      return params, record
    accuracy = float(accuracy_fn(params))
    phase["accuracy"] = record["accuracy"] = accuracy
    record["reached"] = accuracy >= target_accuracy
    log(
      f"teacher phase {k}: {steps} steps at peak lr {lr:g} -> held-out accuracy "
      f"{accuracy:.4f} (target {target_accuracy:g}, {record['steps']}/{max_steps} steps)"
    )
    if record["reached"]:
      return params, record
    left = max_steps - record["steps"]
    if left <= 0:
      log(
        f"warning: the teacher reached held-out accuracy {accuracy:.4f} after "
        f"{record['steps']} steps (teacher.max_pretrain_steps={max_steps}), below "
        f"teacher.target_accuracy={target_accuracy:g}; continuing with this teacher. Raise "
        "teacher.max_pretrain_steps or lower the target"
      )
      return params, record
    steps = min(max(int(CONTINUE_STEPS_FRACTION * first_steps), 1), left)
    lr = CONTINUE_LR_FRACTION * first_lr


def bootstrap_teacher(
  cfg: ModelConfig,
  init_params,
  *,
  cache_dir: str,
  key: str,
  dtype,
  mesh,
  train_kwargs: dict,
  target_accuracy: float = 0.0,
  max_steps: int = 0,
  accuracy_fn=None,
  log=print,
):
  """Loads the cached teacher for `key`, or trains it from `init_params()` and caches it.

  `init_params` is a zero-argument function giving the params to train from; it is called
  only when the cache has no entry (a random init need not run when it would be discarded).
  Training is `train_to_target` (`target_accuracy` 0: `train_kwargs["steps"]` fixed steps);
  its record is cached beside the checkpoint (`BOOTSTRAP_RECORD`).

  Returns:
    (params, info) where info says whether it came from the cache, how long training took,
    and (when known) the record's "steps", "accuracy", "reached" and "phases".
  """
  directory = os.path.join(cache_dir, f"teacher-{key}")
  shardings = build.param_shardings(cfg, mesh, dtype)
  if is_cached(directory):
    params = load_cached(directory, dtype, shardings)
    record = load_record(directory) or {}
    measured = record.get("accuracy")
    how = "" if measured is None else f": held-out accuracy {measured:.4f}"
    steps = f", {record['steps']} steps" if "steps" in record else ""
    log(f"teacher loaded from cache {directory}{steps}{how}")
    if record and not record.get("reached", True):
      log(
        f"warning: the cached teacher is below teacher.target_accuracy="
        f"{record['target_accuracy']:g} (it stopped at teacher.max_pretrain_steps)"
      )
    info = {"cached": True, "seconds": 0.0, "path": directory}
    return params, info | _record_info(record)
  target = f", target accuracy {target_accuracy:g} within {max_steps}" if target_accuracy else ""
  log(f"bootstrapping teacher ({train_kwargs['steps']} supervised steps{target}) -> {directory}")
  start = time.time()
  params, record = train_to_target(
    init_params(),
    cfg,
    mesh=mesh,
    train_kwargs=train_kwargs,
    target_accuracy=target_accuracy,
    max_steps=max_steps,
    accuracy_fn=accuracy_fn,
    log=log,
  )
  seconds = time.time() - start
  host = sharding.to_host(params)  # every process: params may span them
  if jax.process_index() == 0:  # a killed bootstrap never leaves a half-written cache
    save_cached(directory, cfg, host, record)
  return params, {"cached": False, "seconds": seconds, "path": directory} | _record_info(record)


def _record_info(record: dict) -> dict:
  """The fields of a bootstrap record that `bootstrap_teacher`'s info carries."""
  return {k: record[k] for k in ("steps", "accuracy", "reached", "phases") if k in record}
