"""The mapping between a Hugging Face checkpoint's tensors and the opd_jax params layout: one
`TensorSpec` per tensor (`tensor_specs`), read and written by `io.hf`.

Layout mapping (HF `nn.Linear` weights are [out, in]; ours are [in, out] with the
head axes split out so that sharding rules can name them):

    model.embed_tokens.weight                 [V, D]    -> embed_vd      [V, D]
    model.layers.i.self_attn.q_proj.weight    [N·H, D]  -> q_dnh         [D, N, H]
    model.layers.i.self_attn.{k,v}_proj.weight [K·H, D] -> {k,v}_dkh     [D, K, H]
    model.layers.i.self_attn.o_proj.weight    [D, N·H]  -> o_nhd         [N, H, D]
    model.layers.i.self_attn.q_proj.bias      [N·H]     -> q_bias_nh     [N, H]
    model.layers.i.self_attn.{k,v}_proj.bias  [K·H]     -> {k,v}_bias_kh [K, H]
    model.layers.i.self_attn.o_proj.bias      [D]       -> o_bias_d      [D]
    model.layers.i.self_attn.{q,k}_norm.weight [H]      -> {q,k}_norm_h  [H]
    model.layers.i.input_layernorm.weight     [D]       -> attn_norm_d   [D]
    model.layers.i.post_attention_layernorm.weight [D]  -> mlp_norm_d    [D]
    model.layers.i.mlp.{gate,up}_proj.weight  [F, D]    -> {gate,up}_df  [D, F]
    model.layers.i.mlp.down_proj.weight       [D, F]    -> down_fd       [F, D]
    model.norm.weight                         [D]       -> final_norm_d  [D]
    lm_head.weight                            [V, D]    -> lm_head_dv    [D, V]  (untied only)

Every entry is either a plain reshape or "transpose the 2-D HF matrix, then
reshape", so one flag per tensor describes both directions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from opd_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One checkpoint tensor: where it lives in both layouts and how to convert it.

  `to_ours` maps the HF array [hf_shape] to ours [shape]; `to_hf` is its inverse.
  """

  key: tuple[str | int, ...]  # path into the params pytree, e.g. ("layers", 0, "q_dnh")
  hf_name: str
  hf_shape: tuple[int, ...]
  shape: tuple[int, ...]  # our shape
  transpose: bool  # HF [out, in] matrix -> ours [in, out] (then reshape)

  def to_ours(self, w: np.ndarray) -> np.ndarray:
    return (w.T if self.transpose else w).reshape(self.shape)

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    if self.transpose:
      return w.reshape(self.hf_shape[::-1]).T
    return w.reshape(self.hf_shape)

  @property
  def path(self) -> str:
    return "/".join(str(k) for k in self.key)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
  """Every tensor `cfg` needs, in checkpoint order (see the module docstring).

  Args:
    cfg: the model config.

  Returns:
    one TensorSpec per param leaf: embeddings, then layer by layer, then the
    final norm and (untied only) the LM head.
  """
  d, f, n, k, h, v = (
    cfg.hidden_size,
    cfg.intermediate_size,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    cfg.vocab_size,
  )
  specs = [TensorSpec(("embed_vd",), "model.embed_tokens.weight", (v, d), (v, d), False)]
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."

    def add(name, hf_name, hf_shape, shape, transpose, pre=pre, i=i):
      specs.append(TensorSpec(("layers", i, name), pre + hf_name, hf_shape, shape, transpose))

    add("attn_norm_d", "input_layernorm.weight", (d,), (d,), False)
    add("q_dnh", "self_attn.q_proj.weight", (n * h, d), (d, n, h), True)
    add("k_dkh", "self_attn.k_proj.weight", (k * h, d), (d, k, h), True)
    add("v_dkh", "self_attn.v_proj.weight", (k * h, d), (d, k, h), True)
    add("o_nhd", "self_attn.o_proj.weight", (d, n * h), (n, h, d), True)
    if cfg.qkv_bias:
      add("q_bias_nh", "self_attn.q_proj.bias", (n * h,), (n, h), False)
      add("k_bias_kh", "self_attn.k_proj.bias", (k * h,), (k, h), False)
      add("v_bias_kh", "self_attn.v_proj.bias", (k * h,), (k, h), False)
    if cfg.o_bias:
      add("o_bias_d", "self_attn.o_proj.bias", (d,), (d,), False)
    if cfg.qk_norm:
      add("q_norm_h", "self_attn.q_norm.weight", (h,), (h,), False)
      add("k_norm_h", "self_attn.k_norm.weight", (h,), (h,), False)
    add("mlp_norm_d", "post_attention_layernorm.weight", (d,), (d,), False)
    add("gate_df", "mlp.gate_proj.weight", (f, d), (d, f), True)
    add("up_df", "mlp.up_proj.weight", (f, d), (d, f), True)
    add("down_fd", "mlp.down_proj.weight", (d, f), (f, d), True)
  specs.append(TensorSpec(("final_norm_d",), "model.norm.weight", (d,), (d,), False))
  if not cfg.tie_word_embeddings:
    specs.append(TensorSpec(("lm_head_dv",), "lm_head.weight", (v, d), (d, v), True))
  return specs
