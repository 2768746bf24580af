"""Training controls: micro-batches, remat, opt/lr, student/entropy, samples per prompt."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import student_teacher_rollout, tiny_step_cfg

from opd_jax.inference import sampler, transform
from opd_jax.model import sharding, tokenizer
from opd_jax.model import transformer as model
from opd_jax.rollout import worker as rollout_worker
from opd_jax.train import losses, microbatch, train_step
from opd_jax.train import state as train_state

CFG = tiny_step_cfg()
PROMPTS = [[1, 5, 7], [1, 9], [1, 4, 4, 4], [1, 3], [1, 2, 2], [1, 8], [1, 6, 5, 4], [1, 7]]
# f32 tolerance, 1e-5 relative and absolute: the accumulation only reorders additions, but
# a micro-batch's forward has another batch shape, which changes XLA's matmul blocking and
# so the last bits of log-probs of size ~5 (2.4e-6 seen). Values near 0 (the exact
# engine's mismatch/* are f32 noise of ~1e-7) need the atol.
RTOL = 1e-5
ATOL = 1e-5
ADAM_ATOL = 1e-4


@pytest.fixture(scope="module")
def setup():
  scfg = sampler.SamplerConfig(max_new_tokens=6, temperature=1.0, stop_tokens=(2,))
  student, teacher, rollout = student_teacher_rollout(CFG, PROMPTS, scfg)
  # Completions of 1..6 tokens (as if each had stopped there), so micro-batches hold
  # different token counts and only the whole batch's normalisation reproduces the batch.
  lens_b1 = jnp.array([6, 1, 2, 6, 3, 5, 4, 6])[:, None]
  mask_bc = (jnp.arange(6)[None, :] < lens_b1).astype(jnp.int32)
  rollout = rollout.replace(
    completion_mask=mask_bc,
    completion_tokens=rollout.completion_tokens * mask_bc,
    behaviour_logprobs=rollout.behaviour_logprobs * mask_bc,
    model_logprobs=rollout.model_logprobs * mask_bc,
  )
  return student, teacher, rollout


def _step(student, teacher, rollout, loss_cfg, tx, **kwargs):
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  fn = jax.jit(
    lambda s, t, r: train_step.train_step(
      s, t, r, tx=tx, student_cfg=CFG, teacher_cfg=CFG, loss_cfg=loss_cfg, **kwargs
    )
  )
  return fn(state, teacher, rollout)


@pytest.mark.slow
@pytest.mark.parametrize(
  "loss_cfg",
  [
    train_step.LossConfig("reverse_kl_sampled", is_clip=2.0, advantage_clip=1.0),
    train_step.LossConfig("jsd", jsd_beta=0.3),
  ],
  ids=lambda c: c.name,
)
def test_four_microbatches_equal_the_full_batch(setup, loss_cfg):
  """One step with K=1 and K=4 gives the same gradient, params and metrics (RTOL, ATOL)."""
  student, teacher, rollout = setup
  lens = np.asarray(rollout.completion_lens())
  parts = lens.reshape(-1, 4).T.sum(axis=1)  # tokens per micro-batch: unequal, or the
  assert len(set(parts.tolist())) > 1, parts  # per-micro-batch token mean would pass too
  tx = optax.sgd(0.1)
  full_state, full = _step(student, teacher, rollout, loss_cfg, tx)
  micro_state, micro = _step(student, teacher, rollout, loss_cfg, tx, microbatches=4)
  for a, b in zip(
    jax.tree.leaves(full_state.params), jax.tree.leaves(micro_state.params), strict=True
  ):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=RTOL, atol=ATOL)
  assert set(full) == set(micro)
  approximate = [k for k in full if k.endswith("_p95")]  # quantiles do not combine exactly
  for key in sorted(set(full) - set(approximate)):
    np.testing.assert_allclose(
      np.asarray(micro[key]), np.asarray(full[key]), rtol=RTOL, atol=ATOL, err_msg=key
    )
  assert float(full["perf/grad_norm"]) > 1e-2  # a real gradient was compared
  # Normalising each micro-batch by its own token count would be a different gradient.
  w_k = np.asarray(
    microbatch.microbatch_weights(microbatch.split_microbatches(rollout, 4).completion_mask)
  )
  np.testing.assert_allclose(w_k, parts / parts.sum(), rtol=1e-6)


@pytest.mark.slow
def test_microbatches_with_adamw_match_the_full_batch(setup):
  """The real optimizer (clip + AdamW with a schedule) after two steps."""
  student, teacher, rollout = setup
  tx = train_state.make_optimizer(1e-2, 10, 0, 0.01, 1.0)
  loss_cfg = train_step.LossConfig("reverse_kl_full")
  out = []
  for k in (1, 4):
    state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
    fn = jax.jit(
      lambda s, t, r, k=k: train_step.train_step(
        s, t, r, tx=tx, student_cfg=CFG, teacher_cfg=CFG, loss_cfg=loss_cfg, microbatches=k
      )
    )
    for _ in range(2):
      state, metrics = fn(state, teacher, rollout)
    out.append((state, metrics))
  (a, ma), (b, mb) = out
  # Adam divides each coordinate by its own gradient scale, so where a gradient is near zero a
  # summation-order difference (~1e-7) can move that coordinate's update by a visible fraction
  # of one step (lr = 1e-2). ADAM_ATOL is 1 % of one step: a wrong gradient moves whole steps.
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=RTOL, atol=ADAM_ATOL)
  np.testing.assert_allclose(float(mb["loss/total"]), float(ma["loss/total"]), rtol=RTOL)


def test_microbatches_refuse_what_they_cannot_split(setup):
  student, teacher, rollout = setup
  tx = optax.sgd(0.1)
  with pytest.raises(ValueError, match="must be >= 1 and divide"):
    _step(student, teacher, rollout, train_step.LossConfig(), tx, microbatches=3)
  baseline = train_step.LossConfig(advantage_baseline="batch_mean")
  with pytest.raises(ValueError, match="batch baseline"):
    _step(student, teacher, rollout, baseline, tx, microbatches=2)
  with pytest.raises(ValueError, match="batch baseline"):
    train_step.check_microbatches(train_step.LossConfig("reinforce"), 2, 8)
  train_step.check_microbatches(baseline, 1, 8)  # one micro-batch is the batch itself


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["layer", "dots", "dots_no_batch"])
def test_remat_keeps_loss_and_gradients(setup, remat):
  student, teacher, rollout = setup
  loss_cfg = train_step.LossConfig("reverse_kl_sampled")
  grad_fn = jax.jit(
    jax.value_and_grad(train_step.opd_loss, has_aux=True), static_argnums=(3, 4, 5, 6)
  )
  (loss, metrics), grads = grad_fn(student, teacher, rollout, CFG, CFG, loss_cfg, "none")
  (loss_r, metrics_r), grads_r = grad_fn(student, teacher, rollout, CFG, CFG, loss_cfg, remat)
  np.testing.assert_allclose(float(loss_r), float(loss), rtol=RTOL)
  np.testing.assert_allclose(
    float(metrics_r["student/entropy"]), float(metrics["student/entropy"]), rtol=RTOL
  )
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), strict=True):  # recomputed
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=RTOL, atol=1e-5 * scale)
  # The remat really is in the program (one checkpoint per layer), not a no-op.
  tokens_bt = rollout.sequences().tokens_bt
  jaxpr = str(jax.make_jaxpr(lambda p: model.forward(p, tokens_bt, CFG, remat=remat))(student))
  assert jaxpr.count("checkpoint[") + jaxpr.count("remat") >= CFG.num_layers
  assert "checkpoint[" not in str(
    jax.make_jaxpr(lambda p: model.forward(p, tokens_bt, CFG))(student)
  )


def test_unknown_remat_is_refused():
  with pytest.raises(ValueError, match="unknown remat 'all'"):
    model.layer_fn("all")


def test_token_entropy_by_hand():
  logits = np.array([[0.0, 0.0, 0.0, 0.0], [np.log(3.0), 0.0, -np.inf, -np.inf]], np.float32)
  # uniform over 4: log 4; (3/4, 1/4, 0, 0): −(¾ log ¾ + ¼ log ¼), zero-mass tokens add 0.
  expected = [np.log(4.0), -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))]
  np.testing.assert_allclose(np.asarray(losses.token_entropy(jnp.asarray(logits))), expected, 1e-6)


@pytest.mark.parametrize("top_k", [0, 5])
def test_student_entropy_metric_by_hand(setup, top_k):
  """student/entropy = the masked token mean of H(π_θ) at the rollout's temperature/filter."""
  student, teacher, _ = setup
  scfg = sampler.SamplerConfig(max_new_tokens=6, temperature=0.7, top_k=top_k, stop_tokens=(2,))
  rollout = sampler.sample(student, PROMPTS, jax.random.key(3), scfg, CFG)
  loss_cfg = train_step.LossConfig("reverse_kl_full", temperature=0.7)
  _, metrics = train_step.opd_loss(student, teacher, rollout, CFG, CFG, loss_cfg)
  seq = rollout.sequences()
  logits_btv = np.asarray(model.forward(student, seq.tokens_bt, CFG), np.float64)
  index_bc = np.asarray(seq.logit_index_bc)
  z_bcv = np.take_along_axis(logits_btv, index_bc[:, :, None], axis=1) / 0.7
  mask_bc = np.asarray(rollout.completion_mask) > 0
  if top_k:  # the engine's kept set: the student's own top-k (an exact engine)
    ids_bck = np.asarray(rollout.support_ids)
    kept_bcv = np.zeros(z_bcv.shape, bool)
    np.put_along_axis(kept_bcv, ids_bck, True, axis=-1)
    z_bcv = np.where(kept_bcv, z_bcv, -np.inf)
  p_bcv = np.exp(z_bcv - z_bcv.max(-1, keepdims=True))
  p_bcv /= p_bcv.sum(-1, keepdims=True)
  logp = np.log(np.where(p_bcv > 0, p_bcv, 1.0))
  h_bc = -(p_bcv * logp).sum(-1)
  expected = h_bc[mask_bc].mean()
  np.testing.assert_allclose(float(metrics["student/entropy"]), expected, rtol=1e-5)
  assert 0 < expected < np.log(top_k or CFG.vocab_size)


