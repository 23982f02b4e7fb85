"""The layer loop shared by scan and remat_scan (transforms/README.md, "The loop")."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core._errors import format_path
from ..core._state import State
from ._lift import Changes, Lifted, check_no_nodes, commit, split_call
from ._outputs import Restructured
from ._rules import BROADCAST, CARRY, READONLY, RNG, STACKED, TransformError, Treatment
from .memory._carries import offloaded


def check_same_type(before, after, what: str, label: str, hint: str = "") -> None:
  """Raises if ``after`` does not have the structure, shapes and dtypes of ``before``."""
  tb, ta = jax.tree.structure(before), jax.tree.structure(after)
  if tb != ta:
    where, was, now = _structure_difference(before, after, ())
    raise TransformError(
      f"{what}: the {label} changed structure between iterations: "
      f"`{jax.tree_util.keystr(where) or '<carry>'}` went in as {was} and came out as "
      f"{now} (as trees: {tb} -> {ta}). A carry must keep its structure, shapes and "
      f"dtypes; return it in the same form (e.g. `tuple(...)` around a list).{hint}"
    )
  for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after)):
    (sb, db), (sa, da) = (jnp.shape(b), jnp.result_type(b)), (jnp.shape(a), jnp.result_type(a))
    if (sb, db) != (sa, da):
      raise TransformError(
        f"{what}: the {label} leaf `{jax.tree_util.keystr(path) or '<carry>'}` went in "
        f"as {db}{list(sb)} and came out as {da}{list(sa)}. A carry must keep its "
        "shape and dtype across iterations: cast or reshape it back "
        f"(e.g. `.astype(jnp.{db})`), or make it part of the scanned outputs.{hint}"
      )


def describe_node(node) -> str:
  """A pytree node in Python terms, for error messages: ``a tuple of 2``."""
  if isinstance(node, dict):
    return f"a dict with keys {list(node)}"
  if isinstance(node, (tuple, list)):
    return f"a {type(node).__name__} of {len(node)}"
  if hasattr(node, "shape"):
    return f"an array of shape {tuple(node.shape)}"
  return repr(node) if node is None else f"a {type(node).__name__}"


def _structure_difference(a, b, path: tuple) -> tuple[tuple, str, str]:
  """``(key path, was, now)`` of the first node where two pytrees' structures differ."""
  alike = type(a) is type(b) and isinstance(a, (tuple, list, dict)) and len(a) == len(b)
  if alike and not (isinstance(a, dict) and set(a) != set(b)):
    for k in list(a) if isinstance(a, dict) else range(len(a)):
      if jax.tree.structure(a[k]) != jax.tree.structure(b[k]):
        key = jax.tree_util.DictKey(k) if isinstance(a, dict) else jax.tree_util.SequenceKey(k)
        return _structure_difference(a[k], b[k], path + (key,))
  return path, describe_node(a), describe_node(b)


