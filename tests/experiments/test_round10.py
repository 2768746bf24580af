"""Round 10's config (configs/round10.py) and its pieces: the calibration runs are the ladders'
own (their configs hash alike, so a copied ladders workdir is reused), the held-out draw
(`format_lookup.draw_held_out`) on hand-built ladder labels, the format lookup baseline by
hand, and the refusal to build the study before the draw is pasted."""

import json
import os
import sys
from pathlib import Path

import ml_collections
import pytest

from opd_jax import validation as validation_command
from opd_jax.config import check as config_check
from opd_jax.experiments import (
  baselines,
  format_lookup,
  study,
  study_plan,
  study_probe,
  study_setting,
  validation,
)
from opd_jax.io import provenance
from opd_jax.mismatch import candidates as candidates_lib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))
import ladders  # noqa: E402  (configs/ladders.py)
import round10  # noqa: E402  (configs/round10.py)

CACHE = "/ladders/teacher_cache"  # the teacher cache path the ladders' runs recorded

# Hand-built ladder labels (spec -> kept): INT4 degrades from groups of 128 (per channel kept,
# per tensor degraded: the table refuses from the finest degraded rung on), FP4 from groups of
# 128, FP8 never; FP4 KV per tensor with every layer quantized, and nothing else of the KV;
# the lag from k 8 on.
DEGRADED = {
  ladders.INT4[2],  # group 128
  ladders.INT4[4],  # per tensor
  ladders.FP4[2],  # group 128
  "rollout.kv_cache=fp4,rollout.kv_granularity=tensor",
  *ladders.LAG[3:],  # k 8, 12, 16
}
VERDICTS = {spec: spec not in DEGRADED for spec in ladders.LADDERS}


def _run():
  return ladders.get_config().run


def _draw(verdicts=VERDICTS, **kw):
  args = dict(
    seed=round10.HELD_OUT_SEED,
    size=round10.HELD_OUT_SIZE,
    degraded_share=round10.DEGRADED_SHARE,
    singles=round10.SINGLES,
    knobs=round10.KNOBS,
  )
  args.update(kw)
  return format_lookup.draw_held_out(verdicts, _run(), **args)


def test_the_config_refuses_to_build_before_its_draw_is_pasted(monkeypatch):
  monkeypatch.setattr(round10, "HELD_OUT", ())  # as it was before the draw was pasted
  with pytest.raises(ValueError, match="held-out settings are not drawn yet: run `python -m"):
    round10.get_config()
  with pytest.raises(ValueError, match="unknown variant"):
    round10.get_config("full")
  tiny = round10.get_config("tiny")  # the wiring variant has its own list
  assert tuple(tiny.held_out) == round10.TINY_HELD_OUT
  monkeypatch.undo()  # the committed draw
  c = round10.get_config()
  assert len(c.held_out) == 30 and len(set(c.held_out)) == 30
  assert not set(c.held_out) & set(ladders.LADDERS) and c.analysis.too_close == "refuse"
  assert c.rule == c.analysis.primary == "sum_of_fractions"
  assert tuple(c.analysis.must_beat) == ("lookup",)
  assert set(c.analysis.mcnemar_against) == {"admit_all", "pooled", "lookup"}