def test_opt_lr_is_the_schedule_at_each_step(setup):
  student, teacher, rollout = setup
  lr, steps, warmup = 1e-2, 10, 4
  tx = train_state.make_optimizer(lr, steps, warmup, 0.0, 1.0)
  schedule = train_state.make_schedule(lr, steps, warmup)
  state = train_state.init_state(jax.tree.map(jnp.copy, student), tx, 0)
  fn = jax.jit(
    lambda s, t, r: train_step.train_step(
      s,
      t,
      r,
      tx=tx,
      student_cfg=CFG,
      teacher_cfg=CFG,
      loss_cfg=train_step.LossConfig("reverse_kl_full"),
      lr_schedule=schedule,
    )
  )
  seen = []
  for _ in range(6):
    state, metrics = fn(state, teacher, rollout)
    seen.append(float(metrics["opt/lr"]))
  # lr·s/warmup during the warmup, then cosine from the peak (module formula, by hand).
  u = lambda s: (s - warmup) / (steps - warmup)  # noqa: E731
  by_hand = [lr * s / warmup for s in range(4)]
  by_hand += [lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * u(s)))) for s in (4, 5)]
  np.testing.assert_allclose(seen, by_hand, rtol=1e-6)


def _engine(n):
  tok = tokenizer.CharTokenizer()
  batches = iter(itertools.repeat({"prompt": np.array(["1+2=", "30+4=", "5+6+7="])}))
  scfg = sampler.SamplerConfig(max_new_tokens=5, temperature=1.0, stop_tokens=(tok.eos_id,))
  mesh = sharding.make_mesh((1, 1, 1))
  return rollout_worker.RolloutWorker(
    batches,
    tok,
    8,
    transform.EngineConfig(),
    scfg,
    CFG,
    jax.random.key(7),
    mesh,
    samples_per_prompt=n,
  )


