"""The digest of a parameter pytree (`io.params_digest`) and a run's start record
(`io.run_history.start_digests`), against hand-built trees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.io import params_digest, run_history


def _tree():
  rng = np.random.default_rng(0)
  return {
    "embed_vd": jnp.asarray(rng.standard_normal((5, 4), np.float32)),
    "layers": [
      {"q_dnh": jnp.asarray(rng.standard_normal((4, 2, 2)), jnp.bfloat16)},
      {"q_dnh": jnp.asarray(rng.standard_normal((4, 2, 2)), jnp.bfloat16)},
    ],
    "fp8": jnp.asarray(rng.standard_normal((3, 3)), jnp.float8_e4m3fn),
    "int4": jnp.asarray([[1, -2, 7], [0, -8, 3]], jnp.int4),
    "mask": jnp.asarray([True, False, True]),
  }


def test_the_checksum_is_the_odd_weighted_sum_of_the_bits_by_hand():
  x = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
  bits = x.view(np.uint32).astype(np.uint64).ravel()
  want = int(sum((2 * i + 1) * int(b) for i, b in enumerate(bits)) % 2**32)
  assert int(params_digest._checksum(jnp.asarray(x))) == want


def test_equal_trees_agree_and_any_change_of_bits_place_or_name_differs():
  tree = _tree()
  d = params_digest.digest(tree)
  assert len(d) == params_digest.DIGEST_CHARS
  assert params_digest.digest(jax.tree.map(lambda x: jnp.array(x), tree)) == d  # a copy
  assert params_digest.digest(jax.device_get(tree)) == d  # numpy leaves
  one_ulp = np.asarray(tree["embed_vd"]).copy()
  one_ulp[3, 1] = np.nextafter(one_ulp[3, 1], np.inf)
  assert params_digest.digest({**tree, "embed_vd": jnp.asarray(one_ulp)}) != d
  swapped = np.asarray(tree["embed_vd"])[::-1].copy()  # the same values, other places
  assert params_digest.digest({**tree, "embed_vd": jnp.asarray(swapped)}) != d
  flipped = jnp.asarray([[1, -2, 7], [0, -8, 2]], jnp.int4)  # one 4-bit element
  assert params_digest.digest({**tree, "int4": flipped}) != d
  renamed = {("E" if k == "embed_vd" else k): v for k, v in tree.items()}
  assert params_digest.digest(renamed) != d
  assert params_digest.digest(None) is None


def test_a_leaf_that_is_not_an_array_is_named():
  with pytest.raises(ValueError, match=r"\['step'\] is not an array"):
    params_digest.digest({"w": jnp.ones(2), "step": "seven"})


def test_a_fresh_run_digests_its_start_and_a_resumed_one_keeps_its_record():
  teacher, student = _tree(), {"w": jnp.ones((2, 2))}
  fresh = run_history.start_digests(teacher, student, None, "ckpt")
  assert fresh == {
    "teacher": params_digest.digest(teacher),
    "student": params_digest.digest(student),
  }
  trained = {"w": jnp.full((2, 2), 2.0)}  # what a resumption restores
  assert run_history.start_digests(teacher, trained, fresh, "ckpt") == fresh
  # Checkpoints that predate the record: the student it started from is unknown.
  assert run_history.start_digests(teacher, trained, {}, "ckpt")["student"] is None
  other = {**teacher, "mask": jnp.asarray([True, True, True])}
  with pytest.raises(ValueError, match=r"checkpoints in ckpt were trained under teacher"):
    run_history.start_digests(other, trained, fresh, "ckpt")
