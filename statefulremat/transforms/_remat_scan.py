"""sr.remat_scan: N = prod(lengths) layers in nested, rematerialised scans."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, Unpack, overload

from ..core._frozen import ALL_SPLIT as _SPLIT_ALL
from ..core._frozen import ALL_STACKED as _ALL
from ..core._frozen import EMPTY as _EMPTY
from ..core._module import Module
from ..core._stacks import Form
from ._class_form import (
  M,
  P,
  R,
  Transform,
  cached_class_form,
  fresh,
  function_target,
  is_module_class,
)
from ._pattern import class_form, target_repr
from ._remat_scan_args import AUTO, check_lengths, resolve_plan
from ._remat_scan_loop import RematScanForm, candidate
from ._rules import Collections, Rules, public
from .memory._carries import check_carries
from .memory._remat_plan import RematPlan
from .memory._remat_search import search_plans


class _Options(TypedDict, total=False):
  """The keywords of ``remat_scan``, for its overloads (the implementation gives the
  defaults)."""

  length: int | None
  memory_budget: int | str | None
  policy: Callable[..., Any] | None
  carries: str | None
  variable_broadcast: Any
  variable_carry: Any
  variable_axes: Mapping[Any, Any]
  split_rngs: Mapping[Any, Any]
  prevent_cse: bool
  data_transform: Callable[..., Any] | None
  metadata_params: Mapping[Any, Any]
  methods: Sequence[str] | None
  init_in_axes: Any
  pipeline: Any


_Lengths = Sequence[int] | str | RematPlan


# The class form: a stack of M, typed as M (`stack.layer(i)` is an M).
@overload
def remat_scan(target: type[M], lengths: _Lengths = (), **options: Unpack[_Options]) -> type[M]: ...
@overload  # a pattern stack, whose positions differ
def remat_scan(
  target: Sequence[type[Module] | functools.partial[Any]],
  lengths: _Lengths = (),
  **options: Unpack[_Options],
) -> type: ...
@overload  # the function form: the same signature
def remat_scan(
  target: Callable[P, R], lengths: _Lengths = (), **options: Unpack[_Options]
) -> Callable[P, R]: ...
@overload  # keywords only: a decorator of a class or a function
def remat_scan(
  target: None = None, lengths: _Lengths = (), **options: Unpack[_Options]
) -> Transform: ...
@cached_class_form
def remat_scan(
  target: Callable | type | Sequence[Callable] | None = None,
  lengths: Sequence[int] | str | RematPlan = (),
  *,
  length: int | None = None,
  memory_budget: int | str | None = None,
  policy: Callable[..., Any] | None = None,
  carries: str | None = None,
  variable_broadcast: Any = False,
  variable_carry: Any = False,
  variable_axes: Mapping[Any, Any] = _ALL,
  split_rngs: Mapping[Any, Any] = _SPLIT_ALL,
  prevent_cse: bool = False,
  data_transform: Callable[..., Any] | None = None,
  metadata_params: Mapping[Any, Any] = _EMPTY,
  methods: Sequence[str] | None = None,
  init_in_axes: Any = None,
  pipeline: Any = None,
):
  """Applies N layers in nested, rematerialised scans: memory ~ N^(1/d), flat compile time.

  ``remat_scan(f, lengths)(module, carry, *args, **kwargs) -> carry`` is equivalent to::

      for layer in sr.unstack(module):     # N layers
        carry = f(layer, carry, *args, **kwargs)

  but runs as ``d = len(lengths)`` nested ``jax.lax.scan`` loops, each level under
  ``jax.checkpoint``: the backward pass keeps each level's carries and recomputes the
  rest. Stacked variables keep ONE flat layer axis of size N whatever the ``lengths``.
  The arguments after the carry go whole to every layer.

  Args:
    target: ``f(layer, carry, *args, **kwargs) -> carry`` (also a method); a Module
      class (the class form: N layers built in one vmapped init, calling
      ``Block.__call__(carry, *args) -> carry``); a tuple of classes (a pattern, whose
      ``lengths`` count cycles); ``None`` makes a decorator.
    lengths: the layers per level, outermost first, e.g. ``(10, 10)`` for 100 layers
      (the default ``()`` is refused); ``"auto"`` plans them at trace time
      (``sr.plan_remat``); or an ``sr.RematPlan``, which brings its length and policy.
    length: N (default ``None``: ``prod(lengths)``); a smaller N makes the last segment
      short (``lengths=(10, 10), length=97``), with no padding. Needed by the class form
      with ``"auto"``.
    memory_budget: with ``lengths="auto"``, the memory the plan must fit: bytes or e.g.
      ``"512MiB"`` (per device under ``pipeline``). Default ``None``: the least memory
      at no more than 3N evaluations.
    policy: the ``jax.checkpoint_policies`` entry of the innermost level (default
      ``None``: save nothing), checked as ``sr.remat`` checks it; outer levels save only
      their carries.
    carries: where the outer levels' saved carries live: ``"device"`` or ``"offload"``
      (host memory; see the "Memory names" guide). Default ``None``: the device, unless
      an ``"auto"`` plan under ``memory_budget`` needs to offload.
    variable_broadcast: filter of variables read-only in every layer (default
      ``False``).
    variable_carry: filter of variables threaded from layer to layer (default
      ``False``).
    variable_axes: ``{filter: axis}``, the stacked variables and their layer axis
      (default ``{True: 0}``: every variable, at axis 0).
    split_rngs: ``{stream filter: bool}``, the RNG streams that give each layer its key
      (default ``{True: True}``: every stream).
    prevent_cse: as in ``jax.checkpoint`` (default ``False``, as suits a scan).
    data_transform: as ``sr.scan``'s, a ``State -> State`` map of each layer's stacked
      values. Default ``None``.
    metadata_params: as ``sr.scan``'s, ``{"partition_name": name}``. Default ``{}``.
    methods: for a class target, the methods to run (default ``None``: ``__call__``).
    init_in_axes: for a class target, the constructor arguments that differ per layer,
      as ``sr.scan``'s (default ``None``: every argument whole).
    pipeline: an ``sr.PipelineSpec(axis=..., microbatches=...)`` runs it as
      ``sr.pipeline`` over the mesh axis the layer axis is sharded over, each stage's
      layers as one level (or as ``"auto"`` plans them). Default ``None``.

  Returns:
    For a function, ``run(module, carry, *args, **kwargs) -> carry``, which writes the
    body's changes back to ``module``; for a class (or a pattern), the stack class
    ``RematScan{Name}`` (one per equal arguments); with no ``target``, a decorator.

  Raises:
    sr.TransformError: bad ``lengths``, ``carries`` or ``pipeline``; a ``length`` that
      ``lengths`` do not cover, or not the plan's; ``policy`` or ``memory_budget`` with
      a plan, ``memory_budget`` without ``"auto"``; the class form with ``"auto"`` and
      no ``length``; at call, the body returning ``(carry, ys)`` or changing the carry,
      a variable matched by two rules, a ``policy`` naming values the body does not
      name, or no plan fitting ``memory_budget``.
    TypeError: a ``target`` that is not callable; ``methods`` / ``init_in_axes`` with a
      function; a ``policy`` that is not one; at call, argument 0 not a module.
    sr.GraphError: a module in the carry or the arguments after it.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> Deep = sr.remat_scan(sr.nn.Linear, lengths=(4, 5))
  >>> deep = Deep(3, 3, rngs=sr.Rngs(0))
  >>> len(deep), deep.kernel.shape
  (20, (20, 3, 3))
  >>> y = deep(jnp.ones((2, 3)))
  >>> x = jnp.ones((2, 3))
  >>> for layer in sr.unstack(deep):
  ...   x = layer(x)
  >>> bool(jnp.allclose(x, y, rtol=1e-4))
  True
  """
  collections = Collections(variable_axes, variable_broadcast, variable_carry, split_rngs)
  options: dict[str, Any] = dict(
    policy=policy,
    carries=carries,
    collections=collections,
    prevent_cse=prevent_cse,
    data_transform=data_transform,
    metadata_params=metadata_params,
  )
  if target is None:
    return functools.partial(
      remat_scan,
      lengths=lengths,
      length=length,
      memory_budget=memory_budget,
      methods=methods,
      init_in_axes=init_in_axes,
      pipeline=pipeline,
      **public(options),
    )
  what = f"sr.remat_scan({target_repr(target)})"
  check_carries(what, carries, planned=True)
  lengths, length, policy, budget, carries = resolve_plan(
    what, lengths, length, policy, memory_budget, carries
  )
  options["policy"], options["carries"] = policy, carries
  auto = lengths == AUTO
  form = RematScanForm(what, lengths, length, budget, pipeline, options)
  made = class_form(
    target,
    Form.REMAT_SCAN,
    what=what,
    rules=lambda: Rules(what, collections),
    count=form.count,
    run=form.run,
    position_class=lambda cls, n: fresh(remat_scan)(
      cls, (n,), methods=methods, init_in_axes=init_in_axes, **public(options)
    ),
    methods=methods,
    metadata_params=metadata_params,
    init_in_axes=init_in_axes,
    # The nested layout, for to_linen.
    lengths=tuple(lengths) if not auto and is_module_class(target) else None,
  )
  if made is not None:
    return made
  n = length if auto else check_lengths(what, lengths, length)
  fn = function_target(
    "sr.remat_scan",
    target,
    takes="a function f(layer, carry) -> carry, a Module class or a tuple of classes (a pattern)",
    methods=methods,
    init_in_axes=init_in_axes,
  )
  return form.function_form(fn, n)


def plan_remat(
  stack,
  carry,
  *,
  fn: Callable[..., Any] | None = None,
  memory_budget: int | str | None = None,
  max_depth: int = 4,
  policy: Callable[..., Any] | None = None,
  carries: str | None = None,
  host_bandwidth: float | str = "25GB/s",
) -> RematPlan:
  """Plans ``sr.remat_scan`` over ``stack`` for a ``carry`` of these shapes.

  Ranks every nesting of up to ``max_depth`` levels and innermost policy by a memory
  model (see ``sr.RematPlan``) calibrated by compiling the best plan: with
  ``memory_budget``, the fewest block evaluations that fit (the pick compiled to check
  it; carries offloaded where only that fits), else the least memory at no more than 3N
  evaluations. How it plans: the "Which remat?" guide.

  Args:
    stack: a stacked module (N layers), or its ``sr.eval_shape``.
    carry: the carry, or ``jax.ShapeDtypeStruct`` s of it.
    fn: the body ``(layer, carry) -> carry``; default ``layer(carry)``.
    memory_budget: bytes or a string; None for the least memory at <= 3N evaluations.
    max_depth: the most levels of nesting a plan may have (default ``4``).
    policy: the innermost policy to plan with, in place of choosing between nothing
      saveable and dots saveable.
    carries: where the outer levels' carries may live: ``"device"``, ``"offload"``, or
      ``None`` (the default): the device unless only offloading meets the budget.
    host_bandwidth: device-host bytes per second, for the cost an offloading plan
      reports: a number or e.g. ``"25GB/s"`` (the default, PCIe 4.0 x16).

  Returns:
    An ``sr.RematPlan``: its ``lengths``, innermost ``policy``, block evaluations and
    modelled temp bytes (``measured_bytes`` where planning compiled it); pass it as
    ``sr.remat_scan(fn, lengths=plan)``.

  Raises:
    TypeError: ``stack`` is not a stacked module.
    sr.TransformError: ``memory_budget`` or ``host_bandwidth`` is not an amount, no plan
      fits the budget once compiled, or ``carries`` is not a choice.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> stack = sr.vmap(sr.nn.Linear, axis_size=97)(256, 256, rngs=sr.Rngs(0))
  >>> carry = jax.ShapeDtypeStruct((4096, 256), jnp.float32)
  >>> plan = sr.plan_remat(stack, carry, fn=lambda layer, h: jnp.tanh(layer(h)))
  >>> plan.lengths, plan.policy_name, plan.evals == 3 * 97
  ((11, 9), 'nothing_saveable', True)
  >>> y = sr.remat_scan(lambda layer, h: jnp.tanh(layer(h)), lengths=plan)(
  ...     stack, jnp.ones((8, 256)))
  """
  return search_plans(
    stack,
    carry,
    fn=(lambda layer, carry: layer(carry)) if fn is None else fn,
    scan=candidate,
    memory_budget=memory_budget,
    max_depth=max_depth,
    policy=policy,
    carries=carries,
    host_bandwidth=host_bandwidth,
  )
