"""A directory rewritten all at once: a writer that fails part way leaves the old one whole.

`replaced_directory(path, owned)` yields an empty staging directory beside `path`. The writer
fills it; on a clean exit the files of the old `path` that the writer does not own
(`owned(name)` false, and no file of that name written) are copied in, and the staging
directory takes `path`'s place by two renames (`path` → `path.old<pid>`, staging → `path`).
An exception inside the block removes the staging directory and leaves `path` as it was.
Between the two renames `path` is briefly absent, with both the old and the new directory
whole on disk; a crash there is reported by the next writer, which refuses to write while
`path` is absent and a `path.old*` holds the old contents.

An object store (a `gs://` URI) has no renames: `upload(local, uri, owned)` copies a finished
local directory there, config.json last, then deletes the owned objects it did not write.
That is not atomic; a reader that waits for config.json sees whole weights (the teacher
cache's `is_cached` does).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator

from etils import epath


def _copy_entry(source: str, target: str) -> None:
  if os.path.isdir(source) and not os.path.islink(source):
    shutil.copytree(source, target, symlinks=True)
  else:
    shutil.copy2(source, target, follow_symlinks=False)


@contextlib.contextmanager
def replaced_directory(path: str | os.PathLike, owned: Callable[[str], bool]) -> Iterator[str]:
  """Yields a staging directory that replaces `path` when the block exits cleanly (module
  docstring). A symlinked `path` is resolved, so the link keeps pointing where it did.

  Args:
    path: the directory to write (need not exist).
    owned: says of a file name in the old `path` whether the writer owns it, i.e. whether it
      must not survive unless written anew (weights, configs, tokenizer files).

  Raises:
    ValueError: `path` exists and is not a directory; `path` is absent while an interrupted
      write's `path.old*` holds its old contents.
  """
  target = os.path.realpath(os.fspath(path))
  if os.path.exists(target) and not os.path.isdir(target):
    raise ValueError(f"{path} exists and is not a directory")
  parent = os.path.dirname(target)
  os.makedirs(parent, exist_ok=True)
  if not os.path.exists(target):
    prefix = os.path.basename(target) + ".old"
    stranded = sorted(n for n in os.listdir(parent) if n.startswith(prefix))
    if stranded:
      raise ValueError(
        f"{path} is missing and {os.path.join(parent, stranded[0])} holds its old contents "
        "(an earlier write stopped between its two renames); move it back to "
        f"{path} or delete it, then write again"
      )
  stage = f"{target}.tmp{os.getpid()}"
  old = f"{target}.old{os.getpid()}"
  for leftover in (stage, old):
    if os.path.lexists(leftover):
      shutil.rmtree(leftover)
  os.makedirs(stage)
  try:
    yield stage
    if os.path.isdir(target):
      written = set(os.listdir(stage))
      for name in os.listdir(target):
        if name not in written and not owned(name):
          _copy_entry(os.path.join(target, name), os.path.join(stage, name))
      os.rename(target, old)
      os.rename(stage, target)
      shutil.rmtree(old)
    else:
      os.rename(stage, target)
  except BaseException:
    if os.path.isdir(stage):
      shutil.rmtree(stage, ignore_errors=True)
    raise


def upload(
  local: str, uri: str, owned: Callable[[str], bool], last: str = "config.json"
) -> list[str]:
  """Copies the files of the finished directory `local` to the object-store directory `uri`
  (`last` after the others), then deletes the objects in `uri` that `owned` claims and that
  were not written. Returns the names in `uri`, sorted."""
  target = epath.Path(uri)
  target.mkdir(parents=True, exist_ok=True)
  names = sorted(os.listdir(local), key=lambda n: (n == last, n))
  for name in names:
    with open(os.path.join(local, name), "rb") as f:
      (target / name).write_bytes(f.read())
  for stale in target.iterdir():
    if stale.name not in names and owned(stale.name):
      stale.unlink()
  return sorted(p.name for p in target.iterdir())
