"""The sections of `python -m opd_jax.bench.device_check`: each runs another bench's own code.

Every section is a function of a `Plan` (the smoke switch, the minute budget, the log) that
returns its part of the JSON. `SIZES[section]` holds its sizes on a device ("full") and in
the CPU smoke ("smoke": tiny shapes and few steps, the same code path); `ESTIMATE_S` the
seconds each is planned at (`device_check` module docstring).
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

SIZES = {
  "pallas": {
    "full": {"slots": 4096, "position": 4000, "repeats": 5, "tokens": (1, 3)},
    "smoke": {"slots": 64, "position": 40, "repeats": 1, "tokens": (3,)},
  },
  # --quick of bench.decode_scaling: batch 1, 3 timed calls per row.
  "decode_scaling": {
    "full": {"model_name": "qwen3-50m", "repeats": 3, "capacities": None, "positions": None},
    "smoke": {"model_name": "tiny", "repeats": 1, "capacities": (64,), "positions": (40,)},
  },
  "sampler": {
    "full": {"name": "qwen3-50m", "repeats": 2, "batches": (1, 64)},
    "smoke": {"name": "tiny", "repeats": 1, "batches": (1, 2)},
  },
  "roofline": {
    "full": {},  # bench.roofline's defaults
    "smoke": {
      "repeats": 3,
      "matmul_size": 64,
      "copy_mb": 1,
      "train_batch": 2,
      "prompt_len": 4,
      "completion_len": 4,
      "decode_batches": (1, 2),
      "decode_tokens": (4, 260),
    },
  },
  # bench.async_vs_sync flags: a short run, or one long enough to reach the target.
  "main_job": {
    "full": {
      "short": ["--steps=200", "--eval-every=200", "--eval-size=128", "--split-batches=4"],
      "to_target": ["--steps=400", "--eval-every=10", "--eval-size=128", "--split-batches=4"],
    },
    "smoke": {
      "short": ["--variant=tiny", "--steps=4", "--eval-every=4", "--eval-size=8"],
      "to_target": ["--variant=tiny", "--steps=4", "--eval-every=2", "--eval-size=8"],
    },
  },
}
ROOFLINE_MODELS = {"full": ("qwen3-50m",), "smoke": ("tiny",)}
ROOFLINE_LARGE = "qwen3-0.6b"  # the roofline's optional size where compute matters on a GPU
MAIN_RUNS = "sync_bf16,async_fp8"

# Planned seconds per section on one GPU or TPU ("full"), and in the CPU smoke; "extra" keys
# are the optional parts a section adds only when the budget still holds them.
ESTIMATE_S = {
  "full": {
    "environment": 5,
    "pallas": 45,
    "decode_scaling": 60,
    "sampler": 60,
    "roofline": 45,
    "roofline_extra": 75,
    "main_job": 150,
    "main_job_extra": 90,
  },
  "smoke": {
    "environment": 2,
    "pallas": 10,
    "decode_scaling": 8,
    "sampler": 10,
    "roofline": 10,
    "roofline_extra": 0,
    "main_job": 40,
    "main_job_extra": 5,
  },
}


# The optional parts, most wanted first: deciding one keeps room for those before it.
EXTRA_PRIORITY = ("roofline_extra", "main_job_extra")


@dataclasses.dataclass
class Plan:
  """What a section needs: the smoke switch, the budget and the log.

  Attributes:
    smoke: tiny shapes and steps (`--cpu-smoke`).
    budget_s: the whole run's seconds (`--minutes` × 60).
    start: `time.monotonic()` when the run began.
    current: the section running now.
    later: the sections still to run after it.
    log: the readable lines' function.
  """

  smoke: bool
  budget_s: float
  start: float
  current: str = ""
  later: tuple[str, ...] = ()
  log: Callable[..., None] = print

  @property
  def mode(self) -> str:
    return "smoke" if self.smoke else "full"

  def left_s(self) -> float:
    """Seconds of the budget not yet spent."""
    return self.budget_s - (time.monotonic() - self.start)

  def allows(self, extra: str) -> tuple[bool, str]:
    """Whether the optional part `extra` (an `ESTIMATE_S` key) fits in what is left of the
    budget after the planned seconds of the current and later sections and of the later
    sections' optional parts that come before it in `EXTRA_PRIORITY`; and the reason in words."""
    estimates = ESTIMATE_S[self.mode]
    reserve = sum(estimates[name] for name in (self.current, *self.later) if name)
    rank = EXTRA_PRIORITY.index(extra)
    reserve += sum(
      estimates[f"{n}_extra"] for n in self.later if f"{n}_extra" in EXTRA_PRIORITY[:rank]
    )
    need, left = estimates[extra], self.left_s() - reserve
    verdict = "fits" if need <= left else "would exceed --minutes"
    return need <= left, f"{verdict}: planned {need} s, {max(left, 0):.0f} s left after the rest"


