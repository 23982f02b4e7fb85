"""The planner's search: ``sr.plan_remat`` and ``lengths="auto"`` (README.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ...core._frozen import ALL_SPLIT, ALL_STACKED, EMPTY
from ...core._module import Module
from ...core._stacks import cycle, is_stacked
from .._autodiff import grad
from .._jit import jit
from .._pattern_loop import lift_loop
from .._rules import Collections, Rules, TransformError
from ._carries import check_carries, moves_to_host, quiet
from ._remat_budget import calibrate, fit_budget, picking
from ._remat_plan import (
  GIVEN,
  NOTHING,
  POLICIES,
  RematPlan,
  choose,
  nesting_keeps_policy,
  parse_bytes,
  residual_bytes,
  tree_bytes,
  unit_inputs,
)


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

  With ``memory_budget``, the fewest block evaluations that fit, else the least memory at
  no more than 3N evaluations (how it plans: the "Which remat?" guide).

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
    An ``sr.RematPlan`` (its ``lengths``, innermost ``policy``, evaluations and bytes), to
    pass as ``sr.remat_scan(fn, lengths=plan)``.

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
  fn = _call if fn is None else fn
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
  return _search(stack, carry, fn, budget, bandwidth, max_depth, policy, carries, positions)


def _search(stack, carry, fn, budget, bandwidth, max_depth, policy, carries, positions):
  """``plan_remat`` on checked arguments: the model's pick, calibrated and compiled."""
  moves = moves_to_host()
  nested_keeps = policy is not None or nesting_keeps_policy()
  n, unit_fn, unit_states, unit_bytes = unit_inputs(stack, fn)
  as_shape = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  carry, abstract = jax.tree.map(as_shape, (carry, stack))
  carry_bytes = tree_bytes(carry)
  given = {GIVEN: policy} if policy is not None else POLICIES
  residuals = {
    name: residual_bytes(unit_fn, unit_states, carry, innermost)
    for name, innermost in given.items()
  }

  def verify(plan: RematPlan) -> int:
    run = _candidate(fn, plan)
    loss = lambda m, c: sum(jnp.sum(x) for x in jax.tree.leaves(run(m, c)))
    with quiet():  # planning's compiles: the plan warns once, where it is run
      lowered = jit(grad(loss)).lower(abstract, carry)
    analysis: Any = lowered.compile().memory_analysis()  # None only where XLA gives none
    return int(analysis.temp_size_in_bytes)

  unit = "cycle" if len(positions) > 1 else "layer"
  measured: dict[tuple, int] = {}

  def measure(plan: RematPlan) -> int:  # each plan compiled at most once while planning
    key = (plan.lengths, plan.policy_name, plan.carries)
    if key not in measured:
      measured[key] = verify(plan)
    return measured[key]

  working_sets: dict[str, int] | None = None  # W per policy, once calibrated
  # The plan before the model picks; each pick fills in its nesting and figures.
  blank = RematPlan(
    n, (), NOTHING, 0, 0, None, (), carry_bytes, unit_bytes, verify, unit=unit, _policy=policy
  )

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
    )
    unpicked = dataclasses.replace(blank, memory_budget=budget, candidates=tuple(ranked))
    return picking(unpicked, best, measured.get((best.lengths, best.policy, best.carries)))

  working_sets = calibrate(make(None, None), measure, residuals)
  if budget is None:
    plan = make(None, None)
    if plan.measured_bytes is not None:
      return plan
    working_sets = None  # the pick's policy was derived: measure it
    working_sets = calibrate(make(None, None), measure, residuals, plan.policy_name)
    return make(None, None)
  if carries is not None:
    return fit_budget(make, budget, measure)
  if not moves:
    note = (
      f" Offloading the outer levels' carries (carries='offload') would not help: "
      f"this backend ({jax.default_backend()}) moves nothing to host memory."
    )
    return fit_budget(make, budget, measure, note=note)
  offloading = lambda scales, budget: make(scales, budget, ("offload",))
  return fit_budget(make, budget, measure, offloading, bandwidth or 25e9)


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
