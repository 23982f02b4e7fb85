"""The planner's search: ``sr.plan_remat`` and ``lengths="auto"`` (README.md)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ...core._caches import PLANNED_STACKS, planned_bytes
from ...core._frozen import ALL_SPLIT, ALL_STACKED, EMPTY
from ...core._module import Module
from ...core._stacks import cycle, is_stacked
from .._autodiff import grad
from .._jit import jit
from .._pattern_loop import lift_loop
from .._rules import Collections, Rules, TransformError
from ._carries import check_carries, moves_to_host, quiet
from ._jaxpr_reading import remat_flavour
from ._offload_check import offload_problem
from ._remat_budget import calibrate, calibrate_names, fit_budget, frontier, picking
from ._remat_names import AUTO, keepings, name_table, recomputed_flops
from ._remat_plan import (
  GIVEN,
  NOTHING,
  POLICIES,
  RematPlan,
  choose,
  format_bytes,
  nesting_keeps_policy,
  parse_bytes,
  residual_bytes,
  tree_bytes,
  unit_inputs,
)

COSTS = (25e9, 1e14)  # plan_remat's defaults: host_bandwidth, device_flops


def plan_remat(
  stack,
  carry,
  *,
  fn: Callable[..., Any] | None = None,
  memory_budget: int | str | None = None,
  max_depth: int = 4,
  policy: Callable[..., Any] | str | None = None,
  carries: str | None = None,
  host_bandwidth: float | str = "25GB/s",
  device_flops: float = 1e14,
) -> RematPlan:
  """Plans ``sr.remat_scan`` over ``stack`` for a ``carry`` of these shapes.

  With ``memory_budget``, the fewest block evaluations that fit, else the least memory at
  no more than 3N evaluations (how it plans: the "Which remat?" guide).

  Args:
    stack: a stacked module (N layers), or its ``sr.eval_shape``.
    carry: the carry, or ``jax.ShapeDtypeStruct`` s of it.
    fn: the body ``(layer, carry) -> carry``; default ``layer(carry)``.
    memory_budget: bytes or a string; None for the least memory at <= 3N evaluations.
    max_depth: the most levels of nesting a plan may have (default ``4``).
    policy: the innermost policy to plan with, in place of choosing between nothing
      saveable and dots saveable; ``"auto"`` chooses, for each ``checkpoint_name`` the
      block gives, remat, device or offload (an ``sr.policies.custom``), with the nesting
      and the carries, for the least recompute and host traffic that fits.
    carries: where the outer levels' carries may live: ``"device"``, ``"offload"``, or
      ``None`` (the default): the device unless only offloading meets the budget.
    host_bandwidth: device-host bytes per second, for the cost an offloading plan
      reports: a number or e.g. ``"25GB/s"`` (the default, PCIe 4.0 x16).
    device_flops: with ``policy="auto"``, the FLOPs per second that price recomputation
      against host traffic (default ``1e14``).

  Returns:
    An ``sr.RematPlan`` (its ``lengths``, innermost ``policy``, evaluations and bytes), to
    pass as ``sr.remat_scan(fn, lengths=plan)``. With ``policy="auto"`` and no budget,
    ``plan.frontier`` is the memory-cost frontier, compiled when first read. Planning
    compiles the stack's gradient a few times (``"auto"``: 2 to 4, and the frontier's
    other points, 3 typically, 5 at most), and keeps what it measured for the same body
    and shapes.

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
  positions = cycle(stack) if isinstance(stack, Module) else ()
  if not positions or not all(map(is_stacked, positions)):
    raise TypeError(
      f"sr.plan_remat plans a stack of layers; got {type(stack).__name__}. Fix: pass "
      "the stacked module (e.g. `sr.vmap(Block, axis_size=N)(...)` or a class form of "
      "sr.remat_scan / sr.scan), or its sr.eval_shape."
    )
  budget = parse_bytes(memory_budget)
  check_carries("sr.plan_remat", carries, planned=True)
  try:
    bandwidth = parse_bytes(
      host_bandwidth.removesuffix("/s") if isinstance(host_bandwidth, str) else host_bandwidth
    )
  except TransformError:
    raise TransformError(
      f"sr.plan_remat: host_bandwidth={host_bandwidth!r} is not an amount of bandwidth. "
      "Fix: bytes per second, e.g. 25e9, or a string such as '25GB/s'."
    ) from None
  if isinstance(policy, str) and policy != AUTO:
    raise TransformError(
      f"sr.plan_remat: policy={policy!r}; the only string it takes is 'auto' (the planner "
      "chooses what to keep by name). Fix: policy='auto', or a policy such as "
      f"`sr.policies.preset({policy!r})`."
    )
  costs = (bandwidth or COSTS[0], device_flops)
  return search(
    stack, carry, fn or _call, budget, policy, carries, max_depth=max_depth, costs=costs
  )


