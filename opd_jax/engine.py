"""The rollout engine's weights as a pure transform of the trainer's weights.

    params_r = T(θ_v),   T ∈ {identity, cast to bf16, fp8 recipe, + noise σ}

Staleness is not a transform: the async loop hands the engine an older θ_v. The KV
cache numerics (`kvcache.KVCacheSpec`) and the sampling settings live in the
sampler's config; `EngineConfig` gathers everything that defines one rollout
configuration so the admission check and the logs can name it (`engine_id`).

The fp8 transform is quantize-then-prepare: `quant.quantize_params` (the recipe, the
numerics) followed by `quant.prepare_for_compute` (the layout for this hardware's
matmuls: dense compute-dtype weights where there are no FP8 matmuls, native fp8
QArrays where there are). T runs once per published version, so the dequantization
is paid once per version rather than in every decode step; `engine_id` names the
recipe, not the layout, so it is the same on every backend.

Weight noise follows the study: every matrix becomes W + σ · rms(W) · ε with
ε ~ N(0, I), so σ is relative to each matrix's own scale.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from opd_jax import quant
from opd_jax.kvcache import KVCacheSpec

WEIGHT_MODES = ("trainer", "bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """One rollout configuration: weight transform plus KV-cache numerics."""

  weights: str = "trainer"  # trainer | bf16 | fp8
  weight_block_size: int | None = None  # fp8 scales: None per channel, else block edge
  bf16_layers: tuple[int, ...] = ()  # fp8 recipe: layers left unquantized
  noise_sigma: float = 0.0  # relative weight noise σ
  kv: KVCacheSpec = KVCacheSpec()

  def __post_init__(self):
    if self.weights not in WEIGHT_MODES:
      raise ValueError(f"unknown weights mode {self.weights!r}; allowed: {', '.join(WEIGHT_MODES)}")
    if self.noise_sigma < 0:
      raise ValueError(f"noise_sigma must be >= 0, got {self.noise_sigma}")

  @property
  def engine_id(self) -> str:
    """A short stable name, e.g. 'w=fp8/ch+bf16[0],kv=fp8/tensor,noise=0'."""
    w = self.weights
    if w == "fp8":
      w += "/ch" if self.weight_block_size is None else f"/b{self.weight_block_size}"
      if self.bf16_layers:
        w += f"+bf16{list(self.bf16_layers)}"
    kv = self.kv.dtype
    if kv == "float8_e4m3fn":
      kv = f"fp8/{self.kv.granularity}"
      if self.kv.bf16_layers:
        kv += f"+bf16{list(self.kv.bf16_layers)}"
    return f"w={w},kv={kv},noise={self.noise_sigma:g}"


def add_weight_noise(params, sigma: float, rng):
  """W + σ · rms(W) · ε for every matrix (ndim ≥ 2) of `params`; vectors untouched."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(rng, len(leaves))

  def noisy(w, key):
    if w.ndim < 2:
      return w
    w32 = w.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(w32 * w32))
    return (w32 + sigma * rms * jax.random.normal(key, w.shape)).astype(w.dtype)

  return jax.tree.unflatten(treedef, [noisy(w, k) for w, k in zip(leaves, keys, strict=True)])


def engine_params(params, cfg: EngineConfig, rng):
  """params_r = T(θ): the weights the rollout engine samples with.

  Args:
    params: the trainer's dense params pytree.
    cfg: the engine configuration (static).
    rng: key for the weight noise (unused when σ = 0).

  Returns:
    A params pytree for `sampler.sample`. For fp8: dense compute-dtype matrices equal
    to the dequantized recipe on hardware without FP8 matmuls, native `quant.QArray`
    leaves on hardware with them (`quant.has_native_fp8`).
  """
  if cfg.noise_sigma > 0:
    params = add_weight_noise(params, cfg.noise_sigma, rng)
  if cfg.weights == "bf16":
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  if cfg.weights == "fp8":
    recipe = quant.QuantRecipe(block_size=cfg.weight_block_size, bf16_layers=cfg.bf16_layers)
    return quant.prepare_for_compute(quant.quantize_params(params, recipe))
  return params
