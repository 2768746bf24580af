"""A workdir's finished records, carried from one sitting to the next.

A study (`experiments.study`), the OPD-against-RL comparison and a sweep reuse every run whose
`<workdir>/runs/<name>/result.json` was written for the same config (`experiments.runs.run_once`),
and the admission check's readings in `<workdir>/measurements.json` while the measured
student's fingerprint still matches (`experiments.study_probe.measure_settings`). Those small
JSON files are all a later sitting needs to skip what is finished; a finished run's
`metrics.jsonl` travels with its result (gzip-compressed, about a fifth of its size), because the
OPD-against-RL table reads its training curves (accuracy at T = 1, reward, gradient-norm spikes).
Checkpoints, TensorBoard events and compiled programs are not read again. So a long study
runs in parts on machines that keep nothing between sittings: save the records after a part,
restore them into the same workdir path before the next (a run's config holds its teacher
cache's path, by default under the workdir), and the next part's plan counts them as reused.

- `record_paths(workdir)`: the relative path of every file named in `RECORD_FILES` under
  `workdir`, outside the caches in `SKIPPED_DIRS`, and of each `RUN_LOG` beside a result,
  sorted. The log of a run without a result stays behind: that run trains again from its
  first step, and its writer would append to a carried log.
- `save(workdir, dest)`: copies each to the same relative path under `dest` (a `RUN_LOG` as
  `metrics.jsonl.gz`, compressed with no timestamp, so saving the same log twice writes the
  same bytes).
- `restore(src, workdir)`: copies them back, after checking every one first: a file already in
  the workdir with other contents is refused (named), and nothing is copied; an identical one
  is left alone.

What is not carried is rebuilt by the next part: the teacher from its cache key (the same
config and code train the same teacher), and the probe (a few dozen steps); when the rebuilt
probe's fingerprint differs, its measurements are taken again rather than reused.
"""

from __future__ import annotations

import gzip
import os

RECORD_FILES = ("result.json", "measurements.json")
RUN_LOG = "metrics.jsonl"  # carried for a run with a result.json beside it
COMPRESSED = ".gz"
SKIPPED_DIRS = ("jax_cache", "teacher_cache", "checkpoints", "tb")


def _walk(root_dir: str):
  """(directory relative to `root_dir`, its file names) outside SKIPPED_DIRS; a folder that is
  a symbolic link is followed (its runs are the workdir's too), each real folder once."""
  seen = set()
  for root, dirs, files in os.walk(root_dir, followlinks=True):
    real = os.path.realpath(root)
    if real in seen:  # a link back into the tree
      dirs[:] = []
      continue
    seen.add(real)
    dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
    yield os.path.relpath(root, root_dir), set(files)


def _stored(rel: str) -> str:
  """The name under the records directory of workdir file `rel`."""
  return rel + COMPRESSED if os.path.basename(rel) == RUN_LOG else rel


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    data = f.read()
  return gzip.decompress(data) if path.endswith(COMPRESSED) else data


def _write(path: str, data: bytes) -> None:
  """Writes a temporary file beside `path` and renames it, so that a save or restore killed
  midway leaves no half-written record."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(gzip.compress(data, mtime=0) if path.endswith(COMPRESSED) else data)
  os.replace(tmp, path)


def record_paths(workdir: str) -> list[str]:
  """Every RECORD_FILES file under `workdir` (SKIPPED_DIRS left out), and each RUN_LOG beside a
  result.json, relative, sorted.

  Raises:
    FileNotFoundError: `workdir` is not a directory.
  """
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"{workdir} is not a directory")
  found = []
  for rel_dir, files in _walk(workdir):
    names = [f for f in files if f in RECORD_FILES]
    if RUN_LOG in files and "result.json" in files:
      names.append(RUN_LOG)
    found += [os.path.normpath(os.path.join(rel_dir, f)) for f in names]
  return sorted(found)


def _stored_paths(src: str) -> list[str]:
  """The workdir-relative path of every record stored under `src` (RUN_LOG from its .gz)."""
  if not os.path.isdir(src):
    raise FileNotFoundError(f"{src} is not a directory")
  found = []
  for rel_dir, files in _walk(src):
    names = [f for f in files if f in RECORD_FILES]
    names += [RUN_LOG for f in files if f == RUN_LOG + COMPRESSED]
    found += [os.path.normpath(os.path.join(rel_dir, f)) for f in names]
  return sorted(found)


def save(workdir: str, dest: str) -> list[str]:
  """Copies `workdir`'s records to the same relative paths under `dest`; returns those paths.

  Raises:
    FileNotFoundError: `workdir` is not a directory.
    ValueError: `workdir` holds no record (nothing finished yet), or `dest` lies inside it
      (a later save would carry the copies too).
  """
  inside = os.path.commonpath([os.path.abspath(workdir), os.path.abspath(dest)])
  if inside == os.path.abspath(workdir):
    raise ValueError(f"save the records outside the workdir: {dest} is inside {workdir}")
  paths = record_paths(workdir)
  if not paths:
    raise ValueError(f"{workdir} holds no finished record ({' or '.join(RECORD_FILES)})")
  for rel in paths:
    _write(os.path.join(dest, _stored(rel)), _read(os.path.join(workdir, rel)))
  return paths


def restore(src: str, workdir: str) -> dict[str, list[str]]:
  """Copies `src`'s records into `workdir` (module docstring).

  Returns:
    {"copied": relative paths written, "present": those already there, identical}.

  Raises:
    FileNotFoundError: `src` is not a directory.
    ValueError: `src` holds no record, or a record would replace a different file in the
      workdir (every such path named; nothing is copied).
  """
  paths = _stored_paths(src)
  if not paths:
    raise ValueError(f"{src} holds no record ({' or '.join(RECORD_FILES)}) to restore")
  present, clashes = [], []
  for rel in paths:
    target = os.path.join(workdir, rel)
    if os.path.exists(target):
      same = _read(os.path.join(src, _stored(rel))) == _read(target)
      (present if same else clashes).append(rel)
  if clashes:
    raise ValueError(
      f"{len(clashes)} record(s) in {workdir} differ from {src}'s and would be replaced: "
      f"{', '.join(clashes[:5])}{' ...' if len(clashes) > 5 else ''}; nothing was copied"
    )
  copied = [rel for rel in paths if rel not in present]
  for rel in copied:
    _write(os.path.join(workdir, rel), _read(os.path.join(src, _stored(rel))))
  return {"copied": copied, "present": present}
