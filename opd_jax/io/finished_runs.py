"""A workdir's finished records, carried from one sitting to the next.

A study (`experiments.study`), the OPD-against-RL comparison and a sweep reuse every run whose
`<workdir>/runs/<name>/result.json` was written for the same config (`experiments.runs.run_once`),
and the admission check's readings in `<workdir>/measurements.json` while the measured
student's fingerprint still matches (`experiments.study_probe.measure_settings`). Those small
JSON files are all a later sitting needs to skip what is finished: checkpoints, TensorBoard
events and compiled programs are not read again. So a long study runs in parts on machines that
keep nothing between sittings: save the records after a part, restore them into the same
workdir path before the next (a run's config holds its teacher cache's path, by default under
the workdir), and the next part's plan counts them as reused.

- `record_paths(workdir)`: the relative path of every file named in `RECORD_FILES` under
  `workdir`, outside the caches in `SKIPPED_DIRS`, sorted.
- `save(workdir, dest)`: copies each to the same relative path under `dest`.
- `restore(src, workdir)`: copies them back, after checking every one first: a file already in
  the workdir with other contents is refused (named), and nothing is copied; an identical one
  is left alone.

What is not carried is rebuilt by the next part: the teacher from its cache key (the same
config and code train the same teacher), and the probe (a few dozen steps); when the rebuilt
probe's fingerprint differs, its measurements are taken again rather than reused.
"""

from __future__ import annotations

import filecmp
import os
import shutil

RECORD_FILES = ("result.json", "measurements.json")
SKIPPED_DIRS = ("jax_cache", "teacher_cache", "checkpoints", "tb")


def record_paths(workdir: str) -> list[str]:
  """Every RECORD_FILES file under `workdir` (SKIPPED_DIRS left out), relative, sorted.

  Raises:
    FileNotFoundError: `workdir` is not a directory.
  """
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"{workdir} is not a directory")
  found = []
  for root, dirs, files in os.walk(workdir):
    dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
    found += [os.path.relpath(os.path.join(root, f), workdir) for f in files if f in RECORD_FILES]
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
    target = os.path.join(dest, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(os.path.join(workdir, rel), target)
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
  paths = record_paths(src)
  if not paths:
    raise ValueError(f"{src} holds no record ({' or '.join(RECORD_FILES)}) to restore")
  present, clashes = [], []
  for rel in paths:
    target = os.path.join(workdir, rel)
    if os.path.exists(target):
      same = filecmp.cmp(os.path.join(src, rel), target, shallow=False)
      (present if same else clashes).append(rel)
  if clashes:
    raise ValueError(
      f"{len(clashes)} record(s) in {workdir} differ from {src}'s and would be replaced: "
      f"{', '.join(clashes[:5])}{' ...' if len(clashes) > 5 else ''}; nothing was copied"
    )
  copied = [rel for rel in paths if rel not in present]
  for rel in copied:
    target = os.path.join(workdir, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(os.path.join(src, rel), target)
  return {"copied": copied, "present": present}
