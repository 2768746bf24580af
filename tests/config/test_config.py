"""Config schema and CLI validation: every bad value is named before anything compiles."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opd_jax.cli.flags import resolve_config_arg
from opd_jax.config import check as config_check
from opd_jax.config import spec as spec_lib
from opd_jax.io import build
from opd_jax.model.config import ModelConfig
from opd_jax.train import setup as setup_lib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import base  # noqa: E402


def test_base_config_keys_match_schema():
  keys = {k for k, _ in config_check.flatten(base.get_config())}
  assert keys == set(config_check.RULES)


def spec_keys(cls, prefix=""):
  """Every leaf field of a spec dataclass as a dotted key (`values` is not a config key)."""
  import dataclasses

  from opd_jax.config import spec as spec_lib

  for f in dataclasses.fields(cls):
    if f.name == "values":
      continue
    sub = spec_lib.SUB_SPECS.get(f.type) if isinstance(f.type, str) else None
    if sub is None:
      yield prefix + f.name
    else:
      yield from spec_keys(sub, f"{prefix}{f.name}.")


def test_run_spec_mirrors_every_config_key():
  """The spec reads every key of the schema, so none is dropped on the way below the trainer."""
  from opd_jax.config.spec import RunSpec

  assert set(spec_keys(RunSpec)) == set(config_check.RULES)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.py")))
def test_every_config_file_and_variant_validates(name):
  import importlib.util

  spec = importlib.util.spec_from_file_location(name[:-3], ROOT / "configs" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for variant in (None, *getattr(module, "VARIANTS", ())):
    if variant is None and getattr(module, "HELD_OUT", None) == ():  # drawn, then pasted
      with pytest.raises(ValueError, match="not drawn yet"):  # configs/round10.py before it
        module.get_config(variant)
      continue
    config = module.get_config(variant)
    # An experiment config (study.py, opd_vs_rl.py) holds the run it varies under `run`, a
    # sweep (grpo_sweep.py) one run per arm under `arms`.
    runs = list(config.arms.values()) if "arms" in config else [config.get("run", config)]
    runs += [config.grpo_run] if "grpo_run" in config else []  # opd_vs_rl_learns.py's GRPO base
    for run in runs:
      config_check.validate(run)
      assert_spec_holds(run)


def spec_leaves(node, prefix=""):
  """(dotted key, value) of every leaf field of a spec dataclass tree, `values` left out."""
  for field in dataclasses.fields(node):
    value = getattr(node, field.name)
    if dataclasses.is_dataclass(value):
      yield from spec_leaves(value, f"{prefix}{field.name}.")
    elif field.name != "values":
      yield f"{prefix}{field.name}", value


def assert_spec_holds(config):
  """`run_spec(config)` holds every key of `config` with its value (lists as tuples), its
  `values` are the checkpoint fingerprint's reprs, and it cannot be changed."""
  spec = setup_lib.run_spec(config)
  flat = dict(config_check.flatten(config))
  leaves = dict(spec_leaves(spec))
  assert set(leaves) == set(flat) == set(config_check.RULES)
  for key, value in flat.items():
    assert leaves[key] == (tuple(value) if isinstance(value, list) else value), key
  assert spec.values == tuple((k, repr(v)) for k, v in config_check.flatten(config))
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.rollout.weights = "fp8"


def test_typed_settings_are_derived_from_the_spec_fields():
  """`derive` takes every field of the same name; the renamed and converted ones are given."""
  config = base.get_config()
  config.train.is_clip, config.train.advantage_clip, config.train.ppo_epochs = 0.0, 3.0, 2
  config.rollout.weight_block_size, config.rollout.top_k = 64, 5
  spec = setup_lib.run_spec(config)
  loss = setup_lib.loss_config(spec)
  assert (loss.name, loss.is_clip, loss.advantage_clip) == ("reverse_kl_full", None, 3.0)
  assert (loss.ppo_epochs, loss.group_size) == (2, config.rollout.samples_per_prompt)
  engine = setup_lib.engine_config(spec, "float32")
  assert (engine.weight_block_size, engine.weight_group_size) == (64, None)
  assert engine.kv.dtype == "float32"  # kv_cache=auto: the compute dtype
  sampling = setup_lib.sampler_config(spec, 1, engine.kv, 64)
  assert (sampling.top_k, sampling.stop_tokens, sampling.attention) == (5, (1,), "auto")
  arch = build.arch_config(spec.student.arch, 64)
  assert (arch.num_layers, arch.hidden_size, arch.qk_norm) == (2, 128, True)
  with pytest.raises(TypeError):  # a field the target lacks is refused, not dropped
    spec_lib.derive(ModelConfig, spec.student.arch, colour="red")


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("train.steps", 0, "config.train.steps must be >= 1, got 0"),
    ("data.batch_size", 0, "config.data.batch_size must be >= 1, got 0"),
    (
      "rollout.kv_cache",
      "fp16",
      "config.rollout.kv_cache must be one of auto, bf16, fp8, fp8_e5m2, fp4",
    ),
    ("rollout.top_p", 1.5, "config.rollout.top_p must be <= 1"),
    ("rollout.top_p", 0.0, "config.rollout.top_p must be > 0"),
    ("train.lr", "fast", "config.train.lr must be a number, got 'fast'"),
    ("student.arch.num_layers", 2.5, "must be an int, got 2.5"),
    ("rollout.bf16_layers", (1, -2), "must be a tuple of non-negative ints"),
  ],
)
def test_bad_values_are_named(key, value, message):
  config = base.get_config()
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  with node.ignore_type():
    node[leaf] = value
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    config_check.validate(config)


def test_typo_suggests_nearest_key():
  config = base.get_config()
  config.train.stpes = 3
  with pytest.raises(
    ValueError, match="unknown config key 'train.stpes'; did you mean 'train.steps'"
  ):
    config_check.validate(config)


def test_mesh_and_heads_consistency():
  config = base.get_config()
  config.mesh.fsdp = -1
  config.student.arch.num_kv_heads = 3
  with pytest.raises(ValueError) as err:
    config_check.validate(config)
  assert "at most one -1 axis" in str(err.value)
  assert "num_heads (4) must be a multiple of num_kv_heads (3)" in str(err.value)


def test_bare_config_name_resolves_inside_configs():
  (arg,) = resolve_config_arg(["--config=base.py:tiny"])
  assert arg == f"--config={ROOT / 'configs' / 'base.py'}:tiny"
  with pytest.raises(SystemExit, match="config file 'nope.py' not found"):
    resolve_config_arg(["--config=nope.py"])


def _main(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-m", "opd_jax.main", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_cli_rejects_bad_override_before_compiling():
  result = _main("--config=base.py", "--config.rollout.top_p=2.0", "--workdir=/tmp/opd_bad")
  assert result.returncode != 0
  assert "config.rollout.top_p must be <= 1, got 2.0" in result.stderr


def test_cli_rejects_misspelt_override():
  result = _main("--config=base.py", "--config.train.stpes=3")
  assert result.returncode != 0
  assert "stpes" in result.stderr and "steps" in result.stderr
