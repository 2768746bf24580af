"""The admission check on the tiny config: candidate specs, verdicts, the stale budget, the log.

No calibrated budget exists yet, so the budget here is fitted with `fit_budget` on hand-made
records and saved with the fingerprint of the tiny setup. The records put max_kl at
1e-3 + (0.1 − 0.04)/(0.2 − 0.04)·1e-3 = 1.375e-3 nats/token: well above what an exact engine
reads (f32 rounding, < 1e-6) and far below what weight noise σ = 1 reads on the tiny student
(about 1.6e-2).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import with_rollout

from opd_jax.budget import Rule, fit_budget, save_budget
from opd_jax.cli import admit_check
from opd_jax.config import check as config_check
from opd_jax.inference import transform
from opd_jax.io import compile_cache, run_history
from opd_jax.mismatch import admission
from opd_jax.mismatch import candidates as candidates_lib
from opd_jax.train import setup as setup_lib
from opd_jax.train import trainer
from opd_jax.train.setup import run_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import bf16_sync  # noqa: E402

RECORDS = [
  {"source": "noise", "mismatch/kl": x, "quality_drop": y}
  for x, y in [(0.0, 0.0), (5e-4, 0.0), (1e-3, 0.04), (2e-3, 0.2)]
]
MAX_KL = 1e-3 + (0.1 - 0.04) / (0.2 - 0.04) * 1e-3
EXACT = "rollout.weights=trainer"
NOISE = "rollout.noise_sigma=1.0"
COMBO = "rollout.noise_sigma=1.0,rollout.kv_cache=bf16"  # two sources: noise and bf16_kv
STALE = "rollout.stale_k=2"  # needs a run's checkpoints: unmeasurable without --params-from
PROMPTS = 8


def quiet(*args, **kwargs):
  pass


@pytest.fixture(scope="module")
def config(tmp_path_factory):
  c = bf16_sync.get_config("tiny")
  c.teacher.cache_dir = str(tmp_path_factory.mktemp("teacher_cache"))
  return c


@pytest.fixture(scope="module")
def fingerprint(config, tmp_path_factory):
  """The fingerprint of the tiny setup, built the way the check builds it."""
  setup = setup_lib.prepare_models(run_spec(config), str(tmp_path_factory.mktemp("fp")), quiet)
  return admission.current_fingerprint(setup, admission.initial_student(config, setup, quiet))


def test_the_warm_started_student_is_cached_bit_identical(config, fingerprint, tmp_path):
  setup = setup_lib.prepare_models(run_spec(config), str(tmp_path / "w"), quiet)
  lines = []
  trained = admission.initial_student(config, setup, lines.append, str(tmp_path / "cache"))
  loaded = admission.initial_student(config, setup, lines.append, str(tmp_path / "cache"))
  assert lines[0].startswith("warm-starting the student")
  assert lines[-1].startswith("warm-started student loaded from cache")
  for params in (trained, loaded):
    assert admission.current_fingerprint(setup, params) == fingerprint


@pytest.fixture(scope="module")
def budget_path(fingerprint, tmp_path_factory):
  path = tmp_path_factory.mktemp("budget") / "budget.json"
  fitted = fit_budget(RECORDS, 0.1, num_bootstrap=20)
  save_budget(path, dataclasses.replace(fitted, rule=Rule("per_part")), fingerprint)
  return path


@pytest.fixture(scope="module")
def checked(config, budget_path, tmp_path_factory):
  """One check of the exact, the destructive, a combined and a stale candidate (which cannot be
  measured without a run) under the per_part rule: (result, printed lines, workdir)."""
  workdir = tmp_path_factory.mktemp("admit")
  lines = []
  result = admit_check.run_admission(
    config,
    str(budget_path),
    [EXACT, NOISE, COMBO, STALE],
    num_prompts=PROMPTS,
    workdir=str(workdir),
    json_path=str(workdir / "out.json"),
    log=lambda *a: lines.append(" ".join(str(x) for x in a)),
  )
  return result, lines, workdir


# ---------------------------------------------------------------------------------------------
# Specs


def test_spec_parses_values_as_ml_collections_does(config):
  c = candidates_lib.parse_candidate(
    "rollout.weights=fp8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor", config
  )
  assert c.overrides == {
    "rollout.weights": "fp8",
    "rollout.kv_cache": "fp8",
    "rollout.kv_granularity": "tensor",
  }
  assert c.engine_id == "w=fp8/ch,kv=fp8/tensor,noise=0"
  assert c.lag == 0
  # A tuple with its commas inside the brackets, an int given to a float field.
  c = candidates_lib.parse_candidate("rollout.bf16_layers=(0,),rollout.noise_sigma=1", config)
  assert c.overrides == {"rollout.bf16_layers": (0,), "rollout.noise_sigma": 1.0}
  assert isinstance(c.overrides["rollout.noise_sigma"], float)
  assert c.engine_cfg.bf16_layers == (0,) and c.engine_cfg.noise_sigma == 1.0
  assert candidates_lib.parse_candidate("rollout.kv_bf16_layers=(0, 1)", config).engine_cfg.kv == (
    candidates_lib.parse_candidate("rollout.kv_bf16_layers=(0,1)", config).engine_cfg.kv
  )
  assert candidates_lib.parse_candidate("rollout.stale_k=2", config).lag == 2
  assert candidates_lib.parse_candidate("rollout.mode=async,rollout.max_lag=3", config).lag == 3
  # The run config itself is untouched.
  assert config.rollout.weights == "trainer" and config.rollout.noise_sigma == 0.0


def test_a_combination_splits_into_one_part_per_source(config):
  def parts(spec):
    return candidates_lib.source_parts(candidates_lib.parse_candidate(spec, config), config)

  assert parts(
    "rollout.weights=fp8,rollout.weight_block_size=64,rollout.kv_cache=fp8,"
    "rollout.kv_granularity=tensor,rollout.stale_k=5,rollout.noise_sigma=0.05"
  ) == {  # in the candidate's source order (noise, stale, fp8 weights, fp8 KV)
    "noise": "rollout.noise_sigma=0.05",
    "stale": "rollout.stale_k=5",
    "fp8_weights": "rollout.weights=fp8,rollout.weight_block_size=64",
    "fp8_kv": "rollout.kv_cache=fp8,rollout.kv_granularity=tensor",
  }
  # An async lag is the stale part; bf16_layers goes with the weights; the KV's BF16 layers,
  # which do nothing with a full-precision cache, with no part; a sampling setting, which no
  # source owns, with every part.
  assert parts(
    "rollout.weights=fp8,rollout.bf16_layers=(0,),rollout.mode=async,rollout.max_lag=1,"
    "rollout.kv_bf16_layers=(1,),rollout.temperature=0.8"
  ) == {
    "stale": "rollout.mode=async,rollout.max_lag=1,rollout.temperature=0.8",
    "fp8_weights": "rollout.weights=fp8,rollout.bf16_layers=(0,),rollout.temperature=0.8",
  }
  assert parts("rollout.noise_sigma=0.3") == {}  # one source: no parts
  assert parts("rollout.kv_cache=fp8,rollout.kv_granularity=tensor") == {}


def test_a_key_in_no_table_goes_with_the_source_its_reset_changes(config, monkeypatch):
  spec = "rollout.weights=fp8,rollout.weight_block_size=32,rollout.noise_sigma=0.1"
  placed = candidates_lib.source_parts(candidates_lib.parse_candidate(spec, config), config)
  monkeypatch.delitem(candidates_lib.ROLE_OF_KEY, "rollout.weight_block_size")
  probed = candidates_lib.source_parts(candidates_lib.parse_candidate(spec, config), config)
  assert (
    probed
    == placed
    == {
      "noise": "rollout.noise_sigma=0.1",
      "fp8_weights": "rollout.weights=fp8,rollout.weight_block_size=32",
    }
  )


def test_a_noise_part_on_an_async_base_switches_the_bases_lag_off(config):
  base = copy.deepcopy(config)
  base.rollout.mode, base.rollout.max_lag = "async", 1
  candidate = candidates_lib.parse_candidate("rollout.noise_sigma=0.1", base)
  assert candidates_lib.candidate_source(candidate) == "noise+stale"
  parts = candidates_lib.source_parts(candidate, base)
  assert parts == {
    "noise": "rollout.noise_sigma=0.1,rollout.max_lag=0",
    "stale": "rollout.mode=async",  # the base's own lag: a no-op override names it
  }
  for source, spec in parts.items():
    part = candidates_lib.parse_candidate(spec, base)
    assert candidates_lib.candidate_source(part) == source
  assert candidates_lib.parse_candidate(parts["stale"], base).lag == 1


# ---------------------------------------------------------------------------------------------
# Sources by what the engine does


def test_every_engine_field_belongs_to_a_source():
  fields = candidates_lib.engine_fields(transform.EngineConfig())
  unmapped = sorted(set(fields) - set(candidates_lib.ENGINE_SOURCES))
  assert not unmapped, (
    f"EngineConfig fields {unmapped} belong to no mismatch source: map each in "
    "opd_jax/mismatch/candidates.py ENGINE_SOURCES (and its value-named formats in "
    "WEIGHT_SOURCES / KV_SOURCES)"
  )
  roles = set(candidates_lib.ENGINE_SOURCES.values())
  assert roles <= set(candidates_lib.SOURCE_ORDER)
  assert set(candidates_lib.SWITCH_OFF) == set(candidates_lib.SOURCE_ORDER)
  # Every weights format and quantized KV dtype the engine accepts is named.
  assert set(transform.WEIGHT_MODES) - {"trainer"} <= set(candidates_lib.WEIGHT_SOURCES)


def test_every_rollout_key_goes_with_a_source_or_with_none():
  keys = {k for k in config_check.RULES if k.startswith(candidates_lib.CANDIDATE_PREFIX)}
  placed = set(candidates_lib.ROLE_OF_KEY) | set(candidates_lib.NEUTRAL_KEYS)
  assert not keys - placed, (
    f"rollout keys {sorted(keys - placed)} are in neither candidates.ROLE_OF_KEY (the source "
    "whose part they go with) nor candidates.NEUTRAL_KEYS (engine and lag unchanged)"
  )
  assert not set(candidates_lib.ROLE_OF_KEY) & set(candidates_lib.NEUTRAL_KEYS)


@pytest.mark.parametrize(
  "base, spec, sources",
  [
    # A qualifier alone is its source's where it acts, and nothing where it does not.
    ({"weights": "fp8"}, "rollout.weight_block_size=32", "fp8_weights"),
    ({"weights": "fp8"}, "rollout.bf16_layers=(0,)", "fp8_weights"),
    ({}, "rollout.weights=fp8,rollout.weight_block_size=32", "fp8_weights"),
    ({}, "rollout.weight_block_size=32", "reference"),
    ({"kv_cache": "fp8"}, "rollout.kv_granularity=tensor", "fp8_kv"),
    ({"kv_cache": "fp8"}, "rollout.kv_bf16_layers=(0,)", "fp8_kv"),
    ({}, "rollout.kv_granularity=tensor", "reference"),
    ({"noise_sigma": 0.1}, "rollout.noise_layers=(0,)", "noise"),
    ({"noise_sigma": 0.1}, "rollout.noise_modules=(mlp,)", "noise"),
    # Against the trainer, not the --config base: the base's own sources count.
    ({"weights": "fp8"}, "rollout.kv_cache=fp8", "fp8_weights+fp8_kv"),
    ({"mode": "async", "max_lag": 2}, "rollout.kernel=bf16_matmul", "stale+kernel"),
    (
      {"weights": "fp8", "kv_cache": "fp8"},
      "rollout.weights=trainer,rollout.kv_cache=auto",
      "reference",
    ),
    # A bf16 cast keeps its cache in its own dtype (kv_cache=auto): one source; a bf16 cache
    # under an f32 trainer is a KV source.
    ({}, "rollout.weights=bf16", "bf16_weights"),
    ({}, "rollout.kv_cache=bf16", "bf16_kv"),
    ({}, "rollout.weights=bf16,rollout.kv_cache=fp8", "bf16_weights+fp8_kv"),
    ({}, "rollout.mode=async,rollout.max_lag=0", "reference"),
    # Each weight format is a source of its own; its scale grouping qualifies it.
    ({}, "rollout.weights=fp8_e5m2", "fp8_e5m2_weights"),
    ({}, "rollout.weights=int4,rollout.weight_group_size=32", "int4_weights"),
    ({"weights": "int8"}, "rollout.weight_per_tensor=true", "int8_weights"),
    ({}, "rollout.head_dtype=bfloat16", "bf16_head"),
    ({"noise_sigma": 0.1}, "rollout.head_dtype=bfloat16", "noise+bf16_head"),
    ({}, "rollout.temperature=0.7", "reference"),
  ],
)
def test_sources_come_from_what_the_engine_does(config, base, spec, sources):
  assert config.student.dtype == "float32"
  c = candidates_lib.parse_candidate(spec, with_rollout(config, **base))
  assert candidates_lib.candidate_source(c) == sources


def test_an_engine_change_that_belongs_to_no_source_is_refused(config, monkeypatch):
  reference = transform.EngineConfig()
  monkeypatch.delitem(candidates_lib.ENGINE_SOURCES, "head_dtype")  # a field no source owns
  with pytest.raises(ValueError, match=r"head_dtype='bfloat16', which belongs to no known"):
    candidates_lib.engine_sources(transform.EngineConfig(head_dtype="bfloat16"), 0, reference)
  assert candidates_lib.engine_sources(transform.EngineConfig(), 0, reference) == "reference"
  monkeypatch.delitem(candidates_lib.WEIGHT_SOURCES, "fp8")
  c = candidates_lib.parse_candidate("rollout.weights=fp8", config)
  with pytest.raises(ValueError, match=r"weights format 'fp8' belongs to no known mismatch"):
    candidates_lib.candidate_source(c)


def test_strings_in_a_tuple_may_be_typed_unquoted(config):
  def modules(text):
    spec = f"rollout.noise_sigma=0.1,rollout.noise_modules={text}"
    return candidates_lib.parse_candidate(spec, config).engine_cfg.noise_modules

  assert modules("(mlp,)") == ("mlp",)
  assert modules("(mlp, attention)") == ("mlp", "attention")
  assert modules("('mlp', 'o')") == ("mlp", "o")
  assert modules("mlp") == ("mlp",)
  with pytest.raises(ValueError, match=r"quote the strings: \('mlp', '1x'\)"):
    modules("(mlp, 1x)")
  with pytest.raises(ValueError, match=r"unknown 'attn'; allowed: .*attention"):
    modules("(mlp, attn)")


def test_misspelt_key_gets_the_nearest_valid_key(config):
  with pytest.raises(ValueError, match=r"unknown config key 'rollout\.weigts'.*'rollout\.weights'"):
    candidates_lib.parse_candidate("rollout.weigts=fp8", config)
  with pytest.raises(ValueError, match=r"did you mean 'rollout\.kv_cache'"):
    candidates_lib.parse_candidate("rollout.weights=fp8,rolout.kv_cache=fp8", config)


def test_bad_values_are_refused_naming_what_is_allowed(config):
  with pytest.raises(ValueError, match=r"rollout\.weights must be one of trainer, bf16, fp8"):
    candidates_lib.parse_candidate("rollout.weights=fp9", config)
  with pytest.raises(ValueError, match=r"rollout\.noise_sigma"):
    candidates_lib.parse_candidate("rollout.noise_sigma=loud", config)
  with pytest.raises(ValueError, match="set twice"):
    candidates_lib.parse_candidate("rollout.weights=fp8,rollout.weights=bf16", config)
  with pytest.raises(ValueError, match="not <key>=<value>"):
    candidates_lib.parse_candidate("rollout.weights", config)


def test_a_non_rollout_key_is_refused(config):
  with pytest.raises(ValueError, match=r"'train\.lr' is not a rollout setting"):
    candidates_lib.parse_candidate("rollout.weights=fp8,train.lr=0.1", config)
  with pytest.raises(ValueError, match=r"'student\.dtype' is not a rollout setting"):
    candidates_lib.parse_candidate("student.dtype=bfloat16", config)


def test_a_stale_candidate_without_a_run_history_gets_a_row_without_building(config, budget_path):
  lines = []
  result = admit_check.run_admission(
    config, str(budget_path), [STALE], workdir="/nonexistent", log=lines.append
  )
  (row,) = result["rows"]
  assert row["verdict"] == "needs --params-from" and not row["admitted"]
  assert row["lag"] == 2 and row["source"] == "stale" and row["mismatch/kl"] is None
  (reason,) = row["reasons"]
  assert re.search(r"2 version\(s\) old.*--params-from", reason)
  assert result["log_file"] is None and not os.path.exists("/nonexistent")
  table = lines[-1].splitlines()
  assert re.split(r"\s{2,}", table[2]) == [
    "rollout.stale_k=2",
    "2",
    "-",
    "-",
    "-",
    "-",
    "-",
    "needs --params-from",
    "unmeasured",
  ]


# ---------------------------------------------------------------------------------------------
# Verdicts, table, JSON, log


def test_exact_candidate_is_admitted_with_margin_max_kl(checked):
  exact = checked[0]["rows"][0]
  assert exact["candidate"] == EXACT
  assert abs(exact["mismatch/kl"]) < 1e-6
  assert exact["max_kl"] == pytest.approx(MAX_KL, abs=1e-15)
  assert exact["margin"] == pytest.approx(MAX_KL, abs=1e-6)
  assert exact["admitted"] and exact["verdict"] == "admitted" and exact["reasons"] == []
  assert (exact["source"], exact["limit_from"]) == ("reference", "overall")
  lower, upper = exact["limit_band"]
  assert lower <= exact["max_kl"] <= upper
  assert not exact["too_close"] and exact["call"] == "clear"  # 0 is below the whole band


def test_a_combination_is_judged_by_the_files_rule_with_its_parts_measured_alone(checked):
  result, lines, _ = checked
  noise, combo = result["rows"][1], result["rows"][2]
  assert result["budget"]["rule"] == {
    "name": "per_part",
    "params": {"conservative": False},
    "validation": None,
  }
  assert any("rule: per_part, not validated" in line for line in lines)
  assert combo["source"] == "noise+bf16_kv" and combo["rule"] == "per_part"
  # The noise part alone is the noise candidate: the same engine, prompts and key.
  assert combo["mismatch/kl/part/noise"] == noise["mismatch/kl"]
  assert 0 < combo["mismatch/kl/part/bf16_kv"] < MAX_KL  # bf16 KV under an f32 trainer
  # The noise part binds (its margin is the least) and is over its limit.
  assert (combo["limit_from"], combo["admitted"]) == ("noise", False)
  assert combo["margin"] == pytest.approx(MAX_KL - noise["mismatch/kl"], abs=1e-12)
  assert combo["reasons"][-1].startswith("its noise part alone: ")
  # The budget has no record of bf16_kv: refused by default as an uncalibrated source, first.
  assert combo["call"] == combo["extrapolation"] == "uncalibrated source"
  assert combo["reasons"][0].startswith("uncalibrated source: the budget has no calibration ")
  assert "'bf16_kv'" in combo["reasons"][0]


def test_destructive_candidate_is_rejected_with_a_reason(checked):
  noise = checked[0]["rows"][1]
  assert noise["engine_id"] == "w=trainer,kv=float32,noise=1"
  assert noise["mismatch/kl"] > 5 * MAX_KL
  assert noise["margin"] == pytest.approx(MAX_KL - noise["mismatch/kl"], abs=1e-12)
  assert not noise["admitted"] and noise["verdict"] == "rejected"
  # σ = 1 reads far above the largest noise record: beyond the calibrated range, refused by
  # default, and its rule's own reason follows.
  assert noise["call"] == noise["extrapolation"] == "beyond calibrated range"
  assert len(noise["reasons"]) == 3
  assert noise["reasons"][0].startswith("beyond calibrated range: noise reads ")
  assert noise["reasons"][1].startswith("refused: judging it would extrapolate the budget")
  assert noise["mismatch/kl"] > noise["limit_band"][1] and not noise["too_close"]
  # The records are all "noise", so the noise fit is the overall one and sets the limit.
  assert (noise["source"], noise["limit_from"]) == ("noise", "noise")
  assert re.match(
    r"mismatch/kl \S+ > 0\.001375, the limit of source 'noise', ", noise["reasons"][-1]
  )


def test_json_output_matches_the_table(checked):
  result, lines, workdir = checked
  written = json.loads((workdir / "out.json").read_text())
  assert written["rows"] == result["rows"]
  assert written["num_prompts"] == PROMPTS and len(written["prompts"]) == PROMPTS
  table = lines[-1].splitlines()
  assert re.split(r"\s{2,}", table[0]) == [h for h, _, _ in admit_check._COLUMNS]
  body = [line for line in table[2:] if not line.startswith("    ")]
  reasons = [line.removeprefix("    reason: ") for line in table[2:] if line not in body]
  assert len(body) == len(written["rows"])
  for line, row in zip(body, written["rows"], strict=True):
    cells = re.split(r"\s{2,}", line)
    assert cells == [admit_check.format_cell(row[key], fmt) for _, key, fmt in admit_check._COLUMNS]
    if row["mismatch/kl"] is not None:
      assert float(cells[2]) == pytest.approx(row["mismatch/kl"], rel=1e-3, abs=1e-12)
  assert reasons == [r for row in written["rows"] for r in row["reasons"]]


def test_rows_carry_the_kl_by_position_and_first_crossings(checked, tmp_path):
  """Each measured row's buckets hold all its tokens, their token-weighted mean is its
  mismatch/kl, the exact engine crosses nowhere, and --plot's drawing of them is a PNG."""
  from opd_jax.experiments import plots

  rows = checked[0]["rows"]
  assert "kl_by_position" not in rows[3]  # the stale candidate, unmeasured
  for row in rows[:3]:
    pos, cross = row["kl_by_position"], row["first_cross"]
    assert pos["bucket_tokens"] == 16 and sum(pos["tokens"]) == row["measure/tokens"]
    total = sum(k * n for k, n in zip(pos["kl"], pos["tokens"], strict=True) if n)
    assert total / sum(pos["tokens"]) == pytest.approx(row["mismatch/kl"], rel=1e-4, abs=1e-9)
    assert cross["kl"] == 0.1 and cross["completions"] == PROMPTS
    assert 0 <= cross["crossed"] == len([f for f in cross["first"] if f >= 0])
  assert rows[0]["first_cross"]["crossed"] == 0 and rows[0]["first_cross"]["pos_mean"] is None
  png = plots.kl_by_position(rows, str(tmp_path / "plots" / "kl_by_position.png"))
  assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="no candidate row carries kl_by_position"):
    plots.kl_by_position([{"candidate": "x"}], str(tmp_path / "none.png"))


