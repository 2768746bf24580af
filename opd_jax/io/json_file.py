"""JSON files as every command and experiment writes and reads them.

`write_json(path, value)`: indented (`indent=1`), numpy scalars as floats, newline-terminated,
written to `path.tmp` and renamed so that a reader never sees half a file; `path` "-" prints
it to stdout instead. `read_json(path[, default])`: the file's value, or `default` when absent.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def write_text(target: str, text: str) -> None:
  """Writes `text` (newline-terminated) to the file `target`, parents made, atomically (a
  temporary file renamed over it); `target` "-" writes it to stdout.

  Raises:
    ValueError: an empty target.
  """
  if not target:
    raise ValueError("--json needs a path, or - for stdout")
  text = text if text.endswith("\n") else text + "\n"
  if target == "-":
    sys.stdout.write(text)
    sys.stdout.flush()
    return
  os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
  tmp = target + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, target)


def write_json(target: str, value: Any) -> None:
  """`value` as indented JSON at `target` (`write_text`; "-" for stdout)."""
  write_text(target, json.dumps(value, indent=1, default=float))


_NO_DEFAULT = object()


def read_json(path: str, default: Any = _NO_DEFAULT) -> Any:
  """The JSON value in `path`, or `default` when there is no such file (without a default,
  FileNotFoundError)."""
  if default is not _NO_DEFAULT and not os.path.exists(path):
    return default
  with open(path, encoding="utf-8") as f:
    return json.load(f)
