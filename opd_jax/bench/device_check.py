"""One run that shows what a GPU or TPU does with the project: one JSON, within a minute budget.

Command (results: docs/results/benchmarks.md, "Device check"):

    python -m opd_jax.bench.device_check                   # readable summary, then the JSON
    python -m opd_jax.bench.device_check --json            # the JSON only
    python -m opd_jax.bench.device_check --sections=environment,roofline --minutes=3
    python -m opd_jax.bench.device_check --cpu-smoke --json   # tiny shapes, on the CPU

Sections (`--sections`, comma-separated, default all; each runs the named bench's own
functions, `bench/device_sections.py`):

* "environment": python, jax and jaxlib versions, the backend, device kind and count,
  `quant_compute.has_native_fp8()`, and the code's provenance (`io.provenance.code_state`).
* "pallas": `bench.pallas_check`, the opt-in Pallas decode kernel against the blockwise path
  (largest difference, within the tests' tolerance or not, both against float64) and its
  speed. Where Pallas cannot run on the backend (no Pallas backend for the platform, or a
  trivial x + 1 kernel fails to compile or run) the section is {"skipped": reason}.
* "decode_scaling": `bench.decode_scaling --quick` (batch 1, 3 timed calls per row): ms per
  decode step per attention path, KV format, capacity S and position t, and its goal ratios.
* "sampler": `bench.sampler`'s "fp8_vs_bf16" rows at the 58M model, batch 1 and 64: FP8
  weights and KV cache against BF16, tokens/s and `fp8_over_bf16` (BF16 seconds over FP8).
* "roofline": `bench.roofline`, the measured peaks and the train and decode rows at 58M; the
  ~0.6B Qwen3 shape too when the budget holds it.
* "main_job": `bench.async_vs_sync` with `--runs=sync_bf16,async_fp8 --seeds=1` in bf16 on an
  accelerator (f32 on a CPU): seconds per step (`step_s` with compilation, `steady_step_s`
  without), the async FP8 speed-up per step, the serialized split (sampling, teacher, train
  step), and the time to target when the budget holds the longer run (400 steps, an
  evaluation every 10; else 200 steps, evaluated at the end only).

Order. The main job runs first (its runs are processes of their own, started before this
process takes the device: a TPU admits one process at a time, and JAX preallocates most of a
GPU's memory), then the others in the order above; the JSON lists them in that order.

Budget (`--minutes`, default 8). Each section is planned at `device_sections.ESTIMATE_S`
seconds (rough guesses for one H100- or H200-class GPU; `--cpu-smoke` has its own). Before an
optional part (the roofline's larger model, then the main job's time to target, in that order
of priority) the clock is read again, and the part is added only if its estimate fits in what
is left after the estimates of the current and later sections and of the later sections'
optional parts of higher priority; what was left out, and why, is in the section's JSON. A
section that starts with the budget already spent is {"skipped": ...}. At the default 8 minutes
the estimates leave no room for the main job's time to target, which needs `--minutes=9` or
more. The budget is planned, not enforced: no section is stopped once it runs.

Output: {"mode", "minutes", "sections": {name: {..., "wall_s"}}, "errors", "total_wall_s"}.
Every section records its own wall seconds; a section that raises records {"error": "..."}
and the others still run. The exit status is 1 when any section errored.

`--cpu-smoke` runs on the CPU (JAX_PLATFORMS=cpu unless set) with tiny shapes and a few
steps in every section: the same code paths, in 1.5 to 3 minutes on 2 shared cores. Its figures
say that the code runs, not how fast anything is.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from absl import flags

from opd_jax.bench import device_sections
from opd_jax.cli import flags as cli_flags
from opd_jax.cli import runner
from opd_jax.io import json_file

SECTIONS = tuple(device_sections.SECTIONS)


def parse_sections(text: str) -> list[str]:
  """The section names of `--sections` ("all" or a comma-separated subset), in run order.

  Raises:
    ValueError: an unknown name, or none.
  """
  names = [n.strip() for n in text.split(",") if n.strip()]
  if names == ["all"]:
    return list(SECTIONS)
  unknown = [n for n in names if n not in SECTIONS]
  if unknown or not names:
    raise ValueError(
      f"--sections: unknown or no section(s) {unknown}; choose from all, {', '.join(SECTIONS)}"
    )
  return [n for n in SECTIONS if n in names]


def _error(e: BaseException) -> str:
  text = str(e).strip()
  return f"{type(e).__name__}: {text[:2000]}" if text else type(e).__name__


def run(sections: list[str], minutes: float, smoke: bool, log=print) -> dict:
  """Runs `sections` in `device_sections.RUN_ORDER` against a budget of `minutes` (module
  docstring); the JSON lists them in the order of `SECTIONS`."""
  start = time.monotonic()
  plan = device_sections.Plan(smoke=smoke, budget_s=60 * minutes, start=start, log=log)
  estimates = device_sections.ESTIMATE_S[plan.mode]
  order = [name for name in device_sections.RUN_ORDER if name in sections]
  out = {}
  for i, name in enumerate(order):
    plan.current, plan.later = name, tuple(order[i + 1 :])
    began = time.monotonic()
    log(f"[{i + 1}/{len(order)}] {name} ({plan.left_s():.0f} s of the budget left)")
    if plan.left_s() <= 0:
      section = {"skipped": f"the --minutes={minutes} budget was spent before it started"}
    else:
      try:
        section = device_sections.SECTIONS[name](plan)
      except (Exception, SystemExit) as e:  # noqa: BLE001  (a failed run ends with SystemExit)
        log(f"{name} failed:\n{''.join(traceback.format_exception(e))[-3000:]}")
        section = {"error": _error(e)}
    out[name] = section | {"wall_s": round(time.monotonic() - began, 2)}
  return {
    "mode": "cpu-smoke" if smoke else "device",
    "minutes": minutes,
    "planned_s": {name: estimates[name] for name in sections},
    "sections": {name: out[name] for name in sections},  # in the order of SECTIONS
    "errors": [name for name in sections if "error" in out[name]],
    "total_wall_s": round(time.monotonic() - start, 2),
  }


def _section_lines(name: str, s: dict) -> list[str]:
  """A finished section's figures in words (`summary`)."""
  if name == "environment":
    return [
      f"jax {s['jax']} on {s['backend']}, {s['device_count']} x {s['device_kind']}, native fp8 "
      f"{s['has_native_fp8']}, python {s['python']}, {s['provenance']['described']}"
    ]
  if name == "pallas":
    worst = max(r["max_abs_err_vs_blockwise"] for r in s["correctness"])
    speed = ", ".join(f"{r['kv']} {r['path']} {r['speedup_vs_blockwise']:.2f}x" for r in s["speed"])
    return [
      f"all within atol {s['tolerance']['atol']} rtol {s['tolerance']['rtol']}: "
      f"{s['all_within_tolerance']} (largest |kernel - blockwise| {worst:.2e}); kernel speed "
      f"over blockwise: {speed}"
    ]
  if name == "decode_scaling":
    return [f"{len(s['rows'])} rows of {s['model']}; ratios {s['ratios']}"]
  if name == "sampler":
    return [f"{s['model']} tokens/s {s['tokens_per_s']}; fp8/bf16 {s['fp8_over_bf16']}"]
  if name == "roofline":
    from opd_jax.bench import roofline

    peaks = s["peaks"]
    flops = {
      k: f"{v:.3g}" if isinstance(v, float) else v for k, v in peaks["matmul_flops_per_s"].items()
    }
    head = f"matmul FLOP/s {flops}, copy {peaks['copy_bytes_per_s']:.3g} B/s; {s['optional']}"
    return [head, *(roofline.row_line(row) for row in s["rows"])]
  if name == "main_job":
    return [
      f"s/step {s['step_s']} (steady {s['steady_step_s']}), async fp8 per-step speed-up "
      f"{s['step_speedup_async_fp8']}; time to target {s['time_to_target']}"
    ]
  return [str(s)]


