"""sr.vmap: ``jax.vmap`` over modules — stacked init and vectorised application."""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from ..core._errors import format_path
from ..core._filters import filter_repr
from ..core._stacks import layer_axis
from ..core._tracing import tracing_user_code
from ._class_form import display_name, is_module_class
from ._lift import check_no_nodes, write_back
from ._rules import STACKED, Rules, TransformError
from ._module_arg import (check_no_modules, class_length, compiled_when_eager, lift_module_arg,
                          resolve_length, stacked_sources)
from ._stacked import stacked_class

_ALL = MappingProxyType({True: 0})
_SPLIT_ALL = MappingProxyType({True: True})


def vmap(target: Callable | type | None = None, *, in_axes: Any = 0, out_axes: Any = 0,
         axis_size: int | None = None, axis_name: str | None = None,
         variable_axes: Mapping = _ALL, split_rngs: Mapping = _SPLIT_ALL,
         variable_broadcast: Any = False, metadata_params: Mapping = MappingProxyType({}),
         methods: Sequence[str] | None = None):
  """``jax.vmap`` over a module: ``vmap(f)(module, *args)``; or a stacked init.

  Function form: equivalent to ``stack([f(layer_i, *args_i) for i ...])`` where
  ``layer_i`` holds slice ``i`` of each variable matched by ``variable_axes`` (default:
  every variable not broadcast), and the same value of each broadcast one. ``in_axes`` /
  ``out_axes`` describe the non-module positional arguments and the outputs, as in
  ``jax.vmap``; keyword arguments pass unmapped to every layer (e.g. Python flags).
  Under the default ``variable_axes`` only a stack's Variables (those carrying a layer
  axis) are mapped: a plain module's parameters raise rather than hand each example
  one slice of them. Per-example use of one module is ``variable_broadcast=True``;
  explicit ``variable_axes`` map what they name.

  Class form: ``sr.vmap(Block, axis_size=8)(*args, rngs=...)`` builds 8 independently
  initialised layers (an ensemble) in one traced init; calling it maps ``methods``
  (default ``__call__``) over the layers.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> Ensemble = sr.vmap(sr.nn.Linear, axis_size=5, in_axes=None)
  >>> ensemble = Ensemble(3, 2, rngs=sr.Rngs(0))
  >>> ensemble.kernel.shape, ensemble(jnp.ones((4, 3))).shape
  ((5, 3, 2), (5, 4, 2))
  >>> linear = sr.nn.Linear(3, 2, rngs=sr.Rngs(0))      # one module, per example:
  >>> sr.vmap(lambda m, x: m(x), variable_broadcast=True)(linear, jnp.ones((4, 3))).shape
  (4, 2)
  """
  options = dict(in_axes=in_axes, out_axes=out_axes, axis_size=axis_size,
                 axis_name=axis_name, variable_axes=variable_axes, split_rngs=split_rngs,
                 variable_broadcast=variable_broadcast, metadata_params=metadata_params)
  if target is None:
    return functools.partial(vmap, methods=methods, **options)
  what = f"sr.vmap({display_name(target)})"
  rules = Rules(what, variable_axes=variable_axes, variable_broadcast=variable_broadcast,
                variable_carry=False, split_rngs=split_rngs)
  if is_module_class(target):
    return stacked_class(target, "Vmap", rules=rules, length=axis_size,
                         wrap=lambda m: vmap(m, **{**options, "axis_size": None}),
                         methods=methods,
                         metadata_params=metadata_params)
  if methods is not None:
    raise TypeError("sr.vmap(methods=...) applies to a Module class, not a function.")
  if getattr(target, "__name__", None) == "__init__":
    owner = getattr(target, "__qualname__", "__init__").rsplit(".", 1)[0]
    raise TypeError(
        f"sr.vmap on `{owner}.__init__` would map a constructor: the function form maps "
        "an existing module's variables, and a constructor has none yet (it creates "
        "them). Fix: decorate nothing, and build the stacked (ensemble) class with the "
        f"class form, `sr.vmap({owner}, axis_size=n)(...)`: each member is initialised "
        "with its own RNG keys (the `params` stream split) in one traced init.")
  return _vmap_function(target, what=what, rules=rules, **options)


