"""GKD's on-policy fraction λ (`train.on_policy_fraction`, opd_jax/rollout/off_policy.py): reference
completions, the per-batch share, λ = 1 unchanged, λ = 0 all references, mismatch/* over the
sampled rows only, the refusals, and a tiny run at λ = 0.5."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from opd_jax.config import check as config_check
from opd_jax.data import pipeline as data
from opd_jax.data import prompts, task
from opd_jax.inference import sampler, teacher_forcing, transform
from opd_jax.io import metrics_writer
from opd_jax.model import sharding, tokenizer
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.rollout import off_policy
from opd_jax.rollout.async_rollouts import AsyncRollouts
from opd_jax.rollout.sources import SyncRollouts
from opd_jax.rollout.worker import RolloutWorker
from opd_jax.train import (
  mismatch_metrics as mismatch,
)
from opd_jax.train import (
  policy,
  preflight,
  train_step,
  trainer,
)
from opd_jax.train import state as train_state
from opd_jax.train.setup import run_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))

import base  # noqa: E402
from conftest import tiny_config  # noqa: E402

TASK = task.TaskConfig(num_operands=2, max_operand=99)
TOK = tokenizer.CharTokenizer()
CFG = ModelConfig("qwen3", TOK.vocab_size, 16, 32, 1, 2, 1, 8, qk_norm=True)
C = TASK.max_completion_tokens  # every reference fits: 13 tokens with eos
BATCH = 8


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh((1, 1, 1))


@pytest.fixture(scope="module")
def params():
  student = model.init_params(jax.random.key(1), CFG, jnp.float32, scale=0.3)
  teacher = model.init_params(jax.random.key(2), CFG, jnp.float32, scale=0.3)
  return student, teacher


def _engine(mesh, fraction=None, key=7, n=1, top_k=0):
  source = task.TaskSource("train", 10_000, 0, TASK)
  batches = iter(data.prompt_batches(source, BATCH, 0))
  scfg = sampler.SamplerConfig(
    max_new_tokens=C, top_k=top_k, stop_tokens=(TOK.eos_id,), return_topk=-1
  )
  kwargs = {} if fraction is None else {"on_policy_fraction": fraction}
  return RolloutWorker(
    batches,
    TOK,
    TASK.max_prompt_tokens,
    transform.EngineConfig(),
    scfg,
    CFG,
    jax.random.key(key),
    mesh,
    samples_per_prompt=n,
    **kwargs,
  )


def _rollouts(eng, student, steps=3):
  """The first `steps` (rollout, stats) of a sync source at version 0."""
  source = SyncRollouts(eng)
  source.publish(student, 0)
  out = []
  for _ in range(steps):
    rollout = next(source)
    out.append((rollout, source.last_stats))
  return out


def _references(n_batches, n=1):
  """The tokenized references of the first batches, [B·n, C] each, by hand."""
  out = []
  for batch in _batches(n_batches):
    rows = np.zeros((BATCH, C), np.int32)
    for b, completion in enumerate(batch["completion"]):
      ids = TOK.encode(completion) + [TOK.eos_id]
      rows[b, : len(ids)] = ids
    out.append(np.repeat(rows, n, axis=0))
  return out


def _batches(count):
  source = task.TaskSource("train", 10_000, 0, TASK)
  it = iter(data.prompt_batches(source, BATCH, 0))
  return [next(it) for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# References and the share of each batch.


def test_reference_text_from_completion_or_final_assistant_message():
  assert off_policy.reference_text({"prompt": "1+2=", "completion": "3"}) == "3"
  chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
  assert off_policy.reference_text({"messages": chat}) == "4"
  assert off_policy.reference_text({"messages": chat[:1]}) is None
  assert off_policy.reference_text({"prompt": "1+2="}) is None
  assert prompts.prompt_messages(chat) == chat[:1]  # the reply is not part of the prompt
  assert prompts.prompt_messages(chat[:1]) == chat[:1]
  assert off_policy.reference_ids("12", TOK, 8) == [*TOK.encode("12"), TOK.eos_id]
  assert off_policy.reference_ids("12345", TOK, 3) == TOK.encode("123")  # cut, no eos


@pytest.mark.parametrize("fraction, prompts_per_batch", [(0.5, 8), (0.3, 8), (0.9, 5)])
def test_each_batch_holds_the_stated_share_deterministically_by_seed(fraction, prompts_per_batch):
  """k_n = ⌊x⌋ or ⌈x⌉ off-policy prompts, x = (1 − λ)B, with mean x over batches (stochastic
  rounding); the same seed gives the same rows, another seed other rows."""
  x = (1 - fraction) * prompts_per_batch
  draws = [off_policy.off_policy_prompts(fraction, [3], n, prompts_per_batch) for n in range(400)]
  counts = np.array([d.sum() for d in draws])
  assert set(counts.tolist()) <= {int(np.floor(x)), int(np.ceil(x))}
  assert counts.mean() == pytest.approx(x, abs=0.06)  # 400 batches: std of the mean ~0.025
  again = [off_policy.off_policy_prompts(fraction, [3], n, prompts_per_batch) for n in range(400)]
  np.testing.assert_array_equal(np.stack(draws), np.stack(again))
  other = [off_policy.off_policy_prompts(fraction, [4], n, prompts_per_batch) for n in range(400)]
  assert not np.array_equal(np.stack(draws), np.stack(other))
  assert off_policy.off_policy_prompts(0.0, [3], 0, 8).all()
  assert not off_policy.off_policy_prompts(1.0, [3], 0, 8).any()


# ---------------------------------------------------------------------------------------------
# The rollout engine.


def test_fraction_one_is_todays_engine(mesh, params):
  """λ = 1 draws the same prompts and samples the same rollouts as an engine without λ; no
  row is marked, and the logged fraction is 1."""
  student, _ = params
  today = _rollouts(_engine(mesh), student)
  with_one = _rollouts(_engine(mesh, 1.0), student)
  for (a, stats_a), (b, stats_b) in zip(today, with_one, strict=True):
    assert b.on_policy_b is None and a.on_policy_b is None
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert stats_a["rollout/on_policy_fraction"] == stats_b["rollout/on_policy_fraction"] == 1.0


def test_fraction_zero_trains_on_the_references_only(mesh, params):
  """λ = 0: every row's completion is its prompt's tokenized reference (with eos), masked to
  its length, behaviour log-probs 0, every row marked off-policy; the prompts are unchanged."""
  student, _ = params
  sampled = _rollouts(_engine(mesh), student)
  refs = _references(3)
  for (rollout, stats), ref_bc, (base_rollout, _) in zip(
    _rollouts(_engine(mesh, 0.0), student), refs, sampled, strict=True
  ):
    np.testing.assert_array_equal(np.asarray(rollout.completion_tokens), ref_bc)
    np.testing.assert_array_equal(np.asarray(rollout.completion_mask), (ref_bc > 0) * 1)
    np.testing.assert_array_equal(np.asarray(rollout.behaviour_logprobs), 0.0)
    np.testing.assert_array_equal(np.asarray(rollout.on_policy_b), 0)
    np.testing.assert_array_equal(
      np.asarray(rollout.prompt_tokens), np.asarray(base_rollout.prompt_tokens)
    )
    decoded = [TOK.decode(row) for row in np.asarray(rollout.completion_tokens)]
    prompt_text = [TOK.decode(row[1:]) for row in np.asarray(rollout.prompt_tokens)]
    assert all(task.score(p, c) for p, c in zip(prompt_text, decoded, strict=True))
    assert stats["rollout/on_policy_fraction"] == 0.0


@pytest.mark.parametrize("n", [1, 2])
def test_half_the_prompts_take_references_and_the_rest_keep_their_samples(mesh, params, n):
  """λ = 0.5 with 8 prompts: exactly 4 prompts per batch (all n rows of each) carry their
  reference; the other rows are the λ = 1 engine's samples, bit for bit; the same key chooses
  the same rows, another key other rows."""
  student, _ = params
  sampled = _rollouts(_engine(mesh, n=n), student)
  mixed = _rollouts(_engine(mesh, 0.5, n=n), student)
  refs = _references(3, n)
  chosen = []
  for (rollout, stats), (base_rollout, _), ref_bc in zip(mixed, sampled, refs, strict=True):
    on_b = np.asarray(rollout.on_policy_b).astype(bool)
    assert on_b.sum() == BATCH * n // 2
    assert (on_b.reshape(BATCH, n) == on_b.reshape(BATCH, n)[:, :1]).all()  # per prompt
    tokens = np.asarray(rollout.completion_tokens)
    np.testing.assert_array_equal(tokens[~on_b], ref_bc[~on_b])
    np.testing.assert_array_equal(tokens[on_b], np.asarray(base_rollout.completion_tokens)[on_b])
    np.testing.assert_array_equal(
      np.asarray(rollout.behaviour_logprobs)[on_b],
      np.asarray(base_rollout.behaviour_logprobs)[on_b],
    )
    assert stats["rollout/on_policy_fraction"] == 0.5
    chosen.append(on_b)
  again = [np.asarray(r.on_policy_b) for r, _ in _rollouts(_engine(mesh, 0.5, n=n), student)]
  np.testing.assert_array_equal(np.stack(chosen), np.stack(again))
  other = [np.asarray(r.on_policy_b) for r, _ in _rollouts(_engine(mesh, 0.5, 8, n), student)]
  assert not np.array_equal(np.stack(chosen), np.stack(other))


# ---------------------------------------------------------------------------------------------
# The train step: mismatch/* over sampled rows, data rows scored unfiltered.


def test_mismatch_counts_sampled_rows_only_and_references_escape_the_kept_set(mesh, params):
  """The engine is the trainer (f32, same weights), so mismatch/* on sampled rows is f32
  noise; a reference row, with behaviour log-prob 0, would read k1 of several nats if it were
  counted. With top-k 2 a reference token usually lies outside the engine's kept set of its
  row: scored under that set the loss would be infinite."""
  student, teacher = params
  rollout, _ = _rollouts(_engine(mesh, 0.5, top_k=2), student, steps=1)[0]
  loss_cfg = train_step.LossConfig("reverse_kl_full", temperature=1.0)
  loss, metrics = train_step.opd_loss(student, teacher, rollout, CFG, CFG, loss_cfg)
  assert np.isfinite(float(loss))
  for key in ("mismatch/kl", "mismatch/k1", "mismatch/abs_logp_diff_max"):
    assert abs(float(metrics[key])) < 1e-4, (key, float(metrics[key]))
  # The same metrics over every row (references included) are far from 0.
  logits_bcv, _, _ = teacher_forcing.completion_logits(student, rollout, CFG, 1.0)
  policy_bcv = policy.student_policy_logits(logits_bcv, rollout)
  polluted = mismatch.mismatch_metrics(policy_bcv, rollout)
  assert float(polluted["mismatch/k1"]) > 0.5
  # Reference rows under the sampled rows' kept sets: some reference token is outside.
  unmarked = rollout.replace(on_policy_b=None)
  outside = policy.student_policy_logits(logits_bcv, unmarked)
  ref_lp = np.asarray(
    jnp.take_along_axis(outside, rollout.completion_tokens[..., None], axis=-1)[..., 0]
  )
  counted = np.asarray(rollout.completion_mask) > 0
  assert np.isneginf(ref_lp[counted]).any()


def test_all_reference_batch_reads_zero_mismatch(mesh, params):
  """λ = 0: no sampled token, so mismatch/* average over nothing and read 0."""
  student, teacher = params
  rollout, _ = _rollouts(_engine(mesh, 0.0), student, steps=1)[0]
  loss_cfg = train_step.LossConfig("jsd", jsd_beta=0.5, temperature=1.0)
  loss, metrics = train_step.opd_loss(student, teacher, rollout, CFG, CFG, loss_cfg)
  assert np.isfinite(float(loss)) and float(loss) > 0
  assert all(float(v) == 0.0 for k, v in metrics.items() if k.startswith("mismatch/"))


def test_microbatches_weight_mismatch_by_the_sampled_tokens(mesh, params):
  """K = 2 micro-batches reproduce the whole batch's mismatch/*, whose means count sampled
  tokens only, on a batch whose micro-batches hold different shares of sampled tokens (so
  weighting by all tokens would not). The trainer is the teacher here, so mismatch is large."""
  student, teacher = params
  loss_cfg = train_step.LossConfig("reverse_kl_full", temperature=1.0)
  for rollout, _ in _rollouts(_engine(mesh, 0.5), student, steps=3):
    mask_kbc = np.asarray(rollout.completion_mask).reshape(BATCH // 2, 2, -1).swapaxes(0, 1)
    on_kb1 = np.asarray(rollout.on_policy_b).reshape(BATCH // 2, 2).T[..., None]
    sampled_k, all_k = (mask_kbc * on_kb1).sum(axis=(1, 2)), mask_kbc.sum(axis=(1, 2))
    if abs(sampled_k[0] / sampled_k.sum() - all_k[0] / all_k.sum()) > 0.05:
      break
  else:
    pytest.fail("no batch with unequal shares of sampled tokens per micro-batch")
  tx = optax.sgd(0.1)
  out = {}
  for k in (1, 2):
    state = train_state.init_state(jax.tree.map(jnp.copy, teacher), tx, 0)
    _, out[k] = train_step.train_step(
      state,
      teacher,
      rollout,
      tx=tx,
      student_cfg=CFG,
      teacher_cfg=CFG,
      loss_cfg=loss_cfg,
      microbatches=k,
    )
  assert float(out[1]["mismatch/k1"]) > 0.1
  for key in ("mismatch/kl", "mismatch/k1", "mismatch/k3", "mismatch/abs_logp_diff"):
    np.testing.assert_allclose(float(out[2][key]), float(out[1][key]), rtol=1e-5, err_msg=key)


def test_async_source_mixes_the_same_rows_as_sync(mesh, params):
  """The mix is a function of the batch index: async with max_lag 0 gives sync's batches."""
  student, _ = params
  seen = {}
  for name, make in (("sync", SyncRollouts), ("async", lambda e: AsyncRollouts(e, max_lag=0))):
    source = make(_engine(mesh, 0.5))
    source.publish(student, 0)
    seen[name] = []
    for version in (1, 2):
      rollout = next(source)
      seen[name].append((np.asarray(rollout.on_policy_b), np.asarray(rollout.completion_tokens)))
      source.publish(student, version)
    source.close()
  for (on_s, tok_s), (on_a, tok_a) in zip(seen["sync"], seen["async"], strict=True):
    np.testing.assert_array_equal(on_a, on_s)
    np.testing.assert_array_equal(tok_a, tok_s)


# ---------------------------------------------------------------------------------------------
# Refusals.


@pytest.mark.parametrize("loss", ["reverse_kl_sampled", "reinforce"])
def test_on_policy_losses_refuse_a_fraction_below_one(loss):
  config = base.get_config()
  config.train.loss = loss
  config.train.on_policy_fraction = 0.5
  with pytest.raises(ValueError, match=rf"on_policy_fraction=0.5 .*train.loss='{loss}'"):
    config_check.validate(config)
  config.train.on_policy_fraction = 1.0
  config_check.validate(config)  # λ = 1 is today's run


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_fraction_outside_zero_one_is_refused(value):
  config = base.get_config()
  config.train.on_policy_fraction = value
  with pytest.raises(ValueError, match="config.train.on_policy_fraction must be"):
    config_check.validate(config)


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def test_a_prompt_file_without_references_is_refused_before_any_weights(tmp_path):
  """The first record without a reference is named with its file and line, at preflight."""
  file = _write(
    tmp_path / "p.jsonl",
    [{"prompt": "12+3=", "completion": "12+3=15>15"}, {"prompt": "4+5="}, {"prompt": "1+1="}],
  )
  config = base.get_config("tiny")
  config.tokenizer = "char"
  config.data.prompt_file = file
  config.data.batch_size = 2
  config.data.eval_size = 1  # if a held-out slice of the file is evaluated, 2 records train
  config.train.on_policy_fraction = 0.5
  with pytest.raises(ValueError, match=r"record 1 \(line 2\) of .*p.jsonl has none"):
    preflight.check(run_spec(config), str(tmp_path / "w"), log=lambda *a: None)
  with pytest.raises(ValueError, match=r"record 1 \(line 2\) of .*p.jsonl has none"):
    trainer.run(config, str(tmp_path / "w"), log=lambda *a: None)  # before any model
  config.train.on_policy_fraction = 1.0
  preflight.check(run_spec(config), str(tmp_path / "w"), log=lambda *a: None)  # λ = 1 needs none


def test_references_that_do_not_tokenize_are_named(tmp_path):
  file = _write(tmp_path / "p.jsonl", [{"prompt": "1+2=", "completion": "three"}])
  with pytest.raises(ValueError, match=r"reference completion of record 0 \(line 1\)"):
    off_policy.check_references(data.JsonlSource(file), TOK, 8)
  ok = _write(tmp_path / "ok.jsonl", [{"prompt": "1+2=", "completion": "1+2=3>3" * 3}])
  line = off_policy.check_references(data.JsonlSource(ok), TOK, 8)
  assert "1 reference completions, longest 22 tokens with eos; 1 longer than" in line


@pytest.mark.parametrize(
  "record, problem",
  [
    ({"messages": [{"role": "assistant", "content": "4"}]}, "has only an assistant message"),
    (
      {
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        "completion": "4",
      },
      'has both a "completion" and a final assistant message',
    ),
    ({"prompt": "2+2?", "completion": 4}, 'has a "completion" that is not a string'),
  ],
)
def test_reference_schema_errors_name_the_line(tmp_path, record, problem):
  file = _write(tmp_path / "p.jsonl", [{"prompt": "1"}, record])
  with pytest.raises(ValueError, match=f"line 2 {problem}"):
    data.JsonlSource(file)


def test_chat_reference_is_the_assistant_turn_of_the_template(tmp_path):
  """A chat record's prompt is the conversation before the final assistant message with the
  generation prompt; prompt + reference ids are the template's whole conversation, the
  end-of-turn marker being the tokenizer's eos."""
  from test_prompts import save_tokenizer

  tok = save_tokenizer(tmp_path / "tok")
  chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "four"}]
  text, prompt_ids = prompts.record_ids({"messages": chat}, tok)
  assert text == tok.render_chat(chat[:1])
  ref = off_policy.reference_ids(off_policy.reference_text({"messages": chat}), tok, 64)
  whole = tok.hf.apply_chat_template(chat, tokenize=False)  # ends "<|im_end|>\n"
  assert prompt_ids + ref == tok.encode(whole)[:-1]


# ---------------------------------------------------------------------------------------------
# End to end.


@pytest.mark.slow
def test_tiny_run_at_half_on_policy(tmp_path):
  """The built-in task at λ = 0.5: every logged batch half sampled, mismatch/* logged, the
  student moves towards the teacher."""
  config = tiny_config(str(tmp_path / "cache"), **{"train.on_policy_fraction": 0.5})
  workdir = str(tmp_path / "run")
  result = trainer.run(config, workdir, log=lambda *a: None)
  rows = metrics_writer.read_jsonl(workdir)
  logged = [rows[s] for s in (2, 4, 6)]
  assert [r["rollout/on_policy_fraction"] for r in logged] == [0.5, 0.5, 0.5]
  assert all(np.isfinite(r["loss/total"]) and "mismatch/kl" in r for r in logged)
  assert result["student_teacher_kl_after"] < result["student_teacher_kl_before"]
