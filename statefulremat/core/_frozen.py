"""An immutable mapping for default arguments that reads as the dict users would write.

A mapping default must not be a ``dict`` (one object shared by every call, which a call
could change for the next). ``types.MappingProxyType`` is read-only but shows as
``mappingproxy({True: 0})`` in ``help()``, IPython's ``?`` and ``inspect.signature``;
``FrozenMapping`` shows as the literal it equals, ``{True: 0}``, and is hashable and
picklable as well.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FrozenMapping(Mapping[K, V], Generic[K, V]):
  """A read-only mapping whose ``repr`` is its dict literal.

  It equals the ``dict`` with the same items, cannot be changed, and hashes by its items,
  so a default argument holding it is the same for every call and shows in a signature as
  users write it.

  Args:
    items: the mapping's items, as ``dict(items)`` takes them.

  >>> from statefulremat.core._frozen import FrozenMapping
  >>> axes = FrozenMapping({True: 0})
  >>> axes, axes == {True: 0}, axes[True], hash(axes) == hash(FrozenMapping({True: 0}))
  ({True: 0}, True, 0, True)
  >>> axes[False] = 1
  Traceback (most recent call last):
  TypeError: 'FrozenMapping' object does not support item assignment
  """

  __slots__ = ("_items",)
  _items: dict[K, V]

  def __init__(self, items: Mapping[K, V] | Any = (), /):
    object.__setattr__(self, "_items", dict(items))

  def __getitem__(self, key: K) -> V:
    return self._items[key]

  def __iter__(self) -> Iterator[K]:
    return iter(self._items)

  def __len__(self) -> int:
    return len(self._items)

  def __repr__(self) -> str:
    return repr(self._items)

  def __hash__(self) -> int:
    return hash(frozenset(self._items.items()))

  def __eq__(self, other: object) -> bool:
    if isinstance(other, Mapping):
      return self._items == dict(other.items())
    return NotImplemented

  def __setattr__(self, name: str, value: Any):
    raise AttributeError(f"a FrozenMapping cannot be changed; make a new one ({name!r}).")

  def __reduce__(self):
    return (type(self), (self._items,))


# The defaults the package's signatures share: one object each, so a transform can tell
# its default (``variable_axes is ALL_STACKED``) from the same rules given by a user.
EMPTY: Mapping[Any, Any] = FrozenMapping()
ALL_STACKED: Mapping[Any, Any] = FrozenMapping({True: 0})
ALL_SPLIT: Mapping[Any, Any] = FrozenMapping({True: True})
