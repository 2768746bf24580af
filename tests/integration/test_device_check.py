"""`python -m opd_jax.bench.device_check`: its CPU smoke runs every section's real code on tiny
shapes, in a subprocess as a user runs it; `--sections` selects; the budget and a failing
section are handled as the module docstring says."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from opd_jax.bench import device_check, device_sections, roofline

ENVIRONMENT_KEYS = {
  "python",
  "jax",
  "jaxlib",
  "backend",
  "platform",
  "device_kind",
  "device_count",
  "has_native_fp8",
  "provenance",
}


def _check(*flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "opd_jax.bench.device_check", *flags],
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def _positive(value) -> bool:
  return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _check_environment(env: dict) -> None:
  assert set(env) >= ENVIRONMENT_KEYS
  assert env["backend"] == env["platform"] == "cpu" and env["device_count"] >= 1
  assert env["has_native_fp8"] is False  # no CPU has FP8 matrix units
  assert env["python"] == ".".join(map(str, sys.version_info[:3]))
  assert {"git_sha", "dirty", "diff_sha256", "described"} <= set(env["provenance"])


def _check_roofline(roof: dict) -> None:
  peaks = roof["peaks"]
  assert _positive(peaks["copy_bytes_per_s"])
  assert all(_positive(peaks["matmul_flops_per_s"][d]) for d in ("float32", "bfloat16"))
  assert peaks["matmul_flops_per_s"]["float8_e4m3fn"] == "n/a"
  kinds = [(r["kind"], r["batch"]) for r in roof["rows"]]
  assert kinds == [("train", 2), ("decode", 1), ("decode", 2)]
  for row in roof["rows"]:
    if row["kind"] == "decode":
      assert all(_positive(s) for s in row["call_seconds"].values()), row
      if row.get("error") == roofline.DROWNED:  # timed on a loaded machine: no rate, said so
        continue
    assert "error" not in row, row
    assert _positive(row["flops_per_s"]) and _positive(row["fraction_of_peak"])
    assert row["kind"] == "train" or _positive(row["bytes_per_s"])


def test_sections_select_and_run_in_order():
  """Two sections asked in another order: only they run, in the run order, without errors."""
  proc = _check("--cpu-smoke", "--json", "--sections=roofline,environment", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)  # stdout is only the JSON
  assert list(out["sections"]) == ["environment", "roofline"] and out["errors"] == []
  assert out["mode"] == "cpu-smoke" and out["minutes"] == 8.0
  assert all(_positive(s["wall_s"]) for s in out["sections"].values())
  _check_environment(out["sections"]["environment"])
  _check_roofline(out["sections"]["roofline"])
  assert "device check (cpu-smoke" in proc.stderr  # the readable summary, on stderr


def test_an_unknown_section_is_a_clear_error():
  proc = _check("--sections=environment,rooflines", timeout=120)
  assert proc.returncode == 1 and proc.stdout == ""
  assert (
    "error: --sections: unknown or no section(s) ['rooflines']; choose from all, environment, "
    "pallas, decode_scaling, sampler, roofline, main_job"
  ) in proc.stderr
  with pytest.raises(ValueError, match=r"unknown or no section\(s\) \[\]"):
    device_check.parse_sections(",")


def test_a_spent_budget_skips_and_the_planner_reads_the_clock():
  out = device_check.run(["environment", "roofline"], minutes=1e-9, smoke=True, log=lambda *a: 0)
  assert out["errors"] == [] and set(out["sections"]) == {"environment", "roofline"}
  assert all("budget was spent" in s["skipped"] for s in out["sections"].values())
  # The main job first, 480 s of budget: the later sections' 215 s and the roofline's 75 s
  # extra (of higher priority) leave 40 s after the main job's own 150 s, under its 90 s extra.
  later = ("environment", "pallas", "decode_scaling", "sampler", "roofline")
  plan = device_sections.Plan(False, 480, time.monotonic(), current="main_job", later=later)
  fits, why = plan.allows("main_job_extra")
  assert not fits and why.startswith("would exceed --minutes: planned 90 s, 40 s left"), why
  # The roofline last, 300 s left: its own 45 s leave 255 s, room for its 75 s extra.
  plan = device_sections.Plan(False, 300, time.monotonic(), current="roofline")
  fits, why = plan.allows("roofline_extra")
  assert fits and why.startswith("fits: planned 75 s, 255 s left"), why


def test_a_failing_section_is_recorded_and_the_others_still_run(monkeypatch, capsys):
  def failing(plan):
    raise RuntimeError("the kernel failed to lower")

  monkeypatch.setitem(device_sections.SECTIONS, "pallas", failing)
  status = device_check.main(["--cpu-smoke", "--json", "--sections=pallas,environment"])
  out = json.loads(capsys.readouterr().out)
  assert status == 1 and out["errors"] == ["pallas"]
  assert out["sections"]["pallas"]["error"] == "RuntimeError: the kernel failed to lower"
  assert "wall_s" in out["sections"]["pallas"]
  _check_environment(out["sections"]["environment"])


@pytest.mark.slow
def test_cpu_smoke_runs_every_section():
  """The whole check on tiny shapes (1.5 to 3 minutes on 2 shared cores)."""
  proc = _check("--cpu-smoke", "--json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  sections = out["sections"]
  assert list(sections) == list(device_sections.SECTIONS) and out["errors"] == []
  assert all("error" not in s and "skipped" not in s for s in sections.values())
  assert all(_positive(s["wall_s"]) for s in sections.values())
  _check_environment(sections["environment"])
  # Pallas, interpreted on a CPU: both drivers, every cache format, against the stated
  # tolerance, and no farther from float64 than the blockwise path is.
  pallas = sections["pallas"]
  assert pallas["tolerance"] == {"atol": 2e-6, "rtol": 1e-5}
  rows = pallas["correctness"]
  assert {(r["driver"], r["kv"]) for r in rows} == {
    (d, f) for d in ("loop", "grid") for f in ("f32", "bf16", "fp8_token_head", "fp8_tensor")
  }
  assert pallas["all_within_tolerance"] and all(r["within_test_tolerance"] for r in rows)
  for r in rows:
    assert r["finite"] and r["max_abs_err_vs_blockwise"] <= 2e-6 + 1e-5 * 10
    gap = abs(r["kernel_max_abs_err_vs_float64"] - r["blockwise_max_abs_err_vs_float64"])
    assert gap <= 1e-5, r
  assert pallas["speed"] and all(_positive(r["ms"]) for r in pallas["speed"])
  scaling = sections["decode_scaling"]
  assert {(r["attention"], r["kv"]) for r in scaling["rows"]} == {
    (a, kv) for a in ("blockwise", "reference") for kv in ("bf16", "fp8_token_head", "fp8_tensor")
  }
  assert all(_positive(r["ms_per_step"]) for r in scaling["rows"])
  sampler = sections["sampler"]
  assert set(sampler["tokens_per_s"]) == set(sampler["fp8_over_bf16"]) == {"b1", "b2"}
  for batch in ("b1", "b2"):
    assert all(_positive(v) for v in sampler["tokens_per_s"][batch].values())
    assert _positive(sampler["fp8_over_bf16"][batch])
  _check_roofline(sections["roofline"])
  job = sections["main_job"]
  for name in ("sync_bf16", "async_fp8"):
    assert _positive(job["step_s"][name]) and _positive(job["steady_step_s"][name])
    assert _positive(job["split"][name]["train_step_s"])
  assert _positive(job["step_speedup_async_fp8"])
  assert set(job["time_to_target"]["wall_s"]) == {"sync_bf16", "async_fp8"}
