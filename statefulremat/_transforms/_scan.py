"""sr.scan: ``jax.lax.scan`` over modules, with per-collection rules."""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from ._class_form import display_name, is_module_class
from ._layers import LayerLoop
from ._lift import write_back
from ._rules import Rules, TransformError
from ._module_arg import (check_no_modules, class_length, compiled_when_eager, lift_module_arg,
                          resolve_length, stacked_sources)
from ._stacked import stacked_class

_EMPTY = MappingProxyType({})


def scan(target: Callable | type | None = None, *, variable_axes: Mapping = _EMPTY,
         variable_broadcast: Any = False, variable_carry: Any = False,
         split_rngs: Mapping = _EMPTY, in_axes: Any = 0, out_axes: int = 0,
         length: int | None = None, reverse: bool = False, unroll: int | bool = 1,
         data_transform: Callable | None = None, metadata_params: Mapping = _EMPTY,
         methods: Sequence[str] | None = None):
  """``jax.lax.scan`` over a module: ``scan(f)(module, carry, *xs) -> (carry, ys)``.

  Equivalent to this Python loop over the layers (``sr.unstack``), but traced once::

      for i in range(length):                      # reversed if reverse=True
        carry, y_i = f(layer_i, carry, *(x[i] for x in xs))
      ys = stack(y_i)

  where ``layer_i`` holds slice ``i`` of each variable matched by ``variable_axes``,
  the same value of each ``variable_broadcast`` (and unmatched, read-only) variable,
  and the running value of each ``variable_carry`` variable. RNG streams give every
  iteration its own key when split (``split_rngs``), else the same key. Keyword
  arguments pass unchanged to every iteration (Python flags such as
  ``deterministic=True`` stay Python values). Called outside any trace, the scan is
  compiled once per module structure and reused, as under ``sr.jit``: Python values the
  body closes over are read when it is first traced.

  Args:
    target: ``f(module, carry, *xs) -> (carry, ys)`` (also a method), or a Module
      class: the class form builds ``length`` independently initialised layers in one
      traced init and scans its ``methods`` (default ``__call__``).
    variable_axes: ``{filter: axis}`` — variables sliced along ``axis`` per iteration.
    variable_broadcast: filter of variables read-only in every iteration.
    variable_carry: filter of variables threaded from iteration to iteration.
    split_rngs: ``{stream filter: bool}`` — streams that give each iteration its key.
    in_axes: the scanned axis of each ``xs`` argument (int, ``None`` to broadcast,
      a tuple per argument, or a pytree prefix).
    out_axes: the axis of ``ys`` that stacks the iterations.
    length: the number of iterations; required when nothing else tells it.
    reverse, unroll: as in ``jax.lax.scan``.
    data_transform: ``State -> State`` applied to each iteration's stacked values
      (e.g. ``jax.lax.with_sharding_constraint``); its entries keep their Variable
      kinds and the layer's metadata, so it can filter and read ``sharding``.
    metadata_params: ``{"partition_name": name}`` puts ``name`` into the ``sharding``
      metadata of stacked variables at the layer axis (removed inside the body).
    methods: for a class target, the methods to scan.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> class Layer(sr.Module):
  ...   def __init__(self, *, rngs):
  ...     self.w = sr.Param(jax.random.normal(rngs.params(), (3, 3)))
  ...   def __call__(self, x):
  ...     return jnp.tanh(x @ self.w.value), None
  >>> import jax
  >>> Stack = sr.scan(Layer, length=4, variable_axes={sr.Param: 0},
  ...                 split_rngs={"params": True})
  >>> stack = Stack(rngs=sr.Rngs(0))
  >>> stack.w.shape
  (4, 3, 3)
  >>> y, _ = stack(jnp.ones((2, 3)))
  >>> x = jnp.ones((2, 3))
  >>> for layer in sr.unstack(stack):
  ...   x, _ = layer(x)
  >>> bool(jnp.allclose(x, y, atol=1e-6))
  True
  """
  options = dict(variable_axes=variable_axes, variable_broadcast=variable_broadcast,
                 variable_carry=variable_carry, split_rngs=split_rngs, in_axes=in_axes,
                 out_axes=out_axes, length=length, reverse=reverse, unroll=unroll,
                 data_transform=data_transform, metadata_params=metadata_params)
  if target is None:
    return functools.partial(scan, methods=methods, **options)
  if is_module_class(target):
    rules = Rules(f"sr.scan({target.__name__})", variable_axes=variable_axes,
                  variable_broadcast=variable_broadcast, variable_carry=variable_carry,
                  split_rngs=split_rngs)
    return stacked_class(target, "Scan", rules=rules, length=length,
                         # At call time the layer count comes from the stacked
                         # variables (a stack rebuilt by sr.stack may have another).
                         wrap=lambda m: scan(m, **{**options, "length": None}),
                         methods=methods,
                         metadata_params=metadata_params)
  if methods is not None:
    raise TypeError("sr.scan(methods=...) applies to a Module class, not a function.")
  return _scan_function(target, **options)


