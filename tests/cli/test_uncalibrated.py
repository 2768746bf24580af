"""The uncalibrated default limit: its provenance against the committed study budget, its
verdicts through the one rule path, the admission check without a budget file (in process and
on the command line), and the live guard warning with it.

The candidates are weight noise on the tiny student: σ = 1 reads about 0.016 nats/token and
σ = 3 about 0.14, on either side of the default 0.033.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing import event_accumulator

from opd_jax.cli import admit_check
from opd_jax.io import metrics_writer
from opd_jax.mismatch import admission, budget_file, budget_rules, live_guard
from opd_jax.mismatch import budget as budget_lib
from opd_jax.mismatch import guard as guard_lib
from opd_jax.mismatch.candidates import parse_candidate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))

import base  # noqa: E402
import bf16_sync  # noqa: E402

LIMIT = budget_lib.UNCALIBRATED_MAX_KL
BELOW, ABOVE = "rollout.noise_sigma=1.0", "rollout.noise_sigma=3.0"
STUDY_BUDGET = ROOT / "docs" / "study" / "round7" / "budget.json"  # the current study's
HEADER = (
  "no budget file: using the uncalibrated default limit 0.033 nats/token (the lowest knee over "
  "the calibrated pairs, at the lower end of its interval; calibrate your own with "
  "python -m opd_jax.calibrate)"
)
PROMPTS = 8


def quiet(*args, **kwargs):
  pass


# ---------------------------------------------------------------------------------------------
# The limit and its verdicts


def test_the_default_is_the_lowest_committed_knee_at_the_lower_end_of_its_interval():
  """A knee is a per-source fit that crosses τ on its own records (censored "none"); the
  default is the lowest one's interval's lower end, rounded down to 3 decimals."""
  study, _ = budget_file.load_budget(STUDY_BUDGET)
  knees = {s: t for s, t in study.sources.items() if t.censored == "none"}
  assert sorted(knees) == ["noise"]
  lowest = min(knees.values(), key=lambda t: t.max_kl)
  assert lowest.max_kl == pytest.approx(0.0468, abs=1e-4)
  assert LIMIT == math.floor(lowest.interval[0] * 1000) / 1000 == 0.033
  assert LIMIT < lowest.max_kl < study.max_kl
  assert f"{LIMIT:g} nats/token" in budget_lib.uncalibrated_note()


def test_the_default_is_one_pooled_limit_whatever_the_sources_or_conservative():
  default = budget_lib.uncalibrated_budget()
  assert budget_lib.is_uncalibrated(default) and default.rule == budget_lib.POOLED
  assert default.training is None and not default.sources and not default.layers
  study, _ = budget_file.load_budget(STUDY_BUDGET)
  assert not budget_lib.is_uncalibrated(study)
  for source in ("", "noise", "noise+stale", "fp8_weights+fp8_kv"):
    for rule in (None, budget_lib.POOLED.with_params(conservative=True), budget_lib.Rule("whole")):
      at = budget_rules.apply_rule({"mismatch/kl": LIMIT, "source": source}, default, rule)
      assert at.admitted and at.limit == LIMIT and at.margin == 0.0 and not at.too_close
      over = budget_rules.apply_rule({"mismatch/kl": 0.04, "source": source}, default, rule)
      assert not over.admitted and over.margin == pytest.approx(LIMIT - 0.04)
      assert over.reasons == (
        "mismatch/kl 0.04 > 0.033, the uncalibrated default limit (no calibration record of "
        "this model behind it): margin -0.007",
      )


def test_the_checks_verdict_path_takes_the_default_as_any_budget():
  config = bf16_sync.get_config("tiny")
  candidate = parse_candidate(BELOW, config)
  default = budget_lib.uncalibrated_budget()
  for kl, admitted in ((LIMIT - 1e-4, True), (LIMIT + 1e-4, False)):
    out, verdict = admission.candidate_verdict(
      candidate, config, {"mismatch/kl": kl}, default, None
    )
    assert out["source"] == "noise" and verdict.rule == "pooled"
    assert verdict.admitted == admitted and verdict.limit == LIMIT


def test_the_name_uncalibrated_loads_the_default_without_a_fingerprint(tmp_path):
  default, fp = budget_file.load_budget_or_default(budget_lib.UNCALIBRATED)
  assert fp is None and default == budget_lib.uncalibrated_budget()
  with pytest.raises(FileNotFoundError):
    budget_file.load_budget_or_default(tmp_path / "uncalibrated")  # a path is a file


# ---------------------------------------------------------------------------------------------
# The admission check without a budget file


@pytest.fixture(scope="module")
def config(tmp_path_factory):
  c = bf16_sync.get_config("tiny")
  c.teacher.cache_dir = str(tmp_path_factory.mktemp("teacher_cache"))
  return c


@pytest.fixture(scope="module")
def checked(config, tmp_path_factory):
  """A check of σ = 1 and σ = 3 with no budget file: (result, printed lines, workdir)."""
  workdir = tmp_path_factory.mktemp("admit")
  lines = []
  result = admit_check.run_admission(
    config,
    None,
    [BELOW, ABOVE],
    num_prompts=PROMPTS,
    workdir=str(workdir),
    json_path=str(workdir / "out.json"),
    log=lambda *a: lines.append(" ".join(str(x) for x in a)),
  )
  return result, lines, workdir


def test_without_a_budget_a_candidate_below_the_default_is_admitted_one_above_refused(checked):
  below, above = checked[0]["rows"]
  assert 0 < below["mismatch/kl"] < LIMIT < above["mismatch/kl"]
  assert below["admitted"] and below["verdict"] == "admitted" and below["reasons"] == []
  assert not above["admitted"] and above["verdict"] == "rejected"
  assert above["reasons"][0].endswith(
    "the uncalibrated default limit (no calibration record of this model behind it): "
    f"margin {LIMIT - above['mismatch/kl']:.4g}"
  )
  for row in (below, above):
    assert row["max_kl"] == LIMIT and row["rule"] == "pooled"
    assert row["margin"] == pytest.approx(LIMIT - row["mismatch/kl"], abs=1e-15)
    assert row["budget"] == row["limit_from"] == "uncalibrated default"
    assert row["call"] == "uncalibrated" and row["limit_band"] == [LIMIT, LIMIT]


def test_without_a_budget_the_header_the_table_and_the_json_say_uncalibrated(checked):
  result, lines, workdir = checked
  assert lines[-2].startswith(HEADER + "; rule: pooled, not validated; student: ")
  table = lines[-1].splitlines()
  assert all("uncalibrated default" in line for line in table[2:] if not line.startswith(" "))
  written = json.loads((workdir / "out.json").read_text())
  assert written["budget"] == {
    "name": "uncalibrated default",
    "calibrated": False,
    "file": None,
    "max_kl": LIMIT,
    "interval": [LIMIT, LIMIT],
    "conservative": False,
    "rule": {"name": "pooled", "params": {"conservative": False}, "validation": None},
    "note": HEADER.removeprefix("no budget file: using "),
  }
  assert written["rows"] == result["rows"]
  assert written["stale_budget_reasons"] == [] and not written["forced"]
  entries = [json.loads(x) for x in (workdir / admit_check.LOG_FILE).read_text().splitlines()]
  assert [(e["budget_file"], e["budget"]) for e in entries] == [(None, "uncalibrated default")] * 2


def test_the_command_line_without_budget_checks_against_the_default(config, checked):
  _, _, workdir = checked  # its teacher and student caches: nothing is trained again
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "opd_jax.admit",
      "--config=configs/bf16_sync.py:tiny",
      f"--config.teacher.cache_dir={config.teacher.cache_dir}",
      f"--workdir={workdir}",
      f"--candidate={ABOVE}",
      f"--prompts={PROMPTS}",
      "--json=-",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 1, proc.stderr  # its one candidate is refused
  assert HEADER in proc.stderr
  result = json.loads(proc.stdout)
  (row,) = result["rows"]
  assert (row["budget"], row["verdict"], row["max_kl"]) == (
    "uncalibrated default",
    "rejected",
    LIMIT,
  )
  # the same measurement, compiled without backend optimisation (--fast-compile): ~1e-7 apart
  assert row["mismatch/kl"] == pytest.approx(checked[0]["rows"][1]["mismatch/kl"], rel=1e-5)
  assert result["budget"]["calibrated"] is False


# ---------------------------------------------------------------------------------------------
# The live guard with the default


def test_the_guard_warns_when_the_training_mismatch_exceeds_the_default():
  """Training-time values are compared with the default itself (it has no training axis), on
  every rung, and a warning names the limit as uncalibrated."""
  r = base.get_config().rollout
  r.noise_sigma = 1.0
  ladder = guard_lib.fallback_ladder(r)
  default = budget_lib.uncalibrated_budget()
  guard = guard_lib.Guard(
    default, ladder, "warn", 2, smoothing=0.0, sources=("noise", "reference"), rule=default.rule
  )
  assert guard.on_axis("training") is guard.on_axis("check") is default
  assert [guard.limit_of(i, axis) for i in (0, 1) for axis in ("training", "check")] == [LIMIT] * 4
  decisions = {}
  for step, kl in enumerate([0.02, 0.05, 0.02, 0.05, 0.05, 0.05], 1):
    decision = guard.observe(step, {"mismatch/kl": kl})
    if decision is not None:
      decisions[step] = decision
  assert list(decisions) == [5]  # two consecutive steps over 0.033; one within resets the count
  assert decisions[5].kind == "warn" and decisions[5].rung == 0
  assert decisions[5].reason == (
    "mismatch/kl (moving average 0.05) over the uncalibrated default limit 0.033 for 2 "
    "consecutive steps"
  )
  assert guard.scalars()["budget/max_kl"] == LIMIT


def test_the_guard_runs_the_default_only_to_warn():
  b = base.get_config().budget
  b.file = budget_lib.UNCALIBRATED
  assert live_guard.uncalibrated_problem(b) is None  # action warn, the default
  for action in ("fallback", "adaptive"):
    b.action = action
    assert f"budget.action='{action}' would change the run's engine" in (
      live_guard.uncalibrated_problem(b)
    )
  b.file = "budget.json"  # a calibrated file may act
  assert live_guard.uncalibrated_problem(b) is None


def test_an_acting_guard_on_the_default_is_refused_before_anything_loads(tmp_path):
  config = bf16_sync.get_config("tiny")
  config.teacher.cache_dir = str(tmp_path / "teacher_cache")
  config.budget.file, config.budget.action = budget_lib.UNCALIBRATED, "fallback"
  with pytest.raises(ValueError, match=r"only warns: budget\.action='fallback'"):
    live_guard.run(config, str(tmp_path / "run"), log=quiet)
  assert not (tmp_path / "run").exists() and not (tmp_path / "teacher_cache").exists()


def test_a_noisy_run_guarded_by_the_default_warns_every_step_and_trains_on(tmp_path):
  """σ = 3 reads about 0.1 nats/token at training time, over 0.033 at every step: with
  patience 1 and no smoothing each step warns, the engine is never changed, and no budget
  file or fingerprint is needed."""
  config = bf16_sync.get_config("tiny")
  config.teacher.cache_dir = str(tmp_path / "teacher_cache")
  config.rollout.noise_sigma = 3.0
  config.budget.file = budget_lib.UNCALIBRATED
  config.budget.patience, config.budget.smoothing = 1, 0.0
  lines = []
  workdir = tmp_path / "run"
  result = live_guard.run(config, str(workdir), log=lambda *a: lines.append(" ".join(map(str, a))))
  assert result["end_step"] == 6
  text = "\n".join(lines)
  assert f"budget guard: {budget_lib.uncalibrated_note()}, rule pooled, not validated" in text
  assert "compared with this check-axis limit: there is no training-axis default" in text
  warned = [s for s in range(1, 7) if f"step {s}: budget guard: warn: mismatch/kl" in text]
  assert warned == [1, 2, 3, 4, 5, 6]
  assert "over the uncalibrated default limit 0.033 for 1 consecutive steps" in text
  assert "switch" not in text
  logged = {s: r for s, r in metrics_writer.read_jsonl(workdir).items() if "budget/max_kl" in r}
  assert sorted(logged) == [2, 4, 6]
  for r in logged.values():
    assert r["budget/max_kl"] == LIMIT and r["mismatch/kl"] > LIMIT and r["budget/rung"] == 0.0
  events = event_accumulator.EventAccumulator(str(workdir / "tb"))
  events.Reload()
  texts = [t.tensor_proto.string_val[0].decode() for t in events.Tensors("budget/events")]
  assert len(texts) == 6 and all(t.startswith("warn: mismatch/kl") for t in texts)
