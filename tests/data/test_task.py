"""The synthetic addition task: determinism, splits, lengths, scoring, encodings."""

import numpy as np
import pytest

from opd_jax.data import task
from opd_jax.model.tokenizer import CharTokenizer
from opd_jax.train.setup import run_spec


def test_solve_hand_example():
  ex = task.solve([37, 58, 21])
  assert ex == task.Example(prompt="37+58+21=", completion="37+58=95;95+21=116>116", answer="116")
  ex4 = task.solve([10, 20, 30, 45])
  assert ex4.completion == "10+20=30;30+30=60;60+45=105>105"


def test_make_example_is_deterministic_and_seeded():
  a = [task.make_example(0, i) for i in range(50)]
  b = [task.make_example(0, i) for i in range(50)]
  c = [task.make_example(1, i) for i in range(50)]
  assert a == b
  assert sum(x != y for x, y in zip(a, c, strict=True)) >= 45
  src = task.TaskSource("heldout", 20, seed=3)
  assert src[7] == task.TaskSource("heldout", 20, seed=3)[7]
  assert src[7] == {
    "prompt": task.make_example(3, 7, "heldout").prompt,
    "completion": task.make_example(3, 7, "heldout").completion,
    "answer": task.make_example(3, 7, "heldout").answer,
  }


def test_splits_are_disjoint_and_sized():
  cfg = task.TaskConfig()
  train = {task.make_example(0, i, "train").prompt for i in range(3000)}
  heldout = {task.make_example(0, i, "heldout").prompt for i in range(1000)}
  heldout_other_seed = {task.make_example(5, i, "heldout").prompt for i in range(500)}
  assert not train & heldout
  assert not train & heldout_other_seed
  assert all(task.split_of(p, cfg) == "heldout" for p in heldout)
  # About heldout_fraction of all prompts go to the held-out split.
  rng = np.random.default_rng(0)
  prompts = [task.format_prompt(rng.integers(10, 100, size=3)) for _ in range(4000)]
  share = np.mean([task.split_of(p, cfg) == "heldout" for p in prompts])
  assert 0.08 < share < 0.12


def test_lengths_match_the_stated_bounds():
  cfg = task.TaskConfig()
  tok = CharTokenizer()
  assert (cfg.max_prompt_tokens, cfg.min_completion_tokens, cfg.max_completion_tokens) == (
    10,
    21,
    25,
  )
  assert cfg.seq_len == 35
  # The bounds are attained by all-min and all-max operands.
  assert len(task.solve([10, 10, 10]).completion) + 1 == cfg.min_completion_tokens
  assert len(task.solve([99, 99, 99]).completion) + 1 == cfg.max_completion_tokens
  for i in range(500):
    ex = task.make_example(0, i)
    n_completion = len(tok.encode(ex.completion)) + 1  # + eos
    assert 16 <= cfg.min_completion_tokens <= n_completion <= cfg.max_completion_tokens
    assert len(tok.encode(ex.prompt)) + 1 <= cfg.max_prompt_tokens
  four = task.TaskConfig(num_operands=4, min_operand=0, max_operand=999)
  assert four.max_prompt_chars == len("999+999+999+999=")
  assert four.max_completion_chars == len(task.solve([999] * 4).completion)
  assert four.min_completion_chars == len(task.solve([0] * 4).completion)


def test_every_character_encodes():
  tok = CharTokenizer()
  for split in task.SPLITS:
    for i in range(300):
      ex = task.make_example(2, i, split, task.TaskConfig(num_operands=4, min_operand=0))
      text = ex.prompt + ex.completion
      assert tok.decode(tok.encode(text)) == text


def test_score():
  prompt = "37+58+21="
  assert task.score(prompt, "37+58=95;95+21=116>116")
  assert task.score(prompt, "wrong steps do not matter>116")
  assert not task.score(prompt, "37+58=95;95+21=117>117")
  malformed = ["", "116", "37+58=95;95+21=116", ">116>116", ">0116", ">116 ", "> 116", ">+116", ">"]
  for completion in malformed:
    assert not task.score(prompt, completion), completion
  assert task.parse_answer("1+2=3>3") == "3"
  assert task.parse_answer("1+2=3>3x") is None
  for i in range(200):
    ex = task.make_example(0, i, "heldout")
    assert task.score(ex.prompt, ex.completion)
    assert task.parse_answer(ex.completion) == ex.answer
  with pytest.raises(ValueError, match="not a task prompt"):
    task.score("37+58", ">95")


