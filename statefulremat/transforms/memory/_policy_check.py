"""``sr.policies.Policy``, and remat policies checked against the body they wrap (README.md)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
from jax.ad_checkpoint import Offloadable, Recompute, checkpoint_name

from ...core._errors import TransformError
from ._jaxpr_reading import PROBE_NAME, names_under, remat_flavour

_POLICIES = jax.checkpoint_policies
_ALLOW_LISTS = ("save_only_these_names", "save_and_offload_only_these_names")
_EXCLUDING = ("save_any_names_but_these", "save_anything_except_these_names")
_OFFLOADING = ("save_and_offload_only_these_names", "offload_dot_with_no_batch_dims")
CUSTOM_CHOICES = ("remat", "device", "offload")  # what sr.policies.custom does with a name
#: Other names for the values ``sr.nn`` tags, as custom takes them.
ALIASES = {"attention_out": "context"}


class Policy:
  """A remat policy that saves or offloads values by their ``checkpoint_name``.

  Args:
    name: how reprs and messages show it (``"sr.policies.minimal"``).
    saved: names kept in device memory.
    offloaded: names offloaded to ``offload_dst`` memory.
    recomputed: names recomputed (for its description only).
    offload_dst: the memory kind offloaded values go to.

  >>> import statefulremat as sr
  >>> sr.policies.minimal
  sr.policies.minimal
  >>> sr.policies.save_qkv_proj.saved
  ('query_proj', 'value_proj', 'key_proj', 'qkv_proj')
  >>> sr.policies.custom({"mlpwo": "offload"}).offloaded
  ('mlpwo',)
  """

  # jax.checkpoint holds its policy by weak reference (its caches).
  __slots__ = ("name", "saved", "offloaded", "recomputed", "offload_dst", "_jax_policy")
  __slots__ += ("__weakref__",)

  def __init__(
    self,
    name: str,
    saved: Iterable[str] = (),
    offloaded: Iterable[str] = (),
    recomputed: Iterable[str] = (),
    offload_dst: str = "pinned_host",
  ):
    self.name = name
    self.saved = tuple(saved)
    self.offloaded = tuple(offloaded)
    self.recomputed = tuple(recomputed)
    self.offload_dst = offload_dst
    if self.offloaded:
      self._jax_policy = _POLICIES.save_and_offload_only_these_names(
        names_which_can_be_saved=self.saved,
        names_which_can_be_offloaded=self.offloaded,
        offload_src="device",
        offload_dst=offload_dst,
      )
    elif self.saved:
      self._jax_policy = _POLICIES.save_only_these_names(*self.saved)
    else:
      self._jax_policy = _POLICIES.nothing_saveable

  @property
  def names(self) -> tuple[str, ...]:
    """The names the policy keeps: saved, then offloaded."""
    return self.saved + self.offloaded

  def __call__(self, prim, *avals, **params):
    return self._jax_policy(prim, *avals, **params)

  def _key(self) -> tuple:
    return (self.name, self.saved, self.offloaded, self.recomputed, self.offload_dst)

  def __eq__(self, other: object) -> bool:
    return type(other) is type(self) and other._key() == self._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __repr__(self) -> str:
    return self.name

  def __reduce__(self):
    # By value, through the public class: a preset unpickles equal to itself.
    return (type(self), self._key())


def custom_policy(tensors: Mapping[str, str]) -> Policy:
  """``sr.policies.custom(tensors)`` for choices already checked: the one place it is built."""
  chosen = {choice: [] for choice in CUSTOM_CHOICES}
  for name, choice in tensors.items():
    chosen[choice].append(ALIASES.get(name, name))
  return Policy(
    f"sr.policies.custom({dict(tensors)!r})", chosen["device"], chosen["offload"], chosen["remat"]
  )


@functools.cache
def _asked_primitive(_flavour: bool):
  """The primitive JAX passes a policy when it asks about a named value, learnt by asking."""
  asked = []

  def recorder(prim, *_, **params):
    if params.get("name") == PROBE_NAME:
      asked.append(prim)
    return False

  f = jax.checkpoint(lambda x: checkpoint_name(jnp.sin(x), PROBE_NAME), policy=recorder)
  jax.make_jaxpr(jax.grad(f))(jnp.zeros((), jnp.float32))
  if not asked:  # only a jax whose policies cannot act on names reaches this
    raise RuntimeError(
      "statefulremat: this jax never asks a remat policy about a checkpoint_name, so "
      "names policies cannot be checked; please report the jax version."
    )
  return asked[0]


def _answer(policy, name: str) -> tuple[bool, str | None]:
  """``(keeps, offload_dst)``: what ``policy`` does with the value named ``name``."""
  aval = jax.core.ShapedArray((), jnp.float32)
  decision = policy(_asked_primitive(remat_flavour()), aval, name=name)
  if isinstance(decision, bool):
    return decision, None
  if isinstance(decision, Offloadable):
    return True, str(decision.dst)
  return decision is not Recompute, None


def _made_by(policy) -> str | None:
  """The ``jax.checkpoint_policies`` factory that made ``policy`` (None: not one)."""
  qualname = getattr(policy, "__qualname__", "")  # a factory's closure: factory.<locals>.…
  if (getattr(policy, "__module__", "") or "").startswith("jax") and "." in qualname:
    return qualname.split(".")[0]
  return _factory_types().get(type(policy))


@functools.cache
def _factory_types() -> dict[type, str]:
  """The factory of each class the factories' policies are instances of."""
  samples = {
    "save_only_these_names": _POLICIES.save_only_these_names(),
    "save_any_names_but_these": _POLICIES.save_any_names_but_these(),
    "save_and_offload_only_these_names": _POLICIES.save_and_offload_only_these_names(
      names_which_can_be_saved=(),
      names_which_can_be_offloaded=(),
      offload_src="device",
      offload_dst="pinned_host",
    ),
    "offload_dot_with_no_batch_dims": _POLICIES.offload_dot_with_no_batch_dims(
      "device", "pinned_host"
    ),
  }
  return {type(v): k for k, v in samples.items() if not isinstance(v, types.FunctionType)}


