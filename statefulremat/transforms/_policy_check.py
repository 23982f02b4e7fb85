"""What is saved is what was asked: remat policies checked against the traced body.

Three policies of ``jax.checkpoint_policies`` can do something other than what they say
without any error from JAX:

* a names policy (``save_only_these_names("atn")``) whose names match no
  ``jax.ad_checkpoint.checkpoint_name`` in the body is a silent no-op;
* a policy that claims to exclude names but saves them anyway (JAX 0.10's
  ``save_anything_except_these_names`` ignores its names and saves everything);
* an offload policy on a backend that offloads nothing (CPU: the transfer to host
  memory is dropped when lowering, the residuals stay where they are).

``policy_check(policy, what)`` reads the policy once, when the transform is made (the
second case raises there), and returns None when there is nothing to check at trace
time, so a policy-free transform pays nothing. Otherwise ``check.run(f, *args)`` runs
``f`` — a function whose trace contains the ``jax.checkpoint`` with ``policy`` — once
per trace: for a names policy it traces ``f`` to a jaxpr, compares the policy's names
with those the checkpointed body gives (sub-jaxprs included: jit, scan, cond, custom
derivatives, nested remat), then evaluates that same jaxpr, so the user's function is
traced once; for an offload policy it warns when the backend moves nothing to the host.

The policies are recognised by what they are (the classes and factories of
``jax.checkpoint_policies``) and judged by what they do: an excluding policy is asked
about its own names, the backend is asked to lower a tiny offload.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import ClosedJaxpr, Jaxpr

from ..core._errors import TransformError

_POLICIES = jax.checkpoint_policies
_SAVE_ONLY = type(_POLICIES.save_only_these_names())
_SAVE_NAMES_BUT = type(_POLICIES.save_any_names_but_these())


@functools.cache
def name_primitive():
  """The primitive ``jax.ad_checkpoint.checkpoint_name`` binds, learnt by tracing it."""
  return jax.make_jaxpr(lambda x: checkpoint_name(x, "n"))(0.0).eqns[0].primitive


@functools.cache
def _remat_primitive():
  """The primitive ``jax.checkpoint`` binds, learnt by tracing it."""
  return jax.make_jaxpr(jax.checkpoint(lambda x: x))(0.0).eqns[0].primitive


@dataclasses.dataclass(frozen=True)
class _Reading:
  """What a policy says about names: those it saves or offloads (``keeps``), those it
  excludes (``excludes``; None where the policy kept no record of them), and the memory
  kinds it offloads to."""

  keeps: tuple[str, ...] = ()
  excludes: tuple[str, ...] | None = ()
  offload_to: tuple[str, ...] = ()
  excluders: tuple[Callable, ...] = ()  # the parts that claim to exclude names


def _made_by(policy, factory: str) -> bool:
  return (getattr(policy, "__module__", "") or "").startswith("jax") and (
    getattr(policy, "__qualname__", "").startswith(factory + ".")
  )


def _closure(policy) -> dict[str, Any]:
  code, cells = getattr(policy, "__code__", None), getattr(policy, "__closure__", None)
  if code is None or not cells:
    return {}
  return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def _strings(value) -> tuple[str, ...]:
  if isinstance(value, (set, frozenset, list, tuple)) and all(isinstance(v, str) for v in value):
    return tuple(sorted(value))
  return ()


def _read(policy) -> _Reading:
  """The names and offloads of a ``jax.checkpoint_policies`` policy (recursively through
  ``save_from_both_policies``); an unknown policy says nothing."""
  if isinstance(policy, _SAVE_ONLY):
    return _Reading(keeps=tuple(sorted(policy.saveable_names)))
  if isinstance(policy, _SAVE_NAMES_BUT):
    names = tuple(sorted(policy.names))
    return _Reading(excludes=names, excluders=(policy,))
  cells = _closure(policy)
  if _made_by(policy, "save_from_both_policies"):
    parts = [_read(cells[k]) for k in ("policy_1", "policy_2") if k in cells]
    excludes = [p.excludes for p in parts]
    known = [e for e in excludes if e is not None]
    return _Reading(
      keeps=tuple(n for p in parts for n in p.keeps),
      excludes=None if len(known) < len(excludes) else tuple(n for e in known for n in e),
      offload_to=tuple(d for p in parts for d in p.offload_to),
      excluders=tuple(e for p in parts for e in p.excluders),
    )
  if _made_by(policy, "save_and_offload_only_these_names"):
    return _Reading(
      keeps=_strings(cells.get("names_which_can_be_saved", ()))
      + _strings(cells.get("names_which_can_be_offloaded", ())),
      offload_to=(str(cells.get("offload_dst")),),
    )
  if _made_by(policy, "offload_dot_with_no_batch_dims"):
    return _Reading(offload_to=(str(cells.get("offload_dst")),))
  if _made_by(policy, "save_anything_except_these_names"):
    kept = [_strings(v) for v in cells.values() if isinstance(v, (set, frozenset, tuple))]
    excludes = tuple(n for names in kept for n in names) if kept else None
    return _Reading(excludes=excludes, excluders=(policy,))
  return _Reading()


def _saves(decision) -> bool:
  """Whether a policy's answer keeps the value (saved or offloaded)."""
  if isinstance(decision, bool):
    return decision
  return type(decision).__name__ != "RecomputeType"


