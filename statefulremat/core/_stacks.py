"""Stacked modules: the layer axis is data.

A *stack* is an instance of a layer class (``Block``) whose stacked Variables hold
every layer's value along one extra axis, the *layer axis*. The class forms of
``sr.scan`` / ``sr.remat_scan`` / ``sr.vmap`` build stacks; ``sr.stack`` builds one
from layers. Each stacked Variable says so in its metadata::

    layer_axis = ((axis, partition_name),)    # e.g. ((0, "layers"),), or ((0, None),)

``partition_name`` is the layer axis's name in ``sharding`` metadata (given by
``metadata_params={"partition_name": ...}``; ``None`` if not named). A stack of stacks
(``sr.vmap`` of a scanned class: an ensemble of stacks) has one entry per level,
outermost first; one layer of it is a stack again. So a ``State``
split off a stack, a checkpoint, a treescope rendering, a summary and
``sr.get_partition_spec`` know the layer axis without the stack's class. This file
reads and writes that metadata and moves between a stack and its layers:
``stack.layer(i)``, ``len(stack)``, ``sr.unstack``, ``sr.stack``. Nothing here knows
the transforms' rules: a stacked class carries what it needs as class attributes
(``_sr_layer_class``, ``_sr_length``, ``_sr_metadata_params`` and ``_sr_classify``,
which the transform that made it provides).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp

from ._errors import TransformError, format_path
from ._graph import flatten, rewrite, unflatten
from ._split_merge import type_change
from ._graph_diff import first_difference
from ._module import Module
from ._state import freeze, thaw_metadata
from ._variables import Variable

LAYER_AXIS = "layer_axis"
DEFAULT_NAME = "layers"  # how a layer axis without a partition name is shown


def layer_axis(var: Variable) -> tuple[int, str | None] | None:
  """``(axis, partition name)`` of a stacked Variable's (outermost) layer axis, else
  None."""
  levels = var._metadata.get(LAYER_AXIS)
  return levels[0] if levels else None


def axis_name(name: str | None) -> str:
  """How a layer axis is named on screen: its partition name, else ``layers``."""
  return DEFAULT_NAME if name is None else name


def mark(metadata: dict, axis: int, name: str | None) -> dict:
  """``metadata`` of a Variable stacked at ``axis``: ``layer_axis`` recorded and, for a
  named axis, the name inserted into ``sharding`` at that position."""
  inner = tuple((a + (a >= axis), n) for a, n in metadata.get(LAYER_AXIS, ()))
  out = {**metadata, LAYER_AXIS: ((axis, name),) + inner}
  sharding = out.get("sharding")
  if name is not None and sharding is not None:
    sharding = list(sharding)
    sharding.insert(axis, name)
    out["sharding"] = tuple(sharding)
  return out


def unmark(metadata: dict) -> dict:
  """Undoes ``mark``: the metadata of one layer's Variable."""
  if LAYER_AXIS not in metadata:
    return metadata
  out = dict(metadata)
  (axis, name), *inner = out.pop(LAYER_AXIS)
  if inner:
    out[LAYER_AXIS] = tuple((a - (a > axis), n) for a, n in inner)
  sharding = out.get("sharding")
  if name is not None and sharding is not None and axis < len(sharding) and (
      sharding[axis] == name):
    out["sharding"] = tuple(s for i, s in enumerate(sharding) if i != axis)
  return out


def mark_frozen(frozen, axis: int, name: str | None):
  """``mark`` on the frozen metadata a GraphDef holds."""
  return freeze(mark(thaw_metadata(frozen), axis, name))


def unmark_frozen(i, frozen):
  """``unmark`` on the frozen metadata of the ``i``-th Variable of a GraphDef."""
  return freeze(unmark(thaw_metadata(frozen)))


def layer_levels(variables, what: str) -> tuple[tuple[int, str | None], ...]:
  """The layer axes ``variables`` share: ``(layers, partition name)`` per level,
  outermost first; ``()`` when none of them is stacked.

  How a sub-module reached through a stack (``stack.attn``) knows it is one: its own
  Variables carry the layer axis. ``per_layer`` gives a new Variable the same levels.
  Variables without a layer axis (shared ones) are skipped; stacked ones that
  disagree are an error, as they cannot be one stack's layers.
  """
  found, first = None, None
  for path, var in variables:
    levels = var._metadata.get(LAYER_AXIS)
    if not levels:
      continue
    these = tuple((jnp.shape(var._value)[axis], name) for axis, name in levels)
    if found is None:
      found, first = these, path
    elif these != found:
      raise TransformError(
          f"{what}: `{format_path(first)}` and `{format_path(path)}` carry different "
          f"layer axes ({_levels_words(found)} vs {_levels_words(these)}), so they are "
          "not the layers of one stack and a per-layer Variable cannot follow them. "
          "Fix: give the module's stacked Variables one layer axis (the class form "
          "of one transform stacks them alike).")
  return found or ()


