"""treescope rendering of modules, variables and State.

Every object renders through ``__treescope_repr__`` and ``treescope.repr_lib`` (no
treescope internals); Variables are coloured by collection. Two things are ours:

* a stacked module (the class forms of scan, remat_scan and vmap) shows each stacked
  variable's layer axis by name, penzai-style: ``float32(8, 8 | layers:6)``, or with
  ``sharding`` names ``float32(| layers:6, embed:8, mlp:8)``. The name is the stack's
  partition name, else ``layers``. The value is wrapped in a ``LayeredArray``, which
  treescope's array visualiser reads through an ``NDArrayAdapter``, so the HTML figure
  labels its axes with the same names;
* a module or Variable reached twice (shared) is drawn once; later places say where:
  ``Param(<shared: drawn at first.w>)`` (and treescope's own "repeated object"
  comment, which carries a memory address, never fires).

treescope is imported on first render, so ``import statefulremat`` stays light.
"""

from __future__ import annotations

import contextvars
from typing import Any

import numpy as np

from ._errors import format_path

# id(variable) -> (layer axis, axis name), for the variables of the stack being drawn.
_LAYER_AXES: contextvars.ContextVar[dict] = contextvars.ContextVar("sr_layer_axes",
                                                                  default={})
# id(module or variable) -> the path where one top-level render first draws it.
_FIRST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("sr_first",
                                                                    default=None)


def collection_color(kind: type) -> str:
  from treescope import formatting_util

  return formatting_util.color_from_string(kind.collection)


def _attributes(module) -> dict[str, Any]:
  return {k: v for k, v in vars(module).items() if not k.startswith("_sr_")}


