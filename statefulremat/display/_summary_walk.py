"""The one walk behind ``sr.summary``: a model described as plain rows.

``describe`` walks the model once, with the core's ``flatten`` (the walk ``sr.split``
and ``sr.state`` make). Its GraphDef records each module and Variable once, at the path
``sr.state`` gives it, and each later arrival as a reference; every other fact the
summary needs is read off the GraphDef and the objects it numbers: which Variables a
module reaches (shared ones included), how many layers each stacked Variable holds (its
layer axes read once, from its metadata), where the GraphDef of the trace and its
values come from. The table, the norms and the output shapes take the
``Description`` and never walk the model again: a summary of a deep model costs one walk,
not one per row or per stack.

Rows follow definition order (a module's attributes as assigned), as the user wrote the
model, while paths are ``sr.state``'s; the GraphDef keeps attributes sorted, so each
module's attribute order is read from the module itself (its ``vars``, not a walk).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..core._graph import GraphDef, GraphNode, flatten
from ..core._kinds import Param
from ..core._stacks import LAYER_AXIS, is_stacked, layer_axis
from ..core._variables import Variable


@dataclasses.dataclass(frozen=True)
class VariableEntry:
  """One Variable: its ``sr.state`` path, the object (the norms read its value), its
  size and bytes, its outermost layer axis (None where it has none) and ``layers``, how
  many layers it holds: the product over the stacks that reach it (None where no stack
  does)."""

  path: tuple
  variable: Variable
  size: int
  nbytes: int
  layer_axis: int | None
  layers: int | None

  @property
  def collection(self) -> str:
    return type(self.variable).collection

  @property
  def is_param(self) -> bool:
    return isinstance(self.variable, Param)


@dataclasses.dataclass(frozen=True)
class ModuleEntry:
  """One module: its ``sr.state`` path and class; ``variables``, the positions in
  ``Description.variables`` of every Variable it reaches, shared ones included (what
  its row counts); for a stack, ``stacked`` lists those with a layer axis in the
  GraphDef's order (the order its per-layer norms add up in)."""

  path: tuple
  cls: type
  is_stack: bool
  variables: tuple[int, ...]
  stacked: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Description:
  """A model as ``sr.summary`` sees it: ``modules`` and ``variables`` once each, depth
  first in definition order at their ``sr.state`` paths; ``graphdef`` and
  ``graph_variables`` (in the GraphDef's order) to rebuild a copy for the trace.

  >>> import statefulremat as sr
  >>> from statefulremat.display._summary_walk import describe
  >>> d = describe(sr.vmap(sr.nn.Linear, axis_size=4)(2, 3, rngs=sr.Rngs(0)))
  >>> [(e.path, e.layers) for e in d.variables], d.modules[0].is_stack
  ([(('kernel',), 4), (('bias',), 4)], True)
  """

  modules: tuple[ModuleEntry, ...]
  variables: tuple[VariableEntry, ...]
  graphdef: GraphDef
  graph_variables: tuple[Variable, ...]


def describe(model) -> Description:
  """``model`` described by one walk (see the module's docstring)."""
  objects: list[Any] = []
  graphdef, graph_variables = flatten([model], objects=objects)
  (root,) = graphdef.nodes
  graph = _Graph(objects, root)
  reach = {i: graph.reach(i) for i in graph.modules}

  # Layers: a stacked Variable reached by a stack holds one copy per layer of every
  # level of its layer axes (a stack in a stack: outer layers x inner layers).
  axes = {i: layer_axis(objects[i]) for i in graph.variables}
  layers: dict[int, int | None] = dict.fromkeys(graph.variables)
  stacked_reach = {j for i in graph.modules if is_stacked(objects[i]) for j in reach[i]}
  for j in stacked_reach:
    if axes.get(j) is not None:
      shape = np.shape(objects[j]._value)
      layers[j] = math.prod(int(shape[a]) for a, _ in objects[j]._metadata[LAYER_AXIS])

  order = graph.definition_order()
  in_order = [i for i in order if i in axes]
  position = {i: n for n, i in enumerate(in_order)}  # object number -> entry number
  variables = tuple(
    VariableEntry(
      graph.paths[i],
      objects[i],
      int(np.size(objects[i]._value)),
      _nbytes(objects[i]._value),
      (axes[i] or (None,))[0],
      layers[i],
    )
    for i in in_order
  )
  modules = tuple(
    ModuleEntry(
      graph.paths[i],
      type(objects[i]),
      is_stacked(objects[i]),
      tuple(sorted(position[j] for j in reach[i] if j in position)),
      tuple(position[j] for j in sorted(reach[i]) if j in position and axes[j] is not None),
    )
    for i in order
    if i in reach
  )
  return Description(modules, variables, graphdef, tuple(graph_variables))


class _Graph:
  """The GraphDef read back onto the objects ``flatten`` numbered: each one's path
  and owning module; each module's last descendant and the references met
  below it."""

  def __init__(self, objects: list, root: GraphNode):
    self.objects = objects
    self.paths: list[tuple] = [()] * len(objects)
    self.owner: list[int | None] = [None] * len(objects)
    self.last: dict[int, int] = {}  # module -> its last descendant, numbered in order
    self.refs: dict[int, list[int]] = {}  # module -> references met directly in it
    self.modules: list[int] = []
    self.variables: list[int] = []
    self._count = 0
    self.read(root, (), None)

  def read(self, node: GraphNode, path: tuple, owner: int | None) -> None:
    if node.kind == "ref":
      if owner is not None:
        self.refs[owner].append(node.value)
    elif node.kind in ("variable", "module"):
      i = self._count
      self._count += 1
      self.paths[i], self.owner[i] = path, owner
      if node.kind == "variable":
        self.variables.append(i)
        return
      self.modules.append(i)
      self.refs[i] = []
      for key, sub in node.items:
        self.read(sub, path + (key,), i)
      self.last[i] = self._count - 1
    else:  # a container's entries belong to the module holding it
      for key, sub in node.items:
        self.read(sub, path + (key,), owner)

  def reach(self, module: int) -> set[int]:
    """Every object ``module`` reaches: its descendants, and through the references
    met below it, the shared objects and what they reach in turn."""
    out: set[int] = set()
    done: set[int] = set()
    todo = [module]
    while todo:
      m = todo.pop()
      if m in done:
        continue
      done.add(m)
      below = range(m, self.last[m] + 1)
      out.update(below)
      for j in below:
        for target in self.refs.get(j, ()):
          out.add(target)
          if target in self.last and target not in done:
            todo.append(target)
    return out

  def definition_order(self) -> list[int]:
    """The objects depth first with each module's attributes in definition order (as
    ``vars`` holds them); items of lists and dicts keep their order, the GraphDef's."""
    rank = {m: {k: n for n, k in enumerate(vars(self.objects[m]))} for m in self.modules}
    key: list[tuple] = [()] * len(self.objects)
    for i in range(1, len(self.objects)):
      m = self.owner[i]
      assert m is not None  # every object but the root has an owner
      key[i] = key[m] + (rank[m][self.paths[i][len(self.paths[m])]], i)
    return sorted(range(len(self.objects)), key=key.__getitem__)


def _nbytes(value) -> int:
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    return int(np.asarray(value).nbytes)
  return int(np.size(value)) * dtype.itemsize