@pytest.mark.parametrize("arg", [None, "tiny"])
def test_calibration_runs_hash_as_the_ladders_do(arg, monkeypatch, tmp_path):
  monkeypatch.setattr(round10, "HELD_OUT", tuple(s for s, _ in _draw()))
  mine, theirs = round10.get_config(arg), ladders.get_config(arg)
  for c in (mine, theirs):
    c.run.teacher.cache_dir = CACHE  # as `--config.run.teacher.cache_dir=LADDERS/...` sets it
  for key in ("seeds", "probe_steps", "probe_lag", "num_prompts", "num_eval", "tolerance"):
    assert mine[key] == theirs[key], key
  for key in ("label", "per_source", "per_part", "min_crossing_records", "extrapolate"):
    assert mine[key] == theirs[key], key
  assert tuple(mine.borderline_seeds) == tuple(theirs.borderline_seeds)
  workdir = str(tmp_path / "r10")
  ours = {s.name: s for s in study_setting.study_settings(mine) if s.role != "held_out"}
  ref = {s.name: s for s in study_setting.study_settings(theirs)}
  assert ours == ref  # same names, specs, sources, seeds

  def digest(cfg):
    return provenance.config_sha256(cfg)

  for name, s in ref.items():
    a = study_setting.run_config(mine, ours[name], workdir)
    b = study_setting.run_config(theirs, s, str(tmp_path / "ladders"))
    assert digest(a) == digest(b), name
    for seed in theirs.borderline_seeds:
      assert digest(study.rerun_job(mine, s, seed, workdir)[0]) == digest(
        study.rerun_job(theirs, s, seed, workdir)[0]
      )
  # the probe too (every held-out lag is within the ladders' largest)
  probe = study_probe.probe_config(mine, study_setting.study_settings(mine), workdir)
  theirs_probe = study_probe.probe_config(theirs, study_setting.study_settings(theirs), workdir)
  assert digest(probe) == digest(theirs_probe)


def test_the_plan_reuses_a_copied_ladders_workdir(monkeypatch, tmp_path):
  """The ladders' finished runs (each result.json keyed by its config), their probe and their
  measurements, copied into round 10's workdir, are reused: only the held-out runs train."""
  monkeypatch.setattr(round10, "HELD_OUT", tuple(s for s, _ in _draw()))
  theirs, mine = ladders.get_config(), round10.get_config()
  for c in (theirs, mine):
    c.run.teacher.cache_dir = CACHE
  workdir = tmp_path / "r10"
  settings = study_setting.study_settings(theirs)
  extra = [int(x) for x in theirs.borderline_seeds]
  for s in settings:
    jobs = [(study_setting.run_config(theirs, s, "x"), workdir / "runs" / s.name)]
    if s.role == "calibration":
      jobs += [study.rerun_job(theirs, s, seed, str(workdir)) for seed in extra]
    for cfg, run_dir in jobs:
      os.makedirs(run_dir)
      with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump({"config": study.runs.config_repr(cfg)}, f)
  os.makedirs(workdir / "runs" / "probe" / "checkpoints" / "65")
  specs = study_plan.measurement_specs(theirs, settings)
  with open(workdir / "measurements.json", "w") as f:
    json.dump({"fingerprint": None, "measurements": dict.fromkeys(specs, {})}, f)
  plan = study_plan.study_plan(mine, str(workdir))
  assert plan["counts"] == {"train": 90, "reused": 92, "refused": 0}
  assert {r["role"] for r in plan["runs"] if r["state"] == "train"} == {"held_out"}
  assert plan["probe"]["state"] == "reused" and plan["measurements"]["cached"] == 30
  # 90 runs of 600 steps two side by side at 0.3 s per step, and each measurement not cached
  assert plan["seconds"] == pytest.approx(8100 + 10 * (plan["measurements"]["n"] - 30))
  cut = ladders.get_config()  # the ladders run elsewhere: another cache path, refused
  cut.run.teacher.cache_dir = "/elsewhere"
  assert study_plan.study_plan(cut, str(workdir))["counts"]["refused"] == 92


def test_the_draw_is_fixed_by_its_seed_and_aims_at_the_share():
  drawn = _draw()
  assert drawn == _draw()  # a function of its arguments
  assert drawn != _draw(seed=round10.HELD_OUT_SEED + 1)
  specs = [s for s, _ in drawn]
  assert len(specs) == 30 and sum(d for _, d in drawn) == 12  # 40 % predicted degraded
  assert tuple(specs[:6]) == round10.SINGLES
  canon = [frozenset(s.split(",")) for s in specs]
  assert len(set(canon)) == 30
  assert not set(canon) & {frozenset(s.split(",")) for s in ladders.LADDERS}
  table = format_lookup.table_from_verdicts(VERDICTS, _run())
  for spec, degraded in drawn:
    assert "noise" not in spec
    c = candidates_lib.parse_candidate(spec, _run())
    config_check.validate(c.config)
    assert c.lag <= 16  # the ladders' probe holds the stale weights
    assert degraded == (not format_lookup.admits(spec, table, _run()))
  # the singles by hand: INT4 and FP4 groups of 64 and FP8 groups of 64 lie below their
  # ladders' finest degraded rung (128; FP8 none); k 6 < 8 is admitted and k 10, 14 refused.
  assert [d for _, d in drawn[:6]] == [False] * 4 + [True, True]
  assert sum(len(format_lookup.parts(s, _run())) > 1 for s in specs[6:]) >= 15  # combinations
  assert not any("int8" in s or "fp8_e5m2" in s.split("kv_cache")[0] for s in specs)


