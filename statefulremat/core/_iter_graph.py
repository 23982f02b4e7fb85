"""``sr.iter_graph``: everything reachable from a node, in flax.nnx's order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ._bookkeeping import is_bookkeeping
from ._module import Module
from ._variables import Variable


def iter_graph(node) -> Iterator[tuple[tuple, Any]]:
  """Yields ``(path, value)`` for everything reachable from ``node``, as flax.nnx's
  ``iter_graph``: modules, Variables, the lists/tuples/dicts that hold them and the
  static attributes (ints, strings, functions, ...), ``node`` itself last.

  The order is nnx's: depth first, children before their parent, a module's
  attributes and a dict's keys sorted, list items in order. A module, Variable or
  container reached again (shared) is yielded at its first path only; a Variable is a
  leaf (its value is not entered). Attributes statefulremat keeps for itself
  (``core/_bookkeeping``) are left out, as nnx leaves out its own. For modules and Variables
  alone, first path first, use ``model.iter_modules()`` / ``model.iter_variables()``.

  Args:
    node: where to start: a Module, a Variable, or a list/tuple/dict of them.

  Yields:
    ``(path, value)`` pairs: the path from ``node`` (a tuple of attribute names, list
    indices and dict keys; ``()`` for ``node``) and what is there.

  >>> import statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> [(path, type(v).__name__) for path, v in sr.iter_graph([model, model])
  ...  if not path or path[-1] in ("kernel", "bias", 0, 1)]
  [((0, 'bias'), 'Param'), ((0, 'kernel'), 'Param'), ((0,), 'Linear'), ((), 'list')]
  """
  seen: set[int] = set()
  todo: list[tuple[tuple, Any, bool]] = [((), node, False)]
  while todo:
    path, obj, done = todo.pop()
    if done:
      yield path, obj
      continue
    if isinstance(obj, Module):
      children = _sorted_items({k: v for k, v in vars(obj).items() if not is_bookkeeping(k)})
    elif isinstance(obj, dict):
      children = _sorted_items(obj)
    elif isinstance(obj, (list, tuple)):
      children = list(enumerate(obj))
    elif isinstance(obj, Variable):
      children = []  # a leaf: its value is not entered
    else:
      yield path, obj  # a static leaf: yielded wherever it appears
      continue
    if id(obj) in seen:
      continue
    seen.add(id(obj))
    todo.append((path, obj, True))
    todo.extend((path + (k,), v, False) for k, v in reversed(children))


def _sorted_items(mapping: dict) -> list:
  try:
    return sorted(mapping.items(), key=lambda kv: kv[0])
  except TypeError:  # keys of mixed types: keep their order
    return list(mapping.items())
