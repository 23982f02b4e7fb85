"""Lists and dicts owned by modules.

Like PyTorch's ``nn.ModuleList``, a list or dict assigned to a module attribute is
adopted: it is copied into a ``ModuleList`` / ``ModuleDict`` (still a ``list`` /
``dict``, and the same pytree) whose mutations note a change of structure, so a cached
flattening of the graph notices ``self.layers.append(...)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from ._bookkeeping import VERSION
from ._tracing import structure_changed


def _noting(base: type) -> Callable[[Callable], Callable[..., Any]]:
  """Makes the decorated method, whose body is only its doc, ``base``'s method of the
  same name (``list.append``), noting a change of structure first."""

  def decorate(declared: Callable) -> Callable[..., Any]:
    method = getattr(base, declared.__name__)

    @functools.wraps(declared)
    def mutate(self, *args, **kwargs):
      structure_changed(self)
      return method(self, *args, **kwargs)

    return mutate

  return decorate


class ModuleList(list):
  """A ``list`` held by a module; its mutations are tracked.

  A list assigned to a module attribute becomes one by itself; there is no need to
  build one.

  Args:
    iterable: the items, as ``list(iterable)`` takes them; empty by default.

  >>> import statefulremat as sr
  >>> class Net(sr.Module):
  ...   def __init__(self):
  ...     self.layers = [sr.nn.Linear(2, 2, rngs=sr.Rngs(i)) for i in range(2)]
  >>> net = Net()
  >>> type(net.layers).__name__, isinstance(net.layers, list)
  ('ModuleList', True)
  """

  __slots__ = (VERSION, "__weakref__")

  @_noting(list)
  def append(self, *args, **kwargs):
    """``list.append``, and notes a change of structure so cached flattenings
    of the graph (``sr.jit``'s fast path) see the new item. Unlike attribute
    assignment, it does not adopt the item (a list in it stays plain) or record its
    owner.

    >>> import statefulremat as sr
    >>> xs = sr.ModuleList([1])
    >>> xs.append([2])
    >>> xs, type(xs[1]).__name__
    ([1, [2]], 'list')
    """

  @_noting(list)
  def extend(self, *args, **kwargs):
    """``list.extend``, and notes a change of structure. Like ``append``, the
    items are not adopted and get no owner recorded.

    >>> import statefulremat as sr
    >>> xs = sr.ModuleList([1])
    >>> xs.extend([2, 3])
    >>> xs
    [1, 2, 3]
    """

  @_noting(list)
  def insert(self, *args, **kwargs):
    """``list.insert``, and notes a change of structure (later items move to new
    paths). Like ``append``, the item is not adopted and gets no owner recorded.

    >>> import statefulremat as sr
    >>> xs = sr.ModuleList([1, 3])
    >>> xs.insert(1, 2)
    >>> xs
    [1, 2, 3]
    """

  @_noting(list)
  def pop(self, *args, **kwargs):
    """``list.pop`` (returns the item), and notes a change of structure.

    >>> import statefulremat as sr
    >>> xs = sr.ModuleList([1, 2, 3])
    >>> xs.pop(0), xs
    (1, [2, 3])
    """

  @_noting(list)
  def remove(self, *args, **kwargs):
    """``list.remove`` (the first item equal to ``value``), and notes a change of structure.

    >>> import statefulremat as sr
    >>> xs = sr.ModuleList([1, 2, 1])
    >>> xs.remove(1)
    >>> xs
    [2, 1]
    """

  @_noting(list)
  def clear(self, *args, **kwargs):
    """``list.clear``, and notes a change of structure.

    >>> import statefulremat as sr
    >>> xs = sr.ModuleList([1, 2])
    >>> xs.clear()
    >>> xs, type(xs).__name__
    ([], 'ModuleList')
    """

  @_noting(list)
  def sort(self, *args, **kwargs):
    """``list.sort`` in place (same ``key`` and ``reverse``), and notes a change of structure: items change paths.

    >>> import statefulremat as sr
    >>> xs = sr.ModuleList(["b", "c", "a"])
    >>> xs.sort(reverse=True)
    >>> xs
    ['c', 'b', 'a']
    """

  @_noting(list)
  def reverse(self, *args, **kwargs):
    """``list.reverse`` in place, and notes a change of structure: items
    change paths.

    >>> import statefulremat as sr
    >>> xs = sr.ModuleList([1, 2, 3])
    >>> xs.reverse()
    >>> xs
    [3, 2, 1]
    """


class ModuleDict(dict):
  """A ``dict`` held by a module; its mutations are tracked.

  >>> import statefulremat as sr
  >>> class Heads(sr.Module):
  ...   def __init__(self):
  ...     self.heads = {"a": sr.nn.Linear(2, 1, rngs=sr.Rngs(0))}
  >>> type(Heads().heads).__name__
  'ModuleDict'
  """

  __slots__ = (VERSION, "__weakref__")

  @_noting(dict)
  def pop(self, *args, **kwargs):
    """``dict.pop`` (the value, or ``default`` for a missing key), and notes a change of structure.

    >>> import statefulremat as sr
    >>> d = sr.ModuleDict(a=1, b=2)
    >>> d.pop("a"), d.pop("z", None), d
    (1, None, {'b': 2})
    """

  @_noting(dict)
  def popitem(self, *args, **kwargs):
    """``dict.popitem`` (the last inserted ``(key, value)``), and notes a change of structure.

    >>> import statefulremat as sr
    >>> d = sr.ModuleDict(a=1, b=2)
    >>> d.popitem(), d
    (('b', 2), {'a': 1})
    """

  @_noting(dict)
  def clear(self, *args, **kwargs):
    """``dict.clear``, and notes a change of structure.

    >>> import statefulremat as sr
    >>> d = sr.ModuleDict(a=1)
    >>> d.clear()
    >>> d, type(d).__name__
    ({}, 'ModuleDict')
    """

  @_noting(dict)
  def update(self, *args, **kwargs):
    """``dict.update``, and notes a change of structure. Unlike attribute
    assignment, it does not adopt the values (a dict in them stays plain) or record
    their owner.

    >>> import statefulremat as sr
    >>> d = sr.ModuleDict(a=1)
    >>> d.update({"b": {"c": 2}})
    >>> d, type(d["b"]).__name__
    ({'a': 1, 'b': {'c': 2}}, 'dict')
    """

  @_noting(dict)
  def setdefault(self, *args, **kwargs):
    """``dict.setdefault``, and notes a change of structure on every call,
    even when the key is already there. A new value is not adopted and gets no owner
    recorded.

    >>> import statefulremat as sr
    >>> d = sr.ModuleDict(a=1)
    >>> d.setdefault("a", 5), d.setdefault("b", 2), d
    (1, 2, {'a': 1, 'b': 2})
    """


# The mutating operators, which need no docs of their own (they keep list's and dict's).
for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__"):
  setattr(ModuleList, _name, _noting(list)(getattr(list, _name)))
for _name in ("__setitem__", "__delitem__", "__ior__"):
  setattr(ModuleDict, _name, _noting(dict)(getattr(dict, _name)))

jax.tree_util.register_pytree_with_keys(
  ModuleList,
  lambda xs: ([(jax.tree_util.SequenceKey(i), x) for i, x in enumerate(xs)], None),
  lambda _, xs: ModuleList(xs),
  flatten_func=lambda xs: (list(xs), None),
)
jax.tree_util.register_pytree_with_keys(
  ModuleDict,
  lambda d: ([(jax.tree_util.DictKey(k), v) for k, v in d.items()], tuple(d)),
  lambda keys, vs: ModuleDict(zip(keys, vs)),
  flatten_func=lambda d: (list(d.values()), tuple(d)),
)


def maker(cls):
  """How to make a list or tuple of class ``cls`` from a list of its items (a namedtuple
  takes them spread, through ``_make``)."""
  return cls._make if hasattr(cls, "_fields") else cls


def adopt(value):
  """Copies lists and dicts (at any depth inside tuples, lists and dicts) into tracked ones."""
  if type(value) is list or type(value) is ModuleList:
    return ModuleList(adopt(v) for v in value)
  if type(value) is dict or type(value) is ModuleDict:
    return ModuleDict((k, adopt(v)) for k, v in value.items())
  if isinstance(value, tuple) and any(isinstance(v, (list, dict, tuple)) for v in value):
    return maker(type(value))([adopt(v) for v in value])
  return value
