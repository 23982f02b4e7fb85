"""Lifting: how every transform moves modules through a pure JAX function (the
kernel; transforms/README.md describes it)."""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp

from ..core._caches import lifted_steps, plain_leaf_types, structure_epoch
from ..core._errors import GraphError, TraceContextError, TransformError
from ..core._graph import GraphDef, flatten
from ..core._graph_build import unflatten
from ..core._graph_cache import Stamp
from ..core._graph_diff import describe_change
from ..core._graph_lock import Reached, holding, let_go, locked
from ..core._module import Module
from ..core._split_merge import deleted_error
from ..core._stacks import is_stacked
from ..core._tracing import contains_tracer as _contains_tracer
from ..core._tracing import current_trace, tracing_user_code
from ..core._variables import Variable
from ._outputs import NewStructure, Restructured, is_node, lift_outputs, merge


class Roots(list):
  """The objects ``Lifted.rebuild`` made, their Variables and the structure epoch then:
  while it stands, ``collect`` reads the Variables without walking the graph."""

  __slots__ = ("variables", "epoch")

  def __init__(self, roots, variables):
    super().__init__(roots)
    self.variables, self.epoch = variables, structure_epoch.value


@dataclasses.dataclass(slots=True)
class Changes:
  """What a lifted call did to its modules: ``values`` ``{flat index: new value}``, ``made``
  (new Variables' values), ``structure``, ``roots``, ``isolated`` (each unit's writes)."""

  values: dict
  made: list
  structure: NewStructure | None
  roots: Roots
  isolated: list[dict] = dataclasses.field(default_factory=list)


class Lifted:
  """The static description of one call's arguments (hashable: a jit cache key)."""

  __slots__ = ("graphdef", "treedef", "node_positions", "_hash", "__weakref__")

  def __init__(self, graphdef: GraphDef, treedef, node_positions: tuple):
    self.graphdef, self.treedef, self.node_positions = graphdef, treedef, node_positions
    self._hash = hash((graphdef, treedef, node_positions))

  def __eq__(self, other):
    return self is other or (
      isinstance(other, Lifted)
      and self._hash == other._hash
      and (self.graphdef, self.treedef, self.node_positions)
      == (other.graphdef, other.treedef, other.node_positions)
    )

  def __hash__(self):
    return self._hash

  def rebuild(self, values: Sequence[Any], leaves: Sequence[Any]):
    """Inside a trace: fresh objects holding ``values``, as ``(tree, variables, roots)``."""
    built, variables = unflatten(self.graphdef, values)
    roots = Roots(built, variables)
    # Positions need not be ascending: sr.grad puts the differentiated modules first.
    return merge(self.treedef, self.node_positions, roots, leaves), variables, roots

  def run(
    self,
    fn: Callable,
    values: list,
    leaves: Sequence[Any],
    what: str,
    *,
    seed: tuple | None = None,
    units: Sequence[int] | None = None,
    isolate: Sequence[int] = (),
    restructure: bool = False,
    outputs: bool = False,
    copies: bool = False,
  ) -> tuple[Any, Changes]:
    """Inside a trace: ``fn(*args, **kwargs)`` on fresh objects holding ``values``; returns
    ``(out, Changes)``. ``seed=(treatment, index)``: seed the RNG streams as iteration ``index``.
    ``units``: run ``fn(k, *args, **kwargs)`` for each position ``k`` of one cycle on the one
    rebuild, each seeded as iteration ``index + k``; ``out`` is then a list by position.
    ``isolate``: Variables each unit sees unchanged, their writes returned per unit (a vmap's
    members run side by side). ``restructure``: carry changes of structure out, else raise.
    ``outputs``: modules in ``out`` leave as a ``ModulesOut``; ``copies``: all as new objects."""
    before = None if units is None else list(values)  # the keys the units fold from
    if seed is not None:
      treatment, index = seed
      if units and index is not None:  # the first unit run (the last, in reverse)
        index = index + jnp.uint32(units[0])
      served = treatment.seed_layer(values, values, index)
    with tracing_user_code(what):
      (args, kwargs), variables, roots = self.rebuild(values, leaves)
      if seed is not None:
        treatment.serve_names(served, variables)
      if units is None:
        out, isolated = fn(*args, **kwargs), []
      else:
        out, isolated = _run_units(
          fn, args, kwargs, variables, values, before, seed, units, isolate
        )
      changes = self.collect(roots, values, what, restructure)
      changes.isolated = isolated
      if copies:
        out = lift_outputs(out)
      elif outputs:  # read inside the guard: a module reached by closure raises
        known = len(values) if changes.structure is None else len(changes.structure.origin)
        lift_out = functools.partial(lift_outputs, input_roots=roots, n_variables=known)
        out = lift_out(out) if units is None else [lift_out(o) for o in out]
    return out, changes

  def collect(self, roots, values, what: str, restructure: bool = False) -> Changes:
    """What the function did to ``roots``; a changed structure raises unless ``restructure``."""
    if roots.epoch == structure_epoch.value:  # no structure changed anywhere since
      return Changes(_written(roots.variables, values), [], None, roots)
    graphdef, variables = flatten(roots)
    if graphdef == self.graphdef:
      return Changes(_written(variables, values), [], None, roots)
    if not restructure:
      raise GraphError(
        f"{what}: the function changed the structure of its modules "
        f"({describe_change(self.graphdef, graphdef)}). Changes to structure (new "
        "or removed sub-modules and Variables, new static attribute values such as "
        "`.deterministic`) cannot be carried out of a transform. Create sub-modules "
        "and Variables in `__init__` (e.g. `self.h = sr.Intermediate(jnp.zeros(...))`)"
        ", and change static attributes outside the transformed function "
        "(`model.eval()` before calling it)."
      )
    index = {id(v): i for i, v in enumerate(roots.variables)}
    origin = tuple(index.get(id(v), -1) for v in variables)
    made = [v._value for v, j in zip(variables, origin) if j < 0]
    changed = {
      j: v._value for v, j in zip(variables, origin) if j >= 0 and v._value is not values[j]
    }
    return Changes(changed, made, NewStructure(graphdef, origin), roots)


