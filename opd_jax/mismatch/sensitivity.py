"""Layer sensitivity: which decoder layers (and module types) make the mismatch.

    python -m opd_jax.sensitivity --config=... [--params-from=RUN] [--prompts=N]
        [--target-kl=X] [--json=OUT] [--png=OUT]

No training. Every row perturbs one part of the student and measures `mismatch/kl` with
`measure.measure` (the admission check's procedure: the same calibration prompts, the
same key) against the unperturbed student θ:

  fp8_weights  layer i   FP8 e4m3 weights in layer i only (`QuantRecipe.bf16_layers` = every
                         other layer, which keeps the trainer's dtype)
  fp8_kv       layer i   FP8 KV cache in layer i only (`KVCacheSpec.bf16_layers` = every other
                         layer, stored in BF16)
  noise        layer i   W + σ·rms(W)·ε on layer i's matrices (`EngineConfig.noise_layers`)
  noise        module m  the same on every matrix of type m (q, k, v, o, gate, up, down,
                         embed, lm_head) across layers (`EngineConfig.noise_modules`)

plus one "all" row per source (the whole model perturbed) and, for fp8_kv, the "bf16"
baseline: the FP8-KV rows store the other layers' cache in BF16, which itself reads above 0
when the trainer computes in f32 (CPU), so a layer's own FP8-KV share is its row minus that
baseline. Within a source, rows are ranked by `mismatch/kl`.

Suggested recipe. A layer's FP8 score is its fp8_weights KL plus its fp8_kv KL above the
BF16 baseline (the two parts of "FP8 in layer i"). Greedily, most sensitive first, layers
are kept unquantized (weights in the trainer's dtype, KV cache in BF16) and the whole FP8
engine (FP8 weights and FP8 KV everywhere else) is measured again, until its `mismatch/kl`
is at most the target: kept = ∅, {ℓ_1}, {ℓ_1, ℓ_2}, … with score(ℓ_1) ≥ score(ℓ_2) ≥ …
Per-layer KLs do not add up exactly (layers interact through the residual stream), so
every step is measured, never predicted. The recipe's KV capacity ratio is the BF16
cache's bytes per token over the recipe's (`kvcache.measure_bytes_per_token`:
the cache layout `kvcache.init_cache` builds, scales included, per-sequence scales
amortised over `seq_len` slots).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import ml_collections

from opd_jax.config import check as config_check
from opd_jax.config.values import DEFAULT_NUM_PROMPTS
from opd_jax.inference import transform
from opd_jax.io import build, json_file, provenance, run_history
from opd_jax.mismatch import admission
from opd_jax.mismatch import measure as measure_lib
from opd_jax.model import kvcache
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.model.kvcache import KV_GRANULARITIES, KVCacheSpec
from opd_jax.train import setup as setup_lib

SOURCES = ("fp8_weights", "fp8_kv", "noise")
KL_KEY = "mismatch/kl"
FP8 = "float8_e4m3fn"
DEFAULT_NOISE_SIGMA = 0.05
DEFAULT_SEQ_LEN = 4096  # slots per sequence for the capacity accounting (README's table)
DEFAULT_TARGET_FRACTION = 0.5  # default target: this fraction of the all-layers FP8 mismatch


@dataclasses.dataclass(frozen=True)
class ScanSettings:
  """What the scan perturbs and how.

  Attributes:
    sources: a subset of SOURCES.
    layers: decoder layers to scan; () = all.
    modules: module types for the noise-by-module rows (`transform.NOISE_MODULES` or groups);
      () = every type the model has; None = no module rows.
    noise_sigma: σ of the noise rows.
    weight_block_size: FP8 weight scales, None per channel, else the block edge.
    kv_granularity: FP8 KV scales, one of `kvcache.KV_GRANULARITIES`.
  """

  sources: tuple[str, ...] = SOURCES
  layers: tuple[int, ...] = ()
  modules: tuple[str, ...] | None = ()
  noise_sigma: float = DEFAULT_NOISE_SIGMA
  weight_block_size: int | None = None
  kv_granularity: str = "token_head"

  def __post_init__(self):
    bad = [s for s in self.sources if s not in SOURCES]
    if bad or not self.sources:
      raise ValueError(f"unknown or no sources {list(bad)}; allowed: {', '.join(SOURCES)}")
    if not self.noise_sigma > 0:
      raise ValueError(f"noise_sigma must be > 0, got {self.noise_sigma!r}")
    if self.kv_granularity not in KV_GRANULARITIES:
      raise ValueError(
        f"unknown kv_granularity {self.kv_granularity!r}; allowed: {', '.join(KV_GRANULARITIES)}"
      )
    if self.modules:
      transform.expand_modules(self.modules)  # names the unknown module
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.layers):
      raise ValueError(f"layers must be non-negative ints, got {self.layers!r}")

  def scanned_layers(self, num_layers: int) -> tuple[int, ...]:
    """The layers to scan, checked against the model's depth."""
    bad = [i for i in self.layers if i >= num_layers]
    if bad:
      raise ValueError(
        f"layer {bad[0]} out of range: the model has {num_layers} layers (0..{num_layers - 1})"
      )
    return self.layers or tuple(range(num_layers))

  def scanned_modules(self, cfg: ModelConfig) -> tuple[str, ...]:
    """The module types of the noise-by-module rows that exist in this model."""
    if self.modules is None or "noise" not in self.sources:
      return ()
    present = [m for m in transform.NOISE_MODULES if m != "lm_head" or not cfg.tie_word_embeddings]
    if not self.modules:
      return tuple(present)
    chosen = transform.expand_modules(self.modules)
    missing = [m for m in chosen if m not in present]
    if missing:
      raise ValueError(f"module {missing[0]!r} is not in this model (tied embeddings)")
    return chosen


