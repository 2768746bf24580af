"""Training monitoring: TensorBoard event files, a JSONL log and optional Weights & Biases (the
progress line is `io.progress`; docs/design.md, "Layers"; names: docs/reference/metrics.md).

`MetricsWriter` checks each step's scalars once and hands them to its `ScalarWriter`s:
`TensorBoardWriter` (`workdir/tb/`, `simple_value` scalars that `EventAccumulator.Scalars`
reads, histograms and text as v2 tensor summaries; TensorFlow is never imported),
`JsonlWriter` (`workdir/metrics.jsonl`, `{"step": N, ...}` per call at float64, NaN/±inf as
"nan"/"inf"/"-inf") and, with `log.wandb_project` set, `WandbWriter`. `read_scalars` and
`read_jsonl` read a run back.

Only process 0 writes (`enabled=jax.process_index() == 0`); a disabled writer creates nothing.
An object-store workdir (`gs://...`) is staged locally and uploaded every `sync_secs`, on
`flush()` and on `close()`. A line cut short by a kill is dropped when the log is reopened.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from absl import logging
from etils import epath
from tensorboard.compat.proto import event_pb2, summary_pb2

# TensorBoard's writer, summary helpers and event reader are imported where they are used:
# together they take ~0.2 s to import (their TensorFlow stub), which a process that only reads
# `metrics.jsonl` (the admission check) need not pay.
if TYPE_CHECKING:
  from tensorboard.backend.event_processing import event_accumulator

TB_SUBDIR = "tb"
JSONL_NAME = "metrics.jsonl"


def is_remote(path: str | os.PathLike) -> bool:
  """True for a URI such as gs://bucket/run (an object store), False for a local path."""
  return "://" in os.fspath(path)


def drop_partial_line(path: str | os.PathLike) -> int:
  """Truncates a local text log after its last newline; returns the bytes dropped.

  A process killed in the middle of appending a line leaves it without its newline; the next
  line appended would be glued to it and neither would parse.
  """
  with open(path, "rb+") as f:
    size = f.seek(0, os.SEEK_END)
    if size == 0:
      return 0
    f.seek(size - 1)
    if f.read(1) == b"\n":
      return 0
    keep = 0
    position = size
    while position > 0:  # scan back in blocks for the last newline
      start = max(0, position - 65536)
      f.seek(start)
      block = f.read(position - start)
      newline = block.rfind(b"\n")
      if newline >= 0:
        keep = start + newline + 1
        break
      position = start
    f.truncate(keep)
    return size - keep


def _scalar_value(name: str, value: Any) -> int | float:
  """Converts a Python/NumPy/JAX scalar to a Python int or float.

  Booleans and integer dtypes become `int`, everything else `float`. Arrays with more than one
  element raise `ValueError` naming the metric.
  """
  if isinstance(value, bool | int | float):
    return int(value) if isinstance(value, bool | int) else float(value)
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"metric {name!r} must be a scalar, got an array of shape {arr.shape}")
  if arr.dtype.kind in "biu":
    return int(arr.reshape(()))
  if arr.dtype.kind not in "fV":  # "V": ml_dtypes' bfloat16 / float8
    raise ValueError(f"metric {name!r} must be numeric, got dtype {arr.dtype}")
  return float(arr.reshape(()).astype(np.float64))


def _json_value(value: int | float) -> int | float | str:
  """Maps NaN/±inf to the strings "nan"/"inf"/"-inf"; finite values pass through."""
  if isinstance(value, float) and not math.isfinite(value):
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
  return value


def _check_step(step: Any) -> int:
  step_int = int(step)
  if step_int != step or step_int < 0:
    raise ValueError(f"step must be a non-negative integer, got {step!r}")
  return step_int


def _check_name(name: Any) -> str:
  if not isinstance(name, str) or not name:
    raise ValueError(f"metric name must be a non-empty string, got {name!r}")
  if name == "step":
    raise ValueError('"step" is reserved for the step number and cannot be a metric name')
  return name


class ScalarWriter(Protocol):
  """One destination of a run's scalars. `MetricsWriter` checks the names and converts the
  values once (`_scalar_value`), then hands every destination the same `{name: int | float}`."""

  def write_scalars(self, step: int, values: Mapping[str, int | float]) -> None: ...

  def flush(self) -> None: ...

  def close(self) -> None: ...