def _written(variables, values) -> dict[int, Any]:
  """``{index: new value}`` of each Variable whose value is no longer ``values[index]``."""
  return {i: v._value for i, (v, old) in enumerate(zip(variables, values)) if v._value is not old}


def _run_units(fn, args, kwargs, variables, values, before, seed, order, isolate):
  """The units of one cycle on one rebuild (``Lifted.run`` with ``units``)."""
  treatment, first = seed
  streams = treatment.streams
  counts = [values[s.count] for s in streams]
  drew = [False] * len(streams)
  outs: list = [None] * (max(order, default=-1) + 1)
  isolated = []
  for n, k in enumerate(order):
    if n:
      counts = treatment.reseed(variables, before, None if first is None else first + jnp.uint32(k))
    outs[k] = fn(k, *args, **kwargs)
    for j, s in enumerate(streams):
      drew[j] = drew[j] or variables[s.count]._value is not counts[j]
    if isolate:
      isolated.append(
        {i: variables[i]._value for i in isolate if variables[i]._value is not values[i]}
      )
      for i in isolate:
        variables[i]._value = values[i]
  # What the read-back compares against: the first unit's keys, and a count that
  # changed exactly when some unit drew.
  for j, s in enumerate(streams):
    variables[s.key]._value = values[s.key]
    variables[s.count]._value = advance(values[s.count]) if drew[j] else values[s.count]
  return outs, isolated


def _learn_plain(value) -> None:
  if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
    plain_leaf_types.add(type(value))


_NODE_TYPES = (Module, Variable)


def split_call(args: tuple, kwargs: dict):
  """Splits ``(args, kwargs)``: (nodes, other leaves, treedef, node positions)."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
  nodes, others, positions = [], [], []
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, _NODE_TYPES):
      nodes.append(leaf)
      positions.append(i)
    else:
      others.append(leaf)
      if type(leaf) not in plain_leaf_types:
        _learn_plain(leaf)
  return nodes, others, treedef, tuple(positions)


def lift(args: tuple, kwargs: dict) -> tuple[Lifted, list[Variable], list[Any], list[Any]]:
  """A call's arguments split for tracing: ``(lifted, variables, leaves, nodes)``."""
  nodes, leaves, treedef, positions = split_call(args, kwargs)
  graphdef, variables = flatten(nodes)
  return Lifted(graphdef, treedef, positions), variables, leaves, nodes


