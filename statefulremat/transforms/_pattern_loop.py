"""The loop's unit: scan and remat_scan run a layer, or a cycle of a repeating pattern
(``CycleLoop``; transforms/README.md, "The loop")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import jax
import jax.numpy as jnp
from jax import lax

from ..core._module import Module
from ..core._pattern_stack import PatternStack
from ..core._stacks import cycle
from ._layers import LayerLoop, _move_axis, check_same_type
from ._module_arg import class_length, lift_module_arg, resolve_length, stacked_sources
from ._pattern import check_positions, position_names
from ._rules import TransformError
from .memory._carries import offloaded


def take(tree, k: int):
  """Entry ``k`` of the leading axis of every leaf (``None`` stays ``None``)."""
  return jax.tree.map(lambda x: lax.index_in_dim(x, k, keepdims=False), tree)


class CycleLoop(LayerLoop):
  """``LayerLoop`` whose iteration is one cycle of a pattern."""

  def __init__(self, *args, period: int, names: Sequence[str], **kwargs):
    super().__init__(*args, **kwargs)
    self.period, self.names = period, tuple(names)
    self.full, self.rest = divmod(self.length, period)
    paths = self.lifted.graphdef.var_paths
    self.position = [paths[i][0] for i in self.stacked]

  def _stacked_inputs(self) -> list:
    out = []
    for i in self.stacked:
      value = _move_axis(self.values[i], self.treatment.stacked_axis(i), 0)
      out.append(
        value if jnp.shape(value)[0] == self.full else lax.slice_in_dim(value, 0, self.full)
      )
    return out

  def _layer(self, body, state, x):
    return self.cycle(body, state, x, self.period)

  def cycle(self, body: Callable, state, x, active: int):
    """Layers ``0 .. active - 1`` of one cycle. ``body(layer, carry, xs_k) -> (carry,
    ys)``; ``x`` is ``(slices, xs, cycle)``, xs with the positions in front."""
    carry_values, user_carry = state
    slices, xs, cycle = x
    flat = self._substitute(slices, carry_values)
    carry = user_carry

    def unit(k, positions):
      nonlocal carry
      before = carry
      carry, ys = body(positions[k], carry, take(xs, k))
      self._check_carry(k, before, carry)
      return ys

    # No RNG stream: the loop passes no cycle index (None), and nothing is seeded.
    first = None if cycle is None else cycle * jnp.uint32(self.period)
    ys, changes = self.lifted.run(
      unit,
      flat,
      self.leaves,
      self.what,
      seed=(self.treatment, first),
      units=range(active)[::-1] if self.reverse else range(active),
      restructure=True,
    )
    return self._read_back(changes, flat, user_carry, carry, tuple(ys))

  def _check_carry(self, k: int, before, after) -> None:
    what = f"{self.what}: position {k} of the pattern ({self.names[k]})"
    try:
      check_same_type(before, after, what, "carry")
    except TransformError as e:
      raise TransformError(
        f"{e} Every block of a pattern takes and returns the same carry: the blocks' "
        "carries must agree in structure, shape and dtype."
      ) from None

  def _unit_xs(self, xs):
    """xs by cycle: ``(full, P, ...)``, the short last cycle's layers left out."""
    p, full = self.period, self.full
    return jax.tree.map(
      lambda x: lax.reshape(lax.slice_in_dim(x, 0, full * p), (full, p) + jnp.shape(x)[1:]), xs
    )

  def _tail(self, body, carried, carry, xs, remat: bool, offload: bool):
    """The short last cycle: positions ``0 .. rest - 1``, layer ``full`` of each."""
    full, p = self.full, self.period
    slices = []
    for i, k in zip(self.stacked, self.position):
      value = _move_axis(self.values[i], self.treatment.stacked_axis(i), 0)
      slices.append(lax.index_in_dim(value, full if k < self.rest else 0, keepdims=False))
    x = (
      slices,
      jax.tree.map(lambda v: lax.slice_in_dim(v, full * p, self.length), xs),
      jnp.uint32(full),
    )

    def step(state, x):
      return self.cycle(body, state, x, self.rest)

    # Run alone, outside any scan: without prevent_cse XLA would merge the
    # recomputation with the forward pass and keep the residuals after all.
    if offload:  # its input carry is saved as an outer step's is
      step = offloaded(step, None, remat, True)
    elif remat:
      step = jax.checkpoint(step, prevent_cse=True)
    return step((carried, carry), x)

  def _join(self, written: dict, tail: dict) -> dict:
    """The scan's writes (``full`` layers) and the short cycle's (one layer, for the
    positions it ran), as one value per position: its layers in order."""
    out = dict(written)
    for i, k in zip(self.stacked, self.position):
      if k >= self.rest or (i not in written and i not in tail):
        continue
      value = _move_axis(self.values[i], self.treatment.stacked_axis(i), 0)
      head = written.get(i, lax.slice_in_dim(value, 0, self.full))
      last = tail.get(i, lax.index_in_dim(value, self.full, keepdims=False))
      out[i] = lax.concatenate([head, last[None]], 0)
    made = sorted(i for i in set(written) | set(tail) if i < 0)
    if made:
      raise TransformError(
        f"{self.what}: a layer made a Variable (e.g. `self.sow(...)`) inside a pattern "
        f"stack of {self.length} layers, which is not a multiple of its pattern of "
        f"{self.period}: the short last cycle would give it another number of layers "
        "than the full ones. Nothing was written. Fix: a length that is a multiple of "
        f"{self.period}, or create the Variable in `__init__`."
      )
    return out

  def _layer_order(self, ys, tail_ys):
    """ys of every layer in layer order, from per-position ys of the cycles."""
    parts = []
    if ys is not None:
      self._check_ys_alike(ys)
      if all(y is None for y in jax.tree.leaves(ys, is_leaf=lambda y: y is None)):
        return None
      parts.append(
        jax.tree.map(
          lambda *per: lax.reshape(
            jnp.stack(per, axis=1), (self.full * self.period,) + jnp.shape(per[0])[1:]
          ),
          *ys,
        )
      )
    if tail_ys is not None and ys is not None:
      parts.append(jax.tree.map(lambda *per: jnp.stack(per), *tail_ys))
    if not parts:
      return None
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: lax.concatenate(a, 0), *parts)

  def _check_ys_alike(self, ys) -> None:
    first = jax.tree.map(lambda y: (jnp.shape(y)[1:], jnp.result_type(y)), ys[0])
    for k, y in enumerate(ys[1:], 1):
      this = jax.tree.map(lambda y: (jnp.shape(y)[1:], jnp.result_type(y)), y)
      if jax.tree.structure(this) != jax.tree.structure(first) or this != first:
        raise TransformError(
          f"{self.what}: the blocks' ys differ: position 0 ({self.names[0]}) gives "
          f"{_shapes(first)} and position {k} ({self.names[k]}) gives {_shapes(this)}. "
          "The ys of a pattern stack are stacked over its layers in order, so every "
          "block must return ys of one structure, shape and dtype (or None)."
        )


