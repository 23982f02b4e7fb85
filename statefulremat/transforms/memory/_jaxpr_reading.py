"""Reading a traced program as the installed jax writes it, learnt by tracing probes (README.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Jaxpr

PROBE_NAME = "<statefulremat probe>"  # a name no user gives a value
# The name the stacks give the carries they offload (``carries="offload"``).
STACK_CARRY = "sr_stack_carry"


def _probe_policy(*_, **__) -> bool:
  return False


def _params(eqn) -> Iterator[tuple[tuple[str, ...], Any]]:
  """``(path, value)`` for each parameter of ``eqn`` and of a rule object among them."""
  for key, value in eqn.params.items():
    yield (key,), value
    inner = getattr(value, "params", None)
    if isinstance(inner, Mapping):
      for inner_key, inner_value in inner.items():
        yield (key, inner_key), inner_value


class _Layout(NamedTuple):
  """Where a traced call puts a parameter: its primitive, path and rule object's type."""

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


def _learn(trace: Callable[[jax.Array], Any], probe) -> _Layout:
  """Where the call ``trace`` makes puts ``probe`` among its parameters."""
  closed = jax.make_jaxpr(trace)(jnp.zeros((), jnp.float32))
  for eqn in closed.jaxpr.eqns:
    for path, value in _params(eqn):
      if type(value) is type(probe) and value == probe:
        owner = type(eqn.params[path[0]]) if len(path) > 1 else None
        return _Layout(eqn.primitive, path, owner)
  raise RuntimeError(  # only a jax that drops its own parameters reaches this
    f"statefulremat cannot find the probe in this jax's jaxpr:\n{closed}"
  )


def remat_flavour() -> bool:
  """Which remat implementation traces now (jax_remat3 exists from jax 0.12)."""
  return bool(getattr(jax.config, "jax_remat3", False))


@functools.cache
def _layouts(_flavour: bool) -> tuple[_Layout, _Layout]:
  """Where this remat implementation puts a ``checkpoint_name``'s name, and a policy."""
  return (
    _learn(lambda x: checkpoint_name(x, PROBE_NAME), PROBE_NAME),
    _learn(jax.checkpoint(jnp.sin, policy=_probe_policy), _probe_policy),
  )


def checkpoint_name_of(eqn) -> str | None:
  """The name ``eqn`` gives its value, if it is a ``checkpoint_name``."""
  name = _layouts(remat_flavour())[0].read(eqn)
  return name if isinstance(name, str) else None


def remat_policy_of(eqn) -> Any:
  """The policy of ``eqn``, if it is a ``jax.checkpoint`` (None otherwise)."""
  return _layouts(remat_flavour())[1].read(eqn)


def sub_jaxprs(eqn) -> Iterator[Jaxpr]:
  """Every jaxpr ``eqn`` calls."""
  for _, value in _params(eqn):
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, Jaxpr):
        yield v
      elif isinstance(getattr(v, "jaxpr", None), Jaxpr):  # a closed jaxpr
        yield v.jaxpr


def called_body(eqn) -> Jaxpr | None:
  """The one body whose outputs are ``eqn``'s, one to one; None for none or several."""
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
  """The names given inside every ``jax.checkpoint`` with ``policy`` (or wrapping it) in
  ``jaxpr``, ``STACK_CARRY`` aside; None where there is no such checkpoint."""
  found: set[str] | None = None
  for eqn in jaxpr.eqns:
    used = remat_policy_of(eqn)
    ours = used is not None and (used is policy or getattr(used, "__wrapped__", None) is policy)
    for sub in sub_jaxprs(eqn):
      inner = checkpoint_names(sub) - {STACK_CARRY} if ours else names_under(sub, policy)
      if inner is not None:
        found = (found or set()) | inner
  return found


@functools.cache
def reduce_precision_primitive() -> Any:
  """The primitive ``lax.reduce_precision`` binds, learnt by tracing it."""
  rounding = jax.make_jaxpr(lambda x: jax.lax.reduce_precision(x, 8, 23))(jnp.float32(0))
  return rounding.jaxpr.eqns[0].primitive


def is_offload_copy(eqn) -> bool:
  """Whether ``eqn`` copies one value from device into host memory."""
  if len(eqn.invars) != 1 or len(eqn.outvars) != 1:
    return False
  host = jax.memory.Space.Host
  space = getattr(eqn.outvars[0].aval, "memory_space", None)
  return space == host and getattr(eqn.invars[0].aval, "memory_space", None) != host
