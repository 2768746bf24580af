"""Mismatch by token position: hand-computed buckets and first crossings, the names, NaN for an
empty bucket, and an engine whose KV cache is degraded at one position only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.data.rollout_types import Rollout
from opd_jax.model import kvcache
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.train import mismatch_metrics as mismatch

# B = 3, C = 5, w = 2: buckets p000_001, p002_003, p004_004. Row 2 has no counted token; the
# masked entries hold junk (NaN, 9) that must never be read.
KL = np.array(
  [
    [0.00, 0.20, 0.05, 0.30, np.nan],
    [0.01, 0.02, 0.03, 0.50, 0.90],
    [9.00, 9.00, 9.00, 9.00, 9.00],
  ],
  np.float32,
)
MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], np.int32)


def _scalars(d):
  return {k: float(v) for k, v in d.items()}


def test_buckets_and_first_crossings_hand_computed():
  m = _scalars(mismatch.position_metrics(jnp.asarray(KL), jnp.asarray(MASK), 2, 0.1))
  # p000_001: (0 + .2 + .01 + .02) / 4; p002_003: (.05 + .3 + .03 + .5) / 4; p004_004: .9 / 1.
  np.testing.assert_allclose(m["mismatch/kl_by_position/p000_001"], 0.23 / 4, rtol=1e-6)
  np.testing.assert_allclose(m["mismatch/kl_by_position/p002_003"], 0.88 / 4, rtol=1e-6)
  np.testing.assert_allclose(m["mismatch/kl_by_position/p004_004"], 0.9, rtol=1e-6)
  # Row 0 first exceeds 0.1 at t = 1, row 1 at t = 3; row 2 has no counted token.
  assert m["mismatch/first_cross_pos"] == 2.0
  assert m["mismatch/cross_frac"] == 1.0
  # κ = 0.4: only row 1 crosses (t = 3); row 0 counts in the share, not in the mean.
  m = _scalars(mismatch.position_metrics(jnp.asarray(KL), jnp.asarray(MASK), 2, 0.4))
  assert (m["mismatch/first_cross_pos"], m["mismatch/cross_frac"]) == (3.0, 0.5)
  # A value equal to κ does not cross (KL_t > κ).
  m = _scalars(mismatch.position_metrics(jnp.asarray(KL), jnp.asarray(MASK), 2, 0.9))
  assert np.isnan(m["mismatch/first_cross_pos"]) and m["mismatch/cross_frac"] == 0.0


def test_empty_bucket_and_no_completion_read_nan():
  mask = MASK.copy()
  mask[:, 4] = 0  # nothing counted at t = 4
  m = _scalars(mismatch.position_metrics(jnp.asarray(KL), jnp.asarray(mask), 2, 0.1))
  assert np.isnan(m["mismatch/kl_by_position/p004_004"])
  none = _scalars(mismatch.position_metrics(jnp.asarray(KL), jnp.zeros_like(MASK), 2, 0.1))
  assert np.isnan(none["mismatch/first_cross_pos"]) and np.isnan(none["mismatch/cross_frac"])


def test_names_are_zero_padded_and_sort_in_position_order():
  assert mismatch.position_buckets(40, 16) == [(0, 15), (16, 31), (32, 39)]
  names = [mismatch.bucket_name(a, z, 2000) for a, z in mismatch.position_buckets(2000, 16)]
  assert names[0] == "mismatch/kl_by_position/p0000_0015"
  assert names == sorted(names) and len(names) == 125
  assert mismatch.bucket_name(0, 7, 8) == "mismatch/kl_by_position/p000_007"


def test_summary_holds_json_values_with_none_for_nan():
  mask = MASK.copy()
  mask[:, 4] = 0
  s = mismatch.position_summary(KL, mask, 2, 0.1)
  assert s["kl_by_position"]["first"] == [0, 2, 4] and s["kl_by_position"]["last"] == [1, 3, 4]
  assert s["kl_by_position"]["kl"][2] is None and s["kl_by_position"]["tokens"] == [4, 4, 0]
  assert s["first_cross"] == {
    "kl": 0.1,
    "pos_mean": 2.0,
    "frac": 1.0,
    "crossed": 2,
    "completions": 2,
    "first": [1, 3],
  }


@pytest.mark.parametrize(
  ("w", "kappa", "match"),
  [(-1, 0.1, "mismatch_bucket_tokens"), (2.0, 0.1, "mismatch_bucket_tokens"), (2, 0.0, "cross_kl")],
)
def test_bad_settings_are_refused(w, kappa, match):
  with pytest.raises(ValueError, match=match):
    mismatch.position_metrics(jnp.asarray(KL), jnp.asarray(MASK), w, kappa)


def test_zero_bucket_width_turns_the_metrics_off_and_drops_the_array():
  metrics = {"mismatch/kl": 1.0, mismatch.PER_TOKEN_KL_KEY: jnp.asarray(KL)}
  assert mismatch.with_position_metrics(metrics, jnp.asarray(MASK), 0, 0.1) == {"mismatch/kl": 1.0}
  out = mismatch.with_position_metrics(metrics, jnp.asarray(MASK), 2, 0.1)
  assert mismatch.PER_TOKEN_KL_KEY not in out and "mismatch/first_cross_pos" in out


# --- an engine altered at one position ---------------------------------------------------------

CFG = ModelConfig(
  model_type="qwen3",
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  qk_norm=True,
)
F32 = kvcache.KVCacheSpec(dtype="float32")
B, P, C = 4, 4, 48  # prompt tokens, completion tokens
DEGRADED = 24  # the completion token whose cache entry the engine degrades
FIRST_READ = DEGRADED + 2  # the first completion position predicted from a query that reads it


def one_bit(x_bskh):
  """1-bit quantization of each key/value vector: sign(x) · mean |x| over the head dim."""
  return jnp.sign(x_bskh) * jnp.mean(jnp.abs(x_bskh), axis=-1, keepdims=True)


def degraded_engine_logits(params, tokens_bt):
  """The completion logits [B, C, V] of a cached engine whose cache entry at slot s = P +
  DEGRADED is 1-bit quantized right after it is written (every layer, K and V): positions ≤ s
  attend to the intact entry, positions > s to the degraded one."""
  s = P + DEGRADED
  cache = kvcache.init_cache(CFG, B, P + C, F32)
  head, cache = model.forward_with_cache(
    params, tokens_bt[:, : s + 1], jnp.zeros(B, jnp.int32), cache, CFG, F32
  )
  cache = [
    dict(
      e,
      k=e["k"].at[:, :, s].set(one_bit(e["k"][:, :, s])),  # slot s of the [B, K, S, H] cache
      v=e["v"].at[:, :, s].set(one_bit(e["v"][:, :, s])),
    )
    for e in cache
  ]
  tail, _ = model.forward_with_cache(
    params, tokens_bt[:, s + 1 : P + C - 1], jnp.full(B, s + 1, jnp.int32), cache, CFG, F32
  )
  logits = jnp.concatenate([head, tail], axis=1)  # positions 0 .. P + C − 2
  return logits[:, P - 1 :]  # position P − 1 + t predicts completion token t


def _rollout(tokens_bt, engine_bcv) -> Rollout:
  return Rollout(
    prompt_tokens=tokens_bt[:, :P],
    prompt_lens=jnp.full(B, P, jnp.int32),
    completion_tokens=tokens_bt[:, P:],
    completion_mask=jnp.ones((B, C), jnp.int32),
    behaviour_logprobs=jnp.zeros((B, C), jnp.float32),
    model_logprobs=jnp.zeros((B, C), jnp.float32),
    weight_version=jnp.asarray(0, jnp.int32),
    topk_logprobs=jax.nn.log_softmax(engine_bcv, axis=-1),
  )


def _model():
  params = model.init_params(jax.random.key(0), CFG, scale=0.5)
  tokens_bt = jax.random.randint(jax.random.key(1), (B, P + C), 0, CFG.vocab_size)
  return params, tokens_bt, model.forward(params, tokens_bt, CFG)[:, P - 1 : P + C - 1]


def test_kv_degraded_at_one_position_shows_from_the_first_query_that_reads_it():
  """The engine's cache entry of completion token 24 is 1-bit quantized once written; the first
  query that reads it predicts token 26. Every position before 26 is exact (< 1e-6: the cached
  f32 forward against the uncached one, ~1e-8), so the three buckets before p024_031 read ~0 and
  every completion first crosses κ at exactly 26. Every later query attends to the entry too,
  so the later buckets shift as well: on this 48-token completion they do not decay
  (p032_039 reads about twice p024_031), and the bucket of the position is not the largest.
  A mismatch confined to one position is the next test's engine."""
  params, tokens_bt, trainer_bcv = _model()
  rollout = _rollout(tokens_bt, degraded_engine_logits(params, tokens_bt))
  kl_bc = np.asarray(mismatch.per_token_kl(trainer_bcv, rollout))
  assert np.abs(kl_bc[:, :FIRST_READ]).max() < 1e-6
  kappa = 0.5 * float(kl_bc[:, FIRST_READ].min())
  assert kappa > 1e-4
  m = _scalars(mismatch.position_metrics(jnp.asarray(kl_bc), rollout.completion_mask, 8, kappa))
  assert m["mismatch/first_cross_pos"] == FIRST_READ and m["mismatch/cross_frac"] == 1.0
  buckets = {k: v for k, v in m.items() if k.startswith(mismatch.POSITION_PREFIX)}
  before = [v for k, v in buckets.items() if int(k[-7:-4]) + 7 < FIRST_READ]
  assert len(before) == 3 and max(abs(v) for v in before) < 1e-6
  after = [v for k, v in buckets.items() if int(k[-7:-4]) + 7 >= FIRST_READ]
  assert len(after) == 3 and min(after) > 1e-3