def _split_flat(args: tuple):
  """``split_call(args, {})`` when every argument is a node or a known leaf, else None."""
  nodes, leaves, positions = [], [], []
  for i, a in enumerate(args):
    if type(a) in plain_leaf_types:
      leaves.append(a)
    elif isinstance(a, _NODE_TYPES):
      nodes.append(a)
      positions.append(i)
    else:
      return None
  return nodes, leaves, tuple(positions)


class FlattenCache:
  """Per-transform cache of graph walks, each valid while its ``Stamp`` holds."""

  def __init__(self, size: int = 16):
    self._entries: OrderedDict = OrderedDict()
    self._size = size
    self._flat_treedefs: dict[int, Any] = {}  # len(args) -> treedef of ((*,) * n, {})
    # The last flat call: (stamp, per argument its node or None, lifted, variables).
    self._last: tuple | None = None

  def lift(self, nodes, treedef, positions) -> tuple:
    """The entry of these nodes: ``(lifted, variables, nodes, stamp)``."""
    # `positions` belong in the key: f(model, x) and f(x, model) share treedef and ids.
    key = (treedef, positions, tuple(map(id, nodes)))
    hit = self._entries.get(key)
    if hit is not None and hit[3].holds():
      return hit
    stamp = Stamp(walked=True)
    graphdef, variables = flatten(nodes, stamp=stamp)
    variables = Reached(variables)  # keeps the graph's lock group with the entry
    # Equal Lifted objects are made one, so a cache keyed on them finds its entry by
    # identity instead of comparing two equal GraphDefs in Python.
    lifted = Lifted(graphdef, treedef, positions)
    lifted = lifted_steps.setdefault(lifted, lifted)
    # Holding `nodes` keeps their ids from being reused while the entry lives.
    entry = self._entries[key] = (lifted, variables, nodes, stamp)
    self._entries.move_to_end(key)
    if len(self._entries) > self._size:
      self._entries.popitem(last=False)
    return entry

  def lift_call(self, args: tuple, kwargs: dict) -> tuple[Lifted, list[Variable], list[Any]]:
    """``(lifted, variables, other leaves)`` of a call's arguments. A flat call (nodes and
    plain leaves, no keywords) skips ``tree_flatten``; a repeat of the last is found by id."""
    last = self._last
    if (
      not kwargs
      and last is not None
      and len(args) == len(last[1])
      and (last[0].epoch == structure_epoch.value or last[0].holds())
    ):
      leaves = []
      for a, node in zip(args, last[1]):
        if node is None:
          if type(a) not in plain_leaf_types:
            break
          leaves.append(a)
        elif a is not node:
          break
      else:
        return last[2], last[3], leaves
    split = None if kwargs else _split_flat(args)
    if split is None:
      nodes, leaves, treedef, positions = split_call(args, kwargs)
      lifted, variables = self.lift(nodes, treedef, positions)[:2]
      return lifted, variables, leaves
    nodes, leaves, positions = split
    treedef = self._flat_treedefs.get(len(args))
    if treedef is None:
      treedef = jax.tree_util.tree_structure(((0,) * len(args), {}))
      self._flat_treedefs[len(args)] = treedef
    lifted, variables, _, stamp = self.lift(nodes, treedef, positions)
    at = dict(zip(positions, nodes))
    self._last = (stamp, tuple(at.get(i) for i in range(len(args))), lifted, variables)
    return lifted, variables, leaves