def test_the_draw_refuses_a_share_it_cannot_reach():
  with pytest.raises(ValueError, match="not in"):
    _draw(degraded_share=0.6)
  kept_all = dict.fromkeys(ladders.LADDERS, True)  # the table refuses nothing
  with pytest.raises(ValueError, match="predicted degraded short of 12: the ladders' table"):
    _draw(kept_all, max_draws_per_setting=5)
  with pytest.raises(ValueError, match="calibration setting"):
    _draw(singles=(ladders.LAG[0],))


def _rows():
  """Calibration rows (spec, drop) against τ 0.01, hand-labelled."""
  calibration = [
    ("rollout.weights=int4,rollout.weight_group_size=16", 0.0),
    ("rollout.weights=int4,rollout.weight_group_size=32", 0.005),
    ("rollout.weights=int4,rollout.weight_group_size=128", 0.02),  # degraded
    ("rollout.weights=int4", 0.0),  # kept, but coarser than group 128
    ("rollout.kv_cache=fp8,rollout.kv_granularity=token_head", 0.0),
    ("rollout.kv_cache=fp8,rollout.kv_granularity=tensor", 0.03),  # degraded
    ("rollout.kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kv_bf16_layers=(0,)", 0.0),
    ("rollout.mode=async,rollout.max_lag=2", 0.0),
    ("rollout.stale_k=4", 0.0),
    ("rollout.stale_k=8", 0.05),  # degraded
    ("rollout.stale_k=12", 0.0),  # kept, but coarser than k 8
    ("rollout.weights=fp8,rollout.stale_k=2", 0.5),  # a combination: on no one ladder
  ]
  return [{"spec": s, "role": "calibration", "label_drop": d} for s, d in calibration]


# held-out spec -> the lookup table's verdict by hand
LOOKUP = {
  "rollout.weights=int4,rollout.weight_group_size=64": True,  # finer than group 128
  "rollout.weights=int4,rollout.weight_per_tensor=true": False,  # coarser
  "rollout.weights=int4": False,  # per channel: coarser than group 128, though it kept
  "rollout.weights=int8,rollout.weight_per_tensor=true": True,  # no INT8 ladder
  "rollout.weights=fp8": True,  # FP8 weights: only in a combination, so no ladder
  "rollout.kv_cache=fp8,rollout.kv_granularity=tensor,rollout.kv_bf16_layers=(0,)": True,
  "rollout.kv_cache=fp8_e5m2,rollout.kv_granularity=tensor": True,  # no E5M2 KV ladder here
  "rollout.mode=async,rollout.max_lag=1": True,
  "rollout.stale_k=6": True,
  "rollout.stale_k=16": False,
  "rollout.weights=int8,rollout.kv_cache=fp8,rollout.kv_granularity=tensor": False,  # the KV
  "rollout.weights=int4,rollout.weight_group_size=16,rollout.stale_k=4": True,
  "rollout.weights=int4,rollout.weight_group_size=32,rollout.mode=async,rollout.max_lag=2": True,
  "rollout.kv_cache=fp8,rollout.kv_granularity=token_head,rollout.stale_k=10": False,  # k 10
}