def _describe(policy) -> str:
  if isinstance(policy, _SAVE_ONLY):
    names = ", ".join(map(repr, sorted(policy.saveable_names)))
    return f"jax.checkpoint_policies.save_only_these_names({names})"
  if isinstance(policy, _SAVE_NAMES_BUT):
    names = ", ".join(map(repr, sorted(policy.names)))
    return f"jax.checkpoint_policies.save_any_names_but_these({names})"
  qualname = getattr(policy, "__qualname__", "")
  if (getattr(policy, "__module__", "") or "").startswith("jax") and "." in qualname:
    return f"jax.checkpoint_policies.{qualname.split('.')[0]}(...)"
  return getattr(policy, "__name__", None) or repr(policy)


def _check_excluders(reading: _Reading, policy, what: str) -> None:
  """Raises where a part of ``policy`` that claims to exclude names saves them."""
  name_p = name_primitive()
  aval = jax.core.ShapedArray((), jnp.float32)
  for part in reading.excluders:
    part_reading = _read(part)
    if part_reading.excludes is None:
      # No record of the names kept: ask about a name it cannot have been given.
      probes, lost = ("<statefulremat probe>",), True
    else:
      probes, lost = part_reading.excludes, False
    saved = [n for n in probes if _saves(part(name_p, aval, name=n))]
    if not saved:
      continue
    how = (
      "ignores the names it was given (it keeps no record of them) and saves every "
      "value, named or not"
      if lost
      else f"saves {', '.join(map(repr, saved))}, which it was told to exclude"
    )
    whole = "" if part is policy else f" (inside policy={_describe(policy)})"
    raise TransformError(
      f"{what}: policy={_describe(part)}{whole} {how}, so remat would save what "
      f"you asked it not to. Fix: `jax.checkpoint_policies.save_any_names_but_these("
      f"{'*names' if lost else ', '.join(map(repr, probes))})` saves the named values "
      "except those names and recomputes the rest; "
      "`jax.checkpoint_policies.everything_saveable` if saving everything is meant."
    )


class PolicyCheck:
  """The trace-time checks of one transform's policy (see the module docstring)."""

  __slots__ = ("policy", "what", "names", "offload_to")

  def __init__(self, policy, what: str, names: tuple[str, ...], offload_to: tuple[str, ...]):
    self.policy, self.what = policy, what
    self.names, self.offload_to = names, offload_to

  def run(self, f: Callable, *args):
    """``f(*args)``, after checking the policy against the body ``f`` traces."""
    if self.offload_to:
      self._warn_offload()
    if not self.names:
      return f(*args)
    closed, shapes = jax.make_jaxpr(f, return_shape=True)(*args)
    found = _names_under(closed.jaxpr, self.policy)
    if found is not None:
      self._check_names(found)
    # Bound where we stand, not where make_jaxpr stood: its tracebacks stop at its
    # own frame, and the equations' source lines would lose the user's code.
    out = jax.core.eval_jaxpr(
      closed.jaxpr, closed.consts, *jax.tree.leaves(args), propagate_source_info=False
    )
    return jax.tree.unflatten(jax.tree.structure(shapes), out)

  def _check_names(self, found: set[str]) -> None:
    missing = [n for n in self.names if n not in found]
    if not missing:
      return
    listed = []
    for name in missing:
      close = difflib.get_close_matches(name, sorted(found), n=1)
      listed.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if found:
      there = f"The body names: {', '.join(map(repr, sorted(found)))}."
    else:
      there = "The body names nothing: it has no checkpoint_name at all."
    plural, them = ("s", "them") if len(missing) > 1 else ("", "it")
    raise TransformError(
      f"{self.what}: policy={_describe(self.policy)} refers to the name{plural} "
      f"{', '.join(listed)}, which no `jax.ad_checkpoint.checkpoint_name` in the "
      f"traced body gives, so the policy would silently ignore {them}. {there} Fix: "
      "spell the policy's names as the body does, or name the value in the body: "
      f"`checkpoint_name(x, {missing[0]!r})`."
    )

  def _warn_offload(self) -> None:
    for kind in self.offload_to:
      platform = jax.default_backend()
      if _offloads(platform, kind):
        continue
      warnings.warn(
        f"{self.what}: policy={_describe(self.policy)} offloads residuals to "
        f"{kind!r} memory, but on this backend ({platform}) nothing is offloaded: the "
        "compiled program has no transfer to host memory, so the values the policy "
        "offloads stay in device memory, as if it saved them. Offloading needs a "
        "GPU or TPU backend; here, a saving policy (e.g. "
        "jax.checkpoint_policies.save_only_these_names) says what happens.",
        UserWarning,
        stacklevel=_user_stacklevel(),
      )


