"""The planner's search (``sr.plan_remat``, ``lengths="auto"``): it compiles candidates
with the ``scan(fn, plan)`` it is given, never importing the transform that calls it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ...core._module import Module
from ...core._stacks import cycle, is_stacked
from .._autodiff import grad
from .._jit import jit
from .._rules import TransformError
from ._carries import check_carries, moves_to_host, quiet
from ._remat_budget import calibrate, fit_budget
from ._remat_plan import (
  GIVEN,
  POLICIES,
  RematPlan,
  choose,
  nesting_keeps_policy,
  parse_bytes,
  residual_bytes,
  tree_bytes,
  unit_inputs,
)


def search_plans(
  stack,
  carry,
  *,
  fn: Callable[..., Any],
  scan: Callable[[Callable, RematPlan], Callable],
  memory_budget: int | str | None = None,
  max_depth: int = 4,
  policy: Callable[..., Any] | None = None,
  carries: str | None = None,
  host_bandwidth: float | str = "25GB/s",
) -> RematPlan:
  """``sr.plan_remat``'s plan; ``scan(fn, plan)`` builds the candidates it compiles."""
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
  moves = moves_to_host()
  nested_keeps = policy is not None or nesting_keeps_policy()
  n, unit_fn, unit_states, unit_bytes = unit_inputs(stack, fn)
  carry = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), carry)
  carry_bytes = tree_bytes(carry)
  given = {GIVEN: policy} if policy is not None else POLICIES
  residuals = {
    name: residual_bytes(unit_fn, unit_states, carry, innermost)
    for name, innermost in given.items()
  }
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), stack)

  def verify(plan: RematPlan) -> int:
    run = scan(fn, plan)
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
    return RematPlan(
      n,
      best.lengths,
      best.policy,
      best.evals,
      best.temp_bytes,
      budget,
      tuple(ranked),
      carry_bytes,
      unit_bytes,
      verify,
      measured_bytes=measured.get((best.lengths, best.policy, best.carries)),
      unit=unit,
      _policy=policy,
      carries=best.carries,
    )

  def calibrated(policy: str | None = None) -> None:
    nonlocal working_sets
    working_sets = None
    working_sets = calibrate(make(None, None), measure, residuals, policy)

  calibrated()
  if budget is None:
    plan = make(None, None)
    if plan.measured_bytes is not None:
      return plan
    calibrated(plan.policy_name)  # the pick's policy was derived: measure it
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
