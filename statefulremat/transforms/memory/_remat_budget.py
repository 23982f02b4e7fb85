"""Fitting a plan to ``memory_budget``, checked by compiling a few picks (README.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NoReturn

from ...core._errors import TransformError
from ._remat_plan import DOTS, RematPlan, counted, effort, format_bytes

NEAR_MISS = 1.05  # the model's error band, above the budget
MODEL_SLACK = 0.01  # what the band adds to the model's error measured on the pick
PROBES = 8  # compiles at most, to find a plan with fewer evaluations
FRONTIER = 5  # plans compiled at most for policy="auto"'s memory-cost frontier

#: ``make(scales, budget)``: the model's pick, depth ``d``'s figures scaled by ``scales[d]``.
MakePlan = Callable[[dict[int, float] | None, int | None], RematPlan]
#: ``measure(plan)``: XLA's temp bytes for ``plan``, each plan compiled once however often asked.
Measure = Callable[[RematPlan], int]


def calibrate(
  model: RematPlan,
  measure: Measure,
  residuals: dict[str, int],
  policy: str | None = None,
) -> dict[str, int]:
  """``W`` per innermost policy: ``policy``'s measured by one compile, the others derived."""
  policy = model.candidates[0].policy if policy is None else policy
  best = next(c for c in model.candidates if c.policy == policy)  # best first
  working_set = measure(picking(model, best)) - best.temp_bytes
  return {p: working_set - (r - residuals[policy]) for p, r in residuals.items()}


def calibrate_names(model: RematPlan, measure: Measure, residuals: dict[str, int]) -> dict:
  """``policy="auto"``'s residual bytes scaled by what XLA keeps of them: one more compile,
  of the policy saving most at the calibrated pick's nesting (README.md)."""
  low = model.candidates[0]
  most = max(residuals, key=residuals.__getitem__)
  same = lambda c: (c.lengths, c.carries, c.policy) == (low.lengths, low.carries, most)
  high = next((c for c in model.candidates if same(c)), None)
  if high is None or high.temp_bytes <= low.temp_bytes:
    return residuals
  slope = (measure(picking(model, high)) - measure(picking(model, low))) / (
    high.temp_bytes - low.temp_bytes
  )
  base = residuals[low.policy]
  return {p: base + max(0, round(slope * (r - base))) for p, r in residuals.items()}


def fit_budget(
  make: MakePlan,
  budget: int,
  measure: Measure,
  offload: MakePlan | None = None,
  host_bandwidth: float = 25e9,
  note: str = "",
) -> RematPlan:
  """The plan with the fewest evaluations that fits ``budget`` once compiled, offloading
  the carries (``offload``) only where no plan keeping them on the device fits."""
  try:
    plan = _fit(make, budget, measure, note)
    return dataclasses.replace(plan, reason=_why(plan, budget))
  except TransformError as error:
    if offload is None:
      raise
    on_device = getattr(error, "smallest", None)
  try:
    plan = _fit(offload, budget, measure, "")
  except TransformError as error:
    raise TransformError(f"{error} (Its carries in host memory: carries='offload'.)") from None
  if on_device is None:
    return dataclasses.replace(plan, reason=_why(plan, budget))
  host = next(c.host_bytes for c in plan.candidates if c.carries == plan.carries)
  return dataclasses.replace(
    plan,
    reason=(
      f"Carries offloaded: no plan keeping them on the device fits memory_budget="
      f"{format_bytes(budget)} (the smallest, lengths={on_device.lengths}, needs "
      f"{format_bytes(on_device.measured_bytes or 0)}); with the outer levels' carries "
      f"in host memory, {format_bytes(host)} go out and back per step (~"
      f"{1e3 * host / host_bandwidth:.1f} ms each way at host_bandwidth="
      f"{host_bandwidth / 1e9:g} GB/s), and lengths={plan.lengths} needs "
      f"{format_bytes(plan.measured_bytes or 0)} on the device."
    ),
  )


def _why(plan: RematPlan, budget: int) -> str:
  """Where the plan keeps its carries, and why."""
  pick = (
    f"lengths={plan.lengths} ({plan.policy_name}, {plan.evals // plan.n}N evaluations) "
    f"needs {format_bytes(plan.measured_bytes or 0)} on the device once compiled"
  )
  meets = f"memory_budget={format_bytes(budget)}"
  if plan.carries == "offload":
    return f"Carries in host memory, as carries='offload' asks; {pick}."
  return f"Carries on the device: recompute alone meets {meets}; {pick}."


