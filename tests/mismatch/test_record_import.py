"""Records imported from other stacks' logs (`mismatch.record_import`) and the fit_budget command:
small hand-written logs in each format, with figures and budgets computed by hand."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import run_module

from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import budget_file, budget_fit, record_import

REPO = Path(__file__).resolve().parents[2]


def _lines(*objs) -> str:
  return "".join(json.dumps(o) + "\n" for o in objs)


def _verl_log() -> str:
  """Three runs, 4 steps each; with tail 2: x = 0.001, 0.02, 0.06 (k3), quality 0.80, 0.78, 0.70."""
  out = []
  for run, k3, k1, score in (
    ("reference", (0.005, 0.003, 0.001, 0.001), (0.004, 0.002, 0.001, 0.001), (0.78, 0.82)),
    ("fp8", (0.03, 0.025, 0.02, 0.02), (0.03, 0.02, 0.02, 0.02), (0.76, 0.80)),
    ("int4", (0.08, 0.07, 0.06, 0.06), (0.08, 0.07, 0.06, 0.06), (0.70, 0.70)),
  ):
    for step in range(4):
      line = {"run": run, "step": step + 1, "rollout_corr/k3_kl": k3[step]}
      line["rollout_corr/kl"] = k1[step]
      line["rollout_corr/chi2_token"] = 2 * k3[step]
      if step % 2:
        line["val/score"] = score[step // 2]
      out.append(line)
  return _lines(*out)


def test_a_verl_log_of_three_runs_fits_the_budget_computed_by_hand():
  """drops 0, 0.02, 0.10 at x 0.001, 0.02, 0.06 (already monotone); τ = 0.05 is crossed between
  the last two: max_kl = 0.02 + (0.05 − 0.02)/(0.10 − 0.02)·0.04 = 0.035."""
  records, prov = record_import.import_records(
    [("runs.jsonl", _verl_log())], "verl", quality_key="val/score", tail=2
  )
  assert [r["run"] for r in records] == ["reference", "fp8", "int4"]
  assert [r["source"] for r in records] == ["reference", "imported", "imported"]
  np.testing.assert_allclose([r["mismatch/kl"] for r in records], [0.001, 0.02, 0.06])
  np.testing.assert_allclose([r["mismatch/k1"] for r in records], [0.001, 0.02, 0.06])
  np.testing.assert_allclose([r["peer/chi2_token"] for r in records], [0.002, 0.04, 0.12])
  np.testing.assert_allclose([r["quality_drop"] for r in records], [0.0, 0.02, 0.10], atol=1e-12)
  assert {r["x_from"] for r in records} == {"rollout_corr/k3_kl"}
  assert prov["format"] == "verl" and prov["x_from"] == ["rollout_corr/k3_kl"]
  assert prov["reference_runs"] == ["reference"] and prov["axis"] == "training"
  assert prov["reference_quality"] == pytest.approx(0.80)
  assert len(prov["files"][0]["sha256"]) == 64
  fitted = budget_fit.fit_budget(records, 0.05, num_bootstrap=50)
  assert fitted.max_kl == pytest.approx(0.035) and fitted.censored == "none"


def test_verl_file_logger_lines_a_file_per_run_and_a_step_split_over_lines():
  """{"step", "data"} lines; no "run" key (the file's name is the run); step 2's metrics come on
  two lines and are merged; the k1 key is read when asked for."""
  ref = _lines(
    {"step": 1, "data": {"rollout_corr/kl": 0.002, "val/score": 0.5, "source": "reference"}},
    {"step": 2, "data": {"rollout_corr/kl": 0.0}},
    {"step": 2, "data": {"val/score": 0.7}},
  )
  noisy = _lines(
    {"step": 2, "data": {"rollout_corr/kl": 0.04, "val/score": 0.4}},
    {"step": 1, "data": {"rollout_corr/kl": 0.5, "val/score": 0.1, "source": "noise"}},
  )
  records, _ = record_import.import_records(
    [("logs/ref.jsonl", ref), ("logs/noisy.jsonl", noisy)],
    "verl",
    quality_key="val/score",
    kl_key="mismatch/k1",
    tail=1,
  )
  assert [(r["run"], r["source"]) for r in records] == [("ref", "reference"), ("noisy", "noise")]
  assert [r["mismatch/kl"] for r in records] == [0.0, 0.04]  # step 2 is the last of each
  assert [r["quality"] for r in records] == [0.7, 0.4]
  assert records[1]["quality_drop"] == pytest.approx(0.3)


def _slime_log(key="train/train_rollout_logprob_abs_diff") -> str:
  return _lines(
    {"run": "bf16", "source": "reference", key: 0.01, "eval/acc": 0.6},
    {"run": "fp8", key: 0.1, "eval/acc": 0.55},
  )


def test_slime_abs_diff_is_refused_without_a_conversion_and_converted_with_one():
  with pytest.raises(ValueError, match=r"not a KL; pick a conversion: --abs-diff-to-kl"):
    record_import.import_records([("s.jsonl", _slime_log())], "slime", quality_key="eval/acc")
  with pytest.raises(ValueError, match="not a KL"):
    record_import.import_records(
      [("s.jsonl", _slime_log())], "slime", quality_key="eval/acc", kl_key="mismatch/abs_logp_diff"
    )
  low, prov = record_import.import_records(
    [("s.jsonl", _slime_log())], "slime", quality_key="eval/acc", abs_diff_to_kl="lower_bound"
  )
  # m + e^-m - 1 at m = 0.1: 0.1 + 0.904837418 - 1
  assert low[1]["mismatch/kl"] == pytest.approx(0.0048374180, rel=1e-8)
  assert low[1]["mismatch/abs_logp_diff"] == 0.1 and prov["abs_diff_to_kl"] == "lower_bound"
  gauss, _ = record_import.import_records(
    [("s.jsonl", _slime_log("train_rollout_logprob_abs_diff"))],
    "slime",
    quality_key="eval/acc",
    abs_diff_to_kl="gaussian",
  )
  assert gauss[1]["mismatch/kl"] == pytest.approx(math.pi / 4 * 0.01, rel=0.01)
  assert gauss[1]["quality_drop"] == pytest.approx(0.05)


def test_the_lower_bound_holds_on_exact_distributions_and_the_gaussian_solve_inverts():
  rng = np.random.default_rng(0)
  for scale in (0.01, 0.1, 1.0):
    logits = rng.normal(size=(200, 50))
    p_b = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    q = logits + scale * rng.normal(size=logits.shape)
    p_t = np.exp(q) / np.exp(q).sum(-1, keepdims=True)
    delta = np.log(p_b) - np.log(p_t)
    kl = (p_b * delta).sum(-1).mean()  # the exact mean per-token KL(π_b ‖ π_θ)
    m = (p_b * np.abs(delta)).sum(-1).mean()  # its exact E|Δ| under π_b
    assert record_import.lower_bound_kl(m) <= kl
  for m in (1e-3, 0.05, 0.3, 2.0):
    kl = record_import.gaussian_kl(m)
    sigma = math.sqrt(2 * kl)
    assert record_import._folded_mean(sigma) == pytest.approx(m, rel=1e-9)
    assert record_import.lower_bound_kl(m) < kl
  assert record_import.gaussian_kl(1e-3) == pytest.approx(math.pi / 4 * 1e-6, rel=1e-3)
  draws = rng.normal(0.1**2 / 2, 0.1, size=400_000)  # Δ ~ N(σ²/2, σ²), σ = 0.1
  assert record_import.gaussian_kl(np.abs(draws).mean()) == pytest.approx(0.005, rel=0.01)


def test_trl_nemo_and_tinker_logs_map_onto_the_project_names():
  trl = _lines(
    {"step": 10, "sampling/sampling_logp_difference/mean": 0.02, "reward": 0.3, "run": "a"},
    {"step": 10, "sampling/sampling_logp_difference/max": 1.5, "run": "a", "source": "reference"},
    {"step": 10, "sampling/sampling_logp_difference/mean": 0.2, "reward": 0.1, "run": "b"},
  )
  records, _ = record_import.import_records(
    [("t.jsonl", trl)], "trl", quality_key="reward", abs_diff_to_kl="gaussian"
  )
  assert records[0]["mismatch/abs_logp_diff_max"] == 1.5
  assert records[1]["mismatch/kl"] == pytest.approx(record_import.gaussian_kl(0.2))
  nemo = _lines(
    {"run": "reference", "train/gen_kl_error": 0.001, "validation/accuracy": 0.5},
    {"run": "fp8", "train/gen_kl_error": 0.003, "validation/accuracy": 0.48},
  )
  records, _ = record_import.import_records(
    [("n.jsonl", nemo)], "nemo", quality_key="validation/accuracy"
  )
  assert (
    [r["mismatch/k3"] for r in records] == [0.001, 0.003] == [r["mismatch/kl"] for r in records]
  )
  tinker = _lines(
    {"run": "reference", "optim/kl_sample_train_v1": 0.002, "optim/kl_sample_train_v2": 0.001},
    {"run": "reference", "test/loss": 1.0},
    {"run": "lora", "optim/kl_sample_train_v1": 0.01, "test/loss": 1.25},
  )
  records, prov = record_import.import_records(
    [("k.jsonl", tinker)], "tinker", quality_key="test/loss", higher_is_better=False
  )
  assert [r["mismatch/kl"] for r in records] == [0.002, 0.01]  # k1
  assert records[0]["peer/k2"] == 0.001 and records[1]["quality_drop"] == 0.25
  assert prov["x_from"] == ["optim/kl_sample_train_v1"] and prov["higher_is_better"] is False


def test_opd_jax_records_pass_through_to_fit_budget_unchanged():
  recs = [
    {"source": "reference", "mismatch/kl": 0.0, "quality_drop": 0.0},
    {"source": "fp8", "mismatch/kl": 0.1, "quality_drop": 1.0, "note": "kept"},
    {"source": "noise", "mismatch/kl": 0.3, "quality_drop": 9.0},
  ]
  records, prov = record_import.import_records([("r.jsonl", _lines(*recs))], "opd_jax")
  assert records == recs and prov["axis"] == "as recorded"
  assert budget_fit.fit_budget(records, 5.0).max_kl == pytest.approx(0.2)  # 0.1 + 4/8·0.2


@pytest.mark.parametrize(
  ("fmt", "text", "kwargs", "message"),
  [
    ("mlflow", "", {}, r"unknown log format 'mlflow'; known: opd_jax, verl"),
    ("verl", '{"run": "a"}\n[1]\n', {"quality_key": "q"}, r"x.jsonl line 2: a list, not a JSON"),
    ("verl", "{oops\n", {"quality_key": "q"}, r"x.jsonl line 1: not a JSON object"),
    ("verl", '{"run": "a", "q": 1}\n', {}, r"needs --quality-key"),
    ("verl", '{"run": "a", "q": 1}\n', {"quality_key": "q"}, r"has no a mismatch metric.*k3_kl"),
    (
      "verl",
      '{"run": "reference", "rollout_corr/k3_kl": NaN, "q": 1}\n',
      {"quality_key": "q"},
      r"x.jsonl line 1 \(run 'reference'\): rollout_corr/k3_kl is nan",
    ),
    (
      "verl",
      '{"run": "reference", "rollout_corr/k3_kl": "0.1", "q": 1}\n',
      {"quality_key": "q"},
      r"rollout_corr/k3_kl is '0.1', not a number",
    ),
    (
      "verl",
      '{"run": "reference", "rollout_corr/k3_kl": 0.1, "q": 1}\n{"run": "b", "q": 1}\n',
      {"quality_key": "q"},
      r"run 'b' has no mismatch/k3",
    ),
    (
      "verl",
      '{"run": "reference", "rollout_corr/k3_kl": 0.1}\n',
      {"quality_key": "q"},
      r"run 'reference' has no 'q' \(--quality-key\)",
    ),
    (
      "verl",
      '{"run": "a", "rollout_corr/k3_kl": 0.1, "q": 1}\n{"run": "b", "rollout_corr/k3_kl": 0.2, '
      '"q": 1}\n',
      {"quality_key": "q"},
      r"no reference run among \['a', 'b'\]: name one with --reference=RUN",
    ),
    (
      "verl",
      '{"run": "a", "rollout_corr/k3_kl": 0.1, "q": 1}\n',
      {"quality_key": "q", "reference": ["z"]},
      r"--reference names no run: \['z'\]",
    ),
    (
      "verl",
      '{"run": "reference", "rollout_corr/k3_kl": 0.1, "q": 1}\n',
      {"quality_key": "q"},
      r"every run is a reference run",
    ),
    ("verl", "", {"quality_key": "q", "tail": 0}, r"tail must be an int >= 1"),
    (
      "opd_jax",
      "",
      {"kl_key": "mismatch/k3", "reference": ["r"]},
      r"--kl-key, --reference apply to peer logs only",
    ),
    (
      "verl",
      '{"run": "base", "rollout_corr/k3_kl": 0.0, "q": 1}\n'
      '{"run": "other", "source": "reference", "rollout_corr/k3_kl": 0.3, "q": 0.5}\n'
      '{"run": "fp8", "rollout_corr/k3_kl": 0.1, "q": 0.9}\n',
      {"quality_key": "q", "reference": ["base"]},
      r"runs \['other'\] say \"source\": \"reference\" but --reference names \['base'\]",
    ),
    ("slime", "", {"quality_key": "q", "abs_diff_to_kl": "exact"}, r"--abs-diff-to-kl=exact"),
  ],
)
def test_bad_logs_are_refused_with_a_message_naming_the_problem(fmt, text, kwargs, message):
  with pytest.raises(ValueError, match=message):
    record_import.import_records([("x.jsonl", text)], fmt, **kwargs)


def test_the_glossary_peer_column_comes_from_the_importers_table():
  assert record_import.peer_column("mismatch/k3") == (
    "verl `rollout_corr/k3_kl`; NeMo-RL `gen_kl_error`"
  )
  assert record_import.peer_column("mismatch/kl") == ""  # peers log sampled estimators only
  glossary = (REPO / "docs/reference/metrics.md").read_text()
  for p in record_import.PEER_METRICS:
    if p.metric.startswith("mismatch/"):
      row = next(line for line in glossary.splitlines() if line.startswith(f"| `{p.metric}` |"))
      assert f"`{p.names[0]}`" in row


def test_a_budget_file_keeps_its_provenance_and_an_old_file_loads_without_one(tmp_path):
  records, prov = record_import.import_records(
    [("runs.jsonl", _verl_log())], "verl", quality_key="val/score", tail=2
  )
  fitted = budget_fit.fit_budget(records, 0.05, num_bootstrap=20)
  fitted = dataclasses.replace(fitted, provenance=prov, rule=budget_lib.Rule("pooled"))
  budget_file.save_budget(tmp_path / "b.json", fitted, {})
  loaded, fp = budget_file.load_budget(tmp_path / "b.json")
  assert loaded == fitted and fp == {}
  old, old_fp = budget_file.load_budget(REPO / "docs/study/budget.json")
  assert old.provenance is None and old_fp
  assert "provenance" not in budget_file.budget_to_json(old, old_fp)
  assert budget_file.stale_reasons({}, old_fp) == [budget_file.NO_FINGERPRINT]


def test_admit_refuses_a_budget_without_a_fingerprint_unless_forced():
  from opd_jax.cli import admit_check

  with pytest.raises(ValueError, match=r"has no fingerprint.*Pass --force"):
    admit_check.check_budget_fresh({}, {"backend": "cpu"}, force=False)
  assert admit_check.check_budget_fresh({}, {"backend": "cpu"}, force=True) == [
    budget_file.NO_FINGERPRINT
  ]


def _command(*args):
  return run_module("opd_jax.fit_budget", *args)


def test_the_command_writes_the_budget_file_of_a_verl_log(tmp_path):
  log = tmp_path / "verl.jsonl"
  log.write_text(_verl_log())
  out = tmp_path / "budget.json"
  proc = _command(
    f"--records={log}",
    "--format=verl",
    "--quality-key=val/score",
    "--tail=2",
    "--tolerance=0.05",
    "--num-bootstrap=50",
    f"--out={out}",
  )
  assert proc.returncode == 0, proc.stderr
  assert "run int4 (imported): mismatch/kl 0.06, quality_drop 0.1\n" in proc.stdout
  assert "budget: max_kl 0.035 nats/token" in proc.stdout and "rule pooled" in proc.stdout
  doc = json.loads(out.read_text())
  assert doc["rule"]["name"] == "pooled" and doc["fingerprint"] == {}
  assert doc["provenance"]["format"] == "verl" and doc["provenance"]["files"][0]["name"] == str(log)
  assert doc["budget"]["max_kl"] == pytest.approx(0.035)
  assert doc["budget"]["training"]["max_kl"] == pytest.approx(0.035)


def test_the_command_refuses_an_abs_diff_log_without_a_conversion(tmp_path):
  log = tmp_path / "slime.jsonl"
  log.write_text(_slime_log())
  proc = _command(
    f"--records={log}",
    "--format=slime",
    "--quality-key=eval/acc",
    "--tolerance=0.05",
    f"--out={tmp_path / 'b.json'}",
  )
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.startswith("error: slime's `train_rollout_logprob_abs_diff` is a mean abs")
  assert not (tmp_path / "b.json").exists()


def test_files_of_one_name_in_two_folders_stay_two_runs():
  """runs/<exp>/metrics.jsonl: the files' shared name would merge the runs; each is named by
  its path instead."""
  ref = _lines({"step": 1, "rollout_corr/k3_kl": 0.001, "q": 0.8, "source": "reference"})
  a = _lines({"step": 1, "rollout_corr/k3_kl": 0.01, "q": 0.7})
  b = _lines({"step": 1, "rollout_corr/k3_kl": 0.05, "q": 0.5})
  files = [
    ("runs/ref/metrics.jsonl", ref),
    ("runs/a/metrics.jsonl", a),
    ("runs/b/metrics.jsonl", b),
  ]
  records, _ = record_import.import_records(files, "verl", quality_key="q", tail=1)
  assert [r["run"] for r in records] == ["runs/ref/metrics", "runs/a/metrics", "runs/b/metrics"]
  assert [r["mismatch/kl"] for r in records] == [0.001, 0.01, 0.05]


def test_null_qualities_and_early_non_finite_figures_are_steps_without_a_value():
  """W&B or pandas exports write null where a step has no evaluation; a NaN before the tail
  the figure averages is not read."""
  ref = _lines(
    {"step": 1, "rollout_corr/k3_kl": math.nan, "q": None, "source": "reference"},
    {"step": 2, "rollout_corr/k3_kl": 0.001, "q": 0.8},
  )
  run = _lines(
    {"step": 1, "rollout_corr/k3_kl": 0.02, "q": None, "rollout_corr/chi2_token": math.nan},
    {"step": 2, "rollout_corr/k3_kl": 0.03, "q": 0.6, "rollout_corr/chi2_token": 0.06},
  )
  records, _ = record_import.import_records(
    [("ref.jsonl", ref), ("noisy.jsonl", run)], "verl", quality_key="q", tail=1
  )
  assert [(r["mismatch/kl"], r["quality"]) for r in records] == [(0.001, 0.8), (0.03, 0.6)]
  assert records[1]["peer/chi2_token"] == 0.06
