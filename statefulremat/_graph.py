"""Split a module graph into a GraphDef and States, and merge them back.

``split`` walks the graph depth first (a module's attributes in sorted order, list
and dict items in order) and records each module and Variable the first time it is
reached; later arrivals at the same object become references, so shared sub-modules,
shared Variables and reference cycles survive a round trip as one object. The walk
yields three things:

* a ``GraphDef``: the structure — node classes, static attributes, Variable kinds and
  metadata, and where references point. Hashable, so ``jax.jit`` can key on it;
* the Variables in walk order, with their first path;
* from those, ``State``s (per filter) holding the values.

``merge`` replays the walk from the GraphDef, building fresh objects, and fills in
the values; ``update`` writes values into an existing graph by path.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import jax
import numpy as np

from ._errors import GraphError, StateMismatchError, format_path
from ._filters import Filter
from ._module import Module, _record_owners
from ._state import State, freeze, partition, thaw_metadata
from ._tracing import current_trace, rebuilt_graphs, structure_epoch
from ._variables import Variable, _dtype_of, bare_variable

_REF, _VAR, _NODE, _LIST, _TUPLE, _DICT, _STATIC = range(7)


class GraphDef:
  """The structure of a module graph (everything but the variables' values).

  Hashable and equal for equal structure and static attributes, so it can be a static
  argument of ``jax.jit``. ``var_paths`` lists the path of each variable in order.

  >>> import statefulremat as sr
  >>> g1 = sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)))
  >>> g2 = sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(1)))
  >>> g1 == g2, hash(g1) == hash(g2), g1.var_paths
  (True, True, (('bias',), ('kernel',)))
  """

  __slots__ = ("tree", "var_paths", "_hash")

  def __init__(self, tree: tuple, var_paths: tuple):
    self.tree = tree
    self.var_paths = var_paths
    self._hash = hash(tree)

  def __eq__(self, other):
    if self is other:
      return True
    return isinstance(other, GraphDef) and (
        self._hash == other._hash and self.tree == other.tree)

  def __hash__(self):
    return self._hash

  def __repr__(self):
    from ._treescope import text_repr

    return text_repr(self, lambda g: f"GraphDef(<{len(g.var_paths)} variables>)")

  def __treescope_repr__(self, path, subtree_renderer):
    from ._treescope import render_graphdef

    return render_graphdef(self, path, subtree_renderer)


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


def flatten(roots: Sequence[Any], *, objects: list | None = None
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
      return (_NODE, type(obj), tuple(
          (k, walk(attrs[k], path + (k,))) for k in sorted(attrs)
          if not k.startswith("_sr_")))
    if isinstance(obj, list):
      return (_LIST, type(obj), tuple(walk(x, path + (i,)) for i, x in enumerate(obj)))
    if isinstance(obj, tuple):
      return (_TUPLE, type(obj), tuple(walk(x, path + (i,)) for i, x in enumerate(obj)))
    if isinstance(obj, dict):
      return (_DICT, type(obj), tuple((k, walk(v, path + (k,))) for k, v in obj.items()))
    return _static(obj, path)

  tree = tuple(walk(root, (i,) if len(roots) > 1 else ()) for i, root in enumerate(roots))
  return GraphDef(tree, tuple(paths)), variables


def unflatten(graphdef: GraphDef, values: Sequence[Any], kinds=None, metas=None,
              trace=None, substitute: Sequence[Any] = ()) -> tuple[list[Any], list[Variable]]:
  """Builds fresh objects from ``graphdef``; the i-th Variable gets ``values[i]``.

  ``kinds`` / ``metas`` override the GraphDef's Variable kinds and metadata (an entry
  ``None`` keeps the GraphDef's). The first ``len(substitute)`` objects are not built:
  ``substitute`` (from ``flatten(..., objects=...)``) gives existing ones, so a graph
  that refers into existing modules is rebuilt pointing at them.
  Returns the roots and the new Variables in walk order.
  """
  trace = current_trace() if trace is None else trace
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
      var = bare_variable(kind, values[i], thaw_metadata(
          d[2] if metas is None or metas[i] is None else metas[i]), trace)
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

  roots = [build(d) for d in graphdef.tree]
  if kinds is None and metas is None and not substitute:
    _remember(graphdef, roots, variables)
  return roots, variables


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
    if seen == epoch and len(refs) == len(roots) and all(
        ref() is root for ref, root in zip(refs, roots)):
      return graphdef, list(variables)
  return None


def rewrite(graphdef: GraphDef, *, root_classes: dict[int, type] | None = None,
            metadata=None) -> GraphDef:
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


# -- the public functions ---------------------------------------------------------


def _check_node(node, fn: str):
  if not isinstance(node, (Module, Variable, list, tuple, dict)):
    raise TypeError(
        f"sr.{fn} takes a Module (or a list/tuple/dict of them), got "
        f"{type(node).__name__}."
    )


def _states(graphdef: GraphDef, variables: list[Variable], filters) -> list[State]:
  items = list(zip(graphdef.var_paths, variables))
  groups = partition(items, filters)
  return [State.from_variables(items[i] for i in group) for group in groups]


def split(node, *filters: Filter) -> tuple:
  """Splits a graph into its GraphDef and one State per filter.

  Each variable lands in the State of the first filter that matches it; a variable
  matched by none is an error unless the last filter is ``...``.

  >>> import statefulremat as sr
  >>> model = sr.nn.BatchNorm(3, rngs=sr.Rngs(0))
  >>> graphdef, state = sr.split(model)
  >>> graphdef, params, rest = sr.split(model, sr.Param, ...)
  >>> sorted(params.flat()), sorted(rest.flat())
  ([('bias',), ('scale',)], [('mean',), ('var',)])
  >>> sr.merge(graphdef, params, rest).scale.shape
  (3,)
  """
  _check_node(node, "split")
  graphdef, variables = flatten([node])
  return (graphdef, *_states(graphdef, variables, filters))


def merge(graphdef: GraphDef, *states: State) -> Any:
  """Builds a new object graph from a GraphDef and the States ``split`` gave.

  Together the States must hold exactly the GraphDef's variables (by path). Each
  Variable gets the kind and metadata its State entry remembers; entries of a State
  built by hand (``sr.State({"kernel": w})``, which knows no kinds) take the GraphDef's.

  >>> import statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> copy = sr.merge(*sr.split(model))
  >>> copy is model, bool((copy.kernel.value == model.kernel.value).all())
  (False, True)
  """
  if not isinstance(graphdef, GraphDef):
    raise TypeError(
        f"sr.merge takes a GraphDef first (from sr.split), got {type(graphdef).__name__}")
  merged = State.merge(*states)
  spec = merged._spec
  where = {p: i for i, p in enumerate(spec.paths)}
  missing = [p for p in graphdef.var_paths if p not in where]
  if missing:
    raise StateMismatchError(
        f"sr.merge: no value for the variable `{format_path(missing[0])}`"
        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}. Pass every "
        "State that sr.split returned: `sr.merge(graphdef, *states)`."
    )
  extra = set(where) - set(graphdef.var_paths)
  if extra:
    first = sorted(extra, key=str)[0]
    raise StateMismatchError(
        f"sr.merge: the State has an entry `{format_path(first)}` that the GraphDef "
        "has no variable for. The State and GraphDef come from different graphs; split "
        "the model you mean to rebuild."
    )
  order = [where[p] for p in graphdef.var_paths]
  # A plain `()` (not a frozen dict) marks an entry of a hand-built State: it knows
  # neither metadata nor, if its kind is the base Variable, the kind.
  unknown = [type(spec.metas[i]) is tuple for i in order]
  roots, _ = unflatten(
      graphdef, [merged._values[i] for i in order],
      kinds=[None if u and spec.kinds[i] is Variable else spec.kinds[i]
             for u, i in zip(unknown, order)],
      metas=[None if u else spec.metas[i] for u, i in zip(unknown, order)])
  return roots[0]


def state(node, *filters: Filter) -> State | tuple[State, ...]:
  """The State of ``node``: all of it, the entries a filter matches, or a tuple for several.

  >>> import statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> sorted(sr.state(model, sr.Param).flat())
  [('bias',), ('kernel',)]
  """
  _check_node(node, "state")
  graphdef, variables = flatten([node])
  items = list(zip(graphdef.var_paths, variables))
  if not filters:
    return State.from_variables(items)
  whole = State.from_variables(items)
  return whole.filter(*filters)


def graphdef(node) -> GraphDef:
  """The GraphDef of ``node`` (``sr.split(node)[0]``).

  >>> import statefulremat as sr
  >>> sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(0))).var_paths
  (('bias',), ('kernel',))
  """
  _check_node(node, "graphdef")
  return flatten([node])[0]


def update(node, *states: State) -> None:
  """Writes the values of ``states`` into the variables of ``node`` with the same paths.

  Every value must have the structure, shape and dtype of the value it replaces;
  otherwise ``StateMismatchError`` lists the paths that differ and nothing is written
  (to change a variable's shape, assign ``var.value`` directly).

  >>> import jax, statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> sr.update(model, jax.tree.map(lambda x: x * 0, sr.state(model)))
  >>> float(abs(model.kernel.value).sum())
  0.0
  """
  _check_node(node, "update")
  graphdef, variables = flatten([node])
  where = dict(zip(graphdef.var_paths, variables))
  pending = []
  for st in states:
    if not isinstance(st, State):
      raise TypeError(f"sr.update takes States after the module, got {type(st).__name__}")
    for path, value in zip(st._spec.paths, st._values):
      var = where.get(path)
      if var is None:
        raise StateMismatchError(
            f"sr.update: the State has an entry `{format_path(path)}` but the module has "
            "no variable at that path (nothing was written). Update with a State taken "
            "from an equally structured module (`sr.state(model)`)."
        )
      pending.append((path, var, value))
  mismatched = [(path, why) for path, var, value in pending
                if (why := type_change(var._value, value)) is not None]
  if mismatched:
    lines = "".join(f"\n  `{format_path(path)}`: {why}" for path, why in mismatched[:5])
    more = f"\n  ... and {len(mismatched) - 5} more" if len(mismatched) > 5 else ""
    raise StateMismatchError(
        f"sr.update: {len(mismatched)} value(s) do not have the shape and dtype of the "
        f"variable they would replace (nothing was written):{lines}{more}\nA module's "
        "arrays keep their shapes and dtypes: convert the values first (e.g. "
        "`jax.tree.map(lambda x: x.astype(jnp.float32), state)`), or, to change a "
        "variable's shape, assign it directly (`model.w.value = new`).")
  pending = [(var, value) for _, var, value in pending]
  written = []
  try:
    for var, value in pending:
      old = var._value
      var.value = value
      written.append((var, old))
  except BaseException:
    for var, old in reversed(written):
      var._value = old
    raise


def _avals(value) -> tuple:
  leaves, treedef = jax.tree.flatten(value)
  return treedef, [(tuple(np.shape(x)), jax.dtypes.canonicalize_dtype(
      _dtype_of(x), allow_extended_dtype=True)) for x in leaves]


def type_change(old, new) -> str | None:
  """How ``new`` differs from ``old`` in structure, shape or dtype, in words; or None."""
  (old_def, old_avals), (new_def, new_avals) = _avals(old), _avals(new)
  if old_def != new_def:
    return f"structure {old_def} -> {new_def}"
  for (s0, d0), (s1, d1) in zip(old_avals, new_avals):
    if (s0, d0) != (s1, d1):
      return f"{d0}{list(s0)} -> {d1}{list(s1)}"
  return None


def clone(node):
  """A deep copy of the graph: new modules and Variables, same values and sharing.

  >>> import statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> sr.clone(model).kernel is model.kernel
  False
  """
  return merge(*split(node))
