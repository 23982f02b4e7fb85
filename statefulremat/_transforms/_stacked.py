"""Stacked modules: the class forms of scan, remat_scan and vmap.

``sr.scan(Block, length=12, ...)`` returns ``ScanBlock``, a subclass of ``Block``
whose constructor builds all 12 layers in ONE traced init (``jax.vmap`` over the layer
index, each layer drawing its own keys from the split RNG streams) and whose methods
run under the transform. The result is an instance of the layer class whose stacked
variables carry the layer axis; ``stack.layer(i)``, ``sr.unstack`` and ``sr.stack``
move between it and ordinary single-layer modules.

Constructor arguments pass unmapped to every layer's ``__init__``; only RNG streams
are split (per ``split_rngs``). Inside a transformed method the module is one layer: an
instance of the plain layer class, the layer axis (and its partition name) removed.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from .._errors import format_path
from .._graph import flatten, rewrite, type_change, unflatten
from .._module import Module
from .._variables import Variable
from .._state import freeze, thaw_metadata
from ._class_form import subclass, transform_name
from ._lift import Lifted, first_difference, describe_change, split_call, write_back
from ._rules import READONLY, STACKED, Plan, Rules, TransformError


def is_stacked(module) -> bool:
  return isinstance(module, Module) and "_sr_layer_class" in type(module).__dict__


def partition_metadata(metadata_params: dict, plan: Plan, *, insert: bool):
  """A ``rewrite`` metadata function adding (or removing) the partition name."""
  name = (metadata_params or {}).get("partition_name")
  if name is None:
    return None

  def edit(i, frozen):
    if plan.kinds[i] != STACKED:
      return frozen
    meta = thaw_metadata(frozen)
    sharding = meta.get("sharding")
    if sharding is None:
      return frozen
    sharding = list(sharding)
    axis = plan.axes[i]
    if insert:
      sharding.insert(axis, name)
    elif axis < len(sharding) and sharding[axis] == name:
      del sharding[axis]
    meta["sharding"] = tuple(sharding)
    return freeze(meta)

  return edit


def layer_view(graphdef, plan: Plan, metadata_params: dict | None = None):
  """The GraphDef of one layer of a stack: plain layer class, no partition name.

  Every stacked root becomes its layer class (a transform may map a tuple of stacks,
  and each must be one layer inside). The partition name is the one given, else that
  of the first stacked root.
  """
  classes = {}
  for j, root in enumerate(graphdef.tree):
    if isinstance(root[1], type) and "_sr_layer_class" in root[1].__dict__:
      classes[j] = root[1]._sr_layer_class
      if not metadata_params:
        metadata_params = root[1]._sr_metadata_params
  return rewrite(graphdef, root_classes=classes,
                 metadata=partition_metadata(metadata_params, plan, insert=False))


def stacked_class(layer_cls: type, label: str, *, rules: Rules, length: int | None,
                  wrap: Callable, methods: Sequence[str] | None,
                  metadata_params: dict) -> type:
  """The class form: ``{label}{layer_cls}`` building and running a stack of layers."""
  namespace: dict[str, Any] = {
      "_sr_layer_class": layer_cls, "_sr_rules": rules, "_sr_length": length,
      "_sr_metadata_params": dict(metadata_params or {}),
      "__new__": _new_stack, "__init__": _init_nothing, "layer": _layer,
      "__len__": _len,
  }
  return subclass(layer_cls, label, wrap, methods, namespace,
                  f"A stack of {layer_cls.__name__} layers under {transform_name(label)}.")


def _init_nothing(self, *args, **kwargs):
  """The stack was built by ``__new__``."""


def _new_stack(cls, *args, **kwargs):
  return build_stack(cls, args, kwargs)


def build_stack(cls: type, args: tuple, kwargs: dict):
  """Builds ``cls._sr_length`` layers of ``cls._sr_layer_class`` in one vmapped init."""
  rules: Rules = cls._sr_rules
  length = cls._sr_length
  what = f"sr.{cls.__name__}(...)"
  nodes, leaves, treedef, positions = split_call(args, kwargs)
  in_graphdef, in_vars = flatten(nodes)
  lifted = Lifted(in_graphdef, treedef, positions)
  in_plan = Plan(rules.for_init(), in_graphdef, in_vars, nodes)
  in_values = [v._value for v in in_vars]
  n_in = len(in_vars)
  record: dict[str, Any] = {}

  def init_one(index):
    flat = list(in_values)
    served = in_plan.seed_layer(flat, in_values, index)
    tree, rebuilt, roots = lifted.rebuild(flat, leaves)
    in_plan.serve_names(served, rebuilt, index)
    call_args, call_kwargs = tree
    layer = cls._sr_layer_class(*call_args, **call_kwargs)
    counts = {s.count for s in in_plan.streams}
    changed = lifted.collect(roots, flat, what)
    for i in changed:
      if i not in counts:
        raise TransformError(
            f"{what}: the layer constructor wrote to `{format_path(in_graphdef.var_paths[i])}`"
            " of an argument. Constructor arguments are shared by every layer and "
            "read-only; only RNG streams may be drawn from.")
    record["used"] = [s.count for s in in_plan.streams if s.count in changed]
    graphdef, variables = flatten(list(roots) + [layer])
    record["graphdef"] = graphdef
    new_vars = variables[n_in:]
    prefix = len(roots)
    # RNG streams the layer creates itself become per-layer state: classified by the
    # rules like any variable, not split like the streams passed in.
    # rank_offset=1: the axes index the stacked value, which has one more axis than
    # a layer's (variable_axes={Param: -1} puts the layer axis last).
    plan = Plan(rules, graphdef, variables, [layer], rng_streams=False, skip=n_in,
                rank_offset=1,
                display_path=lambda p: p[1:] if p and p[0] == prefix else p)
    record["plan"] = plan
    return [v._value for v in new_vars]

  jax.eval_shape(init_one, jnp.uint32(0))
  plan: Plan = record["plan"]
  stacked = [k == STACKED for k in plan.kinds[n_in:]]
  if length is None:
    if any(stacked):
      first = plan.kinds.index(STACKED)
      raise TransformError(
          f"{what}: `{format_path(plan.display_path(record['graphdef'].var_paths[first]))}` "
          "is stacked by variable_axes, so the number of layers must be known at init: "
          f"pass `length=` (or `axis_size=`) to the transform.")
    values = init_one(jnp.uint32(0))
  else:
    out_axes = [plan.axes[n_in + j] if s else None for j, s in enumerate(stacked)]
    try:
      values = jax.vmap(init_one, out_axes=out_axes, axis_size=length)(
          jnp.arange(length, dtype=jnp.uint32))
    except ValueError as e:
      if "out_axes" not in str(e):
        raise
      raise TransformError(
          f"{what}: a variable that is not stacked (broadcast, carried or read-only) came "
          "out different for each layer, usually because its initializer drew from a "
          "split RNG stream. Stack it with variable_axes, or do not split the stream it "
          f"draws from (e.g. split_rngs={{'params': False}}). JAX said: {e}") from None
  graphdef = rewrite(
      record["graphdef"], root_classes={-1: cls},
      metadata=partition_metadata(cls._sr_metadata_params, plan, insert=True))
  objects: list = []
  flatten(nodes, objects=objects)
  roots, _ = unflatten(graphdef, [None] * n_in + list(values), substitute=objects)
  write_back(in_vars, {i: in_values[i] + jnp.uint32(1) for i in record["used"]}, what)
  return roots[-1]


def stack_plan(stack) -> tuple:
  graphdef, variables = flatten([stack])
  plan = Plan(type(stack)._sr_rules, graphdef, variables, [stack])
  return graphdef, variables, plan


def _len(self) -> int:
  """The number of layers."""
  _, variables, plan = stack_plan(self)
  for v, kind, axis in zip(variables, plan.kinds, plan.axes):
    if kind == STACKED:
      return jnp.shape(v._value)[axis]
  if type(self)._sr_length is not None:
    return type(self)._sr_length
  raise TypeError(f"{type(self).__name__} has no stacked variables, so no layer count.")


def _layer(self, i: int):
  """Layer ``i`` as an ordinary module of the layer class (a copy).

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> Stack = sr.vmap(sr.nn.Linear, axis_size=3)
  >>> stack = Stack(2, 2, rngs=sr.Rngs(0))
  >>> len(stack), type(stack.layer(1)).__name__, stack.layer(1).kernel.shape
  (3, 'Linear', (2, 2))
  """
  n = len(self)
  if not -n <= i < n:
    raise IndexError(f"layer {i} of a stack of {n} layers: use 0..{n - 1} (or -{n}..-1).")
  i %= n
  graphdef, variables, plan = stack_plan(self)
  values = [jnp.take(v._value, i, axis=axis) if kind == STACKED else v._value
            for v, kind, axis in zip(variables, plan.kinds, plan.axes)]
  view = layer_view(graphdef, plan)
  roots, _ = unflatten(view, values)
  roots[0].__dict__["_sr_stacked_from"] = type(self)
  roots[0].__dict__["_sr_stacked_paths"] = {
      p: a for p, kind, a in zip(graphdef.var_paths, plan.kinds, plan.axes)
      if kind == STACKED}
  return roots[0]


def _layer_difference(first, other, g0, g1) -> str:
  """The first place two layers differ in structure, with both values if static."""
  found = None
  for i, (a, b) in enumerate(zip(g0.tree, g1.tree)):
    found = first_difference(a, b, ())
    if found is not None:
      break
  if found is None:
    return describe_change(g0, g1)
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
  return [stack.layer(i) for i in range(len(stack))]


def stack(layers: Sequence[Module], *, like: Any = None):
  """Stacks equally structured layers into a stacked module; undoes ``sr.unstack``.

  The stacked class comes from ``like`` (a stacked module or class) or from the
  layers themselves when they came out of ``sr.unstack`` / ``stack.layer``.

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
            f"dtype of layer 0's: {why.replace(' -> ', f' (layer 0) vs ')} (layer {i}). "
            "Only identical layers can be stacked: build them with the same sizes.")
  plan = Plan(cls._sr_rules, graphdef, variables, [layers[0]], rank_offset=1)
  # Which variables the source stack held stacked (an RNG stream a layer made itself
  # is stacked; one passed to the constructor is shared): known from the layers' origin.
  if isinstance(like, Module):
    like_graphdef, _, like_plan = stack_plan(like)
    known = {p: a for p, k, a in zip(like_graphdef.var_paths, like_plan.kinds,
                                     like_plan.axes) if k == STACKED}
  else:
    marks = [layer.__dict__.get("_sr_stacked_paths") for layer in layers]
    known = marks[0] if all(m == marks[0] for m in marks) else None
  if known is not None:
    for j, path in enumerate(graphdef.var_paths):
      if path in known:
        plan.kinds[j], plan.axes[j] = STACKED, known[path]
      elif plan.kinds[j] == STACKED:
        plan.kinds[j], plan.axes[j] = READONLY, None
  values = []
  for j, (kind, axis) in enumerate(zip(plan.kinds, plan.axes)):
    column = [flat[1][j]._value for flat in flats]
    values.append(jnp.stack(column, axis=axis) if kind == STACKED else column[0])
  graphdef = rewrite(graphdef, root_classes={0: cls},
                     metadata=partition_metadata(cls._sr_metadata_params, plan, insert=True))
  roots, _ = unflatten(graphdef, values)
  return roots[0]
