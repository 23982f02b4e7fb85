"""Where each of our variables goes in flax: its path, linen name and layer axes.

``entries(model)`` lists the model's variables as ``sr.state`` orders them, each with

* ``path``: our path, ``("layers", 0, "kernel")`` (also flax.nnx's path);
* ``linen``: linen's module names then the variable name. An attribute is a linen
  submodule name; items of a list, tuple or dict attribute are named as linen's
  ``setup`` names them, the attribute and the keys joined by ``_`` (``layers_0``,
  ``heads_a``, ``blocks_1_0``);
* ``axis`` / ``lengths``: for a variable that the outermost stacked module above it
  (class form of ``sr.scan`` / ``sr.remat_scan`` / ``sr.vmap``) holds stacked, its
  flat layer axis, and for a ``remat_scan`` stack its ``lengths`` (linen's
  ``nn.remat_scan`` nests the layer axes: ``(a, b, ...)`` in place of our ``a * b``).
  Stacks inside a stacked layer keep their axes as they are (a linen ``nn.scan``
  inside an ``nn.scan`` stores the layer axes the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ..core._errors import format_path
from ..core._graph import flatten
from ..core._module import Module
from ..core._stacks import is_stacked, stacked_variables
from ..core._variables import Variable


@dataclass(frozen=True)
class Entry:
  """One of our variables and where it goes."""

  path: tuple
  var: Variable
  linen: tuple
  axis: int | None = None
  lengths: tuple | None = None

  @property
  def collection(self) -> str:
    return self.var.collection

  @property
  def shape(self) -> tuple:
    return tuple(jnp.shape(self.var._value))

  @property
  def dtype(self) -> Any:
    return self.var.dtype

  def where(self) -> str:
    return f"`{format_path(self.path)}` ({type(self.var).__name__})"

  def linen_shape(self, flat: bool = False) -> tuple:
    """The shape linen keeps this variable in: nested layer axes for remat_scan."""
    shape = self.shape
    if self.axis is None or self.lengths is None or flat:
      return shape
    return shape[:self.axis] + self.lengths + shape[self.axis + 1:]


def entries(model, what: str) -> list[Entry]:
  """Every variable of ``model`` (first path of a shared one), in ``sr.state`` order."""
  if not isinstance(model, Module):
    raise TypeError(f"{what} takes one of our modules (an sr.Module) first, got "
                    f"{type(model).__name__}.")
  graphdef, variables = flatten([model])
  stacks: dict[int, tuple[dict, tuple | None]] = {}
  out = []
  for path, var in zip(graphdef.var_paths, variables):
    linen, stack = _walk(model, path)
    axis = lengths = None
    if stack is not None:
      if id(stack) not in stacks:
        stacks[id(stack)] = _stack_axes(stack)
      axes, stack_lengths = stacks[id(stack)]
      axis = axes.get(id(var))
      if axis is not None and stack_lengths is not None and (
          math.prod(stack_lengths) == jnp.shape(var._value)[axis]):
        lengths = stack_lengths
    out.append(Entry(path, var, linen, axis, lengths))
  return out


def _walk(root, path: tuple) -> tuple[tuple, Any]:
  """The linen name of ``path`` and the outermost stacked module on the way."""
  scope: list[str] = []
  name, obj, stack = None, root, None
  for key in path:
    if isinstance(obj, Module):
      if stack is None and is_stacked(obj):
        stack = obj
      if name is not None:
        scope.append(name)
      name, obj = str(key), vars(obj)[key]
    else:
      name, obj = f"{name}_{key}", obj[key]
  return tuple(scope) + (name,), stack


def _stack_axes(stack) -> tuple[dict, tuple | None]:
  axes = {id(v): axis for _, v, axis, _ in stacked_variables(stack)}
  return axes, remat_scan_lengths(type(stack))


def remat_scan_lengths(cls: type) -> tuple | None:
  """The ``lengths`` a ``sr.remat_scan`` class form was built with; None for others."""
  lengths = cls.__dict__.get("_sr_lengths")
  return None if lengths is None else tuple(lengths)


def placed_like(var: Variable, value):
  """``value`` on the devices (and sharding) of the value it replaces in ``var``."""
  old = var._value
  if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer):
    return jax.device_put(value, old.sharding)
  return value


def select_collections(collections, what: str) -> set[str] | None:
  """``collections=`` as a set of names: names (``"params"``) or kinds (``sr.Param``)."""
  if collections is None:
    return None
  items = (collections if isinstance(collections, (tuple, list, set, frozenset))
           else (collections,))
  names = set()
  for c in items:
    if isinstance(c, str):
      names.add(c)
    elif isinstance(c, type) and issubclass(c, Variable):
      names.add(c.collection)
    else:
      raise TypeError(
          f"{what}: collections= takes collection names or Variable kinds, e.g. "
          f"collections=('params',) or collections=(sr.Param,), got {c!r}.")
  return names


def flat_tree(tree, is_leaf) -> dict[tuple, Any]:
  """``{key path: leaf}`` of nested mappings (``is_leaf`` stops the descent)."""
  flat: dict[tuple, Any] = {}

  def walk(prefix, node):
    if is_leaf(node):
      flat[prefix] = node
    else:
      for k, v in node.items():
        walk(prefix + (k,), v)

  walk((), tree)
  return flat


def nearest(flat: dict[tuple, Any], path: tuple) -> tuple[tuple, list]:
  """The longest prefix of ``path`` that has entries below it, and their next keys."""
  for n in range(len(path) - 1, -1, -1):
    prefix = path[:n]
    below = {p[n] for p in flat if len(p) > n and p[:n] == prefix}
    if below or n == 0:
      return prefix, sorted(below, key=str)
  return (), []
