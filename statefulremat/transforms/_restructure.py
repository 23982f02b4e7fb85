"""Structure changes made inside a transform (attributes added or deleted), carried out
to the caller's objects after the call succeeded (transforms/README.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core._bookkeeping import is_bookkeeping
from ..core._caches import structure_epoch
from ..core._graph import GraphDef, GraphNode
from ..core._module import Module, _record_owners, iter_graph
from ..core._stacks import mark
from ..core._state import thaw_metadata
from ..core._tracing import current_trace, structure_changed
from ..core._variables import Variable, bare_variable


class NewStructure:
  """The graph a traced function left behind: ``graphdef`` and, per Variable, the input
  Variable's flat index (``origin``, -1 for a Variable made inside)."""

  __slots__ = ("graphdef", "origin")

  def __init__(self, graphdef: GraphDef, origin: tuple[int, ...]):
    self.graphdef, self.origin = graphdef, origin

  def __eq__(self, other):  # static pytree data: compared by JAX's tree structures
    return isinstance(other, NewStructure) and (
      self.graphdef == other.graphdef and self.origin == other.origin
    )

  def __hash__(self):
    return hash((self.graphdef, self.origin))

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
    """Reshapes the caller's graph (``nodes``, whose Variables are ``variables``) into
    ``graphdef``; the Variables made inside get ``new_values``, marked as stacked at
    ``stacked_axis`` if given. ``keep_metadata``: the input Variables keep theirs."""
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
