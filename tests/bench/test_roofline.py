"""bench.roofline's hand counts against values worked out by hand on tiny shapes, and the train
row's hand FLOP count 8·W·B·(P + C) against XLA's cost analysis of the compiled step."""

from __future__ import annotations

import pytest

from opd_jax.bench import roofline
from opd_jax.model.config import ModelConfig

# V 10, D 4, F 6, L 2, N 2, K 1, H 3, Qwen3's q/k norms.
SMALL = ModelConfig("qwen3", 10, 4, 6, 2, 2, 1, 3, qk_norm=True)
PEAK = {"matmul_flops_per_s": {"float32": 1e12}, "copy_bytes_per_s": 1e11}  # any positive peak


def test_matmul_params_by_hand():
  # Per layer: q D·N·H 24, k and v D·K·H 12 each, o N·H·D 24, SwiGLU 3·D·F 72 = 144;
  # two layers 288, plus the unembedding V·D 40.
  assert roofline.matmul_params(SMALL) == 328


@pytest.mark.parametrize("tied", [False, True])
def test_decode_counts_by_hand(tied):
  import dataclasses

  cfg = dataclasses.replace(SMALL, tie_word_embeddings=tied)
  counts = roofline.decode_counts(cfg, itemsize=2, batch=3, context=5.5)
  # Weights read once per step: per layer 144 matmul + q/k norms 2·H 6 + two norms 2·D 8 = 158,
  # two layers 316, the final norm 4, the unembedding 40 (the embedding lookup is not
  # counted; tied or not, the one V·D matrix read is the unembedding): 360 params of 2 bytes.
  assert counts["weight_bytes"] == 720
  # K and V of the filled prefix: B·c̄·2·L·K·H·itemsize = 3 · 5.5 · 2·2·1·3·2.
  assert counts["kv_bytes"] == pytest.approx(396.0)
  assert counts["bytes"] == pytest.approx(1116.0)
  # B·(2·W + 4·L·N·H·c̄) = 3 · (656 + 4·2·2·3·5.5) = 3 · (656 + 264).
  assert counts["flops"] == pytest.approx(2760.0)


def test_train_row_hand_flops_and_xla_cost_analysis():
  """The "tiny" shape: W = 2·(2·32·4·8 + 2·32·2·8 + 3·32·64) + 128·32 = 22528; B 2, P + C 8."""
  row = roofline.train_row("tiny", "float32", 2, 4, 4, repeats=1, peak=PEAK)
  assert roofline.matmul_params(roofline.MODELS["tiny"]) == 22528
  assert row["tokens"] == 16 and row["hand_flops"] == 8 * 22528 * 16 == 2_883_584
  # XLA adds the attention scores and the elementwise work (1.31x the hand count on jax 0.10
  # at this shape, 1.11x at qwen3-50m) and skips the first layer's input gradient.
  assert 0.9 < row["flops"] / row["hand_flops"] < 1.6, row["flops"]
  assert row["flops_per_s"] > 0 and row["fraction_of_peak"] == row["flops_per_s"] / 1e12


def test_slots_read_per_path():
  assert roofline.slots_read(10, 104, "reference") == 104
  assert roofline.slots_read(10, 104, "blockwise") == 104  # one block holds the whole cache
  assert roofline.slots_read(1000, 4096, "blockwise") == 1024
  assert roofline.slots_read(299, 300, "blockwise") == 512  # the last block overlaps


def test_decode_row_counts_the_slots_the_attention_reads():
  """ "tiny" (untied): weights 2·(9216 + 16 + 64) + 32 + 4096 = 22720 f32 params; batch 1 with
  a cache of P + C₂ = 10 slots, which one block holds: every step reads all 10."""
  row = roofline.decode_row("tiny", "float32", 1, 4, (2, 6), repeats=1, peak=PEAK)
  assert row["mean_context"] == 10
  assert row["weight_bytes"] == 22720 * 4
  assert row["kv_bytes"] == pytest.approx(10 * 2 * 2 * 2 * 8 * 4)  # 2560
  assert row["flops"] == pytest.approx(2 * 22528 + 4 * 2 * 4 * 8 * 10)  # 47616
  assert row["matvec_chain_seconds"] > 0
  assert row["fused_chain_over_matvec_chain"] == pytest.approx(
    row["fused_chain_seconds"] / row["matvec_chain_seconds"]
  )
  assert "error" in row or row["step_over_matvec_chain"] > 0  # no ratio when the step drowned


@pytest.mark.parametrize("tied", [False, True])
def test_decode_matrices_are_the_matmul_weights(tied):
  """The chain of dots reads exactly the W of `matmul_params`: every projection of every layer
  and the head, tied or not."""
  import dataclasses

  import jax

  from opd_jax.model import transformer as model

  cfg = dataclasses.replace(SMALL, tie_word_embeddings=tied)
  params = model.init_params(jax.random.key(0), cfg)
  matrices = roofline.decode_matrices(params)
  assert len(matrices) == 2 * 7 + 1 and all(m.ndim == 2 for m in matrices)
  assert sum(m.size for m in matrices) == roofline.matmul_params(cfg) == 328
  assert matrices[3].shape == (2 * 3, 4)  # o [N·H, D]
  assert matrices[-1].shape == ((10, 4) if tied else (4, 10))
  assert roofline.matvec_chain_seconds(params, repeats=1, passes=2) > 0
  # The batched chain multiplies x [B, in] (and W·xᵀ for a tied head) through the same W.
  last = matrices[-1].shape
  assert roofline.dot_chain_seconds(matrices, 1, 2, last_transposed=tied, batch=3) > 0
  assert last == ((10, 4) if tied else (4, 10))


@pytest.mark.parametrize("tied", [False, True])
def test_fused_matrices_join_the_projections_that_share_an_input(tied):
  """q|k|v and gate|up, joined along their outputs: the same products in 4 dots per layer."""
  import dataclasses

  import jax
  import numpy as np

  from opd_jax.model import transformer as model

  cfg = dataclasses.replace(SMALL, tie_word_embeddings=tied)
  params = model.init_params(jax.random.key(0), cfg)
  unfused, fused = roofline.decode_matrices(params), roofline.fused_decode_matrices(params)
  assert [m.shape for m in fused[:4]] == [(4, 6 + 3 + 3), (6, 4), (4, 12), (6, 4)]
  assert len(fused) == 2 * 4 + 1 and fused[-1] is unfused[-1]
  assert sum(m.size for m in fused) == sum(m.size for m in unfused)
  x = np.arange(4, dtype=np.float32)
  layer1 = unfused[7:14]
  joined = np.concatenate([x @ np.asarray(layer1[i]) for i in (0, 1, 2)])
  np.testing.assert_allclose(x @ np.asarray(fused[4]), joined, rtol=1e-6)  # layer 1's q|k|v
  gate_up = np.concatenate([x @ np.asarray(layer1[4]), x @ np.asarray(layer1[5])])
  np.testing.assert_allclose(x @ np.asarray(fused[6]), gate_up, rtol=1e-6)


def test_a_batched_decode_row_is_set_against_its_own_chain_of_dots():
  row = roofline.decode_row("tiny", "float32", 4, 4, (2, 6), repeats=1, peak=PEAK)
  assert row["dot_chain_seconds"] > 0 and "matvec_chain_seconds" not in row
  assert "error" in row or row["step_over_dot_chain"] > 0
