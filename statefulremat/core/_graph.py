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

``unflatten`` replays the walk from the GraphDef, building fresh objects, and fills
in the values. The public ``split`` / ``merge`` / ``update`` on top of it are in
``_split_merge``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from . import _display_hooks
from ._errors import GraphError, format_path
from ._module import Module, _record_owners
from ._state import freeze, thaw_metadata
from ._tracing import current_trace, rebuilt_graphs, serials, structure_epoch
from ._variables import Variable, bare_variable

_REF, _VAR, _NODE, _LIST, _TUPLE, _DICT, _STATIC = range(7)


@jax.tree_util.register_static
class GraphDef:
  """The structure of a module graph (everything but the variables' values).

  Hashable and equal for equal structure and static attributes, so it can be a static
  argument of ``jax.jit``. ``var_paths`` lists the path of each variable in order.
  It is a pytree with no leaves (itself static aux data), as nnx's is, so a plain
  ``jax.jit(step)(graphdef, state)`` or ``jax.tree.map`` over the pair takes it.

  >>> import jax, statefulremat as sr
  >>> g1 = sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)))
  >>> g2 = sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(1)))
  >>> g1 == g2, hash(g1) == hash(g2), g1.var_paths
  (True, True, (('bias',), ('kernel',)))
  >>> jax.tree.leaves(g1), jax.tree.map(lambda x: x, g1) == g1
  ([], True)
  """

  __slots__ = ("tree", "var_paths", "_hash", "_plan", "__weakref__")

  def __init__(self, tree: tuple, var_paths: tuple):
    self.tree = tree
    self.var_paths = var_paths
    self._hash = hash(tree)
    self._plan = None  # how `unflatten` builds this graph, worked out on first use

  def __reduce__(self):
    return GraphDef, (self.tree, self.var_paths)

  def __eq__(self, other):
    if self is other:
      return True
    return isinstance(other, GraphDef) and (self._hash == other._hash and self.tree == other.tree)

  def __hash__(self):
    return self._hash

  def __repr__(self):
    return _display_hooks.text(self)

  def __treescope_repr__(self, path, subtree_renderer):
    return _display_hooks.treescope(self, path, subtree_renderer)


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
  roots: Sequence[Any], *, objects: list | None = None
) -> tuple[GraphDef, list[Variable]]:
  """Walks ``roots`` jointly: their GraphDef and their Variables in walk order.

  If ``objects`` is given, every module and Variable is appended to it in the order
  the GraphDef numbers them (what ``unflatten(..., substitute=objects)`` takes).
  """
  if objects is None:
    known = _rebuilt(roots)
    if known is not None:
      return known
  index: dict[int, int] = {}
  objects = [] if objects is None else objects
  variables: list[Variable] = []
  paths: list[tuple] = []

  def walk(obj, path):
    if isinstance(obj, Variable):
      seen = index.get(id(obj))
      if seen is not None:
        return (_REF, seen)
      index[id(obj)] = len(index)
      objects.append(obj)
      variables.append(obj)
      paths.append(path)
      try:
        meta = freeze(obj._metadata)
      except TypeError:
        raise GraphError(
          f"the metadata of `{format_path(path)}` is not hashable: "
          f"{obj._metadata!r}. Use tuples, strings and numbers in metadata."
        ) from None
      return (_VAR, type(obj), meta)
    if isinstance(obj, Module):
      seen = index.get(id(obj))
      if seen is not None:
        return (_REF, seen)
      index[id(obj)] = len(index)
      objects.append(obj)
      attrs = vars(obj)
      return (
        _NODE,
        type(obj),
        tuple((k, walk(attrs[k], path + (k,))) for k in sorted(attrs) if not k.startswith("_sr_")),
      )
    if isinstance(obj, list):
      return (_LIST, type(obj), tuple(walk(x, path + (i,)) for i, x in enumerate(obj)))
    if isinstance(obj, tuple):
      return (_TUPLE, type(obj), tuple(walk(x, path + (i,)) for i, x in enumerate(obj)))
    if isinstance(obj, dict):
      return (_DICT, type(obj), tuple((k, walk(v, path + (k,))) for k, v in obj.items()))
    return _static(obj, path)

  tree = tuple(walk(root, (i,) if len(roots) > 1 else ()) for i, root in enumerate(roots))
  return GraphDef(tree, tuple(paths)), variables


