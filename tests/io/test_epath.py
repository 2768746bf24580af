"""Workdirs on object storage: every file the run keeps goes through `etils.epath`.

`gs://` paths are served here by fsspec's in-memory filesystem registered under the `gs`
protocol (the one epath's fsspec backend asks for), with one object-store rule added: an
object cannot be appended to. No network. Orbax writes checkpoint arrays to gs:// with its own
tensorstore driver, which this fake does not serve, so checkpoints are tested on local paths
(tests/train/test_trainer.py, tests/train/test_faults.py) and only their directory handling here.
"""

import importlib
import json
import os
import sys
from pathlib import Path

import fsspec
import jax
import numpy as np
import pytest
from conftest import tiny_model_cfg
from etils import epath
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem

from opd_jax.budget import fit_budget
from opd_jax.io import build, checkpointing, hf_export, metrics_writer
from opd_jax.mismatch import budget_file
from opd_jax.model import tokenizer as tokenizer_lib
from opd_jax.model import transformer as model
from opd_jax.train import preflight, pretrain
from opd_jax.train import setup as setup_lib
from opd_jax.train.setup import run_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "configs"))

import bf16_sync  # noqa: E402


class ObjectStore(MemoryFileSystem):
  """An in-memory bucket store: whole objects are written or read, never appended to."""

  protocol = ("gs", "gcs")
  root_marker = ""
  store: dict = {}  # its own, not MemoryFileSystem's
  pseudo_dirs = [""]

  def _open(self, path, mode="rb", **kwargs):
    if "a" in mode:
      raise NotImplementedError(f"object {path} cannot be appended to (mode {mode!r})")
    return super()._open(path, mode, **kwargs)


@pytest.fixture
def bucket():
  """gs://bucket, empty, in memory; the `gs` protocol is restored afterwards."""
  saved = {p: fsspec.registry.get(p) for p in ObjectStore.protocol}
  for p in ObjectStore.protocol:
    fsspec.register_implementation(p, ObjectStore, clobber=True)
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  ObjectStore.store.clear()
  ObjectStore.pseudo_dirs[:] = [""]
  yield "gs://bucket"
  ObjectStore.store.clear()
  for p, cls in saved.items():
    importlib.import_module("fsspec.registry")._registry.pop(p, None)  # no unregister API
    if cls is not None:
      fsspec.register_implementation(p, cls, clobber=True)
  epath_backend.fsspec_backend._get_filesystem.cache_clear()


def test_the_fake_store_refuses_appends(bucket):
  path = epath.Path(bucket) / "x.txt"
  path.write_text("a")
  with pytest.raises(NotImplementedError, match="cannot be appended to"), path.open("a") as f:
    f.write("b")


def test_metrics_on_an_object_store_are_uploaded_and_a_second_writer_continues_the_log(bucket):
  workdir = f"{bucket}/run"
  with metrics_writer.MetricsWriter(workdir) as w:
    w.write_scalars(1, {"loss/total": 0.5, "quality/acc": float("nan")})
    w.write_histogram(1, "rollout/version_lag", np.array([0, 1, 1]))
    w.write_text(1, "quality/samples", "1+1=2")
  run = epath.Path(workdir)
  assert (run / "metrics.jsonl").exists()
  assert [p.name.startswith("events.out.tfevents") for p in (run / "tb").iterdir()] == [True]
  with metrics_writer.MetricsWriter(workdir) as w:  # a resumed run
    w.write_scalars(2, {"loss/total": 0.25})
  rows = metrics_writer.read_jsonl(workdir)
  assert rows[1]["loss/total"] == 0.5 and np.isnan(rows[1]["quality/acc"])
  assert rows[2] == {"loss/total": 0.25}
  assert metrics_writer.read_scalars(workdir)["loss/total"] == [(1, 0.5), (2, 0.25)]
  assert len(list((run / "tb").iterdir())) == 2  # one event file per writer


def test_metrics_are_uploaded_every_sync_secs_not_only_at_close(bucket):
  workdir = f"{bucket}/run"
  w = metrics_writer.MetricsWriter(workdir, sync_secs=0.0)
  w.write_scalars(3, {"loss/total": 1.0})
  assert metrics_writer.read_jsonl(workdir) == {3: {"loss/total": 1.0}}  # before close
  w.close()
  quiet = metrics_writer.MetricsWriter(f"{bucket}/quiet", sync_secs=3600.0)
  quiet.write_scalars(3, {"loss/total": 1.0})
  assert metrics_writer.read_jsonl(f"{bucket}/quiet") == {}  # staged, not yet uploaded
  quiet.close()
  assert metrics_writer.read_jsonl(f"{bucket}/quiet") == {3: {"loss/total": 1.0}}


