"""Sharded rollouts, teacher scoring and evaluation against the unsharded ones on 8 devices.

Run by tests/inference/test_sharded_sampler.py in a subprocess whose environment sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 (only this process sees 8 devices).
Prints one JSON line with, per mesh, whether the sharded greedy and sampled rollouts equal
the unsharded ones token for token, the largest log-prob and teacher-logit differences,
and the collectives of each compiled program (`sharding_checks.hlo_collectives`), split into
those that gather the batch and the rest; then the same comparisons for the
`RolloutWorker` (teacher scoring, rewards) and `evaluate.evaluate` on the 2x2x2 mesh.
"""

import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.data import pipeline as data
from opd_jax.data import task
from opd_jax.inference import sampler, teacher_forcing, transform
from opd_jax.model import sharding, sharding_checks, tokenizer
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.rollout.worker import RolloutWorker
from opd_jax.train import evaluate

MESH_SHAPES = ((2, 2, 2), (8, 1, 1))
BATCH = 16  # per-shard batch 4 (2x2x2) or 2 (8x1x1); no other split dimension has those
CFG = ModelConfig(
  model_type="qwen3",
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  qk_norm=True,
)
GREEDY = sampler.SamplerConfig(max_new_tokens=6, temperature=0.0)
SAMPLED = sampler.SamplerConfig(max_new_tokens=6, temperature=1.0, top_k=8, return_topk=4)
TOK = tokenizer.CharTokenizer()
TASK = task.TaskConfig(num_operands=2, max_operand=99)
TASK_CFG = ModelConfig("qwen3", TOK.vocab_size, 32, 64, 2, 4, 2, 8, qk_norm=True)
TASK_SAMPLER = sampler.SamplerConfig(max_new_tokens=6, stop_tokens=(TOK.eos_id,))


def batch_gathers(hlo_text: str, local_batch: int) -> list[str]:
  """All-gathers (and all-to-alls) that concatenate along a dimension holding the
  per-shard batch: each would gather rows of other batch shards."""
  found = []
  for op in sharding_checks.hlo_collectives(hlo_text):
    if op["op"] not in ("all-gather", "all-to-all") or op["operand"] is None:
      continue
    for d in op["dims"]:
      grows = op["result"] is None or op["result"][d] > op["operand"][d]
      if op["operand"][d] == local_batch and grows:
        found.append(op["line"][:200])
  return found


def summary(hlo_text: str) -> dict:
  """Counts per collective op, and the distinct shapes the all-reduces carry."""
  ops = sharding_checks.hlo_collectives(hlo_text)
  reduced = sorted({str(op["operand"]) for op in ops if op["op"] == "all-reduce"})
  return {"counts": dict(Counter(op["op"] for op in ops)), "all_reduce_operands": reduced}


def inspect(lowered, local_batch: int) -> dict:
  text = lowered.compile().as_text()
  return {"batch_gathers": batch_gathers(text, local_batch), **summary(text)}


def max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def same_tokens(a, b, rows: int) -> bool:
  return bool(
    np.array_equal(np.asarray(a.completion_tokens)[:rows], np.asarray(b.completion_tokens)[:rows])
    and np.array_equal(np.asarray(a.completion_mask)[:rows], np.asarray(b.completion_mask)[:rows])
  )


def rows_per_device(x) -> list[int]:
  """The batch rows each device holds (one entry per device)."""
  return sorted(shard.data.shape[0] for shard in x.addressable_shards)


def place(params, mesh):
  return jax.device_put(params, sharding.tree_shardings(params, mesh))


def sampler_checks(mesh, student, teacher, prompts, refs) -> dict:
  key = jax.random.key(3)
  local_batch = BATCH // sharding.batch_shards(mesh)
  s, t = place(student, mesh), place(teacher, mesh)
  greedy = sampler.sample(s, prompts, key, GREEDY, CFG, mesh=mesh)
  sampled = sampler.sample(s, prompts, key, SAMPLED, CFG, mesh=mesh)
  logits, _ = teacher_forcing.sharded_completion_logits(t, greedy, CFG, mesh)
  return {
    "rows_per_device": rows_per_device(greedy.completion_tokens),
    "greedy_same": same_tokens(greedy, refs["greedy"], BATCH),
    "greedy_model_lp_diff": max_diff(greedy.model_logprobs, refs["greedy"].model_logprobs),
    "sampled_same": same_tokens(sampled, refs["sampled"], BATCH),
    "sampled_lp_diff": max_diff(sampled.behaviour_logprobs, refs["sampled"].behaviour_logprobs),
    "sampled_topk_ids_same": bool(
      np.array_equal(np.asarray(sampled.topk_ids), np.asarray(refs["sampled"].topk_ids))
    ),
    "teacher_logits_diff": max_diff(logits, refs["teacher_logits"]),
    "teacher_logits_shard": list(logits.sharding.shard_shape(logits.shape)),
    "sampler_hlo": inspect(sampler.sample_program(s, prompts, key, GREEDY, CFG, mesh), local_batch),
    "sampled_hlo": inspect(
      sampler.sample_program(s, prompts, key, SAMPLED, CFG, mesh), local_batch
    ),
    "teacher_hlo": inspect(
      teacher_forcing.sharded_completion_logits.lower(t, greedy, CFG, mesh), local_batch
    ),
    # The evaluation's KL at the rollout's sampling transform, on the split logits.
    "eval_kl_hlo": inspect(
      evaluate._masked_kl_transformed.lower(logits, logits, greedy.completion_mask, SAMPLED, mesh),
      local_batch,
    ),
  }


