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
  inside an ``nn.scan`` stores the layer axes the same way);
* ``depth``: where the stack sits on the path, so that layer ``i`` also answers to the
  list-of-layers names ``blocks.i.linear.kernel`` and linen's ``blocks_i``
  (``Entry.dotted(i)``, ``Entry.linen_name(i)``);
* ``owner``: the module holding the variable (its class decides PyTorch's layout);
* ``items``: which keys of ``path`` are items of a list, tuple or dict (the rest are
  attributes), so that a name can be rewritten with a layer index put in or taken out;
* ``pattern``: for a variable of one position of a pattern stack, ``(depth, period,
  position)``: its layer ``i`` is the pattern stack's layer ``i * period + position``,
  which also answers to ``blocks.{i * period + position}.…`` (the global index, as
  ``stack.layer`` takes it) and, in a stacked array at ``blocks.…``, to that index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.core
import jax.numpy as jnp

from ..core._errors import format_path
from ..core._graph import flatten
from ..core._module import Module
from ..core._stacks import _pattern_of, is_stacked, stack_info, stacked_variables
from ..core._variables import Variable


@dataclass(frozen=True)
class Entry:
  """One of our variables and where it goes."""

  path: tuple
  var: Variable
  linen: tuple
  axis: int | None = None
  lengths: tuple | None = None
  owner: Any = None  # the module whose attribute (or list, dict) holds the variable
  depth: int = 0  # for a stacked variable: how many keys of ``path`` reach the stack
  items: tuple = ()  # per key of ``path``: True for a list, tuple or dict item
  pattern: tuple | None = None  # (depth, period, position) in a pattern stack

  @property
  def collection(self) -> str:
    return self.var.collection

  @property
  def shape(self) -> tuple:
    return tuple(jnp.shape(self.var._value))

  @property
  def dtype(self) -> Any:
    return self.var.dtype

  def where(self, layer: int | None = None) -> str:
    """How a message names the variable (with ``layer``, that layer of it)."""
    at = "" if layer is None else f" layer {layer}"
    return f"`{format_path(self.path)}` ({type(self.var).__name__}){at}"

  @property
  def layers(self) -> int | None:
    """The number of layers of a stacked variable; None for others."""
    return None if self.axis is None else self.shape[self.axis]

  def layer_shape(self) -> tuple:
    """The shape of one layer's slice (the whole shape if not stacked)."""
    shape = self.shape
    return shape if self.axis is None else shape[: self.axis] + shape[self.axis + 1 :]

  def _listed(self, layer: int) -> tuple[tuple, tuple]:
    """``path`` and ``items`` of ``layer`` in a list of layers at the stack's path."""
    d = self.depth
    return self.path[:d] + (layer,) + self.path[d:], self.items[:d] + (True,) + self.items[d:]

  def dotted(self, layer: int | None = None) -> str:
    """Our path dot-joined, ``layers.0.kernel``; with ``layer``, that layer's place in
    a list of layers at the stack's path (``blocks.3.linear.kernel``)."""
    return dotted(self.path if layer is None else self._listed(layer)[0])

  def linen_name(self, layer: int | None = None) -> tuple:
    """The linen name; with ``layer``, that layer's as linen's ``setup`` names a list
    of submodules at the stack's name (``blocks_3``)."""
    return self.linen if layer is None else linen_names(*self._listed(layer))

  def _spelled(self, n: int, index: int | None = None) -> list[str]:
    """Our first ``n`` keys (then ``index``, as a list item) dot-joined and as linen
    names them: the prefixes ``_swap`` exchanges."""
    path, items = self.path[:n], self.items[:n]
    if index is not None:
      path, items = path + (index,), items + (True,)
    return [dotted(path), ".".join(linen_names(path, items))]

  def global_names(self, names: list[str], layer: int) -> list[str]:
    """``names`` of local ``layer`` of a pattern position, with the position's place
    (``blocks.pattern.1.2.…``, linen ``blocks.pattern_1_2.…``) written as the global
    index ``layer * period + position`` (``blocks.5.…``, ``blocks_5.…``), as
    ``stack.layer`` takes it; [] for other variables."""
    if self.pattern is None:
      return []
    top, period, position = self.pattern
    glob = self._spelled(top, layer * period + position)
    return _swap(names, self._spelled(self.depth, layer), glob)

  def stacked_names(self, names: list[str]) -> list[tuple[str, int, int | None]]:
    """``(name, index, local layer or None)``: where a stacked array of the other side
    (one layer axis in front) holds this variable, at which index. A pattern
    position's layer ``i`` is index ``i * period + position`` of ``blocks.…``; an item
    of a list of layers (``layers.3.…``, not in a stack) is index 3 of ``layers.…``."""
    if self.pattern is not None:
      top, period, position = self.pattern
      renamed = _swap(names, self._spelled(self.depth), self._spelled(top))
      assert self.layers is not None  # a pattern position's variables are stacked
      return [(n, i * period + position, i) for i in range(self.layers) for n in renamed]
    if self.axis is not None or True not in self.items:
      return []
    j = self.items.index(True)
    if not isinstance(self.path[j], int):
      return []
    return [(n, self.path[j], None) for n in _swap(names, self._spelled(j + 1), self._spelled(j))]

  def linen_shape(self, flat: bool = False) -> tuple:
    """The shape linen keeps this variable in: nested layer axes for remat_scan."""
    shape = self.shape
    if self.axis is None or self.lengths is None or flat:
      return shape
    return shape[: self.axis] + self.lengths + shape[self.axis + 1 :]


def entries(model, what: str) -> list[Entry]:
  """Every variable of ``model`` (first path of a shared one), in ``sr.state`` order."""
  if not isinstance(model, Module):
    raise TypeError(
      f"{what} takes one of our modules (an sr.Module) first, got {type(model).__name__}."
    )
  graphdef, variables = flatten([model])
  axes_of: dict[int, dict[int, int]] = {}  # id(stack) -> {id(variable): its layer axis}
  out = []
  for path, var in zip(graphdef.var_paths, variables):
    stack, owner, depth, items, pattern = _walk(model, path)
    if stack is not None and id(stack) not in axes_of:
      axes_of[id(stack)] = {id(v): axis for _, v, axis, _ in stacked_variables(stack)}
    axis = None if stack is None else axes_of[id(stack)].get(id(var))
    linen = linen_names(path, items)
    if axis is None:
      out.append(Entry(path, var, linen, owner=owner, items=items))
      continue
    lengths = getattr(stack_info(stack), "lengths", None)
    if lengths is not None and math.prod(lengths) != jnp.shape(var._value)[axis]:
      lengths = None
    out.append(Entry(path, var, linen, axis, lengths, owner, depth, items, pattern))
  return out


def _walk(root, path: tuple):
  """The outermost stacked module along ``path``, the module holding the variable,
  how many keys of the path reach the stack, which keys are container items, and the
  pattern stack around the stack if any."""
  obj, owner, stack, pattern = root, root, None, None
  depth = 0
  items: list[bool] = []
  patterns: dict[int, int] = {}  # where a pattern stack sits -> its period
  for n, key in enumerate(path):
    items.append(not isinstance(obj, Module))
    if items[-1]:
      obj = obj[key]
      continue
    if stack is None and is_stacked(obj):
      stack, depth = obj, n
      if n - 2 in patterns and path[n - 2] == "pattern":
        pattern = (n - 2, patterns[n - 2], path[n - 1])
    if stack is None and _pattern_of(obj) is not None:
      patterns[n] = len(vars(obj)["pattern"])
    owner, obj = obj, vars(obj)[key]
  return stack, owner, depth, tuple(items), pattern


def linen_names(path: tuple, items: tuple) -> tuple:
  """linen's module and variable names along ``path``: items joined to their
  attribute by ``_`` (``layers_0``), as linen's ``setup`` names them."""
  names: list[str] = []
  for key, item in zip(path, items):
    if item and names:
      names[-1] += f"_{key}"
    else:
      names.append(str(key))
  return tuple(names)


def _swap(names: list[str], old: list[str], new: list[str]) -> list[str]:
  """Each of ``names`` that starts with a prefix in ``old`` (a whole dotted name part),
  with that prefix replaced by the one at the same place in ``new``."""
  out: list[str] = []
  for name in names:
    for a, b in zip(old, new):
      if name == a or name.startswith(a + "."):
        renamed = (b + name[len(a) :]) if b else name[len(a) + 1 :]
        if renamed not in out:
          out.append(renamed)
        break
  return out


def dotted(path: tuple) -> str:
  """A path as a PyTorch state dict names it: keys joined by dots, ``layers.0.kernel``."""
  return ".".join(str(k) for k in path)


def placed_like(var: Variable, value):
  """``value`` on the devices (and sharding) of the value it replaces in ``var``."""
  old = var._value
  if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer):
    return jax.device_put(value, old.sharding)
  return value


