"""Where a stack's carries live: ``carries="device"`` (the default) or ``"offload"``.

The backward pass of a scan needs each step's input carry. ``sr.remat_scan`` keeps one
per outer step, and those live through the whole backward pass; ``sr.scan`` keeps one
per layer. With ``carries="offload"`` they are kept in host memory (``pinned_host``)
instead of on the device, as haliax's ``ScanCheckpointPolicy(save_carries="offload")``
does, by JAX's documented offload pattern: at the start of each step of a level whose
carries are offloaded, the loop state (the carried variables' values and the user's
carry) is named ``STACK_CARRY`` with ``checkpoint_name``, and that level's
``jax.checkpoint`` gets a policy that offloads the name. The body only ever reads the
named copy, so the copy (in host memory) is all the backward pass keeps of the step's
input. Everything else the level saves is what it saved before: nothing on an outer
``remat_scan`` level, the user's ``policy`` on a single one; on ``sr.scan``'s step,
everything, as a plain scan does, unless the body is rematerialised.

That exception is JAX's nesting rule: under an outer ``jax.checkpoint`` the outer
policy decides for every value inside, an inner checkpoint's included, so saving
everything would override ``sr.scan(sr.remat(Block, policy=p))``'s ``p`` and keep all of
the block's intermediates. So while the step is traced, each ``sr.remat`` in it reports
its policy (``report_remat``), and the step's policy answers as that one policy does
(several different ones: as the first; a raw ``jax.checkpoint`` is not seen).

The name is ours alone: the policy checks leave it out of the names a body gives, and
``sr.saved_residuals`` lists the offloaded carries under it. On a backend that offloads
nothing (CPU) the carries stay on the device, so each trace warns once.
"""

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
  """Whether ``carries`` asks for the offload; raises for a value that is not a choice.
  ``planned``: ``None`` is a choice too (``sr.remat_scan``'s: the plan's, else device)."""
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
  """A remat policy: the values named ``STACK_CARRY`` offloaded to host memory,
  every other value as ``inner`` answers (``None``: recomputed; ``True``: saved).
  ``__wrapped__`` lets the policy check find the user's policy inside."""

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
def tracing_step(policy: OffloadCarries):
  """While ``sr.scan``'s step is traced: the ``sr.remat`` calls in it report to ``policy``."""
  token = _TRACING.set(policy)
  try:
    yield
  finally:
    _TRACING.reset(token)


def report_remat(policy) -> None:
  """Called by ``sr.remat`` as it checkpoints its body: its ``policy`` (None: nothing
  saveable) is what the enclosing offloading scan step saves (see module docstring)."""
  step = _TRACING.get()
  if step is not None and (not step.remats or step.remats[0] is not policy):
    step.remats.append(policy)


@functools.cache  # one policy object per inner policy: jax caches traces by policy
def offload_policy(inner=None) -> OffloadCarries:
  """The policy of a level whose carries are offloaded (see ``OffloadCarries``)."""
  return OffloadCarries(inner)


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("sr_carries_quiet", default=False)


def warn_if_kept(what: str) -> None:
  """Warns (once per trace: the transforms call it once per call) where the default
  backend moves nothing to host memory; not inside ``warning_once``'s call."""
  platform = jax.default_backend()
  if _QUIET.get() or _offloads(platform, _HOST):
    return
  warnings.warn(
    f"{what}: carries='offload' keeps the carries the stack saves for the backward "
    f"pass in host memory, but on this backend ({platform}) nothing is offloaded: they "
    "stay in device memory, and the results are the same as carries='device'. "
    "Offloading needs a GPU or TPU backend.",
    UserWarning,
    stacklevel=_user_stacklevel(),
  )


@contextlib.contextmanager
def quiet():
  """No warning from the stacks traced inside (the planner compiling its candidates)."""
  token = _QUIET.set(True)
  try:
    yield
  finally:
    _QUIET.reset(token)


def warning_once(fn: Callable, what: str) -> Callable:
  """``fn`` (a pipeline, which traces each stage's ``sr.remat_scan`` more than once)
  warning once per call, for ``what``, and its stacks inside silent."""

  @functools.wraps(fn)
  def call(*args, **kwargs):
    warn_if_kept(what)
    token = _QUIET.set(True)
    try:
      return fn(*args, **kwargs)
    finally:
      _QUIET.reset(token)

  return call


def offloaded(step: Callable, policy: Callable | None, remat: bool, prevent_cse: bool):
  """``step(state, *x)`` under a ``jax.checkpoint`` that keeps its input ``state`` in host
  memory; every other value as ``policy`` says (``remat``), or saved as a plain scan
  saves it (not ``remat``: ``sr.scan``'s step)."""

  if remat:
    tagged = lambda state, *x: step(tag(state), *x)
    return jax.checkpoint(tagged, policy=offload_policy(policy), prevent_cse=prevent_cse)
  saving = OffloadCarries(True)  # its own: the sr.remat calls in the body report to it

  def reporting(state, *x):
    with tracing_step(saving):
      return step(tag(state), *x)

  return jax.checkpoint(reporting, policy=saving, prevent_cse=prevent_cse)
