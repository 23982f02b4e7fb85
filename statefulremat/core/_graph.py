"""The graph walk: a module graph as a GraphDef plus its Variables, and back.

``split`` walks the graph depth first (a module's attributes in sorted order, list
and dict items in order) and records each module and Variable the first time it is
reached; later arrivals at the same object become references, so shared sub-modules,
shared Variables and reference cycles survive a round trip as one object. The walk
yields three things:

* a ``GraphDef``: the structure — node classes, static attributes, Variable kinds and
  metadata, and where references point. Hashable, so ``jax.jit`` can key on it;
* the Variables in walk order, with their first path;
* from those, ``State``s (per filter) holding the values.

``unflatten`` (in ``_graph_build``) replays the walk from the GraphDef, building
fresh objects, and fills in the values; it notes what it rebuilt in the graph cache
(``_graph_cache``), so a ``flatten`` of those very roots is a look-up. The public
``split`` / ``merge`` / ``update`` on top of both are in ``_split_merge``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _display_hooks
from ._bookkeeping import is_bookkeeping
from ._containers import ModuleDict, ModuleList
from ._errors import GraphError, format_path
from ._graph_cache import Stamp, derived, walk_of
from ._module import Module
from ._state import freeze, thaw
from ._variables import Variable

# How the walk encodes what it met, as nested tuples ``(tag, class, contents)``: cheap
# to hash and compare, which jax.jit's cache does on every call. Only this file and the
# builder (``_graph_build``, the walk's other half) read the tags; everything else
# reads the typed view, ``GraphDef.nodes`` and ``GraphDef.variables``.
_REF, _VAR, _NODE, _LIST, _TUPLE, _DICT, _STATIC = range(7)
_KINDS = ("ref", "variable", "module", "list", "tuple", "dict", "static")


class GraphNode(NamedTuple):
  """What the walk met at one place of a graph (``GraphDef.nodes``).

  ``kind`` is ``"module"``, ``"variable"``, ``"list"``, ``"tuple"``, ``"dict"``, a
  ``"ref"`` (an object met before) or ``"static"`` (any other attribute value);
  ``type`` its class (the module class, Variable kind or container type); ``items``
  the ``(key, GraphNode)`` pairs of a module's attributes or a container's entries
  (keys: names, indices, dict keys); ``value`` a Variable's frozen metadata, a
  static value, or for a ref the number of the module or Variable it points to (in
  the order the walk first met them).
  """

  kind: str
  type: Any
  items: tuple
  value: Any


class VariableEntry(NamedTuple):
  """A Variable of a GraphDef (``GraphDef.variables``): its first path, its kind
  (the Variable class) and its frozen metadata."""

  path: tuple
  kind: type
  metadata: Any


def _typed(d) -> GraphNode:
  tag = d[0]
  if tag == _REF:
    return GraphNode("ref", None, (), d[1])
  if tag == _VAR or tag == _STATIC:
    return GraphNode(_KINDS[tag], d[1], (), d[2])
  items = d[2] if tag == _NODE or tag == _DICT else enumerate(d[2])
  return GraphNode(_KINDS[tag], d[1], tuple((k, _typed(sub)) for k, sub in items), None)


@jax.tree_util.register_static
class GraphDef:
  """The structure of a module graph (everything but the variables' values).

  Hashable and equal for equal structure and static attributes, so it can be a static
  argument of ``jax.jit``. ``var_paths`` lists the path of each variable in order.
  It is a pytree with no leaves (itself static aux data), as nnx's is, so a plain
  ``jax.jit(step)(graphdef, state)`` or ``jax.tree.map`` over the pair takes it.

  ``sr.split`` and ``sr.graphdef`` make it; there is no need to build one.

  Args:
    tree: the walk's record of each root, as nested tuples (read it through ``nodes``).
    var_paths: the path of each Variable (its first, for a shared one), in walk order.

  >>> import jax, statefulremat as sr
  >>> g1 = sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)))
  >>> g2 = sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(1)))
  >>> g1 == g2, hash(g1) == hash(g2), g1.var_paths
  (True, True, (('bias',), ('kernel',)))
  >>> jax.tree.leaves(g1), jax.tree.map(lambda x: x, g1) == g1
  ([], True)
  """

  __slots__ = ("tree", "var_paths", "_hash", "_derived", "__weakref__")

  def __init__(self, tree: tuple, var_paths: tuple):
    self.tree = tree
    self.var_paths = var_paths
    self._hash = hash(tree)
    # What is worked out from the structure on first use, shared by equal GraphDefs
    # (`_graph_cache.per_structure`).
    self._derived: dict | None = None

  @property
  def nodes(self) -> tuple[GraphNode, ...]:
    """The graph's roots as ``GraphNode`` trees (one per root walked together).

    >>> import statefulremat as sr
    >>> (root,) = sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(0))).nodes
    >>> root.kind, root.type.__name__, [(k, n.kind) for k, n in root.items][:2]
    ('module', 'Linear', [('bias', 'variable'), ('dot_general', 'static')])
    """
    return derived(self, "nodes", lambda graphdef: tuple(map(_typed, graphdef.tree)))

  @property
  def variables(self) -> tuple[VariableEntry, ...]:
    """Each Variable's ``(path, kind, metadata)``, in flat (walk) order.

    >>> import statefulremat as sr
    >>> [(e.path, e.kind.__name__) for e in sr.graphdef(sr.nn.Linear(2, 3,
    ...     rngs=sr.Rngs(0))).variables]
    [(('bias',), 'Param'), (('kernel',), 'Param')]
    """
    return derived(self, "variables", _variable_entries)

  def __getstate__(self):
    # Metadata thawed to plain dicts and lists: a pickle names sr.GraphDef and the graph's
    # classes, never _state's frozen helpers, so moving them breaks no pickle.
    return thaw(self.tree), self.var_paths

  def __setstate__(self, state):
    tree, var_paths = state
    GraphDef.__init__(self, freeze(tree), var_paths)

  def __eq__(self, other):
    return self is other or (
      isinstance(other, GraphDef) and self._hash == other._hash and self.tree == other.tree
    )

  def __hash__(self):
    return self._hash

  def __repr__(self):
    return _display_hooks.text(self)

  def __treescope_repr__(self, path, subtree_renderer):
    return _display_hooks.treescope(self, path, subtree_renderer)


def variable_nodes(node: GraphNode, path: tuple = ()) -> Iterator[tuple[tuple, GraphNode]]:
  """``(path, node)`` of each Variable in ``node``, in walk order; the path as
  ``(kind of the container, key)`` pairs."""
  if node.kind == "variable":
    yield path, node
  for key, sub in node.items:
    yield from variable_nodes(sub, path + ((node.kind, key),))


def _variable_entries(graphdef: GraphDef) -> tuple[VariableEntry, ...]:
  found = [n for root in graphdef.nodes for _, n in variable_nodes(root)]
  return tuple(VariableEntry(p, n.type, n.value) for p, n in zip(graphdef.var_paths, found))


# -- flattening -----------------------------------------------------------------


def _static(obj, path):
  if isinstance(obj, (jax.Array, np.ndarray)):
    raise GraphError(
      f"attribute `{format_path(path)}` holds an array "
      f"({getattr(obj, 'dtype', '?')}{list(np.shape(obj))}) that is not in a Variable, "
      "so transforms would bake it in as a constant and never update it. Fix: wrap "
      "it, e.g. `self.w = sr.Param(w)` (or sr.BatchStat / sr.Variable), or make it a "
      "Python number if it is configuration."
    )
  try:
    hash(obj)
  except TypeError:
    raise GraphError(
      f"attribute `{format_path(path)}` holds a {type(obj).__name__}, which is not "
      "hashable. Attributes other than modules, Variables and lists/tuples/dicts of "
      "them are static configuration and become part of the GraphDef, so they must be "
      "hashable. Fix: use a tuple or a frozen dataclass, or wrap array data in a "
      "Variable."
    ) from None
  # The type is part of the entry: 2 == 2.0 == True, but a module holding `2.0`
  # computes in another dtype than one holding `2`, so they must not share a GraphDef
  # (and so a compiled function).
  return (_STATIC, type(obj), obj)


def flatten(
  roots: Sequence[Any], *, objects: list | None = None, stamp: Stamp | None = None
) -> tuple[GraphDef, list[Variable]]:
  """Walks ``roots`` jointly: their GraphDef and their Variables in walk order.

  If ``objects`` is given, every module and Variable is appended to it in the order
  the GraphDef numbers them (what ``unflatten(..., substitute=objects)`` takes). A
  ``stamp`` (made just before) notes the version of each node as the walk reaches it.
  """
  if objects is None and stamp is None:
    known = walk_of(roots)
    if known is not None:
      return known.graphdef, list(known.variables)
  index: dict[int, int] = {}
  objects = [] if objects is None else objects
  variables: list[Variable] = []
  paths: list[tuple] = []

  def walk(obj, path):
    if isinstance(obj, (Variable, Module)):
      seen = index.get(id(obj))
      if seen is not None:
        return (_REF, seen)
      index[id(obj)] = len(index)
      objects.append(obj)
    if isinstance(obj, Variable):
      variables.append(obj)
      paths.append(path)
      if stamp is not None:
        stamp.saw_variable(obj)
      try:
        meta = freeze(obj._metadata)
      except TypeError:
        raise GraphError(
          f"the metadata of `{format_path(path)}` is not hashable: "
          f"{obj._metadata!r}. Use tuples, strings and numbers in metadata."
        ) from None
      return (_VAR, type(obj), meta)
    if isinstance(obj, Module):
      attrs = vars(obj)
      if stamp is not None:
        stamp.saw_module(attrs)
      names = [k for k in attrs if not is_bookkeeping(k)]
      node = (_NODE, type(obj), tuple((k, walk(attrs[k], path + (k,))) for k in sorted(names)))
      # The walk goes in sorted order (the Variables' numbering must not depend on the
      # order attributes were set), but a rebuilt module keeps its definition order, as
      # `repr` and `vars` show it: noted only where it differs.
      return node if names == sorted(names) else (*node, tuple(names))
    if stamp is not None and isinstance(obj, (ModuleList, ModuleDict)):
      stamp.saw_container(obj)
    if isinstance(obj, (list, tuple)):
      tag = _LIST if isinstance(obj, list) else _TUPLE
      return (tag, type(obj), tuple(walk(x, path + (i,)) for i, x in enumerate(obj)))
    if isinstance(obj, dict):
      return (_DICT, type(obj), tuple((k, walk(v, path + (k,))) for k, v in obj.items()))
    return _static(obj, path)

  tree = tuple(walk(root, (i,) if len(roots) > 1 else ()) for i, root in enumerate(roots))
  return GraphDef(tree, tuple(paths)), variables


def rewrite(
  graphdef: GraphDef, *, root_classes: dict[int, type] | None = None, metadata=None
) -> GraphDef:
  """A GraphDef with some roots' classes replaced and/or Variable metadata mapped.

  ``root_classes`` maps root positions (negative counts from the end) to new classes.

  ``metadata(i, meta) -> meta`` maps the frozen metadata of the i-th Variable.
  """
  numbers = itertools.count()  # the i-th Variable, in walk order

  def walk(d):
    tag = d[0]
    if tag == _VAR:
      i = next(numbers)
      return d if metadata is None else (_VAR, d[1], metadata(i, d[2]))
    if tag == _NODE or tag == _DICT:
      return (tag, d[1], tuple((k, walk(sub)) for k, sub in d[2]), *d[3:])
    if tag == _LIST or tag == _TUPLE:
      return (tag, d[1], tuple(walk(sub) for sub in d[2]))
    return d

  tree = [walk(d) for d in graphdef.tree]
  for position, cls in (root_classes or {}).items():
    tree[position] = (tree[position][0], cls, *tree[position][2:])
  return GraphDef(tuple(tree), graphdef.var_paths)
