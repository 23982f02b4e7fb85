"""Stacked modules: the class forms of scan, remat_scan and vmap, a subclass of the layer
class whose constructor builds every layer in one vmapped init (README.md)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from ..core._bookkeeping import SPLITS
from ..core._errors import StatefulRematError, TransformError, format_path
from ..core._graph import flatten, rewrite
from ..core._graph_build import unflatten
from ..core._stacks import (
  LAYER_AXIS,
  Form,
  Layer,
  StackInfo,
  check_init_leaf,
  init_axes,
  layer,
  layer_graphdef,
  mark_frozen,
  not_subscriptable,
  num_layers,
  stack_info,
  unmark,
)
from ..core._state import freeze, thaw_metadata
from ._class_form import transform_name
from ._lift import commit, lift
from ._outputs import is_node
from ._rules import STACKED, Rules, Treatment


def layer_view(graphdef, treatment: Treatment, metadata_params: dict | None = None):
  """The GraphDef of one layer of the lifted modules (layer classes, no layer axes)."""
  name = (metadata_params or {}).get("partition_name")

  def edit(i, frozen):
    if treatment.kinds[i] != STACKED:
      return frozen
    meta = thaw_metadata(frozen)
    if LAYER_AXIS not in meta:
      if name is None:
        return frozen
      meta[LAYER_AXIS] = ((treatment.axes[i], name),)
    return freeze(unmark(meta))

  return layer_graphdef(graphdef, edit)


def stack_namespace(layer_cls: type, rules: Rules) -> dict[str, Any]:
  """What a stacked class of ``layer_cls`` adds: construction, ``layer(i)``, ``len``, pickling."""

  def splits(cls, name: str) -> bool:
    return rules.splits(name)

  splits.__name__ = splits.__qualname__ = SPLITS  # pickled by name: getattr(cls, SPLITS)
  namespace: dict[str, Any] = {
    "__new__": build_stack,
    "__init__": _init_nothing,
    "layer": layer,
    "__len__": num_layers,
    "__reduce__": _reduce_stack,
    SPLITS: classmethod(splits),
  }
  if not hasattr(layer_cls, "__getitem__"):  # a layer class's own indexing stays
    namespace["__getitem__"] = not_subscriptable
  return namespace


def _reduce_stack(self):
  """Pickles and copies a stack as its class and state, not by the layer-building ``__new__``."""
  return object.__new__, (type(self),), self.__getstate__()


def _init_nothing(self, *args, **kwargs):
  """The stack was built by ``__new__``."""


def build_stack(cls: type, *args, **kwargs):
  """``__new__`` of a stacked class: builds its layers in one vmapped init."""
  info = stack_info(cls)
  assert info is not None and isinstance(info.rules, Rules) and isinstance(info.unit, Layer)
  rules, length, what, make = info.rules, info.length, info.what, info.unit.maker()
  mapped, length = _mapped_leaves(what, info.init_in_axes, args, length)
  lifted, in_vars, leaves, nodes = lift(args, kwargs)
  in_treatment = Treatment(rules.for_init(), lifted.graphdef, in_vars, nodes)
  in_values = [v._value for v in in_vars]
  n_in = len(in_vars)
  record: dict[str, Any] = {}

  def init_one(index, slices=(), which=mapped):
    mine = list(leaves)
    for (k, _), value in zip(which, slices):
      mine[k] = value
    layer, changes = lifted.run(make, list(in_values), mine, what, seed=(in_treatment, index))
    roots, changed = changes.roots, changes.values
    counts = {s.count for s in in_treatment.streams}
    for i in changed:
      if i not in counts:
        raise TransformError(
          f"{what}: the layer constructor wrote to `{format_path(lifted.graphdef.var_paths[i])}`"
          " of an argument. Constructor arguments are shared by every layer and "
          "read-only; only RNG streams may be drawn from."
        )
    record["used"] = [s.count for s in in_treatment.streams if s.count in changed]
    graphdef, variables = flatten(list(roots) + [layer])
    record["graphdef"] = graphdef
    prefix = len(roots)
    # RNG streams the layer creates itself become per-layer state: classified by the
    # rules like any variable, not split like the streams passed in.
    # rank_offset=1: the axes index the stacked value, which has one more axis than
    # a layer's (variable_axes={Param: -1} puts the layer axis last).
    treatment = Treatment(
      rules,
      graphdef,
      variables,
      [layer],
      rng_streams=False,
      skip=n_in,
      rank_offset=1,
      display_path=lambda p: p[1:] if p and p[0] == prefix else p,
    )
    record["treatment"] = treatment
    return [v._value for v in variables[n_in:]]

  firsts = [jnp.take(leaves[k], 0, axis=axis) for k, axis in mapped]
  try:
    jax.eval_shape(init_one, jnp.uint32(0), firsts)
  except StatefulRematError:
    raise
  except Exception as e:
    # Nothing was written yet (the streams advance at the end): refusing leaves the
    # caller's objects as they were.
    _refuse_broadcast_argument(info, args, kwargs, leaves, mapped, firsts, length, init_one, e)
    raise
  in_treatment.check_stream_names()
  treatment: Treatment = record["treatment"]
  stacked = [k == STACKED for k in treatment.kinds[n_in:]]
  if length is None:
    if any(stacked):
      first = treatment.kinds.index(STACKED)
      raise TransformError(
        f"{what}: `{format_path(treatment.display_path(record['graphdef'].var_paths[first]))}` "
        "is stacked by variable_axes, so the number of layers must be known at init: "
        f"pass `length=` (or `axis_size=`) to the transform."
      )
    values = init_one(jnp.uint32(0), firsts)
  else:
    out_axes = [treatment.axes[n_in + j] if s else None for j, s in enumerate(stacked)]
    try:
      values = jax.vmap(
        init_one, in_axes=(0, [axis for _, axis in mapped]), out_axes=out_axes, axis_size=length
      )(jnp.arange(length, dtype=jnp.uint32), [leaves[k] for k, _ in mapped])
    except ValueError as e:
      if "out_axes" not in str(e):
        raise
      kept = [
        format_path(treatment.display_path(record["graphdef"].var_paths[n_in + j]))
        for j, s in enumerate(stacked)
        if not s
      ]
      named = ", ".join(f"`{p}`" for p in kept[:3]) + (" …" if len(kept) > 3 else "")
      default = (
        " sr.scan's class form stacks only what variable_axes names (by default "
        "nothing, as flax.linen's nn.scan); `variable_axes={True: 0}` stacks every "
        "Variable, as sr.remat_scan's and sr.vmap's defaults do."
        if info.form is Form.SCAN and not rules.axes
        else ""
      )
      raise TransformError(
        f"{what}: a variable that is not stacked (broadcast, carried or read-only; here "
        f"{named}) came out different for each layer, usually because its initializer "
        "drew from a split RNG stream. Stack it with variable_axes, or do not split the "
        f"stream it draws from (e.g. split_rngs={{'params': False}}).{default} JAX said: {e}"
      ) from None
  name = info.partition_name
  graphdef = rewrite(
    record["graphdef"],
    root_classes={-1: cls},
    metadata=lambda i, m: (
      mark_frozen(m, treatment.axes[i], name) if treatment.kinds[i] == STACKED else m
    ),
  )
  objects: list = []
  flatten(nodes, objects=objects)
  roots, _ = unflatten(graphdef, [None] * n_in + list(values), substitute=objects)
  commit(in_vars, {}, what, streams=record["used"])
  return roots[-1]


def _mapped_leaves(
  what: str, init_in_axes, args: tuple, length: int | None
) -> tuple[list[tuple[int, int]], int | None]:
  """``(leaf number, axis)`` of each leaf ``init_in_axes`` maps, and the number of layers."""
  if init_in_axes is None:
    return [], length
  out, k = [], 0
  for j, (arg, axis) in enumerate(zip(args, init_axes(what, init_in_axes, args))):
    for leaf in jax.tree.leaves(arg, is_leaf=is_node):
      if is_node(leaf):
        if axis is not None:
          raise TransformError(
            f"{what}: init_in_axes maps constructor argument {j}, which holds a "
            f"{type(leaf).__name__}. Fix: give it None (modules and RNG streams pass to "
            "every layer; streams are split by split_rngs)."
          )
        continue
      if axis is not None:
        shape = tuple(jnp.shape(leaf))
        if length is None and -len(shape) <= axis < len(shape):
          length = shape[axis]
        check_init_leaf(what, j, axis, shape, length)
        out.append((k, axis))
      k += 1
  if length is None:
    raise TransformError(
      f"{what}: init_in_axes maps constructor arguments per layer, but maps no array "
      "here, so the number of layers is unknown: pass `length=` (or `axis_size=`) to "
      "the transform."
    )
  return out, length


def _refuse_broadcast_argument(
  info: StackInfo, args, kwargs, leaves, mapped, firsts, length, init_one, error: Exception
) -> None:
  """Raises naming the array argument whose slice along axis 0 would let the init trace."""
  taken = {k for k, _ in mapped}
  paths = [
    path
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_node)[0]
    if not is_node(leaf)
  ]
  candidates: dict[tuple, list[int]] = {}  # (positional?, index or name) -> leaf numbers
  for k, (leaf, path) in enumerate(zip(leaves, paths)):
    shape = jnp.shape(leaf) if isinstance(leaf, (jax.Array, np.ndarray)) else ()
    if k in taken or not shape or (length is not None and shape[0] != length):
      continue
    where = path[1]
    key = (True, where.idx) if path[0].idx == 0 else (False, getattr(where, "key", where))
    candidates.setdefault(key, []).append(k)
  culprits = []
  for key, ks in list(candidates.items())[:8]:
    try:
      jax.eval_shape(
        functools.partial(init_one, which=mapped + [(k, 0) for k in ks]),
        jnp.uint32(0),
        firsts + [jnp.take(leaves[k], 0, axis=0) for k in ks],
      )
    except Exception:
      continue
    culprits.append(key)
  if not culprits:
    return
  unit = cast(Layer, info.unit)
  try:  # the constructor's positional parameters, named where its signature tells
    params = [
      p.name
      for p in inspect.signature(unit.maker()).parameters.values()
      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
  except (TypeError, ValueError):
    params = []
  names = [params[j] if j < len(params) else f"argument {j}" for j in range(len(args))]
  positional = [key[1] for key in culprits if key[0]]
  keywords = [key[1] for key in culprits if not key[0]]
  named = " and ".join([f"`{names[i]}`" for i in positional] + [f"`{k}`" for k in keywords])
  first = leaves[candidates[culprits[0]][0]]
  shape, dtype = tuple(jnp.shape(first)), jnp.result_type(first)
  count = f"every one of the {length} layers" if length is not None else "every layer"
  transform = transform_name(info.form.value)
  layer = unit.cls.__name__
  said = str(error).splitlines()[0] if str(error) else ""
  if positional:
    axes = (
      "0"
      if len(positional) == len(args)
      else "(" + ", ".join("0" if j in positional else "None" for j in range(len(args))) + ")"
    )
    fix = (
      f"pass `init_in_axes={axes}` to {transform}, so layer i gets slice i of {named}"
      + (" (the number of layers is read from it)" if length is None else "")
      + f": `{transform}({layer}, ..., init_in_axes={axes})`"
    )
  else:
    fix = (
      f"init_in_axes maps positional constructor arguments only, so pass {named} "
      f"positionally (made positional in {layer}.__init__ if it is keyword-only), with 0 "
      "at its place in `init_in_axes` and None elsewhere"
    )
  # sr.remat_scan has no in_axes; the others' map the calls, and a user may have
  # meant them for the constructor (nnx's `nnx.vmap(create, in_axes=0)(seeds)`).
  calls = (
    "" if info.form is Form.REMAT_SCAN else "; in_axes maps the stack's calls, not its constructor"
  )
  if info.form is Form.VMAP and positional and not keywords:
    fix += (
      f", or map a function that builds one layer, as nnx does: `sr.vmap(lambda *a: {layer}(*a))`"
    )
  raise TransformError(
    f"{transform}({layer}): constructor argument {named} ({dtype}{list(shape)}) was "
    f"broadcast to {count}, and {layer}.__init__ failed with it ({type(error).__name__}: "
    f"{said}). A class form passes constructor arguments unmapped (only RNG streams "
    f"are split{calls}); with one slice of it each, the layers build. Fix: {fix}."
  ) from error
