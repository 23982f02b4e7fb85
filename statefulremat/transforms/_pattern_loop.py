"""The loop's unit: scan and remat_scan run a layer, or a cycle of a repeating pattern
(``CycleLoop``; transforms/README.md, "The loop")."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import cast

import jax
import jax.numpy as jnp
from jax import lax

from ..core._module import Module
from ..core._pattern_stack import PatternStack
from ..core._stacks import cycle
from ._layers import LayerLoop, _guard, check_same_type
from ._module_arg import class_length, lift_module_arg, resolve_length, stacked_sources
from ._pattern import check_positions, position_names
from ._rules import TransformError


class CycleLoop(LayerLoop):
  """``LayerLoop`` whose iteration is one cycle of a pattern."""

  def __init__(self, *args, names: Sequence[str], **kwargs):
    super().__init__(*args, **kwargs)
    self.names = tuple(names)
    paths = self.lifted.graphdef.var_paths
    self.position = [paths[i][0] for i in self.stacked]

  def _stacked_inputs(self) -> list:
    """The full cycles' layers of each position (a short last cycle's left out)."""
    full = self.full
    return [
      v if jnp.shape(v)[0] == full else lax.slice_in_dim(v, 0, full)
      for v in super()._stacked_inputs()
    ]

  def _layer(self, body: Callable, state, x, active: int | None = None):
    """Layers ``0 .. active - 1`` of one cycle; ``x`` is ``(slices, xs, cycle)``."""
    active = self.period if active is None else active
    carry_values, user_carry = state
    slices, xs, cycle = x
    flat = self._substitute(slices, carry_values)
    carry = user_carry

    def unit(k, positions):
      nonlocal carry
      before = carry
      xs_k = jax.tree.map(lambda x: lax.index_in_dim(x, k, keepdims=False), xs)
      carry, ys = body(positions[k], carry, xs_k)
      what = f"{self.what}: position {k} of the pattern ({self.names[k]})"
      hint = (
        " Every block of a pattern takes and returns the same carry: the blocks' carries "
        "must agree in structure, shape and dtype."
      )
      check_same_type(before, carry, what, "carry", hint)
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

  def _units(self, body, state, xs, lengths, remat, policy, prevent_cse, unroll, offload):
    """The full cycles, and the short last one after them (before them, in reverse)."""
    options = (lengths, remat, policy, prevent_cse, unroll, offload)
    tail = None
    if self.rest and self.reverse:
      state, tail = self._tail(body, state, xs, remat, offload)
    state, written, ys = super()._units(body, state, self._cycle_xs(xs), *options)
    if self.rest and not self.reverse:
      state, tail = self._tail(body, state, xs, remat, offload)
    if tail is None:
      return state, written, self._layer_order(ys, None)
    return state, self._join(written, tail[0]), self._layer_order(ys, tail[1])

  def _cycle_xs(self, xs):
    """xs by cycle: ``(full, P, ...)``, the short last cycle's layers left out."""
    p, full = self.period, self.full
    return jax.tree.map(
      lambda x: lax.reshape(lax.slice_in_dim(x, 0, full * p), (full, p) + jnp.shape(x)[1:]), xs
    )

  def _tail(self, body, state, xs, remat: bool, offload: bool):
    """The short last cycle: positions ``0 .. rest - 1``, layer ``full`` of each."""
    full, p = self.full, self.period
    slices = [
      lax.index_in_dim(self._layer_first(i), full if k < self.rest else 0, keepdims=False)
      for i, k in zip(self.stacked, self.position)
    ]
    xs = jax.tree.map(lambda v: lax.slice_in_dim(v, full * p, self.length), xs)

    def step(state, x):
      return self._layer(body, state, x, self.rest)

    # Run alone, outside any scan: prevent_cse, as a segment's single step (_layers.py).
    return _guard(step, remat=remat, offload=offload)(state, (slices, xs, jnp.uint32(full)))

  def _join(self, written: tuple[dict, list], tail: tuple[dict, list]) -> tuple[dict, list]:
    """The scan's writes and the short cycle's, as one value per position."""
    (values, made), (last_values, last_made) = written, tail
    if made or last_made:
      raise TransformError(
        f"{self.what}: a layer made a Variable (e.g. `self.sow(...)`) inside a pattern "
        f"stack of {self.length} layers, which is not a multiple of its pattern of "
        f"{self.period}: the short last cycle would give it another number of layers "
        "than the full ones. Nothing was written. Fix: a length that is a multiple of "
        f"{self.period}, or create the Variable in `__init__`."
      )
    out = dict(values)
    for i, k in zip(self.stacked, self.position):
      if k >= self.rest or (i not in values and i not in last_values):
        continue
      value = self._layer_first(i)
      head = values.get(i, lax.slice_in_dim(value, 0, self.full))
      last = last_values.get(i, lax.index_in_dim(value, self.full, keepdims=False))
      out[i] = lax.concatenate([head, last[None]], 0)
    return out, made

  def _layer_order(self, ys, tail_ys):
    """ys of every layer in layer order, from per-position ys of the cycles."""
    if ys is None:
      return None
    self._check_ys_alike(ys)
    if all(y is None for y in jax.tree.leaves(ys, is_leaf=lambda y: y is None)):
      return None
    n = self.full * self.period
    out = jax.tree.map(
      lambda *per: lax.reshape(jnp.stack(per, axis=1), (n,) + jnp.shape(per[0])[1:]), *ys
    )
    if tail_ys is None:
      return out
    tail = jax.tree.map(lambda *per: jnp.stack(per), *tail_ys)
    return jax.tree.map(lambda a, b: lax.concatenate([a, b], 0), out, tail)

  def _check_ys_alike(self, ys) -> None:
    def described(y):  # one cycle's ys of a position: (structure, "f32[4, 8], ...")
      avals = [f"{jnp.result_type(v).name}{list(jnp.shape(v)[1:])}" for v in jax.tree.leaves(y)]
      return jax.tree.structure(y), ", ".join(avals) or "no ys (None)"

    first = described(ys[0])
    for k, y in enumerate(ys[1:], 1):
      if (this := described(y)) != first:
        raise TransformError(
          f"{self.what}: the blocks' ys differ: position 0 ({self.names[0]}) gives "
          f"{first[1]} and position {k} ({self.names[k]}) gives {this[1]}. "
          "The ys of a pattern stack are stacked over its layers in order, so every "
          "block must return ys of one structure, shape and dtype (or None)."
        )


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
  """The loop over argument 0's units (a ``CycleLoop`` for a pattern stack). ``sizes``:
  ``(description, n)`` of what else counts the layers; ``fallback``: the count if none."""
  positions = cycle(module) if isinstance(module, Module) else (module,)
  period, names, n = len(positions), (), 0
  if period > 1:
    stack = cast(PatternStack, module)
    n, names = sum(check_positions(stack, what)), position_names(stack)
    for label, size in sizes:
      if size != n:
        raise TransformError(
          f"{what}: {label} has {size} entries along the scanned axis, but the pattern "
          f"stack has {n} layers. Fix: one entry per layer ({n}), or None in in_axes to "
          "give it whole to every layer."
        )
    module = positions
  lifted, variables, treatment, leaves = lift_module_arg(
    module, what, rules, metadata_params, call_form, pattern=period > 1
  )
  if period == 1:
    stacked = stacked_sources(treatment, lifted, variables)
    n = resolve_length(what, list(sizes) + stacked, fallback=class_length(module) or fallback)
  make = LayerLoop if period == 1 else functools.partial(CycleLoop, names=names)
  return make(
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
    period=period,
  )
