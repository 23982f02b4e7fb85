"""sr.scan: ``jax.lax.scan`` over modules, with per-collection rules."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack, overload

import jax
import jax.numpy as jnp

from ..core._frozen import EMPTY
from ..core._module import Module
from ..core._stacks import Form
from ._class_form import M, P, R, Transform, cached_class_form, display_name, fresh, function_target
from ._lift import serialised
from ._module_arg import check_loop_call
from ._outputs import describe_returned
from ._pattern import class_form, target_repr
from ._pattern_loop import lift_loop
from ._rules import Collections, Rules, StackOptions, TransformError, public
from ._scan_axes import broadcast as broadcast  # pickled sr.broadcast named this module
from ._scan_axes import check_axes, in_axes_per_leaf, leaf_path, stack_ys
from .memory._carries import check_carries, warn_if_kept


class _Options(StackOptions, total=False):
  """The keywords of ``scan``, for its overloads (the implementation gives the defaults)."""

  variable_carry: Any
  in_axes: Any
  out_axes: Any
  length: int | None
  reverse: bool
  unroll: int | bool
  carries: str
  data_transform: Callable[..., Any] | None


@overload  # the class form: a stack of M, typed as M (`stack.layer(i)` is an M)
def scan(target: type[M], **options: Unpack[_Options]) -> type[M]: ...
@overload  # a pattern stack, whose positions differ
def scan(
  target: Sequence[type[Module] | functools.partial[Any]], **options: Unpack[_Options]
) -> type: ...
@overload  # the function form: the same signature
def scan(target: Callable[P, R], **options: Unpack[_Options]) -> Callable[P, R]: ...
@overload  # keywords only: a decorator of a class or a function
def scan(target: None = None, **options: Unpack[_Options]) -> Transform: ...
@cached_class_form
def scan(
  target: Callable | type | Sequence[Callable] | None = None,
  *,
  variable_axes: Mapping[Any, Any] = EMPTY,
  variable_broadcast: Any = False,
  variable_carry: Any = False,
  split_rngs: Mapping[Any, Any] = EMPTY,
  in_axes: Any = 0,
  out_axes: Any = 0,
  length: int | None = None,
  reverse: bool = False,
  unroll: int | bool = 1,
  carries: str = "device",
  data_transform: Callable[..., Any] | None = None,
  metadata_params: Mapping[Any, Any] = EMPTY,
  methods: Sequence[str] | None = None,
  init_in_axes: Any = None,
):
  """``jax.lax.scan`` over a module's layers: ``scan(f)(module, carry, *xs) -> (carry, ys)``.

  Args:
    target: ``f(module, carry, *xs) -> (carry, ys)`` (also a method); a Module class
      (the class form: ``length`` layers built in one traced init, its ``methods``
      scanned); a tuple of classes (a pattern); ``None`` makes a decorator.
    variable_axes: ``{filter: axis}``, the variables sliced per iteration (default
      ``{}``; a variable no rule matches is read-only).
    variable_broadcast: filter of variables read-only in every iteration (default ``False``).
    variable_carry: filter of variables threaded through the iterations (default ``False``).
    split_rngs: ``{stream filter: bool}``, the streams that give each iteration its
      own key (default ``{}``: one key for all).
    in_axes: where each ``xs`` leaf is sliced: an int, ``None`` / ``sr.broadcast`` (whole to every
      iteration), or a prefix tree of ``xs``, one entry per argument at the top. Default ``0``.
    out_axes: where the iterations are stacked in each ``ys`` leaf: an int or a prefix
      tree of ``ys``; never ``None``. Default ``0``.
    length: the number of iterations; needed for a class target and when nothing else
      tells it. Default ``None``.
    reverse: run from the last iteration to the first (default ``False``).
    unroll: iterations per loop step, as in ``jax.lax.scan`` (default ``1``).
    carries: where the carries saved for the backward pass live: ``"device"`` (default)
      or ``"offload"`` (host memory).
    data_transform: ``State -> State`` applied to each iteration's stacked values, e.g.
      a ``jax.lax.with_sharding_constraint`` (default ``None``).
    metadata_params: ``{"partition_name": name}``, the layer axis's name in the
      ``sharding`` metadata of stacked variables (default ``{}``).
    methods: for a class target, the methods to scan (default ``None``: ``__call__``).
    init_in_axes: for a class target, the positional constructor arguments that differ
      per layer: an axis, or one entry per argument (default ``None``: all whole).

  Returns:
    For a function, ``scanned(module, carry, *xs, **kwargs) -> (carry, ys)``, which
    writes the body's changes back to ``module``; for a class (or a pattern), the stack
    class ``Scan{Name}``; with no ``target``, a decorator.

  Raises:
    TypeError: a ``target`` that is not callable; ``methods`` / ``init_in_axes`` with a
      function; ``variable_axes`` that is not ``{filter: int}``; at call, argument 0
      not a module, or the body not returning a pair.
    sr.TransformError: bad ``in_axes`` / ``out_axes`` or ``carries``; a variable matched
      by two rules; an unknown or disagreeing iteration count; the carry changing
      structure, shape or dtype; a write to a read-only variable; a name in a rule
      that matches nothing; a list of unstacked layers as argument 0.
    sr.GraphError: a module in the carry, ``xs`` or keyword arguments, or returned.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> class Layer(sr.Module):
  ...   def __init__(self, *, rngs):
  ...     self.w = sr.Param(jax.random.normal(rngs.params(), (3, 3)))
  ...   def __call__(self, x):
  ...     return jnp.tanh(x @ self.w.value), None
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

  A prefix tree gives each leaf its own axis (``xs["b"]`` whole to every iteration):

  >>> def body(layer, c, x):
  ...   c, _ = layer(c + x["a"] + x["b"])
  ...   return c, (c, c.sum(-1))
  >>> xs = {"a": jnp.ones((2, 4, 3)), "b": jnp.zeros((2, 3))}
  >>> c, (cs, sums) = sr.scan(body, variable_axes={sr.Param: 0},
  ...                         in_axes=({"a": 1, "b": None},), out_axes=(0, -1))(
  ...     stack, jnp.ones((2, 3)), xs)
  >>> cs.shape, sums.shape
  ((4, 2, 3), (2, 4))
  """
  collections = Collections(variable_axes, variable_broadcast, variable_carry, split_rngs)
  options: dict[str, Any] = dict(
    collections=collections,
    in_axes=in_axes,
    out_axes=out_axes,
    length=length,
    reverse=reverse,
    unroll=unroll,
    carries=carries,
    data_transform=data_transform,
    metadata_params=metadata_params,
  )
  if target is None:
    return functools.partial(scan, methods=methods, init_in_axes=init_in_axes, **public(options))
  what = f"sr.scan({target_repr(target)})"
  check_axes(what, in_axes, out_axes)
  check_carries(what, carries)
  made = class_form(
    target,
    Form.SCAN,
    what=what,
    rules=lambda: Rules(what, collections),
    count=lambda _: length,
    # At call time the layer count comes from the stacked variables (a stack rebuilt
    # by sr.stack may have another).
    run=lambda fn, _: _scan_function(fn, {**options, "length": None}, from_class_form=True),
    position_class=lambda cls, n: fresh(scan)(
      cls, **{**public(options), "length": n}, methods=methods, init_in_axes=init_in_axes
    ),
    methods=methods,
    metadata_params=metadata_params,
    init_in_axes=init_in_axes,
  )
  if made is not None:
    return made
  fn = function_target(
    "sr.scan",
    target,
    takes="a function f(module, carry, *xs) -> (carry, ys), a Module class or a tuple of "
    "classes (a pattern)",
    methods=methods,
    init_in_axes=init_in_axes,
  )
  return _scan_function(fn, options)


def _scan_function(fn: Callable, options: dict, from_class_form: bool = False) -> Callable:
  """The function form over ``fn``; ``options``: ``scan``'s, with its ``collections``."""
  in_axes, out_axes, length = options["in_axes"], options["out_axes"], options["length"]
  what = f"sr.scan({display_name(fn)})"
  offload = check_carries(what, options["carries"])
  rules = Rules(what, options["collections"])

  @functools.wraps(fn)
  def wrapper(module, carry, *xs, **kwargs):
    usage = "sr.scan(f, variable_axes={sr.Param: 0}, ...)(stack, carry, *xs)"
    check_loop_call(what, usage, module, carry, xs, kwargs, xs="xs")
    x_leaves, x_tree = jax.tree.flatten(xs)
    # Checked before the module is lifted or anything traced.
    axes = in_axes_per_leaf(what, in_axes, xs, len(x_leaves))
    scanned, moved, sources = [], [], []
    for j, (x, axis) in enumerate(zip(x_leaves, axes)):
      if axis is None:
        continue
      ndim = jnp.ndim(x)
      if not -ndim <= axis < ndim:
        raise TransformError(
          f"{what}: in_axes puts the scanned axis of xs leaf {j} at {axis}, but it has "
          f"shape {tuple(jnp.shape(x))} (rank {ndim}) at `xs{leaf_path(xs, j)}`. Fix: "
          f"choose an axis in [-{ndim}, {ndim}), or use None to broadcast it (every "
          "iteration sees it whole)."
        )
      scanned.append(j)
      sources.append((f"xs leaf {j} (axis {axis})", jnp.shape(x)[axis]))
      # Each jnp call is a nested jit; leaves already scanned along axis 0 skip it.
      moved.append(x if axis % ndim == 0 else jnp.moveaxis(x, axis, 0))

    def call(layer, c, x_scanned):
      full = list(x_leaves)
      for j, x in zip(scanned, x_scanned):
        full[j] = x
      out = fn(layer, c, *jax.tree.unflatten(x_tree, full), **kwargs)
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
          f"{what}: the body must return a pair (carry, ys), got {describe_returned(out)}. "
          "Return `carry, None` if there are no ys."
          + (
            " A block written for sr.remat_scan returns the carry alone: the same "
            "block runs without remat as sr.remat_scan(..., lengths=(n,), "
            "policy=jax.checkpoint_policies.everything_saveable), which keeps every "
            "residual (nothing is recomputed)."
            if isinstance(out, jax.Array) and from_class_form
            else ""
          )
        )
      return tuple(out)

    if length is not None:
      sources.insert(0, ("length", int(length)))
    loop = lift_loop(
      module,
      what,
      rules,
      options["metadata_params"],
      "f(module, carry, *xs) -> (carry, ys)",
      sizes=sources,
      data_transform=options["data_transform"],
      reverse=options["reverse"],
    )
    if offload:
      warn_if_kept(what)
    carry, ys = loop.loop(call, carry, moved, unroll=options["unroll"], offload=offload)
    if ys is not None and not (isinstance(out_axes, int) and out_axes == 0):
      ys = stack_ys(what, out_axes, ys)  # may raise: before anything is written back
    loop.finish()
    return carry, ys

  return serialised(wrapper)
