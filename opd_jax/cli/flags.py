"""The command-line vocabulary every `python -m opd_jax.<command>` shares.

`--config` (an `ml_collections` config file, `configs/<name>.py[:variant]`, with
`--config.<key>=<value>` overrides) and `--workdir` are defined here once, for every command
that reads a run config; `resolve_config_arg` lets a bare `--config=fp8_async.py` resolve
inside the repository's `configs/`, and `parse_flags` turns a misspelt override into one line.
The exit helpers end a command without the interpreter's teardown, or end one process of a
multi-process run without waiting on its dead peers.

The vocabulary every command follows (docs/cli.md has the table of what changed):

* `--json=PATH` writes the command's JSON result to PATH; `--json=-` (or a bare `--json`)
  prints it to stdout, and the command's readable lines then go to stderr
  (`io.json_file.write_text`).
* `--params-from=RUN` names the trained run a command reads (`RUN` is its workdir).
* The teacher cache is the run config's own key: `--config.teacher.cache_dir=DIR`
  (`--config.run.teacher.cache_dir=DIR` where the config nests a run config).
* A rollout setting is named as `rollout.<key>=<value>[,rollout.<key>=<value> ...]`.
* `--help` (`-h`) prints the command's own flags, `--config` and `--workdir` among them where it
  has them, points to the config reference, and exits 0.
* An old spelling keeps working for one release, with a warning (`rewrite_deprecated`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

from absl import flags, logging
from ml_collections import config_flags

from opd_jax.io import json_file

CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
WORKDIR = flags.DEFINE_string("workdir", None, "Where logs and checkpoints go.")

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIG_REFERENCE = "docs/reference/config.md"  # every config key, its default and meaning
HELP_ARGS = ("--help", "-h", "--helpshort", "-?")
HIDDEN: set[str] = set()  # flags `command_help` leaves out: deprecated spellings that still work


def needed_workdir(what: str) -> str:
  """`--workdir`'s value, for a command that writes `what` there only when told nowhere else."""
  workdir = flags.FLAGS["workdir"].value  # WORKDIR.value refuses None, the runner's default
  if not workdir:
    raise ValueError(f"pass --workdir=DIR (where {what} goes)")
  return workdir


def warn_deprecated(old: str, new: str) -> None:
  """One stderr line saying that `old` still works for this release and what replaces it."""
  print(
    f"warning: {old} is deprecated and will be removed in the next release; use {new}",
    file=sys.stderr,
    flush=True,
  )


def rewrite_deprecated(argv: list[str], renames: dict[str, str]) -> list[str]:
  """Rewrites old flag spellings to new ones, warning once per old flag.

  Args:
    argv: the command line (argv[0] is kept as is).
    renames: old flag -> new flag, both with their dashes, e.g. {"--run": "--params-from"}. A
      bare old flag (no "=value") maps to the bare new flag.

  Returns:
    argv with every `--old[=value]` replaced by `--new[=value]`.
  """
  out, warned = list(argv[:1]), set()
  for arg in argv[1:]:
    name, sep, value = arg.partition("=")
    if name in renames:
      if name not in warned:
        warn_deprecated(name, renames[name])
        warned.add(name)
      arg = f"{renames[name]}{sep}{value}"
    out.append(arg)
  return out


def bare_json_to_stdout(argv: list[str]) -> list[str]:
  """A bare `--json` means `--json=-`, the JSON on stdout; `--json PATH` (a next argument that
  is no flag: no command takes positional arguments) is `--json=PATH`, and `--json -` is
  `--json=-`."""
  out, args = [], list(argv)
  while args:
    arg = args.pop(0)
    if arg == "--json":
      follows = bool(args) and (args[0] == "-" or not args[0].startswith("-"))
      arg = f"--json={args.pop(0)}" if follows else "--json=-"
    out.append(arg)
  return out


@contextlib.contextmanager
def json_output(target: str | None):
  """The path a library should write its JSON to, for `--json=target`.

  Yields `target` itself (None stays None), or for "-" a temporary file whose text is printed
  to stdout once the block ends without an error.
  """
  if target != "-":
    yield target
    return
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "result.json")
    yield path
    with open(path) as f:
      json_file.write_text("-", f.read())


def define_json_flag(flag_values: flags.FlagValues, what: str = "the JSON result") -> None:
  """`--json[=PATH]` on a command's own flags: PATH, or "-" (a bare `--json`) for stdout only."""
  flags.DEFINE_string(
    "json",
    None,
    f"Write {what} to PATH; - (or a bare --json) prints only it to stdout.",
    flag_values=flag_values,
  )