def environment(plan: Plan) -> dict:
  """Versions, backend, devices, native FP8 and the code's provenance."""
  import jax
  import jaxlib

  from opd_jax.io import provenance
  from opd_jax.model import quant_compute

  device = jax.devices()[0]
  code = provenance.code_state()
  return {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "backend": jax.default_backend(),
    "platform": device.platform,
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "compute_capability": str(getattr(device, "compute_capability", "") or "") or None,
    "has_native_fp8": quant_compute.has_native_fp8(),
    "provenance": code | {"described": provenance.describe(provenance.code_key(code))},
  }


def _pallas_probe() -> str | None:
  """None when a trivial Pallas kernel compiles and runs on this backend, else why not."""
  import jax
  import jax.numpy as jnp

  backend = jax.default_backend()
  if backend not in ("cpu", "gpu", "tpu"):
    return f"Pallas has no backend for platform {backend!r}"
  try:
    from jax.experimental import pallas as pl

    from opd_jax.model import pallas_decode  # noqa: F401  (its Triton and TPU imports)

    def add_one(x_ref, o_ref):
      o_ref[...] = x_ref[...] + 1.0

    x = jnp.zeros((8, 128), jnp.float32)
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out = pl.pallas_call(add_one, out_shape=shape, interpret=backend == "cpu")(x)
    if float(out.sum()) != x.size:
      return "a trivial Pallas kernel (x + 1) gave a wrong result on this backend"
  except Exception as e:  # noqa: BLE001  (any failure here means: Pallas does not run)
    first = (str(e).splitlines() or [""])[0][:300]
    return f"Pallas does not run on {backend}: {type(e).__name__}: {first}"
  return None


def pallas(plan: Plan) -> dict:
  """bench.pallas_check: the kernel against the blockwise path and float64, and its speed."""
  from opd_jax.bench import pallas_check

  reason = _pallas_probe()
  if reason:
    return {"skipped": reason}
  return pallas_check.run(**SIZES["pallas"][plan.mode])


def decode_scaling(plan: Plan) -> dict:
  """bench.decode_scaling --quick: batch 1, both attention paths, three KV formats."""
  from opd_jax.bench import decode_scaling as bench

  sizes = dict(SIZES["decode_scaling"][plan.mode])
  sizes["capacities"] = sizes["capacities"] or bench.CAPACITIES
  sizes["positions"] = sizes["positions"] or bench.POSITIONS
  rows = bench.run(batches=(1,), attentions=None, log=plan.log, **sizes)
  return {"model": sizes["model_name"], "rows": rows, "ratios": bench.ratios(rows)}