# Frames of these folders are not the user's: a warning points past them.
_NOT_USER = (
  os.path.dirname(jax.__file__) + os.sep,
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


def _user_stacklevel() -> int:
  """The ``stacklevel`` of the innermost caller outside statefulremat and JAX."""
  frame, level = sys._getframe(2), 2  # 1 is the function calling warnings.warn
  while frame.f_back is not None and frame.f_code.co_filename.startswith(_NOT_USER):
    frame, level = frame.f_back, level + 1
  return level


@functools.cache
def _offloads(platform: str, kind: str) -> bool:
  """Whether the default backend, ``platform``, moves an offloaded residual to ``kind``
  memory: it has that memory kind and the lowered program of a tiny offloading remat
  transfers to it."""
  device = jax.devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  if kind not in kinds:
    return False
  policy = _POLICIES.offload_dot_with_no_batch_dims("device", kind)

  def loss(w, x):
    return jnp.sum(jax.checkpoint(lambda w, x: jnp.sin(x @ w), policy=policy)(w, x))

  w = jax.ShapeDtypeStruct((2, 2), jnp.float32)
  text = jax.jit(jax.grad(loss)).lower(w, w).as_text()
  return "annotate_device_placement" in text or "_xla_buffer_placement" in text


def _sub_jaxprs(jaxpr: Jaxpr) -> Iterator[tuple[Any, Jaxpr]]:
  """``(equation, sub-jaxpr)`` for each jaxpr in an equation's parameters (jit, scan,
  cond branches, while, custom_jvp / custom_vjp, remat)."""
  for eqn in jaxpr.eqns:
    for value in eqn.params.values():
      for v in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(v, ClosedJaxpr):
          yield eqn, v.jaxpr
        elif isinstance(v, Jaxpr):
          yield eqn, v


def _checkpoint_names(jaxpr: Jaxpr) -> set[str]:
  """Every name ``jax.ad_checkpoint.checkpoint_name`` gives in ``jaxpr``, sub-jaxprs
  included."""
  name_p = name_primitive()
  names = {eqn.params["name"] for eqn in jaxpr.eqns if eqn.primitive is name_p}
  for _, sub in _sub_jaxprs(jaxpr):
    names |= _checkpoint_names(sub)
  return names


def _names_under(jaxpr: Jaxpr, policy) -> set[str] | None:
  """The names given inside every ``jax.checkpoint`` with ``policy`` in ``jaxpr``;
  None if there is no such checkpoint (then there is nothing to compare)."""
  remat_p = _remat_primitive()
  found: set[str] | None = None
  for eqn, sub in _sub_jaxprs(jaxpr):
    if eqn.primitive is remat_p and eqn.params.get("policy") is policy:
      found = (found or set()) | _checkpoint_names(sub)
    else:
      inner = _names_under(sub, policy)
      if inner is not None:
        found = (found or set()) | inner
  return found


def policy_check(policy, what: str) -> PolicyCheck | None:
  """The trace-time check of ``policy`` (None: nothing to check). Raises at once for
  a policy that saves what it claims to exclude."""
  if policy is None:
    return None
  reading = _read(policy)
  if reading.excluders:
    _check_excluders(reading, policy, what)
  names = tuple(dict.fromkeys(reading.keeps + (reading.excludes or ())))
  if not names and not reading.offload_to:
    return None
  return PolicyCheck(policy, what, names, reading.offload_to)