def test_a_disabled_writer_touches_nothing_remote(bucket):
  with metrics_writer.MetricsWriter(f"{bucket}/run", enabled=False) as w:
    w.write_scalars(1, {"loss/total": 1.0})
  assert not epath.Path(f"{bucket}/run").exists()


def test_budget_file_round_trip_on_an_object_store(bucket):
  records = [
    {"source": "s", "mismatch/kl": 0.1 * i, "quality_drop": float(i > 5)} for i in range(1, 11)
  ]
  budget = fit_budget(records, 0.5)
  fp = {"quant_format": "fp8", "backend": "cpu"}
  path = f"{bucket}/budgets/run1/budget.json"
  budget_file.save_budget(path, budget, fp)
  assert [p.name for p in epath.Path(path).parent.iterdir()] == ["budget.json"]  # no .tmp left
  loaded, loaded_fp = budget_file.load_budget(path)
  assert loaded == budget and loaded_fp == fp
  with pytest.raises(FileNotFoundError):
    budget_file.load_budget(f"{bucket}/budgets/missing.json")


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_teacher_cache_entry_round_trips_bit_for_bit(bucket, tmp_path, where):
  cfg = tiny_model_cfg()
  params = jax.device_get(model.init_params(jax.random.key(0), cfg))
  root = str(tmp_path) if where == "local" else f"{bucket}/cache"
  directory = f"{root}/teacher-0123"
  assert not pretrain.is_cached(directory)
  pretrain.save_cached(directory, cfg, params)
  assert pretrain.is_cached(directory)
  loaded = pretrain.load_cached(directory, jax.numpy.float32, None)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_two_runs_writing_one_local_cache_entry_keep_the_first(tmp_path):
  """Two runs that bootstrap the same entry at once: the second save finds the first's
  complete entry, keeps it and removes its own copy; a non-entry in the way is named."""
  cfg = tiny_model_cfg()
  first = jax.device_get(model.init_params(jax.random.key(0), cfg))
  second = jax.device_get(model.init_params(jax.random.key(1), cfg))
  directory = tmp_path / "teacher-0123"
  pretrain.save_cached(os.fspath(directory), cfg, first)
  pretrain.save_cached(os.fspath(directory), cfg, second)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher-0123"]  # no temporary left
  loaded = pretrain.load_cached(os.fspath(directory), jax.numpy.float32, None)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(loaded), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  junk = tmp_path / "teacher-4567"
  junk.mkdir()
  (junk / "notes.txt").write_text("not a checkpoint")
  with pytest.raises(ValueError, match=f"cannot write the cache entry {junk}: .*delete it"):
    pretrain.save_cached(os.fspath(junk), cfg, first)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher-0123", "teacher-4567"]


def test_an_upload_cut_short_is_not_a_cache_entry_and_a_corrupt_one_is_named(bucket):
  cfg = tiny_model_cfg()
  params = jax.device_get(model.init_params(jax.random.key(0), cfg))
  directory = epath.Path(f"{bucket}/cache/teacher-0123")
  pretrain.save_cached(os.fspath(directory), cfg, params)
  (directory / "config.json").unlink()  # as if killed before the last upload
  assert not pretrain.is_cached(os.fspath(directory))
  pretrain.save_cached(os.fspath(directory), cfg, params)  # the next run writes it again
  weights = directory / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:-64])
  with pytest.raises(ValueError, match=f"the cached checkpoint {directory} cannot be read .*"):
    pretrain.load_cached(os.fspath(directory), jax.numpy.float32, None)


def test_checkpointer_keeps_a_uri_and_makes_a_local_path_absolute(tmp_path, monkeypatch):
  # Orbax itself needs google-cloud-storage for a gs:// manager, so only the path is checked.
  assert checkpointing.absolute("gs://bucket/run/checkpoints") == "gs://bucket/run/checkpoints"
  monkeypatch.chdir(tmp_path)
  local = checkpointing.Checkpointer("run/checkpoints")
  assert local.directory == str(tmp_path / "run" / "checkpoints") and local.latest_step() is None
  local.close()


