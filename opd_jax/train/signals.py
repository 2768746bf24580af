"""Stopping cleanly on SIGTERM or SIGINT, at any point of a run.

A preempted job (SLURM's SIGTERM before the kill, a TPU maintenance event, Ctrl-C) should leave a
run that the same command resumes. `StopOnSignal` turns the signal into a flag; the code checks
the flag where stopping is safe:

* the OPD loop, at every step boundary (`trainer._train`): it saves a checkpoint and returns;
  a signal during an evaluation or a checkpoint is seen at the next boundary;
* setup (`trainer.run`): at each phase boundary and inside the long supervised loops of the
  teacher bootstrap and the student warm start (`check`, called by `pretrain.supervised_train`
  every step), where it raises `Interrupted`. `trainer.run` catches it and returns; what was
  finished before (a cached teacher, a cached warm start) is kept, and an unfinished bootstrap
  or warm start is started again by the rerun.

`check` is a no-op when no `StopOnSignal` is active (library calls, tests), so the supervised
loops do not depend on being inside a run.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

_ACTIVE: list = []  # the StopOnSignal contexts entered, innermost last


class Interrupted(Exception):
  """A signal stopped the run in `phase`, before the OPD loop."""

  def __init__(self, signal_name: str, process: int, phase: str):
    super().__init__(f"{signal_name} received during {phase}")
    self.signal_name, self.process, self.phase = signal_name, process, phase


def check(phase: str) -> None:
  """Raises `Interrupted` when the active `StopOnSignal` was signalled (on any process: a
  collective then, so every process must call it at the same point)."""
  if _ACTIVE:
    agreed = _ACTIVE[-1].agreed()
    if agreed is not None:
      raise Interrupted(*agreed, phase)


class StopOnSignal(contextlib.AbstractContextManager):
  """Turns SIGTERM and the first SIGINT into a flag the loop checks at step boundaries.

  A second SIGINT raises KeyboardInterrupt as usual. Outside the main thread (where
  Python cannot install handlers) it installs nothing and never fires.

  In a multi-process run the signal may reach one process only (a maintenance event on one
  host, `kill` of one task), so the loop asks `agreed()`, which every process calls at the
  same step boundary: it gathers each process's flag (one int32 per process) and all of them
  stop at that step when any of them was signalled.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: int | None = None
    self._old = {}

  def _handle(self, signum, frame):
    if self.received == signal.SIGINT and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.received = signum

  def agreed(self) -> tuple[str, int] | None:
    """(signal name, index of the first signalled process), the same on every process, or
    None when no process was signalled. A collective when there are several processes: every
    process must call it at the same point of the loop."""
    if jax.process_count() == 1:
      return None if self.received is None else (signal.Signals(self.received).name, 0)
    flags_p = np.asarray(multihost_utils.process_allgather(np.int32(self.received or 0)))
    signalled = np.flatnonzero(flags_p)
    if not signalled.size:
      return None
    first = int(signalled[0])
    return signal.Signals(int(flags_p[first])).name, first

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    _ACTIVE.append(self)
    return self

  def __exit__(self, *exc_info):
    _ACTIVE.remove(self)
    for s, handler in self._old.items():
      signal.signal(s, handler)
