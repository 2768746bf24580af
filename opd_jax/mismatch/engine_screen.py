"""Screening an engine that is not this one, from its own samples of the calibration prompts.

`mismatch/kl` is KL(π_engine ‖ π_θ) per token, the engine's sampled distribution against the
trainer's student on the engine's own prefixes. Its sampled-token estimator needs only what any
engine returns, the sampled tokens y_t ~ π_engine and their log-probabilities:

    ρ_t  = log π_θ(y_t | prefix_t) − log π_engine(y_t | prefix_t)
    k3_t = exp(ρ_t) − 1 − ρ_t = expm1(ρ_t) − ρ_t            (≥ 0; computed in float64)
    E_{y_t ~ π_engine}[k3_t] = KL(π_engine ‖ π_θ)(prefix_t)   (E[exp ρ] = 1 over π_engine's
                                                             support, so E[k3] = E[−ρ] = KL)

The estimate is the token mean over every completion, K̂ = Σ_i S_i / Σ_i n_i (S_i the sum of
k3 over completion i's n_i tokens), as `mismatch/kl` is a token mean. Its interval resamples
prompts, each with all its completions (the tokens of one completion share a prefix, and the
completions of one prompt share the prompt: neither are independent; with one completion per
prompt, this resamples completions): B bootstrap draws of the N prompts with replacement,
K̂*_b = Σ w_bi S_i / Σ w_bi n_i (S_i, n_i now summed over prompt i's completions), and either the
percentile interval [q_(α/2), q_(1−α/2)] of the K̂*_b or BCa (bias-corrected and accelerated,
Efron 1987) with the bias z0 = Φ⁻¹(#{K̂* < K̂}/B) and the acceleration a from the jackknife over
the resampled units (prompts, or completions when each prompt has one), leaving out unit i:
a = Σ (θ̄ − θ_(i))³ / (6 (Σ (θ̄ − θ_(i))²)^{3/2}).

When the estimate breaks (the inputs `check_samples` refuses):
- log-probabilities taken after a top-k / top-p / min-p filter and renormalised: π_engine is
  then not the model's softmax at the temperature, and E[exp ρ] ≠ 1 off the kept set;
- a temperature other than the check's: π_θ is scored at the check's temperature, so the two
  log-probabilities would be of different distributions; greedy decoding (T = 0) has no
  sampled distribution at all;
- token ids outside the vocabulary, prompts other than the exported ones, completions longer
  than the check's max_new_tokens or going on past the stop token (other settings);
- non-finite log-probabilities (caught when the file is read, `io.engine_samples`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import teacher_forcing
from opd_jax.io.engine_samples import EngineCompletion
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_rules
from opd_jax.model.config import ModelConfig
from opd_jax.train import losses

METHODS = ("percentile", "bca")
NUM_BOOTSTRAP = 2000
LEVEL = 0.95
SEED = 0
SCORE_ROWS = 8  # completions per teacher-forced forward (fixed, so one program for all batches)
TEMPERATURE_TOLERANCE = 1e-6
MAX_RHO = 700.0  # exp(ρ) overflows float64 just above 709


@dataclasses.dataclass(frozen=True)
class Matched:
  """The samples paired with the exported prompts (`check_samples`).

  Attributes:
    prompt_index: int [N], the exported prompt each completion completes.
    completions: the N completions, in file order.
    temperature: the temperature they were sampled at (the check's).
  """

  prompt_index: np.ndarray
  completions: tuple[EngineCompletion, ...]
  temperature: float


def _declared_temperature(c: EngineCompletion, flag: float | None) -> float:
  declared = c.sampling.get("temperature")
  if declared is None and flag is None:
    raise ValueError(
      f"{c.where}: the samples do not say which temperature they were sampled at; add "
      "'temperature' (or 'sampling_params': {'temperature': T}) to each record, or pass "
      "--engine-temperature=T"
    )
  if declared is not None and flag is not None and abs(declared - flag) > TEMPERATURE_TOLERANCE:
    raise ValueError(
      f"{c.where}: temperature mismatch: the record says {declared:g}, --engine-temperature "
      f"{flag:g}"
    )
  return float(declared if declared is not None else flag)


def check_samples(
  completions: Sequence[EngineCompletion],
  prompts: Sequence[Mapping],
  *,
  vocab_size: int,
  temperature: float,
  max_new_tokens: int,
  stop_tokens: Sequence[int] = (),
  engine_temperature: float | None = None,
) -> Matched:
  """Pairs each completion with its exported prompt and refuses what the estimate cannot read
  (module docstring).

  Args:
    completions: `io.engine_samples.read_engine_samples`'s.
    prompts: the exported prompts ({"prompt_id", "prompt_token_ids"}), in export order.
    vocab_size: V_real: token ids must be in [0, V).
    temperature: the check's temperature T (> 0), the one π_θ is scored at.
    max_new_tokens: the check's completion budget C.
    stop_tokens: the ids that end a completion.
    engine_temperature: the temperature the engine sampled at, for records that do not say.

  Raises:
    ValueError: naming the completion and the problem.
  """
  if not temperature > 0:
    raise ValueError(
      f"the check samples at temperature {temperature}: greedy decoding has no sampled "
      "distribution to estimate a KL from; screen at a temperature > 0"
    )
  by_id = {str(p["prompt_id"]): i for i, p in enumerate(prompts)}
  by_tokens = {tuple(int(t) for t in p["prompt_token_ids"]): i for i, p in enumerate(prompts)}
  index = []
  for c in completions:
    if c.prompt_id is not None and c.prompt_id in by_id:
      i = by_id[c.prompt_id]
      exported = tuple(int(t) for t in prompts[i]["prompt_token_ids"])
      if c.prompt_token_ids is not None and c.prompt_token_ids != exported:
        raise ValueError(
          f"{c.where}: prompts not matching the exported ones: prompt {c.prompt_id!r} has "
          f"{len(c.prompt_token_ids)} token ids here, not the {len(exported)} exported (give "
          "the engine the exported prompt_token_ids, not the text, so that it does not "
          "tokenize again)"
        )
    elif c.prompt_token_ids is not None and c.prompt_token_ids in by_tokens:
      i = by_tokens[c.prompt_token_ids]
    elif c.prompt_id is not None or c.prompt_token_ids is not None:
      raise ValueError(
        f"{c.where}: prompts not matching the exported ones: prompt id {c.prompt_id!r} is not "
        "among the exported ids and its prompt token ids match no exported prompt (export "
        "with the same --config and --prompts)"
      )
    else:
      raise ValueError(
        f"{c.where}: the record names no prompt: give it 'prompt_id' (vLLM: the request_id; "
        "SGLang: rid) or its 'prompt_token_ids'"
      )
    for key, off in (("top_k", 0), ("top_p", 1), ("min_p", 0)):
      value = c.sampling.get(key)
      if value is not None and (value < 1.0 if key == "top_p" else value > 0):
        raise ValueError(
          f"{c.where}: sampled with {key}={value:g}: the log-probabilities are of the filtered, "
          f"renormalised distribution, which the trainer's softmax is not; sample with "
          f"{key}={off}{' (vLLM: -1)' if key == 'top_k' else ''}"
        )
    engine_t = _declared_temperature(c, engine_temperature)
    if abs(engine_t - temperature) > TEMPERATURE_TOLERANCE:
      raise ValueError(
        f"{c.where}: temperature mismatch: sampled at {engine_t:g}, the check scores the "
        f"trainer at {temperature:g} (--config.rollout.temperature); sample at {temperature:g}"
      )
    bad = c.token_ids[(c.token_ids < 0) | (c.token_ids >= vocab_size)]
    if bad.size:
      raise ValueError(
        f"{c.where}: token id {int(bad[0])} is outside the vocabulary [0, {vocab_size}): the "
        "engine ran another tokenizer or model"
      )
    if len(c.token_ids) > max_new_tokens:
      raise ValueError(
        f"{c.where}: {len(c.token_ids)} tokens, more than the check's max_new_tokens "
        f"{max_new_tokens}: sample with max_tokens={max_new_tokens}"
      )
    stops = np.flatnonzero(np.isin(c.token_ids[:-1], list(stop_tokens)))
    if stops.size:
      raise ValueError(
        f"{c.where}: the completion goes on past the stop token at position {int(stops[0])}: "
        "sample with the exported stop_token_ids (and without ignore_eos)"
      )
    index.append(i)
  return Matched(np.asarray(index, np.int64), tuple(completions), float(temperature))


def samples_rollout(
  prompt_tokens_np, prompt_lens_n, matched: Matched, max_new_tokens: int, rows=None
) -> Rollout:
  """The completions as a Rollout [N', C] (`rows`: which completions; default all), the
  engine's log-probabilities as its behaviour log-probabilities, completions right-padded
  with 0 and masked out."""
  rows = range(len(matched.completions)) if rows is None else rows
  rows = list(rows)
  b, c = len(rows), max_new_tokens
  tokens_bc = np.zeros((b, c), np.int32)
  mask_bc = np.zeros((b, c), np.int32)
  logp_bc = np.zeros((b, c), np.float32)
  for r, i in enumerate(rows):
    comp = matched.completions[i]
    n = len(comp.token_ids)
    tokens_bc[r, :n] = comp.token_ids
    mask_bc[r, :n] = 1
    logp_bc[r, :n] = comp.logprobs
  index = matched.prompt_index[rows]
  return Rollout(
    prompt_tokens=jnp.asarray(np.asarray(prompt_tokens_np)[index], jnp.int32),
    prompt_lens=jnp.asarray(np.asarray(prompt_lens_n)[index], jnp.int32),
    completion_tokens=jnp.asarray(tokens_bc),
    completion_mask=jnp.asarray(mask_bc),
    behaviour_logprobs=jnp.asarray(logp_bc),
    model_logprobs=jnp.asarray(logp_bc),
    weight_version=jnp.zeros((), jnp.int32),
  )


@functools.partial(jax.jit, static_argnames=("cfg", "temperature"))
def trainer_token_logprobs(params, rollout: Rollout, cfg: ModelConfig, temperature: float):
  """log π_θ(y_t) [B, C] f32: log_softmax(forward(θ)/T) at each completion token, teacher
  forced on the rollout's own prefixes (`teacher_forcing.completion_logits`)."""
  logits_bcv, tokens_bc, _ = teacher_forcing.completion_logits(params, rollout, cfg, temperature)
  return losses.token_logprobs(logits_bcv, tokens_bc)


def score_samples(
  params, cfg: ModelConfig, prompt_tokens_np, prompt_lens_n, matched: Matched, max_new_tokens: int
) -> list[np.ndarray]:
  """log π_θ of every sampled token, one float64 array per completion, scored SCORE_ROWS
  completions at a time (the last batch padded by repeating its first row)."""
  n = len(matched.completions)
  out: list[np.ndarray] = []
  for start in range(0, n, SCORE_ROWS):
    rows = list(range(start, min(start + SCORE_ROWS, n)))
    padded = rows + [rows[0]] * (SCORE_ROWS - len(rows))
    rollout = samples_rollout(prompt_tokens_np, prompt_lens_n, matched, max_new_tokens, padded)
    lp_bc = np.asarray(trainer_token_logprobs(params, rollout, cfg, matched.temperature))
    for r, i in enumerate(rows):
      out.append(lp_bc[r, : len(matched.completions[i].token_ids)].astype(np.float64))
  return out


def k3(trainer_logprobs, engine_logprobs) -> np.ndarray:
  """k3_t = expm1(ρ_t) − ρ_t, ρ_t = log π_θ(y_t) − log π_engine(y_t), in float64 (module
  docstring); the same shape as its inputs."""
  rho = np.asarray(trainer_logprobs, np.float64) - np.asarray(engine_logprobs, np.float64)
  return np.expm1(rho) - rho


def _ratio(weights_bn, sums_n, counts_n):
  return (weights_bn @ sums_n) / (weights_bn @ counts_n)


def bootstrap_interval(
  sums_n,
  counts_n,
  *,
  level: float = LEVEL,
  num_bootstrap: int = NUM_BOOTSTRAP,
  seed: int = SEED,
  method: str = "percentile",
) -> tuple[float, float]:
  """The `level` interval of the token mean Σ S_i / Σ n_i, resampling the N units (prompts, or
  completions; module docstring: percentile or BCa).

  Args:
    sums_n: float [N], S_i, the per-unit sums of k3.
    counts_n: int [N], n_i ≥ 1, the per-unit token counts.
    level: the interval's coverage in (0, 1).
    num_bootstrap: B ≥ 1 resamples.
    seed: numpy seed of the resampling.
    method: one of METHODS.

  Returns:
    (low, high).
  """
  if method not in METHODS:
    raise ValueError(f"unknown interval method {method!r}; known: {', '.join(METHODS)}")
  if not 0 < level < 1:
    raise ValueError(f"level must be in (0, 1), got {level!r}")
  sums_n = np.asarray(sums_n, np.float64)
  counts_n = np.asarray(counts_n, np.float64)
  n = len(sums_n)
  if n < 2:
    raise ValueError(f"a bootstrap interval needs at least 2 prompts (resampled units), got {n}")
  rng = np.random.default_rng(seed)
  weights_bn = rng.multinomial(n, np.full(n, 1.0 / n), size=num_bootstrap).astype(np.float64)
  boot_b = _ratio(weights_bn, sums_n, counts_n)
  alpha = (1 - level) / 2
  if method == "percentile":
    return float(np.quantile(boot_b, alpha)), float(np.quantile(boot_b, 1 - alpha))
  estimate = sums_n.sum() / counts_n.sum()
  normal = statistics.NormalDist()
  below = np.clip(np.mean(boot_b < estimate), 1.0 / num_bootstrap, 1 - 1.0 / num_bootstrap)
  z0 = normal.inv_cdf(float(below))
  jack_n = (sums_n.sum() - sums_n) / (counts_n.sum() - counts_n)
  dev_n = jack_n.mean() - jack_n
  denom = 6.0 * float(np.sum(dev_n**2)) ** 1.5
  accel = float(np.sum(dev_n**3)) / denom if denom > 0 else 0.0
  ends = []
  for a in (alpha, 1 - alpha):
    z = z0 + normal.inv_cdf(a)
    ends.append(float(np.quantile(boot_b, normal.cdf(z0 + z / (1 - accel * z)))))
  return ends[0], ends[1]


def estimate_kl(
  trainer_logprobs: Sequence[np.ndarray],
  engine_logprobs: Sequence[np.ndarray],
  *,
  level: float = LEVEL,
  num_bootstrap: int = NUM_BOOTSTRAP,
  seed: int = SEED,
  method: str = "percentile",
  groups=None,
) -> dict:
  """K̂ = the token mean of k3 over the completions, with its bootstrap interval.

  Args:
    trainer_logprobs, engine_logprobs: one array of log-probabilities per completion, the
      same lengths.
    groups: int [N], the prompt of each completion: the interval resamples prompts, each
      with all its completions (several completions of one prompt share it and are not
      independent); None: every completion its own group.

  Returns:
    {"mismatch/kl": K̂, "mismatch/kl_low", "mismatch/kl_high": the interval,
     "mismatch/k1": the token mean of −ρ, "mismatch/abs_logp_diff": of |ρ|,
     "measure/completions", "measure/prompts", "measure/tokens", "interval": {"method",
     "level", "num_bootstrap", "seed"}}.
  """
  pairs = list(zip(trainer_logprobs, engine_logprobs, strict=True))
  if not all(np.all(np.isfinite(t)) for t, _ in pairs):
    raise ValueError("the trainer's log-probabilities of the samples are not all finite")
  rho = np.concatenate([np.asarray(t, np.float64) - e for t, e in pairs])
  if rho.size and rho.max() > MAX_RHO:
    raise ValueError(
      f"a sampled token is exp({rho.max():.4g}) times likelier under the trainer than under the "
      "engine: k3 = expm1(ρ) − ρ overflows, the engine and the trainer are not the same model "
      "(or the log-probabilities are not the sampled distribution's)"
    )
  per_token = [k3(t, e) for t, e in pairs]
  sums_n = np.array([v.sum() for v in per_token])
  counts_n = np.array([len(v) for v in per_token])
  groups = np.arange(len(pairs)) if groups is None else np.asarray(groups)
  if groups.shape != (len(pairs),):
    raise ValueError(f"groups must give one prompt per completion, got shape {groups.shape}")
  _, index = np.unique(groups, return_inverse=True)
  low, high = bootstrap_interval(
    np.bincount(index, weights=sums_n),
    np.bincount(index, weights=counts_n),
    level=level,
    num_bootstrap=num_bootstrap,
    seed=seed,
    method=method,
  )
  value = float(sums_n.sum() / counts_n.sum())
  return {
    budget_lib.KL_KEY: value,
    "mismatch/kl_low": low,
    "mismatch/kl_high": high,
    "mismatch/k1": float(np.mean(-rho)),
    "mismatch/abs_logp_diff": float(np.mean(np.abs(rho))),
    "measure/completions": int(len(counts_n)),
    "measure/prompts": int(index.max() + 1) if len(index) else 0,
    "measure/tokens": int(counts_n.sum()),
    "interval": {"method": method, "level": level, "num_bootstrap": num_bootstrap, "seed": seed},
  }


def screen_verdict(
  estimate: Mapping,
  budget: budget_lib.Budget,
  rule: budget_lib.Rule | None = None,
  source: str | None = None,
  extrapolate: str = "refuse",
) -> tuple[dict, budget_rules.Verdict, bool]:
  """The budget's rule on the estimate: (the measurement judged, the Verdict, straddles).

  The measurement is {"mismatch/kl": K̂} with the engine's "source" when named; a rule that
  reads a combination's parts takes the whole's K̂ for each (an engine's parts cannot be
  sampled alone here: `apply_rule(..., unmeasured_parts="whole")`). `straddles` says whether
  the estimate's interval holds the limit, low ≤ limit < high: then the call is "too close"
  whatever the verdict. `extrapolate` is `budget_rules.apply_rule`'s, for a named `source`
  outside the budget's calibrated range."""
  measurement = {budget_lib.KL_KEY: float(estimate[budget_lib.KL_KEY])}
  if source:
    measurement[budget_lib.SOURCE_KEY] = source
  verdict = budget_rules.apply_rule(
    measurement, budget, rule, unmeasured_parts="whole", extrapolate=extrapolate
  )
  low, high = estimate["mismatch/kl_low"], estimate["mismatch/kl_high"]
  straddles = bool(low <= verdict.limit < high) and math.isfinite(verdict.limit)
  return measurement, verdict, straddles
