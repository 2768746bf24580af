"""Screening another engine from its samples: the three file shapes on hand-written files, the
inputs the estimate cannot read, k3 and its interval on hand-computed values, the scorer against
the project's own sampler, and one run of `python -m opd_jax.admit` on the tiny config."""

from __future__ import annotations

import json
import math
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
from opd_jax.io import engine_samples as samples_io
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import engine_screen
from opd_jax.mismatch import measure as measure_lib
from opd_jax.model import kvcache
from opd_jax.model import transformer as model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
  {"prompt_id": "calib-00000", "prompt_token_ids": [1, 4, 6]},
  {"prompt_id": "calib-00001", "prompt_token_ids": [1, 9]},
]
LN2 = math.log(2.0)


def _write(tmp_path, name, values, array=False):
  path = tmp_path / name
  text = json.dumps(values) if array else "\n".join(json.dumps(v) for v in values)
  path.write_text(text + "\n")
  return str(path)


def _lp(value, rank=1, text="x"):
  return {"logprob": value, "rank": rank, "decoded_token": text}


VLLM = {
  "request_id": "calib-00000",
  "prompt_token_ids": [1, 4, 6],
  "outputs": [
    {
      "index": 0,
      "text": "ab",
      "token_ids": [7, 2],
      "cumulative_logprob": -0.9,
      "logprobs": [{"7": _lp(-0.5), "8": _lp(-1.5, 2)}, {"2": _lp(-0.4)}],
      "finish_reason": "stop",
    },
    {
      "index": 1,
      "text": "c",
      "token_ids": [8],
      "logprobs": [{"8": _lp(-1.5, 2), "7": _lp(-0.5, 1)}],
    },
  ],
  "finished": True,
}
SGLANG = {
  "text": "ab",
  "meta_info": {
    "id": "calib-00001",
    "output_token_logprobs": [[-0.25, 7, "a"], [-0.75, 2, None]],
    "output_top_logprobs": [[[-0.25, 7, "a"], [-2.0, 8, "b"]], [[-0.75, 2, None]]],
  },
}
PLAIN = {
  "prompt_id": "calib-00001",
  "completion_token_ids": [5, 2],
  "completion_logprobs": [-1.0, -0.1],
  "temperature": 1.0,
}


def test_each_shape_is_read_with_its_tokens_logprobs_and_prompt(tmp_path):
  path = _write(tmp_path, "mixed.jsonl", [VLLM, SGLANG, PLAIN])
  got = samples_io.read_engine_samples(path)
  assert [c.prompt_id for c in got] == ["calib-00000", "calib-00000", "calib-00001", "calib-00001"]
  assert [c.token_ids.tolist() for c in got] == [[7, 2], [8], [7, 2], [5, 2]]
  assert [c.logprobs.tolist() for c in got] == [[-0.5, -0.4], [-1.5], [-0.25, -0.75], [-1.0, -0.1]]
  assert got[0].prompt_token_ids == (1, 4, 6) and got[2].prompt_token_ids is None
  assert got[3].sampling == {"temperature": 1.0}
  # One JSON array, a named format, and SGLang's batch (a list on one line) read the same.
  array = samples_io.read_engine_samples(_write(tmp_path, "a.json", [VLLM], array=True), "vllm")
  assert [c.token_ids.tolist() for c in array] == [[7, 2], [8]]
  batch = samples_io.read_engine_samples(_write(tmp_path, "b.jsonl", [[SGLANG, SGLANG], [PLAIN]]))
  assert len(batch) == 3 and batch[1].where.endswith("b.jsonl:1 [1]")


