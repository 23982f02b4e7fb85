"""sr.vmap over a pattern stack: member ``i`` (of class ``pattern[i % P]``) gets input
slice ``i``.

The members of one position share a class, so each position is one ``jax.vmap``
over its members, fed the input slices ``k, k + P, ...``; the outputs are put back in
member order. The position stacks are lifted together, so a stream they share advances
once per call, and member ``i`` draws the keys of layer ``i`` (as ``stack.layer(i)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ...core._stacks import cycle
from .._lift import commit
from .._module_arg import lift_module_arg
from .._pattern import check_positions, position_names
from .._rules import STACKED, TransformError


def vmap_pattern(
  stack,
  fn: Callable,
  args: tuple,
  kwargs: dict,
  *,
  what: str,
  rules,
  in_axes,
  out_axes,
  axis_size,
  axis_name,
  metadata_params,
) -> Any:
  counts = check_positions(stack, what)
  lifted, variables, treatment, leaves = lift_module_arg(
    cycle(stack), what, rules, metadata_params, "f(module, *args)", pattern=True
  )
  n, period = sum(counts), len(counts)
  names = position_names(stack)
  if axis_size is not None and axis_size != n:
    raise TransformError(
      f"{what}: axis_size={axis_size}, but the pattern stack has {n} "
      "members. Fix: drop axis_size (the stack tells it)."
    )
  arg_axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
  if len(arg_axes) != len(args):
    raise TransformError(
      f"{what}: in_axes={in_axes!r} has {len(arg_axes)} entries for "
      f"{len(args)} arguments (the module excluded)."
    )
  if not isinstance(out_axes, int):
    raise TransformError(
      f"{what}: out_axes={out_axes!r}; over a pattern stack the members' outputs are "
      "put back in member order along one axis, so out_axes is one int."
    )
  for j, (a, ax) in enumerate(zip(args, arg_axes)):
    if ax is None:  # broadcast: nothing to check
      continue
    for leaf in jax.tree.leaves(a):
      shape = tuple(jnp.shape(leaf))
      if not -len(shape) <= ax < len(shape) or shape[ax] != n:
        raise TransformError(
          f"{what}: in_axes maps argument {j + 1} along axis {ax}, one slice per member, "
          f"so it needs {n} entries there (the pattern stack has {n} members); a leaf has "
          f"shape {shape}. Fix: {n} entries at axis {ax}, or None in in_axes to give it "
          "whole to every member."
        )
  values = [v._value for v in variables]
  paths = lifted.graphdef.var_paths
  stacked = treatment.indices(STACKED)
  counts_of = {s.count for s in treatment.streams}
  used: set[int] = set()
  changed: dict[int, Any] = {}
  outs = []
  for k in range(period):
    mine = [i for i in stacked if paths[i][0] == k]
    members = jnp.arange(k, n, period)

    def one(slices, index, call_args, k=k, mine=mine):
      flat = list(values)
      for i, value in zip(mine, slices):
        flat[i] = value
      out, changes = lifted.run(
        lambda positions: fn(positions[k], *call_args, **kwargs),
        flat,
        leaves,
        what,
        seed=(treatment, index),
      )
      wrote = changes.values
      for i in wrote:
        if i in counts_of:
          used.add(i)
        elif i not in mine:
          raise TransformError(
            f"{what}: member {k} of the pattern ({names[k]}) wrote to "
            f"`{variables[i].path_str() or paths[i]}`, which is not mapped per member; "
            "over a pattern stack only mapped Variables (variable_axes) may be written. "
            "Nothing was written. Fix: map it with variable_axes."
          )
      return out, {i: wrote[i] for i in mine if i in wrote}

    sliced = tuple(
      a if ax is None else jax.tree.map(lambda x, ax=ax: jnp.take(x, members, axis=ax), a)
      for a, ax in zip(args, arg_axes)
    )
    out, written = jax.vmap(
      one,
      in_axes=([treatment.axes[i] for i in mine], 0, tuple(arg_axes)),
      out_axes=(out_axes, 0),
      axis_size=counts[k],
      axis_name=axis_name,
    )([values[i] for i in mine], members.astype(jnp.uint32), sliced)
    outs.append(out)
    changed.update({i: jnp.moveaxis(v, 0, treatment.stacked_axis(i)) for i, v in written.items()})
  treatment.check_stream_names()
  out = _member_order(what, outs, out_axes, n, period, names)
  commit(variables, changed, what, streams=used)
  return out


def _member_order(what, outs: list, axis: int, n: int, period: int, names) -> Any:
  """The positions' outputs as one, member ``i`` at index ``i`` of ``axis``."""
  first = jax.tree.structure(outs[0])
  for k, out in enumerate(outs[1:], 1):
    if jax.tree.structure(out) != first:
      raise TransformError(
        f"{what}: the members' outputs differ in structure: position 0 ({names[0]}) "
        f"returns {first}, position {k} ({names[k]}) {jax.tree.structure(out)}. Every "
        "class of a pattern must return outputs of one structure to be mapped together."
      )
  order = jnp.argsort(jnp.concatenate([jnp.arange(k, n, period) for k in range(period)]))
  return jax.tree.map(
    lambda *parts: jnp.take(jnp.concatenate(parts, axis=axis), order, axis=axis), *outs
  )