def test_engine_altered_at_one_step_only_shows_in_that_bucket_only():
  """An engine whose logits differ from the trainer's at one completion position p = 29 only
  (that step sampled at temperature 2): the KL is 0 at every other position (the same
  distributions), so only p024_031 is non-zero and every completion first crosses at 29."""
  _, tokens_bt, trainer_bcv = _model()
  p = 29
  engine_bcv = trainer_bcv.at[:, p].set(trainer_bcv[:, p] / 2.0)
  kl_bc = mismatch.per_token_kl(trainer_bcv, _rollout(tokens_bt, engine_bcv))
  kappa = 0.5 * float(jnp.min(kl_bc[:, p]))
  m = _scalars(mismatch.position_metrics(kl_bc, jnp.ones((B, C)), 8, kappa))
  buckets = {k: v for k, v in m.items() if k.startswith(mismatch.POSITION_PREFIX)}
  assert [k for k, v in buckets.items() if v != 0.0] == ["mismatch/kl_by_position/p024_031"]
  np.testing.assert_allclose(
    buckets["mismatch/kl_by_position/p024_031"], float(jnp.mean(kl_bc[:, p])) / 8, rtol=1e-5
  )
  assert m["mismatch/first_cross_pos"] == p and m["mismatch/cross_frac"] == 1.0


def test_micro_batches_combine_to_the_whole_batchs_position_metrics():
  """The per-token KL goes back to the batch's row order (`combine_microbatch_metrics`) before
  the position metrics are taken: K = 3 strided micro-batches give the full batch's values,
  which a token-weighted mean of the micro-batches' own bucket means would not (their buckets
  hold different token counts)."""
  from opd_jax.train import microbatch

  rng = np.random.default_rng(0)
  kl_bc = jnp.asarray(rng.exponential(0.1, (6, 10)), jnp.float32)
  mask_bc = jnp.asarray(np.arange(10)[None, :] < rng.integers(1, 11, (6, 1)), jnp.int32)
  parts = microbatch.split_microbatches(mask_bc, 3, batch_size=6)
  metrics_k = {mismatch.PER_TOKEN_KL_KEY: microbatch.split_microbatches(kl_bc, 3, batch_size=6)}
  combined = microbatch.combine_microbatch_metrics(metrics_k, jnp.full((3,), 1 / 3))
  got = _scalars(mismatch.with_position_metrics(combined, mask_bc, 4, 0.1))
  want = _scalars(mismatch.position_metrics(kl_bc, mask_bc, 4, 0.1))
  assert got == want
  assert parts.shape == (3, 2, 10)
