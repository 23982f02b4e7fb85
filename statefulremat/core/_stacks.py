"""Stacked modules: the layer axis is data.

A *stack* is an instance of a layer class (``Block``) whose stacked Variables hold
every layer's value along one extra axis, the *layer axis*. The class forms of
``sr.scan`` / ``sr.remat_scan`` / ``sr.vmap`` build stacks; ``sr.stack`` builds one
from layers (``_stacking``). Each stacked Variable says so in its metadata::

    layer_axis = ((axis, partition_name),)    # e.g. ((0, "layers"),), or ((0, None),)

``partition_name`` is the layer axis's name in ``sharding`` metadata (given by
``metadata_params={"partition_name": ...}``; ``None`` if not named). A stack of stacks
(``sr.vmap`` of a scanned class: an ensemble of stacks) has one entry per level,
outermost first; one layer of it is a stack again. So a ``State``
split off a stack, a checkpoint, a treescope rendering, a summary and
``sr.get_partition_spec`` know the layer axis without the stack's class. This file
reads and writes that metadata and moves between a stack and its layers:
``stack.layer(i)``, ``len(stack)``, ``sr.unstack`` (``sr.stack`` is ``_stacking``).
What a stacked class is lives in one frozen record, ``StackInfo``, written once by the
class form that made the class and read through ``stack_info``: its unit (a layer
class, or for a pattern stack the stacked class of each position), its length, its
partition name, and the transform's rules as a two-method protocol (``StackRules``),
so nothing here knows those rules. A class's record is its own (not inherited): the
ensemble ``sr.vmap(PatternClass, axis_size=3)`` is a stack of 3 pattern stacks, whatever
its base class says. A layer copied out of a stack (``stack.layer(i)``) remembers where
it came from in one ``LayerOrigin`` record, so ``sr.stack`` can put it back.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from ._bookkeeping import LAYER_KEYS, LAYER_ORIGIN, SPLITS, STACK_INFO
from ._errors import TransformError, format_path
from ._graph import flatten, rewrite
from ._graph_build import unflatten
from ._module import Module, iter_graph
from ._state import freeze, thaw_metadata
from ._variables import Variable, path_of

LAYER_AXIS = "layer_axis"
DEFAULT_NAME = "layers"  # how a layer axis without a partition name is shown


class StackRules(Protocol):
  """What a stacked class's transform supplies: how its rules treat one layer."""

  def stacked_axes(self, graphdef, variables, layer) -> dict[int, int]:
    """``{flat index: layer axis}`` of the Variables the rules stack, as at init."""
    ...

  def seed_layer(self, layer: Module, index, shared: set[int]) -> dict[int, Any]:
    """Gives the copy ``layer`` the keys layer ``index`` draws inside the stack from
    the streams the layers share (flat indices ``shared``); returns ``{flat index:
    value before}`` of the Variables it rewrote."""
    ...


class Form(enum.Enum):
  """The class form that made a stacked class; its value is the class names' label."""

  SCAN = "Scan"
  REMAT_SCAN = "RematScan"
  VMAP = "Vmap"


@dataclasses.dataclass(frozen=True)
class Layer:
  """The unit of a stack of one class: a layer of ``cls``, built by ``factory`` (a
  ``functools.partial`` of ``cls``, a pattern's element) or else by ``cls``."""

  cls: type
  factory: Callable | None = None

  def maker(self) -> Callable:
    return self.factory or self.cls


@dataclasses.dataclass(frozen=True)
class Cycle:
  """The unit of a pattern stack: one layer of each position, in order — the stacked
  class of each position and its name in the pattern (``partial(Block, w=2)``)."""

  positions: tuple[type, ...]
  names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Place:
  """Where the stack of one position of a pattern sits: its layer ``i`` is the
  pattern's layer ``i * period + position``. ``pattern()`` is the pattern stack class,
  which is made after its positions (so the record reaches it through a function;
  None while it is being made)."""

  period: int
  position: int
  name: str
  pattern: Callable[[], type | None]


@dataclasses.dataclass(frozen=True)
class StackInfo:
  """What a stacked class is (see the module docstring): made whole, with its class,
  by the class form that made it, and never changed after.

  ``unit`` is what one step of a loop over the stack runs: a ``Layer``, or for a
  pattern stack a ``Cycle``; ``place`` is set on the stack of one position of a
  pattern; ``lengths`` is ``sr.remat_scan``'s nested layout (for
  ``sr.interop.to_linen``).
  """

  form: Form
  length: int | None
  what: str  # how errors name the class form
  unit: Layer | Cycle
  rules: StackRules | None = None
  partition_name: str | None = None
  init_in_axes: Any = None
  place: Place | None = None
  lengths: tuple[int, ...] | None = None

  @property
  def index_map(self) -> tuple[int, int]:
    """``(period, position)``: layer ``i`` is layer ``i * period + position`` of the
    pattern it belongs to (``(1, 0)``: none)."""
    return (1, 0) if self.place is None else (self.place.period, self.place.position)


