"""OPD against RL on the GRPO baseline that learns (`configs/opd_vs_rl_learns.py`): its blocks,
its shared bases, the cost plan and its parts counted by hand, the T = 1 summaries, and the
`:tiny` wiring run end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opd_jax.config import check as config_check
from opd_jax.experiments import opd_vs_rl, opd_vs_rl_arms, opd_vs_rl_plan, opd_vs_rl_report, runs
from opd_jax.io import json_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "configs"))
import grpo_practice  # noqa: E402
import opd_vs_rl_learns as learns  # noqa: E402

ASYNC, STALE_16 = "mode-async_max_lag-1", "stale_k-16"
NOISE_RUNGS = {"noise_sigma-0.1", "noise_sigma-0.2", "noise_sigma-0.4"}


def _cells(config):
  out: dict = {}
  for m, s, _, seed, _ in opd_vs_rl.plan(config):
    out.setdefault((m, s), []).append(seed)
  return out


def test_the_config_states_its_blocks_and_every_arm_has_three_noise_rungs():
  config = learns.get_config()
  config_check.validate(config.run)
  config_check.validate(config.grpo_run)
  blocks = opd_vs_rl.blocks(config)
  assert [(len(m), len(s), seeds) for m, s, seeds in blocks] == [
    (4, 5, [0, 1, 2, 3, 4]),
    (4, 5, [0, 1]),
    (8, 2, [0, 1]),
  ]
  assert blocks[0][0] == ("opd", "opd_sampled", "grpo", "grpo_tis")
  assert set(blocks[1][0]) == {"opd_sampled_tis", "grpo_mis", "grpo_seq_tis", "grpo_seq_mis"}
  cells = _cells(config)
  # 4 × 6 × 5 + 4 × 6 × 2 + 8 × 2 × 2 (the ladder's references are the first blocks') = 200
  assert sum(map(len, cells.values())) == 200
  assert cells[("grpo_tis", ASYNC)] == [0, 1, 2, 3, 4] and cells[("opd", "reference")] == [
    0,
    1,
    2,
    3,
    4,
  ]
  assert cells[("grpo_seq_mis", STALE_16)] == [0, 1]
  for method in learns.HEADLINE + learns.REST:
    assert {s for m, s in cells if m == method} >= NOISE_RUNGS, method
  assert config.matched_settings == (*learns.LADDER, learns.NOISE)


def test_every_arm_shares_the_warm_start_and_the_grpo_arms_take_the_named_recipe(monkeypatch):
  config = learns.get_config()
  opd_base = grpo_practice.get_config("opd")
  shared = [
    k
    for k in runs.config_repr(opd_base)
    if k.startswith(opd_vs_rl_arms.SHARED_PREFIXES) and k not in opd_vs_rl_arms.NOT_SHARED
  ]
  want = {k: runs.config_repr(opd_base)[k] for k in shared}
  for method, _, _, _, run in opd_vs_rl.plan(config):
    got = runs.config_repr(run)
    assert {k: got[k] for k in shared} == want, method
    assert run.student.warmup_steps == grpo_practice.WARMUP_STEPS and run.train.eval_sampled
    if method.startswith("grpo"):
      assert (run.train.loss, run.train.lr, run.data.batch_size) == ("grpo", 1e-4, 64)
      assert (run.rollout.samples_per_prompt, run.train.ppo_minibatches) == (8, 1)
      correction = "none" if method == "grpo" else method.removeprefix("grpo_")
      assert run.train.mismatch_correction == correction
    else:
      assert run.train.loss.startswith("reverse_kl") and run.data.batch_size == 32
  monkeypatch.setattr(learns, "GRPO_RECIPE", "grpo_lr1e4_n256")
  assert learns.get_config().grpo_run.data.batch_size == 32  # one line picks the recipe
  monkeypatch.setattr(learns, "GRPO_RECIPE", "grpo_lr1e4_n1024")
  with pytest.raises(ValueError, match="not an arm of grpo_sweep.py"):
    learns.get_config()


def test_a_grpo_base_that_shares_too_little_is_refused_and_corrections_are_added():
  config = learns.get_config("tiny")
  config.grpo_run.student.warmup_steps = 6
  with pytest.raises(ValueError, match=r"differs in: student.warmup_steps \(5 vs 6\)"):
    opd_vs_rl.plan(config)
  config = learns.get_config("tiny")
  config.grpo_run.train.loss = "reverse_kl_full"
  with pytest.raises(ValueError, match="grpo_run.train.loss is 'reverse_kl_full'"):
    opd_vs_rl.plan(config)
  assert opd_vs_rl_arms.grpo_correction("grpo", 2.0) == {"train.mismatch_correction": "none"}
  assert opd_vs_rl_arms.grpo_correction("grpo_seq_mis", 3.0) == {
    "train.mismatch_correction": "seq_mis",
    "train.mismatch_clip": 3.0,
  }
  with pytest.raises(ValueError, match="is not a GRPO arm"):
    opd_vs_rl_arms.grpo_correction("opd", 2.0)
  with pytest.raises(ValueError, match="is_clip > 1"):
    opd_vs_rl_arms.grpo_correction("grpo_tis", 1.0)


def test_full_plan_counts_cost_and_parts_by_hand(tmp_path):
  plan = opd_vs_rl_plan.comparison_plan(learns.get_config(), str(tmp_path / "cmp"))
  assert [b["runs"] for b in plan["blocks"]] == [120, 48, 32]
  assert plan["counts"] == {"train": 200, "reused": 0, "refused": 0}
  rows = plan["runs"]
  grpo = [r for r in rows if r["method"].startswith("grpo")]
  # GRPO: 2 × 6 × 5 + 3 × 6 × 2 + 5 × 2 × 2 = 116 runs of 512 completions per step, 400 s each;
  # OPD: 84 runs of 35 s; one compile of 30 s per cell, 8 arms × 8 settings; two side by side
  # at 1.18×; the teacher and warm start (not cached) 480 s.
  assert len(grpo) == 116 and [r["seconds"] for r in grpo] == pytest.approx([400.0] * 116)
  assert {r["seconds"] for r in rows if r not in grpo} == {35.0}
  assert sum(r["compile"] > 0 for r in rows) == 64
  seconds = (116 * 400 + 84 * 35 + 64 * 30) / 1.18 + 480  # 12.2 h
  assert plan["seconds"] == pytest.approx(seconds)
  parts = plan["parts"]
  assert sum(p["runs"] for p in parts) == 200 and len(parts) == 7
  assert all(p["planned_seconds"] <= 7200 for p in parts)
  assert sum(p["seconds"] for p in parts) == pytest.approx(seconds - 480)
  assert opd_vs_rl_plan.part_names(plan, 1)[0] == "opd__reference"
  with pytest.raises(ValueError, match="the plan has parts 1 to 7"):
    opd_vs_rl_plan.part_names(plan, 8)
  lines = opd_vs_rl_plan.plan_lines(plan)
  assert lines[0] == "plan: 200 runs (200 to train, 0 reused, 0 recorded for another configuration)"
  assert lines[1].startswith("  block 1: 4 arms x 6 settings (the reference and 5) x 5 seeds: 120")


def test_plan_reuses_a_recorded_run_and_refuses_another_configurations(tmp_path):
  """:tiny, one worker: OPD 35 × 4/400 = 0.35 s, GRPO (16 completions) 200/256 × 16 × 4/400 =
  0.125 s, 4 cells × 30 s, the teacher 480 s until its cache holds something."""
  config, workdir = learns.get_config("tiny"), str(tmp_path / "cmp")
  plan = opd_vs_rl_plan.comparison_plan(config, workdir)
  assert plan["seconds"] == pytest.approx(2 * 0.35 + 2 * 0.125 + 4 * 30 + 480)
  todo = opd_vs_rl.plan(opd_vs_rl.resolved(config, workdir))
  (m0, s0, _, seed0, run0), (m1, s1, _, seed1, run1) = todo[:2]
  for (m, s, seed), run in (((m0, s0, seed0), run0), ((m1, s1, seed1), run0)):
    result = {"config": runs.config_repr(run)}
    json_file.write_json(
      os.path.join(workdir, "runs", opd_vs_rl.run_name(m, s, seed), "result.json"), result
    )
  os.makedirs(os.path.join(workdir, "teacher_cache", "teacher-x"))
  plan = opd_vs_rl_plan.comparison_plan(config, workdir)
  assert [r["state"] for r in plan["runs"]] == ["reused", "refused", "train", "train"]
  assert plan["teacher_seconds"] == 0.0
  assert plan["seconds"] == pytest.approx(0.35 + 0.125 + 2 * 30)  # the cells still to train
  assert "reused: opd__reference" in opd_vs_rl_plan.plan_lines(plan)


def test_plan_measures_its_cost_constants_on_finished_runs(tmp_path):
  """:tiny, one worker (W = 1): an OPD run planned at 0.35 s that took 0.7 s (ρ = 2) and a GRPO
  run planned at 0.125 s that took 0.5 s (ρ = 4) leave one run of each at 2 × 0.35 + 4 × 0.125
  = 1.2 s; the parts and the planned wall do not move."""
  config, workdir = learns.get_config("tiny"), str(tmp_path / "cmp")
  before = opd_vs_rl_plan.comparison_plan(config, workdir)
  assert before["measured"] == {}
  todo = opd_vs_rl.plan(opd_vs_rl.resolved(config, workdir))
  first = {}
  for m, s, _, seed, run in todo:
    first.setdefault(run.train.loss in opd_vs_rl_plan.RL_LOSSES, (m, s, seed, run))
  for rl, wall in ((False, 0.7), (True, 0.5)):
    m, s, seed, run = first[rl]
    result = {"config": runs.config_repr(run), "wall_seconds": wall}
    json_file.write_json(
      os.path.join(workdir, "runs", opd_vs_rl.run_name(m, s, seed), "result.json"), result
    )
  plan = opd_vs_rl_plan.comparison_plan(config, workdir)
  assert plan["counts"]["reused"] == 2
  measured = plan["measured"]
  assert measured["families"] == {
    "OPD": {"runs": 1, "ratio": pytest.approx(2.0)},
    "RL": {"runs": 1, "ratio": pytest.approx(4.0)},
  }
  assert measured["seconds"] == pytest.approx(2 * 0.35 + 4 * 0.125)
  assert [p["runs"] for p in plan["parts"]] == [p["runs"] for p in before["parts"]]
  line = next(x for x in opd_vs_rl_plan.plan_lines(plan) if x.startswith("measured:"))
  assert "OPD 2.00x its planned time alone over 1 finished run(s)" in line
  assert line.endswith("1 s (0.00 h)")


def test_a_part_naming_an_unknown_run_is_refused_before_anything_trains(tmp_path):
  config = learns.get_config("tiny")
  with pytest.raises(ValueError, match="runs not in the plan: nope"):
    opd_vs_rl.run_comparison(config, str(tmp_path / "cmp"), lambda *a: None, only={"nope"})
  assert opd_vs_rl.run_comparison(config, str(tmp_path / "cmp"), lambda *a: None, only=()) == {}
  assert not (tmp_path / "cmp" / "runs").exists()


def _row(setting, seed, greedy, t1):
  return {
    "method": "grpo",
    "setting": setting,
    "seed": seed,
    "accuracy": greedy,
    "accuracy_before": 0.5,
    "accuracy_t1": t1,
    "accuracy_t1_before": 0.2,
    "mismatch_kl_mean": 0.0 if setting == "reference" else 0.02,
    "grad_norm_mean": 1.0,
    "grad_norm_max": 2.0,
    "grad_norm_std": 0.5,
    "train_reward_last": 0.5,
  }


def test_t1_drop_and_share_kept_by_hand(tmp_path):
  """T = 1: reference 0.6/0.5 (mean 0.55), noise 0.4/0.3 (mean 0.35), warm start 0.2: the drop
  is 20 points, Welch's interval 20 ± 4.30265·100·√0.005 (ν = 2), the share kept
  (0.35 − 0.2)/(0.55 − 0.2) = 3/7."""
  rows = [
    _row("reference", 0, 0.7, 0.6),
    _row("reference", 1, 0.7, 0.5),
    _row("noise", 0, 0.6, 0.4),
    _row("noise", 1, 0.6, 0.3),
  ]
  opd_vs_rl_report.add_drops(rows)
  assert [r["drop_t1_points"] for r in rows] == pytest.approx([-5.0, 5.0, 15.0, 25.0])
  ref, noise = opd_vs_rl_report.summarise(rows)
  assert noise["drop_t1_points"] == pytest.approx(20.0)
  half = 4.30265 * 100 * math.sqrt(0.005)
  assert noise["drop_t1_ci_points"] == pytest.approx([20 - half, 20 + half], abs=0.01)
  assert noise["gain_kept_t1"] == pytest.approx(3 / 7) and ref["gain_kept_t1"] == 1.0
  assert noise["drop_points"] == pytest.approx(10.0)  # greedy beside it
  assert "| noise | grpo | 2 | 35.0 ± 7.1 % | +20.0 [-10.4, 50.4] | 0.43 [" in (
    opd_vs_rl_report.summary_table_t1([ref, noise])
  )
  meta = {"summary": "s", "matched_settings": ["noise"], "matched_kl": [0.01]}
  report = opd_vs_rl_report.write_report(rows, str(tmp_path), meta, log=lambda *_: None)
  heads = [x for x in (tmp_path / "opd_vs_rl.md").read_text().splitlines() if x[:3] == "## "]
  assert heads == [
    "## Over seeds",
    "## Over seeds, T = 1",
    "## At equal training mismatch",
    "## Every run",
  ]
  at = report["matched"][0]  # half of the way to the noise cell's mismatch/kl 0.02
  assert (at["drop_points"], at["drop_t1_points"]) == pytest.approx((5.0, 10.0))


def test_plan_flag_prints_the_plan_and_trains_nothing(tmp_path):
  cmd = [
    sys.executable,
    "-m",
    "opd_jax.opd_vs_rl",
    "--config=configs/opd_vs_rl_learns.py",
    f"--workdir={tmp_path / 'cmp'}",
    "--plan",
  ]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "plan: 200 runs (200 to train" in done.stdout and "  part 7: " in done.stdout
  assert not (tmp_path / "cmp" / "runs").exists()


@pytest.mark.slow
def test_tiny_part_end_to_end(tmp_path):
  """`--config=configs/opd_vs_rl_learns.py:tiny --part=1` trains the 4 wiring runs (one part),
  records T = 1 accuracy and the code of every run, and a second call reuses them."""
  cmd = [
    sys.executable,
    "-m",
    "opd_jax.opd_vs_rl",
    "--config=configs/opd_vs_rl_learns.py:tiny",
    f"--workdir={tmp_path}",
    "--part=1",
    "--json",
  ]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout)
  assert {(r["method"], r["setting"]) for r in report["rows"]} == {
    (m, s) for m in ("opd", "grpo_tis") for s in ("reference", "noise_sigma-0.5")
  }
  for r in report["rows"]:
    assert 0.0 <= r["accuracy_t1"] <= 1.0 and r["provenance"]["config_sha256"]
  assert report["grpo_recipe"] == learns.GRPO_RECIPE and report["group_size"] == 8
  assert report["provenance"]["git_sha"] and not report["code"]["mixed"]
  assert "plan: 4 runs (4 to train" in done.stderr
  again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0 and "plan: 4 runs (0 to train, 4 reused" in again.stderr


def test_prefix_shift_students_are_the_comparisons_reference_runs_with_checkpoints():
  """configs/prefix_shift_learns.py trains exactly the comparison's seed-0 reference GRPO and
  OPD runs (its arm configs, checkpointing aside), keeps a checkpoint at every lag its
  candidates need, and its docstring's command measures exactly CANDIDATES, the comparison's
  settings."""
  import re

  import prefix_shift_learns as ps

  from opd_jax.mismatch import candidates as candidates_lib

  config = learns.get_config()
  checkpointing = ("train.checkpoint_every", "train.keep_checkpoints")
  for method in ("grpo", "opd"):
    student = dict(config_check.flatten(ps.get_config(method)))
    arm = dict(config_check.flatten(opd_vs_rl.arm_config(config, method, {}, 0)))
    assert set(student) == set(arm)
    assert {k: v for k, v in student.items() if student[k] != arm[k]}.keys() <= set(checkpointing)
    steps = student["train.steps"]
    kept = range(steps - (ps.KEEP_CHECKPOINTS - 1) * ps.CHECKPOINT_EVERY, steps + 1)
    for spec in ps.CANDIDATES:
      lag = candidates_lib.parse_candidate(spec, ps.get_config(method)).lag
      assert lag % ps.CHECKPOINT_EVERY == 0 and steps - lag in kept, (spec, lag)
  assert set(ps.CANDIDATES) == set(learns.SETTINGS + learns.LADDER)
  in_docstring = re.findall(r"--candidate=(\S+)", ps.__doc__)
  assert tuple(in_docstring) == ps.CANDIDATES
  with pytest.raises(ValueError, match="unknown variant 'gpro'"):
    ps.get_config("gpro")
