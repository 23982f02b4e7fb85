"""``sr.remat_scan``'s ``lengths``, ``length``, ``policy`` and ``memory_budget``, checked."""

from __future__ import annotations

import math

from ._module_arg import resolve_length, stacked_sources
from ._rules import TransformError
from .memory._remat_names import AUTO
from .memory._remat_plan import RematPlan, parse_bytes


def resolve_plan(what, lengths, length, policy, memory_budget, carries=None):
  """``(lengths, length, policy, budget, carries)`` from a RematPlan, ``"auto"`` or a tuple."""
  if isinstance(lengths, RematPlan):
    plan = lengths
    if carries is not None and carries != plan.carries:
      raise TransformError(
        f"{what}: the plan keeps its carries in {plan.carries!r} memory; drop "
        f"`carries={carries!r}`, or pass `lengths=plan.lengths, carries=...` to "
        "override it."
      )
    if length is not None and length != plan.n:
      raise TransformError(f"{what}: the plan is for {plan.n} layers but length={length}.")
    if policy is not None:
      raise TransformError(
        f"{what}: the plan chose its innermost policy ({plan.policy_name}); drop "
        "`policy=`, or pass `lengths=plan.lengths, policy=...` to override it."
      )
    if memory_budget is not None:
      raise TransformError(
        f"{what}: memory_budget plans lengths='auto'; the plan "
        f"given was made for budget {plan.memory_budget}."
      )
    return plan.lengths, plan.n, plan.policy, None, plan.carries
  if isinstance(lengths, str):
    if lengths != AUTO:
      raise TransformError(
        f"{what}: lengths={lengths!r}; the only string it takes is "
        "'auto' (plan the nesting at trace time)."
      )
    return AUTO, length, policy, parse_bytes(memory_budget), carries  # planned with them
  if memory_budget is not None and policy != AUTO:
    raise TransformError(
      f"{what}: memory_budget={memory_budget!r} is for planning; pass "
      "lengths='auto' or policy='auto' with it (or sr.plan_remat(...) to see the plan "
      "first)."
    )
  return tuple(lengths), length, policy, parse_bytes(memory_budget), carries


def check_lengths(what: str, lengths: tuple, length: int | None) -> int:
  """The number of layers N, after checking ``lengths`` and ``length`` agree."""
  if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths):
    raise TransformError(
      f"{what}: lengths={lengths!r} must be a non-empty tuple of positive ints, one "
      "per level of nesting, e.g. lengths=(10, 10) for 100 layers (or "
      "lengths=(10, 10), length=97 for 97)."
    )
  total = math.prod(lengths)
  if length is None:
    return total
  if not isinstance(length, int) or isinstance(length, bool) or length < 1:
    raise TransformError(f"{what}: length={length!r} must be a positive int, the number of layers.")
  if length > total:
    raise TransformError(
      f"{what}: lengths={lengths} cover {total} layers, fewer than length={length}. "
      f"Fix: lengths whose product is at least {length}, e.g. "
      f"{covering(length, len(lengths))}; the last segment may be short."
    )
  if total - length >= total // lengths[0]:
    raise TransformError(
      f"{what}: lengths={lengths} cover {total} layers; with length={length} at least "
      f"one whole outer step ({total // lengths[0]} layers) would run nothing. Fix: "
      f"{covering(length, len(lengths))}."
    )
  return length


def covering(n: int, depth: int) -> str:
  """The smallest balanced ``lengths`` of ``depth`` levels covering ``n`` layers."""
  base = max(1, round(n ** (1 / depth)))
  lengths = [base] * depth
  i = 0
  while math.prod(lengths) < n:
    lengths[i % depth] += 1
    i += 1
  return f"lengths={tuple(lengths)}"


def check_cycles(what: str, lengths: tuple, length: int, period: int) -> None:
  """For a pattern, ``lengths`` counts cycles: it must cover all of them."""
  cycles = -(-length // period)
  if math.prod(lengths) < cycles:
    raise TransformError(
      f"{what}: for a pattern of {period} blocks, lengths counts cycles, and "
      f"lengths={lengths} covers {math.prod(lengths)} cycles, fewer than the {cycles} "
      f"that length={length} needs ({length} layers / {period} per cycle, the last "
      f"cycle may be short). Fix: {covering(cycles, len(lengths))}, or "
      "lengths='auto'."
    )


def check_units(what: str, n: int, lengths: tuple | str, loop) -> None:
  """The given count against the loop's (layers, or for a pattern, cycles)."""
  if loop.period > 1:
    if isinstance(lengths, tuple):
      check_cycles(what, lengths, loop.length, loop.period)
  else:
    product = isinstance(lengths, tuple) and n == math.prod(lengths)
    label = f"lengths={lengths} (product)" if product else f"length={n}"
    sources = stacked_sources(loop.treatment, loop.lifted, loop.variables)
    resolve_length(what, [(label, n)] + sources)
