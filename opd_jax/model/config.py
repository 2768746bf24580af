"""Architecture description of a Llama / Qwen2 / Qwen3 decoder.

`ModelConfig` is a frozen, hashable dataclass so it can be a static argument of
`jax.jit`. It is built either directly (tests, the synthetic task) or from a
Hugging Face `config.json` via `ModelConfig.from_hf_dict`, which understands both
the old top-level `rope_theta`/`rope_scaling` keys and transformers v5's
`rope_parameters`.

Padded vocabularies. A checkpoint's embedding table often has more rows than its
tokenizer has tokens (Qwen2.5 0.5B-3B: 151,936 rows, 7B+: 152,064, one tokenizer of
151,665 tokens). `vocab_size` is always the number of rows (what the weights and an
exported config.json hold); `logical_vocab_size` V_real (0 = all rows) is the part of
the table the tokenizer can produce. `model.unembed` keeps only the first V_real logits,
so every consumer (sampler, losses, mismatch metrics, evaluation, teacher scoring) works
over V_real: the padded rows are outside every softmax and can never be sampled. The
run's builder sets it (`build.plan_models`); `from_hf_dict`/`to_hf_dict` never carry it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static shape and numerics description of a decoder-only transformer."""

  model_type: str  # one of SUPPORTED_MODEL_TYPES
  vocab_size: int  # V
  hidden_size: int  # D
  intermediate_size: int  # F, SwiGLU inner width
  num_layers: int  # L
  num_heads: int  # N, query heads
  num_kv_heads: int  # K, key/value heads (GQA when K < N, MQA when K == 1)
  head_dim: int  # H, may differ from D // N
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  # llama3-style scaling as a sorted tuple of (key, value) so the config stays hashable.
  rope_scaling: tuple[tuple[str, float], ...] | None = None
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias
  o_bias: bool = False  # Llama/Qwen3 when attention_bias
  qk_norm: bool = False  # Qwen3's per-head RMSNorm on q and k
  # V_real: logits cover ids [0, V_real) only (padded embedding rows dropped); 0 = all rows.
  logical_vocab_size: int = 0

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
        f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
      )
    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    logical = self.logical_vocab_size
    if isinstance(logical, bool) or not isinstance(logical, int) or logical < 0:
      raise ValueError(f"ModelConfig.logical_vocab_size must be an int >= 0, got {logical!r}")
    if logical > self.vocab_size:
      raise ValueError(
        f"ModelConfig.logical_vocab_size={logical} exceeds vocab_size={self.vocab_size} "
        "(the embedding rows)"
      )
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
      )

  @property
  def real_vocab_size(self) -> int:
    """V_real, the width of the logits: `logical_vocab_size`, or every row when it is 0."""
    return self.logical_vocab_size or self.vocab_size

  @property
  def num_groups(self) -> int:
    """G = N // K query heads share one key/value head."""
    return self.num_heads // self.num_kv_heads

  def rope_inv_freq(self) -> np.ndarray:
    """Inverse frequencies [H/2] for RoPE, with llama3 scaling when configured.

    Base: inv_freq_i = theta^(-2i/H). llama3 scaling divides low frequencies
    (wavelength > L_orig / low_freq_factor) by `factor`, keeps high frequencies, and
    interpolates smoothly in between.
    """
    dim = self.head_dim
    inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if self.rope_scaling is None:
      return inv_freq.astype(np.float32)
    s = dict(self.rope_scaling)
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)

  def num_params(self) -> int:
    """Parameter count, counting a tied embedding once."""
    d, f, n, k, h = (
      self.hidden_size,
      self.intermediate_size,
      self.num_heads,
      self.num_kv_heads,
      self.head_dim,
    )
    attn = d * n * h + 2 * d * k * h + n * h * d
    attn += (n * h + 2 * k * h) * self.qkv_bias + d * self.o_bias + 2 * h * self.qk_norm
    layer = attn + 3 * d * f + 2 * d
    embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * layer + embed + d

  @classmethod
  def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face `config.json` dict."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
        f"unsupported model_type {model_type!r} in config.json; "
        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
      )
    if hf.get("use_sliding_window"):
      raise ValueError("use_sliding_window=True is not supported (full attention only)")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
      raise ValueError(
        f"partial_rotary_factor={hf['partial_rotary_factor']} is not supported (only 1.0)"
      )
    if hf.get("mlp_bias"):
      raise ValueError("mlp_bias=True is not supported (no Llama/Qwen checkpoint uses it)")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
      raise ValueError(f"hidden_act={act!r} is not supported (the MLP is SwiGLU: silu only)")
    rope = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling_src = rope if rope.get("rope_type", "default") != "default" else legacy
    rope_type = scaling_src.get("rope_type", scaling_src.get("type", "default"))
    rope_scaling = None
    if rope_type == "llama3":
      keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
      rope_scaling = tuple(sorted((k, float(scaling_src[k])) for k in keys))
    elif rope_type != "default":
      raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
    num_heads = hf["num_attention_heads"]
    attention_bias = bool(hf.get("attention_bias", False))
    return cls(
      model_type=model_type,
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      rope_theta=float(rope_theta),
      rope_scaling=rope_scaling,
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=model_type == "qwen2" or attention_bias,
      o_bias=model_type != "qwen2" and attention_bias,
      qk_norm=model_type == "qwen3",
    )

  def to_hf_dict(self) -> dict[str, Any]:
    """The `config.json` dict transformers needs to rebuild this architecture."""
    rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
    if self.rope_scaling is not None:
      rope.update(dict(self.rope_scaling), rope_type="llama3")
      rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    out = {
      "architectures": [arch[self.model_type]],
      "model_type": self.model_type,
      "vocab_size": self.vocab_size,
      "hidden_size": self.hidden_size,
      "intermediate_size": self.intermediate_size,
      "num_hidden_layers": self.num_layers,
      "num_attention_heads": self.num_heads,
      "num_key_value_heads": self.num_kv_heads,
      "head_dim": self.head_dim,
      "rms_norm_eps": self.rms_norm_eps,
      "rope_theta": self.rope_theta,
      "rope_parameters": rope,
      "max_position_embeddings": self.max_position_embeddings,
      "tie_word_embeddings": self.tie_word_embeddings,
      "hidden_act": "silu",
    }
    if self.model_type != "qwen2":
      out["attention_bias"] = self.qkv_bias
    return out