def _shapes(tree) -> str:
  leaves = jax.tree.leaves(
    tree, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)
  )
  if not leaves:
    return "no ys (None)"
  return ", ".join(f"{jnp.dtype(d).name}{list(s)}" for s, d in leaves)


def lift_loop(
  module,
  what: str,
  rules,
  metadata_params,
  call_form: str,
  *,
  sizes: Sequence[tuple[str, int]] = (),
  fallback: int | None = None,
  data_transform: Callable | None = None,
  reverse: bool = False,
) -> LayerLoop:
  """The loop over argument 0's units: a ``LayerLoop``, or a ``CycleLoop`` for a pattern
  stack. ``sizes``: ``(description, n)`` of what else counts the layers, which must
  agree; ``fallback``: the count when nothing tells it."""
  positions = cycle(module) if isinstance(module, Module) else (module,)
  if len(positions) == 1:
    lifted, variables, treatment, leaves = lift_module_arg(
      module, what, rules, metadata_params, call_form
    )
    stacked = stacked_sources(treatment, lifted, variables)
    n = resolve_length(what, None, list(sizes) + stacked, fallback=class_length(module) or fallback)
    return LayerLoop(
      lifted,
      treatment,
      variables,
      leaves,
      what,
      data_transform,
      module=module,
      length=n,
      metadata_params=metadata_params,
      reverse=reverse,
    )
  stack = cast(PatternStack, module)
  counts = check_positions(stack, what)
  n = sum(counts)
  for label, size in sizes:
    if size != n:
      raise TransformError(
        f"{what}: {label} has {size} entries along the scanned axis, but the pattern "
        f"stack has {n} layers. Fix: one entry per layer ({n}), or None in in_axes to "
        "give it whole to every layer."
      )
  lifted, variables, treatment, leaves = lift_module_arg(
    positions, what, rules, metadata_params, call_form, pattern=True
  )
  return CycleLoop(
    lifted,
    treatment,
    variables,
    leaves,
    what,
    data_transform,
    module=positions,
    length=n,
    metadata_params=metadata_params,
    reverse=reverse,
    period=len(counts),
    names=position_names(stack),
  )