def search(stack, carry, fn, budget, policy, carries, *, lengths=None, max_depth=4, costs=COSTS):
  """``plan_remat`` on checked arguments: the model's pick, calibrated and compiled;
  ``lengths`` plans that nesting only (``sr.remat_scan(lengths=..., policy="auto")``);
  ``costs``: host bandwidth and device FLOPs, per second (non-zero)."""
  args = (stack, carry, fn, budget, policy, carries, lengths, max_depth, costs)
  moves = moves_to_host()
  try:
    plan, problem = _search(*args, moves)
  except TransformError as error:
    asked = carries is not None or bool(getattr(policy, "offloaded", ()))  # the user's
    if not moves or budget is None or asked:
      raise
    # Offloading only ever lowers the device's bytes, unless it moves nothing (JAX issue
    # #23869): then a plan keeping everything on the device may still fit.
    try:
      plan, _ = _search(*args, False)
    except TransformError:
      raise error from None
    problem = (
      f"Not offloaded: no plan that offloads fits memory_budget={format_bytes(budget)} "
      "once compiled, so this backend's offload saves no device memory here; planned "
      "with nothing offloaded."
    )
  else:
    if problem is not None:  # planned again, offloading nothing
      plan, _ = _search(*args, False)
  notes = [] if plan.names or policy != AUTO else [_unnamed()]
  if problem is not None:
    notes.append(problem)
  return dataclasses.replace(plan, reason=" ".join([*notes, plan.reason]).strip())


def _search(stack, carry, fn, budget, policy, carries, only, max_depth, costs, moves):
  """``(plan, why its offload is refused or None)``; ``moves``: whether it may offload."""
  positions = cycle(stack)
  n, unit_fn, unit_states, unit_bytes = unit_inputs(stack, fn)
  as_shape = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  carry, abstract = jax.tree.map(as_shape, (carry, stack))
  carry_bytes = tree_bytes(carry)
  given, residuals, costing, offloaded, names = _innermost(
    policy, unit_fn, unit_states, carry, n, moves, costs
  )
  nested_keeps = len(given) == 1 or nesting_keeps_policy()

  def lower(plan: RematPlan) -> jax.stages.Lowered:
    run = _candidate(fn, plan)
    loss = lambda m, c: sum(jnp.sum(x) for x in jax.tree.leaves(run(m, c)))
    with quiet():  # planning's compiles: the plan warns once, where it is run
      return jit(grad(loss)).lower(abstract, carry)

  def verify(plan: RematPlan) -> int:
    return _temp_bytes(lower(plan).compile(_planning_options()))

  unit = "cycle" if len(positions) > 1 else "layer"
  measured = _measurements(fn, abstract, carry)
  key = lambda plan: (plan.lengths, plan.policy, plan.carries)  # kept across calls: no names

  def measure(plan: RematPlan) -> int:  # each plan compiled at most once while planning
    if key(plan) not in measured:
      measured[key(plan)] = verify(plan)
    return measured[key(plan)]

  working_sets: dict[str, int] | None = None  # W per policy, once calibrated
  # The plan before the model picks; each pick fills in its nesting and figures.
  blank = RematPlan(
    n, (), NOTHING, 0, 0, None, (), carry_bytes, unit_bytes, verify, unit=unit, _policies=given
  )
  blank = dataclasses.replace(blank, names=names or ())

  placements = ("offload",) if carries == "offload" else ("device",)

  def make(scales: dict[int, float] | None, budget: int | None, placements=placements) -> RematPlan:
    best, ranked = choose(
      n,
      carry_bytes,
      unit_bytes,
      residuals,
      budget,
      max_depth,
      scales,
      unit,
      working_sets,
      placements,
      moves,
      nested_keeps,
      costing,
      only,
    )
    unpicked = dataclasses.replace(blank, memory_budget=budget, candidates=tuple(ranked))
    return picking(unpicked, best, measured.get((best.lengths, given[best.policy], best.carries)))

  def fitted() -> RematPlan:
    nonlocal working_sets, residuals
    working_sets = calibrate(make(None, None), measure, residuals)
    if names is not None:
      residuals = calibrate_names(make(None, None), measure, residuals)
      working_sets = None  # again, on the scaled residuals
      working_sets = calibrate(make(None, None), measure, residuals)
    if budget is None:
      plan = make(None, None)
      if plan.measured_bytes is None:
        working_sets = None  # the pick's policy was derived: measure it
        working_sets = calibrate(make(None, None), measure, residuals, plan.policy_name)
        plan = make(None, None)
      if names is None:
        return plan
      return dataclasses.replace(plan, _frontier=functools.partial(frontier, plan, measure))
    if carries is not None:
      return fit_budget(make, budget, measure)
    if not moves:
      note = (
        f" Offloading the outer levels' carries (carries='offload') would not help: "
        f"this backend ({jax.default_backend()}) moves nothing to host memory."
      )
      return fit_budget(make, budget, measure, note=note)
    offloading = lambda scales, budget: make(scales, budget, ("offload",))
    return fit_budget(make, budget, measure, offloading, costs[0])

  plan = fitted()
  if not offloaded.get(plan.policy_name) and (plan.carries == "device" or carries is not None):
    return plan, None
  return plan, offload_problem(plan, lower(plan).compile(), unit_fn, unit_states, carry)


