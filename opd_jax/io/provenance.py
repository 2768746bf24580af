"""Which code and which config made an output: the `provenance` entry every run, probe,
measurement, calibration, study and check records.

`provenance(resolved)` is {"git_sha", "dirty", "diff_sha256", "config_sha256"}:

- git_sha: the commit of the git checkout holding this package ("unknown" outside one, or when
  git is missing or fails: never an error);
- dirty: whether that checkout differs from its commit (tracked files changed, or untracked
  `.py` files: code and configs are Python, while outputs written inside the checkout are not,
  so a run's own files never make the code dirty); None when unknown;
- diff_sha256: the first DIFF_SHOWN hex digits of sha256 over `git diff HEAD --binary` and each
  untracked `.py` file's path and bytes, so that two dirty trees with different edits differ;
  None when clean or unknown;
- config_sha256: sha256 of the resolved config (`config_sha256`).

Two outputs were made by the same code iff their `code_key`s are equal (the SHA and the diff
hash); `describe` names a version in one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
from collections.abc import Mapping
from typing import Any

from opd_jax.config import check as config_check

UNKNOWN = "unknown"  # git_sha outside a git checkout
DIFF_SHOWN = 12  # hex digits of the diff hash kept
SHA_SHOWN = 12  # hex digits of a SHA in messages
UNRECORDED = "unrecorded"  # the code_key of an output written before provenance was recorded
KEY = "provenance"  # the entry's name in every output
SEGMENTS = "code_segments"  # a run's code keys in the order they trained it, when several
_GIT_TIMEOUT_S = 10
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(root: str, *args: str) -> bytes | None:
  """`git -C root args` stdout, or None when git is missing, fails or times out."""
  try:
    done = subprocess.run(
      ["git", "-C", root, *args],
      capture_output=True,
      timeout=_GIT_TIMEOUT_S,
      check=False,
    )
  except (OSError, subprocess.SubprocessError):
    return None
  return done.stdout if done.returncode == 0 else None


def package_sha256() -> str:
  """sha256 (first DIFF_SHOWN hex digits) of this package's .py files, path and bytes, sorted
  by path: what tells two versions of the code apart where git cannot."""
  digest = hashlib.sha256()
  for top, dirs, files in os.walk(PACKAGE_DIR):
    dirs.sort()
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(top, name)
      digest.update(f"\0{os.path.relpath(path, PACKAGE_DIR)}\0".encode())
      with open(path, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()[:DIFF_SHOWN]


def code_state(root: str | None = None) -> dict[str, Any]:
  """{"git_sha", "dirty", "diff_sha256"} of the git checkout holding `root` (default: this
  package's directory); outside a checkout (or where git refuses it) "unknown"/None/None and
  "package_sha256", the hash of the package's own files (`package_sha256`), so that
  `code_key` still tells two versions apart (module docstring)."""
  root = root or PACKAGE_DIR

  def unknown() -> dict[str, Any]:  # the package is hashed only where git cannot say
    return {
      "git_sha": UNKNOWN,
      "dirty": None,
      "diff_sha256": None,
      "package_sha256": package_sha256(),
    }

  sha = _git(root, "rev-parse", "--verify", "HEAD")
  top = _git(root, "rev-parse", "--show-toplevel")
  if sha is None or top is None:
    return unknown()
  top_dir = top.decode().strip()
  diff = _git(top_dir, "diff", "HEAD", "--binary")
  untracked = _git(top_dir, "ls-files", "--others", "--exclude-standard", "-z", "--", "*.py")
  if diff is None or untracked is None:
    return unknown()
  digest = hashlib.sha256(diff)
  new_files = sorted(p for p in untracked.decode().split("\0") if p)
  for path in new_files:
    digest.update(f"\0{path}\0".encode())
    try:
      with open(os.path.join(top_dir, path), "rb") as f:
        digest.update(f.read())
    except OSError:
      digest.update(b"<unreadable>")
  dirty = bool(diff) or bool(new_files)
  return {
    "git_sha": sha.decode().strip(),
    "dirty": dirty,
    "diff_sha256": digest.hexdigest()[:DIFF_SHOWN] if dirty else None,
  }


def _flat(resolved: Any, prefix: str = "") -> list[tuple[str, str]]:
  """(dotted key, repr of its value) for every leaf of `resolved` (module `config_sha256`)."""
  values = getattr(resolved, "values", None)
  if dataclasses.is_dataclass(resolved) and isinstance(values, tuple) and values:
    return [(prefix + k, v) for k, v in values]  # a RunSpec: its ConfigDict's reprs
  if hasattr(resolved, "to_dict") and hasattr(resolved, "items"):  # an ml_collections ConfigDict
    return [(k, repr(v)) for k, v in config_check.flatten(resolved, prefix)]
  if dataclasses.is_dataclass(resolved) and not isinstance(resolved, type):
    resolved = {f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved)}
  if isinstance(resolved, Mapping):
    out = []
    for key, value in resolved.items():
      nested = isinstance(value, Mapping) or hasattr(value, "to_dict")
      nested = nested or (dataclasses.is_dataclass(value) and not isinstance(value, type))
      if nested:
        out += _flat(value, f"{prefix}{key}.")
      else:
        out.append((f"{prefix}{key}", repr(value)))
    return out
  raise ValueError(
    f"config_sha256: expected a ConfigDict, a run spec, a dataclass or a mapping, got "
    f"{type(resolved).__name__}"
  )


def config_sha256(resolved: Any) -> str:
  """sha256 of a resolved config: of the JSON list of its (dotted key, repr(value)) pairs
  sorted by key. A ConfigDict and the `RunSpec` made from it (`train.setup.run_spec`, whose
  `values` hold the same reprs) hash alike; the order keys were set in does not matter; any
  changed value changes the hash.

  Args:
    resolved: an ml_collections ConfigDict, a `RunSpec`, another dataclass or a nested mapping.

  Raises:
    ValueError: anything else.
  """
  pairs = sorted(_flat(resolved))
  return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


def provenance(resolved: Any = None, root: str | None = None) -> dict[str, Any]:
  """The `provenance` entry: `code_state(root)` and, with `resolved`, its config_sha256
  (None without one)."""
  out = code_state(root)
  out["config_sha256"] = None if resolved is None else config_sha256(resolved)
  return out


def code_key(entry: Mapping[str, Any] | None) -> str:
  """What identifies the code an output was made by: "<sha>" for a clean checkout,
  "<sha>+<diff hash>" for a dirty one, "unknown+<package hash>" outside a checkout ("unknown"
  for an output that recorded no package hash), UNRECORDED for an output with no provenance
  (written before it was recorded)."""
  if not entry:
    return UNRECORDED
  segments = list(dict.fromkeys(entry.get(SEGMENTS) or ()))
  if len(segments) > 1:  # a run resumed under other code, or code changed while it ran
    return f"mixed({'|'.join(segments)})"
  sha = entry.get("git_sha") or UNKNOWN
  if sha == UNKNOWN:
    package = entry.get("package_sha256")
    return f"{UNKNOWN}+{package}" if package else UNKNOWN
  diff = entry.get("diff_sha256")
  return f"{sha}+{diff}" if entry.get("dirty") and diff else sha


def describe(key: str) -> str:
  """A `code_key` in a line: "commit 1a2b3c4d5e6f", "commit 1a2b3c4d5e6f with uncommitted
  changes (diff 9f8e…)", "unknown code (outside a git checkout)", "unrecorded code"."""
  if key == UNRECORDED:
    return "unrecorded code (written before provenance was recorded)"
  if key.startswith("mixed("):
    parts = key[len("mixed(") : -1].split("|")
    return "mixed code: " + ", then ".join(describe(k) for k in parts)
  if key == UNKNOWN:
    return "unknown code (outside a git checkout)"
  if key.startswith(f"{UNKNOWN}+"):
    return f"code outside a git checkout (package files {key.partition('+')[2]})"
  sha, _, diff = key.partition("+")
  text = f"commit {sha[:SHA_SHOWN]}"
  return f"{text} with uncommitted changes (diff {diff})" if diff else text
