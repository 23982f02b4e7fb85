"""The planner's memory model (README.md) and ``sr.RematPlan``, the ``lengths`` it picks."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.core
import jax.numpy as jnp
from jax.extend.core import Literal

from ...core._errors import TransformError
from ...core._stacks import cycle, num_layers, stacked_variables
from .._lift import lift
from ._jaxpr_reading import remat_flavour

# A plan fits a budget when the model puts it at most this fraction of it.
HEADROOM = 0.97
NOTHING = "nothing_saveable"
DOTS = "dots_saveable"
POLICIES = {NOTHING: None, DOTS: jax.checkpoint_policies.dots_saveable}
GIVEN = "given policy"  # the one policy a plan was asked to use (plan_remat(policy=))


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way to run N layers, with its evaluations and predicted temp (and host) bytes."""

  lengths: tuple
  policy: str
  evals: int
  temp_bytes: int
  carries: str = "device"
  host_bytes: int = 0
  flops: int | None = None  # recomputed FLOPs per step, where a policy was given or "auto"
  cost: float | None = None  # the step's recompute and host traffic in seconds (auto)


def effort(c) -> float:
  """What a candidate or plan costs, for ranking: its seconds where planned by names
  (``policy="auto"``), else its block evaluations."""
  return c.evals if c.cost is None else c.cost


@dataclasses.dataclass(frozen=True)
class RematPlan:
  """A planned ``remat_scan``, made by ``sr.plan_remat``: ``sr.remat_scan(f, lengths=plan)``.

  ``plan.policy`` is the innermost policy it runs; ``str(plan)`` a table of the best candidates.

  Args:
    n: the number of layers (cycles, for a pattern stack) the plan runs.
    lengths: the ``remat_scan`` nesting, outermost first (``(10, 10)``).
    policy_name: ``"nothing_saveable"``, ``"dots_saveable"`` or ``"given policy"``.
    evals: the block evaluations per gradient step.
    temp_bytes: the gradient's temp memory, as the model predicts it.
    memory_budget: the budget planning was given, in bytes; None for none.
    candidates: every plan considered, best first.
    carry_bytes: the bytes of the carry.
    layer_bytes: the bytes of one layer's (or cycle's) stacked variables.
    _verify: internal: compiles the plan's gradient, returns XLA's temp bytes (or None).
    measured_bytes: XLA's temp bytes where planning compiled the plan; else None.
    unit: what ``n`` counts: ``"layer"`` (the default), or ``"cycle"``.
    _policies: internal: the policies by ``policy_name`` (None: the two presets').
    carries: where the outer levels' saved carries live: ``"device"`` or ``"offload"``.
    reason: with a budget, where planning put the carries and why; else ``""``.
    recomputed_flops: with a ``policy`` given or ``"auto"``, the FLOPs a step recomputes
      beyond one forward pass (read from the block's jaxpr); else None.
    cost: with ``policy="auto"``, the step's recompute and host traffic in seconds.
    names: with ``policy="auto"``, ``(name, bytes saved, FLOPs recomputed)`` per name.
    _frontier: internal: compiles ``frontier``, where there is one.
  """

  n: int
  lengths: tuple
  policy_name: str
  evals: int
  temp_bytes: int
  memory_budget: int | None
  candidates: tuple
  carry_bytes: int
  layer_bytes: int
  _verify: Callable | None = dataclasses.field(default=None, repr=False, compare=False)
  measured_bytes: int | None = None
  unit: str = "layer"
  _policies: Mapping[str, Callable] | None = dataclasses.field(
    default=None, repr=False, compare=False
  )
  carries: str = "device"
  reason: str = ""
  recomputed_flops: int | None = None
  cost: float | None = None
  names: tuple = ()
  _frontier: Callable | None = dataclasses.field(default=None, repr=False, compare=False)

  @functools.cached_property
  def frontier(self) -> tuple:
    """With ``policy="auto"`` and no budget, the memory-cost frontier: plans, each compiled
    (``measured_bytes``), less memory first and never cheaper; compiled when first read."""
    return () if self._frontier is None else self._frontier()

  @property
  def policy(self):
    return (self._policies or POLICIES)[self.policy_name]

  def verify(self) -> int:
    """Compiles the gradient of this plan once; returns XLA's temp bytes."""
    if self._verify is None:
      raise TransformError(
        "this plan was made without a stack and carry to compile; "
        "use sr.plan_remat(stack, carry) to get one that verifies."
      )
    return self._verify(self)

  def __str__(self) -> str:
    budget = (
      "no budget" if self.memory_budget is None else f"budget {format_bytes(self.memory_budget)}"
    )
    offloading = any(c.carries != "device" for c in self.candidates)

    def row(mark, lengths, policy, evals, temp, carries) -> str:
      carries = f"{carries:>10}" if offloading else ""
      return f"{mark:2}{lengths:<18}{policy:<18}{evals:>8}{temp:>18}{carries}"

    lines = [
      f"RematPlan for N={self.n} {self.unit}s ({budget}; carry "
      f"{format_bytes(self.carry_bytes)}, one {self.unit} "
      f"{format_bytes(self.layer_bytes)})",
      row("", "lengths", "policy", "evals", "temp (predicted)", "carries"),
    ]
    chosen = (self.lengths, self.policy_name, self.carries)
    for c in self.candidates[:8]:
      mark = "->" if (c.lengths, c.policy, c.carries) == chosen else ""
      evals, temp = f"{c.evals // self.n}N", format_bytes(c.temp_bytes)
      lines.append(row(mark, str(c.lengths), c.policy, evals, temp, c.carries))
    if len(self.candidates) > 8:
      lines.append(f"  … {len(self.candidates) - 8} more")
    lines += self._kept_by_name()
    if self.reason:
      lines.append(self.reason)
    return "\n".join(lines)

  def _kept_by_name(self) -> list[str]:
    """``policy="auto"``'s choice per checkpoint name, with what it saves and costs."""
    if not self.names:
      return []
    policy, unit = self.policy, self.unit
    row = lambda *cells: "  {:<16}{:<10}{:>18}{:>22}".format(*cells)
    lines = [row("name", "kept", f"saved per {unit}", "recomputed if not")]
    host = 0
    for name, size, flops in self.names:
      choice = "device" if name in policy.saved else "remat"
      if name in policy.offloaded:
        choice, host = "offload", host + size
      lines.append(row(name, choice, format_bytes(size), format_flops(flops)))
    traffic = 2 * (self.n * host + next((c.host_bytes for c in self.candidates[:1]), 0))
    lines.append(
      f"Per step: {format_flops(self.recomputed_flops or 0)} recomputed beyond one forward "
      f"pass, {format_bytes(traffic)} of host traffic; ~{1e3 * (self.cost or 0):.3g} ms."
    )
    return lines