def unflatten(
  graphdef: GraphDef,
  values: Sequence[Any],
  kinds=None,
  metas=None,
  trace=None,
  substitute: Sequence[Any] = (),
  *,
  remember: bool = True,
) -> tuple[list[Any], list[Variable]]:
  """Builds fresh objects from ``graphdef``; the i-th Variable gets ``values[i]``.

  ``kinds`` / ``metas`` override the GraphDef's Variable kinds and metadata (an entry
  ``None`` keeps the GraphDef's). The first ``len(substitute)`` objects are not built:
  ``substitute`` (from ``flatten(..., objects=...)``) gives existing ones, so a graph
  that refers into existing modules is rebuilt pointing at them. ``remember=False``
  leaves the result out of the rebuilt graphs that ``flatten`` recognises (the pytree
  unflatten keeps its own cache).
  Returns the roots and the new Variables in walk order.
  """
  trace = current_trace() if trace is None else trace
  if kinds is None and metas is None and not substitute:
    plan = graphdef._plan or _plan(graphdef)
    roots, variables = plan.build(values, trace)
    if remember:
      _remember(graphdef, roots, variables)
    return roots, variables
  objects: list[Any] = []
  variables: list[Variable] = []

  def build(d):
    tag = d[0]
    if tag == _REF:
      return objects[d[1]]
    if tag == _VAR and len(objects) < len(substitute):
      var = substitute[len(objects)]
      objects.append(var)
      variables.append(var)
      return var
    if tag == _NODE and len(objects) < len(substitute):
      node = substitute[len(objects)]
      objects.append(node)
      for _, sub in d[2]:
        build(sub)  # consumes the numbering of the existing node's contents
      return node
    if tag == _VAR:
      i = len(variables)
      kind = d[1] if kinds is None or kinds[i] is None else kinds[i]
      var = bare_variable(
        kind,
        values[i],
        thaw_metadata(d[2] if metas is None or metas[i] is None else metas[i]),
        trace,
      )
      objects.append(var)
      variables.append(var)
      return var
    if tag == _NODE:
      node = object.__new__(d[1])
      objects.append(node)
      attrs = {k: build(sub) for k, sub in d[2]}
      for k, v in attrs.items():
        _record_owners(node, v, (k,))
      node.__dict__.update(attrs)
      return node
    if tag == _LIST:
      return d[1](build(x) for x in d[2])
    if tag == _TUPLE:
      items = [build(x) for x in d[2]]
      return d[1]._make(items) if hasattr(d[1], "_fields") else d[1](items)
    if tag == _DICT:
      return d[1]((k, build(v)) for k, v in d[2])
    return d[2]

  return [build(d) for d in graphdef.tree], variables


# -- building from a plan ---------------------------------------------------------
#
# Raw JAX unflattens a module on every call that returns one (`jax.tree.map`, a
# `jax.jit` step returning the model), so the plain case of `unflatten` runs a plan
# worked out once per GraphDef: make every module, then every Variable (its owner
# link included), then fill each module's attributes from a template holding its
# static ones. It builds what the walk above builds: the same classes, attribute
# order, containers, sharing and owners (first owner wins, in the walk's order).

_OBJ, _CONST, _SEQ, _MAP = range(4)
_new = object.__new__
_set = object.__setattr__


