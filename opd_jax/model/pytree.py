"""Frozen dataclasses that are JAX pytrees: what the trainer's state and batches are made of.

`@pytree.dataclass` makes a frozen dataclass and registers it with
`jax.tree_util.register_dataclass`: every field is a child (a traced, sharded, checkpointed
leaf or subtree) unless it is declared with `pytree.static(...)`, which puts it in the treedef
(part of the jit cache key, compared with ==, never traced). Children are keyed by attribute
name (`GetAttrKey`), so checkpoints name them `params`, `opt_state`, ...

`x.replace(field=value)` is `dataclasses.replace`: a new instance, the old one unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax

T = TypeVar("T")


def static(default: Any = dataclasses.MISSING) -> Any:
  """A field held in the treedef rather than as a leaf (a dtype choice, a block size, a name)."""
  return dataclasses.field(default=default, metadata={"static": True})


def _replace(self: T, **changes: Any) -> T:
  return dataclasses.replace(self, **changes)


def dataclass(cls: type[T]) -> type[T]:
  """`cls` as a frozen dataclass registered as a pytree, with a `replace` method."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  cls.replace = _replace
  return jax.tree_util.register_dataclass(cls)
