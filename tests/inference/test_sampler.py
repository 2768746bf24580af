"""The sampler against references: uncached forward, transformers, and numpy sampling math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg

from opd_jax.inference import decode_loop, distribution, sampler
from opd_jax.inference.sampler import SamplerConfig
from opd_jax.model import kvcache
from opd_jax.model import transformer as model

CFG = tiny_model_cfg()
# Lengths 5, 11, 1 and 14 (all in the 16-wide bucket); B=3 is padded to 4 rows.
PROMPTS = [[3, 17, 9, 4, 100], list(range(20, 31)), [7], [5] * 14]
# Tests share these configs (static jit args) so the suite compiles the sampler fewer times.
GREEDY = SamplerConfig(max_new_tokens=8, temperature=0.0)
SAMPLED = SamplerConfig(max_new_tokens=8, temperature=1.0, stop_tokens=(7,))
FP8_KV = "float8_e4m3fn"
FILTERED = SamplerConfig(max_new_tokens=6, temperature=0.9, top_k=7, top_p=0.8, return_topk=-1)


@pytest.fixture(scope="module")
def params():
  # A larger init scale than the default makes the distributions peaked, so greedy
  # argmaxes are separated by much more than f32 rounding.
  return model.init_params(jax.random.key(0), CFG, scale=0.3)


_forward = jax.jit(model.forward, static_argnames="cfg")


def reference_logits(params, prompt, completion, cfg=CFG):
  """Uncached logits [C, V] that predict each completion token (positions len-1+c)."""
  seq = np.asarray(list(prompt) + list(completion), np.int32)[None, :]
  width = 64  # fixed width: one compile; right padding cannot change causal logits
  padded = np.zeros((1, width), np.int32)
  padded[:, : seq.shape[1]] = seq
  logits = np.asarray(_forward(params, jnp.asarray(padded), cfg=cfg))[0]
  start = len(prompt) - 1
  return logits[start : start + len(completion)].astype(np.float64)


def np_log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  with np.errstate(divide="ignore"):
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def np_processed_logprobs(logits_cv, temperature, top_k, top_p):
  """Behaviour log-probs [C, V] by the textbook recipe, written independently."""
  out = []
  for row in logits_cv / temperature:
    order = np.argsort(-row, kind="stable")
    keep = np.zeros(row.shape, bool)
    keep[order[: top_k or row.size]] = True
    z = np.where(keep, row, -np.inf)
    probs = np.exp(np_log_softmax(z))
    mass = 0.0
    nucleus = np.zeros(row.shape, bool)
    for j in order:
      if mass >= top_p or not keep[j]:
        break
      nucleus[j] = True
      mass += probs[j]
    out.append(np_log_softmax(np.where(nucleus, row, -np.inf)))
  return np.stack(out)


def test_greedy_matches_uncached_argmax(params):
  out = sampler.sample(params, PROMPTS[:3], jax.random.key(0), GREEDY, CFG)
  assert out.completion_tokens.shape == (3, 8)
  assert out.prompt_tokens.shape == (3, 16)
  np.testing.assert_array_equal(out.completion_mask, 1)
  np.testing.assert_array_equal(out.behaviour_logprobs, 0.0)
  for b, prompt in enumerate(PROMPTS[:3]):
    seq = list(prompt)
    for _ in range(8):
      logits = reference_logits(params, seq, [0])[0]
      seq.append(int(np.argmax(logits)))
    got = np.asarray(out.completion_tokens[b])
    np.testing.assert_array_equal(got, seq[len(prompt) :])
    ref_lp = np_log_softmax(reference_logits(params, prompt, got))
    np.testing.assert_allclose(out.model_logprobs[b], ref_lp[np.arange(8), got], atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen2"])
def test_greedy_matches_transformers_generate(make_hf_checkpoint, model_type):
  import torch

  from opd_jax.io import hf

  ckpt = make_hf_checkpoint(model_type)
  model_cfg, hf_params = hf.load_checkpoint(ckpt.path, jnp.float32)
  prompts = [[5, 9, 2, 77, 31, 8], [100, 3], list(range(40, 53))]
  new = 12
  cfg = SamplerConfig(max_new_tokens=new, temperature=0.0)
  out = sampler.sample(hf_params, prompts, jax.random.key(0), cfg, model_cfg)
  for b, prompt in enumerate(prompts):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
      ref = ckpt.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,  # no early eos: both sides produce exactly `new` tokens
        pad_token_id=0,
      )
    np.testing.assert_array_equal(out.completion_tokens[b], ref[0, len(prompt) :].numpy())


@pytest.mark.parametrize(
  ("temperature", "top_k", "top_p"), [(0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 7, 0.8)]
)
def test_behaviour_logprobs_match_processed_distribution(params, temperature, top_k, top_p):
  cfg = SamplerConfig(6, temperature, top_k=top_k, top_p=top_p, return_topk=-1)
  out = sampler.sample(params, PROMPTS, jax.random.key(3), cfg, CFG)
  assert out.topk_logprobs.shape == (4, 6, CFG.vocab_size)
  for b, prompt in enumerate(PROMPTS):
    got = np.asarray(out.completion_tokens[b])
    logits = reference_logits(params, prompt, got)
    ref_dist = np_processed_logprobs(logits, temperature, top_k, top_p)
    dist = np.asarray(out.topk_logprobs[b], np.float64)
    # Same support, same probabilities.
    np.testing.assert_array_equal(np.isfinite(dist), np.isfinite(ref_dist))
    np.testing.assert_allclose(np.exp(dist), np.exp(ref_dist), atol=2e-5)
    steps = np.arange(6)
    assert np.all(np.isfinite(ref_dist[steps, got])), "sampled a filtered-out token"
    np.testing.assert_allclose(out.behaviour_logprobs[b], ref_dist[steps, got], atol=1e-4)
    model_lp = np_log_softmax(logits / temperature)[steps, got]
    np.testing.assert_allclose(out.model_logprobs[b], model_lp, atol=1e-4)
    # The kept set travels with the rollout: exactly the reference support.
    kept = np.zeros(ref_dist.shape, bool)
    for c, ids in enumerate(np.asarray(out.support_ids[b])):
      kept[c, ids[ids >= 0]] = True
    np.testing.assert_array_equal(kept, np.isfinite(ref_dist))
  assert out.support_ids.shape == (4, 6, top_k or CFG.vocab_size)


def test_topk_and_tail_describe_behaviour_distribution(params):
  full = sampler.sample(params, PROMPTS, jax.random.key(3), FILTERED, CFG)
  top_cfg = SamplerConfig(6, 0.9, top_k=7, top_p=0.8, return_topk=4)
  top = sampler.sample(params, PROMPTS, jax.random.key(3), top_cfg, CFG)
  np.testing.assert_array_equal(full.completion_tokens, top.completion_tokens)
  dist = np.asarray(full.topk_logprobs, np.float64)
  ids = np.argsort(-dist, axis=-1, kind="stable")[..., :4]
  np.testing.assert_array_equal(top.topk_ids, ids)
  np.testing.assert_allclose(top.topk_logprobs, np.take_along_axis(dist, ids, -1), atol=1e-5)
  rest = dist.copy()
  np.put_along_axis(rest, ids, -np.inf, -1)
  with np.errstate(divide="ignore"):
    tail = np.log(np.exp(rest).sum(-1))  # -inf where the top 4 hold all the mass
  np.testing.assert_allclose(top.tail_logprob, tail, atol=1e-4)
  # The greedy behaviour distribution is the point mass on the argmax.
  greedy = sampler.sample(
    params, PROMPTS, jax.random.key(5), SamplerConfig(3, 0.0, return_topk=3), CFG
  )
  np.testing.assert_array_equal(greedy.topk_ids[..., 0], greedy.completion_tokens)
  np.testing.assert_array_equal(greedy.topk_logprobs[..., 0], 0.0)
  assert np.all(np.isneginf(greedy.topk_logprobs[..., 1:])) and np.all(
    np.isneginf(greedy.tail_logprob)
  )


def test_unfiltered_rollouts_carry_no_kept_set(params):
  for cfg in (GREEDY, SAMPLED, SamplerConfig(4, 0.7, top_k=CFG.vocab_size)):
    out = sampler.sample(params, PROMPTS, jax.random.key(0), cfg, CFG)
    assert out.support_ids is None
    assert float(out.kv_saturated_fraction) == 0.0  # an f32 cache never clips


def test_kv_saturated_fraction_counts_tensor_scale_clipping(params):
  """With headroom 1 the one-token prompts' amax is the edge of the range, so decode
  values beyond it clip; per-token scales never clip."""
  prompts = [[7], [100], [3], [42]]
  fractions = {}
  for granularity, headroom in (("tensor", 1.0), ("tensor", 64.0), ("token_head", 1.0)):
    kv = kvcache.KVCacheSpec(FP8_KV, granularity, tensor_headroom=headroom)
    out = sampler.sample(params, prompts, jax.random.key(0), SamplerConfig(8, 0.0, kv=kv), CFG)
    fractions[granularity, headroom] = float(out.kv_saturated_fraction)
  assert 0.01 < fractions["tensor", 1.0] < 1.0, fractions
  assert fractions["tensor", 64.0] == 0.0 and fractions["token_head", 1.0] == 0.0, fractions


def test_sampling_frequencies_match_distribution(params):
  scipy_stats = pytest.importorskip("scipy.stats")
  draws, temperature, top_k, top_p = 4000, 1.5, 12, 0.9
  cfg = SamplerConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
  prompt = PROMPTS[0]
  out = sampler.sample(params, [prompt] * draws, jax.random.key(11), cfg, CFG)
  probs = np.exp(np_processed_logprobs(reference_logits(params, prompt, [0]), *cfg_math(cfg))[0])
  counts = np.bincount(np.asarray(out.completion_tokens[:, 0]), minlength=CFG.vocab_size)
  support = probs > 0
  assert counts[~support].sum() == 0, "drew a token outside the top-k/top-p support"
  assert 3 <= support.sum() <= top_k
  assert (draws * probs[support]).min() >= 5, "chi-square needs >= 5 expected counts per cell"
  result = scipy_stats.chisquare(counts[support], draws * probs[support])
  assert result.pvalue > 1e-3, result


def cfg_math(cfg):
  return cfg.temperature, cfg.top_k, cfg.top_p


def test_same_seed_same_samples_different_seed_differs(params):
  cfg = SAMPLED
  a = sampler.sample(params, PROMPTS, jax.random.key(1), cfg, CFG)
  b = sampler.sample(params, PROMPTS, jax.random.key(1), cfg, CFG)
  c = sampler.sample(params, PROMPTS, jax.random.key(2), cfg, CFG)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_array_equal(a.behaviour_logprobs, b.behaviour_logprobs)
  assert not np.array_equal(a.completion_tokens, c.completion_tokens)


def test_same_bucket_does_not_recompile(params):
  cfg = SAMPLED
  sampler.sample(params, PROMPTS, jax.random.key(0), cfg, CFG)
  before = decode_loop.trace_count()
  # Other lengths (≤ 16) and another batch size in the same power-of-two bucket.
  sampler.sample(params, [[1, 2], [3] * 16, [4]], jax.random.key(1), cfg, CFG)
  tokens = np.ones((4, 9), np.int32)
  sampler.sample(params, (tokens, np.array([9, 1, 2, 3])), jax.random.key(2), cfg, CFG)
  assert decode_loop.trace_count() == before
  sampler.sample(params, [[1] * 17], jax.random.key(3), cfg, CFG)  # the 32 bucket
  assert decode_loop.trace_count() == before + 1


def test_stop_token_ends_sequence_and_mask(params):
  free = sampler.sample(params, PROMPTS, jax.random.key(0), GREEDY, CFG)
  tokens = np.asarray(free.completion_tokens)
  stop = int(tokens[0, 3])
  other = int(tokens[1, 5]) if tokens[1, 5] != stop else int(tokens[1, 6])
  cfg = SamplerConfig(8, 0.0, stop_tokens=(stop, other))
  out = sampler.sample(params, PROMPTS, jax.random.key(0), cfg, CFG)
  for b in range(len(PROMPTS)):
    hits = np.flatnonzero(np.isin(tokens[b], [stop, other]))
    n = hits[0] + 1 if hits.size else 8
    np.testing.assert_array_equal(out.completion_mask[b], np.arange(8) < n)
    np.testing.assert_array_equal(out.completion_tokens[b, :n], tokens[b, :n])
    np.testing.assert_array_equal(out.completion_tokens[b, n:], 0)
    np.testing.assert_array_equal(out.behaviour_logprobs[b, n:], 0.0)
    np.testing.assert_array_equal(out.model_logprobs[b, n:], 0.0)
  assert out.completion_mask[0].sum() <= 4
  np.testing.assert_array_equal(out.completion_lens(), np.asarray(out.completion_mask).sum(1))


def test_cache_full_stops_each_sequence(params):
  free = sampler.sample(params, PROMPTS[:2], jax.random.key(0), GREEDY, CFG)
  # 12 slots: the 5-token prompt fits 12 - 5 + 1 = 8 tokens, the 11-token one 2.
  out = sampler.sample(
    params, PROMPTS[:2], jax.random.key(0), SamplerConfig(8, 0.0, cache_len=12), CFG
  )
  np.testing.assert_array_equal(out.completion_lens(), [8, 2])
  np.testing.assert_array_equal(out.completion_tokens[0], free.completion_tokens[0])
  np.testing.assert_array_equal(out.completion_tokens[1, :2], free.completion_tokens[1, :2])
  np.testing.assert_array_equal(out.completion_tokens[1, 2:], 0)


def test_sequences_layout_scores_the_completion(params):
  out = sampler.sample(params, PROMPTS, jax.random.key(4), SAMPLED, CFG)
  seqs = out.sequences()
  assert seqs.tokens_bt.shape == (4, 16 + 8)
  for b, prompt in enumerate(PROMPTS):
    n = len(prompt)
    np.testing.assert_array_equal(seqs.tokens_bt[b, :n], prompt)
    np.testing.assert_array_equal(seqs.tokens_bt[b, n : n + 8], out.completion_tokens[b])
    np.testing.assert_array_equal(seqs.completion_mask_bt[b, n : n + 8], out.completion_mask[b])
    assert int(np.asarray(seqs.completion_mask_bt[b]).sum()) == int(out.completion_mask[b].sum())
  logits_btv = model.forward(params, seqs.tokens_bt, CFG)
  logits_bcv = jnp.take_along_axis(logits_btv, seqs.logit_index_bc[..., None], axis=1)
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits_bcv, -1), out.completion_tokens[..., None], -1)
  mask = np.asarray(out.completion_mask, bool)
  np.testing.assert_allclose(
    np.asarray(lp[..., 0])[mask], np.asarray(out.model_logprobs)[mask], atol=1e-4
  )
  # Temperature 1 without filters: the behaviour distribution is the model's.
  np.testing.assert_allclose(out.behaviour_logprobs, out.model_logprobs, atol=1e-6)


def test_rollout_crosses_jit(params):
  out = sampler.sample(params, PROMPTS, jax.random.key(0), GREEDY, CFG, weight_version=7)
  total = jax.jit(lambda r: jnp.sum(r.completion_mask) + r.weight_version)(out)
  assert int(total) == 4 * 8 + 7
  assert out.engine_id == "w=float32,kv=float32,T=0,top_k=0,top_p=1"


@pytest.mark.parametrize("granularity", ["token_head", "tensor"])
def test_fp8_weights_and_kv_cache_close_to_bf16(params, granularity):
  from opd_jax.model import quant

  cfg = SamplerConfig(max_new_tokens=6, temperature=1.0, return_topk=-1)
  bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  ref = sampler.sample(bf16_params, PROMPTS, jax.random.key(9), cfg, CFG)
  assert ref.engine_id.startswith("w=bfloat16,kv=bfloat16")
  fp8_params = quant.quantize_params(bf16_params, quant.QuantRecipe())
  kv = kvcache.KVCacheSpec(dtype="float8_e4m3fn", granularity=granularity)
  fp8_cfg = SamplerConfig(max_new_tokens=6, temperature=1.0, return_topk=-1, kv=kv)
  out = sampler.sample(fp8_params, PROMPTS, jax.random.key(9), fp8_cfg, CFG)
  assert out.engine_id.startswith(f"w=fp8,kv=float8_e4m3fn/{granularity}")
  assert np.all(np.isfinite(out.behaviour_logprobs)) and np.all(np.isfinite(out.model_logprobs))
  # Step 0 sees the same prompt in both engines: its distributions must be close.
  p_ref = np.exp(np.asarray(ref.topk_logprobs[:, 0], np.float64))
  p_fp8 = np.exp(np.asarray(out.topk_logprobs[:, 0], np.float64))
  kl = np.sum(p_ref * (np.log(p_ref) - np.log(p_fp8)), axis=-1)
  assert np.all(kl < 0.05), kl
  assert np.all(kl > 0), "fp8 should not be bit-identical to bf16"


def test_bad_inputs_raise_clear_errors(params):
  cfg = SamplerConfig(max_new_tokens=4, temperature=0.0, cache_len=8)
  with pytest.raises(
    ValueError, match=r"prompt 1 has 9 tokens, longer than the KV cache \(8 slots\)"
  ):
    sampler.sample(params, [[1, 2], [3] * 9], jax.random.key(0), cfg, CFG)
  with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
    SamplerConfig(max_new_tokens=4, top_p=0.0)
  with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
    SamplerConfig(max_new_tokens=4, top_p=1.5)
  for bad in (-0.5, 1e-38, float("nan")):
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or >= 1e-06"):
      SamplerConfig(max_new_tokens=4, temperature=bad)
  with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
    SamplerConfig(max_new_tokens=0)
  with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
    SamplerConfig(max_new_tokens=4, kv=kvcache.KVCacheSpec(dtype="int4"))
  int_params = jax.tree.map(lambda x: x.astype(jnp.int32), params)
  with pytest.raises(ValueError, match="unsupported params dtype 'int32'"):
    sampler.sample(int_params, [[1]], jax.random.key(0), cfg, CFG)
  with pytest.raises(ValueError, match="prompt 2 is empty"):
    sampler.sample(params, [[1], [2, 3], []], jax.random.key(0), cfg, CFG)
  with pytest.raises(ValueError, match="prompt 0 is empty"):
    sampler.sample(
      params, (np.ones((2, 4), np.int32), np.array([0, 4])), jax.random.key(0), cfg, CFG
    )
  with pytest.raises(ValueError, match="empty batch"):
    sampler.sample(params, [], jax.random.key(0), cfg, CFG)
  with pytest.raises(
    ValueError, match=r"prompt 0 has token id 128 at index 1, outside the vocabulary"
  ):
    sampler.sample(params, [[1, 128]], jax.random.key(0), cfg, CFG)


def test_greedy_with_a_long_cache_matches_uncached_forward(params):
  """A cache of ≥ 128 slots under jit (a one-token decode attention variant once
  diverged there on XLA:CPU while staying exact at 127 slots and in eager mode)."""
  prompt = PROMPTS[0]
  cfg = SamplerConfig(max_new_tokens=6, temperature=0.0, cache_len=192)
  out = sampler.sample(params, [prompt], jax.random.key(0), cfg, CFG)
  seq = list(prompt)
  for _ in range(6):
    seq.append(int(np.argmax(reference_logits(params, seq, [0])[0])))
  np.testing.assert_array_equal(np.asarray(out.completion_tokens[0]), seq[len(prompt) :])


def test_the_filters_edges_signed_zero_ties_and_masked_logits():
  """Top-p alone keeps a tie whole, +0 and −0 included; top-k over fewer finite logits than k
  keeps only the finite ones (a −inf logit has no mass under π_b, so it is no support)."""
  for zeros in ([0.0, -0.0, -5.0], [0.0, 0.0, -5.0]):
    z, _ = distribution.filter_logits(jnp.asarray([zeros]), SamplerConfig(1, 1.0, top_p=0.4))
    np.testing.assert_array_equal(np.isfinite(np.asarray(z[0])), [True, True, False])
  logits = jnp.asarray([[1.0, 0.5, -jnp.inf, -jnp.inf, -jnp.inf]])
  for top_p in (1.0, 0.99):
    _, support = distribution.filter_logits(logits, SamplerConfig(1, 1.0, top_k=3, top_p=top_p))
    np.testing.assert_array_equal(np.asarray(support[0]), [0, 1, -1])
