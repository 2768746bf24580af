"""The one prologue of every `python -m opd_jax.<command>`: `run_command(main, ...)`.

A command defines its flags (absl), writes `main()` (the shared `--config`/`--workdir` are
`flags.CONFIG`/`flags.WORKDIR`) and ends with

    if __name__ == "__main__":
      runner.run_command(main, required=("config", "workdir"))

`run_command` parses the command line (`--help` prints the command's flags and exits 0 before
anything heavy is imported; a bare `--config=name.py` resolves in configs/; an old spelling in
`renames` is rewritten with a warning), refuses positional arguments, keeps library INFO
chatter out of the way unless `--verbosity` is given, and ends the process: `main`'s return
value is the exit status (None = 0; an int, e.g. 1 for "refused", is passed on), and a
`ValueError` or `FileNotFoundError` is one `error: ...` line on stderr with `error_status`.
A command that returns its own codes (admit: 0 admitted, 1 refused, 2 error) passes
`error_status=2` and returns 0 or 1 from `main` (admit ends through `flags.exit_at_once(status)`,
skipping the interpreter's teardown).

A command whose `main(argv)` is also called as a library function (tests call it with a list)
defines its flags in a function of a `FlagValues` and parses with `parse_own_flags`; its
`__main__` section is `run_command(main, own_flags=True)`, which hands `main` sys.argv[1:].
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from absl import app, flags, logging

from opd_jax.cli import flags as cli_flags

SHARED_FLAGS = ("config", "workdir")  # defined by cli.flags for every command
ATTRIBUTES = {"config.teacher.cache_dir": "teacher_cache"}  # parse_own_flags' dotted names


def _check_required(flag_values: flags.FlagValues, required: Sequence[str]) -> None:
  """Exits with one line naming the first required flag that was not given."""
  for name in required:
    if flag_values[name].value in (None, ""):
      help_text = " ".join(str(flag_values[name].help).split())
      if name == "config":
        help_text = "a config file, configs/<name>.py[:variant]"
      sys.exit(f"error: --{name} is required: {help_text}")


def _exit_on_error(call: Callable[[], int | None], error_status: int):
  """`call()`'s value (None = 0); a ValueError or FileNotFoundError, or an exit with a message
  (a bad flag), ends the process with one `error: ...` line and `error_status`."""
  try:
    return call() or 0
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(error_status)
  except SystemExit as e:
    if not isinstance(e.code, str):
      raise
    print(e.code, file=sys.stderr, flush=True)
    sys.exit(error_status)


def run_command(
  main: Callable[..., int | None],
  *,
  required: Sequence[str] = (),
  hidden: Sequence[str] = (),
  renames: dict[str, str] | None = None,
  verbosity: int = logging.WARNING,
  error_status: int = 1,
  own_flags: bool = False,
  shared: Sequence[str] = SHARED_FLAGS,
) -> None:
  """Runs `main` as the `__main__` command and exits with its status.

  Args:
    main: `main()` for a command on the global absl flags, `main(argv)` with `own_flags`.
    required: flags that must be given. `--workdir` has no default; name it here where the
      command always writes, or call `flags.needed_workdir` where it writes there only by
      default.
    hidden: flags left out of `--help` (deprecated spellings that still work).
    renames: old flag -> new flag, rewritten with a warning (`flags.rewrite_deprecated`); with
      `own_flags`, `parse_own_flags` takes them.
    verbosity: absl's verbosity unless `--verbosity` is given (orbax logs every restore at INFO).
    error_status: the exit status of a ValueError or FileNotFoundError, or of a bad flag.
    own_flags: `main(argv)` parses its own flags (`parse_own_flags`).
    shared: the flags of `cli.flags` the command takes (`--config`, `--workdir`); the others
      are left out of `--help` and refused.
  """
  if own_flags:
    sys.exit(_exit_on_error(lambda: main(sys.argv[1:]), error_status))
  argv = cli_flags.rewrite_deprecated(sys.argv, renames or {})
  cli_flags.HIDDEN.update(hidden, set(SHARED_FLAGS) - set(shared))

  def parse(args: list[str]) -> list[str]:
    rest = cli_flags.parse_flags(args, required=required)
    for name in set(SHARED_FLAGS) - set(shared):
      if flags.FLAGS[name].present:
        sys.exit(f"error: this command takes no --{name}")
    _check_required(flags.FLAGS, required)
    return rest

  def parse_or_exit(args: list[str]) -> list[str]:
    return _exit_on_error(lambda: parse(args), error_status)

  def wrapped(args: list[str]) -> int:
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {args[1:]}")
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(verbosity)
    return _exit_on_error(main, error_status)

  app.run(wrapped, argv=cli_flags.resolve_config_arg(argv), flags_parser=parse_or_exit)


def parse_own_flags(
  define: Callable[[flags.FlagValues], None],
  argv: Sequence[str] | None,
  doc: str | None,
  required: Sequence[str] = (),
  renames: dict[str, str] | None = None,
  hidden: Sequence[str] = (),
) -> argparse.Namespace:
  """Parses `argv` (without the program name; None = sys.argv[1:]) against the flags `define`
  puts on a fresh `FlagValues`, so the command's `main(argv)` can be called again in one process.

  `--help` prints `doc` and the flags and exits 0; a bare `--json` is `--json=-`; a bad or
  missing flag exits with one line; an old spelling in `renames` is rewritten with a warning
  (`flags.rewrite_deprecated`); `hidden` flags are left out of `--help`. Returns the values as
  attributes, dashes turned into underscores (`--max-new-tokens` -> `.max_new_tokens`;
  `--config.teacher.cache_dir` -> `.teacher_cache`).
  """
  flag_values = flags.FlagValues()
  define(flag_values)
  args = list(sys.argv[1:] if argv is None else argv)
  args = cli_flags.rewrite_deprecated(["command", *args], renames or {})[1:]
  if any(arg in cli_flags.HELP_ARGS for arg in args):
    print(cli_flags.command_help(doc, flag_values, required, hidden))
    sys.exit(0)
  try:
    rest = flag_values(["command", *cli_flags.bare_json_to_stdout(args)])
  except flags.Error as e:
    sys.exit(f"error: {e}\nPass --help to see the flags.")
  if len(rest) > 1:
    sys.exit(f"error: unexpected arguments: {rest[1:]}")
  _check_required(flag_values, required)
  return argparse.Namespace(
    **{ATTRIBUTES.get(n, n.replace("-", "_")): flag_values[n].value for n in flag_values}
  )