def _published_names(policy) -> tuple[str, ...] | None:
  """The string-set fields of a dataclass policy (None where it publishes none)."""
  if not dataclasses.is_dataclass(policy) or isinstance(policy, type):
    return None
  fields = [getattr(policy, field.name) for field in dataclasses.fields(policy)]
  sets = [
    sorted(v)
    for v in fields
    if isinstance(v, (set, frozenset, tuple, list)) and all(isinstance(n, str) for n in v)
  ]
  return tuple(dict.fromkeys(n for names in sets for n in names)) if sets else None


class PolicyCheck(NamedTuple):
  """The trace-time checks of one transform's policy."""

  policy: Any
  what: str
  factory: str | None
  names: tuple[str, ...] | None

  def _describe(self) -> str:
    listing = ("save_only_these_names", "save_any_names_but_these")  # names are all they take
    if self.factory in listing and self.names is not None:
      return f"jax.checkpoint_policies.{self.factory}({', '.join(map(repr, self.names))})"
    if self.factory is not None:
      return f"jax.checkpoint_policies.{self.factory}(...)"
    return getattr(self.policy, "__name__", None) or repr(self.policy)

  def run(self, f: Callable, *args):
    """``f(*args)``, after checking the policy against the body ``f`` traces."""
    closed, shapes = jax.make_jaxpr(f, return_shape=True)(*args)
    found = names_under(closed.jaxpr, self.policy)
    if found is not None:
      self._check(found)
    # Evaluated here, so the equations' source lines keep the user's code.
    out = jax.core.eval_jaxpr(
      closed.jaxpr, closed.consts, *jax.tree.leaves(args), propagate_source_info=False
    )
    return jax.tree.unflatten(jax.tree.structure(shapes), out)

  def _check(self, found: set[str]) -> None:
    answers = {name: _answer(self.policy, name) for name in sorted(found)}
    offload_to = {dst for _, dst in answers.values() if dst is not None}
    if self.factory == "offload_dot_with_no_batch_dims":
      offload_to.add("pinned_host")  # what the factory offloads to: host memory
    for kind in sorted(offload_to):
      self._warn_offload(kind)
    kept = [name for name, (keeps, _) in answers.items() if keeps]
    body_names = (
      f"The body names: {', '.join(map(repr, sorted(found)))}."
      if found
      else "The body names nothing: it has no checkpoint_name at all."
    )
    if isinstance(self.policy, Policy):
      if not kept:
        raise TransformError(
          f"{self.what}: policy={self.policy!r} keeps the values named "
          f"{', '.join(map(repr, self.policy.names))}, and no "
          "`jax.ad_checkpoint.checkpoint_name` in the traced body gives any of them, so "
          "it would save nothing and remat would recompute everything. (An sr.policies "
          "policy needs only one of its names in the body: a block may hold only some of "
          f"a preset's tensors.) {body_names} Fix: a policy naming the "
          "body's values (`sr.policies.custom({name: 'device'})`), names in the body "
          "(`checkpoint_name(x, name)`), or `sr.policies.full` to save nothing."
        )
    elif self.names is not None:
      self._check_published(found, body_names)
    elif self.factory in _ALLOW_LISTS and not kept:
      raise TransformError(
        f"{self.what}: policy={self._describe()} keeps none of the values the "
        "traced body names, so it saves nothing and remat recomputes everything: the "
        "names it was given match no `jax.ad_checkpoint.checkpoint_name` in the body "
        "(this jax keeps a policy's names to itself, so they cannot be listed). "
        f"{body_names} Fix: spell the policy's names as the body does, or "
        "name the value in the body: `checkpoint_name(x, name)`."
      )
    elif self.factory == "save_anything_except_these_names" and len(kept) == len(found):
      # Keeping every name means its exclusions are ignored or name nothing here. (An
      # unpublished save_any_names_but_these that keeps every name may have been given
      # none, which is meant: it is not judged.)
      raise TransformError(
        f"{self.what}: policy={self._describe()} is meant to save every value "
        f"except the names it was given, but it keeps every value the traced body names "
        f"({', '.join(map(repr, sorted(found))) or 'nothing'}), so remat would save what "
        "you asked it not to: this jax's save_anything_except_these_names ignores its "
        f"names (or none of them is in the body). {body_names} Fix: "
        "`jax.checkpoint_policies.save_any_names_but_these(*names)` saves the named "
        "values except those names and recomputes the rest; "
        "`jax.checkpoint_policies.everything_saveable` if saving everything is meant."
      )

  def _check_published(self, found: set[str], body_names: str) -> None:
    missing = [n for n in self.names or () if n not in found]
    if not missing:
      return
    listed = []
    for name in missing:
      close = difflib.get_close_matches(name, sorted(found), n=1)
      listed.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    plural, them = ("s", "them") if len(missing) > 1 else ("", "it")
    raise TransformError(
      f"{self.what}: policy={self._describe()} refers to the name{plural} "
      f"{', '.join(listed)}, which no `jax.ad_checkpoint.checkpoint_name` in the "
      f"traced body gives, so the policy would silently ignore {them}. "
      f"{body_names} Fix: spell the policy's names as the body does, or "
      f"name the value in the body: `checkpoint_name(x, {missing[0]!r})`."
    )

  def _warn_offload(self, kind: str) -> None:
    platform = jax.default_backend()
    if _offloads(platform, kind):
      return
    warnings.warn(
      f"{self.what}: policy={self._describe()} offloads residuals to "
      f"{kind!r} memory, but on this backend ({platform}) nothing is offloaded: the "
      "compiled program keeps no bytes in host memory, so the values the policy "
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
  """Whether the default backend, ``platform``, offloads to ``kind`` memory (compiled)."""
  del platform  # the cache key: the answer is the default backend's
  device = jax.devices()[0]
  if kind not in {m.kind for m in device.addressable_memories()}:
    return False
  policy = Policy("offloading probe", offloaded=("offloaded",), offload_dst=kind)

  def body(w, x):
    return jnp.sin(checkpoint_name(jnp.sin(x @ w), "offloaded") @ w)

  def loss(w, x):
    return jnp.sum(jax.checkpoint(body, policy=policy)(w, x))

  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  lowered = jax.jit(jax.grad(loss)).lower(w, w)
  text = lowered.as_text()
  if "annotate_device_placement" in text or "_xla_buffer_placement" in text:
    return True
  stats = lowered.compile().memory_analysis()
  host = ("host_temp_size_in_bytes", "host_output_size_in_bytes", "host_argument_size_in_bytes")
  return stats is not None and any(getattr(stats, a, 0) for a in host)


_FACTORY_EXAMPLES = {
  "save_only_these_names": "save_only_these_names('attn_out', 'mlp_out')",
  "save_any_names_but_these": "save_any_names_but_these('mlp_hidden')",
  "save_anything_except_these_names": "save_any_names_but_these('mlp_hidden')",
  "save_and_offload_only_these_names": (
    "save_and_offload_only_these_names(names_which_can_be_saved=[], "
    "names_which_can_be_offloaded=['attn_out'], offload_src='device', "
    "offload_dst='pinned_host')"
  ),
  "offload_dot_with_no_batch_dims": "offload_dot_with_no_batch_dims('device', 'pinned_host')",
  "save_from_both_policies": (
    "save_from_both_policies(jax.checkpoint_policies.dots_saveable, "
    "jax.checkpoint_policies.save_only_these_names('attn_out'))"
  ),
}


def _check_argument(policy, what: str) -> None:
  """Refuses what is not a policy: a name, another value, a factory not called."""
  if isinstance(policy, str):
    known = policy in _FACTORY_EXAMPLES or callable(getattr(_POLICIES, policy, None))
    fix = (
      f"`policy=jax.checkpoint_policies.{_FACTORY_EXAMPLES.get(policy, policy)}`"
      if known
      else "a policy of `jax.checkpoint_policies` (e.g. `jax.checkpoint_policies."
      "nothing_saveable`) or a function `(prim, *avals, **params) -> bool`"
    )
    raise TypeError(
      f"{what}: policy={policy!r} is a string; jax.checkpoint takes the policy itself, "
      f"not its name. Fix: {fix}."
    )
  if not callable(policy):
    raise TypeError(
      f"{what}: policy={policy!r} ({type(policy).__name__}) is not a remat policy. Fix: "
      "a policy of `jax.checkpoint_policies` (e.g. `jax.checkpoint_policies."
      "dots_saveable`), a function `(prim, *avals, **params) -> bool`, or None."
    )
  factory = next((n for n in _FACTORY_EXAMPLES if getattr(_POLICIES, n, None) is policy), None)
  if factory is not None:
    raise TypeError(
      f"{what}: policy=jax.checkpoint_policies.{factory} is the factory that makes a "
      "policy, not a policy: JAX would call it with its questions about each value. "
      f"Fix: call it, e.g. `policy=jax.checkpoint_policies.{_FACTORY_EXAMPLES[factory]}`."
    )


def policy_check(policy, what: str) -> PolicyCheck | None:
  """``policy``'s check, whose ``run(f, *args)`` traces ``f`` once, checks, then evaluates
  the same jaxpr (None: nothing to check); a TypeError for what is not a policy."""
  if policy is None:
    return None
  _check_argument(policy, what)
  if isinstance(policy, Policy):
    # Lenient (see Policy above): at least one of its names must be in the body.
    return PolicyCheck(policy, what, None, None) if policy.names else None
  factory = _made_by(policy)
  names = _published_names(policy)
  if names is None and factory not in _ALLOW_LISTS + _EXCLUDING + _OFFLOADING:
    return None
  return PolicyCheck(policy, what, factory, names)
