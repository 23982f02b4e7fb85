"""``split`` / ``merge`` / ``state`` / ``graphdef`` / ``update`` / ``clone`` / ``pop``
/ ``iter_graph``: the public face of the graph walk (``_graph``). ``split`` flattens a
graph and partitions its Variables into States by filter; ``merge`` unflattens a
GraphDef with States into fresh objects; ``update`` writes values into an existing
graph by path, all or nothing; ``clone`` copies a graph, buffers included; ``pop``
takes Variables out of a graph (nnx's, for sown intermediates); ``iter_graph`` lists
every node and leaf as flax.nnx's does.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

import jax
import jax.core
import numpy as np

from ._errors import GraphError, StateMismatchError, TransformError, format_path
from ._filters import Filter, filter_repr
from ._graph import GraphDef, flatten
from ._graph_build import unflatten
from ._graph_lock import locked
from ._module import Module, arrivals
from ._state import State, partition
from ._variables import Variable, _dtype_of

T = TypeVar("T")


def _flatten(node, fn: str) -> tuple[GraphDef, list[Variable]]:
  """The GraphDef and Variables of ``node``, the graph that ``sr.<fn>`` was given."""
  if not isinstance(node, (Module, Variable, list, tuple, dict)):
    raise TypeError(
      f"sr.{fn} takes a Module (or a list/tuple/dict of them), got {type(node).__name__}."
    )
  return flatten([node])


# The overloads give `sr.split`, `sr.state` and `sr.pop` the shape of what they return
# for the number of filters passed, so `graphdef, params, rest = sr.split(m, sr.Param, ...)`
# and `sr.state(m, sr.Param).flat()` type-check in user code.
@overload
def split(node: Any, /) -> tuple[GraphDef, State]: ...
@overload
def split(node: Any, filter: Filter, /) -> tuple[GraphDef, State]: ...
@overload
def split(node: Any, f1: Filter, f2: Filter, /) -> tuple[GraphDef, State, State]: ...
@overload
def split(
  node: Any, f1: Filter, f2: Filter, f3: Filter, /
) -> tuple[GraphDef, State, State, State]: ...
@overload
def split(
  node: Any, f1: Filter, f2: Filter, f3: Filter, f4: Filter, /, *filters: Filter
) -> tuple[GraphDef, *tuple[State, ...]]: ...
def split(node: Any, *filters: Filter) -> tuple[GraphDef, *tuple[State, ...]]:
  """Splits a graph into its GraphDef and one State per filter.

  Each variable lands in the State of the first filter that matches it; a variable
  matched by none is an error unless the last filter is ``...``.

  Args:
    node: a Module, a Variable, or a list/tuple/dict of them.
    *filters: the filters (``sr.Param``, ``"batch_stats"``, ``...`` for the rest, a
      predicate, ...), one State each; none gives one State of everything.

  Returns:
    A tuple: the GraphDef, then one State per filter in order (a single State of
    every variable without filters).

  Raises:
    TypeError: ``node`` is not a module or container of them, or a filter is not a
      filter.
    sr.StateMismatchError: a variable matches none of the filters.
    sr.GraphError: an attribute holds an array outside a Variable, or another value
      that cannot be static (not hashable).

  >>> import statefulremat as sr
  >>> model = sr.nn.BatchNorm(3, rngs=sr.Rngs(0))
  >>> graphdef, state = sr.split(model)
  >>> graphdef, params, rest = sr.split(model, sr.Param, ...)
  >>> sorted(params.flat()), sorted(rest.flat())
  ([('bias',), ('scale',)], [('mean',), ('var',)])
  >>> sr.merge(graphdef, params, rest).scale.shape
  (3,)
  """
  graphdef, variables = _flatten(node, "split")
  items = list(zip(graphdef.var_paths, variables))
  groups = partition(items, filters)
  return (graphdef, *(State.from_variables(items[i] for i in group) for group in groups))


def merge(graphdef: GraphDef, *states: State) -> Any:
  """Builds a new object graph from a GraphDef and the States ``split`` gave.

  Together the States must hold exactly the GraphDef's variables (by path). Each
  Variable gets the kind and metadata its State entry remembers; entries of a State
  built by hand (``sr.State({"kernel": w})``, which knows no kinds) take the GraphDef's.

  Args:
    graphdef: the structure, as ``sr.split`` or ``sr.graphdef`` gave it.
    *states: the States holding the values; on a path held by several, the last wins.

  Returns:
    A new object graph (the Module, or the list/tuple/dict ``split`` was given), sharing
    nothing with the graph it was split from.

  Raises:
    TypeError: ``graphdef`` is not a GraphDef, or one of ``states`` is not a State.
    sr.StateMismatchError: the States lack a value for one of the GraphDef's variables,
      or hold a path it has no variable for.

  >>> import statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> copy = sr.merge(*sr.split(model))
  >>> copy is model, bool((copy.kernel.value == model.kernel.value).all())
  (False, True)
  """
  if not isinstance(graphdef, GraphDef):
    raise TypeError(
      f"sr.merge takes a GraphDef first (from sr.split), got {type(graphdef).__name__}"
    )
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
    first = min(extra, key=str)
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
    graphdef,
    [merged._values[i] for i in order],
    kinds=[
      None if u and spec.kinds[i] is Variable else spec.kinds[i] for u, i in zip(unknown, order)
    ],
    metas=[None if u else spec.metas[i] for u, i in zip(unknown, order)],
  )
  return roots[0]


@overload
def state(node: Any, /) -> State: ...
@overload
def state(node: Any, filter: Filter, /) -> State: ...
@overload
def state(node: Any, f1: Filter, f2: Filter, /, *filters: Filter) -> tuple[State, ...]: ...
def state(node: Any, *filters: Filter) -> State | tuple[State, ...]:
  """The State of ``node``: all of it, the entries a filter matches, or a tuple for several.

  Args:
    node: a Module, a Variable, or a list/tuple/dict of them.
    *filters: which variables to take (``sr.Param``, ``"batch_stats"``, a predicate,
      ...); a variable may match several. Without filters, all of them.

  Returns:
    One State (of everything, or of what the one filter matches), or a tuple of one
    State per filter for several.

  Raises:
    TypeError: ``node`` is not a module or container of them, or a filter is not a
      filter.
    sr.GraphError: an attribute holds an array outside a Variable, or another value
      that cannot be static (not hashable).

  >>> import statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> sorted(sr.state(model, sr.Param).flat())
  [('bias',), ('kernel',)]
  """
  graphdef, variables = _flatten(node, "state")
  whole = State.from_variables(zip(graphdef.var_paths, variables))
  return whole.filter(*filters) if filters else whole


def graphdef(node: Any) -> GraphDef:
  """The GraphDef of ``node`` (``sr.split(node)[0]``).

  Args:
    node: a Module, a Variable, or a list/tuple/dict of them.

  Returns:
    The GraphDef: the structure of ``node``, everything but the values.

  Raises:
    TypeError: ``node`` is not a module or container of them.
    sr.GraphError: an attribute holds an array outside a Variable, or another value
      that cannot be static (not hashable).

  >>> import statefulremat as sr
  >>> sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(0))).var_paths
  (('bias',), ('kernel',))
  """
  return _flatten(node, "graphdef")[0]


def update(node: Any, *states: State) -> None:
  """Writes the values of ``states`` into the variables of ``node`` with the same paths.

  Every value must have the structure, shape and dtype of the value it replaces;
  otherwise ``StateMismatchError`` lists the paths that differ and nothing is written
  (to change a variable's shape, assign ``var.value`` directly).

  Args:
    node: the Module (or list/tuple/dict of them) to write into, in place.
    *states: States keyed by paths of ``node`` (all of its variables, or some); on a
      path several hold, the last wins.

  Raises:
    TypeError: ``node`` is not a module or container of them, or one of ``states``
      is not a State.
    sr.StateMismatchError: a State has a path ``node`` has no variable at, or a value
      whose structure, shape or dtype differs from the one it would replace.

  >>> import jax, statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> sr.update(model, jax.tree.map(lambda x: x * 0, sr.state(model)))
  >>> float(abs(model.kernel.value).sum())
  0.0
  """
  graphdef, variables = _flatten(node, "update")
  with locked(variables):  # another thread's step on this graph writes before or after
    _write(dict(zip(graphdef.var_paths, variables)), states)


def _write(where: dict[tuple, Variable], states) -> None:
  """``update``'s work: checks every value of ``states``, then writes them all."""
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
  mismatched = [
    (path, why)
    for path, var, value in pending
    if (why := type_change(var._value, value)) is not None
  ]
  if mismatched:
    lines = "".join(f"\n  `{format_path(path)}`: {why}" for path, why in mismatched[:5])
    more = f"\n  ... and {len(mismatched) - 5} more" if len(mismatched) > 5 else ""
    raise StateMismatchError(
      f"sr.update: {len(mismatched)} value(s) do not have the shape and dtype of the "
      f"variable they would replace (nothing was written):{lines}{more}\nA module's "
      "arrays keep their shapes and dtypes: convert the values first (e.g. "
      "`jax.tree.map(lambda x: x.astype(jnp.float32), state)`), or, to change a "
      "variable's shape, assign it directly (`model.w.value = new`)."
    )
  olds = [var._value for _, var, _ in pending]
  try:
    for _, var, value in pending:
      var.value = value
  except BaseException:
    for (_, var, _), old in zip(pending, olds):
      var._value = old
    raise


def _aval(x) -> tuple:
  return tuple(np.shape(x)), jax.dtypes.canonicalize_dtype(_dtype_of(x), allow_extended_dtype=True)


def type_change(old, new) -> str | None:
  """How ``new`` differs from ``old`` in structure, shape or dtype, in words; or None."""
  (old_leaves, old_def), (new_leaves, new_def) = jax.tree.flatten(old), jax.tree.flatten(new)
  if old_def != new_def:
    return f"structure {old_def} -> {new_def}"
  for (s0, d0), (s1, d1) in zip(map(_aval, old_leaves), map(_aval, new_leaves)):
    if (s0, d0) != (s1, d1):
      return f"{d0}{list(s0)} -> {d1}{list(s1)}"
  return None


def clone(node: T) -> T:
  """A deep copy of the graph: new modules and Variables holding copies of the values.

  Shared modules and Variables stay shared within the copy. JAX arrays (typed PRNG
  keys included) are copied into new buffers with the same sharding and numpy arrays
  are copied, so nothing done to the original's buffers reaches the copy: a
  ``best = sr.clone(model)`` taken before ``sr.jit(step, donate_state=True)`` steps
  the model stays intact. Python numbers are kept as they are.

  Args:
    node: a Module, a Variable, or a list/tuple/dict of them.

  Returns:
    The copy, of the same type as ``node``.

  Raises:
    TypeError: ``node`` is not a module or container of them.
    sr.TransformError: a Variable holds an array that was deleted (donated to a
      ``donate_state=True`` step, or freed).

  >>> import statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> copy = sr.clone(model)
  >>> copy.kernel is model.kernel, copy.kernel.value is model.kernel.value
  (False, False)
  >>> bool((copy.kernel.value == model.kernel.value).all())
  True
  """
  graphdef, variables = _flatten(node, "clone")
  try:
    with locked(variables):  # the values of one step, not half of another thread's
      values = _copies([var._value for var in variables])
  except RuntimeError:
    error = deleted_error(variables, "sr.clone: ", TransformError)
    if error is None:
      raise
    raise error from None
  return unflatten(graphdef, values)[0][0]


def _copies(values: list) -> list:
  """``values`` with each JAX and numpy array copied; JAX's in one batched call."""
  leaves, treedef = jax.tree.flatten(values)
  at = [i for i, x in enumerate(leaves) if _concrete_array(x)]
  # may_alias=False makes device_put copy even where the placement is unchanged.
  copied = jax.device_put([leaves[i] for i in at], may_alias=False) if at else []
  leaves = [np.copy(x) if isinstance(x, np.ndarray) else x for x in leaves]
  for i, x in zip(at, copied):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _concrete_array(x) -> bool:
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def deleted_error(variables, what: str, kind: type, after: str = "") -> Exception | None:
  """The error naming the Variable that holds a deleted (donated or freed) array, or
  None if none does. Asked after JAX refused an array, not on every call."""
  found = []
  for var in variables:
    leaves = [x for x in jax.tree.leaves(var._value) if _concrete_array(x) and x.is_deleted()]
    if leaves:
      found.append((var, leaves[0]))
  if not found:
    return None
  var, leaf = found[0]
  more = f" (and {len(found) - 1} more Variable(s))" if len(found) > 1 else ""
  spec = f"{leaf.dtype}[{','.join(map(str, leaf.shape))}]"
  return kind(
    f"{what}`{var.path_str()}` ({type(var).__name__}, {spec}){more} holds an array "
    "that has been deleted, so it cannot be read: its buffer was donated to an "
    "earlier computation (`sr.jit(..., donate_state=True)`, or `jax.jit(..., "
    "donate_argnums=...)` given the model's State) or freed with "
    f"`.delete()`.{after} Fix: use the model that donating call "
    "updated (sr.jit writes the new values into the model passed to it; after a "
    "plain jax.jit, `sr.update(model, new_state)` with the State it returned). To "
    "keep a copy that outlives donation (e.g. the best model so far), take "
    "`sr.clone(model)` before the donating call: it copies the buffers."
  )


@overload
def pop(node: Any, filter: Filter, /) -> State: ...
@overload
def pop(node: Any, f1: Filter, f2: Filter, /, *filters: Filter) -> tuple[State, ...]: ...
def pop(node: Any, *filters: Filter) -> State | tuple[State, ...]:
  """Takes the Variables that ``filters`` match out of ``node`` and returns their State,
  as flax.nnx's ``pop``: one State per filter (a tuple for several), each Variable in
  the first that matches.

  The usual use is collecting what ``Module.sow`` kept: after a call,
  ``sr.pop(model, sr.Intermediate)`` returns the sown values and deletes the
  attributes that held them, so the next call sows afresh and the model's structure is
  what it was before. A filter that matches nothing gives an empty State (nothing was
  sown). A Variable held at several paths is removed from all of them. The Variables
  must be held by module attributes or dicts: one inside a list or tuple cannot be
  removed without renumbering its neighbours, so that is an error, and nothing is
  removed.

  Args:
    node: the Module (or list/tuple/dict of them) to take the Variables out of.
    *filters: what to take out (``sr.Intermediate``, ``"intermediates"``, ...); at
      least one.

  Returns:
    The State of the Variables taken out: one for one filter, or a tuple of one per
    filter.

  Raises:
    TypeError: no filter is given, ``node`` is not a module or container of them, or
      a filter is not a filter.
    sr.GraphError: ``node`` is itself a Variable a filter matches, or a matched
      Variable sits in a list or tuple.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> class Net(sr.Module):
  ...   def __init__(self):
  ...     self.linear = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  ...   def __call__(self, x):
  ...     h = self.linear(x)
  ...     self.sow(sr.Intermediate, "hidden", h)
  ...     return h.sum()
  >>> net = Net()
  >>> _ = net(jnp.ones((1, 2)))
  >>> intermediates = sr.pop(net, sr.Intermediate)
  >>> intermediates["hidden"][0].shape, hasattr(net, "hidden")
  ((1, 3), False)
  >>> len(sr.pop(net, sr.Intermediate))  # nothing left
  0
  """
  if not filters:
    raise TypeError(
      "sr.pop takes at least one filter: what to take out, e.g. `sr.pop(model, sr.Intermediate)`."
    )
  graphdef, variables = _flatten(node, "pop")
  items = list(zip(graphdef.var_paths, variables))
  *groups, _ = partition(items, (*filters, ...))  # each in the first filter matching it
  states = [State.from_variables(items[i] for i in group) for group in groups]
  popped = {id(items[i][1]) for group in groups for i in group}
  holders = []
  for path, obj, _ in arrivals(node):
    if id(obj) not in popped or not isinstance(obj, Variable):
      continue
    if not path:
      raise GraphError(
        f"sr.pop: the node given is itself a {type(obj).__name__} matched by "
        f"{filter_repr(filters[0]) if len(filters) == 1 else 'the filters'}, and "
        "cannot be taken out of itself (nothing was removed). Pass the module "
        "holding it."
      )
    parent = node_at(node, path[:-1])
    if not isinstance(parent, (Module, dict)):
      raise GraphError(
        f"sr.pop: `{format_path(path)}` ({type(obj).__name__}) sits in a "
        f"{type(parent).__name__}, and taking it out would renumber the items after "
        "it (nothing was removed). Fix: keep such Variables as module attributes or "
        "in a dict, or pop with a filter that leaves them, e.g. "
        f"`sr.All(filter, sr.Not(sr.PathContains({path[-2]!r})))`."
      )
    holders.append((parent, path[-1]))
  for parent, key in holders:
    if isinstance(parent, Module):
      delattr(parent, key)
    else:
      del parent[key]
  return states[0] if len(states) == 1 else tuple(states)


def node_at(root, path: tuple):
  """What ``root`` holds at ``path`` (attribute names, list indices, dict keys)."""
  for key in path:
    root = vars(root)[key] if isinstance(root, Module) else root[key]
  return root
