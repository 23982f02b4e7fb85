"""sr.remat_scan: N = prod(lengths) layers in nested, rematerialised scans."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack, overload

from ..core._frozen import ALL_SPLIT, ALL_STACKED, EMPTY
from ..core._module import Module
from ._class_form import M, P, R, Transform, cached_class_form, function_target
from ._pattern import target_repr
from ._remat_scan_args import AUTO, check_lengths, resolve_plan
from ._remat_scan_loop import RematScanForm
from ._rules import Collections, StackOptions, public
from .memory._carries import check_carries
from .memory._remat_plan import RematPlan


class _Options(StackOptions, total=False):
  """The keywords of ``remat_scan``, for its overloads (the implementation gives the defaults)."""

  length: int | None
  memory_budget: int | str | None
  policy: Callable[..., Any] | str | None
  carries: str | None
  variable_carry: Any
  prevent_cse: bool
  data_transform: Callable[..., Any] | None
  pipeline: Any


_Lengths = Sequence[int] | str | RematPlan


@overload  # the class form: a stack of M, typed as M (`stack.layer(i)` is an M)
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
  policy: Callable[..., Any] | str | None = None,
  carries: str | None = None,
  variable_broadcast: Any = False,
  variable_carry: Any = False,
  variable_axes: Mapping[Any, Any] = ALL_STACKED,
  split_rngs: Mapping[Any, Any] = ALL_SPLIT,
  prevent_cse: bool = False,
  data_transform: Callable[..., Any] | None = None,
  metadata_params: Mapping[Any, Any] = EMPTY,
  methods: Sequence[str] | None = None,
  init_in_axes: Any = None,
  pipeline: Any = None,
):
  """Applies N layers in nested, rematerialised scans: memory ~ N^(1/d), flat compile time.

  Args:
    target: ``f(layer, carry, *args, **kwargs) -> carry`` (also a method); a Module class (the class
      form: N layers built in one vmapped init, calling ``Block.__call__(carry, *args) -> carry``);
      a tuple of classes (a pattern, whose ``lengths`` count cycles); ``None`` makes a decorator.
    lengths: the layers per level, outermost first, e.g. ``(10, 10)`` for 100 layers
      (the default ``()`` is refused); ``"auto"`` plans them at trace time
      (``sr.plan_remat``); or an ``sr.RematPlan``, which brings its length and policy.
    length: N (default ``None``: ``prod(lengths)``); a smaller N makes the last segment short
      (``lengths=(10, 10), length=97``), with no padding. Needed by the class form with ``"auto"``.
    memory_budget: with ``lengths="auto"`` or ``policy="auto"``, the memory the plan must fit: bytes or e.g.
      ``"512MiB"`` (per device under ``pipeline``). Default ``None``: the least memory
      at no more than 3N evaluations.
    policy: the ``jax.checkpoint_policies`` entry of the innermost level (default ``None``: save
      nothing), checked as ``sr.remat`` checks it; outer levels save only their carries.
      ``"auto"``: planned per ``checkpoint_name`` (``sr.plan_remat``'s ``policy="auto"``).
    carries: where the outer levels' saved carries live: ``"device"`` or ``"offload"``
      (host memory; see the "Memory names" guide). Default ``None``: the device, unless
      an ``"auto"`` plan under ``memory_budget`` needs to offload.
    variable_broadcast: filter of variables read-only in every layer (default ``False``).
    variable_carry: filter of variables threaded from layer to layer (default ``False``).
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
  form = RematScanForm(what, lengths, length, budget, pipeline, options, methods, init_in_axes)
  made = form.class_form(target)
  if made is not None:
    return made
  n = length if lengths == AUTO else check_lengths(what, lengths, length)
  fn = function_target(
    "sr.remat_scan",
    target,
    takes="a function f(layer, carry) -> carry, a Module class or a tuple of classes (a pattern)",
    methods=methods,
    init_in_axes=init_in_axes,
  )
  return form.function_form(fn, n)