def _fit(make: MakePlan, budget: int, measure: Measure, note: str) -> RematPlan:
  try:
    plan = make(None, budget)
  except TransformError:
    # Every plan is over the budget; those within the model's error may still fit.
    plan = dataclasses.replace(make(None, None), memory_budget=budget)
    near = [c for c in plan.candidates if c.temp_bytes <= NEAR_MISS * budget]
    near.sort(key=lambda c: c.temp_bytes)
    fitting = _first_fit(plan, near[:PROBES], budget, measure)
  else:
    # A plan with fewer evaluations that the model puts inside the headroom is tried first.
    cheaper = [c for c in plan.candidates if effort(c) < effort(plan) and c.temp_bytes <= budget]
    cheaper.sort(key=lambda c: (effort(c), c.policy != DOTS, c.temp_bytes, len(c.lengths)))
    fitting = _first_fit(plan, cheaper[:1], budget, measure)
    # Where the model was off for this block, scale its figures for that depth and rechoose.
    scales: dict[int, float] = {}
    for _ in range(4 if fitting is None else 0):
      measured = measure(plan)
      if measured <= budget:
        fitting = plan
        break
      depth = len(plan.lengths)
      scales[depth] = scales.get(depth, 1.0) * measured / plan.temp_bytes
      try:
        plan = make(scales, budget)
      except TransformError:
        break
  if fitting is None:
    _no_plan_fits(plan, budget, measure, note)
  return _fewer_evaluations(fitting, budget, measure)


def _no_plan_fits(plan: RematPlan, budget: int, measure: Measure, note: str) -> NoReturn:
  smallest = _smallest(plan, measure)
  need = format_bytes(smallest.measured_bytes or 0)
  error = TransformError(
    f"no remat plan for {counted(plan.n, plan.unit)} fits memory_budget="
    f"{format_bytes(budget)} once compiled: the smallest, lengths={smallest.lengths} "
    f"({smallest.policy_name}, {smallest.evals // smallest.n}N evaluations), needs "
    f"{need}. Fix: a budget of at least {need} (that plan), a smaller batch or carry, "
    f"or sharding the activations over more devices.{note}"
  )
  error.smallest = smallest  # type: ignore[attr-defined]  # for fit_budget's reason
  raise error


def _smallest(plan: RematPlan, measure: Measure) -> RematPlan:
  """Of the model's smallest candidate and ``plan``, the one smaller once compiled."""
  smallest = picking(plan, min(plan.candidates, key=lambda c: c.temp_bytes))
  best = min(smallest, plan, key=measure)
  return dataclasses.replace(best, measured_bytes=measure(best))


def picking(plan: RematPlan, pick, measured: int | None = None) -> RematPlan:
  """``plan`` with the candidate ``pick`` chosen (first among its candidates)."""
  rest = tuple(c for c in plan.candidates if c is not pick)
  return dataclasses.replace(
    plan,
    lengths=pick.lengths,
    policy_name=pick.policy,
    carries=pick.carries,
    evals=pick.evals,
    temp_bytes=pick.temp_bytes,
    recomputed_flops=pick.flops,
    cost=pick.cost,
    candidates=(pick,) + rest,
    measured_bytes=measured,
  )


def _first_fit(plan: RematPlan, picks: list, budget: int, measure: Measure) -> RematPlan | None:
  """``plan`` picking the first of ``picks`` that fits ``budget`` once compiled; or None."""
  for pick in picks:
    measured = measure(picking(plan, pick))
    if measured <= budget:
      return picking(plan, pick, measured)
  return None


def _fewer_evaluations(plan: RematPlan, budget: int, measure: Measure) -> RematPlan:
  """``plan`` (which fits), or one with fewer evaluations that fits once compiled though
  the model put it over the headroom by up to its error on this block."""
  measured = measure(plan)  # compiled already
  error = abs(measured / plan.temp_bytes - 1) if plan.temp_bytes else 1.0
  band = min(NEAR_MISS, 1 + error + MODEL_SLACK)
  near = sorted(
    (c for c in plan.candidates if effort(c) < effort(plan) and c.temp_bytes <= band * budget),
    key=lambda c: (-effort(c), c.temp_bytes),
  )
  fewer = _first_fit(plan, near[:PROBES], budget, measure)  # the next fewer evaluations first
  return fewer or dataclasses.replace(plan, measured_bytes=measured)


def frontier(plan: RematPlan, measure: Measure) -> tuple[RematPlan, ...]:
  """The memory-cost frontier of ``plan``'s candidates: the model's Pareto set, at most
  ``FRONTIER`` of it (its two ends and evenly between), compiled, and kept where the
  measured bytes still trade against cost: less memory first, never cheaper."""
  pareto, best = [], float("inf")
  for c in sorted(plan.candidates, key=lambda c: (c.temp_bytes, effort(c))):
    if effort(c) < best:
      pareto.append(c)
      best = effort(c)
  last = len(pareto) - 1
  picks = sorted({round(i * last / max(1, FRONTIER - 1)) for i in range(FRONTIER)})
  measured = [picking(plan, pareto[i], measure(picking(plan, pareto[i]))) for i in picks]
  kept, best = [], float("inf")
  for p in sorted(measured, key=lambda p: (p.measured_bytes, effort(p))):
    if effort(p) < best:
      kept.append(p)
      best = effort(p)
  return tuple(kept)
