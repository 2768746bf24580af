"""Tests for TensorBoard/JSONL metric writing, reading back, and the progress line."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

from opd_jax.io import metrics_writer as mw
from opd_jax.io import progress as progress_lib


def _accumulator(workdir):
  acc = event_accumulator.EventAccumulator(
    str(workdir / "tb"), size_guidance={event_accumulator.TENSORS: 0}
  )
  acc.Reload()
  return acc


def test_scalars_round_trip_through_tensorboard_and_jsonl(tmp_path):
  with mw.MetricsWriter(tmp_path) as writer:
    writer.write_scalars(0, {"loss/opd": 0.1, "perf/compile_count": 1})
    writer.write_scalars(1, {"loss/opd": np.float32(0.25), "mismatch/kl": jnp.asarray(1e-3)})
    writer.write_scalars(2, {"loss/opd": jnp.asarray([0.0625]), "rollout/ok": np.bool_(True)})

  scalars = mw.read_scalars(tmp_path)
  # TensorBoard stores float32, like tf.summary.scalar.
  assert scalars["loss/opd"] == [(0, float(np.float32(0.1))), (1, 0.25), (2, 0.0625)]
  assert scalars["perf/compile_count"] == [(0, 1.0)]
  assert scalars["mismatch/kl"] == [(1, float(np.float32(1e-3)))]
  assert scalars["rollout/ok"] == [(2, 1.0)]

  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == [
    {"step": 0, "loss/opd": 0.1, "perf/compile_count": 1},
    {"step": 1, "loss/opd": 0.25, "mismatch/kl": float(jnp.asarray(1e-3))},
    {"step": 2, "loss/opd": 0.0625, "rollout/ok": 1},
  ]


def test_scalars_are_simple_values_for_event_accumulator_scalars(tmp_path):
  """Scripts read scalars with `EventAccumulator(...).Scalars(tag)`, no plugin needed."""
  with mw.MetricsWriter(tmp_path) as writer:
    writer.write_scalars(1, {"loss/opd": 0.5, "perf/compile_count": 3})
    writer.write_scalars(2, {"loss/opd": 0.25, "teacher/kl": math.inf})
    writer.write_histogram(2, "rollout/staleness", [0, 1, 1])
    writer.write_text(2, "rollout/samples", "1+2=3")
  acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))  # default size guidance
  acc.Reload()
  tags = acc.Tags()
  assert set(tags["scalars"]) == {"loss/opd", "perf/compile_count", "teacher/kl"}
  assert [(e.step, e.value) for e in acc.Scalars("loss/opd")] == [(1, 0.5), (2, 0.25)]
  assert [(e.step, e.value) for e in acc.Scalars("perf/compile_count")] == [(1, 3.0)]
  assert [(e.step, e.value) for e in acc.Scalars("teacher/kl")] == [(2, math.inf)]
  # Histograms and text stay v2 tensor summaries with their plugins.
  assert set(tags["tensors"]) == {"rollout/staleness", "rollout/samples"}
  assert acc.SummaryMetadata("rollout/samples").plugin_data.plugin_name == "text"


def test_read_scalars_reads_older_tensor_scalars_then_new_ones(tmp_path):
  """A run resumed in a workdir whose event files hold v2 tensor scalars (the encoding this
  writer used before) reads back as one series."""
  from tensorboard.compat.proto import event_pb2
  from tensorboard.plugins.scalar import summary_v2 as scalar_summary
  from tensorboard.summary.writer.event_file_writer import EventFileWriter

  (tmp_path / "tb").mkdir()
  old = EventFileWriter(str(tmp_path / "tb"))
  for step, value in ((1, 2.0), (2, 1.5)):
    summary = scalar_summary.scalar_pb("loss/opd", value)
    old.add_event(event_pb2.Event(wall_time=100.0 + step, step=step, summary=summary))
  old.close()
  with mw.MetricsWriter(tmp_path) as writer:
    writer.write_scalars(3, {"loss/opd": 1.0})
  assert mw.read_scalars(tmp_path) == {"loss/opd": [(1, 2.0), (2, 1.5), (3, 1.0)]}


def test_nonfinite_values_and_merging_by_step(tmp_path):
  with mw.MetricsWriter(tmp_path) as writer:
    writer.write_scalars(5, {"loss/opd": float("nan"), "teacher/kl": math.inf})
    writer.write_scalars(5, {"teacher/logp": -math.inf, "quality/acc": 0.5})
  first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert first == {"step": 5, "loss/opd": "nan", "teacher/kl": "inf"}

  merged = mw.read_jsonl(tmp_path)
  assert list(merged) == [5]
  assert math.isnan(merged[5]["loss/opd"])
  assert merged[5]["teacher/kl"] == math.inf and merged[5]["teacher/logp"] == -math.inf
  assert merged[5]["quality/acc"] == 0.5
  scalars = mw.read_scalars(tmp_path)
  assert math.isnan(scalars["loss/opd"][0][1]) and scalars["teacher/kl"] == [(5, math.inf)]


def test_histogram_and_text(tmp_path):
  values = np.array([0, 0, 1, 1, 1, 2, np.nan], np.float32)
  with mw.MetricsWriter(tmp_path) as writer:
    writer.write_histogram(3, "rollout/staleness", values, buckets=2)
    writer.write_text(3, "rollout/samples", "**prompt** 1+2= → 1+2=3>3")

  acc = _accumulator(tmp_path)
  assert set(acc.Tags()["tensors"]) == {"rollout/staleness", "rollout/samples"}
  assert acc.SummaryMetadata("rollout/staleness").plugin_data.plugin_name == "histograms"
  (event,) = acc.Tensors("rollout/staleness")
  # Rows are [left edge, right edge, count]; the NaN is dropped, range [0, 2] in 2 buckets.
  buckets = tensor_util.make_ndarray(event.tensor_proto)
  np.testing.assert_array_equal(buckets, [[0.0, 1.0, 2.0], [1.0, 2.0, 4.0]])
  (text_event,) = acc.Tensors("rollout/samples")
  assert text_event.step == 3
  assert tensor_util.make_ndarray(text_event.tensor_proto).item().decode() == (
    "**prompt** 1+2= → 1+2=3>3"
  )
  assert mw.read_scalars(tmp_path) == {}  # histograms and text are not scalars


def test_reopening_appends_to_both_logs(tmp_path):
  with mw.MetricsWriter(tmp_path) as writer:
    writer.write_scalars(1, {"loss/opd": 2.0})
  with mw.MetricsWriter(tmp_path) as writer:
    writer.write_scalars(2, {"loss/opd": 1.0})
  assert mw.read_scalars(tmp_path) == {"loss/opd": [(1, 2.0), (2, 1.0)]}
  assert mw.read_jsonl(tmp_path) == {1: {"loss/opd": 2.0}, 2: {"loss/opd": 1.0}}


def test_disabled_writer_creates_nothing(tmp_path):
  workdir = tmp_path / "run"
  with mw.MetricsWriter(workdir, enabled=False) as writer:
    writer.write_scalars(0, {"loss/opd": 1.0})
    writer.write_histogram(0, "rollout/staleness", [1, 2])
    writer.write_text(0, "rollout/samples", "x")
    writer.flush()
  assert not workdir.exists()


def test_bad_metrics_raise(tmp_path):
  with mw.MetricsWriter(tmp_path) as writer:
    with pytest.raises(
      ValueError, match=r"'loss/opd' must be a scalar, got an array of shape \(2,\)"
    ):
      writer.write_scalars(0, {"loss/opd": np.zeros(2)})
    with pytest.raises(ValueError, match="reserved"):
      writer.write_scalars(0, {"step": 1.0})
    with pytest.raises(ValueError, match="non-negative integer"):
      writer.write_scalars(-1, {"loss/opd": 1.0})
    with pytest.raises(ValueError, match="must be a str"):
      writer.write_text(0, "rollout/samples", 3)
  assert (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.parametrize(
  "seconds, expected",
  [
    (0, "0s"),
    (59.4, "59s"),
    (59.6, "1m00s"),
    (118, "1m58s"),
    (3600, "1h00m"),
    (7380, "2h03m"),
    (90000, "1d01h"),
    (math.nan, "--"),
    (math.inf, "--"),
  ],
)
def test_format_duration(seconds, expected):
  assert progress_lib.format_duration(seconds) == expected


def _wandb_history(run_file) -> list[dict[str, float]]:
  """The `history` records (one per `run.log`) of an offline W&B run file `run-<id>.wandb`.

  The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks
  of chunks, each a 7-byte header (CRC32, length, kind: 1 full, 2 first, 3 middle, 4 last)
  and its bytes; a block's last < 7 bytes are padding. A full record is a `Record` protobuf.
  """
  import struct

  from wandb.proto import wandb_internal_pb2

  data, block, position, pending, rows = run_file.read_bytes(), 32768, 7, b"", []
  assert data[:4] == b":W&B"
  while position + 7 <= len(data):
    left = block - position % block
    if left < 7:
      position += left
      continue
    _, length, kind = struct.unpack("<IHB", data[position : position + 7])
    if length == 0 and kind == 0:  # zero padding to the end of the block
      position += left
      continue
    pending += data[position + 7 : position + 7 + length]
    position += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      pending = b""
      if record.WhichOneof("record_type") == "history":
        items = record.history.item  # "loss/opd" is stored as the nested key ("loss", "opd")
        rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
  return rows


def test_wandb_offline_run_holds_the_scalars(tmp_path, monkeypatch):
  """With `wandb_project` set, the scalars also go to a W&B run; offline, nothing leaves the
  machine and the run's file under WANDB_DIR holds them, while TensorBoard and JSONL are
  written as without W&B."""
  pytest.importorskip("wandb", reason="W&B is the optional extra: pip install -e '.[wandb]'")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  (tmp_path / "wandb_dir").mkdir()
  workdir = tmp_path / "run"
  with mw.MetricsWriter(workdir, wandb_project="opd-test", wandb_config={"seed": "0"}) as w:
    w.write_scalars(1, {"loss/opd": 0.5, "perf/compile_count": np.int32(2)})
    w.write_scalars(2, {"loss/opd": jnp.asarray(0.25)})

  (run_file,) = (tmp_path / "wandb_dir").glob("wandb/offline-run-*/run-*.wandb")
  history = _wandb_history(run_file)
  logged = [{k: v for k, v in row.items() if not k.startswith("_")} for row in history]
  assert logged == [{"loss/opd": 0.5, "perf/compile_count": 2}, {"loss/opd": 0.25}]
  assert [row["_step"] for row in history] == [1, 2]
  assert mw.read_jsonl(workdir) == {
    1: {"loss/opd": 0.5, "perf/compile_count": 2},
    2: {"loss/opd": 0.25},
  }
  assert mw.read_scalars(workdir)["loss/opd"] == [(1, 0.5), (2, 0.25)]


class _Clock:
  """Returns the given times in order, one per call."""

  def __init__(self, times):
    self._times = iter(times)

  def __call__(self):
    return next(self._times)


def test_progress_line_rate_and_eta():
  progress = progress_lib.Progress(500, window=20, clock=_Clock([100.0, 110.0, 120.0]))
  assert progress.line(0) == "step 0/500 | -- steps/s | ETA --"
  assert progress.line(32) == "step 32/500 | 3.2 steps/s | ETA 2m26s"  # 468 / 3.2 = 146.25 s
  # Over the window (0 → 64 in 20 s): 3.2 steps/s, (500 − 64) / 3.2 = 136.25 s.
  line = progress.line(64, {"loss/opd": 0.41234, "perf/compile_count": 1})
  assert line == "step 64/500 | 3.2 steps/s | ETA 2m16s | loss/opd=0.4123 perf/compile_count=1"


def test_progress_moving_window_slow_rate_and_restart():
  progress = progress_lib.Progress(100, window=2, clock=_Clock([0.0, 10.0, 12.0, 40.0, 50.0]))
  progress.line(0)
  progress.line(10)
  # The window holds only (10, 10 s) and (20, 12 s): 5 steps/s, ETA 80 / 5 = 16 s.
  assert progress.line(20) == "step 20/100 | 5.0 steps/s | ETA 16s"
  # A lower step (a restart from a checkpoint) clears the window.
  assert progress.line(5) == "step 5/100 | -- steps/s | ETA --"
  # 1 step in 10 s: printed as seconds per step; ETA 94 steps × 10 s.
  assert progress.line(6) == "step 6/100 | 10.0 s/step | ETA 15m40s"


@pytest.mark.parametrize("enabled", [True, False])
def test_write_after_close_raises_on_every_process(tmp_path, enabled):
  writer = mw.MetricsWriter(tmp_path, enabled=enabled)
  writer.close()
  writer.close()  # closing twice is fine
  with pytest.raises(ValueError, match="closed MetricsWriter"):
    writer.write_scalars(0, {"loss/opd": 1.0})
