"""sr.remat_scan: N = prod(lengths) layers in nested, rematerialised scans."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast, overload

import jax
import jax.numpy as jnp

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
  display_name,
  fresh,
  function_target,
  is_module_class,
)
from ._layers import describe_node
from ._lift import refuse_layer_list, serialised
from ._module_arg import check_no_modules
from ._pattern import class_form, target_repr
from ._pattern_loop import lift_loop
from ._remat_scan_args import AUTO, check_cycles, check_lengths, check_units, resolve_plan
from ._rules import Collections, Rules, TransformError, public
from .memory._carries import check_carries, warn_if_kept, warning_once
from .memory._policy_check import policy_check
from .memory._remat_plan import RematPlan
from .memory._remat_search import search_plans


@overload
def remat_scan(
  target: type[M],
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
) -> type[M]: ...  # the class form: a stack of M, typed as M (`stack.layer(i)` is an M)
@overload
def remat_scan(
  target: Sequence[type[Module] | functools.partial[Any]],
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
) -> type: ...  # a pattern stack, whose positions differ
@overload
def remat_scan(
  target: Callable[P, R],
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
) -> Callable[P, R]: ...  # the function form: the same signature
@overload
def remat_scan(
  target: None = None,
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
) -> Transform: ...  # keywords only: a decorator of a class or a function
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
  """Applies N layers (``length``, default prod(lengths)) with memory ~ N^(1/d) and
  flat compile time.

  ``remat_scan(f, lengths)(module, carry) -> carry`` is equivalent to::

      for layer in sr.unstack(module):     # N layers
        carry = f(layer, carry)

  but runs as ``d = len(lengths)`` nested ``jax.lax.scan`` loops, every level (the innermost
  included) under ``jax.checkpoint``: the backward pass keeps only each level's
  carries and recomputes the rest.
  Stacked variables keep ONE flat layer axis of size N — the nested shape exists only
  inside the trace, so changing ``lengths`` never changes the state. Any N works,
  primes included (see ``length``). Arguments after the carry
  (``remat_scan(f, lengths)(module, carry, position_ids, flag=True)``,
  ``f(layer, carry, position_ids, flag=True)``: an attention mask, Llama's position
  ids) are broadcast: every layer gets them whole, keyword ones unchanged.

  Args:
    target: ``f(layer, carry, *args, **kwargs) -> carry`` (also a method); or a Module
      class: the class form ``sr.remat_scan(Block, lengths=(10, 10))(*args, rngs=...)``
      builds the N layers in one vmapped init, and calling it runs
      ``Block.__call__(carry, *args) -> carry``, the extra arguments broadcast to every
      layer; or a tuple of classes (a pattern, whose ``lengths`` count cycles).
      ``None`` (only keywords given) makes a decorator.
    lengths: the layers per level of nesting, outermost first, e.g. ``(10, 10)`` for
      100 layers: a non-empty tuple of positive ints (the default ``()`` is refused);
      ``"auto"`` plans the nesting at trace time for ``policy`` (without ``policy``,
      the plan chooses it too: ``sr.plan_remat``); or an ``sr.RematPlan`` from
      ``sr.plan_remat``, which brings its own length and policy.
    length: N, the number of layers (default ``None``: ``prod(lengths)``). With
      ``length=N < prod(lengths)`` the last segment is short (``lengths=(10, 10),
      length=97`` runs 9 full outer steps of 10 and one of 7), with no padding and no
      copies of parameter slices. The class form with ``lengths="auto"`` needs it.
    memory_budget: with ``lengths="auto"``, the memory the plan must fit: bytes or a
      string such as ``"512MiB"`` (per device under ``pipeline``). Default ``None``:
      the least memory at no more than 3N evaluations.
    policy: the ``jax.checkpoint_policies`` entry of the innermost level only (default
      ``None``: save nothing); outer levels save nothing but their carries (a saving
      policy there would keep every layer's residuals alive). It is checked as
      ``sr.remat`` checks it: names that no ``checkpoint_name`` in the body gives
      raise, an offload that the backend drops warns.
    carries: where the carries the outer levels save for the backward pass live (one
      per outer step, alive through the whole backward pass): ``"device"`` or
      ``"offload"``, kept in host memory (``pinned_host``). With one level
      (``lengths=(N,)``) that is each layer's input; the innermost level of a deeper
      nesting keeps its carries on the device (they live only while one segment is
      recomputed), and ``policy`` still says what it saves. Where the backend
      offloads nothing (CPU) the carries stay on the device and each trace warns once.
      Default ``None``: on the device, unless ``lengths="auto"`` plans under a
      ``memory_budget`` that only offloading them meets (``sr.plan_remat``); a plan
      brings its own.
    variable_broadcast: filter of variables read-only in every layer (default
      ``False``: none).
    variable_carry: filter of variables threaded from layer to layer (default
      ``False``: none).
    variable_axes: ``{filter: axis}`` — the stacked variables and their layer axis
      (default ``{True: 0}``: every variable, at axis 0).
    split_rngs: ``{stream filter: bool}`` — the RNG streams that give each layer its
      key (default ``{True: True}``: every stream is split).
    prevent_cse: as in ``jax.checkpoint`` (default ``False``, as suits a checkpoint
      under a scan).
    data_transform: ``sr.scan``'s: a ``State -> State`` map of each layer's stacked
      values (e.g. a ``jax.lax.with_sharding_constraint``). Default ``None``: none.
    metadata_params: ``sr.scan``'s: ``{"partition_name": name}`` for the layer axis's
      name in ``sharding`` metadata. Default ``{}``.
    methods: for a class target, the methods to run (default ``None``: ``__call__``).
    init_in_axes: for a class target, the positional constructor arguments that differ
      per layer, as ``sr.scan``'s (default ``None``: every argument whole).
    pipeline: ``sr.PipelineSpec(axis=..., microbatches=...)`` runs it as
      ``sr.pipeline`` (the class form's ``stack(x)`` and the function form alike),
      under a mesh whose ``axis`` the layer axis is sharded over: ``lengths`` /
      ``length`` still count the stack's layers, each stage runs its own as one level
      with ``policy`` and ``carries``, or as ``lengths="auto"`` plans them under ``memory_budget`` per
      device. Default ``None``: no pipeline.

  Returns:
    For a function, ``run(module, carry, *args, **kwargs) -> carry``, which writes the
    body's changes back to ``module``; for a Module class (or a pattern), the stack
    class ``RematScan{Name}``, whose instances hold the N layers (the same class for
    equal arguments); with no ``target``, a decorator that takes it.

  Raises:
    sr.TransformError: ``lengths`` that are not a non-empty tuple of positive ints,
      ``"auto"`` or a plan; ``carries`` neither ``"device"`` nor ``"offload"``;
      ``length`` not covered by ``lengths`` (or leaving a whole outer step empty), or
      not the plan's; ``policy`` or ``memory_budget`` with a plan,
      ``memory_budget`` without ``"auto"``; the class form with ``"auto"`` and no
      ``length``; a ``pipeline`` that is not an ``sr.PipelineSpec``; at call, the body
      returning ``(carry, ys)`` or changing the carry's structure, shape or dtype, a
      variable matched by two rules, a ``policy`` naming values the body does not
      name, or no plan fitting ``memory_budget``.
    TypeError: a ``target`` that is not callable; ``methods`` / ``init_in_axes`` with a
      function; a ``policy`` that is not one; at call, argument 0 not a module.
    sr.GraphError: a module in the carry or the arguments after it (modules go in
      argument 0).

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
  if pipeline is not None and not hasattr(pipeline, "_pipelined"):
    raise TransformError(
      f"{what}: pipeline={pipeline!r}; it takes sr.PipelineSpec(axis=..., "
      "microbatches=..., schedule=..., repeats=...)."
    )

  def function_form(fn: Callable, layers: int | None) -> Callable:
    """The function form over ``fn``, its arguments checked once, above: the class
    forms' methods run it too."""
    what = f"sr.remat_scan({display_name(fn)})"
    if pipeline is not None:  # sr.PipelineSpec runs each stage through remat_scan
      run = pipeline._pipelined(
        fn, what=what, lengths=lengths, layers=layers, memory_budget=budget, **public(options)
      )
      return warning_once(run, what) if carries == "offload" else run
    return _remat_scan_function(fn, lengths, layers, budget, what=what, **options)

  @functools.cache  # checked once, for the class and for each method's function form
  def count(period: int) -> int | None:
    """The layers a class form builds; a pattern's ``lengths`` count its cycles."""
    if auto:
      if length is None and period == 1:  # a pattern's class form says it for a pattern
        raise TransformError(
          f"{what}: the class form with lengths='auto' needs `length=N`, the number of "
          "layers to build (the plan is made at call time, from the carry's shapes)."
        )
      return length
    nesting = cast(tuple, lengths)  # not "auto"
    if period == 1:
      return check_lengths(what, nesting, length)
    if length is not None:  # without length, the pattern's class form says so
      check_lengths(what, nesting, None)
      check_cycles(what, nesting, length, period)
    return length

  made = class_form(
    target,
    Form.REMAT_SCAN,
    what=what,
    rules=lambda: Rules(what, collections),
    count=count,
    # A pattern's lengths count its cycles, and so does the count its calls check.
    run=lambda fn, period: function_form(
      fn, count(1) if period == 1 else None if auto else int(math.prod(lengths))
    ),
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
  return function_form(fn, n)


def _remat_scan_function(
  fn: Callable,
  lengths: tuple | str,
  n: int | None,
  budget: int | None,
  *,
  what,
  policy,
  carries,
  prevent_cse,
  data_transform,
  metadata_params,
  collections,
) -> Callable:
  rules = Rules(what, collections)
  auto = lengths == AUTO
  offload = check_carries(what, carries, planned=True)
  check = policy_check(policy, what)  # the innermost level's policy, once per trace
  if auto:
    label = None if n is None else f"length={n}"
    plans: dict = {}  # one plan per (module structure, N, carry and keyword shapes)
  else:
    label = f"length={n}" if n != math.prod(lengths) else f"lengths={lengths} (product)"

  def planned(module, lifted, count, carry, args, kwargs) -> tuple:
    """``(lengths, innermost policy, offload)``: as given, or planned once per
    structure, layer count and shapes (lengths="auto")."""
    if not auto:
      return lengths, policy, offload
    key = (lifted, count, _avals(carry), _avals(args), _avals(kwargs))
    chosen = plans.get(key)
    if chosen is None:
      chosen = plans[key] = plan_remat(
        module,
        carry,
        fn=lambda layer, c: fn(layer, c, *args, **kwargs),
        memory_budget=budget,
        policy=policy,
        carries=carries,
      )
    return chosen.lengths, chosen.policy, chosen.carries == "offload"

  @functools.wraps(fn)
  def wrapper(module, carry, *args, **kwargs):
    refuse_layer_list(module, what, "sr.remat_scan(f, lengths=...)(stack, carry)")
    check_no_modules(carry, what, "the carry")
    check_no_modules(args, what, "the extra argument")
    check_no_modules(kwargs, what, "the keyword argument")
    loop = lift_loop(
      module,
      what,
      rules,
      metadata_params,
      "f(module, carry) -> carry",
      fallback=n,
      data_transform=data_transform,
    )
    if n is not None and label is not None:
      check_units(what, label, n, lengths, loop)
    nesting, innermost, offloading = planned(module, loop.lifted, loop.length, carry, args, kwargs)

    def body(layer, c, _):
      out = fn(layer, c, *args, **kwargs)
      refuse_carry_and_more(what, c, out)
      return out, None

    def run(carry):
      carry, _ = loop.loop(
        body,
        carry,
        None,
        lengths=nesting,
        remat=True,
        policy=innermost,
        prevent_cse=prevent_cse,
        offload=offloading,
      )
      return carry, loop.changed, loop.made

    if offloading:
      warn_if_kept(what)

    # Under a policy check the loop runs in a jaxpr first: its results come out
    # through the returned values, never as that trace's tracers left on `loop`.
    carry, loop.changed, loop.made = run(carry) if check is None else check.run(run, carry)
    loop.finish()
    return carry

  return serialised(wrapper)


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

  Every nesting of up to ``max_depth`` levels (short last segments included) and both
  innermost policies (nothing saveable, dots saveable; or only the ``policy`` given)
  are ranked by a memory model (see ``sr.RematPlan``): with ``memory_budget`` (bytes,
  or ``"512MiB"``) the fewest block evaluations whose temp memory fits, else the least
  memory at no more than 3N evaluations.

  The model's terms for what changes between nestings (saved carries, residuals,
  parameter slices) are exact; what one unit's backward pass needs besides (attention
  scores, an MLP's hidden activations) depends on XLA, so planning compiles the
  stack's gradient at the model's best plan and reads that from XLA's temp bytes
  (and once more where the pick has the other policy): after that every candidate's
  figure is within 10 % of XLA's (``benchmarks/planner.py``).

  With a budget, the pick is compiled to check it fits (a plan the model puts inside
  the budget's 3 % headroom, or, tried first, one with fewer evaluations that it puts
  under the budget itself), and where the model was still off, it is rescaled by
  XLA's figure and the choice made again; plans with fewer evaluations that the model
  put just over the budget (within its error on the pick plus 1 %, at most 5 %) are
  compiled too, up to 8, and the first that fits is taken. ``plan.measured_bytes`` is
  XLA's figure for the plan returned where planning compiled it. When no plan fits,
  the error names the smallest and what it needs, once compiled.

  Where no plan keeping the carries on the device fits a budget, recompute alone
  cannot meet it: on a backend that moves offloaded values to host memory (GPU, TPU)
  the plans that keep the outer levels' carries there (``carries="offload"``) are
  planned next, the fewest evaluations first and then the least host traffic, and the
  plan's ``reason`` says why it offloads and what the traffic costs at
  ``host_bandwidth``. On one that moves nothing (CPU) the error says so.

  Args:
    stack: a stacked module (N layers), or its ``sr.eval_shape``.
    carry: the carry, or ``jax.ShapeDtypeStruct`` s of it.
    fn: the body ``(layer, carry) -> carry``; default ``layer(carry)``.
    memory_budget: bytes or a string; None for the least memory at <= 3N evaluations.
    max_depth: the most levels of nesting a plan may have (default ``4``).
    policy: the innermost level's policy to plan with (e.g. one saving the names
      ``save_only_these_names`` lists), in place of choosing between nothing saveable
      and dots saveable; the nesting is then planned for the bytes it keeps.
    carries: where the outer levels' carries may live: ``"device"``, ``"offload"``
      (host memory: planned for the device bytes that leaves), or ``None`` (the
      default): on the device, unless only offloading them meets ``memory_budget``.
    host_bandwidth: bytes per second between device and host memory, for the cost an
      offloading plan reports: a number, or a string such as ``"25GB/s"`` (the
      default, PCIe 4.0 x16 in practice; PCIe 5.0 gives about 50, a GH200's
      NVLink-C2C about 450).

  Returns:
    An ``sr.RematPlan``: its ``lengths``, innermost ``policy``, block evaluations and
    modelled temp bytes (``measured_bytes`` too where planning compiled the plan); pass
    it as ``sr.remat_scan(fn, lengths=plan)``.

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
    fn=_call if fn is None else fn,
    scan=lambda body, plan: remat_scan(body, lengths=plan),
    memory_budget=memory_budget,
    max_depth=max_depth,
    policy=policy,
    carries=carries,
    host_bandwidth=host_bandwidth,
  )


def refuse_carry_and_more(what: str, carry, out) -> None:
  """Raises if the body returned ``(carry, something)`` where remat_scan takes the carry
  alone (a block written for ``sr.scan``, or returning an auxiliary output)."""
  if jax.tree.structure(out) == jax.tree.structure(carry):
    return
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    return  # another change of structure: the loop's carry check says where
  if jax.tree.structure(out[0]) != jax.tree.structure(carry):
    return
  raise TransformError(
    f"{what}: the body returned a pair (carry, {describe_node(out[1])}) where "
    "sr.remat_scan's body returns the carry alone: each layer's output is the next "
    "layer's input. Fix: return only the carry; keep an auxiliary output with "
    "`self.sow(sr.Intermediate, 'name', value)` (it comes out stacked per layer), or "
    "use sr.scan (wrapped in sr.remat for the memory), whose body returns (carry, ys)."
  )


def _avals(tree):
  return tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree))


def _call(layer, carry):
  return layer(carry)
