"""Filters: which variables a rule applies to.

A filter is any of

* a ``Variable`` subclass — variables of that kind (``sr.Param``);
* a collection name — ``"batch_stats"``;
* ``...`` or ``True`` — everything; ``False`` or ``None`` — nothing;
* a callable ``(path, variable) -> bool``;
* ``PathContains(key)``, ``Not(f)``, ``Any(f, ...)``, ``All(f, ...)``;
* a tuple or list of filters — any of them.

``to_predicate`` turns one into a ``(path, variable) -> bool`` function. Predicates
are hashable and compare equal when built from equal filters, so they can key caches.
"""

from __future__ import annotations

import collections
import difflib
from collections.abc import Callable
from typing import Any as _AnyType
from typing import cast

from ._variables import Variable

Filter = _AnyType
Predicate = Callable[[tuple, Variable], bool]


class _Predicate:
  __slots__ = ()

  def _args(self) -> tuple:
    # What it was built from, as its slots hold it (Any and All: their predicates).
    return tuple(getattr(self, name) for name in self.__slots__)

  def __call__(self, path: tuple, variable: Variable) -> bool:
    raise NotImplementedError

  def __repr__(self):
    return f"{type(self).__name__}({', '.join(map(repr, self._args()))})"

  def __eq__(self, other):
    return type(self) is type(other) and self._args() == other._args()

  def __hash__(self):
    return hash((type(self), self._args()))

  def __reduce__(self):
    # Rebuilt from the filters it was given (sr.Param, "cache"), so that a pickle of
    # sr.Not / sr.Any / sr.All names them and the kinds, never this file's helpers.
    return type(self), tuple(map(_as_filter, self._args()))


class _Plain(_Predicate):
  """The predicate of a plain filter: a Variable kind, a collection name, True or False."""

  __slots__ = ("filter",)

  def __init__(self, filter: Filter):
    self.filter = filter

  def __repr__(self):  # as users write the filter (help() shows `Not(Param)`)
    return self.filter.__name__ if isinstance(self.filter, type) else repr(self.filter)

  def __call__(self, path, variable):
    if isinstance(self.filter, type):
      return isinstance(variable, self.filter)
    if isinstance(self.filter, str):
      return variable.collection == self.filter
    return self.filter


class PathContains(_Predicate):
  """Matches variables whose path contains ``key`` (an attribute name or index).

  Args:
    key: one entry of a path: an attribute name (``"norm"``) or a list index (``0``),
      anywhere along the path, compared whole (``"norm"`` does not match ``"norm1"``).

  >>> import statefulremat as sr
  >>> sr.PathContains("norm")(("block", "norm", "scale"), None)
  True
  """

  __slots__ = ("key",)

  def __init__(self, key):
    self.key = key

  def __call__(self, path, variable):
    return self.key in path


class Not(_Predicate):
  """Matches what ``filter`` does not match.

  Args:
    filter: any filter (a Variable kind, a collection name, a predicate, a tuple of
      filters, ...; see ``sr.state``).

  Raises:
    TypeError: ``filter`` is not a filter.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.Not(sr.Param)((), sr.BatchStat(jnp.zeros(1)))
  True
  """

  __slots__ = ("predicate",)

  def __init__(self, filter: Filter):
    self.predicate = to_predicate(filter)

  def __call__(self, path, variable):
    return not self.predicate(path, variable)


class _Combined(_Predicate):
  """``Any`` / ``All``: matches what ``combine`` (``any`` / ``all``) says of ``filters``."""

  __slots__ = ("predicates",)
  combine: Callable = any

  def __init__(self, *filters: Filter):
    self.predicates = tuple(to_predicate(f) for f in filters)

  def _args(self):
    return self.predicates

  def __call__(self, path, variable):
    return self.combine(p(path, variable) for p in self.predicates)


class Any(_Combined):
  """Matches what at least one of ``filters`` matches.

  Args:
    *filters: the filters (Variable kinds, collection names, predicates, ...); with
      none, it matches nothing.

  Raises:
    TypeError: one of ``filters`` is not a filter.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.Any(sr.Param, "batch_stats")((), sr.BatchStat(jnp.zeros(1)))
  True
  """

  __slots__ = ()


class All(_Combined):
  """Matches what every one of ``filters`` matches.

  Args:
    *filters: the filters (Variable kinds, collection names, predicates, ...); with
      none, it matches everything.

  Raises:
    TypeError: one of ``filters`` is not a filter.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.All(sr.Param, sr.PathContains("w"))(("w",), sr.Param(jnp.zeros(1)))
  True
  """

  __slots__ = ()
  combine = all


def _as_filter(predicate):
  """The filter that ``to_predicate`` turns into ``predicate``."""
  return predicate.filter if isinstance(predicate, _Plain) else predicate


def to_predicate(filter: Filter) -> Predicate:
  """Turns a filter into a ``(path, variable) -> bool`` predicate (see module doc)."""
  if isinstance(filter, _Predicate):
    return filter
  if isinstance(filter, type):
    if issubclass(filter, Variable):
      return _Plain(filter)
    # A class is callable, but calling it with (path, variable) would construct an
    # instance (or fail obscurely) instead of answering a question: refuse it here.
    raise TypeError(
      f"{filter.__name__} is a class but not a Variable kind, so it is not a filter. "
      "Filter by a Variable subclass (sr.Param, sr.BatchStat, ...), a collection name "
      "('batch_stats'), or a (path, variable) -> bool callable such as "
      "`lambda path, v: isinstance(v.value, jax.Array)`."
    )
  if isinstance(filter, str):
    return _Plain(filter)
  if filter is Ellipsis or filter is True:
    return _Plain(True)
  if filter is False or filter is None:
    return _Plain(False)
  if isinstance(filter, (tuple, list)):
    return Any(*filter)
  if callable(filter):
    return cast(Predicate, filter)
  raise TypeError(
    f"{filter!r} is not a filter. A filter is a Variable subclass (sr.Param), a "
    "collection name ('batch_stats'), ..., True/False/None, a (path, variable) -> bool "
    "callable, sr.PathContains/Not/Any/All, or a tuple of these."
  )


def is_everything(filter: Filter) -> bool:
  predicate = to_predicate(filter)
  return isinstance(predicate, _Plain) and predicate.filter is True


def filter_repr(filter: Filter) -> str:
  """How error messages write a filter: ``sr.Param``, ``'params'``, ``(sr.Param, 'cache')``."""
  if isinstance(filter, type):
    public = filter.__module__.startswith("statefulremat")
    return f"sr.{filter.__name__}" if public else filter.__name__
  if isinstance(filter, tuple):
    return "(" + ", ".join(map(filter_repr, filter)) + ("," if len(filter) == 1 else "") + ")"
  return repr(filter)


def collections_and_guess(filters: tuple, variables) -> tuple[str, str | None]:
  """For filters that matched none of ``variables`` (``(path, Variable)`` pairs): the
  collections there with their counts, and the collection a misspelt name may mean.

  >>> import statefulremat as sr
  >>> from statefulremat.core._filters import collections_and_guess
  >>> model = sr.nn.BatchNorm(2, rngs=sr.Rngs(0))
  >>> collections_and_guess(("param",), model.iter_variables())
  ("'params' (2), 'batch_stats' (2)", 'params')
  """
  counts = collections.Counter(var.collection for _, var in variables)
  have = ", ".join(f"{name!r} ({n})" for name, n in counts.items()) or "none"
  names = [f for f in filters if isinstance(f, str)]
  close = [m for f in names for m in difflib.get_close_matches(f, list(counts), n=1)]
  return have, (close[0] if close else None)