def test_jsonl_lines_on_the_store_are_plain_json(bucket):
  with metrics_writer.MetricsWriter(f"{bucket}/run") as w:
    w.write_scalars(5, {"a": 1})
  text = (epath.Path(bucket) / "run" / "metrics.jsonl").read_text()
  assert [json.loads(line) for line in text.splitlines()] == [{"step": 5, "a": 1}]


def test_preflight_checks_a_bucket_workdir_on_the_store_not_as_a_local_folder(
  bucket, tmp_path, monkeypatch
):
  monkeypatch.chdir(tmp_path)  # where os.makedirs("gs://bucket/run") would make gs:/bucket/run
  config = bf16_sync.get_config("tiny")
  config.teacher.cache_dir = f"{bucket}/cache"
  preflight.check(run_spec(config), f"{bucket}/run", log=lambda *a: None)
  assert list(tmp_path.iterdir()) == []
  for name in ("run", "cache"):
    directory = epath.Path(bucket) / name
    assert directory.is_dir() and list(directory.iterdir()) == []  # the probe is removed
  ObjectStore.store.clear()
  ObjectStore.pseudo_dirs[:] = [""]
  preflight.check_writable(f"{bucket}/deep/er/run", "the workdir")  # parents created
  assert (epath.Path(bucket) / "deep" / "er" / "run").is_dir()


def _warm_start_setup():
  """The tiny config with a 2-step warm start, and its models without a teacher bootstrap."""
  config = bf16_sync.get_config("tiny")
  config.student.warmup_steps = 2
  config.student.warmup_batch_size = 2
  return config, setup_lib.Setup(
    build.build_models(run_spec(config)), setup_lib.task_config(run_spec(config)), {}, None
  )


def _assert_same_params(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # two 2-step warm starts: their compiles take minutes on a busy machine
def test_a_second_warm_start_loads_the_first_and_one_cached_meanwhile_is_kept(bucket, tmp_path):
  config, setup = _warm_start_setup()
  cache = f"{bucket}/cache"
  lines = []
  trained = setup_lib.warm_started_student(run_spec(config), setup, lines.append, cache)
  (entry,) = epath.Path(cache).iterdir()
  assert entry.name.startswith("student-") and pretrain.is_cached(os.fspath(entry))
  loaded = setup_lib.warm_started_student(run_spec(config), setup, lines.append, cache)
  assert lines[0] == "warm-starting the student (2 supervised steps)"
  assert lines[-1] == f"warm-started student loaded from cache {entry}"
  _assert_same_params(trained, loaded)

  # Another run saves the same warm start (local cache) while this one trains: its entry is
  # kept, not an error. It holds the untrained params here (a real one holds the trained
  # params) so that keeping it rather than overwriting it is visible.
  config, setup = _warm_start_setup()  # fresh models: training consumed the first ones
  untrained = jax.device_get(build.materialize(setup.models, "student"))
  other = tmp_path / "cache" / entry.name

  def log(line):
    if line.startswith("  sft step 2/2"):
      pretrain.save_cached(other, setup.models.student_cfg, untrained)

  again = setup_lib.warm_started_student(run_spec(config), setup, log, str(tmp_path / "cache"))
  _assert_same_params(trained, again)
  assert [p.name for p in (tmp_path / "cache").iterdir()] == [entry.name]  # no .tmp left
  _assert_same_params(untrained, pretrain.load_cached(other, jax.numpy.float32, None))


def test_an_export_to_a_bucket_lands_in_the_bucket(bucket, tmp_path, monkeypatch):
  """A gs:// export is uploaded whole, not written to a local folder named "gs:"; a second
  export removes the first one's weight and tokenizer objects that it does not write."""
  monkeypatch.chdir(tmp_path)
  cfg = tiny_model_cfg(vocab_size=tokenizer_lib.CharTokenizer().vocab_size)
  params = model.init_params(jax.random.key(0), cfg)
  out = f"{bucket}/run/export"
  (epath.Path(out) / "vocab.json").parent.mkdir(parents=True, exist_ok=True)
  (epath.Path(out) / "vocab.json").write_text("{}")  # an earlier tokenizer's file
  (epath.Path(out) / "README.md").write_text("kept")
  names = hf_export.export_student(out, cfg, params, tokenizer_lib.CharTokenizer())
  local = hf_export.export_student(tmp_path / "local", cfg, params, tokenizer_lib.CharTokenizer())
  assert names == sorted([*local, "README.md"]) and not (tmp_path / "gs:").exists()
  for name in local:
    assert (epath.Path(out) / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