def stack_info(obj) -> StackInfo | None:
  """The ``StackInfo`` of a stacked class or of a stack (an instance), else None."""
  cls = obj if isinstance(obj, type) else type(obj)
  return cls.__dict__.get(STACK_INFO)


def set_stack_info(cls: type, info: StackInfo) -> type:
  """Records ``info`` as what ``cls`` is (once, by the class form that made it)."""
  assert STACK_INFO not in cls.__dict__, cls
  setattr(cls, STACK_INFO, info)
  return cls


def layer_unit(obj) -> Layer | None:
  """The ``Layer`` unit of a stack of one class (a class or an instance), else None."""
  unit = getattr(stack_info(obj), "unit", None)
  return unit if isinstance(unit, Layer) else None


def cycle_unit(obj) -> Cycle | None:
  """The ``Cycle`` unit of a pattern stack (a class or an instance), else None."""
  unit = getattr(stack_info(obj), "unit", None)
  return unit if isinstance(unit, Cycle) else None


@dataclasses.dataclass(frozen=True)
class LayerOrigin:
  """Where a layer copied out of a stack (``stack.layer(i)``) came from: the stack's
  class, the layer axis of each of its stacked Variables (by path), and the value the
  stack held of each shared RNG Variable the copy was given layer ``i``'s keys in."""

  stack_class: type
  stacked_paths: dict
  stream_origins: dict


def layer_origin(module) -> LayerOrigin | None:
  """The ``LayerOrigin`` of a layer copied out of a stack, else None."""
  # Kept on the layer as a plain tuple, so that a pickled layer names no private class.
  kept = vars(module).get(LAYER_ORIGIN) if isinstance(module, Module) else None
  return None if kept is None else LayerOrigin(*kept)


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
  if name is not None and out.get("sharding") is not None:
    sharding = tuple(out["sharding"])
    out["sharding"] = sharding[:axis] + (name,) + sharding[axis:]
  return out


def unmark(metadata: dict) -> dict:
  """Undoes ``mark``: the metadata of one layer's Variable."""
  if LAYER_AXIS not in metadata:
    return metadata
  out = dict(metadata)
  (axis, name), *inner = out.pop(LAYER_AXIS)
  if inner:
    out[LAYER_AXIS] = tuple((a - (a > axis), n) for a, n in inner)
  sharding = out.get("sharding") or ()
  if name is not None and axis < len(sharding) and sharding[axis] == name:
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
  found, first = None, ()
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
        "of one transform stacks them alike)."
      )
  return found or ()


def _levels_words(levels) -> str:
  return " x ".join(f"{n} {axis_name(name)}" for n, name in levels)


