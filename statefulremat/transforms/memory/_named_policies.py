"""Remat policies by checkpoint name, with a name of their own (``sr.policies``).

A ``Policy`` says which values named by ``jax.ad_checkpoint.checkpoint_name`` a remat
keeps on the device and which it offloads to host memory; every other value is
recomputed. It is a thin, named wrapper of the public ``jax.checkpoint_policies``
(``save_only_these_names``, or ``save_and_offload_only_these_names`` when it offloads),
so it acts by names and holds under either remat implementation (``jax_remat3``
included). What it adds: a name in messages and reprs (``sr.policies.minimal``), value
equality (one class form per equal policy), pickling by value, and a check that suits
presets: the policy check (``_policy_check``) refuses a ``Policy`` only when *none* of
its names is in the traced body, since a preset names the tensors of a whole
transformer and one block may hold only some of them (an MLP-only block under
``minimal``).

The presets themselves and ``custom`` are in ``statefulremat/policies``, the public
front; this file sits on the transforms' floor because the policy check reads it.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax

_POLICIES = jax.checkpoint_policies


class Policy:
  """A remat policy that saves or offloads values by their ``checkpoint_name``.

  ``sr.policies``' presets (``sr.policies.minimal``) and ``sr.policies.custom`` make
  them; give one as ``policy=`` to ``sr.remat``, ``sr.scan`` or ``sr.remat_scan``. The
  values named in ``saved`` stay in device memory for the backward pass, those in
  ``offloaded`` go to ``offload_dst`` memory (``"pinned_host"``) and come back for it,
  and every other value is recomputed (``recomputed`` lists names the policy was told
  to recompute, for its description only). It calls
  ``jax.checkpoint_policies.save_only_these_names`` (or
  ``save_and_offload_only_these_names`` when it offloads).

  Checked when traced, more leniently than a bare names policy: a block must name at
  least one of the policy's values (a preset names a whole transformer's tensors; a
  block may have only some of them), else the remat raises, listing the block's names.

  Args:
    name: how reprs and messages show it (``"sr.policies.minimal"``).
    saved: names kept in device memory.
    offloaded: names offloaded to ``offload_dst`` memory.
    recomputed: names recomputed (what the policy does with any name it does not list).
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