def chosen_entries(model, want: set[str] | None, what: str) -> list[Entry]:
  """``model``'s entries in the collections ``want`` names (None: all but RNG state)."""
  return [
    e
    for e in entries(model, what)
    if (e.collection != "rngs" if want is None else e.collection in want)
  ]


def select_collections(collections, what: str) -> set[str] | None:
  """``collections=`` as a set of names: names (``"params"``) or kinds (``sr.Param``)."""
  if collections is None:
    return None
  items = collections if isinstance(collections, (tuple, list, set, frozenset)) else (collections,)
  names = set()
  for c in items:
    if isinstance(c, str):
      names.add(c)
    elif isinstance(c, type) and issubclass(c, Variable):
      names.add(c.collection)
    else:
      raise TypeError(
        f"{what}: collections= takes collection names or Variable kinds, e.g. "
        f"collections=('params',) or collections=(sr.Param,), got {c!r}."
      )
  return names


def flat_tree(tree, prefix: tuple = ()) -> dict[tuple, Any]:
  """``{key path: leaf}`` of nested mappings (anything but a mapping is a leaf)."""
  if not isinstance(tree, Mapping):
    return {prefix: tree}
  return {path: leaf for k, v in tree.items() for path, leaf in flat_tree(v, prefix + (k,)).items()}