class LayerLoop:
  """Runs a body once per layer over the lifted modules (``period``: layers per unit)."""

  def __init__(
    self,
    lifted: Lifted,
    treatment: Treatment,
    variables: list,
    leaves: list,
    what: str,
    data_transform: Callable | None = None,
    *,
    module: Any,
    length: int,
    metadata_params: Mapping | None = None,
    reverse: bool = False,
    period: int = 1,
  ):
    self.lifted, self.treatment, self.variables, self.leaves = lifted, treatment, variables, leaves
    self.values = [v._value for v in variables]
    self.what, self.data_transform = what, data_transform
    self.module, self.length, self.reverse, self.period = module, length, reverse, period
    self.full, self.rest = divmod(length, period)  # full units, layers of a short last one
    self.partition_name = (metadata_params or {}).get("partition_name")
    self.changed: dict[int, Any] = {}
    self.stacked = treatment.indices(STACKED)
    self.carried = treatment.indices(CARRY)
    self.counts = {s.count for s in treatment.streams}
    self.used: set[int] = set()
    self.carry_written: set[int] = set()
    self.structure = None  # a NewStructure, if the body added or deleted attributes
    self.made: list = []  # then the values of the Variables made inside, stacked

  def _layer(self, body, state, x):
    carry_values, user_carry = state
    slices, xs_slice, index = x
    flat = self._substitute(slices, carry_values)
    (new_carry, ys), changes = self.lifted.run(
      lambda layer: body(layer, user_carry, xs_slice),
      flat,
      self.leaves,
      self.what,
      seed=(self.treatment, index),
      restructure=True,
    )
    return self._read_back(changes, flat, user_carry, new_carry, ys)

  def _substitute(self, slices, carry_values) -> list:
    """The flat values of one iteration: stacked slices and carried values put in."""
    flat = list(self.values)
    if self.data_transform is not None and self.stacked:
      slices = self._transform_data(self.data_transform, slices)
    for i, value in zip(self.stacked, slices):
      flat[i] = value
    for i, value in zip(self.carried, carry_values):
      flat[i] = value
    return flat

  def _read_back(self, changes: Changes, flat, user_carry, new_carry, ys):
    """After the body: ``((carry values, carry), ((written, made), ys))`` of one iteration,
    ``made`` the values of the Variables the layer made (stacked per layer, as the ys)."""
    check_no_nodes((new_carry, ys), self.what)
    changed = changes.values
    if changes.structure is not None:
      self.structure = changes.structure
    for i in changed:
      self._check_writable(i)
    check_same_type(user_carry, new_carry, self.what, "carry")
    for i in self.carried:
      if i in changed:
        self.carry_written.add(i)
        label = f"carried variable `{self._name(i)}`: its value"
        check_same_type(flat[i], changed[i], self.what, label)
    new_carry_values = [changed.get(i, flat[i]) for i in self.carried]
    written = {i: changed[i] for i in self.stacked if i in changed}
    return (new_carry_values, new_carry), ((written, changes.made), ys)

  def _transform_data(self, transform: Callable, slices):
    paths = tuple(self.lifted.graphdef.var_paths[i] for i in self.stacked)
    # Each entry keeps its kind and the layer's metadata (the partition name removed),
    # so the hook can filter (`state.filter(sr.Param)`) and read `sharding`.
    entries = [self.lifted.graphdef.variables[i] for i in self.stacked]
    state = State.from_parts(
      paths, [e.kind for e in entries], [e.metadata for e in entries], slices
    )
    out = transform(state)
    if not isinstance(out, State) or tuple(out.flat()) != paths:
      raise TransformError(
        f"{self.what}: data_transform must return a State with the same entries it "
        "was given (e.g. `lambda s: jax.tree.map(constrain, s)`)."
      )
    return list(out._values)

  def _name(self, i: int) -> str:
    return format_path(self.treatment.display_path(self.lifted.graphdef.var_paths[i]))

  def _check_writable(self, i: int) -> None:
    kind = self.treatment.kinds[i]
    if kind == RNG and i in self.counts:  # a stream drawn from: it advances once per call
      self.used.add(i)
    elif kind in (BROADCAST, READONLY, RNG):
      var_kind = type(self.variables[i])
      how = (
        "is broadcast (variable_broadcast), so it is read-only in every iteration"
        if kind == BROADCAST
        else "is matched by no collection rule, so it is read-only in every iteration"
      )
      raise TransformError(
        f"{self.what}: the body wrote to `{self._name(i)}` ({var_kind.__name__}, "
        f"collection {var_kind.collection!r}), which {how}; the write would be lost. "
        f"Fix: carry it from iteration to iteration with "
        f"`variable_carry={var_kind.collection!r}`, or give each iteration its own "
        f"slice with `variable_axes={{{var_kind.collection!r}: 0}}`."
      )

  def loop(
    self,
    body: Callable,
    carry: Any,
    xs: Any,
    *,
    lengths: Sequence[int] | None = None,
    remat: bool = False,
    policy: Callable | None = None,
    prevent_cse: bool = True,
    unroll: int | bool = 1,
    offload: bool = False,
  ):
    """Runs every layer, ``body(layer, carry, x) -> (carry, ys)``: ``(carry, ys)``,
    layer axis first. ``lengths`` nests the units (``remat``: each level under
    ``jax.checkpoint``); ``offload``: the outer levels' carries go to host memory.
    Nothing is written until ``finish()``."""
    # The state of every iteration: the carried variables' values and the user's carry.
    state = ([self.values[i] for i in self.carried], carry)
    options = (lengths, remat, policy, prevent_cse, unroll, offload)
    state, written, ys = self._units(body, state, xs, *options)
    self.changed = self._changed(written, state[0])
    return state[1], ys

  def _units(self, body, state, xs, lengths, remat, policy, prevent_cse, unroll, offload):
    """``loop``'s full units from ``state``: ``(state, written, ys)``."""
    lengths = (self.full,) if lengths is None else tuple(lengths)
    if remat and math.prod(lengths) != self.full:
      state, written = self.segments(body, state, self.full, lengths, policy, prevent_cse, offload)
      return state, written, None
    return self.levels(body, state, xs, lengths, unroll, remat, policy, prevent_cse, offload)

  def finish(self) -> None:
    """Writes what the loop changed into the caller's modules."""
    made = None if self.structure is None else Restructured(None, self.made, self.structure)
    commit(
      self.variables,
      self.changed,
      self.what,
      made,
      nodes=split_call((self.module,), {})[0] if made else (),
      streams=self.used,
      stacked_axis=0,
      partition_name=self.partition_name,
      keep_metadata=True,
    )

  def _layer_first(self, i: int):
    """The value of stacked variable ``i``, layer axis first."""
    return _move_axis(self.values[i], self.treatment.stacked_axis(i), 0)

  def _stacked_inputs(self) -> list:
    """The stacked values the loop runs over, layer axis first."""
    return [self._layer_first(i) for i in self.stacked]

  def levels(self, body, state, xs, lengths: tuple, unroll, remat, policy, prevent_cse, offload):
    """``loop``'s scans from ``state``: ``(state, written, ys)``, layer axis first."""
    n = math.prod(lengths)
    # lax, and nothing for a single level or axis 0: each jnp call is a nested jit,
    # which under grad costs about a millisecond of tracing.
    if len(lengths) == 1:
      fold = unfold = lambda x: x
    else:
      fold = lambda x: lax.reshape(x, lengths + jnp.shape(x)[1:])
      unfold = lambda x: lax.reshape(x, (n,) + jnp.shape(x)[len(lengths) :])
    # A Variable's value may be a pytree (a sown tuple): each leaf has the layer axis.
    stacked_in = [jax.tree.map(fold, v) for v in self._stacked_inputs()]
    # The layer index only feeds the RNG streams' per-layer keys.
    index = lax.reshape(lax.iota(jnp.uint32, n), lengths) if self.treatment.streams else None
    depth = len(lengths)

    # Closures rather than functools.partial: jax inspects a partial's signature at
    # every scan and checkpoint, which costs tens of microseconds each.
    def level(d, state, x):
      if d == depth:
        return self._layer(body, state, x)

      def step(state, x):
        return level(d + 1, state, x)

      # The innermost level's carry stays on the device and its step follows the policy;
      # without remat (sr.scan) a step saves what a plain scan saves.
      innermost = d == depth - 1
      step = _guard(
        step,
        remat=remat,
        policy=policy if innermost else None,
        prevent_cse=prevent_cse and remat,
        offload=offload and (not innermost or depth == 1),
      )
      return lax.scan(
        step, state, x, length=lengths[d], reverse=self.reverse, unroll=unroll if innermost else 1
      )

    state, (written, ys) = level(0, state, (stacked_in, jax.tree.map(fold, xs), index))
    return state, jax.tree.map(unfold, written), jax.tree.map(unfold, ys)

  def _changed(self, written: tuple[dict, list], carry_values: list) -> dict:
    self.treatment.check_stream_names()  # the body is traced: the names drawn are known
    values, self.made = written
    changed = {i: _move_axis(v, 0, self.treatment.axes[i]) for i, v in values.items()}
    changed.update({i: v for i, v in zip(self.carried, carry_values) if i in self.carry_written})
    return changed

  def segments(self, body, state, n: int, lengths: tuple, policy, prevent_cse, offload):
    """``loop(body, carry, None, lengths=lengths, remat=True)`` for ``n < prod(lengths)``
    layers, from ``state``: ``(state, written)``. Level ``d`` scans its full steps of
    ``m = prod(lengths[d+1:])`` layers, then one short step, each under
    ``jax.checkpoint``."""
    depth = len(lengths)

    def segment(d, state, values, count, offset):
      """Layers ``[offset, offset + count)``, whose stacked values are ``values``."""
      if d == depth - 1:  # the innermost level: single layers
        index = None
        if self.treatment.streams:
          index = lax.iota(jnp.uint32, count) + lax.convert_element_type(offset, jnp.uint32)
        step = _guard(
          lambda state, x: self._layer(body, state, x),
          policy=policy,
          prevent_cse=prevent_cse,
          offload=offload and depth == 1,
        )
        state, (written, _) = lax.scan(step, state, (values, None, index), length=count)
        return state, written
      m = math.prod(lengths[d + 1 :])
      full, rest = divmod(count, m)
      parts = []
      if full > 1:

        def step(state, i):
          sub = [jax.tree.map(lambda v: lax.dynamic_slice_in_dim(v, i * m, m), v) for v in values]
          return segment(d + 1, state, sub, m, offset + i * m)

        step = _guard(step, prevent_cse=prevent_cse, offload=offload)
        state, written = lax.scan(step, state, lax.iota(jnp.int32, full))
        merge = lambda v: lax.reshape(v, (full * m,) + v.shape[2:])
        parts.append(jax.tree.map(merge, written))
      # A single step runs outside any scan, where XLA would merge its recomputation
      # with the forward pass and keep the residuals: prevent_cse=True stops it. (Two
      # in a row still hold both residuals at once; sr.plan_remat never proposes that.)
      singles = ([(0, m)] if full == 1 else []) + ([(full * m, rest)] if rest else [])
      for begin, size in singles:
        sub = [jax.tree.map(lambda v: lax.slice_in_dim(v, begin, begin + size), v) for v in values]

        def single(state, sub, begin=begin, size=size):
          return segment(d + 1, state, sub, size, offset + begin)

        state, written = _guard(single, offload=offload)(state, sub)
        parts.append(written)
      if len(parts) == 1:
        return state, parts[0]
      join = lambda *vs: lax.concatenate(vs, 0)
      return state, jax.tree.map(join, *parts)

    return segment(0, state, self._stacked_inputs(), n, 0)


def _guard(step, *, remat=True, policy=None, prevent_cse=True, offload=False) -> Callable:
  """``step`` under ``jax.checkpoint`` (``offload``: its carry in host memory), or as is."""
  if offload:
    return offloaded(step, policy, remat, prevent_cse)
  return jax.checkpoint(step, policy=policy, prevent_cse=prevent_cse) if remat else step


def _move_axis(x, source: int, destination: int):
  if source == destination:
    return x
  return jax.tree.map(lambda leaf: jnp.moveaxis(leaf, source, destination), x)