def test_encode_example_layout():
  tok = CharTokenizer()
  ex = task.solve([37, 58, 21])
  enc = task.encode_example(ex, tok, 35)
  tokens, mask = enc["tokens"], enc["loss_mask"]
  assert tokens.shape == mask.shape == (35,) and tokens.dtype == np.int32
  assert int(enc["prompt_len"]) == 10
  assert tokens[0] == tok.bos_id
  assert tok.decode(tokens[1:10]) == ex.prompt
  assert tok.decode(tokens[10:]) == ex.completion
  n = 10 + len(ex.completion)
  assert tokens[n] == tok.eos_id and (tokens[n + 1 :] == tok.pad_id).all()
  np.testing.assert_array_equal(mask, (np.arange(35) >= 10) & (np.arange(35) <= n))
  batch = task.encode_batch([ex, task.TaskSource("train", 4)[1]], tok, 35)
  assert batch["tokens"].shape == (2, 35) and batch["prompt_len"].tolist() == [10, 10]
  with pytest.raises(ValueError, match="seq_len=30"):
    task.encode_example(ex, tok, 30)


def test_encode_prompts_right_padded():
  tok = CharTokenizer()
  tokens, lengths = task.encode_prompts(["1+2=", "37+58+21="], tok, 12)
  assert lengths.tolist() == [5, 10]
  assert tokens[0, :5].tolist() == [tok.bos_id] + tok.encode("1+2=")
  assert (tokens[0, 5:] == tok.pad_id).all()
  assert tok.decode(tokens[1]) == "37+58+21="
  with pytest.raises(ValueError, match="length=4"):
    task.encode_prompts(["1+2="], tok, 4)


def test_task_source_with_grain():
  import grain

  src = task.TaskSource("train", 16, seed=0)
  ds = grain.MapDataset.source(src).seed(1).shuffle()
  prompts = {ds[i]["prompt"] for i in range(len(ds))}
  assert prompts == {src[i]["prompt"] for i in range(16)}
  with pytest.raises(IndexError):
    src[16]


def test_bad_arguments():
  with pytest.raises(ValueError, match="num_operands"):
    task.TaskConfig(num_operands=1)
  with pytest.raises(ValueError, match="min_operand"):
    task.TaskConfig(min_operand=50, max_operand=10)
  with pytest.raises(ValueError, match="heldout_fraction"):
    task.TaskConfig(heldout_fraction=1.0)
  with pytest.raises(ValueError, match="unknown split"):
    task.TaskSource("test", 4)
  with pytest.raises(ValueError, match="unknown split"):
    task.make_example(0, 0, "validation")


CHAIN = task.TaskConfig(num_operands=32, kind="chain")


def test_chain_hand_example_and_score():
  ex = task.solve_chain(37, 8, 3)
  assert ex == task.Example(prompt="37+8*3=", completion="3:45;2:53;1:61>61", answer="61")
  assert task.score("37+8*3=", "3:45;2:53;1:61>61")
  assert task.score("37+8*3=", "3:45;2:50;1:61>61")  # the steps are not checked
  assert not task.score("37+8*3=", "3:45;2:53;1:61>60")
  assert not task.score("37+8*3=", "3:45;2:53;1:61")
  with pytest.raises(ValueError, match="not a task prompt"):
    task.score("37*8+3=", ">61")


