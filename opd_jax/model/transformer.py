"""Llama / Qwen2 / Qwen3 decoder as pure functions over a params pytree.

Params layout (one model implementation for BF16, F32 and FP8; any matrix may be
a `quant.QArray` instead of a plain array):

    {"embed_vd": [V, D],
     "final_norm_d": [D],
     "lm_head_dv": [D, V],                      # absent when embeddings are tied
     "layers": [                                # L dicts, one per layer
        {"attn_norm_d": [D], "mlp_norm_d": [D],
         "q_dnh": [D, N, H], "k_dkh": [D, K, H], "v_dkh": [D, K, H], "o_nhd": [N, H, D],
         "q_bias_nh", "k_bias_kh", "v_bias_kh",  # when cfg.qkv_bias
         "o_bias_d",                             # when cfg.o_bias
         "q_norm_h", "k_norm_h",                 # when cfg.qk_norm (Qwen3)
         "gate_df": [D, F], "up_df": [D, F], "down_fd": [F, D]}]}

Layers are a Python list rather than a stacked scan so that each layer may have its
own precision (FP8 with BF16 exceptions) and its own KV-cache dtype.

Activations run in the embedding's dtype; norms, softmax and logits in f32. Every
weight matmul goes through `linear`, the one place that knows about weight precision.

Kernel variants. A rollout engine may run the same weights through a different
numerical path (`KERNELS`); the choice travels with the engine's weights as
`params["kernel"] = Kernel(name)`, a pytree node with no leaves whose name is static
(like `QArray.native_fp8`), so `forward`, `forward_with_cache` and the jitted sampler
key their compilation on it without another argument. Absent means "reference", the
path described above. The variants change one numerical step each, in one helper:

  bf16_attention  `attend` as eager bf16 attention runs it: QKᵀ emitted in bf16 (the
                  scores rounded to bf16 before the f32 softmax) and the probabilities
                  rounded to bf16 for P·V, with f32 accumulation; the reference keeps
                  the scores in f32.
  bf16_matmul     every weight matmul (`linear`, the LM head) with both operands
                  rounded to bf16 and f32 accumulation: one bf16 pass, what XLA's
                  default precision does for f32 matmuls on TPU. With bf16 activations
                  and weights it equals the reference up to the rounding of the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.model import decode_attention, kvcache, pallas_decode, quant, quant_compute
from opd_jax.model.config import ModelConfig
from opd_jax.model.quant import QArray, as_dense

KERNELS = ("reference", "bf16_attention", "bf16_matmul")
KERNEL_KEY = "kernel"  # params[KERNEL_KEY]: the engine's kernel variant, when not the reference


@jax.tree_util.register_static
class Kernel:
  """A kernel variant marker for a params pytree: static (no leaves), hashable."""

  def __init__(self, name: str):
    if name not in KERNELS:
      raise ValueError(f"unknown kernel {name!r}; allowed: {', '.join(KERNELS)}")
    self.name = name

  def __eq__(self, other):
    return isinstance(other, Kernel) and other.name == self.name

  def __hash__(self):
    return hash(("Kernel", self.name))

  def __repr__(self):
    return f"Kernel({self.name!r})"


def kernel_of(params) -> str:
  """The kernel variant `params` run with: "reference" unless marked (module docstring)."""
  marker = params.get(KERNEL_KEY)
  return "reference" if marker is None else marker.name


def rms_norm(x, weight_d, eps: float):
  """y = w · x / sqrt(mean(x²) + eps), computed in f32 and cast back to x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight_d.astype(x.dtype) * y.astype(x.dtype)


def apply_rope(x_btnh, positions_bt, inv_freq_h2):
  """Rotary embedding, rotate-half convention: x·cos(pθ) + rot(x)·sin(pθ)."""
  angles = positions_bt[..., None].astype(jnp.float32) * inv_freq_h2  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x_btnh.dtype), jnp.sin(angles).astype(x_btnh.dtype)
  half = x_btnh.shape[-1] // 2
  rotated = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
  return x_btnh * cos + rotated * sin


