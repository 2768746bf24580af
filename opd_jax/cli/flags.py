"""The command-line vocabulary every `python -m opd_jax.<command>` shares.

`--config` (an `ml_collections` config file, `configs/<name>.py[:variant]`, with
`--config.<key>=<value>` overrides) and `--workdir` are defined here once, for every command
that reads a run config; `resolve_config_arg` lets a bare `--config=fp8_async.py` resolve
inside the repository's `configs/`, and `parse_flags` turns a misspelt override into one line.
The exit helpers end a command without the interpreter's teardown, or end one process of a
multi-process run without waiting on its dead peers.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from pathlib import Path

import jax
from absl import flags, logging
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
WORKDIR = flags.DEFINE_string("workdir", "/tmp/opd_jax", "Where logs and checkpoints go.")

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def resolve_config_arg(argv: list[str]) -> list[str]:
  """Rewrites a bare `--config=name.py[:arg]` to the file inside configs/ when needed.

  The config's folder also goes on sys.path, so variants can `import base`.
  """
  out = []
  for arg in argv:
    if arg.startswith("--config="):
      path, sep, variant = arg[len("--config=") :].partition(":")
      if not os.path.exists(path):
        for root in (Path.cwd() / "configs", CONFIGS_DIR):
          if (root / path).exists():
            path = str(root / path)
            break
        else:
          raise SystemExit(
            f"config file {path!r} not found (looked in ., ./configs, {CONFIGS_DIR})"
          )
      arg = f"--config={path}{sep}{variant}"
      sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    out.append(arg)
  return out


def distributed_args(environ=os.environ) -> dict:
  """initialize() kwargs from the launch scripts' JAX_NUM_PROCESSES / JAX_PROCESS_ID.

  JAX reads JAX_COORDINATOR_ADDRESS itself and auto-detects SLURM and TPU pods; the
  process count and id need passing explicitly for a plain multi-host launch.
  """
  args = {}
  if "JAX_NUM_PROCESSES" in environ:
    args["num_processes"] = int(environ["JAX_NUM_PROCESSES"])
  if "JAX_PROCESS_ID" in environ:
    args["process_id"] = int(environ["JAX_PROCESS_ID"])
  return args


PEER_FAILURE_SIGNS = ("Gloo", "Connection reset by peer", "heartbeat", "coordination service")


def exit_multiprocess_error(error: Exception) -> None:
  """Ends this process of a multi-process run at once, with one error line and status 1.

  Exiting normally would first wait at JAX's shutdown barrier for every peer; when a peer died
  (SIGKILL, a lost host) that wait lasts until the heartbeat timeout (100 s by default) and
  ends in an abort. A peer's death shows here as a failed collective (the survivor's next
  collective fails as soon as the dead peer's connection drops), named as such. Checkpoints
  are committed atomically, so the last one still resumes the run.
  """
  text = str(error).strip()
  first_line = text.splitlines()[0][:300] if text else type(error).__name__
  where = f"process {jax.process_index()}/{jax.process_count()}"
  if isinstance(error, jax.errors.JaxRuntimeError) or any(s in text for s in PEER_FAILURE_SIGNS):
    message = (
      f"error: {where}: a collective with the other processes failed ({first_line}); another "
      "process has probably died, see its log. Rerun the same command to resume from the last "
      "checkpoint."
    )
  elif isinstance(error, ValueError | FileNotFoundError):
    message = f"error: {where}: {text}"
  else:
    traceback.print_exception(error)
    message = f"error: {where}: {type(error).__name__}: {first_line}"
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(1)


def define_compilation_cache_flag(what: str) -> flags.FlagHolder:
  """Defines --compilation-cache for an entry point whose programs recur between invocations:
  the directory of jax's persistent XLA compilation cache, default <workdir>/jax_cache, "" for
  none (`io.compile_cache.compilation_cache_flag` applies it). `what` says what the cache saves."""
  return flags.DEFINE_string(
    "compilation-cache",
    None,
    f"Persistent XLA compilation cache (default <workdir>/jax_cache; empty = off): {what}",
  )


def freeze_heap_for_exit() -> None:
  """Takes every live object out of the cyclic collector's reach; called when a command's work
  is done and its outputs are closed.

  Interpreter shutdown otherwise runs the collector over everything jax, orbax and grain
  imported, several times longer than with the heap frozen (the memory goes back to the OS
  either way). A frozen cycle is never finalised, so nothing may still hold unflushed output.
  """
  gc.freeze()


def exit_at_once() -> None:
  """Ends a short command whose work is done and whose outputs are written and closed,
  without the interpreter's teardown.

  The teardown (the compile threads joined, the XLA client destroyed, every module freed) does
  nothing such a command needs and costs a few percent of an admission check (see
  `python -m opd_jax.bench.admission_cost`). atexit handlers do not run: only stdout, stderr
  and the log handlers are flushed, so every file the command writes must be closed before
  this call.
  """
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with a one-line error for a misspelt --config.key override."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    message = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
    sys.exit(f"error: bad --config override: {message}")
  except flags.Error as e:
    sys.exit(f"error: {e}\nPass --helpshort or --helpfull to see help on flags.")
