"""The sampler: the jitted KV-cache decode loop the rollout engine runs; returns a `Rollout`.

`sample(params, prompts, rng, cfg, model_cfg)` pads the prompts to a bucketed
shape on the host, then runs one jitted function that

1. builds the KV cache on the device (never a host copy, so there is nothing to
   donate; the while loop updates it in place),
2. prefills it with the right-padded prompts (all sequences start at position 0),
   without computing prefill logits,
3. runs a `lax.while_loop` of one-token decode steps: step i feeds sequence b's
   previous token (the last prompt token for i = 0) at its own position
   len_b − 1 + i and samples token i from that step's logits.

The loop stops after `max_new_tokens`, when every sequence has produced a stop
token, or when no sequence has a free cache slot left. A sequence whose next
token would need slot ≥ cache_len ends there (its mask stops). Nothing returns
to the host between steps.

Shapes are bucketed so that repeated calls reuse one compiled program: the prompt
width is the next power of two ≥ max(longest prompt, 16) and the batch is padded
to the next power of two with rows that start finished. `SamplerConfig` and
`ModelConfig` are static jit arguments of the jitted core (`inference.decode_loop`), whose
`trace_count()` counts how often it was traced, which tests use to catch recompiles.

Sampling math (the filters, π_b, the draw and the kept set `Rollout.support_ids`) is in
`inference.distribution`.

KV saturation: with an FP8 "tensor"-scaled cache, values beyond the format's largest finite
value times the scale (448 for e4m3, 57,344 for e5m2, 6 for e2m1) are clipped;
`Rollout.kv_saturated_fraction` is the share of the K/V elements written to FP8 layers (prompt
and counted completion tokens) that clipped.

Sharded sampling (`mesh=`): the batch is split over the mesh's ("data", "fsdp") axes
and each shard decodes only its own rows, SPMD, with the params in whatever layout
they carry (FSDP and tensor axes as in training, or a separate rollout mesh). Every
process passes the same global prompts (token ids only); each device receives just
its rows (`jax.make_array_from_callback`), the KV cache is laid out [B over data·fsdp,
S, K over tensor, H], every [B, ...] buffer of the loop is constrained to the batch
layout, and the token choice (top-k, top-p, the kept-set scatter, the inverse-CDF draw)
runs inside a `jax.shard_map` over the batch axes (`distribution.per_shard`), since XLA would
gather the batch to split a top-k or a scatter by rows itself. So the compiled program
never all-gathers the batch: the only cross-shard traffic on the batch side is the
scalar "all rows done?" reduction of the loop condition and the scalar saturation
sums. The uniforms are drawn for the whole batch before the split, so row b meets the
same draw and the same computation as without a mesh: a sharded rollout equals the
unsharded one token for token, greedy or sampled (up to f32 reduction order where
the tensor axis splits a matmul). The batch is padded to a multiple of data·fsdp (not to a power
of two) with rows that start finished, and those padding rows stay in the returned
rollout (mask 0) so that nothing is re-laid out; `sample_program` returns the lowered
program for inspection (`sharding_checks.hlo_collectives`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.data.padding import next_pow2, prompt_bucket
from opd_jax.data.rollout_types import Rollout
from opd_jax.inference.decode_loop import _sample_core
from opd_jax.model import kvcache, sharding
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.model.quant import QArray

COMPUTE_DTYPES = ("float32", "bfloat16")
# The smallest sampling temperature above 0: below it f32 logits / T can overflow to inf for
# finite logits (then inf − inf gives NaN log-probs and a token that is not the argmax); use
# T = 0 (greedy) for the limit.
MIN_TEMPERATURE = 1e-6


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Static, hashable sampling settings (a jit static argument).

  Attributes:
    max_new_tokens: C, tokens to generate per sequence (≥ 1).
    temperature: T; 0 means greedy decoding, else at least `MIN_TEMPERATURE`.
    top_k: keep the k most likely tokens (exactly k; ties go to the lower id); 0 disables it.
    top_p: nucleus mass in (0, 1]; 1 disables the filter.
    stop_tokens: ids that end a sequence (the stop token itself is kept and counted).
    cache_len: KV-cache slots S per sequence; None derives S = prompt bucket + C.
    kv: KV-cache numerics; None stores the cache in the params' compute dtype.
    return_topk: 0 returns no distribution, k > 0 the behaviour top-k log-probs
      with their tail mass, −1 the full behaviour distribution [B, C, V]
      (`train.mismatch_metrics.default_return_topk(V)` picks one from the vocabulary size).
    attention: the attention over the cache, one of `transformer.ATTENTIONS`: "auto" (the
      platform's default, `transformer.resolve_attention`), "blockwise"
      (XLA, the filled prefix in blocks), "pallas" (the same as a Pallas kernel for decode
      steps; interpret mode on CPU) or "reference" (the whole cache); equal to f32 rounding.
  """

  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  cache_len: int | None = None
  kv: kvcache.KVCacheSpec | None = None
  return_topk: int = 0
  attention: str = "auto"

  def __post_init__(self):
    def integer(name, lowest, hint):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lowest:
        raise ValueError(f"{name} must be {hint}, got {value!r}")
      object.__setattr__(self, name, int(value))  # numpy ints hash like Python ints

    integer("max_new_tokens", 1, "a positive int")
    integer("top_k", 0, "an int >= 0 (0 = off)")
    integer("return_topk", -1, "0 (none), k > 0, or -1 (full distribution)")
    if self.cache_len is not None:
      integer("cache_len", 1, "a positive int or None")
    if not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
      raise ValueError(
        f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g} (f32 logits / T overflows "
        f"below it), got {self.temperature!r}"
      )
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_p", float(self.top_p))
    stops = tuple(int(t) for t in self.stop_tokens)
    if any(t < 0 for t in stops):
      raise ValueError(f"stop_tokens must be non-negative token ids, got {stops}")
    object.__setattr__(self, "stop_tokens", stops)
    if self.kv is not None and not isinstance(self.kv, kvcache.KVCacheSpec):
      raise ValueError(f"kv must be a kvcache.KVCacheSpec or None, got {type(self.kv).__name__}")
    if self.attention not in model.ATTENTIONS:
      raise ValueError(
        f"unknown attention {self.attention!r}; allowed: {', '.join(model.ATTENTIONS)}"
      )