def structure(n: int, lengths: Sequence[int]) -> tuple[list[int], list[int]]:
  """``(steps, per_step)``: per level, the most steps a segment runs and the layers in one.

  >>> structure(97, (10, 10))
  ([10, 10], [10, 1])
  >>> structure(13, (2, 2, 4))
  ([2, 2, 4], [8, 4, 1])
  """
  per_step = [math.prod(lengths[i + 1 :]) for i in range(len(lengths))]
  steps, largest = [], n
  for m in per_step:
    steps.append(-(-largest // m))
    largest = min(largest, m)
  return steps, per_step


def runs_in_order(n: int, lengths: Sequence[int]) -> bool:
  """False if some level would run two single steps in a row (the model would not hold).

  >>> runs_in_order(97, (10, 10)), runs_in_order(97, (2, 49))
  (True, False)
  """

  def fine(count: int, level: int) -> bool:
    if level == len(lengths) - 1:
      return True
    m = math.prod(lengths[level + 1 :])
    full, rest = divmod(count, m)
    if full == 1 and rest:
      return False
    return (not full or fine(m, level + 1)) and (not rest or fine(rest, level + 1))

  return fine(n, 0)


def predict_temp(n: int, lengths: Sequence[int], carry: int, residual: int, layer: int) -> int:
  """The model's temp bytes for ``n`` layers nested as ``lengths``, uncalibrated."""
  steps, per_step = structure(n, lengths)
  d = len(lengths)
  return int(
    carry * sum(steps[:-1])
    + residual * steps[-1]
    + 2 * layer * sum(per_step[:-1])
    + (3 + (d >= 2)) * carry
    + ragged_bytes(n, lengths, carry, layer)
  )


def ragged_bytes(n: int, lengths: Sequence[int], carry: int, layer: int) -> int:
  """What short last segments add to the model's temp bytes (0 where ``lengths`` divide ``n``).

  >>> ragged_bytes(1000, (20, 10, 5), 16, 1), ragged_bytes(1000, (16, 9, 7), 16, 1)
  (0, 45)
  """
  extra, count = 0, n
  for i in range(len(lengths) - 1):
    full, rest = divmod(count, math.prod(lengths[i + 1 :]))
    if not rest:
      break
    if i == 0:
      extra -= carry
    if full:
      extra += layer * rest
    count = rest
  return extra


def offloaded_bytes(n: int, lengths: Sequence[int], carry: int) -> int:
  """The bytes ``carries="offload"`` keeps in host memory.

  >>> offloaded_bytes(100, (10, 10), 4), offloaded_bytes(100, (100,), 4)
  (40, 400)
  """
  steps = structure(n, lengths)[0]
  return carry * (sum(steps[:-1]) if len(steps) > 1 else steps[0])


def nestings(n: int, max_depth: int = 3):
  """Every ``lengths`` of 1 to ``max_depth`` levels covering ``n`` layers, each once.

  >>> sorted(nestings(7, 2))
  [(3, 3), (4, 2), (7,)]
  """
  seen = set()

  def extend(prefix: tuple, outer: int):
    inner = -(-n // outer)
    lengths = prefix + (inner,)
    key = tuple(structure(n, lengths)[0])
    if key not in seen and runs_in_order(n, lengths) and (len(lengths) == 1 or min(lengths) >= 2):
      seen.add(key)
      yield lengths
    if len(prefix) + 2 <= max_depth:
      for length in range(1, n // outer + 1):
        if outer * length <= n:
          yield from extend(prefix + (length,), outer * length)

  yield from extend((), 1)


_UNITS = {"": 1, "b": 1}
_UNITS.update({p + "b": 10 ** (3 * i) for i, p in enumerate("kmgt", start=1)})
_UNITS.update({p + "ib": 2 ** (10 * i) for i, p in enumerate("kmgt", start=1)})


def parse_bytes(budget: float | str | None, what: str = "memory_budget") -> int | None:
  """Bytes from a whole number or a string such as ``"512MiB"`` or ``"1.5 GB"``.

  >>> parse_bytes("512MiB"), parse_bytes("2 GB"), parse_bytes(1024), parse_bytes(1e9)
  (536870912, 2000000000, 1024, 1000000000)
  """
  if budget is None:
    return None
  if isinstance(budget, numbers.Real) and not isinstance(budget, bool):
    amount = float(budget)
    if amount > 0 and amount.is_integer():
      return int(amount)
    raise TransformError(
      f"{what}={budget!r} is not an amount of memory: bytes come whole and positive. "
      "Fix: a positive whole number of bytes (1e9 and 2**30 are), or a string such as "
      "'512MiB', '2GiB' or '1.5GB'."
    )
  match = re.fullmatch(
    r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget if isinstance(budget, str) else ""
  )
  if match is None or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
    raise TransformError(
      f"{what}={budget!r} is not an amount of memory. Fix: a positive number of bytes "
      "or a string such as '512MiB', '2GiB' or '1.5GB'."
    )
  return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def format_flops(n: int) -> str:
  for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} FLOP"


def counted(n: int, unit: str) -> str:
  """``n`` units as a message says them: ``"37 layers"``, or cycles said as such."""
  return f"{n} {unit}s" + (" (a cycle is one pass over the pattern)" if unit == "cycle" else "")


def choose(
  n: int,
  carry: int,
  layer: int,
  residuals: dict[str, int],
  memory_budget: int | None,
  max_depth: int = 4,
  scales: dict[int, float] | None = None,
  unit: str = "layer",
  working_sets: dict[str, int] | None = None,
  carries: Sequence[str] = ("device",),
  moves: bool = True,
  nested_keeps: bool = True,
  costing: Callable[[tuple, str, int], tuple[int, float]] | None = None,
  only: tuple | None = None,
) -> tuple[Candidate, list]:
  """The best candidate and all of them, best first (README.md says how they rank).

  ``costing(lengths, policy, host bytes) -> (recomputed FLOPs, seconds or None)`` counts
  what each recomputes, and ranks by the seconds (``policy="auto"``); ``only`` plans that
  one nesting."""
  candidates = []
  least = min(residuals.values())
  for lengths in nestings(n, max_depth) if only is None else (only,):
    evals = (len(lengths) + 1) * n
    scale = (scales or {}).get(len(lengths), 1.0)
    for policy, residual in residuals.items():
      # Where nestings keep nothing of the innermost policy, the one saving least stands for all.
      if not nested_keeps and len(lengths) > 1 and residual > least:
        continue
      temp = predict_temp(n, lengths, carry, residual, layer) + (working_sets or {}).get(policy, 0)
      for placement in carries:
        host = offloaded_bytes(n, lengths, carry) if placement == "offload" else 0
        # Offloaded, the saved carries leave the device but for one in transit.
        device = temp - (host - carry if moves and host else 0)
        flops, cost = costing(lengths, policy, host) if costing else (None, None)
        candidates.append(
          Candidate(
            lengths, policy, evals, max(0, int(scale * device)), placement, host, flops, cost
          )
        )
  # At equal cost, the plan that recomputes less: dots saved (or the given policy).
  if memory_budget is None:
    pool = [c for c in candidates if c.evals <= 3 * n]
    key = lambda c: (c.temp_bytes, effort(c), len(c.lengths), c.policy == NOTHING, c.host_bytes)
  elif candidates[0].cost is not None:
    pool = [c for c in candidates if c.temp_bytes <= HEADROOM * memory_budget]
    key = lambda c: (c.cost, c.temp_bytes, len(c.lengths))
  else:
    pool = [c for c in candidates if c.temp_bytes <= HEADROOM * memory_budget]
    key = lambda c: (
      (c.host_bytes > 0, c.evals, c.host_bytes),
      (c.policy == NOTHING, c.temp_bytes, len(c.lengths)),
    )
    if not pool:
      smallest = min(candidates, key=lambda c: c.temp_bytes)
      needed = math.ceil(smallest.temp_bytes / HEADROOM)
      raise TransformError(
        f"no remat plan for {counted(n, unit)} fits memory_budget="
        f"{format_bytes(memory_budget)}: the smallest needs "
        f"{format_bytes(smallest.temp_bytes)} (lengths={smallest.lengths}, "
        f"{smallest.policy}, {smallest.evals // n}N evaluations; predicted, planned "
        f"with 3 % headroom). Fix: a budget of at least {format_bytes(needed)}, a "
        "smaller batch or carry, or sharding the activations over more devices."
      )
  chosen = set(map(id, pool))
  ranked = sorted(pool, key=key) + sorted(
    (c for c in candidates if id(c) not in chosen), key=lambda c: c.temp_bytes
  )
  return ranked[0], ranked


def nesting_keeps_policy() -> bool:
  """Whether a nesting's innermost policy keeps what it saves (not under ``jax_remat3``)."""
  return _nesting_keeps_policy(remat_flavour())


@functools.cache
def _nesting_keeps_policy(_flavour: bool) -> bool:
  """Asks XLA once per remat implementation: equal temp bytes mean nothing was kept."""

  def loss(ws, h, policy):
    unit = jax.checkpoint(lambda h, w: jnp.tanh(h @ w), policy=policy)

    def inner(h, ws):
      return jax.lax.scan(lambda h, w: (unit(h, w), None), h, ws)[0]

    outer = lambda h, ws: (jax.checkpoint(inner)(h, ws), None)
    return jnp.sum(jax.lax.scan(outer, h, ws.reshape(2, 4, *ws.shape[1:]))[0])

  ws = jax.ShapeDtypeStruct((8, 32, 32), jnp.float32)
  h = jax.ShapeDtypeStruct((512, 32), jnp.float32)

  def temp(policy) -> int:
    lowered = jax.jit(jax.grad(loss), static_argnums=2).lower(ws, h, policy)
    analysis: Any = lowered.compile().memory_analysis()
    return int(analysis.temp_size_in_bytes)

  return temp(None) != temp(jax.checkpoint_policies.dots_saveable)


def residual_bytes(layer_fn: Callable, params: Any, carry: Any, policy) -> int:
  """Bytes one layer saves for its backward pass under ``policy``, its parameters aside."""
  leaves, tree = jax.tree.flatten((params, carry))
  checkpointed = jax.checkpoint(lambda *x: layer_fn(*jax.tree.unflatten(tree, x)), policy=policy)
  closed = jax.make_jaxpr(lambda *x: jax.tree.leaves(jax.vjp(checkpointed, *x)[1]))(*leaves)
  jaxpr = closed.jaxpr
  param_vars = set(jaxpr.invars[: len(jax.tree.leaves(params))])
  return saved_bytes(v for v in jaxpr.outvars if not isinstance(v, Literal) and v not in param_vars)


def saved_bytes(residuals) -> int:
  """Bytes of a pullback's residuals, given as jaxpr variables (each one once)."""
  avals = [cast(jax.core.ShapedArray, v.aval) for v in set(residuals)]  # each an array
  return sum(a.size * a.dtype.itemsize for a in avals)


def tree_bytes(tree: Any) -> int:
  return sum(math.prod(jnp.shape(x)) * jnp.result_type(x).itemsize for x in jax.tree.leaves(tree))


def unit_inputs(stack, fn: Callable) -> tuple[int, Callable, Any, int]:
  """``(units, unit_fn(states, carry) -> carry, abstract states, stacked bytes of one unit)``."""
  positions = cycle(stack)
  found = {}

  def one_unit(stack):
    lifted, variables, _, _ = lift((tuple(p.layer(0) for p in cycle(stack)),), {})
    found["lifted"] = lifted
    return [v._value for v in variables]

  states = jax.eval_shape(one_unit, stack)
  units = -(-sum(map(num_layers, positions)) // len(positions))
  stacked = tree_bytes([v._value for p in positions for _, v, _, _ in stacked_variables(p)])

  def unit_fn(states, carry):
    def chain(layers):
      return functools.reduce(lambda out, layer: fn(layer, out), layers, carry)

    return found["lifted"].run(chain, list(states), [], "the planner", restructure=True)[0]

  return units, unit_fn, states, stacked // units