def _innermost(policy, unit_fn, states, carry, n: int, moves: bool, costs: tuple) -> tuple:
  """``(policies, residual bytes, costing, offloaded bytes, names)`` by policy name: the
  innermost policies to plan with (``"auto"``: the block's names'), what one unit saves
  under each, ``choose``'s costing (None: ranked by evaluations alone), the bytes each
  offloads per unit, and ``plan.names``' rows (None: not planned by name)."""
  bandwidth, device_flops = costs
  table = name_table(unit_fn, states, carry) if policy == AUTO else None
  if table is None or not table.names:
    given = {GIVEN: policy} if policy not in (None, AUTO) else POLICIES
    residuals = {name: residual_bytes(unit_fn, states, carry, p) for name, p in given.items()}
    if policy in (None, AUTO):
      return given, residuals, None, {}, None
    forward, recomputed = recomputed_flops(unit_fn, states, carry, policy)
    flops = lambda lengths: (len(lengths) - 1) * n * forward + n * recomputed
    return given, residuals, lambda lengths, _, __: (flops(lengths), None), {}, None
  keeps = {f"auto #{i}": k for i, k in enumerate(keepings(table, moves, device_flops, bandwidth))}

  def costing(lengths: tuple, name: str, host: int) -> tuple[int, float]:
    flops = (len(lengths) - 1) * n * table.forward_flops + n * keeps[name].flops
    traffic = 2 * (n * keeps[name].host + host)
    return flops, flops / device_flops + traffic / bandwidth

  return (
    {name: k.policy for name, k in keeps.items()},
    {name: k.device for name, k in keeps.items()},
    costing,
    {name: k.host for name, k in keeps.items()},
    tuple((m, table.bytes[m], table.flops[m]) for m in table.names),
  )


def _measurements(fn: Callable, abstract: Any, carry: Any) -> dict[tuple, int]:
  """The compiled temp bytes planning has measured for this body, stack and carry."""
  shapes = lambda tree: (jax.tree.structure(tree), tuple(map(str, jax.tree.leaves(tree))))
  key = (fn, shapes(abstract), shapes(carry), remat_flavour(), jax.default_backend())
  if key not in planned_bytes and len(planned_bytes) >= PLANNED_STACKS:
    del planned_bytes[next(iter(planned_bytes))]
  return planned_bytes.setdefault(key, {})


def _planning_options() -> dict:
  """XLA's options for the planner's compiles: on CPU, LLVM's optimisations off. Temp bytes
  come from buffer assignment, before LLVM runs, so they are the same; compiles take half."""
  return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}


def _temp_bytes(compiled: jax.stages.Compiled) -> int:
  analysis: Any = compiled.memory_analysis()  # None only where XLA gives none
  return int(analysis.temp_size_in_bytes)


def _call(layer, carry):
  return layer(carry)


def _candidate(fn: Callable, plan: RematPlan) -> Callable:
  """``run(stack, carry)``: the layer loop ``sr.remat_scan(fn, lengths=plan)`` runs."""
  what = "sr.plan_remat"
  rules = Rules(what, Collections(ALL_STACKED, False, False, ALL_SPLIT))

  def run(module, carry):
    loop = lift_loop(module, what, rules, EMPTY, "f(module, carry) -> carry", fallback=plan.n)
    carry, _ = loop.loop(
      lambda layer, c, _: (fn(layer, c), None),
      carry,
      None,
      lengths=plan.lengths,
      remat=True,
      policy=plan.policy,
      prevent_cse=False,
      offload=plan.carries == "offload",
    )
    loop.finish()
    return carry

  return run


def _unnamed() -> str:
  """Why ``policy="auto"`` planned with the two presets: the block names nothing."""
  return (
    "policy='auto': the block gives no `checkpoint_name`, so there is nothing to choose "
    "by name; planned between nothing_saveable and dots_saveable. Name values in the "
    "block (`jax.ad_checkpoint.checkpoint_name(x, name)`; sr.nn's layers name theirs) "
    "to plan them."
  )