def _as_padded_prompts(prompts, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Validates prompts and returns host (tokens [B, P] int32 right-padded, lens [B])."""
  if isinstance(prompts, tuple) and len(prompts) == 2 and getattr(prompts[0], "ndim", 0) == 2:
    tokens_bp = np.asarray(prompts[0])
    lens_b = np.asarray(prompts[1])
    if tokens_bp.ndim != 2 or lens_b.shape != tokens_bp.shape[:1]:
      raise ValueError(
        f"prompt arrays must be tokens [B, P] and lens [B], got shapes "
        f"{tokens_bp.shape} and {lens_b.shape}"
      )
    if tokens_bp.shape[0] == 0:
      raise ValueError("empty batch: no prompts given")
    for i, n in enumerate(lens_b.tolist()):
      if n < 1:
        raise ValueError(f"prompt {i} is empty (length {n}); every prompt needs >= 1 token")
      if n > tokens_bp.shape[1]:
        raise ValueError(f"prompt {i} has length {n} > prompt array width {tokens_bp.shape[1]}")
    width = tokens_bp.shape[1]
    tokens_bp = np.where(np.arange(width)[None, :] < lens_b[:, None], tokens_bp, 0)
  else:
    if not isinstance(prompts, Sequence) or isinstance(prompts, str):
      raise ValueError(
        "prompts must be a list of token-id lists or a (tokens [B, P], lens [B]) pair, "
        f"got {type(prompts).__name__}"
      )
    if len(prompts) == 0:
      raise ValueError("empty batch: no prompts given")
    rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    for i, row in enumerate(rows):
      if row.size == 0:
        raise ValueError(f"prompt {i} is empty; every prompt needs >= 1 token")
    lens_b = np.asarray([row.size for row in rows])
    tokens_bp = np.zeros((len(rows), int(lens_b.max())), np.int64)
    for i, row in enumerate(rows):
      tokens_bp[i, : row.size] = row
  bad = (tokens_bp < 0) | (tokens_bp >= vocab_size)
  if bad.any():
    i, j = np.argwhere(bad)[0]
    raise ValueError(
      f"prompt {i} has token id {tokens_bp[i, j]} at index {j}, outside the vocabulary "
      f"[0, {vocab_size})"
    )
  return tokens_bp.astype(np.int32), lens_b.astype(np.int32)


def _weights_label(params) -> str:
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray))
  if any(isinstance(x, QArray) for x in leaves):
    return "fp8"
  return jnp.dtype(model.compute_dtype(params)).name


def engine_label(params, cfg: SamplerConfig) -> str:
  """A readable id of the engine configuration, e.g. `w=fp8,kv=float8_e4m3fn/token_head,T=1`."""
  kv = cfg.kv or kvcache.KVCacheSpec(dtype=jnp.dtype(model.compute_dtype(params)).name)
  quantized = kv.dtype in kvcache.QUANTIZED_KV_DTYPES
  kv_label = f"{kv.dtype}/{kv.granularity}" if quantized else kv.dtype
  return (
    f"w={_weights_label(params)},kv={kv_label},T={cfg.temperature:g},"
    f"top_k={cfg.top_k},top_p={cfg.top_p:g}"
  )


@dataclasses.dataclass(frozen=True)
class Prepared:
  """The static half of a prepared sampling call (`prepare`): hashable, a jit static argument.

  Attributes:
    cfg: the sampler settings, with the KV spec filled in (the params' dtype when None).
    model_cfg: the model config.
    cache_len: S, the KV-cache slots per sequence.
    batch: B, the caller's rows; the arrays may hold more (padding rows that start finished).
    mesh: the mesh the batch is split over, or None.
  """

  cfg: SamplerConfig
  model_cfg: ModelConfig
  cache_len: int
  batch: int
  mesh: jax.sharding.Mesh | None = None


def prepare(params, prompts, cfg: SamplerConfig, model_cfg: ModelConfig, mesh=None):
  """Validates, pads and places the prompts on the host, as `sample` does before decoding.
  Of `params` (arrays or `jax.ShapeDtypeStruct`s) only the compute dtype is read.

  Returns:
    ((tokens [B', P'], lens [B'], live [B']), Prepared): B' ≥ B is the padded batch (the next
    power of two, or a multiple of data·fsdp with a mesh), P' the prompt bucket. Pass both to
    `sample_prepared`, which can run inside a caller's jit.
  """
  if not isinstance(cfg, SamplerConfig):
    raise ValueError(f"cfg must be a SamplerConfig, got {type(cfg).__name__}")
  dtype = jnp.dtype(model.compute_dtype(params)).name
  if dtype not in COMPUTE_DTYPES:
    raise ValueError(
      f"unsupported params dtype {dtype!r} (from the embedding table); "
      f"allowed: {', '.join(COMPUTE_DTYPES)}"
    )
  tokens_bp, lens_b = _as_padded_prompts(prompts, model_cfg.real_vocab_size)
  batch, width = tokens_bp.shape
  bucket = prompt_bucket(width)
  cache_len = cfg.cache_len or bucket + cfg.max_new_tokens
  for i, n in enumerate(lens_b.tolist()):
    if n > cache_len:
      raise ValueError(
        f"prompt {i} has {n} tokens, longer than the KV cache ({cache_len} slots); "
        "raise SamplerConfig.cache_len or shorten the prompt"
      )
  if cfg.kv is None:
    cfg = dataclasses.replace(cfg, kv=kvcache.KVCacheSpec(dtype=dtype))

  if mesh is None:
    padded_batch = next_pow2(batch)
  else:
    shards = sharding.batch_shards(mesh)
    padded_batch = -(-batch // shards) * shards
  tokens = np.zeros((padded_batch, bucket), np.int32)
  tokens[:batch, :width] = tokens_bp
  lens = np.ones((padded_batch,), np.int32)
  lens[:batch] = lens_b
  live = np.arange(padded_batch) < batch
  inputs = [tokens, lens, live]
  if mesh is not None:  # each device gets only its rows
    inputs = [sharding.place_rows(x, mesh) for x in inputs]
  return tuple(inputs), Prepared(cfg, model_cfg, cache_len, batch, mesh)


def _core_static(prepared: Prepared) -> dict:
  """`_sample_core`'s static arguments."""
  p = prepared
  return {"cfg": p.cfg, "model_cfg": p.model_cfg, "cache_len": p.cache_len, "mesh": p.mesh}


def sample_program(params, prompts, rng, cfg: SamplerConfig, model_cfg: ModelConfig, mesh=None):
  """The jitted sampler core lowered for these inputs (`.compile().as_text()` is its HLO),
  exactly as `sample` would run it."""
  (tokens, lens, live), prepared = prepare(params, prompts, cfg, model_cfg, mesh)
  return _sample_core.lower(params, tokens, lens, live, rng, **_core_static(prepared))


def sample(
  params,
  prompts,
  rng,
  cfg: SamplerConfig,
  model_cfg: ModelConfig,
  weight_version: int = 0,
  engine_id: str | None = None,
  mesh=None,
) -> Rollout:
  """Samples completions for a batch of prompts with a KV cache.

  Args:
    params: the model params pytree (plain or FP8 `QArray` matrices). With a `mesh`,
      laid out on it (any layout: `sharding.tree_shardings` gives the training one).
    prompts: a list of B token-id lists (any lengths ≥ 1), or a pair
      (tokens [B, P] right-padded array, lens [B] array). A list is padded to the bucket of its
      longest prompt; a pair keeps the bucket of its width P, so fixed-shape callers
      always get fixed-shape rollouts. With a mesh: the global batch, the same on every
      process.
    rng: a PRNG key; step i uses fold_in(rng, i).
    cfg: sampler settings (static).
    model_cfg: the model config (static).
    weight_version: the version tag of `params`, stored in the rollout.
    engine_id: stored in the rollout; default `engine_label(params, cfg)`.
    mesh: None decodes the whole batch as one program on the params' device; a
      ("data", "fsdp", "tensor") mesh decodes each data·fsdp shard's rows on that
      shard only (module docstring).

  Returns:
    A `Rollout` with prompt_tokens [B, P'], where P' is the bucketed prompt width,
    and completion arrays [B, C], C = cfg.max_new_tokens. With a mesh, B is rounded up
    to a multiple of data·fsdp (the extra rows have lens 1 and mask 0) and every [B, ...]
    array is split over the batch axes.
  """
  inputs, prepared = prepare(params, prompts, cfg, model_cfg, mesh)
  if engine_id is None:
    engine_id = engine_label(params, cfg)
  return sample_prepared(params, *inputs, rng, prepared, weight_version, engine_id)


def sample_prepared(
  params,
  tokens_bp,
  lens_b,
  live_b,
  rng,
  prepared: Prepared,
  weight_version: int = 0,
  engine_id: str = "",
) -> Rollout:
  """`sample` on inputs from `prepare`. Traceable: a caller can jit all of it, the decode and
  the rollout's assembly, and compile it from shapes before any weights exist
  (`mismatch.measure.start_compiling`).

  Args:
    params: as `sample`'s.
    tokens_bp, lens_b, live_b: the arrays `prepare` returned (or tracers of them).
    rng: a PRNG key; step i uses fold_in(rng, i).
    prepared: the `Prepared` that came with them.
    weight_version: the version tag of `params`, stored in the rollout.
    engine_id: stored in the rollout.

  Returns:
    The `Rollout` `sample` returns.
  """
  mesh, batch = prepared.mesh, prepared.batch
  out = _sample_core(params, tokens_bp, lens_b, live_b, rng, **_core_static(prepared))
  padded_batch = tokens_bp.shape[0]

  def rows(x):
    return x if padded_batch == batch or mesh is not None else x[:batch]

  topk_ids = out.get("topk_ids")
  if "topk_lp" in out and topk_ids is None:  # full distribution, vocabulary order
    topk_ids = _vocab_ids(out["topk_lp"].shape, mesh)

  # Host values are transferred (`device_put`), not converted: `jnp.asarray` of a host array
  # compiles a small program per shape, which a one-off call (the admission check) pays for.
  # With a mesh the prompts are already placed (global arrays) and kept as they are.
  def on_device(x):
    return x if isinstance(x, jax.Array) else jax.device_put(x)

  return Rollout(
    prompt_tokens=rows(on_device(tokens_bp)),
    prompt_lens=rows(on_device(lens_b)),
    completion_tokens=rows(out["tokens"]),
    completion_mask=rows(out["mask"]),
    behaviour_logprobs=rows(out["behaviour_lp"]),
    model_logprobs=rows(out["model_lp"]),
    weight_version=jax.device_put(np.asarray(weight_version, np.int32)),
    topk_logprobs=None if "topk_lp" not in out else rows(out["topk_lp"]),
    topk_ids=None if topk_ids is None else rows(topk_ids),
    tail_logprob=None if "tail_lp" not in out else rows(out["tail_lp"]),
    support_ids=None if "support" not in out else rows(out["support"]),
    kv_saturated_fraction=out["kv_saturated_fraction"],
    engine_id=engine_id,
  )


def _vocab_ids(shape, mesh):
  """int32 [B, C, V] holding 0..V-1 along the last axis (batch-split with a mesh)."""
  if mesh is None:
    return jax.device_put(np.broadcast_to(np.arange(shape[-1], dtype=np.int32), shape))
  layout = sharding.batch_sharding(mesh, len(shape))
  build = jax.jit(
    lambda: jnp.broadcast_to(jnp.arange(shape[-1], dtype=jnp.int32), shape), out_shardings=layout
  )
  return build()