def _first_paths(root) -> dict[int, tuple]:
  """Where each module and Variable under ``root`` is first reached, in drawing order."""
  from ._module import Module
  from ._variables import Variable

  first: dict[int, tuple] = {}

  def walk(obj, path):
    if isinstance(obj, (Module, Variable)):
      if id(obj) in first:
        return
      first[id(obj)] = path
      if isinstance(obj, Module):
        for k, v in _attributes(obj).items():
          walk(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
      for i, v in enumerate(obj):
        walk(v, path + (i,))
    elif isinstance(obj, dict):
      for k, v in obj.items():
        walk(v, path + (k,))

  walk(root, ())
  return first


def _mark_shared(value, path: tuple, first: dict):
  """``value`` with every module or Variable drawn elsewhere first replaced by a mark."""
  from ._module import Module
  from ._variables import Variable

  if isinstance(value, (Module, Variable)):
    where = first.get(id(value), path)
    return value if where == path else _SharedMark(value, where)
  if isinstance(value, (list, tuple, dict)):
    items = value.items() if isinstance(value, dict) else enumerate(value)
    marked = {k: _mark_shared(v, path + (k,), first) for k, v in items}
    if all(marked[k] is v for k, v in (value.items() if isinstance(value, dict)
                                       else enumerate(value))):
      return value  # nothing shared below: draw the user's own object
    if isinstance(value, dict):
      return type(value)(marked)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
      return type(value)(*marked.values())
    return type(value)(marked.values())
  return value


def render_module(module, path, subtree_renderer):
  from treescope import repr_lib

  from ._transforms._rules import STACKED
  from ._transforms._stacked import is_stacked, stack_plan

  first = _FIRST.get()
  tokens = []
  if first is None:
    first = _first_paths(module)
    tokens.append((_FIRST, _FIRST.set(first)))
  if is_stacked(module):
    _, variables, plan = stack_plan(module)
    name = type(module)._sr_metadata_params.get("partition_name") or "layers"
    axes = dict(_LAYER_AXES.get())
    axes.update({id(v): (axis, name) for v, kind, axis
                 in zip(variables, plan.kinds, plan.axes) if kind == STACKED})
    tokens.append((_LAYER_AXES, _LAYER_AXES.set(axes)))
  try:
    here = first.get(id(module), ())
    attributes = {k: _mark_shared(v, here + (k,), first)
                  for k, v in _attributes(module).items()}
    return repr_lib.render_object_constructor(type(module), attributes, path,
                                              subtree_renderer)
  finally:
    for var, token in reversed(tokens):
      var.reset(token)


def render_variable(var, path, subtree_renderer):
  from treescope import repr_lib

  value = var._value
  layer = _LAYER_AXES.get().get(id(var))
  if layer is not None and hasattr(value, "shape"):
    value = LayeredArray(value, layer[0], layer[1], var._metadata.get("sharding"))
  attributes = {"value": value, **var._metadata}
  return repr_lib.render_object_constructor(
      type(var), attributes, path, subtree_renderer, color=collection_color(type(var)))


def render_state(state, path, subtree_renderer):
  """A State as the nested dict its indexing follows, each entry its Variable kind."""
  from treescope import repr_lib

  nested: dict = {}
  for p, var in state.flat_variables().items():
    node = nested
    for key in p[:-1]:
      node = node.setdefault(key, {})
    node[p[-1]] = var
  return repr_lib.render_dictionary_wrapper(type(state), nested, path, subtree_renderer)


class _SharedMark:
  """A module or Variable drawn earlier: ``Param(<shared: also at a.kernel>)``."""

  def __init__(self, obj, where: tuple):
    self.kind, self.where = type(obj), where

  def __treescope_repr__(self, path, subtree_renderer):
    from treescope import rendering_parts

    where = format_path(self.where) if self.where else "the root"
    return rendering_parts.text(f"{self.kind.__name__}(<shared: drawn at {where}>)")


class LayeredArray:
  """An array whose ``axis`` is a stack's layer axis named ``name`` (for display).

  >>> import jax.numpy as jnp
  >>> from statefulremat._treescope import LayeredArray
  >>> LayeredArray(jnp.zeros((6, 8, 8)), 0, "layers").axes_text()
  'float32(8, 8 | layers:6)'
  """

  def __init__(self, array, axis: int, name: str, sharding=None):
    self.array, self.axis, self.name = array, axis, name
    self.names = _axis_names(np.ndim(array), axis, name, sharding)
    _register_adapter()  # before treescope looks for an adapter to visualise it

  def axes_text(self) -> str:
    shape = np.shape(self.array)
    positional = [str(n) for n, label in zip(shape, self.names) if label is None]
    named = [f"{label}:{n}" for n, label in zip(shape, self.names) if label is not None]
    dtype = np.dtype(self.array.dtype).name
    positional = ", ".join(positional) + " " if positional else ""
    return f"{dtype}({positional}| {', '.join(named)})"

  def __treescope_repr__(self, path, subtree_renderer):
    from treescope import rendering_parts

    summary = self.axes_text()
    stats = _data_summary(self.array)
    body = f"<jax.Array {summary}{' ' + stats.strip() if stats else ''}>"
    return rendering_parts.text(body)


def _axis_names(ndim: int, axis: int, name: str, sharding) -> list:
  """Each axis's name: the layer axis's, else the ``sharding`` metadata's, else None."""
  names = [None] * ndim
  if sharding is not None and len(sharding) == ndim - 1:  # without the layer axis
    sharding = (*sharding[:axis], None, *sharding[axis:])
  if sharding is not None and len(sharding) == ndim:
    names = [s if isinstance(s, str) else None for s in sharding]
  names[axis] = name
  return names


def _data_summary(array) -> str:
  try:
    from treescope.external import jax_support

    return jax_support.summarize_array_data(array)
  except Exception:  # a tracer or a deleted buffer: no statistics, the shape suffices
    return ""


_ADAPTER_REGISTERED = False


def _register_adapter() -> None:
  """Lets treescope's array visualiser draw a LayeredArray with its axis names."""
  global _ADAPTER_REGISTERED
  if _ADAPTER_REGISTERED:
    return
  from treescope import type_registries

  from ._treescope_adapter import LayeredArrayAdapter

  type_registries.NDARRAY_ADAPTER_REGISTRY[LayeredArray] = LayeredArrayAdapter()
  _ADAPTER_REGISTERED = True