def _levels_words(levels) -> str:
  return " x ".join(f"{n} {axis_name(name)}" for n, name in levels)


def per_layer(levels) -> tuple[tuple[int, ...], dict]:
  """``(leading shape, metadata)`` of a new Variable with one value per layer of
  ``levels`` (from ``layer_levels``): the layer axes in front, outermost first, as
  the class forms stack with ``variable_axes={...: 0}``; ``((), {})`` for none."""
  metadata: dict = {}
  for _, name in reversed(levels):
    metadata = mark(metadata, 0, name)
  return tuple(n for n, _ in levels), metadata


def is_stacked(module) -> bool:
  """Whether ``module`` is a stack (its class was made by a transform's class form)."""
  return isinstance(module, Module) and "_sr_layer_class" in type(module).__dict__


def partition_name(cls: type) -> str | None:
  return cls._sr_metadata_params.get("partition_name")


def stacked_variables(stack) -> list[tuple[tuple, Variable, int, str | None]]:
  """``(path, variable, axis, name)`` of each Variable of ``stack`` with a layer axis."""
  graphdef, variables = flatten([stack])
  return [(path, var, *layer_axis(var)) for path, var in zip(graphdef.var_paths, variables)
          if layer_axis(var) is not None]


def num_layers(stack) -> int:
  """The number of layers: ``len(stack)``."""
  _, variables = flatten([stack])
  return _count(stack, variables, [layer_axis(v) for v in variables])


def _count(stack, variables, axes) -> int:
  for var, axis in zip(variables, axes):
    if axis is not None:
      return jnp.shape(var._value)[axis[0]]
  if type(stack)._sr_length is not None:
    return type(stack)._sr_length
  raise TypeError(f"{type(stack).__name__} has no stacked variables, so no layer count.")


def layer_graphdef(graphdef, metadata=unmark_frozen):
  """The GraphDef of one layer: each stacked root its layer class, each Variable's
  metadata mapped by ``metadata(i, frozen)`` (default: its layer axis removed)."""
  classes = {j: root[1]._sr_layer_class for j, root in enumerate(graphdef.tree)
             if isinstance(root[1], type) and "_sr_layer_class" in root[1].__dict__}
  return rewrite(graphdef, root_classes=classes, metadata=metadata)


def layer(stack, i: int):
  """Layer ``i`` as an ordinary module of the layer class (a copy).

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> Stack = sr.vmap(sr.nn.Linear, axis_size=3)
  >>> stack = Stack(2, 2, rngs=sr.Rngs(0))
  >>> len(stack), type(stack.layer(1)).__name__, stack.layer(1).kernel.shape
  (3, 'Linear', (2, 2))
  """
  graphdef, variables = flatten([stack])
  axes = [layer_axis(v) for v in variables]
  n = _count(stack, variables, axes)
  if not -n <= i < n:
    raise IndexError(f"layer {i} of a stack of {n} layers: use 0..{n - 1} (or -{n}..-1).")
  i %= n
  values = [v._value if a is None else jnp.take(v._value, i, axis=a[0])
            for v, a in zip(variables, axes)]
  roots, _ = unflatten(layer_graphdef(graphdef), values)
  roots[0].__dict__["_sr_stacked_from"] = type(stack)
  roots[0].__dict__["_sr_stacked_paths"] = {
      p: a for p, a in zip(graphdef.var_paths, axes) if a is not None}
  # The RNG streams the layers share are split when the stack runs; the class's hook
  # gives this copy the keys layer i draws there (and says what the stack held).
  seed = getattr(type(stack), "_sr_layer_rngs", None)
  shared = {j for j, a in enumerate(axes) if a is None}
  before = seed(roots[0], i, shared) if seed is not None else {}
  roots[0].__dict__["_sr_stream_origins"] = {
      graphdef.var_paths[j]: value for j, value in before.items()}
  return roots[0]


def unstack(stack) -> list:
  """The layers of a stacked module, as ordinary modules: ``[stack.layer(i) ...]``.

  >>> import statefulremat as sr
  >>> stack = sr.vmap(sr.nn.Linear, axis_size=4)(2, 3, rngs=sr.Rngs(0))
  >>> [layer.kernel.shape for layer in sr.unstack(stack)]
  [(2, 3), (2, 3), (2, 3), (2, 3)]
  """
  if not is_stacked(stack):
    raise TypeError(
        f"sr.unstack takes a stacked module (built by the class form of sr.scan, "
        f"sr.remat_scan or sr.vmap), got {type(stack).__name__}.")
  return [layer(stack, i) for i in range(num_layers(stack))]