def attend(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, cfg: ModelConfig, kernel="reference"):
  """softmax(q·kᵀ/√H + mask)·v with grouped KV heads; key s is visible iff k_pos ≤ q_pos.

  Returns [B, T, N, H] in q's dtype; scores and softmax are f32 (with
  kernel="bf16_attention": scores rounded to bf16, probabilities to bf16, P·V
  accumulated in f32).
  """
  b, t, n, h = q_btnh.shape
  k, g = cfg.num_kv_heads, cfg.num_groups
  q_btkgh = q_btnh.reshape(b, t, k, g, h)
  low = kernel == "bf16_attention"
  if low:
    q_btkgh, k_bskh = q_btkgh.astype(jnp.bfloat16), k_bskh.astype(jnp.bfloat16)
  scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
  if low:  # accumulated in f32, emitted and scaled in bf16 (a bf16 GEMM's output)
    scores = (scores.astype(jnp.bfloat16) * jnp.bfloat16(h**-0.5)).astype(jnp.float32)
  else:
    scores = scores * (h**-0.5)
  visible_bts = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
  scores = jnp.where(visible_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  if low:
    v16 = v_bskh.astype(jnp.bfloat16)
    out = jnp.einsum(
      "bkgts,bskh->btkgh", probs.astype(jnp.bfloat16), v16, preferred_element_type=jnp.float32
    )
    return out.astype(q_btnh.dtype).reshape(b, t, n, h)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_bskh.dtype), v_bskh)
  return out.reshape(b, t, n, h)