def test_chain_examples_are_long_and_within_the_stated_bounds():
  """Completions of n = 32 steps run 186-219 tokens with eos; the bounds are attained."""
  assert (CHAIN.min_completion_tokens, CHAIN.max_completion_tokens) == (186, 219)
  assert CHAIN.max_prompt_tokens == 9 and CHAIN.seq_len == 228
  lengths = []
  for i in range(3000):
    ex = task.make_example(0, i, "train", CHAIN)
    start, step, count = (int(x) for x in task._CHAIN_RE.fullmatch(ex.prompt).groups())
    assert count == 32 and 10 <= start <= 99 and 1 <= step <= 9
    assert ex.answer == str(start + step * count) and task.score(ex.prompt, ex.completion)
    lengths.append(len(ex.completion) + 1)
  assert CHAIN.min_completion_tokens <= min(lengths) and max(lengths) <= 219
  longest = task.solve_chain(99, 9, 32)
  assert len(longest.completion) + 1 == CHAIN.max_completion_tokens
  assert len(task.solve_chain(10, 1, 32).completion) + 1 == CHAIN.min_completion_tokens
  heldout = {task.make_example(0, i, "heldout", CHAIN).prompt for i in range(50)}
  train = {task.make_example(0, i, "train", CHAIN).prompt for i in range(500)}
  assert not heldout & train


def test_task_kind_keeps_the_sum_task_cache_key():
  """The teacher cache keys on repr(TaskConfig): the sum task's is the one it always was,
  and the chain's differs from it."""
  assert repr(task.TaskConfig()) == (
    "TaskConfig(num_operands=3, min_operand=10, max_operand=99, heldout_fraction=0.1)"
  )
  assert "kind='chain'" in repr(CHAIN)
  with pytest.raises(ValueError, match="kind must be one of sum, chain"):
    task.TaskConfig(kind="product")
  with pytest.raises(ValueError, match="max_step must be an int in"):
    task.TaskConfig(kind="chain", max_step=10)


def test_chain_task_from_the_run_config():
  import sys
  from pathlib import Path

  from opd_jax.config import check as config_check
  from opd_jax.train import setup as setup_lib

  sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
  import base

  config = base.get_config()
  config.data.task = "chain"
  config.data.num_operands = 32
  config_check.validate(config)
  assert setup_lib.task_config(run_spec(config)) == CHAIN
  config.data.task = "product"
  with pytest.raises(ValueError, match="config.data.task must be one of sum, chain"):
    config_check.validate(config)


