"""Modules in a traced function's results: how ``sr.jit`` and ``sr.eval_shape`` return
them. Only the values of the Variables made inside leave the trace; the GraphDef leaves
as static aux data, and outside the objects are rebuilt around the caller's own. Structure
changes made inside (attributes added or deleted) are carried out to the caller's objects
after the call succeeded (``NewStructure``; transforms/README.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from ..core._bookkeeping import is_bookkeeping
from ..core._caches import structure_epoch
from ..core._graph import GraphDef, GraphNode, flatten
from ..core._graph_build import unflatten
from ..core._module import Module, _record_owners, iter_graph
from ..core._stacks import mark
from ..core._state import thaw_metadata
from ..core._tracing import current_trace, structure_changed
from ..core._variables import Variable, bare_variable


def is_node(x) -> bool:
  """Whether ``x`` is a module or a Variable: what lifting rebuilds, not a pytree leaf."""
  return isinstance(x, (Module, Variable))


def describe_returned(out) -> str:
  """What a function returned, as a message names it: ``a tuple of length 3``."""
  if isinstance(out, (tuple, list)):
    return f"a {type(out).__name__} of length {len(out)}"
  return "a single array" if isinstance(out, jax.Array) else f"a {type(out).__name__}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True, eq=False)
class ModulesOut:
  """A result holding modules while it crosses the trace boundary (a pytree)."""

  leaves: list
  values: list
  info: tuple = dataclasses.field(metadata={"static": True})

  def rebuild(self, input_nodes: Sequence[Any] = ()) -> Any:
    """The result with its modules, outside the trace (inputs come back as themselves)."""
    graphdef, treedef, positions, n_roots, n_variables = self.info
    objects: list = []
    if n_roots:
      flatten(input_nodes, objects=objects)
    roots, _ = unflatten(graphdef, [None] * n_variables + list(self.values), substitute=objects)
    return merge(treedef, positions, roots[n_roots:], self.leaves)


def merge(treedef, positions: Sequence[int], nodes: Sequence[Any], leaves: Sequence[Any]) -> Any:
  """The pytree ``treedef`` with ``nodes`` at its leaf ``positions``, ``leaves`` elsewhere."""
  at, rest = dict(zip(positions, nodes)), iter(leaves)
  merged = [at[i] if i in at else next(rest) for i in range(len(at) + len(leaves))]
  return jax.tree_util.tree_unflatten(treedef, merged)


def lift_outputs(out: Any, input_roots: Sequence[Any] = (), n_variables: int = 0) -> Any:
  """Inside a trace: ``out``, or a ``ModulesOut`` if it holds a module or Variable."""
  leaves, treedef = jax.tree_util.tree_flatten(out, is_leaf=is_node)
  positions = tuple(i for i, leaf in enumerate(leaves) if is_node(leaf))
  if not positions:
    return out
  nodes = [leaves[i] for i in positions]
  graphdef, variables = flatten(list(input_roots) + nodes)
  values = [v.value for v in variables[n_variables:]]
  others = [leaf for leaf in leaves if not is_node(leaf)]
  info = (graphdef, treedef, positions, len(input_roots), n_variables)
  return ModulesOut(others, values, info)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True, eq=False)
class Restructured:
  """A result whose function changed its modules' structure, crossing the trace boundary."""

  out: Any
  made: list
  structure: Any = dataclasses.field(metadata={"static": True})


@dataclasses.dataclass(frozen=True, slots=True)  # static pytree data: JAX compares it
class NewStructure:
  """The graph a traced function left behind: ``graphdef`` and, per Variable, the input
  Variable's flat index (``origin``, -1 for a Variable made inside)."""

  graphdef: GraphDef
  origin: tuple[int, ...]

  def apply(
    self,
    nodes: Sequence[Any],
    variables: Sequence[Variable],
    new_values: Sequence[Any],
    *,
    stacked_axis: int | None = None,
    partition_name: str | None = None,
    keep_metadata: bool = False,
  ) -> None:
    """Reshapes the caller's graph (``nodes``, ``variables``) into ``graphdef``; the Variables
    made inside get ``new_values``. ``keep_metadata``: the input Variables keep theirs."""
    at_path = _objects_by_path(nodes)
    fresh = iter(new_values)
    trace = current_trace()
    objects: list = []
    origin = iter(self.origin)

    def build(node: GraphNode, path):
      kind, cls = node.kind, node.type
      if kind == "ref":
        return objects[node.value]
      if kind == "variable":
        j, meta = next(origin), thaw_metadata(node.value)
        if j >= 0:
          var = variables[j]
          if not keep_metadata and meta != var._metadata:
            var._metadata = meta
        else:
          if stacked_axis is not None:
            meta = mark(meta, stacked_axis, partition_name)
          var = bare_variable(cls, next(fresh), meta, trace)
        objects.append(var)
        return var
      if kind == "module":
        old = at_path.get(path)
        reuse = isinstance(old, cls) and not any(o is old for o in objects)
        module = old if reuse else object.__new__(cls)
        objects.append(module)
        attrs = {k: build(sub, path + (k,)) for k, sub in node.items}
        if reuse:
          assert module is not None  # reuse: isinstance(old, cls) held
          _update_attributes(module, attrs)
        else:
          for k, v in attrs.items():
            _record_owners(module, v, (k,))
          module.__dict__.update(attrs)
        return module
      if kind == "list":
        return cls(build(x, path + (i,)) for i, x in node.items)
      if kind == "tuple":
        items = [build(x, path + (i,)) for i, x in node.items]
        return cls._make(items) if hasattr(cls, "_fields") else cls(items)
      if kind == "dict":
        return cls((k, build(v, path + (k,))) for k, v in node.items)
      return node.value

    multi = len(self.graphdef.nodes) > 1
    for i, root in enumerate(self.graphdef.nodes):
      build(root, (i,) if multi else ())
    structure_epoch.value += 1  # Variables' metadata may have changed too


def _update_attributes(module: Module, attrs: dict) -> None:
  """Gives ``module`` exactly ``attrs`` (besides the library's notes, ``_bookkeeping``)."""
  current = vars(module)
  for k in [k for k in current if not is_bookkeeping(k) and k not in attrs]:
    object.__delattr__(module, k)
  for k, v in attrs.items():
    if k in current and _same(current[k], v):
      continue
    _record_owners(module, v, (k,))
    object.__setattr__(module, k, v)
  structure_changed(module)


def _same(a, b) -> bool:
  if isinstance(a, (Module, Variable)) or isinstance(b, (Module, Variable)):
    return a is b
  if isinstance(a, (list, tuple, dict)) or isinstance(b, (list, tuple, dict)):
    return False  # rebuilt: its items may be new objects
  return type(a) is type(b) and a == b


def _objects_by_path(nodes: Sequence[Any]) -> dict[tuple, Any]:
  """Each module of the caller's graph by its first path, as ``flatten`` walks it."""
  root = nodes[0] if len(nodes) == 1 else list(nodes)
  return {path: obj for path, obj in iter_graph(root) if isinstance(obj, Module)}