# Equal GraphDefs share their plan (sr.split makes a new GraphDef on every call).
_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan(graphdef: GraphDef) -> _Plan:
  plan = _plans.get(graphdef)
  if plan is None:
    plan = _plans.setdefault(graphdef, _Plan(graphdef))
  graphdef._plan = plan
  return plan


def _item(spec, objects: list):
  tag = spec[0]
  if tag == _OBJ:
    return objects[spec[1]]
  if tag == _CONST:
    return spec[1]
  if tag == _SEQ:
    return spec[1]([_item(s, objects) for s in spec[2]])
  return spec[1]((k, _item(s, objects)) for k, s in spec[2])


class _Plan:
  """How to build a GraphDef's objects: modules first (``classes``), then Variables
  (``kinds``, ``metas``, ``owners``), so an object's number in ``build`` is its
  module number, or the module count plus its Variable number."""

  __slots__ = ("classes", "kinds", "metas", "owners", "fills", "roots", "root")

  def __init__(self, graphdef: GraphDef):
    order: list[tuple] = []  # _NODE / _VAR entries, in the walk's numbering
    attrs: dict[int, list] = {}  # walk number of a module -> [(name, spec)]
    owner: dict[int, tuple] = {}  # walk number -> (walk number of parent, key path)

    def record(parent, spec, key_path):
      if spec[0] == _OBJ:
        owner.setdefault(spec[1], (parent, key_path))
      elif spec[0] == _SEQ:
        for i, s in enumerate(spec[2]):
          record(parent, s, key_path + (i,))
      elif spec[0] == _MAP:
        for k, s in spec[2]:
          record(parent, s, key_path + (k,))

    def compile(d):
      tag = d[0]
      if tag == _REF:
        return (_OBJ, d[1])
      if tag == _VAR:
        order.append(d)
        return (_OBJ, len(order) - 1)
      if tag == _NODE:
        k = len(order)
        order.append(d)
        attrs[k] = [(name, compile(sub)) for name, sub in d[2]]
        for name, spec in attrs[k]:  # as the walk does once the module is built
          record(k, spec, (name,))
        return (_OBJ, k)
      if tag == _LIST or tag == _TUPLE:
        make = d[1]._make if hasattr(d[1], "_fields") else d[1]
        items = [compile(x) for x in d[2]]
        if tag == _TUPLE and all(s[0] == _CONST for s in items):
          return (_CONST, make([s[1] for s in items]))  # immutable: made once, here
        return (_SEQ, make, items)
      if tag == _DICT:
        return (_MAP, d[1], [(k, compile(v)) for k, v in d[2]])
      return (_CONST, d[2])

    roots = [compile(d) for d in graphdef.tree]
    modules = [k for k, d in enumerate(order) if d[0] == _NODE]
    variables = [k for k, d in enumerate(order) if d[0] == _VAR]
    number = {k: i for i, k in enumerate(modules + variables)}

    def final(spec):  # walk numbers -> build numbers
      tag = spec[0]
      if tag == _OBJ:
        return (_OBJ, number[spec[1]])
      if tag == _SEQ:
        return (_SEQ, spec[1], [final(s) for s in spec[2]])
      if tag == _MAP:
        return (_MAP, spec[1], [(k, final(s)) for k, s in spec[2]])
      return spec

    def link(k):
      if k not in owner:
        return None
      parent, key_path = owner[k]
      return number[parent], key_path

    self.classes = tuple(order[k][1] for k in modules)
    self.kinds = tuple(order[k][1] for k in variables)
    self.metas = tuple(thaw_metadata(order[k][2]) for k in variables)
    self.owners = tuple(link(k) for k in variables)
    fills = []
    for k in modules:
      template, direct, built = {}, [], []
      for name, spec in attrs[k]:
        spec = final(spec)
        template[name] = spec[1] if spec[0] == _CONST else None
        if spec[0] == _OBJ:
          direct.append((name, spec[1]))
        elif spec[0] != _CONST:
          built.append((name, spec))
      if link(k) is not None:
        template["_sr_owner"] = None
      fills.append((template, tuple(direct), tuple(built), link(k)))
    self.fills = tuple(fills)
    self.roots = tuple(final(spec) for spec in roots)
    self.root = self.roots[0][1] if len(roots) == 1 and self.roots[0][0] == _OBJ else None

  def build(self, values: Sequence[Any], trace) -> tuple[list[Any], list[Variable]]:
    """The roots and the Variables (holding ``values``) of a fresh object graph."""
    if len(values) < len(self.kinds):
      raise IndexError(f"{len(self.kinds)} values needed, {len(values)} given")
    modules = list(map(_new, self.classes))
    refs = list(map(weakref.ref, modules))
    variables = []
    append = variables.append
    # What `bare_variable` does, inlined: this loop runs once per Variable per call.
    for kind, value, meta, owner in zip(self.kinds, values, self.metas, self.owners):
      var = _new(kind)
      var._value = value
      var._metadata = meta  # shared: metadata is replaced (set_metadata), never edited
      var._trace = trace
      var._owner = None if owner is None else (refs[owner[0]], owner[1])
      var._serial = next(serials)
      append(var)
    objects = modules + variables
    for module, (template, direct, built, owner) in zip(modules, self.fills):
      attrs = template.copy()
      for name, i in direct:
        attrs[name] = objects[i]
      for name, spec in built:
        attrs[name] = _item(spec, objects)
      if owner is not None:
        attrs["_sr_owner"] = (refs[owner[0]], owner[1])
      _set(module, "__dict__", attrs)  # not Module.__setattr__: nothing to adopt
    if self.root is not None:  # one module or Variable, the usual case
      return [objects[self.root]], variables
    return [_item(spec, objects) for spec in self.roots], variables