def reference_engine(compute_dtype: str) -> transform.EngineConfig:
  """The unperturbed engine: the trainer's weights, KV cache in the compute dtype."""
  return transform.EngineConfig(kv=KVCacheSpec(dtype=compute_dtype))


def fp8_recipe_engine(kept: Sequence[int], settings: ScanSettings) -> transform.EngineConfig:
  """FP8 weights and FP8 KV everywhere except the `kept` layers."""
  kept = tuple(sorted(kept))
  return transform.EngineConfig(
    weights="fp8",
    weight_block_size=settings.weight_block_size,
    bf16_layers=kept,
    kv=KVCacheSpec(dtype=FP8, granularity=settings.kv_granularity, bf16_layers=kept),
  )


def scan_engines(
  cfg: ModelConfig, settings: ScanSettings, compute_dtype: str
) -> list[tuple[dict, transform.EngineConfig]]:
  """(row label, engine) for every row of the scan (module docstring), in measuring order."""
  num_layers = cfg.num_layers
  layers = settings.scanned_layers(num_layers)
  ref_kv = KVCacheSpec(dtype=compute_dtype)
  out = []

  def others(i):
    return tuple(j for j in range(num_layers) if j != i)

  def label(source, target, layer=None, module=None):
    return {"source": source, "target": target, "layer": layer, "module": module}

  if "fp8_weights" in settings.sources:
    block = settings.weight_block_size
    out.append((label("fp8_weights", "all"), transform.EngineConfig("fp8", block, (), kv=ref_kv)))
    for i in layers:
      ecfg = transform.EngineConfig("fp8", block, others(i), kv=ref_kv)
      out.append((label("fp8_weights", f"layer {i}", layer=i), ecfg))
  if "fp8_kv" in settings.sources:
    gran = settings.kv_granularity
    out.append((label("fp8_kv", "bf16"), transform.EngineConfig(kv=KVCacheSpec("bfloat16"))))
    out.append((label("fp8_kv", "all"), transform.EngineConfig(kv=KVCacheSpec(FP8, gran))))
    for i in layers:
      ecfg = transform.EngineConfig(kv=KVCacheSpec(FP8, gran, bf16_layers=others(i)))
      out.append((label("fp8_kv", f"layer {i}", layer=i), ecfg))
  if "noise" in settings.sources:
    sigma = settings.noise_sigma
    out.append((label("noise", "all"), transform.EngineConfig(noise_sigma=sigma, kv=ref_kv)))
    for i in layers:
      ecfg = transform.EngineConfig(noise_sigma=sigma, noise_layers=(i,), kv=ref_kv)
      out.append((label("noise", f"layer {i}", layer=i), ecfg))
    for m in settings.scanned_modules(cfg):
      ecfg = transform.EngineConfig(noise_sigma=sigma, noise_modules=(m,), kv=ref_kv)
      out.append((label("noise", f"module {m}", module=m), ecfg))
  return out