def check_no_nodes(out, what: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(out, is_leaf=is_node):
    if is_node(leaf):
      kind = "a Variable" if isinstance(leaf, Variable) else "a module"
      raise GraphError(
        f"{what}: the function returned {kind} ({type(leaf).__name__}) at output "
        f"`{jax.tree_util.keystr(path)}`. Modules passed in are updated in place; "
        "return arrays (for a Variable, its `.value`)."
      )


def advance(count, draws: int | jax.Array = 1):
  """An RNG stream's count moved on by ``draws`` (one per call, or per microbatch)."""
  return count + jnp.asarray(draws, jnp.result_type(count))


def commit(
  variables: Sequence[Variable],
  changed: dict[int, Any],
  what: str,
  out: Any = None,
  *,
  nodes: Sequence[Any] = (),
  streams: Any = (),
  draws: int = 1,
  **placement: Any,
) -> Any:
  """The one write of a transform's result into the caller's objects: ``changed`` values,
  ``streams`` advanced, a ``Restructured`` result's structure of ``nodes``; nothing at all
  when a value is a tracer of a trace that does not own its Variable. Returns the result."""
  if streams:
    changed = {**changed, **{i: advance(variables[i]._value, draws) for i in streams}}
  if not plain_leaf_types.issuperset(map(type, changed.values())):
    trace = None
    for i, value in changed.items():
      if not _contains_tracer(value):
        _learn_plain(value)
        continue
      var = variables[i]
      trace = current_trace() if trace is None else trace
      if var._trace != trace:
        raise TraceContextError(
          f"{what} ran inside a JAX transform (e.g. a plain `jax.jit`, `jax.vmap` or "
          f"`jax.grad` whose function closes over the module) that does not own "
          f"`{var.path_str()}` ({type(var).__name__}): its new value is a tracer of that "
          "transform and would leak out of it, so nothing was written. Fix: pass the "
          "module as an argument to the outer transform, using `sr.jit` / `sr.grad` / "
          "`sr.vmap` (or sr.scan/sr.remat) instead of closing over it."
        )
  for i, value in changed.items():
    variables[i]._value = value
  if type(out) is not Restructured:
    return out
  out.structure.apply(nodes, variables, out.made, **placement)
  return out.out


def serialised(wrapper: Callable) -> Callable:
  """``wrapper`` run under ``held`` on its arguments' Variables (``sr.jit`` locks itself)."""
  cache = FlattenCache()

  @functools.wraps(wrapper)
  def call(*args, **kwargs):
    if holding():  # nested: the outer call holds the lock
      return wrapper(*args, **kwargs)
    try:
      variables = cache.lift_call(args, kwargs)[1]
    except TypeError:  # not a module graph: the transform says what is wrong
      return wrapper(*args, **kwargs)
    with held(variables):
      return wrapper(*args, **kwargs)

  return call


class held(locked):
  """``with held(variables):`` ``locked``, and on failure a deleted array named by its Variable."""

  __slots__ = ()

  def __exit__(self, kind, error, traceback):
    try:
      if kind is not None and issubclass(kind, RuntimeError):
        raise_if_deleted(self.variables)
    finally:
      let_go(self.group)
    return False


def raise_if_deleted(variables: Sequence[Variable]) -> None:
  """After a call failed: raises naming the Variable that holds a deleted array, if any."""
  error = deleted_error(variables, "", TransformError)
  if error is not None:
    raise error from None


def refuse_layer_list(module, what: str, call: str) -> None:
  """Raises if argument 0 is a list (or tuple) of unstacked modules of one class."""
  if not isinstance(module, (list, tuple)) or len({type(m) for m in module}) != 1:
    return
  if len(module) < 2 or not isinstance(module[0], Module) or any(map(is_stacked, module)):
    return
  n, cls, kind = len(module), type(module[0]).__name__, type(module).__name__
  raise TransformError(
    f"{what}: argument 0 is a {kind} of {n} {cls} modules, but "
    f"{what.partition('(')[0]} runs over one stacked module (each Variable with a "
    "layer axis in front) and calls the function with one layer at a time; a Python "
    f"{kind} of layers is not stacked. Fix: stack them first, `stack = "
    f"sr.stack(layers, like=sr.vmap({cls}, axis_size={n}))` (`like=` names the "
    "stacked class; layers that came out of `sr.unstack` need none), or build the "
    f"stack at once with a class form, e.g. `sr.vmap({cls}, axis_size={n})(..., "
    f"rngs=sr.Rngs(0))`; then pass the stack: `{call}`."
  )
