"""A plan that offloads, checked before the planner returns it (README.md): offloading
has been seen to do nothing (JAX issue #23869, scan carries) and to give wrong gradients
(openxla PR #46231, scan residuals on jaxlib 0.11.0)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._policy_check import Policy
from ._remat_plan import RematPlan


def offload_problem(
  plan: RematPlan, compiled: jax.stages.Compiled, unit_fn: Callable, states: Any, carry: Any
) -> str | None:
  """Why ``plan``'s offload is refused (None: it moves bytes and its gradient is right).

  ``compiled`` is the plan's gradient; ``unit_fn(states, carry)`` one unit of the stack,
  whose gradient under the plan's policy must equal the one saving on the device."""
  policy = plan.policy
  what = (
    f"the names {', '.join(map(repr, policy.offloaded))}"
    if isinstance(policy, Policy) and policy.offloaded
    else "the outer levels' carries"
  )
  host = getattr(compiled.memory_analysis(), "host_temp_size_in_bytes", 0) or 0
  if not host:
    return (
      f"Not offloaded: the plan offloading {what} (lengths={plan.lengths}) compiles to a "
      f"program that keeps no host bytes on this backend ({jax.default_backend()}), so "
      "its offload would move nothing (as JAX issue #23869 reports of scan carries); "
      "planned with nothing offloaded."
    )
  if not isinstance(policy, Policy) or not policy.offloaded:
    return None
  on_device = Policy("the device plan", policy.saved + policy.offloaded)
  got, want = (_gradient(unit_fn, states, carry, p) for p in (policy, on_device))
  worst = max((float(np.max(np.abs(a - b))) for a, b in zip(got, want)), default=0.0)
  if all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want)):
    return None
  return (
    f"Not offloaded: with {what} offloaded, one {plan.unit}'s gradient differs from the "
    f"plan saving them on the device (by up to {worst:.3g}), so this jaxlib offloads "
    "wrongly (openxla PR #46231 fixed such a bug in scan residuals for jaxlib 0.11.0); "
    "planned with nothing offloaded."
  )


def _gradient(unit_fn: Callable, states: Any, carry: Any, policy) -> list[np.ndarray]:
  """The gradient of one unit rematerialised under ``policy``, at fixed random inputs."""
  leaves, tree = jax.tree.flatten((states, carry))
  rng = np.random.default_rng(0)
  values = [
    jnp.asarray(rng.normal(size=x.shape), x.dtype)
    if jnp.issubdtype(x.dtype, jnp.inexact)
    else jnp.zeros(x.shape, x.dtype)
    for x in leaves
  ]
  inexact = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
  unit = jax.checkpoint(lambda *x: unit_fn(*jax.tree.unflatten(tree, x)), policy=policy)
  loss = lambda *x: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(unit(*x)))
  return [np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=inexact))(*values)]
