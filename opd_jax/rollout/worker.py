"""The rollout worker: published weights and a prompt batch in, a scored `Rollout` out.

`RolloutWorker` owns what one batch needs, whichever source (sync or async) asks for it:

    params_r = T(θ_v)                      `transform(params, v)`: the engine transform, once
                                           per published version (`inference.transform`)
    prompts  = draw_prompts()              the next batch of the prompt stream
    rollout  = sample(params_r, prompts)   the sampler on the engine's mesh, then the frozen
                                           teacher's logits at the completion positions, the
                                           rewards (RL), off-policy rows; laid out for the
                                           train step

Keys are named streams (`named_stream`: "rollout/sample", "rollout/noise") folded with the
batch index, so a batch's randomness does not depend on which source or thread sampled it.
The worker samples SPMD on the mesh its weights live on: the trainer's mesh, or the rollout
mesh `rollout_mesh` names.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import types
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from opd_jax.config.spec import RolloutSpec
from opd_jax.data import rewards, task
from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import sampler, teacher_forcing, transform
from opd_jax.model import sharding, teacher_topk
from opd_jax.model.config import ModelConfig
from opd_jax.rollout import off_policy


def host_key(seed: int) -> jax.Array:
  """`jax.random.key(seed)`, built on the host when the default PRNG is threefry.

  threefry's seed key is the pair (seed >> 32, seed mod 2^32); wrapping that pair is the same
  key without the two small programs `jax.random.key` compiles on first use, which a one-off
  process (the admission check) would pay for. Other PRNGs, and seeds outside [0, 2^31), go
  through `jax.random.key`.
  """
  impl = jax.config.jax_default_prng_impl
  if impl != "threefry2x32" or not 0 <= seed < 2**31:
    return jax.random.key(seed)
  return jax.random.wrap_key_data(np.array([0, seed], np.uint32), impl=impl)


def named_stream(key, name: str):
  """An independent key stream for `name`: fold_in(key, crc32(name)).

  Sampling and weight noise each get their own stream of the run's key, so no
  rollout key ever equals a model-initialisation key (those come from split(key)).
  """
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


@functools.partial(jax.jit, static_argnums=1)
def _engine_params(params, cfg: transform.EngineConfig, rng):
  return transform.engine_params(params, cfg, rng)


def rollout_mesh(r: RolloutSpec, batch_size: int, train_mesh):
  """The mesh the rollouts run on, or None to sample on the training mesh.

  `rollout.devices` = 0 (the default): the mesh `rollout.mesh_{data,fsdp,tensor}` names over the
  training mesh's devices (-1 takes the devices the others leave), or None when all three are 0.
  `rollout.devices` = n > 0: a mesh over the n devices set apart for rollouts
  (`sharding.split_devices`, the last n / P of each process's), by default of the training
  mesh's own shape when the sets are equal halves (a mirror: weights and rollouts then move
  shard for shard, which is what several processes need) and all data-parallel otherwise.

  Raises:
    ValueError: a shape that does not fit the devices, a `data.batch_size` that its data·fsdp
      shards do not divide (every shard must get whole rows of every batch), or, with several
      processes, a rollout mesh that does not mirror the training mesh.
  """
  shape = (r.mesh_data, r.mesh_fsdp, r.mesh_tensor)
  apart = r.devices
  if shape == (0, 0, 0) and not apart:
    return None
  if 0 in shape and shape != (0, 0, 0):
    raise ValueError(
      f"config.rollout.mesh_data/mesh_fsdp/mesh_tensor must all be 0 (the training mesh) "
      f"or all be set (positive or one -1), got {shape}"
    )
  if apart:
    devices = sharding.split_devices(apart)[1]
    if shape == (0, 0, 0):
      same = len(devices) == train_mesh.size
      shape = tuple(train_mesh.devices.shape) if same else (-1, 1, 1)
  else:
    devices = list(train_mesh.devices.flat)
  mesh = sharding.make_mesh(shape, devices=devices)
  if apart and jax.process_count() > 1 and mesh.devices.shape != train_mesh.devices.shape:
    raise ValueError(
      f"with {jax.process_count()} processes the rollout mesh {dict(mesh.shape)} must mirror "
      f"the training mesh {dict(train_mesh.shape)}: set rollout.devices to half the devices "
      f"({jax.device_count() // 2}) and leave rollout.mesh_* at 0"
    )
  shards = sharding.batch_shards(mesh)
  if batch_size % shards:
    raise ValueError(
      f"data.batch_size={batch_size} must be a multiple of the rollout mesh's "
      f"data x fsdp shards ({shards}, rollout mesh {dict(mesh.shape)})"
    )
  return mesh


def _to_mesh(tree, mesh):
  """`tree` laid out on `mesh` with the training rules (a no-op when it already is)."""
  return sharding.relayout(tree, sharding.tree_shardings(tree, mesh))


def _rewards(rollout: Rollout, tokenizer, kind: str = "exact_match") -> jax.Array:
  """`rewards.rollout_rewards` of `kind` (`rewards.REWARDS`), computed by each process on the
  rows its devices hold."""

  def rows(start, prompt_bp, lens_b, tokens_bc, mask_bc):
    del start
    part = types.SimpleNamespace(  # host rows of the fields rollout_rewards reads
      prompt_tokens=prompt_bp,
      prompt_lens=lens_b,
      completion_tokens=tokens_bc,
      completion_mask=mask_bc,
    )
    return np.asarray(rewards.rollout_rewards(part, tokenizer, kind))

  r = rollout
  fields = (r.prompt_tokens, r.prompt_lens, r.completion_tokens, r.completion_mask)
  return sharding.map_local_rows(rows, *fields)


def _step_rewards(rollout: Rollout, tokenizer) -> Rollout:
  """`rollout` with the step reward (`rewards.step_rewards`): `step_reward_bs` [B, S + 1] and
  `step_index_bc` [B, C], each process scoring the rows its devices hold, and `reward_b` the
  exact-match reward (the answer's column S), so rl/reward_mean reads as with exact match."""

  scored = {}  # row block start -> (credit, index): each block decoded once

  def block(start, prompt_bp, lens_b, tokens_bc, mask_bc):
    if start not in scored:
      part = types.SimpleNamespace(  # host rows of the fields step_rewards reads
        prompt_tokens=prompt_bp,
        prompt_lens=lens_b,
        completion_tokens=tokens_bc,
        completion_mask=mask_bc,
      )
      scored[start] = rewards.step_rewards(part, tokenizer)
    return scored[start]

  r = rollout
  fields = (r.prompt_tokens, r.prompt_lens, r.completion_tokens, r.completion_mask)
  credit_bs = sharding.map_local_rows(lambda *a: block(*a)[0], *fields)
  index_bc = sharding.map_local_rows(lambda *a: block(*a)[1], *fields)
  return r.replace(reward_b=credit_bs[:, -1], step_reward_bs=credit_bs, step_index_bc=index_bc)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "top_k", "temperature"))
