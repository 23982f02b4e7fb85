"""Building a module graph back from its GraphDef: ``unflatten``.

``unflatten`` replays the walk of ``_graph.flatten`` from a GraphDef, making fresh
modules and Variables (or taking existing ones in their place) and filling in the
values. It follows a plan worked out once per GraphDef (``_Plan``): raw JAX runs it
on every call that returns a module.
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
from ._variables import Variable


def unflatten(
  graphdef: GraphDef,
  values: Sequence[Any],
  kinds=None,
  metas=None,
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
  plain = kinds is None and metas is None and not substitute
  stamp = Stamp() if plain else None  # its nodes not noted: held while nothing changes anywhere
  plan = derived(graphdef, "build", _Plan)
  roots, variables = plan.build(values, current_trace(), kinds, metas, substitute)
  if stamp is not None and all(isinstance(r, Module) for r in roots):
    remember(roots, stamp, graphdef, variables)
  return roots, variables


# -- building from a plan ---------------------------------------------------------
#
# Raw JAX unflattens a module on every call that returns one (`jax.tree.map`, a
# `jax.jit` step returning the model), so `unflatten` runs a plan worked out once per
# GraphDef: make every module, then every Variable (its owner link included), then fill
# each module's attributes from a template holding its static ones. The classes,
# attribute order, containers and sharing are the walk's, and so are the owners: the
# first owner wins, modules recording their attributes' after their contents'.

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
    return spec[1]([_item(s, objects) for _, s in spec[2]])
  return spec[1]((k, _item(s, objects)) for k, s in spec[2])


class _Plan:
  """How to build a GraphDef's objects: Variables first (``kinds``, ``metas``,
  ``owners``), then modules (``classes``), so an object's number in ``build`` is its
  Variable number, or the Variable count plus its module number. ``number`` turns the
  walk's numbers (what ``substitute`` counts) into these; ``post`` lists the modules in
  the order they record their attributes' owners, each after its contents."""

  __slots__ = ("classes", "kinds", "metas", "owners", "fills", "roots", "root", "number", "post")

  def __init__(self, graphdef: GraphDef):
    n_variables = len(graphdef.var_paths)
    number: list[int] = []  # walk number -> build number
    kinds, metas, nodes = [], [], []  # the Variables' kinds and metadata; the modules
    attrs: dict[int, list] = {}  # module number -> [(name, spec)]
    owner: dict[int, tuple] = {}  # build number -> (module number of its parent, key path)
    post: list[int] = []

    def record(parent, spec, key_path):
      if spec[0] == _OBJ:
        owner.setdefault(spec[1], (parent, key_path))
      elif spec[0] == _SEQ or spec[0] == _MAP:  # (key, spec) pairs
        for k, s in spec[2]:
          record(parent, s, key_path + (k,))

    def compile(d):
      tag = d[0]
      if tag == _REF:
        return (_OBJ, number[d[1]])
      if tag == _VAR:
        number.append(len(kinds))
        kinds.append(d[1])
        metas.append(thaw_metadata(d[2]))
        return (_OBJ, number[-1])
      if tag == _NODE:
        m = len(nodes)
        number.append(n_variables + m)
        nodes.append(d)
        attrs[m] = [(name, compile(sub)) for name, sub in d[2]]
        for name, spec in attrs[m]:  # as the walk does once the module is built
          record(m, spec, (name,))
        post.append(m)
        return (_OBJ, n_variables + m)
      if tag == _LIST or tag == _TUPLE:
        make = maker(d[1])
        items = [(i, compile(x)) for i, x in enumerate(d[2])]
        if tag == _TUPLE and all(s[0] == _CONST for _, s in items):
          return (_CONST, make([s[1] for _, s in items]))  # immutable: made once, here
        return (_SEQ, make, items)
      if tag == _DICT:
        return (_MAP, d[1], [(k, compile(v)) for k, v in d[2]])
      return (_CONST, d[2])

    self.roots = tuple(compile(d) for d in graphdef.tree)
    self.root = self.roots[0][1] if len(self.roots) == 1 and self.roots[0][0] == _OBJ else None
    self.kinds, self.metas = tuple(kinds), tuple(metas)
    self.number, self.post = tuple(number), tuple(post)
    self.owners = tuple(owner.get(i) for i in range(n_variables))
    self.classes = tuple(d[1] for d in nodes)
    fills = []
    for m, d in enumerate(nodes):
      template, direct, built = {}, [], []
      for name, spec in attrs[m]:
        template[name] = spec[1] if spec[0] == _CONST else None
        if spec[0] == _OBJ:
          direct.append((name, spec[1]))
        elif spec[0] != _CONST:
          built.append((name, spec))
      if len(d) > 3:  # the module's definition order (see `_graph.flatten`)
        template = {name: template[name] for name in d[3]}
      link = owner.get(n_variables + m)
      if link is not None:
        template[OWNER] = None
      fills.append((template, tuple(direct), tuple(built), link))
    self.fills = tuple(fills)

  def build(
    self, values: Sequence[Any], trace, kinds=None, metas=None, substitute: Sequence[Any] = ()
  ) -> tuple[list[Any], list[Variable]]:
    """The roots and the Variables (holding ``values``) of a fresh object graph;
    ``unflatten`` says what ``kinds``, ``metas`` and ``substitute`` change."""
    if len(values) < len(self.kinds):
      raise IndexError(f"{len(self.kinds)} values needed, {len(values)} given")
    if kinds is not None:
      kinds = [mine if kind is None else kind for mine, kind in zip(self.kinds, kinds)]
    if metas is not None:
      metas = [mine if m is None else thaw_metadata(m) for mine, m in zip(self.metas, metas)]
    modules = list(map(_new, self.classes))
    refs = list(map(weakref.ref, modules))
    variables = []
    append = variables.append
    # What `bare_variable` does, inlined: this loop runs once per Variable per call.
    for kind, value, meta, owner in zip(
      kinds or self.kinds, values, metas or self.metas, self.owners
    ):
      var = _new(kind)
      var._value = value
      var._metadata = meta  # shared: metadata is replaced (set_metadata), never edited
      var._trace = trace
      var._owner = None if owner is None else (refs[owner[0]], owner[1])
      var._serial = next(serials)
      append(var)
    objects = variables + modules
    n = len(variables)
    fills = zip(modules, self.fills)
    if substitute:  # existing objects in place of the first ones the walk numbers
      for k, existing in enumerate(substitute):
        objects[self.number[k]] = existing
      variables = objects[:n]
      fills = [(new, fill) for m, (new, fill) in enumerate(fills) if objects[n + m] is new]
    for module, (template, direct, built, owner) in fills:
      attrs = template.copy()
      for name, i in direct:
        attrs[name] = objects[i]
      for name, spec in built:
        attrs[name] = _item(spec, objects)
      if owner is not None:
        attrs[OWNER] = (refs[owner[0]], owner[1])
      _set(module, "__dict__", attrs)  # not Module.__setattr__: nothing to adopt
    if substitute:  # an existing object with no owner yet takes its first new holder
      for m in self.post:
        if objects[n + m] is modules[m]:
          for name, value in vars(modules[m]).items():
            if name != OWNER:
              _record_owners(modules[m], value, (name,))
    if self.root is not None:  # one module or Variable, the usual case
      return [objects[self.root]], variables
    return [_item(spec, objects) for spec in self.roots], variables
