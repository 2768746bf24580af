"""The data-parallel sampler: sharded rollouts equal unsharded ones, and never gather the batch.

The 8-device comparisons run in a subprocess (tests/inference/_sharded_sampler_check.py) with
XLA_FLAGS=--xla_force_host_platform_device_count=8 set for that process only.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg, xla_flags_with

from opd_jax.config import check as config_check
from opd_jax.inference import sampler
from opd_jax.model import sharding, sharding_checks
from opd_jax.model import transformer as model
from opd_jax.rollout import worker as rollout_worker
from opd_jax.train import setup as setup_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "configs"))
import base  # noqa: E402

# A compiled CPU HLO excerpt: an FSDP weight gather, a batch gather, a tensor-parallel
# all-reduce, a tuple all-reduce and an async all-gather.
HLO = """
  %param.1 = f32[16,4,8]{2,1,0} parameter(1), sharding={devices=[2,2,1]<=[4]}
  %fusion.3 = s32[4,1]{1,0} fusion(%param.2), kind=kLoop, calls=%fused
  %all-gather.1 = f32[32,4,8]{2,1,0} all-gather(%param.1), replica_groups=[2,2]<=[4], dimensions={0}
  %all-gather.2 = s32[8,1]{1,0} all-gather(%fusion.3), replica_groups={{0,1},{2,3}}, dimensions={0}
  %all-reduce.5 = f32[4,1,32]{2,1,0} all-reduce(%fusion.3), channel_id=3, to_apply=%add
  %all-reduce.6 = (s32[], s32[]) all-reduce(%a, %b), channel_id=4, to_apply=%add
  %all-gather-start = (f32[4,2]{1,0}, f32[4,4]{1,0}) all-gather-start(%param.1), dimensions={1}
