"""Sharded forward against unsharded forward on 8 host devices.

Run by tests/model/test_sharding.py in a subprocess whose environment sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the flag must be set before
jax starts, and only this process should see 8 devices). Prints one JSON line:

    {"devices": 8, "max_abs_diff": {"8x1x1": ..., "2x2x2": ..., "1x2x4": ...}, ...}
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from opd_jax.model import sharding, sharding_checks
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig

MESH_SHAPES = ((8, 1, 1), (2, 2, 2), (1, 2, 4))
CFG = ModelConfig(
  model_type="qwen3",
  vocab_size=64,
  hidden_size=64,
  intermediate_size=128,
  num_layers=2,
  num_heads=4,
  num_kv_heads=4,
  head_dim=16,
  qk_norm=True,
)


def init_fn():
  return model.init_params(jax.random.key(0), CFG, jnp.float32)


def spec_tree(tree):
  return jax.tree.map(lambda x: str(x.sharding.spec), tree)


def main():
  tokens_bt = jax.random.randint(jax.random.key(1), (8, 8), 0, CFG.vocab_size)
  ref_params = jax.jit(init_fn)()
  ref_logits = np.asarray(jax.jit(model.forward, static_argnums=2)(ref_params, tokens_bt, CFG))

  result = {"devices": jax.device_count(), "max_abs_diff": {}}
  for shape in MESH_SHAPES:
    name = "x".join(map(str, shape))
    mesh = sharding.make_mesh(shape)
    if shape == (2, 2, 2):
      # Initialising in place is the production path; it must reproduce the same values.
      params, param_shardings = sharding.shard_init(init_fn, mesh)
      init_diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, ref_params)
      result["init_max_abs_diff_2x2x2"] = max(jax.tree.leaves(init_diff))
    else:
      # Compiling the random init per mesh costs seconds; placing the values is enough here.
      param_shardings = sharding.tree_shardings(jax.eval_shape(init_fn), mesh)
      params = jax.device_put(ref_params, param_shardings)

    tokens_sharding = sharding.batch_sharding(mesh, 2)
    logits_sharding = sharding.logical_sharding(mesh, "btv", ref_logits.shape)
    forward = jax.jit(
      model.forward,
      static_argnums=2,
      in_shardings=(param_shardings, tokens_sharding),
      out_shardings=logits_sharding,
    )
    logits = forward(params, jax.device_put(tokens_bt, tokens_sharding), CFG)
    if logits.sharding.spec != logits_sharding.spec:
      raise RuntimeError(f"logits sharding {logits.sharding} != {logits_sharding}")
    result["max_abs_diff"][name] = float(np.max(np.abs(np.asarray(logits) - ref_logits)))

    if shape == (2, 2, 2):
      result["excess_2x2x2"] = sharding_checks.assert_params_sufficiently_sharded(params, mesh)
      replicated = jax.device_put(ref_params, sharding.replicated(mesh))
      try:
        sharding_checks.assert_params_sufficiently_sharded(replicated, mesh)
        result["replicated_rejected"] = ""
      except ValueError as e:
        result["replicated_rejected"] = str(e)

      tx = optax.adamw(1e-3)
      opt_shardings = sharding.tree_shardings(jax.eval_shape(tx.init, params), mesh)
      opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
      adam = opt_state[0]
      param_specs = spec_tree(params)
      result["param_specs"] = param_specs
      result["opt_mu_matches"] = spec_tree(adam.mu) == param_specs
      result["opt_nu_matches"] = spec_tree(adam.nu) == param_specs
      result["opt_count_spec"] = str(adam.count.sharding.spec)
      result["describe"] = sharding_checks.describe(params)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