def test_samples_per_prompt_repeats_each_prompt_in_adjacent_rows(setup):
  """B prompts give B·n rows, prompt b in rows [b·n, (b+1)·n), with different samples."""
  student = setup[0]
  eng = _engine(3)
  prompts = eng.draw_prompts()
  assert prompts[0].shape[0] == 9
  one = _engine(1).draw_prompts()
  np.testing.assert_array_equal(prompts[0], np.repeat(one[0], 3, axis=0))
  np.testing.assert_array_equal(prompts[1], np.repeat(one[1], 3))
  rollout, _ = eng.sample(eng.transform(student, 0), prompts, 0, 0)
  assert rollout.batch_size == 9
  prompts_b = np.asarray(rollout.prompt_tokens)
  tokens_bc = np.asarray(rollout.completion_tokens)
  for g in range(3):
    group = slice(3 * g, 3 * g + 3)
    assert (prompts_b[group] == prompts_b[3 * g]).all()  # the same prompt n times
    assert (prompts_b[3 * g] != prompts_b[(3 * g + 3) % 9]).any()  # and not its neighbour's
    distinct = {tuple(row) for row in tokens_bc[group]}
    assert len(distinct) == 3, tokens_bc[group]  # different samples under sampling
  with pytest.raises(ValueError, match="samples_per_prompt must be >= 1"):
    _engine(0)