def scan(
  student_params,
  cfg: ModelConfig,
  prompts,
  rng,
  sampler_cfg,
  settings: ScanSettings,
  log: Callable[..., None] = print,
) -> tuple[dict, list[dict]]:
  """Measures the reference engine and every row of `scan_engines`.

  Args:
    student_params: θ (dense), both the engines' source and the scoring student.
    cfg: its ModelConfig.
    prompts: the calibration prompts, (tokens [N, P], lens [N]) or lists.
    rng: the measurement key, shared by every row.
    sampler_cfg: the sampling settings (`setup_lib.sampler_config`).
    settings: what to perturb.
    log: progress lines.

  Returns:
    (reference row, rows): each row is its label (source, target, layer, module) plus
    "engine_id" and the `measure.measure` floats.
  """
  compute_dtype = jnp.dtype(model.compute_dtype(student_params)).name
  engines = scan_engines(cfg, settings, compute_dtype)  # validates before measuring

  def one(label, ecfg):
    m = measure_lib.measure(student_params, cfg, ecfg, prompts, rng, sampler_cfg)
    return {**label, **m}

  reference = one({"source": "reference", "target": "none"}, reference_engine(compute_dtype))
  rows = []
  for i, (label, ecfg) in enumerate(engines):
    rows.append(one(label, ecfg))
    row = rows[-1]
    log(
      f"  [{i + 1}/{len(engines)}] {row['source']:<11} {row['target']:<14} "
      f"mismatch/kl={row[KL_KEY]:.3e}  ({row['measure/seconds']:.1f} s)"
    )
  return reference, rows


def ranking(rows: Sequence[dict]) -> dict[str, list[dict]]:
  """Per source (and "noise_modules"), the per-layer (per-module) rows by mismatch/kl, largest
  first: [{"target", "layer" or "module", "mismatch/kl"}]."""
  out = {}
  groups = [(s, lambda r, s=s: r["source"] == s and r["layer"] is not None) for s in SOURCES]
  groups.append(("noise_modules", lambda r: r["source"] == "noise" and r["module"] is not None))
  for name, keep in groups:
    chosen = sorted((r for r in rows if keep(r)), key=lambda r: -r[KL_KEY])
    if chosen:
      out[name] = [
        {"target": r["target"], "layer": r["layer"], "module": r["module"], KL_KEY: r[KL_KEY]}
        for r in chosen
      ]
  return out


def layer_scores(rows: Sequence[dict]) -> dict[int, float]:
  """FP8 score of each scanned layer: fp8_weights KL + max(0, fp8_kv KL − BF16 baseline)."""
  baseline = next(
    (r[KL_KEY] for r in rows if (r["source"], r["target"]) == ("fp8_kv", "bf16")), 0.0
  )
  scores: dict[int, float] = {}
  for r in rows:
    if r["layer"] is None or r["source"] not in ("fp8_weights", "fp8_kv"):
      continue
    part = r[KL_KEY] if r["source"] == "fp8_weights" else max(0.0, r[KL_KEY] - baseline)
    scores[r["layer"]] = scores.get(r["layer"], 0.0) + part
  return scores


def kv_capacity_ratio(cfg: ModelConfig, spec: KVCacheSpec, seq_len: int) -> dict:
  """Bytes per cached token of `spec` and of a BF16 cache, and their ratio (tokens per byte
  gained), from the cache layout `kvcache.init_cache` builds (traced, not allocated)."""
  bf16 = kvcache.measure_bytes_per_token(cfg, KVCacheSpec("bfloat16"), seq_len, False)
  recipe = kvcache.measure_bytes_per_token(cfg, spec, seq_len, False)
  return {
    "kv_bytes_per_token": recipe,
    "bf16_kv_bytes_per_token": bf16,
    "capacity_ratio": bf16 / recipe,
    "seq_len": seq_len,
  }


