"""``sr.stack``: equally structured layers into a stack (the inverse of ``sr.unstack``).

Which Variables get the layer axis comes from the layers' origin (the stack they came
out of), from ``like``, or from the stacked class's rules, as at its init; a Variable
kept once for all layers must be equal in all of them (never layer 0's silently). A
pattern's layers go to their positions, layer ``i`` to position ``i % P``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp

from ._errors import TransformError, format_path
from ._filters import filter_repr
from ._graph import flatten, rewrite
from ._graph_build import unflatten
from ._graph_diff import first_difference
from ._kinds import Intermediate
from ._module import Module
from ._pattern_stack import from_positions
from ._split_merge import node_at, type_change
from ._stacks import (
  _pattern_of,
  cycle,
  cycle_unit,
  layer_origin,
  layer_unit,
  mark_frozen,
  stack_info,
  stacked_variables,
)
from ._variables import Variable


def stack(layers: Sequence[Module], *, like: Any = None):
  """Stacks equally structured layers into a stacked module; undoes ``sr.unstack``.

  The stacked class comes from ``like`` (a stacked module or class) or from the
  layers themselves when they came out of ``sr.unstack`` / ``stack.layer``. Which
  Variables get the layer axis (and where) comes from the same place: the layers'
  origin, ``like``'s stacked Variables, or ``like``'s rules; a Variable the layers
  got after ``sr.unstack`` is stacked or not as the class's rules say, as at init.
  A Variable left unstacked is held once for all layers, so it must be equal in
  every layer: a ``TransformError`` names it otherwise (never layer 0's kept). A
  Variable holding a pytree (the tuple ``Module.sow`` appends to) is stacked leaf by
  leaf, so each layer must hold the same structure (sown as many times).

  Args:
    layers: the layers, in order: modules built alike (the same class, arguments and
      mode), as ``sr.unstack`` gives them.
    like: the stacked module or class to build (what ``sr.vmap(Block, ...)`` or
      ``sr.scan(Block, ...)`` made); None (the default) takes it from the layers'
      origin, for layers that came out of ``sr.unstack`` or ``stack.layer``.

  Returns:
    The stacked module, its Variables holding the layers' values along the layer axis.

  Raises:
    ValueError: ``layers`` is empty.
    TypeError: ``like`` is not a stacked module or class, or it is None and the layers
      did not all come out of the same stack.
    sr.TransformError: the layers are not structured alike (another structure, shape
      or dtype, a sown tuple of another length), or a Variable held once for all
      layers differs between them.

  >>> import statefulremat as sr
  >>> stack = sr.vmap(sr.nn.Linear, axis_size=4)(2, 3, rngs=sr.Rngs(0))
  >>> again = sr.stack(sr.unstack(stack))
  >>> type(again) is type(stack), bool((again.kernel.value == stack.kernel.value).all())
  (True, True)
  """
  layers = list(layers)
  if not layers:
    raise ValueError("sr.stack needs at least one layer.")
  pattern = _pattern_of(like) if like is not None else _pattern_origin(layers)
  if pattern is not None:
    return _stack_pattern(layers, like, pattern)
  return _stack(layers, like, _Numbers(range(len(layers))))


class _Numbers:
  """How messages number the layers given to ``_stack``: the user's index of each in
  the list passed to ``sr.stack`` (a pattern's position gets every P-th), the position
  they hold in a pattern and its blocks, ``"(Local, Global)"`` (None for a plain stack)."""

  def __init__(
    self, numbers: Sequence[int], position: int | None = None, pattern: str | None = None
  ):
    self.numbers, self.position, self.pattern = list(numbers), position, pattern

  def __getitem__(self, i: int) -> int:
    return self.numbers[i]

  def first(self, possessive: bool = False) -> str:
    """The first layer, which the others are compared with (``layer 0``, ``layer 0's``)
    and, in a pattern, which layers its position stacks together."""
    text = f"layer {self.numbers[0]}" + "'s" * possessive
    if self.position is None:
      return text
    together = ", ".join(map(str, self.numbers))
    return f"{text} (position {self.position} of the pattern stacks layers {together})"


def _stack(layers: list, like: Any, numbers: _Numbers):
  """``sr.stack`` of one class of layers; ``numbers`` names them in messages."""
  if like is None:
    classes = {getattr(layer_origin(layer), "stack_class", None) for layer in layers}
    if len(classes) != 1 or None in classes:
      raise TypeError(
        "sr.stack cannot tell which stacked class to build: these layers did not all "
        "come from the same stack. Pass one: `sr.stack(layers, like=StackedClass)` "
        "(e.g. the class `sr.scan(Block, ...)` returned)."
      )
    like = classes.pop()
  cls = like if isinstance(like, type) else type(like)
  unit = layer_unit(cls)
  if unit is None:
    raise TypeError(f"sr.stack(like=...) takes a stacked module or class, got {cls!r}.")
  flats = [flatten([layer]) for layer in layers]
  graphdef, variables = flats[0]
  _check_alike(layers, flats, numbers)
  # A shared RNG stream that `layer(i)` split per layer goes back as the stack held it.
  origins = getattr(layer_origin(layers[0]), "stream_origins", None) or {}
  axes, why_shared = _layer_axes_of(layers, like, cls, graphdef, variables, origins)
  columns = [[flat[1][j]._value for flat in flats] for j in range(len(axes))]
  block = numbers.pattern or unit.cls.__name__
  for j, why in why_shared.items():
    _check_shared(graphdef.var_paths[j], variables[j], columns[j], why, block, numbers)
  values = []
  for j, (axis, column) in enumerate(zip(axes, columns)):
    if axis is None:
      values.append(origins.get(graphdef.var_paths[j], column[0]))
    else:
      # A pytree value (a sown tuple) is stacked leaf by leaf, as the stack slices it.
      values.append(jax.tree.map(lambda *xs, a=axis[0]: jnp.stack(xs, axis=a), *column))
  graphdef = rewrite(
    graphdef,
    root_classes={0: cls},
    metadata=lambda i, m: m if axes[i] is None else mark_frozen(m, *axes[i]),
  )
  roots, _ = unflatten(graphdef, values)
  return roots[0]


def _layer_axes_of(layers, like, cls, graphdef, variables, origins) -> tuple[list, dict[int, str]]:
  """``(axis, name)`` per flat Variable of a layer (None: shared, not stacked), and
  for each shared one to check (``origins`` are not: the stack's own RNG streams go
  back) why it is shared.

  What the layers' origin (``like``'s Variables, or the marks ``stack.layer`` left)
  says is kept; a Variable it does not cover (one the layers got after
  ``sr.unstack``) is decided by the class's rules, as at its init.
  """
  held: set = set()  # paths `like` holds without a layer axis
  if isinstance(like, Module):
    known = {p: (axis, name) for p, _, axis, name in stacked_variables(like)}
    held = set(flatten([like])[0].var_paths) - set(known)
  else:
    marks = [getattr(layer_origin(layer), "stacked_paths", None) or {} for layer in layers]
    known = marks[0] if all(m == marks[0] for m in marks) else {}
  info = stack_info(cls)
  assert info is not None and info.rules is not None
  rules = None
  axes: list = []
  why: dict[int, str] = {}
  for i, path in enumerate(graphdef.var_paths):
    if path in known:
      axes.append(known[path])
      continue
    axes.append(None)
    if path in held:
      why[i] = "`like` holds it without a layer axis"
    elif path not in origins:
      if rules is None:  # the class's rules decide, as at its init
        rules = info.rules.stacked_axes(graphdef, variables, layers[0])
      if i in rules:
        axes[i] = (rules[i], info.partition_name)
      else:
        why[i] = f"the rules of {cls.__name__} do not stack it"
  return axes, why


def _check_shared(
  path, var: Variable, column: list, why: str, block: str, numbers: _Numbers
) -> None:
  """Raises unless every layer holds the same value of a Variable the stack will hold
  once: keeping layer 0's would silently drop the others'."""
  for i, value in enumerate(column[1:], 1):
    same = _same_value(column[0], value)
    if same:
      continue
    first = numbers.first(possessive=True)
    differs = (
      f"may differ from {first}: it is traced, so sr.stack cannot compare them"
      if same is None
      else f"differs from {first}"
    )
    raise TransformError(
      f"sr.stack: `{format_path(path)}` ({type(var).__name__}) is not stacked ({why}), so "
      f"the stack holds one value of it for every layer, but layer {numbers[i]}'s "
      f"{differs}; keeping layer {numbers[0]}'s would lose the others'. Fix: give every "
      "layer the same value, or stack it: build a stacked class whose rules stack it, e.g. "
      f"`NewClass = sr.scan({block}, ..., variable_axes={{{filter_repr(type(var))}: 0}})`, "
      "and pass it: `sr.stack(layers, like=NewClass)`."
    )


def _same_value(a, b) -> bool | None:
  """Whether two layers' values of a Variable are equal (NaNs equal); None when a
  traced value keeps it from being known. ``_check_alike`` saw they have one structure,
  shape and dtype."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if x is y:
      continue
    if isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
      return None
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    if not bool(jnp.array_equal(x, y, equal_nan=True)):
      return False
  return True


def _check_alike(layers, flats, numbers: _Numbers) -> None:
  graphdef, variables = flats[0]
  for i, (g, layer_vars) in enumerate(flats[1:], 1):
    if g != graphdef:
      difference, sown = _layer_difference(layers[0], layers[i], graphdef, g, numbers[0])
      fix = (
        "a sown Intermediate exists only in a layer that was called since its last "
        "`sr.pop`: call every layer as often, or `sr.pop(layer, sr.Intermediate)` each"
        if sown
        else "build them with the same arguments (and the same mode, `.train()` / `.eval()`)"
      )
      raise TransformError(
        f"sr.stack: layer {numbers[i]} is not structured like {numbers.first()}: "
        f"{difference}. Only identical layers can be stacked: {fix}."
      )
    for path, v0, v in zip(graphdef.var_paths, variables, layer_vars):
      _check_tree(path, v0, v, numbers, i)
      why = type_change(v0._value, v._value)
      if why is not None:
        a, b = numbers[0], numbers[i]
        both = why.replace(" -> ", f" (layer {a}) vs ")
        raise TransformError(
          f"sr.stack: `{format_path(path)}` of layer {b} does not have the shape and "
          f"dtype of {numbers.first(possessive=True)}: {both} (layer {b}). Only identical "
          "layers can be stacked: build them with the same sizes (and dtypes)."
        )


def _values(n: int) -> str:
  return f"{n} value" + "s" * (n != 1)


def _check_tree(path, v0: Variable, v: Variable, numbers: _Numbers, i: int) -> None:
  """Raises unless a Variable holds a value of one tree structure in both layers: a
  pytree value (a sown tuple) is stacked leaf by leaf, so its leaves must pair up."""
  t0, t1 = jax.tree.structure(v0._value), jax.tree.structure(v._value)
  if t0 == t1:
    return
  a, b = numbers[0], numbers[i]
  sown = isinstance(v0._value, tuple) and isinstance(v._value, tuple)
  held = (
    f"a tuple of {_values(len(v0._value))} in layer {a} but of {_values(len(v._value))} in "
    f"layer {b}"
    if sown
    else f"{t0} in layer {a} but {t1} in layer {b}"
  )
  fix = (
    "a sown Variable gains an entry per call, so the layers were called a different "
    "number of times. Fix: call every layer as often, or clear what they sowed first, "
    "`sr.pop(layer, sr.Intermediate)` for each layer"
    if sown
    else "Fix: give the Variable the same structure in every layer"
  )
  raise TransformError(
    f"sr.stack: `{format_path(path)}` ({type(v0).__name__}) holds {held}; its leaves "
    f"are stacked one by one, so they must pair up: {fix}."
  )


def _layer_difference(first, other, g0, g1, number: int) -> tuple[str, bool]:
  """The first place two layers differ in structure, in words (with both values if
  static), and whether it is a sown ``Intermediate`` that only one of them holds."""
  found = first_difference(g0.nodes[0], g1.nodes[0], ())
  if found is None:
    return "their structure differs", False
  path, verb = found
  was, now = _value_at(first, path), _value_at(other, path)
  sown = isinstance(was, Intermediate) or isinstance(now, Intermediate)
  if verb == "changed":
    if was is _MISSING or now is _MISSING:
      return f"`{format_path(path)}` differs", sown
    if not isinstance(was, (Module, Variable)) and not isinstance(now, (Module, Variable)):
      return f"`{format_path(path)}` is {was!r} in layer {number} but {now!r} here", sown
  return f"attribute `{format_path(path)}` {verb}", sown


_MISSING = object()  # what `_value_at` finds where a layer holds nothing


def _value_at(root, path: tuple):
  try:
    return node_at(root, path)
  except (KeyError, IndexError, TypeError):
    return _MISSING


def _pattern_origin(layers) -> type | None:
  """The pattern class the layers came out of (``stack.layer`` / ``sr.unstack``)."""
  parents = set()
  for layer in layers:
    origin = layer_origin(layer)
    info = None if origin is None else stack_info(origin.stack_class)
    parents.add(None if info is None or info.place is None else info.place.pattern())
  return parents.pop() if len(parents) == 1 else None


def _stack_pattern(layers: list, like, cls: type):
  """``sr.stack`` for a pattern: layer ``i`` goes to position ``i % P``."""
  unit = cycle_unit(cls)
  assert unit is not None
  p = len(unit.positions)
  if len(layers) < p:
    raise TransformError(
      f"sr.stack: {len(layers)} layers for a pattern of {p} blocks; every position "
      f"needs at least one layer. Fix: give at least {p} layers (layer i at position "
      f"i % {p})."
    )
  for i, layer in enumerate(layers):
    want = layer_unit(unit.positions[i % p])
    assert want is not None
    if not isinstance(layer, want.cls):
      raise TransformError(
        f"sr.stack: layer {i} is a {type(layer).__name__}, but layer {i} of this "
        f"pattern (position {i % p}) is a {want.cls.__name__}. Fix: put the layers in "
        "pattern order (as `sr.unstack` gives them)."
      )
  # Each position's layers are stacked as one plain stack; messages number them as
  # the user did, layer i of the list (not its index among the position's layers).
  n, block = len(layers), f"({', '.join(unit.names)})"
  likes = cycle(like) if isinstance(like, Module) else unit.positions
  stacks = [_stack(layers[k::p], likes[k], _Numbers(range(k, n, p), k, block)) for k in range(p)]
  return from_positions(cls, stacks)
