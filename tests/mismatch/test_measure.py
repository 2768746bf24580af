"""The shared mismatch measurement: an exact engine reads 0, real sources read more, repeatably."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_model_cfg

from opd_jax.inference import transform
from opd_jax.inference.sampler import SamplerConfig
from opd_jax.io import compile_cache
from opd_jax.mismatch import measure as measure_lib
from opd_jax.model import kvcache
from opd_jax.model import transformer as model

CFG = tiny_model_cfg(vocab_size=64)
PROMPTS = [[3, 17, 9, 4, 10], list(range(20, 31)), [7], [5] * 9]
F32_KV = kvcache.KVCacheSpec(dtype="float32")
EXACT = transform.EngineConfig(kv=F32_KV)
FP8 = transform.EngineConfig(weights="fp8", kv=F32_KV)
NOISE = transform.EngineConfig(noise_sigma=0.1, kv=F32_KV)
SCFG = SamplerConfig(max_new_tokens=12)
TIMING_KEYS = ("measure/compile_seconds", "measure/run_seconds", "measure/seconds")


@pytest.fixture(scope="module")
def params():
  return model.init_params(jax.random.key(0), CFG, scale=0.3)


def _measure(params, engine_cfg, scfg=SCFG, seed=0, **kw):
  return measure_lib.measure(params, CFG, engine_cfg, PROMPTS, jax.random.key(seed), scfg, **kw)


@pytest.mark.parametrize(
  "scfg",
  [
    SamplerConfig(max_new_tokens=12),
    SamplerConfig(max_new_tokens=12, temperature=0.7, top_k=5),
    SamplerConfig(max_new_tokens=12, temperature=0.0),
  ],
  ids=["T1", "T0.7-top5", "greedy"],
)
def test_exact_engine_reads_zero(params, scfg):
  m = _measure(params, EXACT, scfg)
  assert m["measure/tokens"] == 4 * 12
  assert m["engine_id"] == "w=trainer,kv=float32,noise=0"
  for name in ("mismatch/kl", "mismatch/kl_max", "mismatch/k3"):
    assert abs(m[name]) < 1e-6, (name, m[name])
  assert m["mismatch/abs_logp_diff_max"] < 1e-4


def test_fp8_reads_above_zero_and_below_noise(params):
  exact, fp8, noise = (_measure(params, e)["mismatch/kl"] for e in (EXACT, FP8, NOISE))
  assert exact < 1e-6
  assert 1e-5 < fp8 < noise, (fp8, noise)


def test_deterministic_for_a_fixed_key(params):
  first = _measure(params, NOISE, return_per_token=True)
  second = _measure(params, NOISE, return_per_token=True)
  other = _measure(params, NOISE, seed=1)
  np.testing.assert_array_equal(
    first.pop(measure_lib.PER_TOKEN_KEY), second.pop(measure_lib.PER_TOKEN_KEY)
  )
  for key in TIMING_KEYS:
    first.pop(key), second.pop(key), other.pop(key)
  assert first == second
  assert other["mismatch/kl"] != first["mismatch/kl"]


def test_per_token_kl_matches_the_mean_and_tail(params):
  m = _measure(params, FP8, return_per_token=True)
  kl_n = m[measure_lib.PER_TOKEN_KEY]
  assert kl_n.shape == (int(m["measure/tokens"]),)
  np.testing.assert_allclose(kl_n.mean(), m["mismatch/kl"], rtol=1e-5)
  np.testing.assert_allclose(np.quantile(kl_n, 0.95), m["mismatch/kl_p95"], rtol=1e-5)
  np.testing.assert_allclose(kl_n.max(), m["mismatch/kl_max"], rtol=1e-6)


def test_stale_trainer_params_read_above_zero(params):
  newer = jax.tree.map(lambda w: w * 1.05, params)
  assert _measure(params, EXACT, trainer_params=newer)["mismatch/kl"] > 1e-4


@pytest.mark.parametrize("engine_cfg", [FP8, NOISE], ids=["fp8", "noise"])
def test_measure_equals_the_rollout_scored_separately(params, engine_cfg):
  """`measure`'s three compiled programs give what the plain path gives: the engine's rollout
  from `sampler.sample` (`engine_rollout`), scored by `score_rollout`."""
  rng = jax.random.key(3)
  m = measure_lib.measure(params, CFG, engine_cfg, PROMPTS, rng, SCFG, return_per_token=True)
  rollout = measure_lib.engine_rollout(params, CFG, engine_cfg, PROMPTS, rng, SCFG)
  metrics, kl_bc = measure_lib.score_rollout(
    params, rollout.replace(engine_id=""), CFG, SCFG.temperature
  )
  mask_bc = np.asarray(rollout.completion_mask) > 0
  assert m["measure/tokens"] == mask_bc.sum()
  for name, value in metrics.items():
    np.testing.assert_allclose(m[name], float(value), rtol=1e-6, atol=1e-9, err_msg=name)
  np.testing.assert_allclose(m[measure_lib.PER_TOKEN_KEY], np.asarray(kl_bc)[mask_bc], rtol=1e-6)


def test_programs_compiled_from_shapes_serve_the_measurement(params):
  """`start_compiling` on the params' shapes compiles everything `measure` then runs on the
  arrays: the measurement itself compiles nothing, and its result is the usual one."""
  scfg = SamplerConfig(max_new_tokens=7)  # programs no other test compiles
  shapes = jax.eval_shape(lambda p: p, params)
  stale = jax.tree.map(lambda w: w * 1.01, params)
  programs, inputs = measure_lib.start_compiling(
    shapes, CFG, FP8, PROMPTS, jax.random.key(5), scfg, trainer_params=shapes
  ).result()
  assert len(programs) == 3 and all(isinstance(p, jax.stages.Compiled) for p in programs)
  assert inputs[0].shape == (4, 16)  # 4 prompts, padded to the smallest prompt bucket
  compiles = []

  def listen(event, seconds, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(kw.get("fun_name"))

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    m = measure_lib.measure(
      params, CFG, FP8, PROMPTS, jax.random.key(5), scfg, trainer_params=stale
    )
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiles == []
  assert m["measure/tokens"] == 4 * 7 and m["mismatch/kl"] > 1e-5


def test_bad_arguments_are_named(params):
  with pytest.raises(ValueError, match="engine_cfg"):
    measure_lib.measure(params, CFG, "fp8", PROMPTS, jax.random.key(0), SamplerConfig(4))
  with pytest.raises(ValueError, match="sampler_cfg"):
    measure_lib.measure(params, CFG, EXACT, PROMPTS, jax.random.key(0), {"max_new_tokens": 4})


FAST_COMPILE_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
from opd_jax.io import compile_cache, run_history
from opd_jax.mismatch import admission, candidates as candidates_lib
took = compile_cache.fast_compilation() if sys.argv[1] == "fast" else False
import jax
from conftest import tiny_model_cfg
from opd_jax.inference import transform
from opd_jax.model import kvcache, transformer as model
from opd_jax.mismatch import measure
from opd_jax.inference.sampler import SamplerConfig
cfg = tiny_model_cfg(vocab_size=64)
params = model.init_params(jax.random.key(0), cfg, scale=0.3)
fp8 = transform.EngineConfig(weights="fp8", kv=kvcache.KVCacheSpec(dtype="float8_e4m3fn"))
sampling = SamplerConfig(max_new_tokens=12)
m = measure.measure(params, cfg, fp8, {prompts!r}, jax.random.key(0), sampling)
print(json.dumps({{"took": took, "again": compile_cache.fast_compilation(),
                  "xla_flags": os.environ.get("XLA_FLAGS", ""), "kl": m["mismatch/kl"]}}))
"""