def suggest_recipe(
  student_params,
  cfg: ModelConfig,
  prompts,
  rng,
  sampler_cfg,
  scores: dict[int, float],
  target_kl: float,
  settings: ScanSettings,
  seq_len: int = DEFAULT_SEQ_LEN,
  log: Callable[..., None] = print,
) -> dict:
  """The greedy FP8 recipe of the module docstring.

  Args:
    student_params, cfg, prompts, rng, sampler_cfg: as `scan`.
    scores: layer -> FP8 score (`layer_scores`); the layers kept are taken from these, most
      sensitive first (ties: lower index first).
    target_kl: the largest acceptable `mismatch/kl` of the whole FP8 engine (> 0).
    settings: FP8 weight block size and KV granularity.
    seq_len: slots per sequence for the capacity accounting.
    log: progress lines.

  Returns:
    {"target_kl", "bf16_layers" (the kept layers, ascending), "met" (the last measured
    recipe reads ≤ target), "mismatch/kl" of that recipe, "engine_id", "path": [{"bf16_layers",
    "mismatch/kl"} per measured step], and `kv_capacity_ratio`'s keys}.
  """
  if not target_kl > 0:
    raise ValueError(f"target_kl must be > 0, got {target_kl!r}")
  order = sorted(scores, key=lambda i: (-scores[i], i))
  path = []
  kept: tuple[int, ...] = ()
  for n in range(len(order) + 1):
    kept = tuple(sorted(order[:n]))
    ecfg = fp8_recipe_engine(kept, settings)
    kl = measure_lib.measure(student_params, cfg, ecfg, prompts, rng, sampler_cfg)[KL_KEY]
    path.append({"bf16_layers": list(kept), KL_KEY: kl})
    log(f"  recipe bf16_layers={list(kept)}: mismatch/kl={kl:.3e} (target {target_kl:.3e})")
    if kl <= target_kl:
      break
  ecfg = fp8_recipe_engine(kept, settings)
  return {
    "target_kl": target_kl,
    "bf16_layers": list(kept),
    "met": path[-1][KL_KEY] <= target_kl,
    KL_KEY: path[-1][KL_KEY],
    "engine_id": ecfg.engine_id,
    "path": path,
    **kv_capacity_ratio(cfg, ecfg.kv, seq_len),
  }


def format_table(reference: dict, rows: Sequence[dict]) -> str:
  """The ranked table: per source, the "all"/baseline rows, then layers and modules by KL
  (ranked within the layers and within the modules; "of all" = the row's KL over the
  whole-model row's)."""
  head = f"{'source':<11} {'rank':>4}  {'target':<14} {'mismatch/kl':>11} {'kl_p95':>10} "
  head += f"{'|dlogp|':>9} {'of all':>7}"
  lines = [head, "-" * len(head)]
  lines.append(
    f"{'reference':<11} {'':>4}  {'none':<14} {reference[KL_KEY]:>11.3e} "
    f"{reference['mismatch/kl_p95']:>10.3e} {reference['mismatch/abs_logp_diff']:>9.2e}"
  )
  for source in SOURCES:
    mine = [r for r in rows if r["source"] == source]
    if not mine:
      continue
    whole = next((r[KL_KEY] for r in mine if r["target"] == "all"), None)
    fixed = [r for r in mine if r["layer"] is None and r["module"] is None]
    for group in ([r for r in mine if r["layer"] is not None], [r for r in mine if r["module"]]):
      fixed += sorted(group, key=lambda r: -r[KL_KEY])
    rank = {}
    for group in ([r for r in mine if r["layer"] is not None], [r for r in mine if r["module"]]):
      rank |= {id(r): k + 1 for k, r in enumerate(sorted(group, key=lambda r: -r[KL_KEY]))}
    for r in fixed:
      share = f"{r[KL_KEY] / whole:>7.2f}" if whole and r["target"] != "all" else f"{'':>7}"
      numbered = r["layer"] is not None or r["module"] is not None
      lines.append(
        f"{source:<11} {rank[id(r)] if numbered else '':>4}  {r['target']:<14} "
        f"{r[KL_KEY]:>11.3e} {r['mismatch/kl_p95']:>10.3e} "
        f"{r['mismatch/abs_logp_diff']:>9.2e} {share}"
      )
  return "\n".join(lines)


