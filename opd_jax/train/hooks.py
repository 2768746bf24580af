"""What the training loop can be handed, instead of importing it: a step hook.

The loop (`trainer.run`) knows nothing of budgets or guards. A caller that wants to watch or
steer a run passes a `HookFactory`; the loop calls it once, after the state is restored and
before the first rollout source is built, and then drives the hook it returned:

    hook = factory(config, setup, params, resumed, make_source, prompt_iter, writer, log)
    source = make_source(hook.spec, state, next_batch)
    source = hook.begin(step, state, source)                  # before the first step
    ... every step: source = hook.after_step(step, state, scalars, source)
    ... every checkpoint: extra[hook.EXTRA_KEY] = hook.checkpoint_extra()
    hook.close()

`after_step` may add scalars (they are logged with the step's) and may return another rollout
source (the loop closes nothing it did not build: the hook closes what it built). The live
budget guard (`mismatch.live_guard.LiveGuard.create`) is the one factory the project ships.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from opd_jax.config.spec import RunSpec


class StepHook(Protocol):
  """A hook the loop drives (module docstring for the call order)."""

  EXTRA_KEY: str  # its entry in each checkpoint's extra data (what a resumed run gets back)
  spec: RunSpec  # the run spec the first rollout source is built from

  def begin(self, step: int, state: Any, source: Any) -> Any: ...

  def after_step(self, step: int, state: Any, scalars: dict, source: Any) -> Any: ...

  def checkpoint_extra(self) -> dict: ...

  def close(self) -> None: ...


# (the run's ConfigDict, setup, student params, the restored checkpoint's extra ({} when fresh),
#  make_source(spec, state, next_batch), the prompt iterator, the metrics writer, log)
#  -> a hook, or None when the config asks for none.
HookFactory = Callable[..., StepHook | None]