def test_log_gets_one_line_per_candidate(checked, fingerprint):
  result, _, workdir = checked
  entries = [json.loads(line) for line in (workdir / admit_check.LOG_FILE).read_text().splitlines()]
  assert len(entries) == 3  # the stale candidate was not measured
  for entry, row in zip(entries, result["rows"][:3], strict=True):
    assert entry["config"]["candidate"] == row["candidate"]
    assert entry["config"]["overrides"] == row["overrides"]
    assert entry["engine_id"] == row["engine_id"]
    assert entry["fingerprint"] == fingerprint
    assert entry["measurement"]["mismatch/kl"] == row["mismatch/kl"]
    assert entry["verdict"]["admitted"] == row["admitted"]
    assert entry["verdict"]["too_close"] == row["too_close"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", entry["time"])
  # A second check appends.
  admit_check.append_log(str(workdir), [{"time": "t"}])
  assert len((workdir / admit_check.LOG_FILE).read_text().splitlines()) == 4


def test_stale_budget_is_refused_naming_what_changed_and_accepted_with_force(
  config, fingerprint, tmp_path
):
  saved = copy.deepcopy(fingerprint)
  saved["jax_version"] = "0.0.1"
  saved["teacher"]["weights_sha256"] = "0" * 64
  path = tmp_path / "stale.json"
  save_budget(path, fit_budget(RECORDS, 0.1, num_bootstrap=20), saved)
  kwargs = dict(num_prompts=PROMPTS, workdir=str(tmp_path / "w"), log=quiet)
  with pytest.raises(ValueError, match="the budget is stale") as e:
    admit_check.run_admission(config, str(path), [EXACT], **kwargs)
  assert f"jax version 0.0.1 -> {fingerprint['jax_version']}" in str(e.value)
  assert "teacher weights hash changed: 000000000000…" in str(e.value)
  assert "--force" in str(e.value)
  assert not (tmp_path / "w" / admit_check.LOG_FILE).exists()

  result = admit_check.run_admission(config, str(path), [EXACT], force=True, **kwargs)
  assert result["forced"]
  assert any(r.startswith("jax version 0.0.1") for r in result["stale_budget_reasons"])
  assert result["rows"][0]["admitted"]
  (entry,) = [
    json.loads(x) for x in (tmp_path / "w" / admit_check.LOG_FILE).read_text().splitlines()
  ]
  assert entry["stale_budget_reasons"] == result["stale_budget_reasons"]


# ---------------------------------------------------------------------------------------------
# Staleness from a run's checkpoints


@pytest.fixture(scope="module")
def trained_run(config, tmp_path_factory):
  """A finished tiny run: 6 steps, checkpoints at 3 and 6, its student exported at 6."""
  run = tmp_path_factory.mktemp("run")
  trainer.run(config, str(run), log=quiet)
  return run


@pytest.mark.slow
def test_the_last_step_is_read_from_the_export_bit_identical(config, trained_run, tmp_path):
  from opd_jax.io import checkpointing

  run = str(trained_run)
  assert run_history.exported_run_record(run, 6)["step"] == 6
  assert run_history.exported_run_record(run, 3) is None  # the export holds step 6 only
  setup = setup_lib.prepare_models(run_spec(config), str(tmp_path / "w"), quiet)
  history = run_history.RunHistory(run_spec(config), setup, run)
  exported = history.params(6)
  assert history.run_config == run_history.run_fingerprint(run_spec(config))
  ckpt = checkpointing.Checkpointer(trained_run / "checkpoints", read_only=True)
  restored, extra = ckpt.restore_params(6, history.abstract_params)
  ckpt.close()
  assert extra["config"] == history.run_config
  assert admission.current_fingerprint(setup, exported) == admission.current_fingerprint(
    setup, restored
  )
  # Reading the export leaves orbax out (the point of it); a step the export does not hold
  # restores from the checkpoint.
  code = (
    "import sys; sys.path.insert(0, 'configs'); import bf16_sync\n"
    "from opd_jax.io import run_history; from opd_jax.train import setup as setup_lib\n"
    f"c = bf16_sync.get_config('tiny'); c.teacher.cache_dir = {config.teacher.cache_dir!r}\n"
    "c = setup_lib.run_spec(c)\n"
    f"h = run_history.RunHistory(c, setup_lib.prepare_models(c, {str(tmp_path / 'w2')!r}, print), "
    f"{run!r})\n"
    "h.params(6); print('orbax' in sys.modules)\n"
    "h.params(3); print('orbax' in sys.modules)\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split()[-2:] == ["False", "True"]


def test_an_export_counts_only_when_it_holds_that_checkpoint(tmp_path):
  run = tmp_path / "run"
  (run / "checkpoints" / "6").mkdir(parents=True)
  (run / "export").mkdir()
  record = run / "export" / run_history.EXPORT_RECORD
  assert run_history.exported_run_record(str(run), 6) is None  # no record: an older export
  record.write_text(json.dumps({"step": 6, "config": {}}))
  assert run_history.exported_run_record(str(run), 6) == {"step": 6, "config": {}}
  assert run_history.exported_run_record(str(run), 5) is None
  newer = record.stat().st_mtime + 10  # the checkpoint re-written after the export
  os.utime(run / "checkpoints" / "6", (newer, newer))
  assert run_history.exported_run_record(str(run), 6) is None
  os.utime(record, (newer + 1, newer + 1))
  assert run_history.exported_run_record(str(run), 6) is not None
  record.write_text("{not json")
  assert run_history.exported_run_record(str(run), 6) is None


@pytest.mark.slow
def test_stale_candidates_are_measured_from_a_runs_checkpoints(
  config, budget_path, trained_run, tmp_path
):
  run = trained_run
  assert run_history.checkpoint_steps(str(run)) == [3, 6]
  kwargs = dict(num_prompts=PROMPTS, workdir=str(tmp_path / "w"), params_from=str(run), log=quiet)
  # The budget was fitted on the warm-started student: stale for the run's trained student.
  with pytest.raises(ValueError, match="student weights hash changed(.|\n)*--params-from"):
    admit_check.run_admission(config, str(budget_path), [EXACT], **kwargs)
  (missing,) = admit_check.run_admission(
    config, str(budget_path), ["rollout.stale_k=2"], force=True, **kwargs
  )["rows"]
  assert missing["verdict"] == "needs checkpoints" and not missing["admitted"]
  assert "holds steps [3, 6] (lags available from step 6: " in missing["reasons"][0]
  specs = [EXACT, "rollout.stale_k=3", "rollout.mode=async,rollout.max_lag=3"]
  rows = admit_check.run_admission(config, str(budget_path), specs, force=True, **kwargs)["rows"]
  exact, stale, async_ = rows
  assert abs(exact["mismatch/kl"]) < 1e-6
  # The run sampled with the exact engine: its training-time mismatch/kl is set beside it.
  assert exact["train/key"] == "mismatch/kl/lag_0" and exact["train/logged_steps"] == 3
  assert abs(exact["train/mismatch_kl_last"]) < 1e-6
  assert "train/key" not in stale and "train/key" not in async_
  assert (stale["behaviour_step"], stale["trainer_step"]) == (3, 6)
  assert stale["mismatch/kl"] > 1e-5
  # Same engine, same lag, same key: async at max_lag=3 reads what sync stale_k=3 reads.
  assert async_["mismatch/kl"] == stale["mismatch/kl"]


@pytest.mark.slow
def test_prefix_shift_of_a_stale_engine_samples_with_the_runs_earlier_checkpoint(
  config, budget_path, trained_run, tmp_path
):
  """A stale candidate's prefix shift builds its engine from θ_(t−k) of the run: its own-prefix
  KL is the admission check's measurement of the same lag (same prompts, key and procedure),
  async at max_lag k reads what sync stale_k k reads, and a lag the run cannot give is refused
  with the check's message."""
  from opd_jax.mismatch import prefix_shift

  run = str(trained_run)
  specs = ["rollout.stale_k=3", "rollout.mode=async,rollout.max_lag=3", EXACT]
  rows = prefix_shift.run_prefix_shift(
    config, specs, params_from=run, num_prompts=PROMPTS, log=quiet
  )["rows"]
  stale, async_, exact = rows
  assert (stale["lag"], async_["lag"], exact["lag"]) == (3, 3, 0)
  assert stale["own_prefix/kl"] > 1e-5 and stale["teacher_forced/kl"] > 1e-5
  assert stale["diverged_fraction"] > 0
  assert {k: v for k, v in async_.items() if k not in ("name", "spec")} == {
    k: v for k, v in stale.items() if k not in ("name", "spec")
  }
  assert exact["diverged_fraction"] == 0.0 and exact["own_prefix/kl"] < 1e-6
  kwargs = dict(num_prompts=PROMPTS, workdir=str(tmp_path / "w"), params_from=run, log=quiet)
  (checked,) = admit_check.run_admission(
    config, str(budget_path), ["rollout.stale_k=3"], force=True, **kwargs
  )["rows"]
  assert stale["own_prefix/kl"] == pytest.approx(checked["mismatch/kl"], rel=1e-5)
  with pytest.raises(ValueError, match=r"holds steps \[3, 6\]"):
    prefix_shift.run_prefix_shift(config, ["rollout.stale_k=2"], params_from=run, log=quiet)
  with pytest.raises(ValueError, match="--params-from=RUN with checkpoints at steps t and t-3"):
    prefix_shift.run_prefix_shift(config, ["rollout.stale_k=3"], log=quiet)


def test_training_time_kl_reads_the_lag_breakdown_or_the_plain_key(tmp_path):
  lines = [
    {"step": 10 * i, "mismatch/kl": 0.1 * i, "mismatch/kl/lag_1": 0.2 * i} for i in range(1, 11)
  ]
  lines.insert(3, {"step": 35, "quality/student_accuracy": 0.5})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  # 10 logged values; the last 10% is the last one.
  plain = admission.training_time_kl(str(tmp_path), lag=0)
  assert plain["train/key"] == "mismatch/kl" and plain["train/logged_steps"] == 10
  assert plain["train/mismatch_kl_mean"] == pytest.approx(0.55)
  assert plain["train/mismatch_kl_last"] == pytest.approx(1.0)
  lagged = admission.training_time_kl(str(tmp_path), lag=1)
  assert lagged["train/key"] == "mismatch/kl/lag_1"
  assert lagged["train/mismatch_kl_mean"] == pytest.approx(1.1)
  assert admission.training_time_kl(str(tmp_path / "none"), lag=0) is None
  # A non-finite step is left out of both means and counted.
  lines.insert(5, {"step": 45, "mismatch/kl": math.nan})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  plain = admission.training_time_kl(str(tmp_path), lag=0)
  assert plain["train/mismatch_kl_mean"] == pytest.approx(0.55)
  assert plain["train/logged_steps"] == 10 and plain["train/nonfinite_steps"] == 1


def test_trained_with_compares_every_rollout_key_the_run_saved(config):
  run_config = run_history.run_fingerprint(run_spec(config))
  assert admission.trained_with(candidates_lib.parse_candidate(EXACT, config), run_config)
  assert not admission.trained_with(candidates_lib.parse_candidate(NOISE, config), run_config)
  fp8 = candidates_lib.parse_candidate("rollout.weights=fp8", config)
  assert admission.trained_with(fp8, {**run_config, "rollout.weights": "'fp8'"})
  # A key the run did not save (an older run) is not compared.
  del run_config["rollout.top_p"]
  assert admission.trained_with(
    candidates_lib.parse_candidate("rollout.top_p=0.9", config), run_config
  )


def _admit_command(budget_path, *args: str) -> subprocess.CompletedProcess:
  """`python -m opd_jax.admit` on the tiny config with `args`, its workdir beside the budget."""
  workdir = os.path.join(os.path.dirname(budget_path), "admit_command")
  command = [
    "-m",
    "opd_jax.admit",
    "--config=configs/bf16_sync.py:tiny",
    f"--budget={budget_path}",
    f"--workdir={workdir}",
  ]
  return subprocess.run(
    [sys.executable, *command, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
  )


def test_command_line_refuses_a_misspelt_candidate_without_building(budget_path):
  proc = _admit_command(budget_path, "--candidate=rollout.wieghts=fp8")
  assert proc.returncode == 2
  assert "error: candidate 'rollout.wieghts=fp8'" in proc.stderr
  assert "did you mean 'rollout.weights'?" in proc.stderr


def test_importing_the_check_leaves_out_what_it_does_not_run_first():
  """orbax (with tensorstore, most of a second) is imported by `RunHistory.params`, where a
  check restores while its programs compile; optax (0.3 s) only by a training step, and
  TensorBoard's writer and reader (0.2 s, its TensorFlow stub) only by a metrics writer or
  reader, neither of which a check uses: importing the check must load none of them."""
  code = "import sys, opd_jax.cli.admit_check; print(sorted(sys.modules))"
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr
  modules = set(ast.literal_eval(proc.stdout.strip().splitlines()[-1]))
  assert {"jax", "opd_jax.io.metrics_writer"} <= modules
  assert not {m.split(".")[0] for m in modules} & {"orbax", "tensorstore", "optax"}
  assert not {m for m in modules if m.startswith("tensorboard.")} & {
    "tensorboard.backend.event_processing.event_accumulator",
    "tensorboard.compat.tensorflow_stub",
    "tensorboard.summary.writer.event_file_writer",
  }


def test_an_unusable_compilation_cache_is_refused_naming_it(budget_path, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(ValueError, match=r"--compilation-cache '.*a_file/cache': cannot create it"):
    compile_cache.enable_compilation_cache(str(blocker / "cache"))
  proc = _admit_command(
    budget_path, "--candidate=rollout.weights=fp8", f"--compilation-cache={blocker / 'cache'}"
  )
  assert proc.returncode == 2
  assert "error: --compilation-cache" in proc.stderr and "a_file/cache" in proc.stderr


def test_a_stale_candidate_beside_others_gets_its_row_and_the_others_are_judged(checked):
  exact, noise, combo, stale = checked[0]["rows"]
  assert exact["admitted"] and not noise["admitted"] and combo["mismatch/kl"] > 0
  assert stale["candidate"] == STALE and stale["verdict"] == "needs --params-from"
  assert not stale["admitted"] and stale["mismatch/kl"] is None


def test_the_exit_status_says_whether_every_candidate_was_admitted(config, budget_path, tmp_path):
  """0: all admitted; 1: one refused, or a stale one that needs --params-from (its row says so);
  2: an error; --report-only: 0 whatever the verdicts. One workdir, so that the warm-started
  student and the compiled programs are built once."""
  workdir = tmp_path / "w"

  def admit(*args, budget=budget_path):
    json_path = workdir / "out.json"
    json_path.unlink(missing_ok=True)
    proc = _admit_command(
      budget,
      f"--config.teacher.cache_dir={config.teacher.cache_dir}",
      f"--workdir={workdir}",
      f"--prompts={PROMPTS}",
      f"--json={json_path}",
      "--force",  # the command's warm-started student (fast compile) is not the fixture's
      *args,
    )
    rows = json.loads(json_path.read_text())["rows"] if json_path.exists() else None
    return proc, rows

  proc, rows = admit(f"--candidate={EXACT}", f"--candidate={NOISE}")
  assert proc.returncode == 1, proc.stderr
  assert [r["verdict"] for r in rows] == ["admitted", "rejected"]
  proc, rows = admit(f"--candidate={EXACT}")
  assert proc.returncode == 0, proc.stderr
  assert [r["verdict"] for r in rows] == ["admitted"]
  # A stale candidate alone: nothing is built, and it is not admitted.
  proc, rows = admit(f"--candidate={STALE}")
  assert proc.returncode == 1, proc.stderr
  assert [r["verdict"] for r in rows] == ["needs --params-from"]
  assert "needs --params-from" in proc.stdout
  proc, rows = admit(f"--candidate={STALE}", "--report-only")
  assert proc.returncode == 0, proc.stderr
  assert [r["admitted"] for r in rows] == [False]
  proc, rows = admit(f"--candidate={EXACT}", budget=tmp_path / "missing.json")
  assert proc.returncode == 2 and rows is None
  assert "error:" in proc.stderr and "missing.json" in proc.stderr
  proc, _ = admit(f"--candidate={EXACT}", "--prompts=many")
  assert proc.returncode == 2 and "--prompts" in proc.stderr


@pytest.mark.parametrize("spec", ["rollout.temperature=0.0", "rollout.top_k=1"])
def test_a_candidate_whose_steps_are_point_masses_is_refused_before_measuring(config, spec):
  """Greedy or top-1 sampling: engine and trainer both put all mass on the sampled token, so
  the mismatch reads 0 for any engine; the check refuses to measure it (nothing else is used)."""
  candidate = candidates_lib.parse_candidate(f"rollout.noise_sigma=1.0,{spec}", config)
  with pytest.raises(ValueError, match="point mass on the sampled token"):
    admission.measure_candidate(candidate, setup=None, prompts=None, student_params=None)
