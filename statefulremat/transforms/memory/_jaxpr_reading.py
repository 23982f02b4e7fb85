"""Reading a traced program as the installed jax writes it.

The policy checks and ``sr.saved_residuals`` read three things off a jaxpr: where
``jax.ad_checkpoint.checkpoint_name`` named a value, which ``jax.checkpoint`` carries a
given policy, and the bodies an equation calls (jit, scan, cond, custom derivatives,
remat). JAX writes these differently across versions and remat implementations: under
``jax_remat3`` both ``jax.checkpoint`` and ``checkpoint_name`` bind one generic
primitive whose single parameter is a rule object with parameters of its own. So
nothing here names a primitive or a JAX class. How this jax writes a named value, or a
checkpoint's policy, is learnt once per remat implementation by tracing the public
call with a probe (a probe name, a probe policy) and finding where the probe sits among
the equation's parameters, or among the parameters of a rule object there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Jaxpr

PROBE_NAME = "<statefulremat probe>"  # a name no user gives a value
# The name the stacks give the carries they offload (``carries="offload"``, ``_carries``):
# the library's, never a name of the user's body.
STACK_CARRY = "sr_stack_carry"


def _probe_policy(*_, **__) -> bool:
  return False


def _params(eqn) -> Iterator[tuple[tuple[str, ...], Any]]:
  """``(path, value)`` for each parameter of ``eqn``, and for each parameter of a rule
  object among them (an object with a ``params`` mapping, as jax_remat3 binds)."""
  for key, value in eqn.params.items():
    yield (key,), value
    inner = getattr(value, "params", None)
    if isinstance(inner, Mapping):
      for inner_key, inner_value in inner.items():
        yield (key, inner_key), inner_value


class _Layout(NamedTuple):
  """Where a traced call puts a parameter: the primitive it binds, the path to the
  parameter, and the type of the rule object on that path (None: a direct parameter)."""

  primitive: Any
  path: tuple[str, ...]
  owner: type | None

  def read(self, eqn) -> Any:
    """The parameter in ``eqn`` if ``eqn`` is such a call, else None."""
    if eqn.primitive is not self.primitive:
      return None
    value = eqn.params.get(self.path[0])
    if self.owner is None:
      return value
    if type(value) is not self.owner:
      return None
    return value.params.get(self.path[1])


def _learn(trace: Callable[[], Any], is_probe: Callable[[Any], bool]) -> _Layout:
  closed = jax.make_jaxpr(trace)()
  for eqn in closed.jaxpr.eqns:
    for path, value in _params(eqn):
      if is_probe(value):
        owner = type(eqn.params[path[0]]) if len(path) > 1 else None
        return _Layout(eqn.primitive, path, owner)
  raise RuntimeError(  # only a jax that drops its own parameters reaches this
    f"statefulremat cannot find the probe in this jax's jaxpr:\n{closed}"
  )


def remat_flavour() -> bool:
  """Which remat implementation traces now (jax_remat3 exists from jax 0.12)."""
  return bool(getattr(jax.config, "jax_remat3", False))


@functools.cache
def _name_layout(_flavour: bool) -> _Layout:
  x = jnp.zeros((), jnp.float32)
  return _learn(
    lambda: checkpoint_name(x, PROBE_NAME), lambda v: isinstance(v, str) and v == PROBE_NAME
  )


@functools.cache
def _policy_layout(_flavour: bool) -> _Layout:
  x = jnp.zeros((), jnp.float32)
  return _learn(
    lambda: jax.checkpoint(jnp.sin, policy=_probe_policy)(x), lambda v: v is _probe_policy
  )


def checkpoint_name_of(eqn) -> str | None:
  """The name ``eqn`` gives its value, if it is a ``checkpoint_name``."""
  name = _name_layout(remat_flavour()).read(eqn)
  return name if isinstance(name, str) else None


def remat_policy_of(eqn) -> Any:
  """The policy of ``eqn``, if it is a ``jax.checkpoint`` (None otherwise)."""
  return _policy_layout(remat_flavour()).read(eqn)


def sub_jaxprs(eqn) -> Iterator[Jaxpr]:
  """Every jaxpr ``eqn`` calls (a jit's, a scan's body, cond's branches, a
  checkpoint's body, custom derivatives' primal)."""
  for _, value in _params(eqn):
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, Jaxpr):
        yield v
      elif isinstance(getattr(v, "jaxpr", None), Jaxpr):  # a closed jaxpr
        yield v.jaxpr


def called_body(eqn) -> Jaxpr | None:
  """The one body whose outputs are ``eqn``'s outputs, one to one (jit, scan, remat,
  custom derivatives); None where there is none or several (cond, while)."""
  bodies = [j for j in sub_jaxprs(eqn) if len(j.outvars) == len(eqn.outvars)]
  return bodies[0] if len(bodies) == 1 else None


def checkpoint_names(jaxpr: Jaxpr) -> set[str]:
  """Every name ``checkpoint_name`` gives in ``jaxpr``, called bodies included."""
  names = set()
  for eqn in jaxpr.eqns:
    name = checkpoint_name_of(eqn)
    if name is not None:
      names.add(name)
    for sub in sub_jaxprs(eqn):
      names |= checkpoint_names(sub)
  return names


def names_under(jaxpr: Jaxpr, policy) -> set[str] | None:
  """The names the body gives inside every ``jax.checkpoint`` with ``policy`` (or with
  a policy wrapping it, as ``_carries.OffloadCarries`` does) in ``jaxpr``, the stacks'
  own ``STACK_CARRY`` left out; None where there is no such checkpoint (then there is
  nothing to compare)."""
  found: set[str] | None = None
  for eqn in jaxpr.eqns:
    used = remat_policy_of(eqn)
    if used is not None and (used is policy or getattr(used, "__wrapped__", None) is policy):
      for sub in sub_jaxprs(eqn):
        found = (found or set()) | (checkpoint_names(sub) - {STACK_CARRY})
      continue
    for sub in sub_jaxprs(eqn):
      inner = names_under(sub, policy)
      if inner is not None:
        found = (found or set()) | inner
  return found


@functools.cache
def reduce_precision_primitive() -> Any:
  """The primitive ``lax.reduce_precision`` binds (remat puts it on saved values),
  learnt by tracing it rather than named."""
  x = jnp.zeros((), jnp.float32)
  return jax.make_jaxpr(lambda: jax.lax.reduce_precision(x, 8, 23))().jaxpr.eqns[0].primitive


def is_offload_copy(eqn) -> bool:
  """Whether ``eqn`` copies one value from device into host memory, as the residuals
  an offload policy offloads are copied (on every backend, CPU included): read off
  the values' memory spaces, whatever primitive this jax copies with."""
  if len(eqn.invars) != 1 or len(eqn.outvars) != 1:
    return False
  host = jax.memory.Space.Host
  space = getattr(eqn.outvars[0].aval, "memory_space", None)
  return space == host and getattr(eqn.invars[0].aval, "memory_space", None) != host
