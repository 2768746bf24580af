"""opd_jax.io.staged_dir: a directory replaced whole, or not at all."""

from __future__ import annotations

import os

import pytest

from opd_jax.io import staged_dir


def _owned(name):
  return name.endswith(".bin")


def test_replaces_owned_files_and_keeps_the_rest(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "old.bin").write_text("stale")
  (out / "notes.txt").write_text("keep")
  (out / "sub").mkdir()
  (out / "sub" / "x").write_text("y")
  with staged_dir.replaced_directory(out, _owned) as stage:
    assert os.listdir(stage) == [] and os.path.dirname(stage) == str(tmp_path)
    (tmp_path / os.path.basename(stage) / "new.bin").write_text("new")
  assert sorted(os.listdir(out)) == ["new.bin", "notes.txt", "sub"]
  assert (out / "sub" / "x").read_text() == "y"
  assert sorted(os.listdir(tmp_path)) == ["out"]


def test_an_error_leaves_the_directory_as_it_was(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "a.bin").write_text("old")
  with (
    pytest.raises(RuntimeError, match="midway"),
    staged_dir.replaced_directory(out, _owned) as stage,
  ):
    with open(os.path.join(stage, "a.bin"), "w") as f:
      f.write("half")
    raise RuntimeError("midway")
  assert os.listdir(out) == ["a.bin"] and (out / "a.bin").read_text() == "old"
  assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_new_directory_and_a_symlinked_one(tmp_path):
  with staged_dir.replaced_directory(tmp_path / "fresh" / "out", _owned) as stage:
    open(os.path.join(stage, "w.bin"), "w").close()
  assert os.listdir(tmp_path / "fresh" / "out") == ["w.bin"]
  (tmp_path / "link").symlink_to(tmp_path / "fresh" / "out")
  with staged_dir.replaced_directory(tmp_path / "link", _owned) as stage:
    open(os.path.join(stage, "v.bin"), "w").close()
  assert (tmp_path / "link").is_symlink() and os.listdir(tmp_path / "link") == ["v.bin"]


def test_refuses_a_file_and_a_stranded_old_copy(tmp_path):
  (tmp_path / "file").write_text("x")
  with (
    pytest.raises(ValueError, match="exists and is not a directory"),
    staged_dir.replaced_directory(tmp_path / "file", _owned),
  ):
    pass
  (tmp_path / "out.old123").mkdir()  # a write that stopped between its two renames
  with (
    pytest.raises(ValueError, match=r"out is missing and .*out\.old123 holds its old"),
    staged_dir.replaced_directory(tmp_path / "out", _owned),
  ):
    pass
  assert not (tmp_path / "out").exists()