# A transform inside another (grad inside jit, remat inside a scan body) receives
# exactly the roots the outer one rebuilt; flattening them again would walk the whole
# graph once per level per trace to find the GraphDef the outer level already has.
# While no structure has changed since (the epoch), unflatten's result is the answer.


def _remember(graphdef: GraphDef, roots: list, variables: list) -> None:
  if not all(isinstance(r, Module) for r in roots):
    return
  refs = tuple(weakref.ref(r) for r in roots)
  rebuilt_graphs.append((structure_epoch.value, refs, graphdef, variables))
  if len(rebuilt_graphs) > 8:
    del rebuilt_graphs[0]


def _rebuilt(roots: Sequence[Any]) -> tuple[GraphDef, list[Variable]] | None:
  epoch = structure_epoch.value
  for seen, refs, graphdef, variables in reversed(rebuilt_graphs):
    if (
      seen == epoch
      and len(refs) == len(roots)
      and all(ref() is root for ref, root in zip(refs, roots))
    ):
      return graphdef, list(variables)
  return None


def rewrite(
  graphdef: GraphDef, *, root_classes: dict[int, type] | None = None, metadata=None
) -> GraphDef:
  """A GraphDef with some roots' classes replaced and/or Variable metadata mapped.

  ``root_classes`` maps root positions (negative counts from the end) to new classes.

  ``metadata(i, meta) -> meta`` maps the frozen metadata of the i-th Variable.
  """
  count = [0]

  def walk(d):
    tag = d[0]
    if tag == _VAR:
      i = count[0]
      count[0] += 1
      return d if metadata is None else (_VAR, d[1], metadata(i, d[2]))
    if tag == _NODE or tag == _DICT:
      return (tag, d[1], tuple((k, walk(sub)) for k, sub in d[2]))
    if tag == _LIST or tag == _TUPLE:
      return (tag, d[1], tuple(walk(sub) for sub in d[2]))
    return d

  tree = [walk(d) for d in graphdef.tree]
  for position, cls in (root_classes or {}).items():
    tree[position] = (tree[position][0], cls, tree[position][2])
  return GraphDef(tuple(tree), graphdef.var_paths)
