"""``sr.policies.Policy``; the presets and ``custom`` are in ``statefulremat/policies``."""

from __future__ import annotations

from collections.abc import Iterable

import jax

_POLICIES = jax.checkpoint_policies


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
