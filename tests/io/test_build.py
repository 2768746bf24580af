"""`build.build_models`: a built-in model's random init is deferred until a value is needed."""

import jax
import numpy as np
import pytest
from conftest import tiny_config

from opd_jax.io import build
from opd_jax.train.setup import run_spec


def test_built_in_models_stay_abstract_until_materialized(tmp_path):
  config = tiny_config(str(tmp_path / "cache"))
  models = build.build_models(run_spec(config))
  for who in ("student", "teacher"):
    leaves = jax.tree.leaves(getattr(models, f"{who}_params"))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert all(x.sharding is not None for x in leaves)
  assert sorted(models.pending) == ["student", "teacher"]

  student = build.materialize(models, "student")
  # The same params the eager init gave: the init key of `build_models` (split of `seed`).
  rng_s, _ = jax.random.split(jax.random.key(config.seed))
  dtype = build.DTYPES[config.student.dtype]
  eager = build.init_sharded(models.student_cfg, models.mesh, rng_s, dtype)
  for got, want in zip(jax.tree.leaves(student), jax.tree.leaves(eager), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert list(models.pending) == ["teacher"]  # the teacher's init has still not run
  assert build.materialize(models, "student") is student  # once only

  with pytest.raises(ValueError, match="who must be 'student' or 'teacher'"):
    build.materialize(models, "critic")