def learn_and_score(tc: task.TaskConfig, max_steps: int, batch: int, stop_at: float, log=None):
  """Trains a 2-layer d=128 model on `tc` and returns (steps, held-out greedy exact match).

  Scored through an exponential moving average of the weights, which removes most of the
  step-to-step noise of the climb. Training stops as soon as the average gets ≥ `stop_at` of
  a validation draw of held-out prompts right under teacher forcing (a lower bound of greedy
  exact match that costs one forward pass), at the latest after `max_steps`; then 256 other
  held-out prompts are decoded greedily and scored with `task.score`.
  """
  import jax
  import jax.numpy as jnp
  import optax

  from opd_jax.model import transformer as model
  from opd_jax.model.config import ModelConfig

  tok = CharTokenizer()
  cfg = ModelConfig(
    model_type="llama",
    vocab_size=tok.vocab_size,
    hidden_size=128,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=32,
  )
  check_every, ema_decay = 25, 0.97
  params = model.init_params(jax.random.key(0), cfg)
  opt = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, 1e-3, 50, max_steps, 1e-4),
      b2=0.98,
      weight_decay=0.1,
    ),
  )

  def loss_fn(p, tokens_bt, mask_bt):
    logp = jax.nn.log_softmax(model.forward(p, tokens_bt[:, :-1], cfg))
    ll = jnp.take_along_axis(logp, tokens_bt[:, 1:, None], -1)[..., 0]
    return -jnp.sum(ll * mask_bt[:, 1:]) / jnp.sum(mask_bt[:, 1:])

  def train_step(state, batch_bt):
    p, s, e = state
    grads = jax.grad(loss_fn)(p, *batch_bt)
    updates, s = opt.update(grads, s, p)
    p = optax.apply_updates(p, updates)
    return (p, s, jax.tree.map(lambda x, y: ema_decay * x + (1 - ema_decay) * y, e, p)), None

  @jax.jit
  def train_steps(state, tokens_nbt, mask_nbt):
    """`check_every` steps in one call: a scan runs ~25% faster on CPU than a loop of calls."""
    return jax.lax.scan(train_step, state, (tokens_nbt, mask_nbt))[0]

  @jax.jit
  def teacher_forced_exact(p, tokens_bt, mask_bt):
    """Share of sequences whose every completion token is the argmax after the true prefix."""
    hit = jnp.argmax(model.forward(p, tokens_bt[:, :-1], cfg), -1) == tokens_bt[:, 1:]
    return jnp.mean(jnp.all(hit | (mask_bt[:, 1:] == 0), -1))

  @jax.jit
  def greedy(p, tokens_bt):
    def body(t, toks):
      nxt = jnp.argmax(model.forward(p, toks, cfg)[:, t - 1], -1).astype(jnp.int32)
      return toks.at[:, t].set(nxt)

    return jax.lax.fori_loop(tc.max_prompt_tokens, tc.seq_len, body, tokens_bt)

  val = task.TaskSource("heldout", 256, seed=1, task_cfg=tc)  # disjoint from the scored prompts
  val_b = task.encode_batch([val[i] for i in range(len(val))], tok, tc.seq_len)
  val_inputs = (val_b["tokens"], val_b["loss_mask"])
  train = task.TaskSource("train", max_steps * batch, seed=0, task_cfg=tc)
  state = (params, opt.init(params), params)  # params, optimizer state, EMA of params
  for step in range(check_every, max_steps + 1, check_every):
    examples = [train[i] for i in range((step - check_every) * batch, step * batch)]
    b = task.encode_batch(examples, tok, tc.seq_len)
    shape = (check_every, batch, tc.seq_len)
    state = train_steps(state, b["tokens"].reshape(shape), b["loss_mask"].reshape(shape))
    exact = teacher_forced_exact(state[2], *val_inputs)
    if log is not None:
      log(f"step {step}: teacher-forced exact match {float(exact):.3f}")
    if exact >= stop_at:
      break
  ema = state[2]

  heldout = task.TaskSource("heldout", 256, seed=0, task_cfg=tc)
  prompts = [heldout[i]["prompt"] for i in range(len(heldout))]
  prompt_bp, _ = task.encode_prompts(prompts, tok, tc.max_prompt_tokens)
  assert prompt_bp.shape[1] == tc.max_prompt_tokens  # every prompt has the same length
  tokens = np.zeros((len(prompts), tc.seq_len), np.int32)
  tokens[:, : tc.max_prompt_tokens] = prompt_bp
  out = np.asarray(greedy(ema, jnp.asarray(tokens)))
  accuracy = np.mean(
    [task.score(p, tok.decode(out[i, tc.max_prompt_tokens :])) for i, p in enumerate(prompts)]
  )
  print(f"stopped at step {step}, held-out greedy exact match {accuracy:.4f}")
  return step, accuracy


@pytest.mark.slow
def test_tiny_transformer_learns_the_task():
  """A 2-layer d=128 model reaches ≥ 90% held-out greedy exact match in ~600 steps (~35 s on
  CPU), from ~40% to ~95% (`learn_and_score`)."""
  step, accuracy = learn_and_score(task.TaskConfig(), max_steps=800, batch=32, stop_at=0.92)
  assert accuracy >= 0.9, (step, accuracy)


@pytest.mark.slow
def test_tiny_transformer_learns_a_short_chain():
  """The chain variant is learnable by the same 2-layer d=128 model (`learn_and_score`): each
  step reads only the one before it. The test uses n = 8 steps (about 60 completion tokens) to
  stay within the suite's time; the full n = 32 variant (186-219 tokens) was measured once by
  hand with `learn_and_score(CHAIN, max_steps=1500, batch=16, stop_at=0.9)`: teacher-forced exact
  match 0.92 after 1,125 steps, greedy exact match 0.9375 on 256 held-out prompts, about 25
  minutes on 2 busy CPU cores."""
  short = task.TaskConfig(num_operands=8, kind="chain")
  step, accuracy = learn_and_score(short, max_steps=800, batch=16, stop_at=0.9)
  assert accuracy >= 0.85, (step, accuracy)