def linear(x, w, num_in_axes: int = 1, kernel: str = "reference"):
  """y = x · W in x's dtype, contracting x's last `num_in_axes` axes with W's first ones.

  A plain W is cast to x's dtype. A `quant.QArray` is dequantized to x's dtype
  (W8A16, `quant.as_dense`), or, when marked `native_fp8` by
  `quant_compute.prepare_for_compute`, multiplied in fp8 with per-token activation scales
  (W8A8, `quant_compute.fp8_matmul`). With kernel="bf16_matmul" a dense product rounds both
  operands to bf16 and accumulates in f32 (one bf16 pass).

  Args:
    x: activations [..., *in], in the compute dtype.
    w: weight [*in, *out] (plain array or QArray), len(in) = num_in_axes.
    num_in_axes: how many axes are contracted.
    kernel: one of KERNELS (static).

  Returns:
    y [..., *out] in x's dtype.
  """
  if isinstance(w, QArray):
    if w.num_in_axes != num_in_axes:
      raise ValueError(f"QArray has {w.num_in_axes} input axes, the matmul contracts {num_in_axes}")
    if w.native_fp8:
      return quant_compute.fp8_matmul(x, w).astype(x.dtype)
  # Contracting axes in their stored order, so that W [*in, *out] is already the row-major
  # [prod(in), prod(out)] matrix the dot wants; listed last-first (jnp.einsum's order), XLA
  # transposed the whole of a 2-axis W (the o projection) in every call, every decode step.
  x_axes = tuple(range(x.ndim - num_in_axes, x.ndim))
  w_axes = tuple(range(num_in_axes))
  dims = ((x_axes, w_axes), ((), ()))
  if kernel == "bf16_matmul":
    x16, w16 = x.astype(jnp.bfloat16), as_dense(w, jnp.bfloat16)
    y = jax.lax.dot_general(x16, w16, dims, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
  return jax.lax.dot_general(x, as_dense(w, x.dtype), dims, preferred_element_type=x.dtype)


def _qkv(layer, x_btd, positions_bt, cfg: ModelConfig, kernel: str):
  dt = x_btd.dtype
  q = linear(x_btd, layer["q_dnh"], kernel=kernel)
  k = linear(x_btd, layer["k_dkh"], kernel=kernel)
  v = linear(x_btd, layer["v_dkh"], kernel=kernel)
  if cfg.qkv_bias:
    q = q + layer["q_bias_nh"].astype(dt)
    k = k + layer["k_bias_kh"].astype(dt)
    v = v + layer["v_bias_kh"].astype(dt)
  if cfg.qk_norm:
    q = rms_norm(q, layer["q_norm_h"], cfg.rms_norm_eps)
    k = rms_norm(k, layer["k_norm_h"], cfg.rms_norm_eps)
  inv_freq = jnp.asarray(cfg.rope_inv_freq())
  return apply_rope(q, positions_bt, inv_freq), apply_rope(k, positions_bt, inv_freq), v


def _mlp(layer, x_btd, kernel: str):
  """SwiGLU: down(silu(x·gate) ⊙ (x·up))."""
  gate = linear(x_btd, layer["gate_df"], kernel=kernel)
  up = linear(x_btd, layer["up_df"], kernel=kernel)
  return linear(jax.nn.silu(gate) * up, layer["down_fd"], kernel=kernel)


def _block(layer, x_btd, positions_bt, cfg, attn_fn, kernel: str):
  """One pre-norm decoder block; `attn_fn(q, k, v) -> [B, T, N, H]` is its attention."""
  h = rms_norm(x_btd, layer["attn_norm_d"], cfg.rms_norm_eps)
  q, k, v = _qkv(layer, h, positions_bt, cfg, kernel)
  attn = attn_fn(q, k, v)
  out = linear(attn, layer["o_nhd"], num_in_axes=2, kernel=kernel)
  if cfg.o_bias:
    out = out + layer["o_bias_d"].astype(x_btd.dtype)
  x_btd = x_btd + out
  mlp_in = rms_norm(x_btd, layer["mlp_norm_d"], cfg.rms_norm_eps)
  return x_btd + _mlp(layer, mlp_in, kernel)


def _embed(params, tokens_bt):
  embed = params["embed_vd"]
  return jnp.take(as_dense(embed, embed.dtype), tokens_bt, axis=0)


def compute_dtype(params):
  """Activations run in the embedding table's dtype."""
  return params["embed_vd"].dtype


def unembed(params, x_btd, cfg: ModelConfig):
  """Final norm and LM head; logits [B, T, V_real] in f32 (bf16 operands under bf16_matmul).

  An engine's bf16 head (`quant.HeadDtype`, params[quant.HEAD_KEY]) runs the final norm
  and the LM head in bf16 and rounds the logits to bf16 before returning them in f32.

  V_real = `cfg.real_vocab_size`: with a padded embedding table (`cfg.logical_vocab_size`
  > 0) the logits of the padded rows are sliced off after the full-width matmul, so no
  softmax downstream sees them and no sampler can pick them. The matmul itself keeps the
  table's full width (and its vocabulary sharding); only its output is cut.
  """
  low_head = quant.head_dtype_of(params) == "bfloat16"
  if low_head:
    x_btd = x_btd.astype(jnp.bfloat16)
  x_btd = rms_norm(x_btd, params["final_norm_d"], cfg.rms_norm_eps)
  if kernel_of(params) == "bf16_matmul":
    x_btd = x_btd.astype(jnp.bfloat16)
  if cfg.tie_word_embeddings:
    head = as_dense(params["embed_vd"], x_btd.dtype)
    logits_btv = jnp.einsum("btd,vd->btv", x_btd, head, preferred_element_type=jnp.float32)
  else:
    head = as_dense(params["lm_head_dv"], x_btd.dtype)
    logits_btv = jnp.einsum("btd,dv->btv", x_btd, head, preferred_element_type=jnp.float32)
  if low_head:  # a bf16 GEMM's output
    logits_btv = logits_btv.astype(jnp.bfloat16).astype(jnp.float32)
  if cfg.real_vocab_size < cfg.vocab_size:
    logits_btv = logits_btv[..., : cfg.real_vocab_size]
  return logits_btv


# Activation rematerialisation of `forward` (train.remat): the name -> the jax.checkpoint
# policy of what each decoder layer saves for the backward pass (the rest is recomputed).
REMAT_POLICIES = {
  "layer": jax.checkpoint_policies.nothing_saveable,  # only each layer's input is kept
  "dots": jax.checkpoint_policies.dots_saveable,  # matmul outputs kept, elementwise recomputed
  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # weight matmuls
}
REMAT_CHOICES = ("none", *REMAT_POLICIES)


def _plain_block(layer, x_btd, positions_bt, cfg: ModelConfig, kernel: str):
  """`_block` without a cache: keys are the layer's own, at `positions_bt`."""

  def attn_fn(q, k, v):
    return attend(q, k, v, positions_bt, positions_bt, cfg, kernel)

  return _block(layer, x_btd, positions_bt, cfg, attn_fn, kernel)


def layer_fn(remat: str = "none"):
  """The decoder layer `forward` applies: `_plain_block`, or it under `jax.checkpoint`.

  remat="none" stores every intermediate of every layer for the backward pass. A name of
  `REMAT_POLICIES` wraps each layer in `jax.checkpoint` with that policy: the backward pass
  recomputes what the policy does not save (one extra forward of the layer at most), so the
  values and gradients are unchanged and the peak activation memory drops from
  O(L · per-layer intermediates) towards O(L · B·T·D) plus one layer's intermediates.

  Raises:
    ValueError: an unknown name.
  """
  if remat == "none":
    return _plain_block
  if remat not in REMAT_POLICIES:
    raise ValueError(f"unknown remat {remat!r}; allowed: {', '.join(REMAT_CHOICES)}")
  return jax.checkpoint(_plain_block, policy=REMAT_POLICIES[remat], static_argnums=(3, 4))


def forward(params, tokens_bt, cfg: ModelConfig, positions_bt=None, remat: str = "none"):
  """Causal forward without a cache.

  Args:
    params: the params pytree (see module docstring).
    tokens_bt: int tokens [B, T].
    cfg: the model config.
    positions_bt: optional positions [B, T]; defaults to 0..T-1.
    remat: "none", or a `REMAT_POLICIES` name to rematerialise each layer in the backward
      pass (`layer_fn`); the logits are the same.

  Returns:
    logits [B, T, V_real] in f32 (V_real = cfg.real_vocab_size, `unembed`).
  """
  if positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
  kernel = kernel_of(params)
  block = layer_fn(remat)
  x = _embed(params, tokens_bt)
  for layer in params["layers"]:
    x = block(layer, x, positions_bt, cfg, kernel)
  return unembed(params, x, cfg)


ATTENTIONS = ("auto", "blockwise", "reference", "pallas")  # forward_with_cache's attention
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def resolve_attention(attention: str, backend: str | None = None) -> str:
  """The attention over the cache that `attention` runs as on `backend` (JAX's default backend
  when None).

  "auto" is "reference" on a GPU and "blockwise" elsewhere. The blockwise path loops over the
  cache's live blocks with a trip count known only at run time; on a GPU such a loop runs one
  iteration at a time from the host, and on one H200 it was slower than the static-shape masked
  form at every measured context (bf16, batch 1, S 4096: 4.25 against 1.31 ms per step at
  t = 4000, 2.02 against 0.97 at t = 1024, equal at t = 32; docs/bench/decode_scaling.md). On a
  CPU or TPU the loop is compiled in and reads O(t) slots instead of O(S).

  Raises:
    ValueError: an unknown attention, or "pallas" on a GPU (its Triton lowering disagreed with
      the blockwise path there and ran 5x slower; it is offered on CPU and TPU only).
  """
  if attention not in ATTENTIONS:
    raise ValueError(f"unknown attention {attention!r}; allowed: {', '.join(ATTENTIONS)}")
  backend = (backend or jax.default_backend()).lower()
  on_gpu = backend in GPU_PLATFORMS
  if attention == "pallas" and on_gpu:
    raise ValueError(
      "rollout.decode_attention='pallas' is not offered on a GPU: its Triton lowering "
      "disagreed with the blockwise path there and ran about 5x slower; use 'auto' (the "
      "static-shape masked form on a GPU)"
    )
  if attention == "auto":
    return "reference" if on_gpu else "blockwise"
  return attention


def forward_with_cache(
  params,
  tokens_bt,
  start_b,
  cache,
  cfg: ModelConfig,
  spec: kvcache.KVCacheSpec | None = None,
  valid_len_b=None,
  attention: str = "auto",
  block: int = decode_attention.BLOCK,
):
  """Cached forward: prefill (T > 1) or one-token decode (T == 1).

  Token t of sequence b sits at position start_b[b] + t; its key/value is written to
  that cache slot, and it attends to every slot at or before its position.

  attention="blockwise" (`decode_attention.attend_cache`) reads the cache in blocks of
  `block` slots up to the largest position of the batch, converting each block where it
  is consumed (a quantized cache's scales multiply the scores and probabilities): a step
  costs O(position), not O(S). attention="reference" reads the whole cache (`kvcache.read`,
  a dense copy in the compute dtype) and runs `attend` over all S slots; the two agree to
  f32 rounding, and with a quantized cache and bf16 compute to the bf16 rounding of a
  dequantized element (tests/model/test_decode_attention.py).
  attention="pallas" (`pallas_decode.attend_cache`) runs the same blockwise online softmax as
  a Pallas kernel for steps of T ≤ `pallas_decode.MAX_QUERIES` tokens, in interpret mode on
  CPU; longer calls (prefill) and the kernel variant "bf16_attention" (two passes) take the
  blockwise path. It equals the blockwise path as the reference does
  (tests/model/test_pallas_decode.py).

  Args:
    params: the params pytree.
    tokens_bt: int tokens [B, T].
    start_b: int positions [B] of each sequence's first token in `tokens_bt`.
    cache: list of per-layer cache dicts from `kvcache.init_cache`.
    cfg: the model config.
    spec: the cache numerics (fp8 granularity and headroom); default BF16.
    valid_len_b: optional int [B], real tokens per row of `tokens_bt` (the rest is
      padding, excluded from fp8 "tensor" scale calibration).
    attention: one of ATTENTIONS (static); "auto" is resolved by `resolve_attention`.
    block: slots per block of the blockwise attention (static).

  Returns:
    (logits [B, T, V_real] f32 (`unembed`), updated cache).
  """
  attention = resolve_attention(attention)
  spec = spec or kvcache.KVCacheSpec()
  t = tokens_bt.shape[1]
  positions_bt = start_b[:, None] + jnp.arange(t)[None, :]
  kernel = kernel_of(params)
  x = _embed(params, tokens_bt)
  new_cache = []
  for layer, entry in zip(params["layers"], cache, strict=True):

    def attn_fn(q, k, v, entry=entry):
      updated = kvcache.write(entry, k, v, start_b, spec, valid_len_b)
      new_cache.append(updated)
      if attention == "pallas" and t <= pallas_decode.MAX_QUERIES and kernel != "bf16_attention":
        return pallas_decode.attend_cache(q, updated, positions_bt, cfg, block)
      if attention != "reference":
        return decode_attention.attend_cache(q, updated, positions_bt, cfg, kernel, block)
      keys, values = kvcache.read(updated, k.dtype)
      slots = jnp.broadcast_to(jnp.arange(keys.shape[1]), keys.shape[:2])
      return attend(q, keys, values, positions_bt, slots, cfg, kernel)

    x = _block(layer, x, positions_bt, cfg, attn_fn, kernel)
  return unembed(params, x, cfg), new_cache


def init_params(rng, cfg: ModelConfig, dtype=jnp.float32, scale: float = 0.02):
  """Random params: N(0, scale²) matrices, unit norms, zero biases."""
  d, f, n, k, h, v = (
    cfg.hidden_size,
    cfg.intermediate_size,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    cfg.vocab_size,
  )
  keys = iter(jax.random.split(rng, 2 + 7 * cfg.num_layers))

  def normal(shape, std=scale):
    return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  layers = []
  for _ in range(cfg.num_layers):
    layer = {
      "attn_norm_d": jnp.ones((d,), dtype),
      "mlp_norm_d": jnp.ones((d,), dtype),
      "q_dnh": normal((d, n, h)),
      "k_dkh": normal((d, k, h)),
      "v_dkh": normal((d, k, h)),
      "o_nhd": normal((n, h, d), scale / np.sqrt(2 * cfg.num_layers)),
      "gate_df": normal((d, f)),
      "up_df": normal((d, f)),
      "down_fd": normal((f, d), scale / np.sqrt(2 * cfg.num_layers)),
    }
    if cfg.qkv_bias:
      layer |= {
        "q_bias_nh": jnp.zeros((n, h), dtype),
        "k_bias_kh": jnp.zeros((k, h), dtype),
        "v_bias_kh": jnp.zeros((k, h), dtype),
      }
    if cfg.o_bias:
      layer["o_bias_d"] = jnp.zeros((d,), dtype)
    if cfg.qk_norm:
      layer |= {"q_norm_h": jnp.ones((h,), dtype), "k_norm_h": jnp.ones((h,), dtype)}
    layers.append(layer)
  params = {"embed_vd": normal((v, d)), "final_norm_d": jnp.ones((d,), dtype), "layers": layers}
  if not cfg.tie_word_embeddings:
    params["lm_head_dv"] = normal((d, v))
  return params
