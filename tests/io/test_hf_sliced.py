"""hf.load_checkpoint reads only the slices a process's devices hold.

`hf._read_block` is checked against the tensor read whole and converted, for slices of
every dimension; a 2-process CPU job (tests/io/_hf_sliced_check.py) shows each process reads
about half of the checkpoint when fsdp = 2 spans the two processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors

from opd_jax.io import hf, hf_layout
from opd_jax.model import sharding


def _specs_and_tensors(ckpt):
  cfg = hf.load_config(ckpt.path)
  weight_map, _ = hf._weight_map(str(ckpt.path))
  return cfg, weight_map


def _index_variants(shape, rng):
  """Slices of ours: whole, halves of each dimension, and a random box (inner dims too)."""
  full = tuple(slice(None) for _ in shape)
  out = [full]
  for d, n in enumerate(shape):
    if n >= 2:
      out.append(full[:d] + (slice(n // 2, n),) + full[d + 1 :])
  box = []
  for n in shape:
    lo = int(rng.integers(0, n))
    box.append(slice(lo, int(rng.integers(lo + 1, n + 1))))
  out.append(tuple(box))
  return out


@pytest.mark.parametrize("model_type, overrides", [("qwen2", {}), ("qwen3", {"head_dim": 16})])
def test_read_block_equals_the_slice_of_the_whole_tensor(make_hf_checkpoint, model_type, overrides):
  ckpt = make_hf_checkpoint(model_type, **overrides)
  cfg, weight_map = _specs_and_tensors(ckpt)
  rng = np.random.default_rng(0)
  checked = 0
  for spec in hf_layout.tensor_specs(cfg):
    with safetensors.safe_open(weight_map[spec.hf_name], framework="numpy") as fh:
      whole = spec.to_ours(fh.get_tensor(spec.hf_name))
      for index in _index_variants(spec.shape, rng):
        hf.reset_bytes_read()
        block = hf._read_block(fh, spec, index, np.float32)
        np.testing.assert_array_equal(block, whole[index], err_msg=f"{spec.path} {index}")
        # A split of the leading dimension (what the rules produce) reads exactly the slice.
        if all(s == slice(None) for s in index[1:]):
          assert hf.bytes_read() == whole[index].nbytes, (spec.path, index)
        assert hf.bytes_read() >= whole[index].nbytes
        checked += 1
  assert checked > 50


def test_a_split_of_our_second_axis_reads_only_its_rows_of_the_hf_matrix(make_hf_checkpoint):
  """q_dnh [D, N, H] from HF [N·H, D]: heads 2..3 of 4 are HF rows 2H..4H, all D columns."""
  ckpt = make_hf_checkpoint("qwen3")
  cfg, weight_map = _specs_and_tensors(ckpt)
  spec = next(s for s in hf_layout.tensor_specs(cfg) if s.path == "layers/0/q_dnh")
  d, n, h = spec.shape
  with safetensors.safe_open(weight_map[spec.hf_name], framework="numpy") as fh:
    hf.reset_bytes_read()
    block = hf._read_block(fh, spec, (slice(None), slice(n // 2, n), slice(None)), np.float32)
    hf_rows = fh.get_tensor(spec.hf_name)[(n // 2) * h : n * h]
  np.testing.assert_array_equal(block, hf_rows.T.reshape(d, n - n // 2, h))
  assert hf.bytes_read() == hf_rows.nbytes == d * (n - n // 2) * h * 4


def test_sharded_load_equals_plain_load_and_reads_each_tensor_once(make_hf_checkpoint):
  ckpt = make_hf_checkpoint("qwen2")
  mesh = sharding.make_mesh((1, 1, 1))
  hf.reset_bytes_read()
  cfg, plain = hf.load_checkpoint(ckpt.path)
  plain_bytes = hf.bytes_read()
  hf.reset_bytes_read()
  _, placed = hf.load_checkpoint(
    ckpt.path, shardings=lambda c: sharding.tree_shardings(plain, mesh)
  )
  specs = hf_layout.tensor_specs(cfg)
  assert hf.bytes_read() == plain_bytes == sum(int(np.prod(s.shape)) * 4 for s in specs)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(placed), strict=True):
    np.testing.assert_array_equal(a, b)
  assert (
    placed["layers"][0]["q_dnh"].sharding.spec
    == sharding.tree_shardings(plain, mesh)["layers"][0]["q_dnh"].spec
  )


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_each_read_about_half_of_the_checkpoint(make_hf_checkpoint):
  ckpt = make_hf_checkpoint("qwen3", hidden_size=64, intermediate_size=128)
  script = Path(__file__).with_name("_hf_sliced_check.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, str(script), str(ckpt.path), str(i), str(port)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  results = []
  for proc in procs:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    results.append(json.loads(out.strip().splitlines()[-1]))
  assert sorted(r["process"] for r in results) == [0, 1]
  total = results[0]["checkpoint_bytes"]
  for r in results:
    assert r["processes"] == 2 and r["equal"]
    # Exactly the distinct slices its device holds: every matrix is split over fsdp = 2
    # and only the norms (replicated) are read whole by both processes.
    assert r["bytes_read"] == r["held_bytes"]
    assert 0.5 <= r["bytes_read"] / total < 0.51, (r["bytes_read"], total)
    assert r["q_shard"] == [32, 4, 16]  # D = 64 split over fsdp, 4 heads, H = 16