def test_the_lookup_table_by_hand():
  run = _run()
  table = format_lookup.table_from_rows(_rows(), 0.01, run, "label_drop")
  assert table["int4_weights"] == {
    "rungs": 4,
    "degraded": 1,
    "refuse_from": "group 128",
    "refuse_rung": [0, 128],
  }
  assert table["fp8_kv"]["refuse_from"] == "per tensor"
  assert table["fp8_kv+bf16_layers=(0,)"]["refuse_from"] is None
  assert table["stale"] == {"rungs": 4, "degraded": 1, "refuse_from": "k 8", "refuse_rung": [8]}
  assert "fp8_weights" not in table  # the combination is left out
  assert format_lookup.refusal_text(table) == (
    "fp8_kv from per tensor, int4_weights from group 128, stale from k 8"
  )
  got = {spec: format_lookup.admits(spec, table, run) for spec in LOOKUP}
  assert got == LOOKUP
  refused = format_lookup.refused_parts(
    "rollout.weights=int4,rollout.kv_cache=fp8,rollout.kv_granularity=tensor,rollout.stale_k=8",
    table,
    run,
  )
  assert [p.ladder for p in refused] == ["stale", "int4_weights", "fp8_kv"]


def _result():
  """_rows as a study, with five held-out settings: (spec, drop, the rule's verdict)."""
  held = [
    ("rollout.weights=int4,rollout.weight_group_size=64", 0.0, True),  # lookup admits: right
    ("rollout.weights=int4", 0.0, True),  # lookup refuses: wrong
    ("rollout.stale_k=6", 0.0, True),  # lookup admits: right
    ("rollout.stale_k=16", 0.04, False),  # lookup refuses: right
    ("rollout.weights=int8,rollout.stale_k=10", 0.0, True),  # lookup refuses: wrong
  ]

  def row(spec, role, drop, admitted=True):
    q = -(0.1 + drop)
    return {
      "name": spec,
      "spec": spec,
      "role": role,
      "source": "x",
      "mismatch/kl": 0.0,
      "label_drop": drop,
      "admitted": admitted,
      "admitted_pooled": True,
      "too_close": False,
      "accuracy_runs": [0.6, 0.6],
      "teacher_kl_runs": [-q, -q],
      "quality_runs": [q, q],
    }

  rows = [row("rollout.weights=trainer", "reference", 0.0)]
  rows += [row(r["spec"], "calibration", r["label_drop"]) for r in _rows()]
  rows += [row(s, "held_out", d, a) for s, d, a in held]
  return {
    "rows": rows,
    "tolerance": 0.01,
    "label": "teacher_kl",
    "num_eval": 256,
    "noise_floor": {"mean": -0.1},
  }


def _config():
  c = ml_collections.ConfigDict()
  c.run = ladders.get_config("tiny").run
  c.analysis = ml_collections.ConfigDict(round10.ANALYSIS)
  return c


def test_validate_scores_the_lookup_baseline_by_hand():
  out = validation.validate(_result(), _config())
  assert out["baselines"] == ["pooled", "admit_all", "lookup"] and "thresholds" not in out
  assert out["lookup"]["stale"]["refuse_from"] == "k 8"
  block = out["primary_label"]
  assert [s["lookup"] for s in out["settings"]] == [True, False, True, False, False]
  # the rule is right on all 5; lookup on 3 (it refuses INT4 per channel and INT8 + k 10,
  # which kept); McNemar: b = 2, c = 0, p = 1/4.
  assert block["sum_of_fractions"]["agreement"] == 1.0
  assert block["lookup"]["agreement"] == pytest.approx(0.6)
  t = block["tests"]["lookup"]
  assert (t["rule_only_right"], t["other_only_right"], t["mcnemar_p"]) == (2, 0, 0.25)
  # agreement ≥ 90 % but not beating the lookup table at α 0.05: the goal is not met
  assert block["must_beat"] == ["lookup"] and not block["goal_met"]
  text = study_report_markdown(out)
  assert "Format lookup table: refuses fp8_kv from per tensor" in text
  assert "| lookup | 3/5 = 60.0%" in text


def study_report_markdown(validated):
  from opd_jax.experiments import study_report

  return study_report.validation_markdown(
    {"validation": validated, "primary": "sum_of_fractions", "one_scale": {}, "factorial": []}
  )


