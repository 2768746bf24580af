"""`io.provenance`: the git SHA, the dirty flag and its diff hash, and the config hash, in and
out of a git checkout (a real repository made with `git init`)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opd_jax.io import provenance
from opd_jax.train import setup as setup_lib

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))
import base  # noqa: E402

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo, *args):
  subprocess.run(
    ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
    check=True,
    capture_output=True,
  )


@pytest.fixture
def repo(tmp_path):
  root = tmp_path / "repo"
  (root / "pkg").mkdir(parents=True)
  (root / "pkg" / "code.py").write_text("x = 1\n")
  (root / ".gitignore").write_text("/ignored/\n")
  _git(root, "init", "-q")
  _git(root, "add", ".")
  _git(root, "commit", "-q", "-m", "first")
  return root


@needs_git
def test_a_clean_checkout_records_its_head_and_no_diff(repo):
  head = subprocess.run(
    ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
  ).stdout.strip()
  state = provenance.code_state(str(repo / "pkg"))  # any directory inside the checkout
  assert state == {"git_sha": head, "dirty": False, "diff_sha256": None}
  assert provenance.code_key(state) == head
  assert provenance.describe(head) == f"commit {head[:12]}"


@needs_git
def test_dirty_detection_and_a_diff_hash_that_tells_edits_apart(repo):
  (repo / "outputs.json").write_text("{}")  # a run's output inside the checkout: not code
  (repo / "ignored").mkdir()
  (repo / "ignored" / "x.py").write_text("ignored = True\n")
  assert provenance.code_state(str(repo))["dirty"] is False

  (repo / "pkg" / "code.py").write_text("x = 2\n")
  first = provenance.code_state(str(repo))
  assert first["dirty"] is True and len(first["diff_sha256"]) == provenance.DIFF_SHOWN
  assert provenance.code_state(str(repo)) == first  # the same edit hashes alike

  (repo / "pkg" / "code.py").write_text("x = 3\n")
  second = provenance.code_state(str(repo))
  assert second["diff_sha256"] != first["diff_sha256"]
  assert provenance.code_key(second) == f"{second['git_sha']}+{second['diff_sha256']}"
  assert "uncommitted changes" in provenance.describe(provenance.code_key(second))

  (repo / "pkg" / "code.py").write_text("x = 1\n")
  (repo / "pkg" / "new.py").write_text("y = 1\n")  # an untracked module is code
  third = provenance.code_state(str(repo))
  assert third["dirty"] is True and third["diff_sha256"] not in (
    first["diff_sha256"],
    second["diff_sha256"],
  )


def test_outside_a_checkout_everything_is_unknown_and_nothing_raises(tmp_path):
  state = provenance.provenance({"a": 1}, root=str(tmp_path))
  assert state["git_sha"] == provenance.UNKNOWN
  assert state["dirty"] is None and state["diff_sha256"] is None
  assert state["config_sha256"] == provenance.config_sha256({"a": 1})
  assert provenance.code_key(state) == f"{provenance.UNKNOWN}+{provenance.package_sha256()}"
  # Two versions of the package outside git are two keys; an old record without the hash is
  # still "unknown".
  other = dict(state, package_sha256="0" * 12)
  assert provenance.code_key(other) != provenance.code_key(state)
  assert provenance.code_key(dict(state, package_sha256=None)) == provenance.UNKNOWN
  assert "package files" in provenance.describe(provenance.code_key(state))
  assert provenance.provenance(root=str(tmp_path / "missing"))["git_sha"] == provenance.UNKNOWN
  assert provenance.code_key(None) == provenance.UNRECORDED  # an output written before


def test_config_hash_is_stable_and_sensitive():
  config = base.get_config()
  digest = provenance.config_sha256(config)
  assert digest == provenance.config_sha256(base.get_config())  # a fresh copy: the same
  assert len(digest) == 64
  # the spec made from it holds the same reprs: the same hash
  assert provenance.config_sha256(setup_lib.run_spec(config)) == digest
  changed = base.get_config()
  changed.train.lr = config.train.lr * 2
  assert provenance.config_sha256(changed) != digest
  # key order does not matter, a value's type does
  assert provenance.config_sha256({"a": 1, "b": {"c": 2}}) == provenance.config_sha256(
    {"b": {"c": 2}, "a": 1}
  )
  assert provenance.config_sha256({"a": 1}) != provenance.config_sha256({"a": 1.0})
  assert provenance.config_sha256({"a": 1}) != provenance.config_sha256({"a": "1"})
  with pytest.raises(ValueError, match="expected a ConfigDict"):
    provenance.config_sha256(3)


def test_a_run_trained_by_two_versions_has_a_mixed_key():
  """A run resumed under other code lists each stretch's code; its key is neither version's, so
  a study that refuses mixed code refuses it; one version listed twice is that version."""
  entry = {"git_sha": "b" * 40, "dirty": False, "diff_sha256": None}
  mixed = dict(entry, code_segments=["a" * 40, "b" * 40])
  assert provenance.code_key(mixed) == f"mixed({'a' * 40}|{'b' * 40})"
  assert provenance.code_key(dict(entry, code_segments=["b" * 40, "b" * 40])) == "b" * 40
  assert provenance.describe(provenance.code_key(mixed)) == (
    f"mixed code: commit {'a' * 12}, then commit {'b' * 12}"
  )
