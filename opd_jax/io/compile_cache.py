"""Compilation settings for short commands that compile more than they run.

`enable_compilation_cache(dir)` turns on jax's persistent XLA cache (`<workdir>/jax_cache`
by default, `--compilation-cache`), so only the first check of a config on a machine
compiles; `fast_compilation()` compiles without backend optimisation on CPU (less compile time,
the same KLs to ~1e-6 relative) when this XLA knows the flag. Measured compile times:
docs/results/benchmarks.md.
"""

from __future__ import annotations

import os

import jax

COMPILATION_CACHE = "jax_cache"  # <workdir>/jax_cache: compiled programs kept between checks


def compilation_cache_flag(value: str | None, workdir: str) -> None:
  """A command's --compilation-cache flag: None means <workdir>/jax_cache, "" turns it off."""
  cache = os.path.join(workdir, COMPILATION_CACHE) if value is None else value
  if cache:
    enable_compilation_cache(cache)


FAST_COMPILE_XLA_FLAG = "--xla_backend_optimization_level=0"


# CPU code generation without LLVM's expensive passes. XLA's legacy CPU emitters
# (--xla_cpu_use_fusion_emitters=false) compiled the sampler in about half the time again but
# are left out: they round f32 to float4_e2m1fn twice (5.0002 became 4, not 6; 38 of the 65,536
# draws in tests/mismatch/test_measure.py), so an FP4 candidate would be screened with other
# numbers than the engine runs.
FAST_COMPILE_CPU_XLA_FLAGS = ("--xla_llvm_disable_expensive_passes=true",)


def xla_knows_flag(flag: str) -> bool:
  """True when the installed XLA library defines `flag` (`--name=value`): XLA aborts the whole
  process on an unknown `XLA_FLAGS` entry, and its flag set changes between jaxlib releases.

  Registered flag names are strings in the library (`libjax_common.so` in current jaxlib,
  `xla_extension.so` in older ones), so they are looked for there: a memory-mapped search of
  a few milliseconds, much less than the flags save.
  """
  import mmap

  import jaxlib

  name = flag.lstrip("-").split("=", 1)[0].encode()
  directory = os.path.dirname(jaxlib.__file__)
  for entry in sorted(os.listdir(directory)):
    path = os.path.join(directory, entry)
    if ".so" not in entry or os.path.getsize(path) < (16 << 20):  # XLA is the big library
      continue
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as image:
      if image.find(name) >= 0:
        return True
  return False


def fast_compilation() -> bool:
  """Turns XLA's backend (LLVM) optimisation off for this process; True when it took effect.

  A check runs each of its programs once, on a few dozen prompts, so compiling them is most of
  its cost. Without backend optimisation the programs compile in about half the time, and the
  measured `mismatch/kl` moves by about 2e-7 relative (docs/results/benchmarks.md). The HLO
  programs are the same: only the machine code is less optimised, and every number format
  converts bit for bit as in an optimised build. The CPU flags of `FAST_COMPILE_CPU_XLA_FLAGS`
  are added only when this XLA defines them (`xla_knows_flag`). `XLA_FLAGS` is read when the
  backend starts, so this must run before anything touches a device; it is False (and changes
  nothing) when the backend is already up or when `XLA_FLAGS` sets the level itself. The
  persistent compilation cache keys entries by `XLA_FLAGS`, so fast and optimised programs
  never mix.
  """
  from jax._src import xla_bridge  # no public "is the backend up?" query

  flags = os.environ.get("XLA_FLAGS", "")
  if xla_bridge.backends_are_initialized() or "xla_backend_optimization_level" in flags:
    return False
  extra = [f for f in FAST_COMPILE_CPU_XLA_FLAGS if f.split("=")[0] not in flags]
  extra = [f for f in extra if xla_knows_flag(f)]
  os.environ["XLA_FLAGS"] = " ".join([flags, FAST_COMPILE_XLA_FLAG, *extra]).strip()
  return True


def enable_compilation_cache(directory: str) -> None:
  """Keeps every XLA program the check compiles in `directory` (jax's persistent compilation
  cache), so a later check of the same config loads them instead of compiling.

  A check is mostly compilation: the model init, the sampler for each KV format and weight
  dtype, the engine transform for each noise σ, the scorer (`python -m
  opd_jax.bench.admission_cost` measures a cold and a warm check). Entries are keyed
  by the program, the jax version and the backend, so a stale entry is never used.

  Raises:
    ValueError: `directory` cannot be created or written (it names the directory and why).
  """
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    reason = e.strerror or str(e)
    raise ValueError(
      f"--compilation-cache {directory!r}: cannot create it ({reason}); pass a writable "
      "directory, or --compilation-cache= (empty) to compile without a cache"
    ) from e
  if not os.access(directory, os.W_OK):
    raise ValueError(
      f"--compilation-cache {directory!r} is not writable; pass a writable directory, or "
      "--compilation-cache= (empty) to compile without a cache"
    )
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