def _axes_per_leaf(in_axes, xs: tuple, what: str) -> list:
  if isinstance(in_axes, int) or in_axes is None:
    prefix = tuple(in_axes for _ in xs)
  elif isinstance(in_axes, (tuple, list)) and len(in_axes) == len(xs):
    prefix = tuple(in_axes)
  else:
    raise TransformError(
        f"{what}: in_axes={in_axes!r} does not fit {len(xs)} xs argument(s): give an int, "
        "None, or a tuple with one entry (an int, None or a pytree prefix) per argument.")
  out = []
  for axes, x in zip(prefix, xs):
    try:
      jax.tree.map(lambda a, sub: out.extend([a] * len(jax.tree.leaves(sub))), axes, x,
                   is_leaf=lambda a: a is None)
    except ValueError:
      raise TransformError(
          f"{what}: in_axes entry {axes!r} is not a prefix of its argument's structure "
          f"{jax.tree.structure(x)}.") from None
  return out


def _scan_function(fn: Callable, *, variable_axes, variable_broadcast, variable_carry,
                   split_rngs, in_axes, out_axes, length, reverse, unroll,
                   data_transform, metadata_params) -> Callable:
  what = f"sr.scan({display_name(fn)})"
  rules = Rules(what, variable_axes=variable_axes, variable_broadcast=variable_broadcast,
                variable_carry=variable_carry, split_rngs=split_rngs)
  if not isinstance(out_axes, int):
    raise TypeError(f"{what}: out_axes must be an int (the axis of ys that stacks the "
                    f"iterations), got {out_axes!r}.")

  @functools.wraps(fn)
  def wrapper(module, carry, *xs, **kwargs):
    check_no_modules(carry, what, "the carry")
    check_no_modules(xs, what, "the xs argument")
    check_no_modules(kwargs, what, "the keyword argument")
    lifted, variables, plan, leaves = lift_module_arg(
        module, what, rules, metadata_params, "f(module, carry, *xs) -> (carry, ys)")
    x_leaves, x_tree = jax.tree.flatten(xs)
    axes = _axes_per_leaf(in_axes, xs, what)
    scanned, sources = [], []
    for j, (x, axis) in enumerate(zip(x_leaves, axes)):
      if axis is None:
        continue
      ndim = jnp.ndim(x)
      if not -ndim <= axis < ndim:
        raise TransformError(
            f"{what}: in_axes puts the scanned axis of xs leaf {j} at {axis}, but it has "
            f"shape {tuple(jnp.shape(x))}. Fix in_axes, or use None to broadcast it.")
      scanned.append(j)
      sources.append((f"xs leaf {j} (axis {axis})", jnp.shape(x)[axis]))
    n = resolve_length(what, length, sources + stacked_sources(plan, lifted, variables),
                       fallback=class_length(module))
    loop = LayerLoop(lifted, plan, variables, leaves, what, data_transform)

    def body(tree, c, x_scanned):
      full = list(x_leaves)
      for j, x in zip(scanned, x_scanned):
        full[j] = x
      out = fn(tree[0][0], c, *jax.tree.unflatten(x_tree, full), **kwargs)
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        # Name what came back in user terms: a tracer's class name means nothing here.
        got = ("a single array" if isinstance(out, jax.Array) else
               f"a {type(out).__name__} of length {len(out)}"
               if isinstance(out, (tuple, list)) else f"a {type(out).__name__}")
        raise TypeError(f"{what}: the body must return a pair (carry, ys), got {got}. "
                        "Return `carry, None` if there are no ys.")
      return tuple(out)

    moved = [jnp.moveaxis(x_leaves[j], axes[j], 0) for j in scanned]
    carry, ys, changed = loop.run(body, carry, moved, (n,), reverse=reverse, unroll=unroll)
    write_back(variables, changed, what)
    if out_axes != 0:
      ys = jax.tree.map(lambda y: jnp.moveaxis(y, 0, out_axes), ys)
    return carry, ys

  return compiled_when_eager(wrapper)