def per_layer(module: Module, variable: Variable) -> Variable:
  """``variable`` (one layer's) made per layer of the stack ``module`` belongs to.

  For a module's own per-layer state created after init, e.g. a key/value cache made
  by an ``init_cache`` method: on a module reached through a stack (``stack.attn``,
  whose Variables carry the layer axis) it returns a new Variable of ``variable``'s
  kind and metadata whose value is ``variable``'s repeated once per layer, the layer
  axes in front (outermost first, a stack of stacks has two), recorded in its
  ``layer_axis`` metadata with the stack's partition name (also put in ``sharding``),
  as the class forms stack with ``variable_axes={...: 0}``. So ``stack.layer(i)``,
  ``sr.unstack``, checkpoints and the stack's scan treat it as stacked, and each layer
  sees its own slice. On a plain module (no layer axis) it returns ``variable`` itself,
  so one method serves both. It is what creating the Variable inside ``nnx.vmap`` over
  the layers gives in flax.nnx. The stack's rules must slice the Variable's
  collection (``variable_axes={True: 0}``, the default of ``sr.remat_scan`` and
  ``sr.vmap``, does).

  Args:
    module: the module the Variable is for (usually ``self``), plain or reached
      through a stack.
    variable: one layer's Variable, without a layer axis.

  Returns:
    A new Variable holding ``variable``'s value once per layer, or ``variable`` itself
    on a plain module.

  Raises:
    TypeError: ``module`` is not a Module or ``variable`` not a Variable.
    sr.TransformError: ``module`` is a stack none of whose Variables carries the layer
      axis, or ``variable`` already carries one.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> class Counter(sr.Module):
  ...   def __init__(self, *, rngs):
  ...     self.linear = sr.nn.Linear(2, 2, rngs=rngs)
  ...   def init_cache(self, batch):
  ...     self.seen = sr.per_layer(self, sr.Cache(jnp.zeros((batch,), jnp.int32)))
  >>> plain = Counter(rngs=sr.Rngs(0))
  >>> plain.init_cache(5)
  >>> plain.seen.shape
  (5,)
  >>> stack = sr.remat_scan(Counter, lengths=(3,))(rngs=sr.Rngs(0))
  >>> stack.init_cache(5)
  >>> stack.seen.shape, stack.seen.metadata["layer_axis"], stack.layer(1).seen.shape
  ((3, 5), ((0, None),), (5,))
  """
  if not isinstance(module, Module) or not isinstance(variable, Variable):
    raise TypeError(
      "sr.per_layer(module, variable) takes a module and one layer's Variable, got "
      f"{type(module).__name__} and {type(variable).__name__}. Fix: e.g. "
      "`self.cache = sr.per_layer(self, sr.Cache(jnp.zeros(shape)))`."
    )
  path = path_of(module)
  where = f"`{format_path(path)}`" if path else f"a {type(module).__name__}"
  levels = layer_levels(module.iter_variables(), f"sr.per_layer on {where}")
  if not levels and is_stacked(module):
    raise TransformError(
      f"sr.per_layer on {where}: it is a stack, but none of its Variables carries "
      "the layer axis, so the number of layers is not known here. Fix: build the "
      "stack with a length and rules that stack a Variable of it (e.g. "
      "`variable_axes={sr.Param: 0}`), or make the Variable per layer by hand: "
      "`sr.Cache(value, layer_axis=((0, None),))` with the layer axis in front."
    )
  if not levels:
    return variable
  if LAYER_AXIS in variable._metadata:
    raise TransformError(
      f"sr.per_layer on {where}: the Variable given already carries a layer axis "
      f"({variable._metadata[LAYER_AXIS]}), so it holds several layers' values. Fix: "
      "pass one layer's Variable (without `layer_axis` metadata)."
    )
  lead = tuple(n for n, _ in levels)
  metadata = dict(variable._metadata)
  for _, name in reversed(levels):
    metadata = mark(metadata, 0, name)
  value = jax.tree.map(lambda x: jnp.broadcast_to(x, lead + jnp.shape(x)), variable._value)
  return type(variable)(value, **metadata)


def is_stacked(module) -> bool:
  """Whether ``module`` (or a class) is a stack of layers of one class (its class was
  made by a transform's class form; a pattern stack holds such stacks)."""
  return layer_unit(module) is not None


def stacked_variables(stack) -> list[tuple[tuple, Variable, int, str | None]]:
  """``(path, variable, axis, name)`` of each Variable of ``stack`` with a layer axis."""
  graphdef, variables = flatten([stack])
  return [
    (path, var, *axis)
    for path, var in zip(graphdef.var_paths, variables)
    if (axis := layer_axis(var)) is not None
  ]


def num_layers(stack) -> int:
  """The number of layers: ``len(stack)``."""
  for _, var, axis, _ in stacked_variables(stack):
    return axis_size(var._value, axis)
  info = stack_info(stack)
  if info is not None and info.length is not None:
    return info.length
  raise TypeError(f"{type(stack).__name__} has no stacked variables, so no layer count.")


def axis_size(value, axis: int) -> int:
  """The size of a Variable value's ``axis``: a pytree value (a sown tuple) is stacked
  leaf by leaf, each leaf with the axis."""
  return jnp.shape(jax.tree.leaves(value)[0])[axis]


def layer_graphdef(graphdef, metadata=unmark_frozen):
  """The GraphDef of one layer: each stacked root its layer class, each Variable's
  metadata mapped by ``metadata(i, frozen)`` (default: its layer axis removed)."""
  classes = {
    j: unit.cls
    for j, root in enumerate(graphdef.nodes)
    if isinstance(root.type, type) and (unit := layer_unit(root.type)) is not None
  }
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
  n = num_layers(stack)
  if not -n <= i < n:
    raise IndexError(f"layer {i} of a stack of {n} layers: use 0..{n - 1} (or -{n}..-1).")
  i %= n
  values = [
    v._value if a is None else jax.tree.map(lambda x, a=a: jnp.take(x, i, axis=a[0]), v._value)
    for v, a in zip(variables, axes)
  ]
  roots, _ = unflatten(layer_graphdef(graphdef), values)
  # The RNG streams the layers share are split when the stack runs; the class's rules
  # give this copy the keys layer i draws there (and say what the stack held).
  info = stack_info(stack)
  shared = {j for j, a in enumerate(axes) if a is None}
  before = {}
  if info is not None and info.rules is not None:
    # One position of a pattern: its layer i is layer i * period + position there.
    period, position = info.index_map
    before = info.rules.seed_layer(roots[0], i * period + position, shared)
    # The copy asks its class whether a name splits (the same rules): that pickles.
    for _, node in iter_graph(roots[0]):
      keys = vars(node).get(LAYER_KEYS) if isinstance(node, Module) else None
      if keys is not None:
        keys.splits = getattr(type(stack), SPLITS)
  roots[0].__dict__[LAYER_ORIGIN] = (  # a LayerOrigin's fields (see layer_origin)
    type(stack),
    {p: a for p, a in zip(graphdef.var_paths, axes) if a is not None},
    {graphdef.var_paths[j]: value for j, value in before.items()},
  )
  return roots[0]