def plot(rows: Sequence[dict], path: str, title: str = "") -> bool:
  """A PNG bar chart of mismatch/kl per layer (one panel per source) and per module; False,
  writing nothing, when matplotlib is not installed."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  panels = [(s, [r for r in rows if r["source"] == s and r["layer"] is not None]) for s in SOURCES]
  panels.append(("noise by module", [r for r in rows if r["module"] is not None]))
  panels = [(name, rs) for name, rs in panels if rs]
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
  for ax, (name, rs) in zip(axes[0], panels, strict=True):
    labels = [str(r["layer"] if r["layer"] is not None else r["module"]) for r in rs]
    values = [r[KL_KEY] for r in rs]
    ax.bar(labels, values, color="tab:blue" if "fp8" in name else "tab:orange")
    whole = next((r[KL_KEY] for r in rows if (r["source"], r["target"]) == (name, "all")), None)
    if whole:
      ax.axhline(whole, color="k", lw=0.8, ls="--", label="whole model")
      ax.legend(fontsize=7)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("layer" if name in SOURCES else "module", fontsize=8)
    ax.set_ylabel("mismatch/kl (nats/token)", fontsize=8)
    ax.tick_params(labelsize=7)
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def load_student(config, params_from: str | None, log: Callable[..., None] = print):
  """(Models, task config, student params, description) of the student to scan.

  The student is built as the trainer builds it (`build.build_models`; the teacher is
  initialised but never bootstrapped, the scan does not use it): `params_from`'s latest
  checkpoint (`run_history.RunHistory`, read only), else the HF checkpoint, else the
  warm-started built-in student (`admission.initial_student`).
  """
  return load_student_and_lagged(config, params_from, (), log)[:4]


def load_student_and_lagged(
  config, params_from: str | None, candidates: Sequence, log: Callable[..., None] = print
):
  """`load_student`'s four, plus {k: θ_{t−k}} for the lag k > 0 of each candidate
  (`candidates.Candidate`): the student of `params_from`'s run k checkpointed steps before its
  latest t. A lag the run cannot give (no `params_from`, no checkpoint at t − k) fails with
  `admission.stale_lag_problem`'s message, which names the training flags that keep one."""
  spec = setup_lib.run_spec(config)
  models = build.build_models(spec)
  task_cfg = setup_lib.task_config(spec)
  setup = setup_lib.Setup(models, task_cfg, teacher_info={}, eval_set=None)
  history = run_history.RunHistory(spec, setup, params_from) if params_from else None
  for candidate in candidates:
    problem = admission.stale_lag_problem(candidate, history)
    if problem:
      raise ValueError(problem)
  if history is not None:
    t = history.latest
    lagged = {c.lag: history.params(t - c.lag) for c in candidates if c.lag > 0}
    return models, task_cfg, history.params(t), f"{params_from} checkpoint {t}", lagged
  source = config.student.checkpoint or "warm-started built-in student"
  return models, task_cfg, admission.initial_student(config, setup, log), source, {}


