"""`io.json_file`: the one JSON writer and reader every command and experiment uses."""

import json

import numpy as np
import pytest

from opd_jax.io import json_file


def test_write_json_is_indented_newline_terminated_and_reads_back(tmp_path):
  path = tmp_path / "deep" / "x.json"  # parents are made
  json_file.write_json(str(path), {"a": np.float32(0.5), "b": [1, 2]})
  text = path.read_text()
  assert text == '{\n "a": 0.5,\n "b": [\n  1,\n  2\n ]\n}\n'
  assert not (tmp_path / "deep" / "x.json.tmp").exists()  # renamed over the target
  assert json_file.read_json(str(path)) == {"a": 0.5, "b": [1, 2]}


def test_read_json_default_only_for_a_missing_file(tmp_path):
  missing = str(tmp_path / "none.json")
  assert json_file.read_json(missing, None) is None
  assert json_file.read_json(missing, {"k": 1}) == {"k": 1}
  with pytest.raises(FileNotFoundError):
    json_file.read_json(missing)


def test_dash_writes_to_stdout_and_an_empty_target_is_refused(capsys):
  json_file.write_json("-", {"a": 1})
  assert json.loads(capsys.readouterr().out) == {"a": 1}
  with pytest.raises(ValueError, match="--json needs a path"):
    json_file.write_text("", "{}")