def _script_json(script: str, mode: str) -> dict:
  """Runs `script` with argument `mode` in a fresh Python without the session's XLA_FLAGS and
  returns the JSON its last line prints."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
    [sys.executable, "-c", script, mode], capture_output=True, text=True, env=env, timeout=300
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_fast_compilation_changes_machine_code_not_the_measurement(tmp_path):
  """The admission check compiles without XLA backend optimisation (`--fast-compile`): the
  flag must reach XLA (the backend reads it at start, so a second call is refused), and the
  FP8 engine's mismatch/kl must match an optimised build within 1e-4 relative."""
  tests = str(Path(__file__).resolve().parents[1])  # where conftest is
  script = FAST_COMPILE_SCRIPT.format(tests=tests, prompts=PROMPTS)
  fast, optimised = (_script_json(script, mode) for mode in ("fast", "optimised"))
  assert fast["took"] and not fast["again"]  # set once, before the backend started
  assert "--xla_backend_optimization_level=0" in fast["xla_flags"]
  for flag in compile_cache.FAST_COMPILE_CPU_XLA_FLAGS:  # this jaxlib has them all
    assert flag in fast["xla_flags"]
  assert "xla_backend_optimization_level" not in optimised["xla_flags"]
  assert optimised["kl"] > 1e-5  # FP8 weights and KV read a real mismatch
  np.testing.assert_allclose(fast["kl"], optimised["kl"], rtol=1e-4)