def summary(result: dict) -> list[str]:
  """The readable lines: one or a few per section."""
  lines = [
    f"device check ({result['mode']}, {result['total_wall_s']} s of {result['minutes']} min)"
  ]
  for name, s in result["sections"].items():
    head = f"{name} ({s['wall_s']} s):"
    if "error" in s:
      lines.append(f"{head} ERROR {s['error']}")
      continue
    if "skipped" in s:
      lines.append(f"{head} skipped: {s['skipped']}")
      continue
    try:
      first, *rest = _section_lines(name, s)
    except (KeyError, TypeError, ValueError) as e:  # a summary never hides the JSON
      first, rest = f"(no summary: {_error(e)}; see the JSON)", []
    lines += [f"{head} {first}", *(f"  {line}" for line in rest)]
  if result["errors"]:
    lines.append(f"errors in: {', '.join(result['errors'])}")
  return lines


def define_flags(fv: flags.FlagValues) -> None:
  """The command's flags, on `fv`."""
  cli_flags.define_json_flag(fv, '{"mode", "minutes", "sections", "errors", ...}')
  flags.DEFINE_string(
    "sections", "all", f"all, or a comma-separated subset of {', '.join(SECTIONS)}.", flag_values=fv
  )
  flags.DEFINE_float(
    "minutes",
    8.0,
    "The budget the sections are planned against (module docstring).",
    flag_values=fv,
  )
  flags.DEFINE_bool(
    "cpu-smoke", False, "Tiny shapes and steps in every section, on the CPU.", flag_values=fv
  )


def main(argv: list[str] | None = None) -> int:
  """Runs the check; prints the summary and the JSON (only the JSON with --json); 1 when any
  section errored."""
  args = runner.parse_own_flags(define_flags, argv, __doc__)
  sections = parse_sections(args.sections)
  if not args.minutes > 0:
    raise ValueError(f"--minutes must be > 0, got {args.minutes}")
  if args.cpu_smoke and "jax" not in sys.modules:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # also for the main job's subprocesses
  log = cli_flags.log_for_json(args.json)
  result = run(sections, args.minutes, args.cpu_smoke, log)
  for line in summary(result):
    log(line)
  json_file.write_json(args.json or "-", result)
  return 1 if result["errors"] else 0


if __name__ == "__main__":
  runner.run_command(main, own_flags=True)