@pytest.mark.parametrize(
  "record, words",
  [
    ({**PLAIN, "completion_logprobs": None}, "missing log-probabilities"),
    ({**PLAIN, "completion_logprobs": [-1.0]}, "missing log-probabilities"),
    ({**PLAIN, "completion_logprobs": [float("nan"), -0.1]}, "NaN"),
    ({**PLAIN, "completion_logprobs": [float("-inf"), -0.1]}, "-inf"),
    ({**PLAIN, "completion_logprobs": [0.5, -0.1]}, "no log-probability"),
    ({**PLAIN, "completion_token_ids": []}, "no tokens"),
    ({**VLLM, "outputs": [{**VLLM["outputs"][0], "logprobs": None}]}, "SamplingParams(logprobs=0)"),
    (  # top-p renormalised: the filtered alternative is -inf
      {**VLLM, "outputs": [{"token_ids": [7], "logprobs": [{"7": _lp(0.0), "8": _lp(-math.inf)}]}]},
      "filtered the distribution",
    ),
    (  # renormalised over a kept set: the alternatives sum to 0.75 + 0.5 > 1
      {
        **VLLM,
        "outputs": [{"token_ids": [7], "logprobs": [{"7": _lp(math.log(0.75)), "8": _lp(-LN2)}]}],
      },
      "sum to 1.25",
    ),
    (
      {
        "meta_info": {
          "output_token_logprobs": [[-0.25, 7, None]],
          "output_top_logprobs": [[[-0.5, 7, None]]],
        }
      },
      "disagrees",
    ),
    ({"meta_info": {"id": "x"}}, "return_logprob=True"),
    ({"choices": []}, "none of the known shapes"),
    ({"meta_info": {"output_token_logprobs": [[-0.25]]}}, "must be [logprob, token_id, text]"),
    (  # alternatives for one position of two: they cannot be matched to the tokens
      {
        "meta_info": {
          "output_token_logprobs": [[-0.25, 7, None], [-0.1, 2, None]],
          "output_top_logprobs": [[[-0.25, 7, None]]],
        }
      },
      "1 positions but the completion 2 tokens",
    ),
    ({**PLAIN, "sampling_params": [0.7]}, "'sampling_params' must be an object"),
    ({**VLLM, "outputs": [{"logprobs": []}]}, "not a vllm record (KeyError"),
  ],
)
def test_what_the_estimate_cannot_read_is_refused_when_read(tmp_path, record, words):
  path = _write(tmp_path, "bad.jsonl", [record])
  with pytest.raises(ValueError, match="bad.jsonl:1") as e:
    samples_io.read_engine_samples(path)
  assert words in str(e.value)


def test_a_raw_unicode_line_separator_inside_a_string_is_not_a_line_break(tmp_path):
  """JSON writers with ensure_ascii=False leave U+2028/U+2029/U+0085 raw inside strings."""
  records = [
    {**PLAIN, "text": "a\u2028b\u0085c"},
    {**VLLM, "outputs": [{**VLLM["outputs"][0], "text": "x\u2029y"}]},
  ]
  path = tmp_path / "raw.jsonl"
  path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\r\n")
  assert "\u2028" in path.read_text()
  read = samples_io.read_engine_samples(str(path))
  assert [c.where.rsplit(":", 1)[1].split()[0] for c in read] == ["1", "2"]


def _check(completions, **kw):
  args = dict(vocab_size=32, temperature=1.0, max_new_tokens=4, stop_tokens=(2,))
  return engine_screen.check_samples(completions, PROMPTS, **{**args, **kw})


def _plain(tmp_path, **changes):
  return samples_io.read_engine_samples(_write(tmp_path, "s.jsonl", [{**PLAIN, **changes}]))


@pytest.mark.parametrize(
  "changes, kw, words",
  [
    ({"completion_token_ids": [40, 2]}, {}, "outside the vocabulary [0, 32)"),
    ({"prompt_id": "other"}, {}, "prompts not matching the exported ones"),
    ({"prompt_token_ids": [1, 8]}, {}, "prompts not matching the exported ones"),
    ({"prompt_id": None}, {}, "names no prompt"),
    ({"temperature": 0.7}, {}, "temperature mismatch"),
    ({"temperature": None}, {}, "do not say which temperature"),
    ({"temperature": 1.0}, {"engine_temperature": 0.5}, "temperature mismatch"),
    ({"sampling_params": {"top_p": 0.9}}, {}, "top_p=0.9"),
    ({"top_k": 20}, {}, "top_k=20"),
    ({"min_p": 0.05}, {}, "min_p=0.05"),
    (
      {"completion_token_ids": [5, 5, 5, 5, 2], "completion_logprobs": [-1.0] * 5},
      {},
      "max_tokens",
    ),
    ({"completion_token_ids": [2, 5], "completion_logprobs": [-1.0] * 2}, {}, "past the stop"),
    ({}, {"temperature": 0.0}, "greedy"),
  ],
)
def test_samples_that_do_not_match_the_check_are_refused(tmp_path, changes, kw, words):
  with pytest.raises(ValueError) as e:
    _check(_plain(tmp_path, **changes), **kw)
  assert words in str(e.value)