"""


def test_hlo_collectives_reads_ops_shapes_and_dims():
  ops = sharding_checks.hlo_collectives(HLO)
  got = [(op["op"], op["operand"], op["result"], op["dims"]) for op in ops]
  assert got == [
    ("all-gather", (16, 4, 8), (32, 4, 8), (0,)),
    ("all-gather", (4, 1), (8, 1), (0,)),
    ("all-reduce", (4, 1), (4, 1, 32), ()),
    ("all-reduce", None, None, ()),
    ("all-gather", (16, 4, 8), None, (1,)),
  ]
  assert ops[1]["line"].startswith("%all-gather.2 = s32[8,1]")


def test_batch_shards_and_place_rows_on_one_device():
  mesh = sharding.make_mesh((1, 1, 1))
  assert sharding.batch_shards(mesh) == 1
  rows = sharding.place_rows(np.arange(6).reshape(3, 2), mesh)
  assert rows.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)
  np.testing.assert_array_equal(rows, np.arange(6).reshape(3, 2))
  assert [start for start, _ in sharding.local_rows(rows)] == [0]
  doubled = sharding.map_local_rows(lambda start, x: x[:, 0] * 2 + start, rows)
  np.testing.assert_array_equal(doubled, [0, 4, 8])


def test_place_rows_refuses_a_batch_the_mesh_cannot_split():
  mesh = jax.sharding.AbstractMesh(
    (2, 1, 1), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
  )
  with pytest.raises(ValueError, match=r"shape \(3, 2\) cannot be split over 2 batch shards"):
    sharding.place_rows(np.zeros((3, 2)), mesh)


def test_params_mesh_names_only_multi_device_training_meshes():
  params = {"embed_vd": jnp.ones((4, 2))}
  assert sharding.params_mesh(params) is None  # one device, no NamedSharding
  one = sharding.make_mesh((1, 1, 1))
  assert sharding.params_mesh(jax.device_put(params, sharding.tree_shardings(params, one))) is None


def test_sampling_on_a_one_device_mesh_matches_plain_sampling():
  """mesh= takes the sharded path (constraints, batch padded to a multiple of data·fsdp
  rather than a power of two) and changes no token: 5 prompts, so the plain path pads to 8."""
  cfg = tiny_model_cfg(64)
  params = model.init_params(jax.random.key(0), cfg, jnp.float32, scale=0.3)
  prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
  scfg = sampler.SamplerConfig(max_new_tokens=5, temperature=1.0, top_k=6)
  mesh = sharding.make_mesh((1, 1, 1))
  plain = sampler.sample(params, prompts, jax.random.key(2), scfg, cfg)
  placed = jax.device_put(params, sharding.tree_shardings(params, mesh))
  split = sampler.sample(placed, prompts, jax.random.key(2), scfg, cfg, mesh=mesh)
  assert split.completion_tokens.shape == plain.completion_tokens.shape == (5, 5)
  np.testing.assert_array_equal(split.completion_tokens, plain.completion_tokens)
  np.testing.assert_array_equal(split.completion_mask, plain.completion_mask)
  np.testing.assert_allclose(split.behaviour_logprobs, plain.behaviour_logprobs, atol=1e-5)
  np.testing.assert_array_equal(split.support_ids, plain.support_ids)


def _config(**rollout_mesh):
  config = base.get_config()
  for axis, size in rollout_mesh.items():
    config.rollout[f"mesh_{axis}"] = size
  return config


def _rollout_mesh(config, mesh):
  spec = setup_lib.run_spec(config)
  return rollout_worker.rollout_mesh(spec.rollout, spec.data.batch_size, mesh)


def test_rollout_mesh_from_the_config():
  mesh = sharding.make_mesh((1, 1, 1))
  assert _rollout_mesh(_config(), mesh) is None
  own = _rollout_mesh(_config(data=1, fsdp=-1, tensor=1), mesh)
  assert dict(own.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  with pytest.raises(ValueError, match=r"has 2 devices but there are 1"):
    _rollout_mesh(_config(data=2, fsdp=1, tensor=1), mesh)
  with pytest.raises(ValueError, match=r"must all be 0 \(the training mesh\) or all be set"):
    _rollout_mesh(_config(data=1), mesh)
  with pytest.raises(ValueError, match=r"rollout.mesh_data/mesh_fsdp/mesh_tensor must all be 0"):
    config_check.validate(_config(fsdp=2))
  config_check.validate(_config(data=-1, fsdp=2, tensor=1))


@pytest.fixture(scope="module")
def eight_devices():
  flags = xla_flags_with("--xla_force_host_platform_device_count=8")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  script = pathlib.Path(__file__).with_name("_sharded_sampler_check.py")
  proc = subprocess.run(
    [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["devices"] == 8
  return result


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2x2x2", "8x1x1"])
def test_sharded_rollouts_equal_unsharded_token_for_token(eight_devices, mesh):
  got = eight_devices["meshes"][mesh]
  per_device = {"2x2x2": 4, "8x1x1": 2}[mesh]  # 16 rows over data·fsdp = 4 or 8 shards
  assert got["rows_per_device"] == [per_device] * 8
  # [B over data·fsdp, C, V over tensor]: V = 64 is split in two on 2x2x2.
  assert got["teacher_logits_shard"] == [per_device, 6, 64 // (2 if mesh == "2x2x2" else 1)]
  assert got["greedy_same"] and got["sampled_same"] and got["sampled_topk_ids_same"]
  assert got["greedy_model_lp_diff"] < 1e-5
  assert got["sampled_lp_diff"] < 1e-5
  assert got["teacher_logits_diff"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2x2x2", "8x1x1"])
def test_sampler_teacher_and_eval_programs_never_gather_the_batch(eight_devices, mesh):
  got = eight_devices["meshes"][mesh]
  for program in ("sampler_hlo", "sampled_hlo", "teacher_hlo", "eval_kl_hlo"):
    assert got[program]["batch_gathers"] == [], (program, got[program])
    assert "all-to-all" not in got[program]["counts"]
    assert "collective-permute" not in got[program]["counts"]
  if mesh == "8x1x1":  # only the batch is split: any gather would gather the batch
    for program in ("sampler_hlo", "sampled_hlo", "teacher_hlo", "eval_kl_hlo"):
      assert "all-gather" not in got[program]["counts"], (program, got[program])
      assert set(got[program]["all_reduce_operands"]) <= {"()"}, (program, got[program])
  else:  # FSDP weight gathers only, once per call
    assert got["sampler_hlo"]["counts"]["all-gather"] > 0


@pytest.mark.slow
def test_the_batch_gather_detector_finds_a_real_one(eight_devices):
  assert len(eight_devices["control_batch_gathers"]) == 1


@pytest.mark.slow
def test_rollout_engine_and_evaluation_match_unsharded_on_2x2x2(eight_devices):
  """Teacher scoring and rewards in the engine, on the trainer's 2x2x2 mesh and on its own
  8x1x1 rollout mesh; evaluate.evaluate with 13 held-out rows padded to 16."""
  got = eight_devices
  assert got["engine_same"] and got["engine_rewards_same"] and got["engine_tokens_same"]
  assert got["engine_rows_per_device"] == [4] * 8
  assert got["engine_teacher_logits_diff"] < 1e-5
  # Sampled on 8x1x1, handed back laid out for the 2x2x2 train step.
  assert got["own_mesh_same"] and got["own_mesh_rows_per_device"] == [4] * 8
  assert got["own_mesh_params_mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
  assert got["own_mesh_teacher_logits_diff"] < 1e-5
  ref, split = got["eval_unsharded"], got["eval_sharded"]
  assert set(split) == set(ref)
  for name, value in ref.items():
    assert split[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize(
  "changes, key",
  [
    ({}, "teacher.pretrain_batch_size=64"),
    ({("teacher", "checkpoint"): "/some/teacher"}, "student.warmup_batch_size=64"),
  ],
)
def test_supervised_batches_must_split_over_the_batch_devices(changes, key):
  """The teacher bootstrap and the warm start place their batches as the prompts are: a size
  the data x fsdp devices do not divide is refused before any weights load, naming the key."""
  config = base.get_config()
  config.data.batch_size = 48
  for (group, name), value in changes.items():
    config[group][name] = value
  spec = setup_lib.run_spec(config)
  mesh = types.SimpleNamespace(shape={"data": 6, "fsdp": 1, "tensor": 1})  # its shape alone
  with pytest.raises(ValueError, match=rf"{re.escape(key)} must be a multiple of the data x fsdp"):
    setup_lib.check_shapes(spec, setup_lib.task_config(spec), mesh)