def define_teacher_cache_flag(flag_values: flags.FlagValues, help_text: str) -> None:
  """`--config.teacher.cache_dir=DIR` on a command's own flags (the run config's own key; the
  parsed value is `.teacher_cache`), with the old `--teacher-cache` kept for this release
  (`rewrite_deprecated`)."""
  flags.DEFINE_string("config.teacher.cache_dir", "", help_text, flag_values=flag_values)


def log_for_json(target: str | None):
  """The log function a command's readable lines use (a `ProgressLog`): stderr when its JSON
  goes to stdout, else stdout."""
  return ProgressLog(sys.stderr if target == "-" else sys.stdout)


# "[3/44] ...", "  [3/44] ...", "setting 3/44: ...", "cold check 2/5: ...": item i of n is done.
_COUNTER_RE = re.compile(r"^\s*(?:\[(\d+)/(\d+)\]|([a-z][a-z ]*?) (\d+)/(\d+)\b)")


class ProgressLog:
  """A command's log function that adds an ETA to its "item i of n" lines.

  A line that starts with `[i/n]` (or `<what> i/n`, e.g. `setting 3/44`) says item i of n is
  finished; the rate is measured by `io.progress.Progress` from the moment the counter was
  first seen (counting that moment as item 0), and the line gets `| ETA 12m30s` appended. On a
  terminal a status line (`setting 3/44 | 0m42s elapsed | ETA 12m30s`) also stays under the
  latest line until the next one replaces it; in a log file only the lines are written.
  """

  def __init__(self, stream=None, clock=time.monotonic, tty: bool | None = None):
    """Args:
    stream: where lines go (default sys.stdout, looked up at each call).
    clock: monotonic seconds; injectable for tests.
    tty: force the terminal behaviour on or off (default: `stream.isatty()`).
    """
    self._stream, self._clock, self._tty = stream, clock, tty
    self._start = clock()
    self._counters: dict[tuple[str, int], Any] = {}
    self._status = False

  def _out(self):
    return self._stream if self._stream is not None else sys.stdout

  def _is_tty(self) -> bool:
    if self._tty is not None:
      return self._tty
    isatty = getattr(self._out(), "isatty", None)
    return bool(isatty and isatty())

  def eta(self, what: str, done: int, total: int) -> str:
    """Records that `done` of `total` `what` are finished; returns the formatted ETA."""
    from opd_jax.io import progress as progress_lib

    key = (what, total)
    if key not in self._counters or done < self._counters[key][1]:
      first = [self._start if key not in self._counters else self._clock()]
      progress = progress_lib.Progress(
        max(total, 1), clock=lambda: first.pop() if first else self._clock()
      )
      progress.line(0 if key not in self._counters else done)
      self._counters[key] = [progress, done]
    progress = self._counters[key][0]
    progress.line(done)
    self._counters[key][1] = done
    rate = progress.rate()
    remaining = (total - done) / rate if rate == rate and rate > 0 else float("nan")
    return progress_lib.format_duration(max(remaining, 0.0) if done < total else 0.0)

  def __call__(self, *args) -> None:
    text = " ".join(str(a) for a in args)
    out, status = self._out(), None
    match = _COUNTER_RE.match(text.splitlines()[0]) if text else None
    if match:
      done, total = (int(match[1]), int(match[2])) if match[1] else (int(match[4]), int(match[5]))
      what = (match[3] or "item").strip()
      if 0 < done <= total:
        eta = self.eta(what, done, total)
        text += f" | ETA {eta}"
        elapsed = self._clock() - self._start
        from opd_jax.io import progress as progress_lib

        status = (
          f"{what} {done}/{total} | {progress_lib.format_duration(elapsed)} elapsed | ETA {eta}"
        )
    if self._status:
      out.write("\r\x1b[K")
      self._status = False
    out.write(text + "\n")
    if status and self._is_tty() and "/".join(map(str, (done, total))) != f"{total}/{total}":
      out.write(status)
      self._status = True
    out.flush()


