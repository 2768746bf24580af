"""Config schema and CLI validation: every bad value is named before anything compiles."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from opd_jax.cli.flags import resolve_config_arg
from opd_jax.config import check as config_check

ROOT = Path(__file__).resolve().parent.parent
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
    config = module.get_config(variant)
    # An experiment config (study.py, opd_vs_rl.py) holds the run it varies under `run`.
    config_check.validate(config.run if "run" in config else config)


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
