"""``sr.scan``'s ``in_axes`` / ``out_axes`` (prefix trees of axes) and ``sr.broadcast``."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ._layers import describe_node
from ._rules import TransformError

_LEVELS = (tuple, list, dict)  # the nodes of a prefix tree of axes


class _Broadcast:
  """``sr.broadcast``: in ``sr.scan``'s ``in_axes``, the value is given whole to every
  iteration, as ``None`` (and flax.linen's ``nn.broadcast``); not in ``out_axes``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.broadcast
  sr.broadcast
  >>> class Scale(sr.Module):
  ...   def __init__(self, w):
  ...     self.w = sr.Param(w)
  >>> def body(m, c, x, bias):
  ...   return c + m.w.value * x + bias, None
  >>> stack = Scale(jnp.arange(3.0))  # one weight per iteration
  >>> c, _ = sr.scan(body, variable_axes={sr.Param: 0}, in_axes=(0, sr.broadcast))(
  ...     stack, 0.0, jnp.ones(3), 10.0)
  >>> float(c)  # the loop: sum of w[i] * 1 + 10 over i
  33.0
  """

  __slots__ = ()

  def __repr__(self) -> str:
    return "sr.broadcast"

  def __reduce__(self) -> str:
    return "broadcast"  # pickles and copies as the one instance


broadcast = _Broadcast()


def check_axes(what: str, in_axes, out_axes) -> None:
  """Raises unless both are prefix trees of ints / None / sr.broadcast (none in out)."""
  is_axis = lambda a: not isinstance(a, _LEVELS)  # noqa: E731
  for name, axes in (("in_axes", in_axes), ("out_axes", out_axes)):
    for path, a in jax.tree_util.tree_leaves_with_path(axes, is_leaf=is_axis):
      where = f"{name}={axes!r}" + (
        f" has {a!r} at `{name}{jax.tree_util.keystr(path)}`" if path else ""
      )
      if a is None or a is broadcast:
        if name == "out_axes":
          raise TransformError(
            f"{what}: {where}, but ys differ per iteration, so every ys leaf needs the "
            "axis that stacks them. Fix: give an int there (e.g. 0); return a value "
            "computed once through the carry."
          )
      elif not isinstance(a, numbers.Integral) or isinstance(a, bool):
        whole = ", None or sr.broadcast (the whole value)" if name == "in_axes" else ""
        which = ", which" if path else ""
        raise TransformError(
          f"{what}: {where}{which} is not an axis: expected an int (the axis){whole}, "
          "or a tuple/list/dict of them following the structure. Fix that entry."
        )


def _fit(prefix, tree, path: tuple, mismatch: Callable) -> list:
  """One axis (an int, or None to broadcast) per leaf of ``tree``, from the prefix tree."""
  if not isinstance(prefix, _LEVELS):
    axis = None if prefix is None or prefix is broadcast else operator.index(prefix)
    return [axis] * len(jax.tree.leaves(tree))
  # One level of ``tree``, in jax's own order (dict keys sorted, namedtuple fields).
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda n: n is not tree)[0]
  children = [(keys[0], child) for keys, child in flat if len(keys) == 1]
  if isinstance(prefix, dict):
    fits = isinstance(tree, dict) and set(prefix) == {k.key for k, _ in children}
    entries = [prefix[k.key] for k, _ in children] if fits else []
  else:
    fits = isinstance(tree, (tuple, list)) and len(prefix) == len(children)
    entries = prefix
  if not fits:
    mismatch(path, prefix, tree)
  out = []
  for entry, (key, child) in zip(entries, children):
    out.extend(_fit(entry, child, path + (key,), mismatch))
  return out


def in_axes_per_leaf(what: str, in_axes, xs: tuple, n_leaves: int) -> list:
  if not isinstance(in_axes, _LEVELS):
    return [None if in_axes is broadcast else in_axes] * n_leaves
  if isinstance(in_axes, dict) or len(in_axes) != len(xs):
    raise TransformError(
      f"{what}: in_axes={in_axes!r} does not fit {len(xs)} xs argument(s): give an "
      "int, None (or sr.broadcast), or a tuple with one entry (an int, None, or a "
      "prefix tree of the argument) per argument."
    )

  def mismatch(path, sub, node):
    i = path[0].idx  # the xs argument
    where = f"xs{jax.tree_util.keystr(path)}"
    raise TransformError(
      f"{what}: in_axes entry {in_axes[i]!r} is not a prefix of xs argument {i}: at "
      f"`{where}` it has {describe_node(sub)} where the argument has "
      f"{describe_node(node)}. "
      "Fix: follow the argument's structure there, or give one int (or None) for all "
      f"of `{where}`."
    )

  return _fit(in_axes, xs, (), mismatch)


def leaf_path(tree, j: int) -> str:
  return jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][j][0])


def stack_ys(what: str, out_axes, ys):
  """Moves the iteration axis of each ``ys`` leaf (first, from lax.scan) to out_axes."""

  def mismatch(path, sub, node):
    where = f"ys{jax.tree_util.keystr(path)}"
    raise TransformError(
      f"{what}: out_axes={out_axes!r} is not a prefix of the body's ys: at `{where}` "
      f"it has {describe_node(sub)} where ys has {describe_node(node)} (stacked over the "
      "iterations). Fix: follow the structure of ys there, or give one int for all "
      f"of `{where}`."
    )

  leaves, treedef = jax.tree.flatten(ys)
  axes = _fit(out_axes, ys, (), mismatch)
  moved = []
  for j, (y, axis) in enumerate(zip(leaves, axes)):
    rank = jnp.ndim(y)
    if not -rank <= axis < rank:
      raise TransformError(
        f"{what}: out_axes puts the iteration axis of `ys{leaf_path(ys, j)}` at "
        f"{axis}, but stacked over the iterations it has shape "
        f"{tuple(jnp.shape(y))} (rank {rank}). Fix: choose an axis in [-{rank}, {rank})."
      )
    moved.append(y if axis % rank == 0 else jnp.moveaxis(y, 0, axis))
  return jax.tree.unflatten(treedef, moved)
