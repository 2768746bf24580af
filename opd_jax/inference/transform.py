"""The rollout engine's weights as a pure transform of the trainer's weights.

    params_r = T(θ_v),   T ∈ {identity, cast to bf16, fp8 recipe, + noise σ, kernel}

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

from opd_jax.model import quant
from opd_jax.model import transformer as model
from opd_jax.model.kvcache import KVCacheSpec

WEIGHT_MODES = ("trainer", "bf16", "fp8")
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

  weights: str = "trainer"  # trainer | bf16 | fp8
  weight_block_size: int | None = None  # fp8 scales: None per channel, else block edge
  bf16_layers: tuple[int, ...] = ()  # fp8 recipe: layers left unquantized
  noise_sigma: float = 0.0  # relative weight noise σ
  kv: KVCacheSpec = KVCacheSpec()
  noise_layers: tuple[int, ...] = ()  # noise only these decoder layers; () = all
  noise_modules: tuple[str, ...] = ()  # noise only these module types or groups; () = all
  kernel: str = "reference"  # numerical path, one of model.KERNELS

  def __post_init__(self):
    if self.weights not in WEIGHT_MODES:
      raise ValueError(f"unknown weights mode {self.weights!r}; allowed: {', '.join(WEIGHT_MODES)}")
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

  @property
  def engine_id(self) -> str:
    """A short stable name, e.g. 'w=fp8/ch+bf16[0],kv=fp8/tensor,noise=0', with
    '@L[i,..]' and '@<modules>' after a restricted noise and ',kernel=<name>' for a
    kernel variant."""
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
    noise = f"noise={self.noise_sigma:g}"
    if self.noise_layers:
      noise += f"@L{list(self.noise_layers)}"
    if self.noise_modules:
      noise += "@" + "+".join(self.noise_modules)
    kernel = "" if self.kernel == "reference" else f",kernel={self.kernel}"
    return f"w={w},kv={kv},{noise}{kernel}"


def _leaf_place(path) -> tuple[int | None, str]:
  """(decoder layer or None, leaf name) of a params path such as layers/3/q_dnh."""
  names = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
  layer = names[1] if len(names) >= 3 and names[0] == "layers" else None
  return layer, str(names[-1])


def add_weight_noise(params, sigma: float, rng, layers: tuple[int, ...] = (), modules=()):
  """W + σ · rms(W) · ε for every selected matrix (ndim ≥ 2) of `params`; vectors untouched.

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
    A params pytree for `sampler.sample`. For fp8: dense compute-dtype matrices equal
    to the dequantized recipe on hardware without FP8 matmuls, native `quant.QArray`
    leaves on hardware with them (`quant.has_native_fp8`). A kernel variant adds the
    static marker `params_r[model.KERNEL_KEY] = model.Kernel(cfg.kernel)`.
  """
  if model.KERNEL_KEY in params:
    raise ValueError("params already carry a kernel marker: engine_params takes the trainer's")
  if cfg.noise_sigma > 0:
    params = add_weight_noise(params, cfg.noise_sigma, rng, cfg.noise_layers, cfg.noise_modules)
  if cfg.weights == "bf16":
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  elif cfg.weights == "fp8":
    recipe = quant.QuantRecipe(block_size=cfg.weight_block_size, bf16_layers=cfg.bf16_layers)
    params = quant.prepare_for_compute(quant.quantize_params(params, recipe))
  if cfg.kernel != "reference":
    params = {**params, model.KERNEL_KEY: model.Kernel(cfg.kernel)}
  return params