def command_help(
  doc: str | None, flag_values: flags.FlagValues | None = None, required=(), hidden=()
) -> str:
  """The `--help` text of a command: `usage: python -m <module>`, its docstring, its own flags
  and the shared ones (`--config`, `--workdir` where it reads a run config), and where the
  config keys are.

  `flag_values` is a command's own `FlagValues` (`runner.parse_own_flags`), else the global
  flags of the `__main__` module and `opd_jax`; a flag in `HIDDEN` or `hidden` is left out, one
  in `required` says so instead of its default."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  module = getattr(spec, "name", "") or ""
  usage = [f"usage: python -m {module} [flags]", ""] if module.startswith("opd_jax.") else []
  lines = [*usage, (doc or "").strip(), "", "flags:"]
  by_module = (flag_values or flags.FLAGS).flags_by_module_dict()
  shown = set()
  main_file = getattr(sys.modules.get("__main__"), "__file__", None)
  for module in sorted(by_module, key=lambda m: (m != __name__, m)):
    if flag_values is None and (
      module not in (__name__, main_file, sys.argv[0]) and not module.startswith("opd_jax")
    ):
      continue  # absl's own flags and those of libraries (orbax): --helpfull lists them
    for flag in sorted(by_module[module], key=lambda f: f.name):
      if flag.name in shown or flag.name in HIDDEN or flag.name in hidden:
        continue
      shown.add(flag.name)
      if flag.name in required:
        default = " (required)"
      else:
        default = "" if flag.default is None else f" (default: {flag.default_as_str})"
      if flag.name == "config":
        help_text = (
          "a config file, configs/<name>.py[:variant], with --config.<key>=<value> overrides"
        )
      else:
        help_text = " ".join(str(flag.help).split())
      lines.append(
        textwrap.fill(f"  --{flag.name}: {help_text}{default}", 100, subsequent_indent="      ")
      )
  lines.append("")
  if "config" in shown:
    lines.append(f"Every config key, its default and meaning: {CONFIG_REFERENCE}")
  if flag_values is None:
    lines.append("absl's own flags: --helpfull")
  return "\n".join(lines)


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
  import jax  # here, not at the top: `--help` and the flags never import JAX

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


def exit_at_once(status: int = 0) -> None:
  """Ends a short command whose work is done and whose outputs are written and closed,
  without the interpreter's teardown, with exit status `status`.

  The teardown (the compile threads joined, the XLA client destroyed, every module freed) does
  nothing such a command needs and costs a few percent of an admission check (see
  `python -m opd_jax.bench.admission_cost`). atexit handlers do not run: only stdout, stderr
  and the log handlers are flushed, so every file the command writes must be closed before
  this call.
  """
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def _override_path(config, key: str):
  """The ConfigDict holding `key` ("a.b.c") and the last name, or None when there is none."""
  *parents, name = key.split(".")
  for parent in parents:
    config = getattr(config, parent, None)
  return (config, name) if config is not None and name in config else None


def reparse_tuple_overrides(argv: list[str], config) -> None:
  """Parses each `--config.<key>=<value>` of a tuple field again with `values.parse_value`.

  ml_collections reads `(attention,)` as the one string "(attention,)" (it is no Python
  literal); `parse_value`, the parser of `--candidate` specs, reads it as ("attention",), so the
  same text means the same value in both, written `--config.<key>=<value>` or
  `--config.<key> <value>`. Quoted and other values parse as before.
  """
  from opd_jax.config import values

  args = argv[1:]
  for i, arg in enumerate(args):
    if not arg.startswith("--config."):
      continue
    if "=" in arg:
      key, raw = arg[len("--config.") :].split("=", 1)
    elif i + 1 < len(args) and not args[i + 1].startswith("--"):
      key, raw = arg[len("--config.") :], args[i + 1]
    else:
      continue
    found = _override_path(config, key)
    if found and isinstance(found[0][found[1]], tuple):
      found[0][found[1]] = values.parse_value(raw, found[0][found[1]])


def parse_flags(argv: list[str], required=()) -> list[str]:
  """absl flag parsing, with a one-line error for a misspelt --config.key override.

  `--help` prints `command_help` for the `__main__` module (`required` flags marked) and exits
  0; a bare `--json` is `--json=-`; a tuple override parses as a `--candidate` value does
  (`reparse_tuple_overrides`).
  """
  if any(arg in HELP_ARGS for arg in argv[1:]):
    print(command_help(getattr(sys.modules.get("__main__"), "__doc__", None), None, required))
    sys.exit(0)
  argv = bare_json_to_stdout(argv)
  try:
    rest = flags.FLAGS(argv)
    if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
      reparse_tuple_overrides(argv, flags.FLAGS["config"].value)
    return rest
  except (AttributeError, KeyError) as e:
    message = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
    sys.exit(f"error: bad --config override: {message}")
  except flags.Error as e:
    sys.exit(f"error: {e}\nPass --helpshort or --helpfull to see help on flags.")
  except ValueError as e:
    sys.exit(f"error: bad --config override: {e}")
