"""sr.vmap over a pattern stack: moving between members (the user's layout) and cycles
(the map's; see README.md)."""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
from jax import lax

from .._rules import TransformError


def padded(value, axis: int, size: int):
  """``value`` with ``size`` entries along ``axis``: extra entries copy entry 0."""
  have = jnp.shape(value)[axis]
  if have == size:
    return value
  fill = jnp.repeat(lax.slice_in_dim(value, 0, 1, axis=axis), size - have, axis=axis)
  return lax.concatenate([value, fill], axis % jnp.ndim(value))


def position_args(args, arg_axes, period: int, cycles: int) -> tuple:
  """Per position ``k``, its members' arguments: slices ``k, k + P, ...`` of each mapped
  one, the broadcast ones whole."""

  def slices(k: int):
    take = jnp.arange(k, cycles * period, period)
    return tuple(
      a
      if ax is None
      else jax.tree.map(lambda x, ax=ax: jnp.take(padded(x, ax, cycles * period), take, ax), a)
      for a, ax in zip(args, arg_axes)
    )

  return tuple(slices(k) for k in range(period))


def stack_units(what: str, outs: list, names) -> Any:
  """One cycle's outputs (one per position) as one, the positions in front."""
  first = jax.tree.structure(outs[0])
  for k, out in enumerate(outs[1:], 1):
    if jax.tree.structure(out) != first:
      raise TransformError(
        f"{what}: the members' outputs differ in structure: position 0 ({names[0]}) "
        f"returns {first}, position {k} ({names[k]}) {jax.tree.structure(out)}. Every "
        "class of a pattern must return outputs of one structure to be mapped together."
      )
  return jax.tree.map(lambda *per: jnp.stack(per), *outs)


def cycle_axes(out_axes) -> Any:
  """``out_axes`` of the map over cycles: the cycle axis in front of every mapped output."""
  return jax.tree.map(lambda a: None if a is None else 0, out_axes, is_leaf=lambda a: a is None)


def member_order(out, out_axes, n: int, leaf_axes) -> Any:
  """The map's outputs, ``(cycles, P, ...)`` per mapped leaf, as ``n`` members along
  each leaf's ``out_axes``; an unmapped leaf, the positions' one value."""
  leaves, treedef = jax.tree.flatten(out)
  axes = [axis for _, _, axis in leaf_axes(out_axes, out)]
  result = []
  for leaf, axis in zip(leaves, axes):
    if axis is None:
      result.append(leaf[0])
      continue
    shape = jnp.shape(leaf)
    members = lax.reshape(leaf, (shape[0] * shape[1],) + shape[2:])[:n]
    result.append(jnp.moveaxis(members, 0, axis))
  return jax.tree.unflatten(treedef, result)


def agree(per_position, refuse) -> None:
  """Calls ``refuse()`` unless the positions' values (stacked in front) are one; under
  an outer trace, when the computation runs."""

  def check(stacked):
    if not bool(jnp.all(stacked == stacked[:1])):
      refuse()

  if isinstance(per_position, jax.core.Tracer):
    jax.debug.callback(check, per_position)
  else:
    check(per_position)


def refuse_ragged_made(what: str, n: int, period: int) -> None:
  raise TransformError(
    f"{what}: a member made a Variable (e.g. `self.sow(...)`) inside a pattern stack of "
    f"{n} members, which is not a multiple of its pattern of {period}: the positions "
    "would hold it for different numbers of members. Nothing was written. Fix: a number "
    f"of members that is a multiple of {period}, or create the Variable in `__init__`."
  )