def run_sensitivity(
  config: ml_collections.ConfigDict,
  *,
  params_from: str | None = None,
  num_prompts: int = DEFAULT_NUM_PROMPTS,
  target_kl: float | None = None,
  settings: ScanSettings | None = None,
  seq_len: int = DEFAULT_SEQ_LEN,
  json_path: str | None = None,
  png_path: str | None = None,
  log: Callable[..., None] = print,
) -> dict:
  """Runs the scan (module docstring) and returns what `--json` writes.

  Args:
    config: the run config naming the student (validated here); its rollout sampling
      settings (temperature, top-k/top-p, max_new_tokens) are the scan's.
    params_from: a trainer workdir whose latest checkpoint's student is scanned (read only).
    num_prompts: N calibration prompts (`admission.calibration_prompts`).
    target_kl: the suggested recipe's target; None = DEFAULT_TARGET_FRACTION of the measured
      all-layers FP8 (weights + KV) mismatch. Needs the fp8_weights source.
    settings: what to perturb; default ScanSettings(kv_granularity=config's).
    seq_len: slots per sequence for the capacity accounting.
    json_path, png_path: where to write the result and the bar chart (None: not written).
    log: progress and the table.

  Returns:
    {"student", "model", "num_prompts", "settings", "reference", "rows", "ranking",
     "recipe" (or None without fp8_weights), "png" (path or None), "seconds"}.
  """
  start = time.perf_counter()
  config_check.validate(config)
  if settings is None:
    settings = ScanSettings(kv_granularity=config.rollout.kv_granularity)
  models, task_cfg, params, source = load_student(config, params_from, log)
  cfg = models.student_cfg
  settings.scanned_layers(cfg.num_layers)
  settings.scanned_modules(cfg)
  _, tokens_bp, lens_b = admission.calibration_prompts(
    config, models.tokenizer, task_cfg, num_prompts
  )
  prompts = (tokens_bp, lens_b)
  rng = admission.measurement_key(config)
  compute_dtype = jnp.dtype(model.compute_dtype(params)).name
  scfg = setup_lib.sampler_config(
    setup_lib.run_spec(config),
    models.tokenizer.eos_id,
    KVCacheSpec(compute_dtype),
    cfg.real_vocab_size,
  )
  log(
    f"sensitivity scan of {source}: {cfg.model_type} L={cfg.num_layers} D={cfg.hidden_size} "
    f"V={cfg.real_vocab_size}, {num_prompts} calibration prompts, T={scfg.temperature:g}"
  )
  reference, rows = scan(params, cfg, prompts, rng, scfg, settings, log)
  result = {
    "provenance": provenance.provenance(config),
    "student": source,
    "model": dataclasses.asdict(cfg),
    "num_prompts": num_prompts,
    "sampler": dataclasses.asdict(scfg),
    "settings": dataclasses.asdict(settings),
    "reference": reference,
    "rows": rows,
    "ranking": ranking(rows),
    "recipe": None,
  }
  log(format_table(reference, rows))
  if "fp8_weights" in settings.sources:
    if target_kl is None:
      whole = fp8_recipe_engine((), settings)
      whole_kl = measure_lib.measure(params, cfg, whole, prompts, rng, scfg)[KL_KEY]
      target_kl = DEFAULT_TARGET_FRACTION * whole_kl
      log(f"target: {DEFAULT_TARGET_FRACTION} x the all-layers FP8 mismatch {whole_kl:.3e}")
    recipe = suggest_recipe(
      params, cfg, prompts, rng, scfg, layer_scores(rows), target_kl, settings, seq_len, log
    )
    result["recipe"] = recipe
    verdict = "meets" if recipe["met"] else "does NOT meet"
    log(
      f"suggested FP8 recipe: keep layers {recipe['bf16_layers']} unquantized "
      f"(rollout.bf16_layers and rollout.kv_bf16_layers); mismatch/kl {recipe[KL_KEY]:.3e} "
      f"{verdict} the target {target_kl:.3e}; KV capacity {recipe['capacity_ratio']:.3f}x "
      f"BF16 ({settings.kv_granularity} scales, {seq_len}-token sequences)"
    )
  result["png"] = None
  if png_path:
    title = f"{source}: {cfg.model_type} L={cfg.num_layers}, noise sigma={settings.noise_sigma:g}"
    if plot(rows, png_path, title):
      result["png"] = png_path
      log(f"wrote {png_path}")
    else:
      log("matplotlib is not installed: no PNG written")
  result["seconds"] = time.perf_counter() - start
  if json_path:
    json_file.write_json(json_path, result)
    log(f"wrote {json_path}")
  return result
