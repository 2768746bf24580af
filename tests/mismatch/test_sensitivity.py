"""The layer-sensitivity scan: ranked rows, a recipe that meets its target when re-measured,
clear errors for bad layers and modules, and the command's JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from opd_jax.inference import transform
from opd_jax.inference.sampler import SamplerConfig
from opd_jax.mismatch import measure as measure_lib
from opd_jax.mismatch import sensitivity
from opd_jax.model import kvcache
from opd_jax.model import transformer as model
from opd_jax.model.config import ModelConfig

CFG = ModelConfig(
  model_type="qwen3",
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  num_layers=3,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  qk_norm=True,
)
PROMPTS = [[3, 17, 9, 4, 10], list(range(20, 31)), [7], [5] * 9]
SCFG = SamplerConfig(max_new_tokens=8)
SETTINGS = sensitivity.ScanSettings(modules=("attention", "mlp"), noise_sigma=0.05)
KL = sensitivity.KL_KEY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import bf16_sync  # noqa: E402


@pytest.fixture(scope="module")
def params():
  return model.init_params(jax.random.key(0), CFG, scale=0.3)


@pytest.fixture(scope="module")
def scanned(params):
  return sensitivity.scan(params, CFG, PROMPTS, jax.random.key(0), SCFG, SETTINGS, log=print)


def test_scan_rows_and_ranking(scanned):
  reference, rows = scanned
  assert abs(reference[KL]) < 1e-6
  targets = {(r["source"], r["target"]) for r in rows}
  layers = {f"layer {i}" for i in range(CFG.num_layers)}
  assert {t for s, t in targets if s == "fp8_weights"} == {"all"} | layers
  assert {t for s, t in targets if s == "fp8_kv"} == {"all", "bf16"} | layers
  modules = {f"module {m}" for m in ("q", "k", "v", "o", "gate", "up", "down")}
  assert {t for s, t in targets if s == "noise"} == {"all"} | layers | modules
  assert len(rows) == len(targets)
  for r in rows:
    assert r[KL] > 0 and np.isfinite(r[KL]), r
    assert r["engine_id"] and r["measure/tokens"] == len(PROMPTS) * SCFG.max_new_tokens
  ranks = sensitivity.ranking(rows)
  assert set(ranks) == {"fp8_weights", "fp8_kv", "noise", "noise_modules"}
  for name, ranked in ranks.items():
    kls = [r[KL] for r in ranked]
    assert kls == sorted(kls, reverse=True), name
  assert sorted(r["layer"] for r in ranks["fp8_weights"]) == list(range(CFG.num_layers))
  # Each one-layer row perturbs less than the whole model.
  for source in ("fp8_weights", "noise"):
    whole = next(r[KL] for r in rows if (r["source"], r["target"]) == (source, "all"))
    assert max(r[KL] for r in ranks[source]) < whole
  table = sensitivity.format_table(reference, rows)
  assert len(table.splitlines()) == 2 + 1 + len(rows)
  assert "module gate" in table and "layer 2" in table


def test_suggested_recipe_meets_its_target_when_remeasured(params, scanned):
  _, rows = scanned
  scores = sensitivity.layer_scores(rows)
  assert set(scores) == set(range(CFG.num_layers))
  rng = jax.random.key(0)
  whole = sensitivity.fp8_recipe_engine((), SETTINGS)
  whole_kl = measure_lib.measure(params, CFG, whole, PROMPTS, rng, SCFG)[KL]
  target = 0.5 * whole_kl
  recipe = sensitivity.suggest_recipe(
    params, CFG, PROMPTS, rng, SCFG, scores, target, SETTINGS, seq_len=64
  )
  assert recipe["met"] and recipe[KL] <= target
  assert recipe["path"][0] == {"bf16_layers": [], KL: pytest.approx(whole_kl)}
  # The kept layers are the most sensitive ones, in score order.
  order = sorted(scores, key=lambda i: -scores[i])
  assert recipe["bf16_layers"] == sorted(order[: len(recipe["bf16_layers"])])
  again = measure_lib.measure(
    params, CFG, sensitivity.fp8_recipe_engine(recipe["bf16_layers"], SETTINGS), PROMPTS, rng, SCFG
  )
  assert again[KL] == recipe[KL] <= target
  # Capacity: the bench's own accounting of the recipe's cache against BF16.
  spec = kvcache.KVCacheSpec("float8_e4m3fn", "token_head", tuple(recipe["bf16_layers"]))
  bf16 = kvcache.measure_bytes_per_token(CFG, kvcache.KVCacheSpec("bfloat16"), 64, True)
  fp8 = kvcache.measure_bytes_per_token(CFG, spec, 64, True)
  assert recipe["capacity_ratio"] == pytest.approx(bf16 / fp8)
  assert 1.0 <= recipe["capacity_ratio"] < 2.0


def test_unreachable_target_keeps_every_layer_and_says_so(params):
  scores = {0: 3.0, 1: 1.0, 2: 2.0}
  recipe = sensitivity.suggest_recipe(
    params, CFG, PROMPTS, jax.random.key(0), SCFG, scores, 1e-30, SETTINGS, seq_len=64
  )
  assert not recipe["met"]
  assert [p["bf16_layers"] for p in recipe["path"]] == [[], [0], [0, 2], [0, 1, 2]]


def test_bad_layer_module_or_source_is_named():
  with pytest.raises(ValueError, match=r"layer 5 out of range: the model has 3 layers \(0..2\)"):
    sensitivity.scan_engines(CFG, sensitivity.ScanSettings(layers=(5,)), "float32")
  with pytest.raises(ValueError, match="unknown module 'mlp_up'"):
    sensitivity.ScanSettings(modules=("mlp_up",))
  with pytest.raises(ValueError, match="unknown or no sources"):
    sensitivity.ScanSettings(sources=("fp8",))
  tied = ModelConfig(**{**CFG.__dict__, "tie_word_embeddings": True})
  with pytest.raises(ValueError, match="'lm_head' is not in this model"):
    sensitivity.ScanSettings(modules=("lm_head",)).scanned_modules(tied)
  with pytest.raises(ValueError, match="target_kl must be > 0"):
    sensitivity.suggest_recipe(None, CFG, PROMPTS, None, SCFG, {0: 1.0}, 0.0, SETTINGS)


@pytest.mark.slow
def test_run_sensitivity_writes_the_ranked_json(tmp_path):
  config = bf16_sync.get_config("tiny")
  settings = sensitivity.ScanSettings(modules=None, kv_granularity="tensor")
  out = tmp_path / "sens.json"
  result = sensitivity.run_sensitivity(
    config, num_prompts=4, settings=settings, json_path=str(out), png_path=str(tmp_path / "s.png")
  )
  saved = json.loads(out.read_text())
  assert saved["rows"] == json.loads(json.dumps(result["rows"]))
  assert saved["student"] == "warm-started built-in student"
  assert set(saved["ranking"]) == {"fp8_weights", "fp8_kv", "noise"}
  recipe = saved["recipe"]
  assert recipe["met"] and recipe[KL] <= recipe["target_kl"]
  assert saved["settings"]["kv_granularity"] == "tensor"
  noise_0 = transform.EngineConfig(
    noise_sigma=0.05, noise_layers=(0,), kv=kvcache.KVCacheSpec("float32")
  )
  assert noise_0.engine_id in {r["engine_id"] for r in saved["rows"]}