def unstack(stack) -> list:
  """The layers of a stacked module, as ordinary modules: ``[stack.layer(i) ...]``.

  Args:
    stack: a stacked module (built by the class form of ``sr.scan``, ``sr.remat_scan``
      or ``sr.vmap``, or by ``sr.stack``).

  Returns:
    A list of the layers in order, each a copy holding its slice of the stack's values
    (a pattern stack's layers in the order they run).

  Raises:
    TypeError: ``stack`` is not a stacked module.

  >>> import statefulremat as sr
  >>> stack = sr.vmap(sr.nn.Linear, axis_size=4)(2, 3, rngs=sr.Rngs(0))
  >>> [layer.kernel.shape for layer in sr.unstack(stack)]
  [(2, 3), (2, 3), (2, 3), (2, 3)]
  """
  if _pattern_of(stack) is not None:
    return [stack.layer(i) for i in range(len(stack))]
  if not is_stacked(stack):
    raise TypeError(
      f"sr.unstack takes a stacked module (built by the class form of sr.scan, "
      f"sr.remat_scan or sr.vmap), got {type(stack).__name__}."
    )
  return [layer(stack, i) for i in range(num_layers(stack))]


# -- stacks of a repeating pattern -------------------------------------------------------
# A pattern stack (made by a class form over a tuple of classes) holds one stack per
# position in ``.pattern``; its record lists their classes in ``positions``.


def not_subscriptable(stack, i):
  """Raises for ``stack[i]``: a stack's layers are taken out with ``stack.layer(i)``."""
  pattern = _pattern_of(stack) is not None
  raise TypeError(
    f"{type(stack).__name__!r} object is not subscriptable: layer {i!r} of the stack is "
    f"`stack.layer({i!r})` (a copy of it), and `sr.unstack(stack)` gives every layer"
    + (", and `stack.pattern[k]` is the stack of position k." if pattern else ".")
  )


def init_axes(what: str, init_in_axes, args: tuple) -> tuple:
  """``init_in_axes`` as one entry per positional constructor argument."""
  axes = (
    tuple(init_in_axes) if isinstance(init_in_axes, (tuple, list)) else (init_in_axes,) * len(args)
  )
  if len(axes) != len(args):
    raise TransformError(
      f"{what}: init_in_axes={init_in_axes!r} has {len(axes)} entries for {len(args)} "
      "positional constructor arguments. Fix: one entry (an axis, or None to pass it "
      "whole to every layer) per positional argument."
    )
  return axes


def check_init_leaf(what: str, j: int, axis: int, shape: tuple, length: int | None) -> None:
  """Raises unless constructor argument ``j`` (a leaf of it, of ``shape``) has one entry
  per layer along the ``axis`` that ``init_in_axes`` maps (``length`` None: any number,
  the axis must exist)."""
  if length is None and not -len(shape) <= axis < len(shape):
    raise TransformError(
      f"{what}: init_in_axes maps constructor argument {j} along axis {axis}, one "
      f"slice per layer, but it has shape {shape}, no axis {axis}. Fix: give it a "
      "layer axis there, or None in init_in_axes to pass it whole to every layer."
    )
  if length is not None and (not -len(shape) <= axis < len(shape) or shape[axis] != length):
    raise TransformError(
      f"{what}: init_in_axes maps constructor argument {j} along axis {axis}, one "
      f"slice per layer, so it needs {length} entries there; it has shape {shape}. Fix: "
      f"give it {length} entries at axis {axis} (a leading layer axis), or None in "
      "init_in_axes to pass it whole to every layer."
    )


def cycle(stack) -> tuple:
  """The stacks whose layers make one unit of a loop over ``stack``: a pattern stack's
  position stacks (one cycle: a layer of each, in order), else ``(stack,)``."""
  return tuple(vars(stack)["pattern"]) if _pattern_of(stack) is not None else (stack,)


def _pattern_of(obj) -> type | None:
  """The pattern stack class of ``obj`` (an instance or a class), else None."""
  cls = obj if isinstance(obj, type) else type(obj)
  return cls if cycle_unit(cls) is not None else None
