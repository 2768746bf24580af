"""Orbax checkpoints of the trainer: what is saved, and when it is safe to save.

A checkpoint at step N holds two items:

* `state`: the `TrainState` pytree (student params, optimizer state, step, RNG),
  saved with its shardings and restored into the shardings of an abstract target;
* `extra`: JSON with everything else the loop needs to continue exactly: the data
  iterator's state, the weight version, and the run's config fingerprint.

The frozen teacher is never checkpointed: it is rebuilt from its own cache or
checkpoint. A state with a non-finite value is refused, so the last good
checkpoint always survives a diverged step.

The directory is any `etils.epath` path: a local directory or an object store
(`gs://bucket/run/checkpoints`, written by orbax's own tensorstore drivers). Orbax
writes step N into a temporary directory and only then commits it (a rename on a
local disk, a commit marker on an object store), so a process killed mid-write leaves
an uncommitted temporary directory that `latest_step` never returns; the next
writing `Checkpointer` on that directory deletes it (`cleanup_tmp_directories`: in the
background; its first save, and its `close`, wait for the deletion, so two writers opened
one after the other never delete the same directory at once).

A reader (`read_only=True`: the admission check, the sensitivity scan, anything that
restores another run's checkpoints) deletes nothing and creates nothing: the temporary
directory it would see may be a live run's step being written. Orbax announces every read-only
manager with a warning ("Given directory is read only"); a reader is the expected case here,
so that one line is filtered out (`_ReadOnlyNotice`), and every other orbax message still shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath


def absolute(path: str | os.PathLike) -> str:
  """`path` as an absolute local path, or unchanged when it is a URI (`gs://...`)."""
  path = os.fspath(path)
  return path if "://" in path else os.path.abspath(path)


@jax.jit
def _leaves_finite(leaves) -> jax.Array:
  """∧_leaf ∧_i isfinite(leaf_i): one program for the whole state, not two dispatches and a
  host round trip per leaf."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree) -> bool:
  """True when every floating leaf of `tree` is finite."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
  return bool(_leaves_finite(leaves)) if leaves else True


class _ReadOnlyNotice(logging.Filter):
  """Drops orbax's "Given directory is read only" warning, and nothing else."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Given directory is read only")


@contextlib.contextmanager
def _without_read_only_notice():
  absl_logger = logging.getLogger("absl")  # where absl.logging (orbax's logger) writes
  notice = _ReadOnlyNotice()
  absl_logger.addFilter(notice)
  try:
    yield
  finally:
    absl_logger.removeFilter(notice)


class Checkpointer:
  """Saves and restores (state, extra) under `directory` with orbax; `read_only` restores only."""

  def __init__(self, directory: str | os.PathLike, max_to_keep: int = 2, *, read_only=False):
    self.directory = absolute(directory)
    self.read_only = read_only
    self._kind: str | None = None  # "state" or "params" once used (`_bind`)
    if read_only:
      options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, max_to_keep=None, save_interval_steps=0
      )
    else:
      options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True
      )
    with _without_read_only_notice() if read_only else contextlib.nullcontext():
      self._manager = ocp.CheckpointManager(epath.Path(self.directory), options=options)

  def _bind(self, kind: str) -> None:
    """Whole states ("state") or params alone ("params"): one kind per Checkpointer."""
    if self._kind not in (None, kind):
      raise ValueError(
        f"this Checkpointer of {self.directory} has handled whole states; restore the params "
        "alone with another Checkpointer on the directory"
        if kind == "params"
        else f"this Checkpointer of {self.directory} has restored params alone; save or restore "
        "whole states with another Checkpointer on the directory"
      )
    self._kind = kind

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, extra: dict[str, Any]) -> None:
    """Writes step `step`; raises ValueError (saving nothing) if `state` is not finite.

    A step at or below the latest saved one is skipped without a word (orbax's `should_save`):
    the trainer's steps only grow from the restored one, so it never asks for that.
    """
    if self.read_only:
      raise ValueError(f"refusing to save step {step}: {self.directory} was opened read-only")
    if not all_finite(state):
      raise ValueError(
        f"refusing to checkpoint step {step}: the state has non-finite values; "
        f"the last good checkpoint ({self.latest_step()}) is kept"
      )
    self._bind("state")
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra))
    self._manager.save(step, args=args)
    self._manager.wait_until_finished()

  def restore(self, step: int, abstract_state) -> tuple[Any, dict[str, Any]]:
    """Restores step `step` into the shapes/shardings of `abstract_state`."""
    self._bind("state")
    args = ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()
    )
    restored = self._manager.restore(step, args=args)
    return restored["state"], restored["extra"]

  def restore_params(self, step: int, abstract_params) -> tuple[Any, dict[str, Any]]:
    """Restores only the student params of step `step`, into the shapes and shardings of
    `abstract_params`, and the extra: a reader that needs the student alone (the admission
    check, an export) skips the optimizer state, two thirds of the state's arrays, and needs
    no optimizer to describe it.

    Raises:
      ValueError: this Checkpointer has saved or restored a whole state (orbax binds an item
        to the handler it first used; open another Checkpointer on the directory).
    """
    self._bind("params")
    target = {"params": abstract_params}  # the `TrainState.params` subtree of `state`
    state = ocp.args.PyTreeRestore(
      item=target,
      restore_args=ocp.checkpoint_utils.construct_restore_args(target),
      partial_restore=True,
    )
    restored = self._manager.restore(
      step, args=ocp.args.Composite(state=state, extra=ocp.args.JsonRestore())
    )
    return restored["state"]["params"], restored["extra"]

  def close(self) -> None:
    """Waits for outstanding writes and closes the manager; skipped in a multi-process run that
    is failing (called while an exception propagates), where closing would wait at a barrier
    for a peer that may be dead. `save` has already waited for its write to commit."""
    if jax.process_count() > 1 and sys.exc_info()[1] is not None:
      return
    self._manager.close()
    # `CheckpointManager.close` does not wait for the deletion of stale temporary directories
    # that its constructor started; a writer closed before its first save would leave it
    # running into the next writer's own deletion of the same directories.
    await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()