def test_prompts_match_by_id_or_by_token_ids_and_the_flag_gives_the_temperature(tmp_path):
  by_tokens = _plain(tmp_path, prompt_id=None, prompt_token_ids=[1, 4, 6], temperature=None)
  matched = _check(by_tokens, engine_temperature=1.0)
  assert matched.prompt_index.tolist() == [0] and matched.temperature == 1.0
  assert _check(_plain(tmp_path)).prompt_index.tolist() == [1]


def test_k3_on_hand_computed_values():
  # ρ = ln π_θ − ln π_engine: ln 2 → 2 − 1 − ln 2; −ln 2 → 1/2 − 1 + ln 2; 0 → 0.
  trainer = [np.log([0.5, 0.25]), np.log([0.3])]
  engine = [np.log([0.25, 0.5]), np.log([0.3])]
  np.testing.assert_allclose(engine_screen.k3(trainer[0], engine[0]), [1 - LN2, LN2 - 0.5])
  est = engine_screen.estimate_kl(trainer, engine, num_bootstrap=200)
  assert est["mismatch/kl"] == pytest.approx((1 - LN2 + LN2 - 0.5 + 0.0) / 3, rel=1e-12)
  assert est["mismatch/k1"] == pytest.approx(0.0, abs=1e-12)
  assert est["mismatch/abs_logp_diff"] == pytest.approx(2 * LN2 / 3, rel=1e-12)
  assert (est["measure/completions"], est["measure/tokens"]) == (2, 3)
  with pytest.raises(ValueError, match="overflows"):
    engine_screen.estimate_kl([np.array([-0.1]), np.array([-0.2])], [np.array([-900.0])] * 2)
  # float64: a ρ of 1e-9 gives k3 = ρ²/2 to the last digit, not 0 (exp(ρ) − 1 − ρ in f32 is 0).
  assert engine_screen.k3([1e-9], [0.0])[0] == pytest.approx(5e-19, rel=1e-6)


def test_the_interval_resamples_completions():
  # Equal per-completion means: every resample gives the same token mean, for both methods.
  for method in engine_screen.METHODS:
    low, high = engine_screen.bootstrap_interval([2.0, 4.0, 6.0], [1, 2, 3], method=method)
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)
  sums, counts = np.arange(1.0, 41.0), np.ones(40)
  for method in engine_screen.METHODS:
    low, high = engine_screen.bootstrap_interval(sums, counts, method=method, seed=3)
    assert low < 20.5 < high and high - low == pytest.approx(2 * 1.96 * 11.54 / 40**0.5, rel=0.2)
  # Two completions of one prompt move together: grouped by prompt, equal per-prompt means.
  lps = [np.log([0.5]), np.log([0.5]), np.log([0.25]), np.log([0.25])]
  grouped = engine_screen.estimate_kl(lps, [np.log([0.25])] * 4, groups=[0, 1, 1, 0])
  assert grouped["mismatch/kl_low"] == pytest.approx(grouped["mismatch/kl_high"])
  assert grouped["measure/prompts"] == 2 and grouped["measure/completions"] == 4
  with pytest.raises(ValueError, match="at least 2 prompts"):
    engine_screen.bootstrap_interval([1.0], [1])
  with pytest.raises(ValueError, match="unknown interval method"):
    engine_screen.bootstrap_interval([1.0, 2.0], [1, 1], method="t")


def test_an_interval_that_holds_the_limit_is_too_close():
  budget = budget_lib.uncalibrated_budget()
  limit = budget_lib.UNCALIBRATED_MAX_KL
  near = {"mismatch/kl": limit * 0.9, "mismatch/kl_low": limit * 0.5, "mismatch/kl_high": limit * 2}
  _, verdict, straddles = engine_screen.screen_verdict(near, budget)
  assert verdict.admitted and straddles
  far = {"mismatch/kl": limit / 10, "mismatch/kl_low": limit / 20, "mismatch/kl_high": limit / 5}
  _, verdict, straddles = engine_screen.screen_verdict(far, budget)
  assert verdict.admitted and not straddles and verdict.margin == pytest.approx(limit * 0.9)


