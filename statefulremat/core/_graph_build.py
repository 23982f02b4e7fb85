"""Building a module graph back from its GraphDef: ``unflatten``.

``unflatten`` replays the walk of ``_graph.flatten`` from a GraphDef, making fresh
modules and Variables (or taking existing ones in their place) and filling in the
values. Its plain case, the one raw JAX runs on every call that returns a module,
follows a plan worked out once per GraphDef (``_Plan``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from ._bookkeeping import OWNER
from ._caches import serials
from ._containers import maker
from ._graph import _DICT, _LIST, _NODE, _REF, _TUPLE, _VAR, GraphDef
from ._graph_cache import Stamp, derived, remember
from ._module import Module, _record_owners
from ._state import thaw_metadata
from ._tracing import current_trace
from ._variables import Variable, bare_variable


def unflatten(
  graphdef: GraphDef,
  values: Sequence[Any],
  kinds=None,
  metas=None,
  trace=None,
  substitute: Sequence[Any] = (),
) -> tuple[list[Any], list[Variable]]:
  """Builds fresh objects from ``graphdef``; the i-th Variable gets ``values[i]``.

  ``kinds`` / ``metas`` override the GraphDef's Variable kinds and metadata (an entry
  ``None`` keeps the GraphDef's). The first ``len(substitute)`` objects are not built:
  ``substitute`` (from ``flatten(..., objects=...)``) gives existing ones, so a graph
  that refers into existing modules is rebuilt pointing at them. A graph of modules
  built from the GraphDef alone is remembered (``_graph_cache``), so a ``flatten`` of
  those very roots, by a transform inside another or by raw JAX, is a look-up.
  Returns the roots and the new Variables in walk order.
  """
  trace = current_trace() if trace is None else trace
  if kinds is None and metas is None and not substitute:
    stamp = Stamp()  # its nodes not noted: held while nothing changes anywhere
    plan = derived(graphdef, "build", _Plan)
    roots, variables = plan.build(values, trace)
    if all(isinstance(r, Module) for r in roots):
      remember(roots, stamp, graphdef, variables)
    return roots, variables
  objects: list[Any] = []
  variables: list[Variable] = []

  def build(d):
    tag = d[0]
    if tag == _REF:
      return objects[d[1]]
    if (tag == _VAR or tag == _NODE) and len(objects) < len(substitute):
      existing = substitute[len(objects)]
      objects.append(existing)
      if tag == _VAR:
        variables.append(existing)
      else:
        for _, sub in d[2]:
          build(sub)  # consumes the numbering of the existing node's contents
      return existing
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
      if len(d) > 3:  # built in the walk's order, kept in the definition order
        attrs = {k: attrs[k] for k in d[3]}
      for k, v in attrs.items():
        _record_owners(node, v, (k,))
      node.__dict__.update(attrs)
      return node
    if tag == _LIST or tag == _TUPLE:
      return maker(d[1])([build(x) for x in d[2]])
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
# static ones. It builds what `build` above builds: the same classes, attribute
# order, containers, sharing and owners (first owner wins, in the walk's order).

_OBJ, _CONST, _SEQ, _MAP = range(4)
_new = object.__new__
_set = object.__setattr__


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
        make = maker(d[1])
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

    def link(k):  # an object's owner: (build number of its parent, key path), or None
      parent, key_path = owner.get(k, (None, None))
      return None if parent is None else (number[parent], key_path)

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
      if len(order[k]) > 3:  # the module's definition order (see `_graph.flatten`)
        template = {name: template[name] for name in order[k][3]}
      if link(k) is not None:
        template[OWNER] = None
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
        attrs[OWNER] = (refs[owner[0]], owner[1])
      _set(module, "__dict__", attrs)  # not Module.__setattr__: nothing to adopt
    if self.root is not None:  # one module or Variable, the usual case
      return [objects[self.root]], variables
    return [_item(spec, objects) for spec in self.roots], variables
