"""``policy="auto"``: what each checkpoint name of a block saves and costs, and the policies
worth planning with (README.md)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Jaxpr, Literal

from ._jaxpr_reading import STACK_CARRY, checkpoint_name_of, checkpoint_names, sub_jaxprs
from ._policy_check import Policy, custom_policy
from ._remat_plan import saved_bytes

AUTO = "auto"
EXHAUSTIVE = 4096  # the most name assignments searched one by one; above, a greedy chain
# Equations that move or relabel values: no arithmetic to count.
_FREE = {
  "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "convert_element_type",
  "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "copy", "copy_p", "pad",
  "select_n", "iota", "gather", "optimization_barrier", "device_put", "stop_gradient",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Keeping:
  """One innermost policy's figures for one unit: its residual bytes and recomputed FLOPs."""

  choices: dict[str, str]  # every name of the unit: "remat", "device" or "offload"
  device: int  # residual bytes kept in device memory
  host: int  # residual bytes offloaded to host memory
  flops: int  # FLOPs the backward pass recomputes, beyond saving every value

  @functools.cached_property
  def policy(self) -> Policy:
    return custom_policy(self.choices)

  def seconds(self, device_flops: float, host_bandwidth: float) -> float:
    """The unit's recompute and host traffic (out and back), in seconds."""
    return self.flops / device_flops + 2 * self.host / host_bandwidth


@dataclasses.dataclass(frozen=True)
class NameTable:
  """Per checkpoint name of a unit: bytes kept if saved, FLOPs recomputed if not."""

  names: tuple[str, ...]
  bytes: dict[str, int]
  flops: dict[str, int]
  base_bytes: int  # residual bytes with every name recomputed
  base_flops: int  # recomputed FLOPs with every name recomputed
  forward_flops: int  # one forward pass of the unit

  def keeping(self, choices: dict[str, str]) -> Keeping:
    """The additive figures of ``choices`` (``{name: "remat" | "device" | "offload"}``),
    each name it leaves out recomputed."""
    kept = [n for n, c in choices.items() if c != "remat"]
    host = sum(self.bytes[n] for n, c in choices.items() if c == "offload")
    device = self.base_bytes + sum(self.bytes[n] for n in kept) - host
    flops = max(0, self.base_flops - sum(self.flops[n] for n in kept))
    every = {n: choices.get(n, "remat") for n in self.names}  # sorted: one repr per policy
    return Keeping(every, device, host, flops)


def flops(jaxpr: Jaxpr) -> int:
  """The FLOPs of ``jaxpr``: exact for dots and convolutions, one per element elsewhere."""
  total = 0
  for eqn in jaxpr.eqns:
    subs = list(sub_jaxprs(eqn))
    if subs:
      inner = [flops(s) for s in subs]
      branches = "branches" in eqn.params  # a cond runs one of them
      total += (max(inner) if branches else sum(inner)) * int(eqn.params.get("length", 1))
      continue
    if not eqn.outvars or checkpoint_name_of(eqn) is not None:
      continue  # a name gives its value a name, nothing more
    name, size = eqn.primitive.name, math.prod(_shape(eqn.outvars[0]))
    if name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = _shape(eqn.invars[0])
      total += 2 * size * math.prod(lhs[i] for i in contract)
    elif name == "conv_general_dilated":
      rhs = _shape(eqn.invars[1])
      out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
      total += 2 * size * math.prod(rhs) // out_features
    elif name not in _FREE:
      total += size
  return total


def _shape(var) -> tuple[int, ...]:
  return getattr(var.aval, "shape", ())


def name_table(unit_fn: Callable, states: Any, carry: Any) -> NameTable:
  """The unit's names, each measured by tracing (no compile): one trace per name, two more."""
  trace, forward = _tracer(unit_fn, states, carry)
  names = tuple(sorted(checkpoint_names(forward) - {STACK_CARRY}))
  traced = lambda saved: trace(jax.checkpoint_policies.save_only_these_names(*saved))
  everything = trace(jax.checkpoint_policies.everything_saveable)[1]
  base_bytes, base = traced(())
  alone = {name: traced((name,)) for name in names}
  return NameTable(
    names,
    {n: max(0, b - base_bytes) for n, (b, _) in alone.items()},
    {n: max(0, base - f) for n, (_, f) in alone.items()},
    base_bytes,
    base - everything,
    flops(forward),
  )


def recomputed_flops(unit_fn: Callable, states: Any, carry: Any, policy) -> tuple[int, int]:
  """``(forward FLOPs, FLOPs recomputed under policy)`` of one unit, from three traces."""
  trace, forward = _tracer(unit_fn, states, carry)
  everything = trace(jax.checkpoint_policies.everything_saveable)[1]
  return flops(forward), max(0, trace(policy)[1] - everything)


def _tracer(unit_fn: Callable, states: Any, carry: Any) -> tuple[Callable, Jaxpr]:
  """``(trace(policy) -> (residual bytes, FLOPs), the unit's forward jaxpr)``."""
  leaves, tree = jax.tree.flatten((states, carry))
  flat = lambda *x: unit_fn(*jax.tree.unflatten(tree, x))
  params = len(jax.tree.leaves(states))
  return (lambda policy: _traced(flat, leaves, params, policy)), jax.make_jaxpr(flat)(*leaves).jaxpr


def _traced(flat: Callable, leaves: list, params: int, policy) -> tuple[int, int]:
  """``(residual bytes, FLOPs)`` of the unit's forward and backward passes rematerialised
  under ``policy``, from one trace; the residuals are the pullback's arrays, the first
  ``params`` inputs (the unit's variables) aside."""
  checkpointed = jax.checkpoint(flat, policy=policy)

  def step(*x):
    out, pullback = jax.vjp(checkpointed, *x)
    return jax.tree.leaves(pullback), pullback(out)

  closed = jax.make_jaxpr(step)(*leaves)
  saved, inputs = closed.jaxpr.outvars, set(closed.jaxpr.invars[:params])
  residuals = saved[: len(saved) - len(leaves)]
  kept = (v for v in residuals if not isinstance(v, Literal) and v not in inputs)
  return saved_bytes(kept), flops(closed.jaxpr)


def keepings(table: NameTable, offload: bool, device_flops: float, bandwidth: float) -> list:
  """The policies worth planning with: for each amount of device memory, the cheapest one
  (a Pareto set over device bytes and recompute + traffic seconds), least memory first."""
  choices = ("remat", "device", "offload") if offload else ("remat", "device")
  names = [n for n in table.names if table.bytes[n] or table.flops[n]]
  if len(choices) ** len(names) <= EXHAUSTIVE:
    assignments = itertools.product(choices, repeat=len(names))
    found = [table.keeping(dict(zip(names, a))) for a in assignments]
  else:
    found = _chain(table, names, offload)
  seconds = lambda k: k.seconds(device_flops, bandwidth)
  pareto, best = [], math.inf
  for k in sorted(found, key=lambda k: (k.device, seconds(k), k.host)):
    if seconds(k) < best:
      pareto.append(k)
      best = seconds(k)
  return pareto


def _chain(table: NameTable, names: list[str], offload: bool) -> list[Keeping]:
  """MaxText's walk, ordered by what a byte saves: every name recomputed, then each in turn
  (most FLOPs saved per byte first) offloaded, then each kept on the device."""
  order = sorted(names, key=lambda n: -table.flops[n] / max(1, table.bytes[n]))
  choices = dict.fromkeys(names, "remat")
  found = [table.keeping(choices)]
  for step in ("offload", "device") if offload else ("device",):
    for name in order:
      choices[name] = step
      found.append(table.keeping(choices))
  return found