def test_only_flags_this_xla_defines_are_added():
  """XLA aborts the process on an unknown XLA_FLAGS entry, so each CPU flag is looked up first."""
  assert compile_cache.xla_knows_flag("--xla_backend_optimization_level=0")
  assert compile_cache.xla_knows_flag("--xla_cpu_use_fusion_emitters=false")
  assert not compile_cache.xla_knows_flag("--xla_cpu_no_such_flag_in_any_release=true")


FORMATS_SCRIPT = """
import json, sys
import ml_dtypes, numpy as np
from opd_jax.io import compile_cache
took = compile_cache.fast_compilation() if sys.argv[1] == "fast" else False
import jax, jax.numpy as jnp
x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32) * 3
differ = {}
for name in ("float4_e2m1fn", "float8_e4m3fn", "float8_e5m2"):
  fmt = jnp.dtype(getattr(ml_dtypes, name))
  got = jax.jit(lambda a, fmt=fmt: (2.0 * a).astype(fmt).astype(jnp.float32))(x)
  differ[name] = int(np.sum(np.asarray(got) != (2.0 * x).astype(fmt).astype(np.float32)))
print(json.dumps({"took": took, "differ": differ}))
"""


@pytest.mark.parametrize("mode", ["fast", "optimised"])
def test_fast_compilation_converts_every_format_bit_for_bit(mode):
  """f32 to FP4/FP8 in a jitted fusion equals ml_dtypes' rounding element for element, with
  and without the fast flags. (XLA's legacy CPU emitters, --xla_cpu_use_fusion_emitters=false,
  once among them, rounded to FP4 twice: 38 of these 65,536 draws differed.)"""
  result = _script_json(FORMATS_SCRIPT, mode)
  assert result["took"] == (mode == "fast")
  assert result["differ"] == {"float4_e2m1fn": 0, "float8_e4m3fn": 0, "float8_e5m2": 0}


def test_fast_compilation_leaves_a_started_backend_alone(params, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
  assert not compile_cache.fast_compilation()  # the suite's backend is up: too late to take effect
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_use_thunk_runtime=true"


def test_a_padded_table_is_measured_over_its_real_vocabulary():
  """The behaviour distribution is chosen from V_real, as the trainer chooses it: 4,160 rows
  (above the 4,096 full-distribution limit) over a 4,000-token vocabulary keep the full,
  exact distribution, where the row count would have picked top-64."""
  cfg = dataclasses.replace(tiny_model_cfg(vocab_size=4160), logical_vocab_size=4000)
  padded = model.init_params(jax.random.key(0), cfg, scale=0.3)
  rollout = measure_lib.engine_rollout(padded, cfg, FP8, PROMPTS, jax.random.key(0), SCFG)
  assert rollout.topk_logprobs.shape == (len(PROMPTS), SCFG.max_new_tokens, 4000)
  np.testing.assert_allclose(np.exp(np.asarray(rollout.topk_logprobs)).sum(-1), 1.0, atol=1e-4)