def stack(layers: Sequence[Module], *, like: Any = None):
  """Stacks equally structured layers into a stacked module; undoes ``sr.unstack``.

  The stacked class comes from ``like`` (a stacked module or class) or from the
  layers themselves when they came out of ``sr.unstack`` / ``stack.layer``. Which
  Variables get the layer axis (and where) comes from the same place: the layers'
  origin, ``like``'s stacked Variables, or ``like``'s rules.

  >>> import statefulremat as sr
  >>> stack = sr.vmap(sr.nn.Linear, axis_size=4)(2, 3, rngs=sr.Rngs(0))
  >>> again = sr.stack(sr.unstack(stack))
  >>> type(again) is type(stack), bool((again.kernel.value == stack.kernel.value).all())
  (True, True)
  """
  layers = list(layers)
  if not layers:
    raise ValueError("sr.stack needs at least one layer.")
  cls = like if isinstance(like, type) else type(like) if like is not None else None
  if cls is None:
    origins = {layer.__dict__.get("_sr_stacked_from") for layer in layers}
    if len(origins) != 1 or None in origins:
      raise TypeError(
          "sr.stack cannot tell which stacked class to build: these layers did not all "
          "come from the same stack. Pass one: `sr.stack(layers, like=StackedClass)` "
          "(e.g. the class `sr.scan(Block, ...)` returned).")
    cls = origins.pop()
  if not (isinstance(cls, type) and "_sr_layer_class" in cls.__dict__):
    raise TypeError(f"sr.stack(like=...) takes a stacked module or class, got {cls!r}.")
  flats = [flatten([layer]) for layer in layers]
  graphdef, variables = flats[0]
  _check_alike(layers, flats)
  axes = _layer_axes_of(layers, like, cls, graphdef, variables)
  # A shared RNG stream that `layer(i)` split per layer goes back as the stack held it.
  origins = layers[0].__dict__.get("_sr_stream_origins", {})
  values = []
  for j, axis in enumerate(axes):
    column = [flat[1][j]._value for flat in flats]
    if axis is None:
      values.append(origins.get(graphdef.var_paths[j], column[0]))
    else:
      values.append(jnp.stack(column, axis=axis[0]))
  graphdef = rewrite(graphdef, root_classes={0: cls},
                     metadata=lambda i, m: m if axes[i] is None else mark_frozen(m, *axes[i]))
  roots, _ = unflatten(graphdef, values)
  return roots[0]


def _layer_axes_of(layers, like, cls, graphdef, variables) -> list:
  """``(axis, name)`` per flat Variable of a layer (None: shared, not stacked)."""
  if isinstance(like, Module):
    known = {p: layer_axis(v) for p, v, _, _ in stacked_variables(like)}
  else:
    marks = [layer.__dict__.get("_sr_stacked_paths") for layer in layers]
    known = marks[0] if all(m == marks[0] for m in marks) else None
  if known is None:  # the class's rules decide, as at its init
    name = partition_name(cls)
    known = {graphdef.var_paths[i]: (axis, name)
             for i, axis in cls._sr_classify(graphdef, variables, layers[0]).items()}
  return [known.get(p) for p in graphdef.var_paths]


def _check_alike(layers, flats) -> None:
  graphdef, variables = flats[0]
  for i, (g, layer_vars) in enumerate(flats[1:], 1):
    if g != graphdef:
      raise TransformError(
          f"sr.stack: layer {i} is not structured like layer 0: "
          f"{_layer_difference(layers[0], layers[i], graphdef, g)}. Only identical "
          "layers can be stacked: build them with the same arguments (and the same "
          "mode, `.train()` / `.eval()`).")
    for path, v0, v in zip(graphdef.var_paths, variables, layer_vars):
      why = type_change(v0._value, v._value)
      if why is not None:
        raise TransformError(
            f"sr.stack: `{format_path(path)}` of layer {i} does not have the shape and "
            f"dtype of layer 0's: {why.replace(' -> ', ' (layer 0) vs ')} (layer {i}). "
            "Only identical layers can be stacked: build them with the same sizes.")


def _layer_difference(first, other, g0, g1) -> str:
  """The first place two layers differ in structure, with both values if static."""
  found = first_difference(g0.tree[0], g1.tree[0], ())
  if found is None:
    return "their structure differs"
  path, verb = found
  if verb == "changed":
    try:
      was, now = _value_at(first, path), _value_at(other, path)
    except (AttributeError, KeyError, IndexError, TypeError):
      return f"`{format_path(path)}` differs"
    if not isinstance(was, (Module, Variable)) and not isinstance(now, (Module, Variable)):
      return f"`{format_path(path)}` is {was!r} in layer 0 but {now!r} here"
  return f"attribute `{format_path(path)}` {verb}"


def _value_at(root, path: tuple):
  for key in path:
    root = getattr(root, key) if isinstance(root, Module) else root[key]
  return root
