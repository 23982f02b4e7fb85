"""How ``sr.plan_remat`` stays true to XLA: it compiles, a few times at most.

The memory model (``_remat_plan``) ranks every nesting and policy. What one unit's
backward pass needs besides the terms that change between nestings (its working set
``W``) is XLA's to decide, so ``calibrate`` compiles the model's best plan for each
innermost policy once and takes ``W`` from the difference.

With a budget the model picks the plan with the fewest block evaluations that it puts
inside the budget (less 3 % headroom). A budget is a promise, and the model is an
estimate, so ``fit_budget`` compiles the pick to check it; where the model was off it
rescales the model by XLA's figure and picks again; and it tries the plans with fewer
evaluations that the model put just over the budget (within its error), a few
compiles at most. When none fits, the error names the smallest plan and its need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NoReturn

from ...core._errors import TransformError
from ._remat_plan import DOTS, RematPlan, counted, format_bytes

NEAR_MISS = 1.05  # the model's error band, above the budget
MODEL_SLACK = 0.01  # what the band adds to the model's error measured on the pick
PROBES = 8  # compiles at most, to find a plan with fewer evaluations

#: ``make(scales, budget)``: the model's pick, its figures for a nesting of depth ``d``
#: scaled by ``scales[d]``, under ``budget`` (None: the least memory at <= 3N
#: evaluations); raises ``TransformError`` when the model puts every plan over it.
MakePlan = Callable[[dict[int, float] | None, int | None], RematPlan]


def calibrate(
  model: RematPlan,
  measure: Callable[[RematPlan], int],
  residuals: dict[str, int],
  policy: str | None = None,
) -> dict[str, int]:
  """``W`` per innermost policy. For ``policy`` (default: that of ``model``'s best
  candidate) it is XLA's temp bytes for the best candidate of that policy
  (``measure(plan)``: one compile), less the model's figure for it (``model`` is made
  without ``W``); negative where the model's constant terms overcount a small block.
  The others are derived: a policy that saves ``R_p`` bytes per unit reads them from
  the saved stack where the other recomputes them, so ``W_p = W - (R_p - R)`` (within
  3 % of a compile on the planner benchmark's blocks)."""
  policy = model.candidates[0].policy if policy is None else policy
  best = next(c for c in model.candidates if c.policy == policy)  # best first
  working_set = measure(_picking(model, best)) - best.temp_bytes
  return {p: working_set - (r - residuals[policy]) for p, r in residuals.items()}


def fit_budget(
  make: MakePlan,
  budget: int,
  measure: Callable[[RematPlan], int],
  offload: MakePlan | None = None,
  host_bandwidth: float = 25e9,
  note: str = "",
) -> RematPlan:
  """The plan with the fewest evaluations that fits ``budget`` once compiled
  (``measure(plan)``: XLA's temp bytes, each plan compiled once), with its
  ``measured_bytes``; raises ``TransformError`` naming the smallest plan when none of
  those tried fits (``note`` ends its message). Where none keeping the carries on the
  device fits and ``offload`` makes plans that may offload them, those are tried next;
  the plan then says why it offloads, and what that costs at ``host_bandwidth`` bytes
  per second."""
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
  if plan.carries == "device" or on_device is None:
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
  """Where the plan keeps its carries, and why, for a plan that fits ``budget``."""
  pick = (
    f"lengths={plan.lengths} ({plan.policy_name}, {plan.evals // plan.n}N evaluations) "
    f"needs {format_bytes(plan.measured_bytes or 0)} on the device once compiled"
  )
  if plan.carries == "device":
    return (
      f"Carries on the device: recompute alone meets memory_budget={format_bytes(budget)}; {pick}."
    )
  return f"Carries in host memory, as carries='offload' asks; {pick}."


def _fit(make: MakePlan, budget: int, measure: Callable[[RematPlan], int], note: str) -> RematPlan:
  try:
    plan = make(None, budget)
  except TransformError:
    # The model puts every plan over the budget; those within its error of it may
    # still fit once compiled.
    unbudgeted = dataclasses.replace(make(None, None), memory_budget=budget)
    fitting = _smallest_that_fits(unbudgeted, budget, measure)
    if fitting is None:
      _no_plan_fits(unbudgeted, budget, measure, note)
    return fitting
  # Where the model is exact (Dense + tanh: to 0.1 % of XLA's figure), a plan with fewer
  # evaluations that it puts under the budget itself, inside the headroom kept for
  # other blocks, is compiled first: where it fits, that one compile is all.
  bold = _bolder(plan, budget)
  if bold is not None:
    measured = measure(bold)
    if measured <= budget:
      return _fewer_evaluations(bold, measured, budget, measure)
  # A budget is a promise: compile the pick, and where the model was off for this
  # block (small shapes, other backends, deep nestings), scale its figures for nestings
  # of that depth by what XLA said and choose again.
  scales: dict[int, float] = {}
  for _ in range(4):
    measured = measure(plan)
    if measured <= budget:
      return _fewer_evaluations(plan, measured, budget, measure)
    depth = len(plan.lengths)
    scales[depth] = scales.get(depth, 1.0) * measured / plan.temp_bytes
    try:
      plan = make(scales, budget)
    except TransformError:
      break
  _no_plan_fits(plan, budget, measure, note)


def _no_plan_fits(
  plan: RematPlan, budget: int, measure: Callable[[RematPlan], int], note: str
) -> NoReturn:
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


def _smallest(plan: RematPlan, measure: Callable[[RematPlan], int]) -> RematPlan:
  """Of the model's smallest candidate (compiled now) and ``plan`` (compiled), the one
  that needs less once compiled, with its ``measured_bytes``."""
  smallest = _picking(plan, min(plan.candidates, key=lambda c: c.temp_bytes))
  best = min(smallest, plan, key=measure)
  return dataclasses.replace(best, measured_bytes=measure(best))


def _picking(plan: RematPlan, pick, measured: int | None = None) -> RematPlan:
  """``plan`` with the candidate ``pick`` chosen (first among its candidates)."""
  rest = tuple(c for c in plan.candidates if c is not pick)
  return dataclasses.replace(
    plan,
    lengths=pick.lengths,
    policy_name=pick.policy,
    carries=pick.carries,
    evals=pick.evals,
    temp_bytes=pick.temp_bytes,
    candidates=(pick,) + rest,
    measured_bytes=measured,
  )


def _bolder(plan: RematPlan, budget: int) -> RematPlan | None:
  """The plan with the fewest evaluations, fewer than ``plan``'s, that the model puts
  at most at the budget (no headroom); or None."""
  bolder = [c for c in plan.candidates if c.evals < plan.evals and c.temp_bytes <= budget]
  if not bolder:
    return None
  return _picking(
    plan, min(bolder, key=lambda c: (c.evals, c.policy != DOTS, c.temp_bytes, len(c.lengths)))
  )


def _fewer_evaluations(
  plan: RematPlan, measured: int, budget: int, verify: Callable[[RematPlan], int]
) -> RematPlan:
  """``plan`` (that fits, ``measured`` bytes once compiled) with its measure, or one
  with fewer evaluations that fits once compiled though the model put it over the
  budget's headroom by up to its error on this block (read from the compile of
  ``plan``: ``measured`` against ``temp_bytes``, plus 1 %, at most 5 %): where the
  model is exact only plans it puts under the budget itself are compiled, where it was
  off a few per cent a tight budget sits within that of several nestings."""
  error = abs(measured / plan.temp_bytes - 1) if plan.temp_bytes else 1.0
  band = min(NEAR_MISS, 1 + error + MODEL_SLACK)
  near = sorted(
    (c for c in plan.candidates if c.evals < plan.evals and c.temp_bytes <= band * budget),
    key=lambda c: (-c.evals, c.temp_bytes),
  )
  for probe in near[:PROBES]:  # the next fewer evaluations first, likeliest first
    probed = verify(_picking(plan, probe))
    if probed <= budget:
      return _picking(plan, probe, probed)
  return dataclasses.replace(plan, measured_bytes=measured)


def _smallest_that_fits(
  plan: RematPlan, budget: int, verify: Callable[[RematPlan], int]
) -> RematPlan | None:
  """The plan with the fewest evaluations among those the model puts just over the
  budget (within its error) that fit once compiled, the smallest tried first; or None."""
  near = sorted(
    (c for c in plan.candidates if c.temp_bytes <= NEAR_MISS * budget), key=lambda c: c.temp_bytes
  )
  for probe in near[:PROBES]:
    candidate = _picking(plan, probe)
    measured = verify(candidate)
    if measured <= budget:
      return _fewer_evaluations(candidate, measured, budget, verify)
  return None
