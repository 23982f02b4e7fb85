"""Modules in a traced function's results: how ``sr.jit`` and ``sr.eval_shape`` return
them. Only the values of the Variables made inside leave the trace; the GraphDef leaves
as static aux data, and outside the objects are rebuilt around the caller's own."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from ..core._graph import flatten
from ..core._graph_build import unflatten
from ..core._module import Module
from ..core._variables import Variable


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
  """A result holding modules while it crosses the trace boundary (a pytree): its other
  leaves, the values of the Variables made inside, and static ``info``."""

  leaves: list
  values: list
  info: tuple = dataclasses.field(metadata={"static": True})

  def rebuild(self, input_nodes: Sequence[Any] = ()) -> Any:
    """The result with its modules, outside the trace; outputs that were inputs come back
    as the caller's ``input_nodes`` themselves."""
    graphdef, treedef, positions, n_roots, n_variables = self.info
    objects: list = []
    if n_roots:
      flatten(input_nodes, objects=objects)
    roots, _ = unflatten(graphdef, [None] * n_variables + list(self.values), substitute=objects)
    out_nodes, rest, positions = iter(roots[n_roots:]), iter(self.leaves), set(positions)
    merged = [
      next(out_nodes) if i in positions else next(rest)
      for i in range(len(self.leaves) + len(positions))
    ]
    return jax.tree_util.tree_unflatten(treedef, merged)


def lift_outputs(out: Any, input_roots: Sequence[Any] = (), n_variables: int = 0) -> Any:
  """Inside a trace: ``out`` itself if it holds no module or Variable, else a
  ``ModulesOut`` (objects among ``input_roots``' graph recognised as inputs)."""
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
  """A result whose function changed its modules' structure, crossing the trace boundary
  (a pytree): ``out``, the new Variables' values and the static ``NewStructure``."""

  out: Any
  made: list
  structure: Any = dataclasses.field(metadata={"static": True})
