"""Where a stack's carries live: ``carries="device"`` (the default) or ``"offload"`` (README.md)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import Offloadable, checkpoint_name

from ...core._errors import TransformError
from ._jaxpr_reading import STACK_CARRY, remat_flavour
from ._policy_check import _asked_primitive, _offloads, _user_stacklevel

CHOICES = ("device", "offload")
_HOST = "pinned_host"


def check_carries(what: str, carries, *, planned: bool = False) -> bool:
  """Whether ``carries`` asks for the offload (``planned``: None is a choice too)."""
  if (isinstance(carries, str) and carries in CHOICES) or (planned and carries is None):
    return carries == "offload"
  default = " (the default: None, where lengths='auto' decides)" if planned else ""
  raise TransformError(
    f"{what}: carries={carries!r}; it takes 'device' (the carries saved for the "
    "backward pass stay in device memory) or 'offload' (they are kept in "
    f"host memory){default}. Fix: carries='device' or carries='offload'."
  )


def moves_to_host() -> bool:
  """Whether the default backend moves offloaded values to host memory (CPU does not)."""
  return _offloads(jax.default_backend(), _HOST)


def tag(state):
  """``state`` named as a stack's carry: what the level's offload policy moves."""
  return jax.tree.map(lambda x: checkpoint_name(x, STACK_CARRY), state)


class OffloadCarries:
  """A remat policy offloading ``STACK_CARRY``, every other value as the first ``sr.remat``
  in the step reports, or as ``inner`` (None: recomputed; True: saved)."""

  __slots__ = ("__wrapped__", "_name_primitive", "remats", "__weakref__")  # jax: weakrefs

  def __init__(self, inner):
    self.__wrapped__ = inner
    self._name_primitive = _asked_primitive(remat_flavour())
    self.remats: list = []  # the policies of the sr.remat calls in a scan's step

  def __call__(self, prim, *avals, **params) -> Any:  # jax types policies as -> bool
    if prim is self._name_primitive and params.get("name") == STACK_CARRY:
      return Offloadable(src="device", dst=_HOST)
    inner = self.__wrapped__ if not self.remats else self.remats[0]
    if inner is None or isinstance(inner, bool):
      return bool(inner)
    return inner(prim, *avals, **params)


_TRACING: contextvars.ContextVar[OffloadCarries | None] = contextvars.ContextVar(
  "sr_offloading_step", default=None
)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def report_remat(policy) -> None:
  """Called by ``sr.remat``: its ``policy`` is what an enclosing offloading step saves."""
  step = _TRACING.get()
  if step is not None and (not step.remats or step.remats[0] is not policy):
    step.remats.append(policy)


# A level's offloading policy, one object per inner policy: jax caches traces by policy.
offload_policy = functools.cache(OffloadCarries)


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("sr_carries_quiet", default=False)


def warn_if_kept(what: str) -> None:
  """Warns where the default backend moves nothing to host memory (unless quiet)."""
  if _QUIET.get() or moves_to_host():
    return
  warnings.warn(
    f"{what}: carries='offload' keeps the carries the stack saves for the backward "
    f"pass in host memory, but on this backend ({jax.default_backend()}) nothing is offloaded: "
    "they stay in device memory, and the results are the same as carries='device'. "
    "Offloading needs a GPU or TPU backend.",
    UserWarning,
    stacklevel=_user_stacklevel(),
  )


def quiet():
  """No warning from the stacks traced inside (the planner compiling its candidates)."""
  return _setting(_QUIET, True)


def warning_once(fn: Callable, what: str) -> Callable:
  """``fn`` (a pipeline) warning once per call for ``what``, its stacks inside silent."""

  @functools.wraps(fn)
  def call(*args, **kwargs):
    warn_if_kept(what)
    with quiet():
      return fn(*args, **kwargs)

  return call


def offloaded(step: Callable, policy: Callable | None, remat: bool, prevent_cse: bool):
  """``step(state, *x)`` checkpointed with ``state`` in host memory, every other value as
  ``policy`` says (``remat``) or saved (``sr.scan``'s step)."""

  if remat:
    tagged = lambda state, *x: step(tag(state), *x)
    return jax.checkpoint(tagged, policy=offload_policy(policy), prevent_cse=prevent_cse)
  saving = OffloadCarries(True)  # its own: the sr.remat calls in the body report to it

  def reporting(state, *x):
    with _setting(_TRACING, saving):
      return step(tag(state), *x)

  return jax.checkpoint(reporting, policy=saving, prevent_cse=prevent_cse)