def task_prompts(n: int, seed: int):
  source = task.TaskSource("train", 1000, seed, TASK)
  return iter(data.prompt_batches(source, n, seed))


def engine_checks(mesh, student, teacher) -> dict:
  """The RolloutWorker (teacher scoring and rewards) and evaluate.evaluate, sharded vs not."""
  out = {}
  results = []
  rollout_mesh = sharding.make_mesh((8, 1, 1))
  for where, own_mesh in ((None, None), (mesh, None), (mesh, rollout_mesh)):
    eng = RolloutWorker(
      task_prompts(BATCH, 0),
      TOK,
      TASK.max_prompt_tokens,
      transform.EngineConfig(),
      TASK_SAMPLER,
      TASK_CFG,
      jax.random.key(7),
      where or sharding.make_mesh((1, 1, 1), jax.devices()[:1]),
      teacher=(teacher if where is None else place(teacher, mesh), TASK_CFG),
      score_rewards=True,
      rollout_mesh=own_mesh,
    )
    params = student if where is None else place(student, mesh)
    params_r = eng.transform(params, 0)
    rollout, stats = eng.sample(params_r, eng.draw_prompts(), 0, 0)
    results.append((rollout, stats))
  (ref, ref_stats), (split, split_stats), (own, _) = results
  # A rollout mesh (8x1x1) other than the trainer's (2x2x2): weights re-laid out on it.
  out["own_mesh_same"] = same_tokens(own, ref, BATCH)
  out["own_mesh_rows_per_device"] = rows_per_device(own.completion_tokens)
  out["own_mesh_teacher_logits_diff"] = max_diff(own.teacher_logits, ref.teacher_logits)
  out["own_mesh_params_mesh"] = dict(sharding.params_mesh(params_r).shape)
  out["engine_same"] = same_tokens(split, ref, BATCH)
  out["engine_rows_per_device"] = rows_per_device(split.completion_tokens)
  out["engine_teacher_logits_diff"] = max_diff(split.teacher_logits, ref.teacher_logits)
  out["engine_rewards_same"] = bool(np.array_equal(split.reward_b, ref.reward_b))
  out["engine_reward_sum"] = float(np.sum(ref.reward_b))
  out["engine_tokens_same"] = (
    split_stats["rollout/mean_completion_len"] == (ref_stats["rollout/mean_completion_len"])
  )

  source = task.TaskSource("heldout", 13, 5, TASK)  # 13 rows: padded to 16 on 2x2x2
  eval_set = evaluate.make_eval_set(source, TOK, TASK.max_prompt_tokens)
  metrics = []
  for s, t in ((student, teacher), (place(student, mesh), place(teacher, mesh))):
    metrics.append(evaluate.evaluate(s, TASK_CFG, t, TASK_CFG, eval_set, TOK, 6)[0])
  out["eval_unsharded"], out["eval_sharded"] = metrics
  return out


def main():
  rng = np.random.default_rng(0)
  lens = rng.integers(3, 10, BATCH)
  prompts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in lens]
  student = model.init_params(jax.random.key(0), CFG, jnp.float32, scale=0.3)
  teacher = model.init_params(jax.random.key(1), CFG, jnp.float32, scale=0.3)
  key = jax.random.key(3)
  greedy = sampler.sample(student, prompts, key, GREEDY, CFG)
  refs = {
    "greedy": greedy,
    "sampled": sampler.sample(student, prompts, key, SAMPLED, CFG),
    "teacher_logits": teacher_forcing.sharded_completion_logits(teacher, greedy, CFG)[0],
  }
  result = {"devices": jax.device_count(), "meshes": {}}
  for shape in MESH_SHAPES:
    name = "x".join(map(str, shape))
    result["meshes"][name] = sampler_checks(
      sharding.make_mesh(shape), student, teacher, prompts, refs
    )

  # The detector finds a batch gather where there is one: a program that replicates a
  # batch-split array.
  mesh = sharding.make_mesh((2, 2, 2))
  rows = sharding.place_rows(np.zeros((BATCH, 8), np.float32), mesh)
  gather = jax.jit(lambda x: x * 2, out_shardings=sharding.replicated(mesh)).lower(rows)
  result["control_batch_gathers"] = inspect(gather, BATCH // 4)["batch_gathers"]

  task_student = model.init_params(jax.random.key(4), TASK_CFG, jnp.float32, scale=0.3)
  task_teacher = model.init_params(jax.random.key(5), TASK_CFG, jnp.float32, scale=0.3)
  result |= engine_checks(mesh, task_student, task_teacher)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