def _vmap_function(fn: Callable, *, what, rules, in_axes, out_axes, axis_size, axis_name,
                   variable_axes, split_rngs, variable_broadcast, metadata_params):

  @functools.wraps(fn)
  def wrapper(module, *args, **kwargs):
    check_no_modules(args, what, "the argument")
    check_no_modules(kwargs, what, "the keyword argument")
    lifted, variables, plan, leaves = lift_module_arg(
        module, what, rules, metadata_params, "f(module, *args)")
    values = [v._value for v in variables]
    stacked = plan.indices(STACKED)
    if variable_axes is _ALL:
      _refuse_mapping_plain(what, lifted, plan, variables, stacked)
    arg_axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(arg_axes) != len(args):
      raise TransformError(f"{what}: in_axes={in_axes!r} has {len(arg_axes)} entries for "
                           f"{len(args)} arguments (the module excluded).")
    sources = stacked_sources(plan, lifted, variables)
    for j, (a, ax) in enumerate(zip(args, arg_axes)):
      if isinstance(ax, int):
        for leaf in jax.tree.leaves(a):
          if not -jnp.ndim(leaf) <= ax < jnp.ndim(leaf):
            raise TransformError(
                f"{what}: in_axes puts the mapped axis of argument {j + 1} at {ax}, but a "
                f"leaf has shape {tuple(jnp.shape(leaf))}. Fix in_axes (None broadcasts).")
          sources.append((f"argument {j + 1} (axis {ax})", jnp.shape(leaf)[ax]))
    if axis_size is not None:
      sources.insert(0, (f"axis_size={axis_size}", int(axis_size)))
    if not sources and class_length(module) is not None:
      sources.append(("the stack's axis_size", class_length(module)))
    if not sources:
      raise TransformError(
          f"{what}: cannot tell the size of the mapped axis: no argument is mapped "
          "(in_axes is None for all) and no variable is stacked. Pass `axis_size=`.")
    n = resolve_length(what, None, sources)
    used: set[int] = set()

    def one(stacked_values, index, call_args):
      flat = list(values)
      for i, value in zip(stacked, stacked_values):
        flat[i] = value
      served = plan.seed_layer(flat, values, index)
      with tracing_user_code(what):
        tree, rebuilt, roots = lifted.rebuild(flat, leaves)
        plan.serve_names(served, rebuilt, index)
        out = fn(tree[0][0], *call_args, **kwargs)
      check_no_nodes(out, what)
      changed = lifted.collect(roots, flat, what)
      counts = {s.count for s in plan.streams}
      for i in changed:
        if i in counts:
          used.add(i)
        elif plan.kinds[i] != STACKED:
          var = variables[i]
          path = lifted.graphdef.var_paths[i]
          raise TransformError(
              f"{what}: the function wrote to `{var.path_str() or path}` "
              f"({type(var).__name__}, collection {var.collection!r}), which is not mapped "
              "(broadcast or matched by no rule), so each layer's write would disagree. "
              f"Fix: map it with `variable_axes={{{var.collection!r}: 0}}`.")
      return out, {i: changed[i] for i in stacked if i in changed}

    stacked_in = [values[i] for i in stacked]
    mapped = jax.vmap(one, in_axes=([plan.axes[i] for i in stacked], 0, tuple(arg_axes)),
                      out_axes=(out_axes, 0), axis_size=n, axis_name=axis_name)
    out, written = mapped(stacked_in, jnp.arange(n, dtype=jnp.uint32), args)
    plan.check_stream_names()
    changed = {i: jnp.moveaxis(v, 0, plan.axes[i]) for i, v in written.items()}
    for i in used:
      changed[i] = values[i] + jnp.uint32(1)
    write_back(variables, changed, what)
    return out

  return compiled_when_eager(wrapper)


def _refuse_mapping_plain(what, lifted, plan, variables, stacked) -> None:
  """Under the default ``variable_axes``, mapping a Variable that carries no layer axis
  would hand each example one row of a parameter: the per-example case
  (``sr.vmap(lambda m, x: m(x))(linear, xs)``) computes wrong numbers of the right
  shape. Only Variables of a stack (layer axis in their metadata) map by default."""
  for i in stacked:
    var = variables[i]
    if layer_axis(var) is not None:
      continue
    path = format_path(plan.display_path(lifted.graphdef.var_paths[i]))
    kind = filter_repr(type(var))
    raise TransformError(
        f"{what}: `{path}` ({type(var).__name__}, shape {tuple(jnp.shape(var._value))}) belongs to a "
        "plain module and carries no layer axis, but the default variable_axes="
        "{True: 0} would map its axis 0 alongside the inputs, giving each example one "
        "slice of it. Nothing was run. Fix: to apply the same module to every example, "
        "pass `variable_broadcast=True` (read-only; or e.g. "
        f"`variable_broadcast={kind}`); for an ensemble of independently initialised "
        "modules, build it with the class form (`sr.vmap(Block, axis_size=n)(...)`) or "
        "`sr.stack(layers)`; to map this variable on purpose, give the rule explicitly "
        f"(`variable_axes={{{kind}: 0}}`).")