def test_an_unknown_baseline_is_refused():
  config = _config()
  config.analysis.baselines = ("pooled", "oracle")
  with pytest.raises(ValueError, match=r"names \['oracle'\]"):
    baselines.baseline_verdicts(_result(), [], config)


def test_the_draw_command_prints_lines_to_paste(tmp_path, capsys):
  rows = [
    {"spec": s, "role": "calibration", "label_drop": 0.0 if kept else 0.1}
    for s, kept in VERDICTS.items()
  ]
  study_json = tmp_path / "study.json"
  study_json.write_text(json.dumps({"rows": rows, "tolerance": 0.01}))
  config = str(ROOT / "configs" / "round10.py")
  validation_command.main(["--draw-held-out", f"--study={study_json}", f"--config={config}"])
  text = capsys.readouterr().out
  assert text.startswith("# The ladders' lookup table refuses fp4_kv from per tensor, ")
  assert max(map(len, text.splitlines())) <= 100  # pasted as the formatter leaves it
  namespace = {}
  exec(text, namespace)  # the lines are Python
  assert namespace["HELD_OUT"] == tuple(s for s, _ in _draw())
  study_json.write_text(json.dumps({"rows": rows[1:], "tolerance": 0.01}))
  with pytest.raises(ValueError, match="calibration settings are not"):
    validation_command.main(["--draw-held-out", f"--study={study_json}", f"--config={config}"])
  with pytest.raises(ValueError, match="defines no draw_config"):
    validation_command.main(
      [
        "--draw-held-out",
        f"--study={study_json}",
        f"--config={ROOT / 'configs' / 'validation.py'}",
      ]
    )


@pytest.mark.slow
def test_tiny_round_reuses_the_ladders_runs_end_to_end(tmp_path, capsys):
  """`configs/ladders.py:tiny` run, its runs and measurements copied into a fresh workdir, and
  `configs/round10.py:tiny` run there with the ladders' teacher cache: nothing of the ladders
  trains or is measured again, only the held-out settings; then the round is scored, the
  lookup table among its baselines."""
  import shutil
  import subprocess

  theirs, mine = tmp_path / "ladders", tmp_path / "r10"
  cache = f"--config.run.teacher.cache_dir={theirs / 'teacher_cache'}"

  def run_study(name, workdir):
    cmd = [sys.executable, "-m", "opd_jax.study", f"--config={ROOT / 'configs' / name}:tiny"]
    done = subprocess.run(
      [*cmd, f"--workdir={workdir}", cache], capture_output=True, text=True, cwd=ROOT, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr

  run_study("ladders.py", theirs)
  mine.mkdir()
  shutil.copytree(theirs / "runs", mine / "runs")
  shutil.copy(theirs / "measurements.json", mine / "measurements.json")
  mtimes = {p.name: p.stat().st_mtime for p in (mine / "runs").glob("*/result.json")}
  log = run_study("round10.py", mine)
  assert f"probe: {ladders.get_config('tiny').probe_steps} reference steps" not in log
  assert {p.name: p.stat().st_mtime for p in (mine / "runs").glob("*/result.json")} == mtimes
  measured = [
    line.split("measured ")[1].split(":")[0] for line in log.splitlines() if "measured " in line
  ]
  assert measured and not set(measured) & set(ladders.TINY)  # the ladders' were reused
  result = json.loads((mine / "study.json").read_text())
  held = [r for r in result["rows"] if r["role"] == "held_out"]
  assert [r["spec"] for r in held] == list(round10.TINY_HELD_OUT)
  assert all(len(r["quality_runs"]) == 2 for r in result["rows"] if r["role"] != "reference")
  out = tmp_path / "v.json"
  config = f"{ROOT / 'configs' / 'round10.py'}:tiny"
  validation_command.main([f"--study={mine / 'study.json'}", f"--config={config}", f"--json={out}"])
  scored = json.loads(out.read_text())["validation"]
  assert scored["n"] == 2 and scored["baselines"] == ["pooled", "admit_all", "lookup"]
  assert "Format lookup table: refuses" in capsys.readouterr().out