def sparse_teacher(params, rollout: Rollout, cfg: ModelConfig, mesh, top_k: int, temperature):
  """The teacher's top-k log-probs plus a tail at the rollout's completion positions
  (`teacher_topk.from_logits` of `teacher_forcing.sharded_completion_logits`), in one program:
  the full
  [B, C, V] logits are a temporary of it and never leave it."""
  logits_bcv, _ = teacher_forcing.sharded_completion_logits(params, rollout, cfg, mesh)
  return teacher_topk.from_logits(logits_bcv, top_k, temperature)


def _shard_rollout(rollout: Rollout, mesh) -> Rollout:
  """Lays the rollout out for the train step: batch over (data, fsdp), scalars replicated.

  On the trainer's own devices this is a jitted reshard, compiled once; from an engine on
  other devices it is a transfer (`sharding.relayout`).
  """
  shardings = jax.tree.map(
    lambda x: sharding.batch_sharding(mesh, x.ndim) if x.ndim else sharding.replicated(mesh),
    rollout,
  )
  return sharding.relayout(rollout, shardings)


class RolloutWorker:
  """Prompts in, sharded `Rollout`s out: the part both sources share.

  Args:
    prompt_batches: iterator of this process's collated prompt batches
      ({"prompt": [B_local strings], ...}); it must support `get_state()`.
    tokenizer: encodes prompts.
    prompt_len: P, padded prompt width.
    engine_cfg: the weight transform (T(θ)) and the KV-cache numerics.
    sampler_cfg: the sampling settings.
    model_cfg: the student's ModelConfig.
    rng: the run's key. Batch n samples with fold_in(stream "rollout/sample", n) and
      version v's weight noise uses fold_in(stream "rollout/noise", v).
    mesh: the device mesh the train step runs on.
    teacher: optional (teacher_params, teacher_cfg). When given, the engine also
      scores every rollout with the frozen teacher (`Rollout.teacher_logits`), as
      verl's and slime's rollout side does, so that forward pass leaves the train
      step; in async mode it then overlaps training. The teacher is only read.
    teacher_top_k: k > 0 (`train.teacher_top_k`): the engine keeps only the teacher's top-k
      log-probs plus a tail bucket (`Rollout.teacher_topk`, at `teacher_temperature`), so
      the rollout carries [B, C, k] instead of the full [B, C, V] logits; 0 keeps the full
      raw logits (`Rollout.teacher_logits`, T = 1; the train step applies the temperature).
    teacher_temperature: τ_T (`teacher.temperature`) of the sparse teacher.
    score_rewards: when True, every rollout also carries `reward_b`, the task's reward of
      each decoded completion (`rewards.rollout_rewards` of kind `reward`), for the RL loss;
      the engine holds the tokenizer, so the reward is computed where the texts are.
    reward: the reward's kind (`train.reward`, one of `rewards.REWARDS`): exact_match (1 or
      0), partial (the share of right steps and answer) or step (exact match in `reward_b`,
      plus each step's credit and each token's step: `Rollout.step_reward_bs`,
      `Rollout.step_index_bc`; the character tokenizer only). Unused without `score_rewards`.
    rollout_mesh: None samples on the mesh the published weights live on (the trainer's,
      or the engine's own devices); a ("data", "fsdp", "tensor") mesh lays the engine's
      weights (and the teacher) out on it with the training rules and samples there.
    samples_per_prompt: n, completions sampled per prompt (`rollout.samples_per_prompt`):
      each prompt of a batch of B prompts fills n adjacent rows, so the rollout has B·n rows
      (`data.batch_size` counts prompts). Each row has its own sampling key, so the n
      completions differ under sampling. Process i's B/P prompts become the contiguous
      rows [i·B·n/P, (i+1)·B·n/P), the rows its own devices decode.
    on_policy_fraction: λ (`train.on_policy_fraction`): below 1, a share 1 − λ of each batch's
      prompts train on their reference completions instead of samples
      (`opd_jax.rollout.off_policy`; the rows are chosen by the key stream "rollout/on_policy"
      and the batch index). The
      realised share is logged as `rollout/on_policy_fraction`.
  """

  def __init__(
    self,
    prompt_batches: Iterator,
    tokenizer,
    prompt_len: int,
    engine_cfg: transform.EngineConfig,
    sampler_cfg: sampler.SamplerConfig,
    model_cfg: ModelConfig,
    rng,
    mesh,
    teacher=None,
    score_rewards: bool = False,
    rollout_mesh=None,
    samples_per_prompt: int = 1,
    on_policy_fraction: float = 1.0,
    teacher_top_k: int = 0,
    teacher_temperature: float = 1.0,
    reward: str = "exact_match",
  ):
    if reward not in rewards.REWARDS:
      raise ValueError(
        f"unknown reward {reward!r} (train.reward); known: {', '.join(rewards.REWARDS)}"
      )
    if score_rewards and reward == rewards.STEP:
      rewards.check_step_tokenizer(tokenizer)
    teacher_topk.check_top_k(teacher_top_k)
    teacher_topk.check_temperature(teacher_temperature)
    self._teacher_top_k, self._teacher_temperature = teacher_top_k, teacher_temperature
    if samples_per_prompt < 1:
      raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    self._mix = None  # λ = 1: every row sampled
    if on_policy_fraction < 1.0:
      seed = off_policy.seed_from_key(named_stream(rng, "rollout/on_policy"))
      self._mix = off_policy.Mix(
        on_policy_fraction, seed, tokenizer, sampler_cfg.max_new_tokens, samples_per_prompt
      )
    self.samples_per_prompt = samples_per_prompt
    self.prompts = prompt_batches
    self._rollout_mesh = rollout_mesh
    if teacher is not None and rollout_mesh is not None:
      teacher = (_to_mesh(teacher[0], rollout_mesh), teacher[1])
    self._score_rewards = score_rewards
    self._reward = reward
    self._teacher = teacher
    self._tokenizer = tokenizer
    self._prompt_len = prompt_len
    self.engine_cfg = engine_cfg
    self._sampler_cfg = sampler_cfg
    self._model_cfg = model_cfg
    self._sample_key = named_stream(rng, "rollout/sample")
    self._noise_key = named_stream(rng, "rollout/noise")
    self._mesh = mesh

  @property
  def devices_apart(self) -> bool:
    """Whether the rollouts run on devices of their own (`rollout.devices`)."""
    mesh = self._rollout_mesh
    return mesh is not None and not set(mesh.devices.flat) <= set(self._mesh.devices.flat)

  def engine_copy(self, params):
    """The copy of θ the engine reads: on the rollout devices when they are apart (a transfer
    between meshes, `sharding.relayout`), else an explicit copy on the params' own devices
    (`may_alias=False`). Either way the trainer may donate `params` to its next step."""
    if self.devices_apart:
      return _to_mesh(params, self._rollout_mesh)
    return jax.device_put(params, jax.tree.map(lambda x: x.sharding, params), may_alias=False)

  def transform(self, params, version: int):
    """params_r = T(θ_version), computed once per version (laid out on the rollout mesh
    when there is one)."""
    params_r = _engine_params(params, self.engine_cfg, jax.random.fold_in(self._noise_key, version))
    if self._rollout_mesh is not None:
      params_r = _to_mesh(params_r, self._rollout_mesh)
    return params_r

  def data_state(self) -> dict:
    """The prompt iterator's position (what a checkpoint stores)."""
    return self.prompts.get_state()

  def draw_prompts(self) -> tuple:
    """The next prompt batch as (tokens [B·n, P], lens [B·n]), each of the B prompts in n
    adjacent rows (n = `samples_per_prompt`), plus its `off_policy.References` [B·n, C] as a
    third item when λ < 1; StopIteration at the end."""
    batch = next(self.prompts)
    refs = None if self._mix is None else self._mix.references(batch)
    tokens_bp, lens_b = task.encode_prompts(
      list(batch["prompt"]), self._tokenizer, self._prompt_len
    )
    if jax.process_count() > 1:
      tokens_bp = multihost_utils.process_allgather(tokens_bp, tiled=True)
      lens_b = multihost_utils.process_allgather(lens_b, tiled=True)
    n = self.samples_per_prompt  # the gathered batch is in process order: repeats stay local
    prompts = np.repeat(np.asarray(tokens_bp), n, axis=0), np.repeat(np.asarray(lens_b), n, axis=0)
    return prompts if refs is None else (*prompts, refs)

  def sample(self, params_r, prompts, batch_index: int, version: int):
    """Samples one batch; returns (train-sharded Rollout, per-batch stats), waiting for it.

    The batch is decoded on the mesh `params_r` lives on, each data·fsdp shard its rows.
    """
    return self.finish(self.dispatch(params_r, prompts, batch_index, version))

  def dispatch(self, params_r, prompts, batch_index: int, version: int) -> Pending:
    """Enqueues one batch's programs and returns without waiting for them (JAX dispatches
    asynchronously; only the RL reward and GKD's reference rows read values on the host).
    `finish` waits for it and returns (Rollout, stats)."""
    start = time.perf_counter()
    mesh = sharding.params_mesh(params_r)
    refs = None
    if isinstance(prompts, tuple) and isinstance(prompts[-1], off_policy.References):
      prompts, refs = prompts[:-1], prompts[-1]  # λ < 1: draw_prompts' references
    if (self._mix is None) != (refs is None):
      raise ValueError(
        "sample() needs prompts with references exactly when on_policy_fraction < 1: pass "
        "this engine's own draw_prompts()"
      )
    rollout = sampler.sample(
      params_r,
      prompts,
      jax.random.fold_in(self._sample_key, batch_index),
      self._sampler_cfg,
      self._model_cfg,
      weight_version=version,
      engine_id=self.engine_cfg.engine_id,
      mesh=mesh,
    )
    on_policy = 1.0
    if self._mix is not None:  # before the teacher scores the rows
      rollout, on_policy = self._mix.apply(rollout, refs, batch_index)
    if self._teacher is not None:
      teacher_params, teacher_cfg = self._teacher
      if self._teacher_top_k:
        k, tau = self._teacher_top_k, self._teacher_temperature
        sparse = sparse_teacher(teacher_params, rollout, teacher_cfg, mesh, k, tau)
        rollout = rollout.replace(teacher_topk=sparse)
      else:
        logits_bcv, _ = teacher_forcing.sharded_completion_logits(
          teacher_params, rollout, teacher_cfg, mesh
        )
        rollout = rollout.replace(teacher_logits=logits_bcv)
    if self._score_rewards and self._reward == rewards.STEP:
      rollout = _step_rewards(rollout, self._tokenizer)
    elif self._score_rewards:
      rollout = rollout.replace(reward_b=_rewards(rollout, self._tokenizer, self._reward))
    num_tokens = jnp.sum(rollout.completion_mask)
    return Pending(_shard_rollout(rollout, self._mesh), num_tokens, on_policy, start)

  def finish(self, pending: Pending):
    """(Rollout, stats) of a dispatched batch, once its sampler has finished.

    `rollout/seconds` runs from the dispatch to the end of this wait: the sampling time when
    `finish` follows `dispatch` at once (`sample`), and an upper bound on it otherwise.
    """
    rollout = pending.rollout
    num_tokens = int(pending.num_tokens)  # waits for the sampler
    seconds = time.perf_counter() - pending.start
    saturated = rollout.kv_saturated_fraction
    stats = {
      "rollout/kv_saturated_fraction": 0.0 if saturated is None else float(saturated),
      "rollout/seconds": seconds,
      "rollout/tokens_per_s": num_tokens / max(seconds, 1e-9),
      "rollout/mean_completion_len": num_tokens / rollout.batch_size,
      "rollout/on_policy_fraction": pending.on_policy,
    }
    return rollout, stats


@dataclasses.dataclass
class Pending:
  """A dispatched batch (`RolloutWorker.dispatch`): its train-sharded rollout, still being
  computed, and what `finish` needs for the stats."""

  rollout: Rollout
  num_tokens: jax.Array
  on_policy: float
  start: float