def test_the_scorer_reads_the_samplers_own_logprobs_back():
  """An engine identical to the trainer: the teacher-forced log-probabilities of its samples
  equal the sampler's (cached decode against the uncached forward, f32 rounding), so k3 ≈ 0
  (engines that differ: `python -m opd_jax.bench.engine_samples`)."""
  cfg = tiny_model_cfg(vocab_size=64)
  params = model.init_params(jax.random.key(0), cfg, scale=0.3)
  prompts = [[3, 17, 9, 4, 10], [20, 21, 22], [7], [5] * 9, [8, 9], [11, 3, 4], [6] * 4, [30]]
  scfg = SamplerConfig(max_new_tokens=8, return_topk=-1)
  engine = transform.EngineConfig(kv=kvcache.KVCacheSpec(dtype="float32"))
  rollout = measure_lib.engine_rollout(params, cfg, engine, prompts, jax.random.key(1), scfg)
  tokens, mask = np.asarray(rollout.completion_tokens), np.asarray(rollout.completion_mask)
  logp = np.asarray(rollout.behaviour_logprobs)
  exported = [{"prompt_id": str(i), "prompt_token_ids": p} for i, p in enumerate(prompts)]
  comps = [
    samples_io.EngineCompletion(
      str(i), None, tokens[i, : mask[i].sum()], logp[i, : mask[i].sum()].astype(float), {}, "x"
    )
    for i in range(len(prompts))
  ]
  matched = engine_screen.check_samples(
    comps, exported, vocab_size=64, temperature=1.0, max_new_tokens=8, engine_temperature=1.0
  )
  width = max(len(p) for p in prompts)
  tokens_np = np.array([p + [0] * (width - len(p)) for p in prompts])
  lens = np.array([len(p) for p in prompts])
  trainer = engine_screen.score_samples(params, cfg, tokens_np, lens, matched, 8)
  for t, c in zip(trainer, comps, strict=True):
    np.testing.assert_allclose(t, c.logprobs, atol=1e-4)
  est = engine_screen.estimate_kl(trainer, [c.logprobs for c in comps], num_bootstrap=200)
  assert est["mismatch/kl"] < 1e-8 and est["measure/tokens"] == int(mask.sum())


def _admit(*args, cwd):
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  return subprocess.run(
    [sys.executable, "-m", "opd_jax.admit", "--config=configs/bf16_sync.py:tiny", *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_export_then_screen_on_the_command_line(tmp_path):
  """--export-prompts, samples written against it, --engine-samples: the row has the check's
  columns and the interval, the exit status follows the verdict, a mismatch exits 2."""
  prompts = tmp_path / "prompts.jsonl"
  done = _admit(f"--export-prompts={prompts}", "--prompts=3", cwd=ROOT)
  assert done.returncode == 0, done.stderr
  exported = samples_io.read_prompts(str(prompts))
  assert [p["prompt_id"] for p in exported] == ["calib-00000", "calib-00001", "calib-00002"]
  sampling = exported[0]["sampling_params"]
  assert (sampling["top_k"], sampling["top_p"], sampling["temperature"]) == (0, 1.0, 1.0)
  stop = sampling["stop_token_ids"][0]
  records = [
    {
      "prompt_id": p["prompt_id"],
      "completion_token_ids": [5 + i, 6, stop],
      "completion_logprobs": [-2.0, -2.5, -1.0],
      "temperature": 1.0,
    }
    for i, p in enumerate(exported)
  ]
  samples = _write(tmp_path, "samples.jsonl", records)
  work = str(tmp_path / "work")
  cache = f"--config.teacher.cache_dir={tmp_path / 'teacher'}"
  done = _admit(
    f"--engine-samples={samples}", "--prompts=3", f"--workdir={work}", cache, "--json", cwd=ROOT
  )
  assert done.returncode in (0, 1), done.stderr
  result = json.loads(done.stdout)
  row = result["rows"][0]
  assert row["estimator"] == "k3" and row["engine_id"] == "external"
  assert row["mismatch/kl_low"] <= row["mismatch/kl"] <= row["mismatch/kl_high"]
  assert (row["measure/completions"], row["measure/tokens"]) == (3, 9)
  assert row["budget"] == "uncalibrated default" and row["max_kl"] == 0.033
  assert row["call"] in ("too close", "uncalibrated")
  assert done.returncode == (0 if row["admitted"] else 1)
  assert "k3_kl" in done.stderr and "kl_low" in done.stderr
  assert os.path.exists(os.path.join(work, "admission_log.jsonl"))
  hot = _write(tmp_path, "hot.jsonl", [{**r, "temperature": 0.7} for r in records])
  done = _admit(f"--engine-samples={hot}", "--prompts=3", f"--workdir={work}", cache, cwd=ROOT)
  assert done.returncode == 2 and "temperature mismatch" in done.stderr