class JsonlWriter:
  """Appends one `{"step": N, ...}` line per call to a local `metrics.jsonl`, opened and closed
  per line so that a crash loses no logged line. A partial last line (a kill mid-write) is
  dropped when the writer opens the log."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "a", encoding="utf-8"):
      pass  # the log exists from the start, even before the first scalar
    dropped = drop_partial_line(path)
    if dropped:
      logging.warning("%s: dropped an incomplete last line (%d bytes)", JSONL_NAME, dropped)

  def write_scalars(self, step: int, values: Mapping[str, int | float]) -> None:
    record = {"step": step, **{name: _json_value(v) for name, v in values.items()}}
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record, allow_nan=False) + "\n")

  def flush(self) -> None:
    pass  # every line is written and closed at once

  def close(self) -> None:
    pass


class TensorBoardWriter:
  """Writes TensorBoard event files to a local directory: scalars as `simple_value` summaries,
  histograms and text as v2 tensor summaries (module docstring). Flushed every `flush_secs`."""

  def __init__(self, tb_dir: str, flush_secs: float = 30.0):
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    os.makedirs(tb_dir, exist_ok=True)
    self._events = EventFileWriter(tb_dir, flush_secs=flush_secs)

  def add_summary(self, step: int, summary: summary_pb2.Summary) -> None:
    event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary)
    self._events.add_event(event)

  def write_scalars(self, step: int, values: Mapping[str, int | float]) -> None:
    summary = summary_pb2.Summary(
      value=[summary_pb2.Summary.Value(tag=name, simple_value=v) for name, v in values.items()]
    )
    self.add_summary(step, summary)

  def flush(self) -> None:
    self._events.flush()

  def close(self) -> None:
    self._events.close()


class WandbWriter:
  """Logs scalars to a Weights & Biases run: `wandb.init(project, dir, name, config)` once,
  `run.log(values, step=step)` per call, `run.finish()` on close. Needs the optional extra
  (`pip install -e ".[wandb]"`); where the run goes (online, `WANDB_MODE=offline`, entity) is
  W&B's own environment. W&B keeps a run's steps increasing: a resumed run starts a new W&B
  run (its steps continue from the checkpoint)."""

  def __init__(
    self,
    project: str,
    directory: str | None,
    name: str,
    run_config: Mapping[str, Any] | None = None,
  ):
    try:
      import wandb
    except ImportError as e:
      raise ImportError(
        f"log.wandb_project={project!r} needs Weights & Biases: pip install -e '.[wandb]' "
        '(or set log.wandb_project to "" to log to TensorBoard and metrics.jsonl only)'
      ) from e
    self._run = wandb.init(project=project, dir=directory, name=name, config=dict(run_config or {}))

  def write_scalars(self, step: int, values: Mapping[str, int | float]) -> None:
    self._run.log(dict(values), step=step)

  def flush(self) -> None:
    pass  # W&B's service process writes in the background; `close` waits for it

  def close(self) -> None:
    import wandb

    self._run.finish()
    # `finish` can return before W&B's service has written the run's last records to its file
    # (seen offline); `teardown` waits for the service, so the files are complete on return.
    wandb.teardown()


class MetricsWriter:
  """Writes scalars, histograms and text to TensorBoard, and scalars to `metrics.jsonl` (and to
  Weights & Biases when `wandb_project` is set).

  Usage:

      with MetricsWriter(workdir, enabled=jax.process_index() == 0) as writer:
        writer.write_scalars(step, {"loss/opd": 0.41, "perf/step_time_s": 0.12})

  Args:
    workdir: run directory; event files go to `workdir/tb/`, the log to `workdir/metrics.jsonl`.
    enabled: write anything at all. Pass `jax.process_index() == 0`.
    flush_secs: how often the event-file writer flushes in the background.
    wandb_project: a W&B project to log the scalars to as well; "" = none (`WandbWriter`).
    wandb_config: the run's config, recorded with the W&B run.

  Files are created in the constructor (when enabled). Each JSONL line is appended and closed
  at once, so a resumed run continues the same log and a crash loses no logged line; the event
  files are flushed every `flush_secs` and on `flush()`/`close()`. A new event file is started
  per writer; TensorBoard and `read_scalars` read them all. An object-store workdir is staged
  locally and uploaded every `sync_secs` (module docstring).
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    enabled: bool = True,
    flush_secs: float = 30.0,
    sync_secs: float = 60.0,
    wandb_project: str = "",
    wandb_config: Mapping[str, Any] | None = None,
  ):
    self.enabled = enabled
    self.workdir = os.fspath(workdir)
    self._remote = is_remote(self.workdir)
    self._sync_secs = sync_secs
    self._last_sync = time.monotonic()
    self._staging = None  # the local directory written when the workdir is remote
    self._tb: TensorBoardWriter | None = None
    self._writers: list[ScalarWriter] = []
    self._closed = False
    local = self.workdir
    if enabled and self._remote:
      self._staging = local = tempfile.mkdtemp(prefix="opd_metrics_")
      remote_log = epath.Path(self.workdir) / JSONL_NAME
      if remote_log.exists():
        with open(os.path.join(local, JSONL_NAME), "wb") as f:
          f.write(remote_log.read_bytes())
    self._jsonl_path = os.path.join(local, JSONL_NAME)
    if not enabled:
      return
    self._tb = TensorBoardWriter(os.path.join(local, TB_SUBDIR), flush_secs)
    self._writers = [self._tb, JsonlWriter(self._jsonl_path)]
    if wandb_project:
      # W&B's files go to WANDB_DIR when it is set, else into a local workdir (a remote one:
      # W&B's default, the current directory).
      directory = None if self._remote or "WANDB_DIR" in os.environ else self.workdir
      name = os.path.basename(self.workdir.rstrip("/")) or self.workdir
      self._writers.append(WandbWriter(wandb_project, directory, name, wandb_config))
    self._sync(force=True)

  def _sync(self, force: bool = False) -> None:
    """Uploads the staged log and event files to a remote workdir (every `sync_secs`)."""
    if self._staging is None or not (
      force or time.monotonic() - self._last_sync >= self._sync_secs
    ):
      return
    if self._tb is not None:
      self._tb.flush()
    root = epath.Path(self.workdir)
    (root / TB_SUBDIR).mkdir(parents=True, exist_ok=True)
    with open(self._jsonl_path, "rb") as f:
      (root / JSONL_NAME).write_bytes(f.read())
    tb_dir = os.path.join(self._staging, TB_SUBDIR)
    for name in sorted(os.listdir(tb_dir)):
      with open(os.path.join(tb_dir, name), "rb") as f:
        (root / TB_SUBDIR / name).write_bytes(f.read())
    self._last_sync = time.monotonic()

  def _active(self) -> bool:
    """False when disabled; raises after `close()` so late writes are not silently lost."""
    if self._closed:
      raise ValueError(f"write to a closed MetricsWriter({self.workdir!r})")
    return self.enabled

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Logs scalar metrics for one step: one TensorBoard event and one JSONL line (and one W&B
    `log` call).

    Args:
      step: the training step (a non-negative integer).
      scalars: name -> scalar (Python number, NumPy scalar, or a one-element NumPy/JAX array).
        NaN and ±inf are written as such to TensorBoard and as "nan"/"inf"/"-inf" to JSONL.
    """
    if not self._active():
      return
    step = _check_step(step)
    values = {_check_name(name): _scalar_value(name, v) for name, v in scalars.items()}
    if not values:
      return
    for writer in self._writers:
      writer.write_scalars(step, values)
    self._sync()

  def write_histogram(self, step: int, name: str, values: Any, buckets: int = 30) -> None:
    """Logs a histogram of `values` (any shape; flattened) to TensorBoard.

    Non-finite values are dropped: TensorBoard's bucketing needs a finite range.

    Args:
      step: the training step.
      name: tag, e.g. "rollout/staleness".
      values: array-like of numbers, any shape.
      buckets: number of equal-width buckets between min and max.
    """
    from tensorboard.plugins.histogram import summary_v2 as histogram_summary

    if not self._active():
      return
    step, name = _check_step(step), _check_name(name)
    values_n = np.asarray(values, dtype=np.float64).ravel()
    values_n = values_n[np.isfinite(values_n)]
    self._tb.add_summary(step, histogram_summary.histogram_pb(name, values_n, buckets=buckets))

  def write_text(self, step: int, name: str, text: str) -> None:
    """Logs a text summary (rendered as Markdown by TensorBoard), e.g. rollout samples.

    Args:
      step: the training step.
      name: tag, e.g. "rollout/samples".
      text: the text.
    """
    from tensorboard.plugins.text import summary_v2 as text_summary

    if not self._active():
      return
    step, name = _check_step(step), _check_name(name)
    if not isinstance(text, str):
      raise ValueError(f"text for {name!r} must be a str, got {type(text).__name__}")
    self._tb.add_summary(step, text_summary.text_pb(name, text))

  def flush(self) -> None:
    """Writes everything pending to disk."""
    if not self._active():
      return
    for writer in self._writers:
      writer.flush()
    self._sync(force=True)

  def close(self) -> None:
    """Flushes and closes the event file, finishes the W&B run (and uploads everything to a
    remote workdir); later writes raise ValueError. Closing twice is fine."""
    if self._writers:
      writers, self._writers = self._writers, []
      self._tb = None  # closed: the last upload below has nothing left to flush
      for writer in writers:
        writer.close()
      self._sync(force=True)
    if self._staging is not None:
      shutil.rmtree(self._staging, ignore_errors=True)
      self._staging = None
    self._closed = True

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _load_events(workdir: str | os.PathLike) -> event_accumulator.EventAccumulator:
  from tensorboard.backend.event_processing import event_accumulator

  tb_dir = epath.Path(workdir) / TB_SUBDIR
  if not tb_dir.is_dir():
    raise FileNotFoundError(f"no TensorBoard directory at {tb_dir}")
  # 0 keeps every event; the defaults keep a reservoir sample (10 tensor events per tag).
  guidance = {event_accumulator.TENSORS: 0, event_accumulator.SCALARS: 0}
  if not is_remote(workdir):
    acc = event_accumulator.EventAccumulator(os.fspath(tb_dir), size_guidance=guidance)
    acc.Reload()
    return acc
  with tempfile.TemporaryDirectory(prefix="opd_tb_") as local:  # read a local copy
    for path in tb_dir.iterdir():
      with open(os.path.join(local, path.name), "wb") as f:
        f.write(path.read_bytes())
    acc = event_accumulator.EventAccumulator(local, size_guidance=guidance)
    acc.Reload()
  return acc


def read_scalars(workdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
  """Reads every scalar written by `MetricsWriter` under `workdir/tb/`.

  `simple_value` scalars are the accumulator's `Scalars(tag)`. Event files written before
  scalars were stored that way hold v2 tensor summaries whose plugin is "scalars"; those are
  read too, and a tag found in both is merged in write order (wall time). Values come back at
  TensorBoard's float32 precision (`metrics.jsonl` keeps float64).

  Args:
    workdir: the directory given to `MetricsWriter`.

  Returns:
    name -> [(step, value), ...] in the order written.
  """
  from tensorboard.backend.event_processing import event_accumulator
  from tensorboard.plugins.scalar import summary_v2 as scalar_summary
  from tensorboard.util import tensor_util

  acc = _load_events(workdir)
  timed: dict[str, list[tuple[float, int, float]]] = {}
  for tag in acc.Tags()[event_accumulator.SCALARS]:
    timed[tag] = [(e.wall_time, e.step, float(e.value)) for e in acc.Scalars(tag)]
  for tag in acc.Tags()[event_accumulator.TENSORS]:  # older event files
    if acc.SummaryMetadata(tag).plugin_data.plugin_name != scalar_summary.metadata.PLUGIN_NAME:
      continue
    timed.setdefault(tag, []).extend(
      (e.wall_time, e.step, float(tensor_util.make_ndarray(e.tensor_proto).item()))
      for e in acc.Tensors(tag)
    )
  return {
    tag: [(step, value) for _, step, value in sorted(rows, key=lambda r: r[0])]
    for tag, rows in timed.items()
  }


def read_jsonl(workdir: str | os.PathLike) -> dict[int, dict[str, float]]:
  """Reads `workdir/metrics.jsonl`, merging lines of the same step.

  Args:
    workdir: the directory given to `MetricsWriter`.

  Returns:
    step -> {name: value}, steps in first-logged order; "nan"/"inf"/"-inf" become floats. When a
    name is logged twice for one step, the later line wins.
  """
  path = epath.Path(workdir) / JSONL_NAME
  out: dict[int, dict[str, float]] = {}
  with path.open("r", encoding="utf-8") as f:
    for line_no, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {line_no}: {e}") from e
      step = record.pop("step")
      merged = out.setdefault(step, {})
      for name, value in record.items():
        merged[name] = float(value) if isinstance(value, str) else value
  return out
