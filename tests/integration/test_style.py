"""The tree is clean under the ruff lint and format settings in pyproject.toml."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args):
  exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
  return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")])
def test_ruff_clean(args):
  result = _ruff(*args)
  assert result.returncode == 0, result.stdout + result.stderr