def sampler(plan: Plan) -> dict:
  """bench.sampler's fp8_vs_bf16 rows: FP8 weights and KV against BF16, tokens/s per batch."""
  from opd_jax.bench import sampler as bench
  from opd_jax.model import quant_compute

  sizes = SIZES["sampler"][plan.mode]
  rows = bench.bench_model(
    sizes["name"], sizes["repeats"], plan.log, kinds=("fp8_vs_bf16",), batches=sizes["batches"]
  )
  return {
    "model": sizes["name"],
    "new_tokens": bench.NEW_TOKENS,
    "native_fp8": quant_compute.has_native_fp8(),
    "tokens_per_s": {
      f"b{r['batch']}": {"fp8": r["opd_jax_tokens_per_s"], "bf16": r["bf16_tokens_per_s"]}
      for r in rows
    },
    "fp8_over_bf16": {f"b{r['batch']}": r["ratio_vs_bf16"] for r in rows},
    "rows": rows,
  }


def roofline(plan: Plan) -> dict:
  """bench.roofline: the peaks and the train/decode rows; the larger model if the budget holds."""
  from opd_jax.bench import roofline as bench

  models = list(ROOFLINE_MODELS[plan.mode])
  extra = {}
  if not plan.smoke:
    fits, why = plan.allows("roofline_extra")
    models += [ROOFLINE_LARGE] if fits else []
    extra = {ROOFLINE_LARGE: "included" if fits else f"left out ({why})"}
  result = bench.run(models, log=plan.log, **SIZES["roofline"][plan.mode])
  return result | {"optional": extra}


def _trainer_dtype() -> str:
  """`bench.roofline.resolve_dtype("auto")` (bfloat16 on an accelerator, float32 on a CPU),
  asked in a process of its own so that this one does not take the device yet (`RUN_ORDER`)."""
  code = "from opd_jax.bench import roofline; print(roofline.resolve_dtype('auto'))"
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return done.stdout.strip().splitlines()[-1]


def main_job(plan: Plan) -> dict:
  """bench.async_vs_sync on sync BF16 and async FP8, one seed: seconds per step, the serialized
  split, and the time to target when the budget holds the longer run."""
  from opd_jax.bench import async_vs_sync
  from opd_jax.cli import runner

  fits, why = plan.allows("main_job_extra")
  which = "to_target" if fits else "short"
  argv = [
    f"--runs={MAIN_RUNS}",
    "--seeds=1",
    f"--dtype={'float32' if plan.smoke else _trainer_dtype()}",
    *SIZES["main_job"][plan.mode][which],
  ]
  args = runner.parse_own_flags(async_vs_sync.define_flags, argv, async_vs_sync.__doc__)
  root = tempfile.mkdtemp(prefix="opd_device_check_")
  args.workdir = root
  try:
    result = async_vs_sync.run(args, plan.log)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  rows = {r["name"]: r for r in result.pop("rows")}
  result.pop("workdir")
  sync, fp8 = rows["sync_bf16"], rows["async_fp8"]
  out = {
    "flags": argv,
    "step_s": {name: r["step_s_mean"] for name, r in rows.items()},
    "steady_step_s": {name: r["steady_step_s_mean"] for name, r in rows.items()},
    "step_speedup_async_fp8": fp8["step_speedup_vs_sync"],
    "split": {name: r["split"] for name, r in rows.items()},
  }
  if fits:
    out["time_to_target"] = {
      "target": result["target"],
      "wall_s": {name: r["wall_s_to_target_mean"] for name, r in rows.items()},
      "speedup_async_fp8": fp8["speedup_vs_sync"],
    }
  else:
    out["time_to_target"] = {"skipped": f"the longer run {why}"}
  out["final_quality"] = {
    "sync_bf16": sync["final_quality_mean"],
    "async_fp8": fp8["final_quality_mean"],
  }
  return out | {"run": result, "rows": list(rows.values())}


# The main job runs first: its runs are processes of their own, started before this process
# takes the device (a TPU admits one process at a time; a GPU's memory is preallocated).
RUN_ORDER = ("main_job", "environment", "pallas", "decode_scaling", "sampler", "roofline")
SECTIONS: dict[str, Callable[[Plan], dict]] = {
  "environment": environment,
  "pallas": pallas,
  "decode_scaling": decode_scaling,
  "sampler": sampler,
  "roofline": roofline,
  "main_job": main_job,
}
