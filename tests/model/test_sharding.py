"""Tests for opd_jax.model.sharding: logical axes, rules, mesh validation and a sharded forward."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _sharded_forward_check import CFG  # the model the subprocess check uses
from conftest import xla_flags_with
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey, SequenceKey

from opd_jax.model import sharding, sharding_checks
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig
from opd_jax.model.quant import QArray


def abstract_mesh(data, fsdp, tensor):
  return AbstractMesh((data, fsdp, tensor), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def abstract_params(cfg=CFG):
  return jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg))


def specs(tree, mesh, rules=sharding.DEFAULT_RULES):
  return jax.tree.map(lambda s: s.spec, sharding.tree_shardings(tree, mesh, rules))


def leaf(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_logical_axes_from_key_suffixes():
  layer = (DictKey("layers"), SequenceKey(1))
  assert sharding.logical_axes((DictKey("embed_vd"),), leaf(64, 8)) == ("vocab", "embed")
  assert sharding.logical_axes(layer + (DictKey("q_dnh"),), leaf(8, 4, 2)) == (
    "embed",
    "heads",
    "head_dim",
  )
  assert sharding.logical_axes(layer + (DictKey("o_nhd"),), leaf(4, 2, 8)) == (
    "heads",
    "head_dim",
    "embed",
  )
  assert sharding.logical_axes(layer + (DictKey("k_bias_kh"),), leaf(2, 2)) == (
    "kv_heads",
    "head_dim",
  )
  assert sharding.logical_axes(layer + (DictKey("attn_norm_d"),), leaf(8)) == ("embed",)
  assert sharding.logical_axes(layer + (DictKey("down_fd"),), leaf(16, 8)) == ("mlp", "embed")
  # Rank mismatch, no suffix, and a suffix that is not dimension letters: replicated.
  assert sharding.logical_axes(layer + (DictKey("gate_df"),), leaf(8)) == (None,)
  assert sharding.logical_axes((DictKey("layers"),), leaf(3)) == (None,)
  assert sharding.logical_axes((DictKey("k_scale"),), leaf(1, 2, 3, 4, 5)) == (None,) * 5
  # The last matching dict key wins; a non-matching last key falls back to an earlier one.
  assert sharding.logical_axes((DictKey("x_vd"), DictKey("y_df")), leaf(2, 3)) == ("embed", "mlp")
  assert sharding.logical_axes((DictKey("x_vd"), DictKey("layers")), leaf(2, 3)) == (
    "vocab",
    "embed",
  )


def test_param_specs_on_2x2x2():
  got = specs(abstract_params(), abstract_mesh(2, 2, 2))
  assert got["embed_vd"] == P("tensor", "fsdp")
  assert got["lm_head_dv"] == P("fsdp", "tensor")
  assert got["final_norm_d"] == P("fsdp")
  layer = got["layers"][1]
  assert layer["q_dnh"] == P("fsdp", "tensor", None)
  assert layer["k_dkh"] == P("fsdp", "tensor", None)
  assert layer["o_nhd"] == P("tensor", None, "fsdp")
  assert layer["gate_df"] == P("fsdp", "tensor")
  assert layer["down_fd"] == P("tensor", "fsdp")
  assert layer["q_norm_h"] == P(None)


def test_optimizer_state_gets_param_specs():
  params = abstract_params()
  mesh = abstract_mesh(2, 2, 2)
  param_specs = specs(params, mesh)
  adam = specs(jax.eval_shape(optax.adamw(1e-3).init, params), mesh)[0]
  assert adam.mu == param_specs
  assert adam.nu == param_specs
  assert adam.count == P()


def test_qarray_value_takes_param_axes_and_scale_replicates():
  mesh = abstract_mesh(1, 2, 4)
  q3 = QArray(jax.ShapeDtypeStruct((64, 4, 16), jnp.float8_e4m3fn), leaf(1, 64), num_in_axes=1)
  q2_channel = QArray(jax.ShapeDtypeStruct((64, 128), jnp.float8_e4m3fn), leaf(1, 128))
  tree = {"layers": [{"q_dnh": q3, "gate_df": q2_channel}]}
  got = specs(tree, mesh)["layers"][0]
  assert got["q_dnh"].value == P("fsdp", "tensor", None)
  assert got["q_dnh"].scale == P(None, None)
  assert got["gate_df"].value == P("fsdp", "tensor")
  # The per-channel scale [1, F] has the weight's rank: its out axis follows the weight.
  assert got["gate_df"].scale == P(None, "tensor")


def test_non_divisible_dims_fall_back_to_unsharded():
  # vocab 50 is not divisible by tensor=4; 2 KV heads neither; heads 8 and mlp 96 are.
  cfg = ModelConfig("qwen2", 50, 64, 96, 1, 8, 2, 8, qkv_bias=True)
  got = specs(abstract_params(cfg), abstract_mesh(1, 2, 4))
  assert got["embed_vd"] == P(None, "fsdp")
  assert got["lm_head_dv"] == P("fsdp", None)
  layer = got["layers"][0]
  assert layer["q_dnh"] == P("fsdp", "tensor", None)
  assert layer["k_dkh"] == P("fsdp", None, None)
  assert layer["q_bias_nh"] == P("tensor", None)
  assert layer["k_bias_kh"] == P(None, None)
  assert layer["gate_df"] == P("fsdp", "tensor")


def test_mesh_axis_used_once_per_spec():
  rules = (("vocab", "tensor"), ("embed", "tensor"), ("mlp", ("fsdp", "tensor")))
  got = specs(
    {"embed_vd": leaf(8, 8), "gate_df": leaf(8, 8), "down_fd": leaf(8, 8)},
    abstract_mesh(1, 2, 2),
    rules,
  )
  assert got["embed_vd"] == P("tensor", None)
  assert got["gate_df"] == P("tensor", None)  # mlp wants (fsdp, tensor); embed took tensor
  assert got["down_fd"] == P(("fsdp", "tensor"), None)


def test_bad_rules_raise():
  mesh = abstract_mesh(1, 1, 2)
  with pytest.raises(ValueError, match="'model'"):
    specs({"embed_vd": leaf(4, 4)}, mesh, (("vocab", "model"),))
  with pytest.raises(ValueError, match="'vocab' appears twice"):
    specs({"embed_vd": leaf(4, 4)}, mesh, (("vocab", "tensor"), ("vocab", None)))


def test_batch_and_logical_shardings():
  mesh = abstract_mesh(2, 2, 2)
  assert sharding.batch_sharding(mesh, 2).spec == P(("data", "fsdp"), None)
  assert sharding.batch_sharding(mesh, 1).spec == P(("data", "fsdp"))
  assert sharding.logical_sharding(mesh, "btv", (8, 16, 64)).spec == P(
    ("data", "fsdp"), None, "tensor"
  )
  assert sharding.logical_sharding(mesh, "btv", (6, 16, 63)).spec == P(None, None, None)
  with pytest.raises(ValueError, match="ndim=0"):
    sharding.batch_sharding(mesh, 0)
  with pytest.raises(ValueError, match=r"unknown dimension letters \['x'\]"):
    sharding.logical_sharding(mesh, "bx")


def test_make_mesh_on_one_device():
  mesh = sharding.make_mesh((1, -1, 1))
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  assert mesh.axis_types == (AxisType.Auto,) * 3
  assert dict(sharding.make_mesh({"tensor": -1}).shape) == {"data": 1, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize(
  "shape, message",
  [
    ((2, 2, 2), r"mesh shape \(2, 2, 2\) has 8 devices but there are 1 devices"),
    ((-1, 1, -1), r"more than one -1"),
    ((2, -1, 1), r"1 devices are not divisible by the fixed axes \(2\)"),
    ((1, 1), r"must have 3 entries"),
    ((1, 0, 1), r"positive ints or -1"),
    ({"model": 1}, r"unknown mesh axes \['model'\]"),
  ],
)
def test_make_mesh_rejects_bad_shapes(shape, message):
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(shape, devices=jax.devices()[:1])


def test_sufficiently_sharded_hand_computed():
  mesh = abstract_mesh(2, 2, 2)  # model axes fsdp·tensor = 4 devices

  def placed(spec):
    return jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, spec))

  tree = {"a_df": placed(P("fsdp", "tensor")), "b_df": placed(P()), "n_d": leaf(64)}
  # per device: 32·32 + 64·64 = 5120 elements of 8192 total; excess = 5120·4/8192 − 1.
  assert sharding_checks.assert_params_sufficiently_sharded(tree, mesh, tolerance=2.0) == 1.5
  with pytest.raises(ValueError, match=r"150\.0% above total/4.*\['b_df'\] \(64, 64\) P\(\)"):
    sharding_checks.assert_params_sufficiently_sharded(tree, mesh)
  # Only fsdp splits b: it holds 32·64 per device; excess = (1024 + 2048)·4/8192 − 1 = 0.5.
  tree["b_df"] = placed(P("fsdp", None))
  assert sharding_checks.assert_params_sufficiently_sharded(tree, mesh, tolerance=1.0) == 0.5
  tree["b_df"] = placed(P("tensor", "fsdp"))
  assert sharding_checks.assert_params_sufficiently_sharded(tree, mesh) == 0.0


def test_sufficiently_sharded_passes_trivially_on_one_device():
  mesh = sharding.make_mesh((1, 1, 1))
  params, shardings = sharding.shard_init(
    lambda: {"embed_vd": jnp.ones((64, 32)), "layers": [{"gate_df": jnp.ones((32, 128))}]}, mesh
  )
  assert shardings["embed_vd"].spec == P("tensor", "fsdp")
  assert params["layers"][0]["gate_df"].sharding.spec == P("fsdp", "tensor")
  assert sharding_checks.assert_params_sufficiently_sharded(params, mesh, min_elements=0) == 0.0


def test_describe_counts_and_specs():
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_params())
  layer = params["layers"][0]
  layer["q_dnh"] = QArray(
    layer["q_dnh"].astype(jnp.float8_e4m3fn), jnp.ones((1, 64), jnp.float32), num_in_axes=1
  )
  mesh = sharding.make_mesh((1, 1, 1))
  params = jax.device_put(params, sharding.tree_shardings(params, mesh))
  lines = sharding_checks.describe(params).splitlines()
  assert [line.split()[0] for line in lines] == [
    "embed_vd",
    "final_norm_d",
    "layers",
    "lm_head_dv",
    "total",
  ]
  assert lines[0].split()[1:4] == ["4,096", "params", "16.0"]
  assert "embed_vd (64, 64) float32 P('tensor', 'fsdp')" in lines[0]
  # Per layer: 4·64·64 attention + 3·64·128 MLP + 2·64 + 2·16 norms = 41,120 elements.
  # Layer 0's q is fp8 (1 byte) plus 64 f32 scales: bytes = 4·(82,240 − 4,096) + 4,096 + 256.
  assert lines[2].split()[1] == "82,240"
  assert lines[2].split()[3:5] == [f"{(4 * (82240 - 4096) + 4096 + 256) / 1024:.1f}", "KiB"]
  assert "gate_df (64, 128) float32 P('fsdp', 'tensor')" in lines[2]
  assert lines[4].split()[1] == f"{4096 * 2 + 64 + 82240:,}"


def test_sharded_forward_matches_unsharded_on_8_devices():
  # 8 host devices for this process only.
  env = dict(os.environ, XLA_FLAGS=xla_flags_with("--xla_force_host_platform_device_count=8"))
  env["JAX_PLATFORMS"] = "cpu"
  script = pathlib.Path(__file__).with_name("_sharded_forward_check.py")
  proc = subprocess.run(
    [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["devices"] == 8
  diffs = result["max_abs_diff"]
  assert set(diffs) == {"8x1x1", "2x2x2", "1x2x4"}
  for name, diff in diffs.items():
    assert diff <= 1e-5, (name, diff)
  assert result["init_max_abs_diff_2x2x2"] == 0.0
  # Norms are below min_elements; every matrix is split 4 ways over fsdp·tensor.
  assert result["excess_2x2x2"] == 0.0
  assert "300.0% above total/4" in result["replicated_rejected"]
  assert "['layers'][0]['down_fd'] (128, 64) P()" in result["replicated_rejected"]
  specs_222 = result["param_specs"]
  assert specs_222["layers"][0]["q_dnh"] == "P('fsdp', 'tensor', None)"
  assert specs_222["embed_vd"] == "P('tensor', 'fsdp')"
  assert result["opt_mu_matches"] and result["opt_nu_matches"]
  assert result["opt_count_spec"] == "P()"
  assert "gate_df (64, 128) float32 P('fsdp', 'tensor')" in result["describe"]


def test_the_params_alone_shard_as_the_train_states_params():
  """A reader restores the params subtree alone (`Checkpointer.restore_params`) into
  `tree_shardings(params)`: the layout the trainer gives `TrainState.params`."""
  from opd_jax.train import state as train_state

  params = abstract_params()
  tx = train_state.make_optimizer(1e-3, 10, 2, 0.0, 1.0)
  state = jax.eval_shape(lambda p: train_state.init_state(p, tx, 0), params)
  for mesh in (abstract_mesh(1, 8, 1), abstract_mesh(2, 2, 2)):
    assert specs(params, mesh) == specs(state, mesh).params


def test_relayout_compiles_once_per_layout():
  """A loop that relayouts every step (each rollout onto the train mesh) with fresh but equal
  shardings compiles the identity once, not once per call."""
  compiles = []

  def listen(event, seconds, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(seconds)

  def step(i):
    mesh = sharding.make_mesh((1, -1, 1))
    tree = {"tokens_bt": jax.device_put(np.full((4, 3), i, np.int32)), "n": jnp.int32(i)}
    layout = {"tokens_bt": sharding.batch_sharding(mesh, 2), "n": sharding.replicated(mesh)}
    return sharding.relayout(tree, layout), layout

  step(0)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    outs = [step(i) for i in range(1, 4)]
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiles == []
  for i, (out, layout) in enumerate(outs, start=1):
    assert out["tokens_bt"].sharding == layout["tokens_bt"]
    np.testing.assert_array_equal(np.asarray(out["tokens_bt"]), np.full((4, 3), i))
    assert int(out["n"]) == i
  mesh = sharding.make_mesh((1, -1, 1))
  on_host = {"x_b": sharding.batch_sharding(mesh, 1)}
  host = sharding.relayout({"x_b": np.arange(4)}, on_host)  # a host array: transferred
  assert host["x_b"].sharding == on_host["x_b"]
  np.testing.assert_array_equal(np.asarray(host["x_b"]), np.arange(4))
