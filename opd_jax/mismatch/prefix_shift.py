"""Prefix shift: how far a perturbed engine's decodes drift from the unperturbed engine's.

    python -m opd_jax.prefix_shift --config=... --source=noise:0.05 [--source=fp8 ...]

Per-token corrections (importance ratios) fix the probability of each sampled token, not
which prefixes generation reaches. This module measures the second effect for one
perturbed engine π_b against the unperturbed engine π_θ (the trainer's weights, KV cache in
the compute dtype), both sampling the same calibration prompts with the same key, so that
step c of row b draws with the same uniform u_{b,c} in both engines (`measure.engine_keys`;
the sampler inverts the CDF in vocabulary order):

  teacher-forced KL   KL_t = KL(π_b(·|x_<t) ‖ π_θ(·|x_<t)) on the unperturbed engine's own
                      samples x ~ π_θ: both policies scored on the same reference prefixes.
                      π_b is the perturbed engine run teacher-forced (its weights, kernel and
                      KV numerics: `engine_logits`).
  own-prefix KL       the same KL on the perturbed engine's own samples x ~ π_b (what a
                      training step sees: `measure.measure`'s mismatch/kl). Its per-sequence
                      sum is the sequence-level KL(P_b ‖ P_θ) by the chain rule.
  first divergence    d_b = the first completion position where the two engines' tokens
                      (or their stop) differ; rows that never differ are censored at their
                      reference completion length L_b. Reported as a histogram over
                      0 … C−1 plus "never", the mean over diverged rows, the diverged
                      fraction and the censored mean E[min(d_b, L_b)].

Prediction from per-token mismatch. Until they diverge the two engines share their prefix,
which is the reference prefix, so d_b is set by the per-token flip probability of the
shared-uniform coupling on the reference prefixes. With cumulative distributions
F_j = Σ_{i≤j} π_θ(i), G_j = Σ_{i≤j} π_b(i), both engines draw token j iff u lies in
[F_{j−1}, F_j) ∩ [G_{j−1}, G_j), so

  flip_t = 1 − Σ_j max(0, min(F_j, G_j) − max(F_{j−1}, G_{j−1}))      (≥ TV_t)

and, treating the steps' uniforms as independent, P(d_b ≥ c) = Π_{s<c} (1 − flip_s),
predicted diverged fraction 1 − Π_{s<L_b} (1 − flip_s), predicted E[min(d_b, L_b)] =
Σ_{c=1}^{L_b} Π_{s<c} (1 − flip_s). Setting the observed figures beside these predictions
says whether a perturbation shifts prefixes more than its per-token mismatch implies.

Staleness. A candidate with a weight lag k (rollout.stale_k, or rollout.max_lag in async mode)
is the engine that samples with θ_{t−k}, the run's student k steps before the one measured
(θ_t): the same figures with π_b built from θ_{t−k}. It needs a trainer workdir holding both
checkpoints (`--params-from`, `sensitivity.load_student_and_lagged`). Needs
the full behaviour distribution (V ≤ 4096, `mismatch.default_return_topk`) and unfiltered
sampling at T > 0 (top-k/top-p kept sets differ between the engines).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from opd_jax.config import check as config_check
from opd_jax.config.values import DEFAULT_NUM_PROMPTS
from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import teacher_forcing, transform
from opd_jax.io import json_file, provenance
from opd_jax.mismatch import admission, sensitivity
from opd_jax.mismatch import candidates as candidates_lib
from opd_jax.mismatch import measure as measure_lib
from opd_jax.model import kvcache
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.model.kvcache import KVCacheSpec
from opd_jax.train import losses
from opd_jax.train import setup as setup_lib
from opd_jax.train.mismatch_metrics import FULL_DISTRIBUTION_MAX_VOCAB

KL_KEY = "mismatch/kl"
# Rollout keys reset before a --source applies: every source is measured against the
# unperturbed engine alone, whatever engine the run config names.
REFERENCE_ROLLOUT = {
  "weights": "trainer",
  "bf16_layers": (),
  "kv_cache": "auto",
  "kv_bf16_layers": (),
  "noise_sigma": 0.0,
  "noise_layers": (),
  "noise_modules": (),
  "kernel": "reference",
  "mode": "sync",
  "stale_k": 0,
}
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "max_new_tokens")


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "temperature"))
def engine_logits(params_r, rollout: Rollout, cfg: ModelConfig, spec: KVCacheSpec, temperature):
  """The engine's logits / T at the rollout's completion positions, teacher-forced.

  One cached forward over prompt + completion from an empty cache with the engine's KV
  numerics: every token attends to the dequantized cache as in decoding, and a "tensor" KV
  scale is calibrated on the prompt tokens alone (`valid_len_b` = prompt lengths), as the
  sampler's prefill calibrates it.

  Args:
    params_r: the engine's weights (`transform.engine_params`, kernel marker included).
    rollout: the prefixes to score.
    cfg: the model config (static).
    spec: the engine's KV numerics (static).
    temperature: T > 0 (static).

  Returns:
    f32 [B, C, V].
  """
  seq = rollout.sequences()
  b, t = seq.tokens_bt.shape
  cache = kvcache.init_cache(cfg, b, t, spec)
  start_b = jnp.zeros((b,), jnp.int32)
  logits_btv, _ = model.forward_with_cache(
    params_r, seq.tokens_bt, start_b, cache, cfg, spec, rollout.prompt_lens
  )
  logits_bcv = jnp.take_along_axis(logits_btv, seq.logit_index_bc[:, :, None], axis=1)
  return logits_bcv / temperature


def coupled_flip_probability(lp_a_bcv, lp_b_bcv):
  """flip_t of the module docstring: P(two inverse-CDF draws with one uniform differ), f32 [B, C].

  Args:
    lp_a_bcv, lp_b_bcv: log-probabilities [B, C, V] over the same vocabulary order.
  """
  p_a = jnp.exp(lp_a_bcv.astype(jnp.float32))
  p_b = jnp.exp(lp_b_bcv.astype(jnp.float32))
  hi_a = jnp.cumsum(p_a, axis=-1)
  hi_b = jnp.cumsum(p_b, axis=-1)
  hi_a, hi_b = hi_a / hi_a[..., -1:], hi_b / hi_b[..., -1:]
  lo_a = jnp.pad(hi_a[..., :-1], [(0, 0)] * (hi_a.ndim - 1) + [(1, 0)])
  lo_b = jnp.pad(hi_b[..., :-1], [(0, 0)] * (hi_b.ndim - 1) + [(1, 0)])
  same = jnp.sum(jnp.maximum(0.0, jnp.minimum(hi_a, hi_b) - jnp.maximum(lo_a, lo_b)), axis=-1)
  return jnp.clip(1.0 - same, 0.0, 1.0)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "temperature"))
def _teacher_forced(params, params_r, reference: Rollout, cfg, spec, temperature):
  """Per-token KL(π_b ‖ π_θ), TV and flip probability on the reference prefixes, [B, C]."""
  engine_lp = jax.nn.log_softmax(engine_logits(params_r, reference, cfg, spec, temperature))
  student_bcv, _, _ = teacher_forcing.completion_logits(params, reference, cfg, temperature)
  student_lp = jax.nn.log_softmax(student_bcv)
  kl_bc = losses.bucket_kl(engine_lp, student_lp)
  tv_bc = 0.5 * jnp.sum(jnp.abs(jnp.exp(engine_lp) - jnp.exp(student_lp)), axis=-1)
  return kl_bc, tv_bc, coupled_flip_probability(student_lp, engine_lp)


def first_divergence(tokens_a_bc, mask_a_bc, tokens_b_bc, mask_b_bc) -> np.ndarray:
  """d_b: the first position where the two decodes differ (a token, or one stopped), −1 if
  never. numpy int [B]."""
  tokens_a_bc, tokens_b_bc = np.asarray(tokens_a_bc), np.asarray(tokens_b_bc)
  mask_a_bc, mask_b_bc = np.asarray(mask_a_bc) > 0, np.asarray(mask_b_bc) > 0
  differ_bc = (mask_a_bc != mask_b_bc) | (mask_a_bc & (tokens_a_bc != tokens_b_bc))
  return np.where(differ_bc.any(axis=1), differ_bc.argmax(axis=1), -1)


def check_sampling(sampler_cfg, vocab_size: int) -> None:
  """Refuses the settings under which the study is undefined (module docstring)."""
  if sampler_cfg.temperature <= 0:
    raise ValueError("prefix shift needs sampling at temperature > 0 (greedy has no coupling)")
  if sampler_cfg.top_k > 0 or sampler_cfg.top_p < 1.0:
    raise ValueError(
      f"prefix shift needs unfiltered sampling (top_k=0, top_p=1), got top_k="
      f"{sampler_cfg.top_k}, top_p={sampler_cfg.top_p}: the engines' kept sets differ"
    )
  if vocab_size > FULL_DISTRIBUTION_MAX_VOCAB:
    raise ValueError(
      f"prefix shift needs the full distributions: vocabulary {vocab_size} > "
      f"{FULL_DISTRIBUTION_MAX_VOCAB}"
    )


def prefix_shift(
  student_params,
  cfg: ModelConfig,
  engine_cfg: transform.EngineConfig,
  prompts,
  rng,
  sampler_cfg,
  engine_params=None,
) -> dict:
  """The module docstring's figures for one perturbed engine.

  Args:
    student_params: θ (dense): the unperturbed engine's weights and the scoring student.
    cfg: its ModelConfig.
    engine_cfg: the perturbed engine.
    prompts: calibration prompts.
    rng: the shared key (the same uniforms in both engines).
    sampler_cfg: unfiltered sampling at T > 0 (`check_sampling`).
    engine_params: the dense weights the perturbed engine is built from: θ_{t−k} of the same
      run for a stale engine (lag k), None for θ itself.

  Returns:
    A dict of floats: "teacher_forced/kl" (mean, and _p95), "own_prefix/kl" (and _p95),
    "own_over_teacher_forced", "teacher_forced/seq_kl" and "own_prefix/seq_kl" (mean per
    sequence of Σ_t KL_t), "teacher_forced/tv", "teacher_forced/flip", "first_divergence"
    (mean over diverged rows, NaN if none), "diverged_fraction", "censored_first_divergence"
    (E[min(d, L)]), "predicted/diverged_fraction", "predicted/censored_first_divergence",
    "histogram" (list of C + 1 counts: positions 0..C−1, then never), "engine_id".
  """
  check_sampling(sampler_cfg, cfg.real_vocab_size)
  temperature = sampler_cfg.temperature
  compute_dtype = jnp.dtype(model.compute_dtype(student_params)).name
  ref_engine = sensitivity.reference_engine(compute_dtype)
  reference = measure_lib.engine_rollout(student_params, cfg, ref_engine, prompts, rng, sampler_cfg)
  source_params = student_params if engine_params is None else engine_params
  perturbed = measure_lib.engine_rollout(source_params, cfg, engine_cfg, prompts, rng, sampler_cfg)
  own, own_kl_bc = measure_lib.score_rollout(
    student_params, perturbed.replace(engine_id=""), cfg, temperature
  )
  params_r, _ = measure_lib.engine_inputs(source_params, engine_cfg, rng)  # the engine's weights
  tf = _teacher_forced(
    student_params, params_r, reference.replace(engine_id=""), cfg, engine_cfg.kv, temperature
  )
  kl_bc, tv_bc, flip_bc = (np.asarray(x, np.float64) for x in jax.device_get(tf))
  own = {k: float(v) for k, v in jax.device_get(own).items()}
  mask_bc = np.asarray(reference.completion_mask) > 0
  own_mask_bc = np.asarray(perturbed.completion_mask) > 0
  lens_b = mask_bc.sum(axis=1)
  c = mask_bc.shape[1]
  d_b = first_divergence(
    reference.completion_tokens,
    reference.completion_mask,
    perturbed.completion_tokens,
    perturbed.completion_mask,
  )
  diverged_b = d_b >= 0
  censored_b = np.where(diverged_b, np.minimum(d_b, lens_b), lens_b)
  # Along the shared (reference) prefix: P(d > c) = Π_{s≤c} (1 − flip_s), and
  # E[min(d, L)] = Σ_{c<L} P(d > c). The mask is a prefix of each row, so the sums over it
  # stop at L.
  survive_bc = np.cumprod(np.where(mask_bc, 1.0 - flip_bc, 1.0), axis=1)
  predicted_censored_b = np.sum(np.where(mask_bc, survive_bc, 0.0), axis=1)
  kl_tf = kl_bc[mask_bc]
  tf_mean = float(kl_tf.mean()) if kl_tf.size else 0.0
  histogram = np.bincount(np.where(diverged_b, d_b, c), minlength=c + 1)
  own_seq_b = np.sum(np.where(own_mask_bc, np.asarray(own_kl_bc, np.float64), 0.0), axis=1)
  return {
    "engine_id": engine_cfg.engine_id,
    "teacher_forced/kl": tf_mean,
    "teacher_forced/kl_p95": float(np.quantile(kl_tf, 0.95)) if kl_tf.size else 0.0,
    "own_prefix/kl": own[KL_KEY],
    "own_prefix/kl_p95": own["mismatch/kl_p95"],
    "own_over_teacher_forced": own[KL_KEY] / tf_mean if tf_mean > 0 else float("nan"),
    "teacher_forced/seq_kl": float(np.sum(np.where(mask_bc, kl_bc, 0.0), axis=1).mean()),
    "own_prefix/seq_kl": float(own_seq_b.mean()),
    "teacher_forced/tv": float(tv_bc[mask_bc].mean()),
    "teacher_forced/flip": float(flip_bc[mask_bc].mean()),
    "first_divergence": float(d_b[diverged_b].mean()) if diverged_b.any() else float("nan"),
    "diverged_fraction": float(diverged_b.mean()),
    "censored_first_divergence": float(censored_b.mean()),
    "predicted/diverged_fraction": float(np.mean(1.0 - survive_bc[:, -1])),
    "predicted/censored_first_divergence": float(predicted_censored_b.mean()),
    "histogram": histogram.tolist(),
  }


SHORTHANDS = {
  "fp8": "rollout.weights=fp8,rollout.kv_cache=fp8",
  "fp8_weights": "rollout.weights=fp8",
  "fp8_kv": "rollout.kv_cache=fp8",
}


def source_specs(source: str) -> list[tuple[str, str]]:
  """(name, admission candidate spec) for one --source: `noise:<σ>[:<σ>...]`, `kernel:<name>`,
  `fp8`, `fp8_weights`, `fp8_kv`, or a `rollout.<key>=<value>[,...]` candidate spec."""
  if source in SHORTHANDS:
    return [(source, SHORTHANDS[source])]
  kind, sep, rest = source.partition(":")
  if sep and kind == "noise":
    specs = []
    for raw in rest.split(":"):
      try:
        sigma = float(raw)
      except ValueError as e:
        raise ValueError(f"--source {source!r}: noise sigma {raw!r} is not a number") from e
      specs.append((f"noise:{sigma:g}", f"rollout.noise_sigma={sigma!r}"))
    return specs
  if sep and kind == "kernel":
    return [(source, f"rollout.kernel={rest}")]
  if source.startswith(("rollout.", "config.rollout.")):
    return [(source, source)]
  raise ValueError(
    f"unknown --source {source!r}; use noise:<sigma>[:<sigma>...], kernel:<name>, "
    f"{', '.join(SHORTHANDS)}, or rollout.<key>=<value>[,...]"
  )


def source_engine(spec: str, config: ml_collections.ConfigDict) -> transform.EngineConfig:
  """The engine of a candidate spec applied to `config` with its engine reset to the
  reference (`REFERENCE_ROLLOUT`); refuses specs that change sampling or staleness."""
  candidate = source_candidate(spec, config)
  if candidate.lag:
    raise ValueError(
      f"--source {spec!r} changes the weight lag: both engines must sample from the same "
      "weights here (a lag needs the run's earlier checkpoint: `run_prefix_shift`)"
    )
  return candidate.engine_cfg


def source_candidate(spec: str, config: ml_collections.ConfigDict) -> candidates_lib.Candidate:
  """A candidate spec applied to `config` with its engine reset to the reference
  (`REFERENCE_ROLLOUT`); refuses specs that change sampling (both engines must sample alike).

  Its `lag` k (rollout.stale_k, or rollout.max_lag in async mode: the worst batch's lag) makes
  a stale engine: the perturbed engine is built from θ_{t−k}, the run's student k steps (one
  weight version each) before the one measured."""
  base = ml_collections.ConfigDict(config.to_dict())
  for key, value in REFERENCE_ROLLOUT.items():
    base.rollout[key] = value
  candidate = candidates_lib.parse_candidate(spec, base)
  changed = [k for k in SAMPLING_KEYS if candidate.config.rollout[k] != base.rollout[k]]
  if changed:
    raise ValueError(
      f"--source {spec!r} changes {changed}: both engines must sample alike (set sampling in "
      "--config)"
    )
  return candidate


def format_table(rows: Sequence[dict]) -> str:
  """One line per source: the per-token and prefix figures side by side."""
  width = max([6, *(len(r["name"]) for r in rows)])
  cols = (
    ("source", "name", f"<{width}", "s"),
    ("tf_kl", "teacher_forced/kl", ">10", ".3e"),
    ("own_kl", "own_prefix/kl", ">10", ".3e"),
    ("own/tf", "own_over_teacher_forced", ">7", ".2f"),
    ("flip", "teacher_forced/flip", ">8", ".4f"),
    ("diverged", "diverged_fraction", ">8", ".3f"),
    ("pred", "predicted/diverged_fraction", ">6", ".3f"),
    ("E[min(d,L)]", "censored_first_divergence", ">11", ".2f"),
    ("pred", "predicted/censored_first_divergence", ">6", ".2f"),
    ("d|div", "first_divergence", ">6", ".2f"),
  )
  head = " ".join(f"{name:{align}}" for name, _, align, _ in cols)
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(" ".join(f"{r[key]:{align}{fmt}}" for _, key, align, fmt in cols))
  return "\n".join(lines)


def run_prefix_shift(
  config: ml_collections.ConfigDict,
  sources: Sequence[str],
  *,
  params_from: str | None = None,
  num_prompts: int = DEFAULT_NUM_PROMPTS,
  json_path: str | None = None,
  log: Callable[..., None] = print,
) -> dict:
  """Measures every --source against the unperturbed engine; returns what --json writes.

  Returns:
    {"student", "num_prompts", "sampler", "rows": [{"name", "spec", "lag",
     **prefix_shift(...)}], "seconds"}. A candidate with a weight lag k (rollout.stale_k, or
    rollout.max_lag in async mode) builds its engine from θ_{t−k}, the run's checkpoint k steps
    before the latest (`sensitivity.load_student_and_lagged`; needs `params_from`).
  """
  start = time.perf_counter()
  if not sources:
    raise ValueError("give at least one --source")
  config_check.validate(config)
  specs = [pair for source in sources for pair in source_specs(source)]
  engines = [(name, spec, source_candidate(spec, config)) for name, spec in specs]
  models, task_cfg, params, student, lagged = sensitivity.load_student_and_lagged(
    config, params_from, [c for *_, c in engines], log
  )
  cfg = models.student_cfg
  _, tokens_bp, lens_b = admission.calibration_prompts(
    config, models.tokenizer, task_cfg, num_prompts
  )
  rng = admission.measurement_key(config)
  compute_dtype = jnp.dtype(model.compute_dtype(params)).name
  scfg = setup_lib.sampler_config(
    setup_lib.run_spec(config),
    models.tokenizer.eos_id,
    KVCacheSpec(compute_dtype),
    cfg.real_vocab_size,
  )
  check_sampling(scfg, cfg.real_vocab_size)
  log(f"prefix shift of {student}: {num_prompts} prompts, T={scfg.temperature:g}")
  rows = []
  for name, spec, candidate in engines:
    ecfg, lag = candidate.engine_cfg, candidate.lag
    row = {
      "name": name,
      "spec": spec,
      "lag": lag,
      **prefix_shift(params, cfg, ecfg, (tokens_bp, lens_b), rng, scfg, lagged.get(lag)),
    }
    rows.append(row)
    log(
      f"  {name}: teacher-forced kl {row['teacher_forced/kl']:.3e}, own-prefix kl "
      f"{row['own_prefix/kl']:.3e}, diverged {row['diverged_fraction']:.3f}, "
      f"first divergence {row['first_divergence']:.2f}"
    )
  log(format_table(rows))
  result = {
    "provenance": provenance.provenance(config),
    "student": student,
    "num_prompts": num_prompts,
    "sampler": dataclasses.asdict(scfg),
    "rows": rows,
    "seconds": time.perf_counter() - start,
  }
  if json_path:
    json_file.write_json(json_path, result)
    log(f"wrote {json_path}")
  return result
