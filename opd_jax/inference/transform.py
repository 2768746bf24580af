"""The rollout engine's weights as a pure transform of the trainer's weights.

    params_r = T(θ_v),   T ∈ {identity, cast to bf16, quantized recipe, + noise σ, kernel,
                              bf16 head}

Staleness is not a transform: the async loop hands the engine an older θ_v. The KV
cache numerics (`kvcache.KVCacheSpec`) and the sampling settings live in the
sampler's config; `EngineConfig` gathers everything that defines one rollout
configuration so the admission check and the logs can name it (`engine_id`).

The quantized transform is quantize-then-prepare: `quant.quantize_params` (the recipe,
the numerics) followed by `quant_compute.prepare_for_compute` (the layout for this hardware's
matmuls: dense compute-dtype weights where there are no FP8 matmuls, native fp8
QArrays where there are). T runs once per published version, so the dequantization
is paid once per version rather than in every decode step; `engine_id` names the
recipe, not the layout, so it is the same on every backend.

Weight formats (`weights`; `quant.quantize` gives each format's equation and error):
"fp8" (e4m3), "fp8_e5m2", "int8", "int4" and "fp4" (e2m1 with MX power-of-two scales).
Each takes one scale grouping: per output channel (the default), b×b blocks
(`weight_block_size`), groups of g inputs per output column (`weight_group_size`; fp4
needs it, MX uses 32) or one scale per matrix (`weight_per_tensor`).

The output head (`head_dtype`): "bfloat16" runs the final norm and the LM head in bf16 and
rounds the logits to bf16 (`quant.HeadDtype`, read by `model.unembed`), where the trainer
computes them in f32; the engine marks params_r with it, like the kernel.

Weight noise follows the study: every matrix becomes W + σ · rms(W) · ε with
ε ~ N(0, I), so σ is relative to each matrix's own scale. It may be limited to some
decoder layers (`noise_layers`) and to some module types (`noise_modules`: q, k, v, o,
gate, up, down, embed, lm_head, or the groups attention = q k v o, mlp = gate up down,
embeddings = embed lm_head); a matrix is noised iff both filters select it (an empty
filter selects everything; the embeddings belong to no layer, so a layer filter
excludes them). Each matrix draws the same ε whatever the filters, so the noise of a
restricted engine is the full engine's noise on the selected matrices.

The kernel variant (`kernel`, one of `model.KERNELS`) keeps the weights and changes
the numerical path they run through (`model` module docstring): "bf16_attention"
(scores and probabilities rounded to bf16 as eager bf16 attention kernels do) and
"bf16_matmul" (every weight matmul with bf16 operands and f32 accumulation, XLA's
default precision for f32 matmuls on TPU). The engine marks params_r with it
(`model.Kernel`), so the sampler and the teacher-forced forward both follow it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from opd_jax.model import kvcache, quant, quant_compute
from opd_jax.model import transformer as model
from opd_jax.model.kvcache import KVCacheSpec

# rollout weights -> the quant format it stores ("trainer" and "bf16" are not quantized).
QUANT_WEIGHTS = {
  "fp8": "fp8_e4m3",
  "fp8_e5m2": "fp8_e5m2",
  "int8": "int8",
  "int4": "int4",
  "fp4": "fp4_e2m1",
}
WEIGHT_MODES = ("trainer", "bf16", *QUANT_WEIGHTS)
# Quantized KV dtype -> its `rollout.kv_cache` name, the engine id's label ("kv=fp4/tensor").
_KV_NAMES = {dtype: name for name, dtype in kvcache.KV_CACHE_NAMES.items()}
NOISE_MODULES = ("q", "k", "v", "o", "gate", "up", "down", "embed", "lm_head")
NOISE_MODULE_GROUPS = {
  "attention": ("q", "k", "v", "o"),
  "mlp": ("gate", "up", "down"),
  "embeddings": ("embed", "lm_head"),
}


def expand_modules(names) -> tuple[str, ...]:
  """Module names with groups expanded, in `NOISE_MODULES` order; ValueError on unknown names."""
  allowed = NOISE_MODULES + tuple(NOISE_MODULE_GROUPS)
  if isinstance(names, str):
    raise ValueError(f"module names must be a tuple of strings, got the string {names!r}")
  chosen = set()
  for name in names:
    if name not in allowed:
      raise ValueError(f"unknown module {name!r}; allowed: {', '.join(allowed)}")
    chosen.update(NOISE_MODULE_GROUPS.get(name, (name,)))
  return tuple(m for m in NOISE_MODULES if m in chosen)


def module_of(name: str) -> str:
  """The module type of a params leaf name: 'q_dnh' and 'q_bias_nh' -> 'q', 'lm_head_dv' ->
  'lm_head'."""
  return "lm_head" if name.startswith("lm_head") else name.split("_")[0]


def _check_layers(name: str, layers) -> None:
  if not isinstance(layers, tuple) or any(
    isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers
  ):
    raise ValueError(f"{name} must be a tuple of non-negative ints, got {layers!r}")
  if len(set(layers)) != len(layers):
    raise ValueError(f"{name} has duplicates: {layers!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """One rollout configuration: weight transform plus KV-cache numerics."""

  weights: str = "trainer"  # one of WEIGHT_MODES
  weight_block_size: int | None = None  # quantized weights: b×b block scales, None = off
  bf16_layers: tuple[int, ...] = ()  # quantized recipe: layers left unquantized
  noise_sigma: float = 0.0  # relative weight noise σ
  kv: KVCacheSpec = KVCacheSpec()
  noise_layers: tuple[int, ...] = ()  # noise only these decoder layers; () = all
  noise_modules: tuple[str, ...] = ()  # noise only these module types or groups; () = all
  kernel: str = "reference"  # numerical path, one of model.KERNELS
  # The scale groupings act only on quantized weights (like weight_block_size, bf16_layers).
  weight_group_size: int | None = None  # quantized weights: one scale per g inputs, None = off
  weight_per_tensor: bool = False  # quantized weights: one scale per matrix
  head_dtype: str = "float32"  # final norm and LM head: float32 (the trainer's) | bfloat16

  def __post_init__(self):
    if self.weights not in WEIGHT_MODES:
      raise ValueError(f"unknown weights mode {self.weights!r}; allowed: {', '.join(WEIGHT_MODES)}")
    if self.head_dtype not in quant.HEAD_DTYPES:
      raise ValueError(
        f"unknown head_dtype {self.head_dtype!r}; allowed: {', '.join(quant.HEAD_DTYPES)}"
      )
    if self.weights == "fp4" and self.weight_group_size is None:
      raise ValueError(
        "weights='fp4' shares one power-of-two scale per block of inputs (MX): set "
        "weight_group_size (MXFP4 uses 32)"
      )
    if self.weights in QUANT_WEIGHTS:
      self.quant_recipe()  # refuses two scale groupings at once
    if self.noise_sigma < 0:
      raise ValueError(f"noise_sigma must be >= 0, got {self.noise_sigma}")
    if self.kernel not in model.KERNELS:
      raise ValueError(f"unknown kernel {self.kernel!r}; allowed: {', '.join(model.KERNELS)}")
    _check_layers("noise_layers", self.noise_layers)
    if not isinstance(self.noise_modules, tuple):
      raise ValueError(f"noise_modules must be a tuple of strings, got {self.noise_modules!r}")
    modules = expand_modules(self.noise_modules)
    if (self.noise_layers or self.noise_modules) and self.noise_sigma == 0:
      raise ValueError(
        "noise_layers/noise_modules restrict the weight noise, but noise_sigma is 0; set "
        "noise_sigma > 0 or leave them empty"
      )
    if self.noise_layers and self.noise_modules and not set(modules) - {"embed", "lm_head"}:
      raise ValueError(
        f"noise_layers={self.noise_layers} with noise_modules={self.noise_modules} selects no "
        "matrix: the embeddings belong to no decoder layer"
      )

  def quant_recipe(self) -> quant.QuantRecipe:
    """The `quant.QuantRecipe` of quantized weights (ValueError for trainer or bf16)."""
    if self.weights not in QUANT_WEIGHTS:
      raise ValueError(f"weights={self.weights!r} is not a quantized format")
    return quant.QuantRecipe(
      block_size=self.weight_block_size,
      bf16_layers=self.bf16_layers,
      fmt=QUANT_WEIGHTS[self.weights],
      group_size=self.weight_group_size,
      per_tensor=self.weight_per_tensor,
    )

  @property
  def engine_id(self) -> str:
    """A short stable name, e.g. 'w=fp8/ch+bf16[0],kv=fp8/tensor,noise=0'. Quantized
    weights name their scales: /ch per channel, /b<b> blocks, /g<g> groups, /t per tensor
    ('w=int4/g32', 'w=fp8_e5m2/t'); a quantized KV cache is named by its `rollout.kv_cache`
    value and scale granularity ('kv=fp4/token_head'). After a restricted noise come '@L[i,..]' and
    '@<modules>', then ',kernel=<name>' for a kernel variant and ',head=bf16' for a bf16
    output head."""
    w = self.weights
    if w in QUANT_WEIGHTS:
      if self.weight_block_size is not None:
        w += f"/b{self.weight_block_size}"
      elif self.weight_group_size is not None:
        w += f"/g{self.weight_group_size}"
      elif self.weight_per_tensor:
        w += "/t"
      else:
        w += "/ch"
      if self.bf16_layers:
        w += f"+bf16{list(self.bf16_layers)}"
    kv = self.kv.dtype
    if kv in kvcache.QUANTIZED_KV_DTYPES:
      kv = f"{_KV_NAMES[kv]}/{self.kv.granularity}"
      if self.kv.bf16_layers:
        kv += f"+bf16{list(self.kv.bf16_layers)}"
    noise = f"noise={self.noise_sigma:g}"
    if self.noise_layers:
      noise += f"@L{list(self.noise_layers)}"
    if self.noise_modules:
      noise += "@" + "+".join(self.noise_modules)
    kernel = "" if self.kernel == "reference" else f",kernel={self.kernel}"
    head = "" if self.head_dtype == "float32" else ",head=bf16"
    return f"w={w},kv={kv},{noise}{kernel}{head}"


def _leaf_place(path) -> tuple[int | None, str]:
  """(decoder layer or None, leaf name) of a params path such as layers/3/q_dnh."""
  names = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
  layer = names[1] if len(names) >= 3 and names[0] == "layers" else None
  return layer, str(names[-1])


def add_weight_noise(params, sigma: float, rng, layers: tuple[int, ...] = (), modules=()):
  """W + σ · rms(W) · ε for every selected leaf of two or more dims of `params`: the matrices
  and the q/k/v biases (stored per head, [N, H] and [K, H]); 1-D leaves (norms, the output
  bias) untouched.

  Args:
    params: a dense params pytree.
    sigma: σ ≥ 0, relative to each matrix's rms.
    rng: key; matrix j (in pytree order) draws ε from split(rng, #leaves)[j] whatever
      the filters.
    layers: decoder layers to noise; () = all (and the embeddings).
    modules: module types or groups to noise (`NOISE_MODULES`, `NOISE_MODULE_GROUPS`);
      () = all.

  Returns:
    The noised pytree, same structure and dtypes.
  """
  num_layers = len(params["layers"])
  bad = [i for i in layers if i >= num_layers]
  if bad:
    raise ValueError(f"noise_layers {bad} out of range for a {num_layers}-layer model")
  chosen = set(expand_modules(modules)) if modules else None
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(rng, len(path_leaves))

  def noisy(path, w, key):
    layer, name = _leaf_place(path)
    if w.ndim < 2:
      return w
    if layers and layer not in layers:
      return w
    if chosen is not None and module_of(name) not in chosen:
      return w
    w32 = w.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(w32 * w32))
    return (w32 + sigma * rms * jax.random.normal(key, w.shape)).astype(w.dtype)

  noised = [noisy(p, w, k) for (p, w), k in zip(path_leaves, keys, strict=True)]
  return jax.tree.unflatten(treedef, noised)


def engine_params(params, cfg: EngineConfig, rng):
  """params_r = T(θ): the weights the rollout engine samples with.

  Args:
    params: the trainer's dense params pytree.
    cfg: the engine configuration (static).
    rng: key for the weight noise (unused when σ = 0).

  Returns:
    A params pytree for `sampler.sample`. For quantized weights: dense compute-dtype
    matrices equal to the dequantized recipe, except e4m3 weights without group scales on
    hardware with FP8 matmuls, which stay native `quant.QArray` leaves
    (`quant_compute.prepare_for_compute`). A kernel variant adds the static marker
    `params_r[model.KERNEL_KEY] = model.Kernel(cfg.kernel)`, a bf16 head
    `params_r[quant.HEAD_KEY] = quant.HeadDtype("bfloat16")`.
  """
  if model.KERNEL_KEY in params or quant.HEAD_KEY in params:
    raise ValueError("params already carry an engine marker: engine_params takes the trainer's")
  if cfg.noise_sigma > 0:
    params = add_weight_noise(params, cfg.noise_sigma, rng, cfg.noise_layers, cfg.noise_modules)
  if cfg.weights == "bf16":
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  elif cfg.weights in QUANT_WEIGHTS:
    params = quant_compute.prepare_for_compute(quant.quantize_params(params, cfg.quant_recipe()))
  if cfg.kernel != "reference":
    params = {**params, model.KERNEL_KEY: model.Kernel(cfg.kernel)}
  if cfg.head_dtype != "float32":
    params = {**params, quant.HEAD_KEY: quant.HeadDtype(cfg.head_dtype)}
  return params
