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
from ._module_arg import stacked_sources
from ._outputs import Restructured
from ._rules import BROADCAST, CARRY, READONLY, RNG, STACKED, TransformError, Treatment
from .memory._carries import offloaded


def _aval(x):
  return (tuple(jnp.shape(x)), jnp.result_type(x))


def check_same_type(before, after, what: str, label: str) -> None:
  """Raises if ``after`` does not have the structure, shapes and dtypes of ``before``."""
  tb, ta = jax.tree.structure(before), jax.tree.structure(after)
  if tb != ta:
    where, was, now = _structure_difference(before, after, ())
    raise TransformError(
      f"{what}: the {label} changed structure between iterations: "
      f"`{jax.tree_util.keystr(where) or '<carry>'}` went in as {was} and came out as "
      f"{now} (as trees: {tb} -> {ta}). A carry must keep its structure, shapes and "
      "dtypes; return it in the same form (e.g. `tuple(...)` around a list)."
    )
  for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after)):
    if _aval(b) != _aval(a):
      (sb, db), (sa, da) = _aval(b), _aval(a)
      raise TransformError(
        f"{what}: the {label} leaf `{jax.tree_util.keystr(path) or '<carry>'}` went in "
        f"as {db}{list(sb)} and came out as {da}{list(sa)}. A carry must keep its "
        "shape and dtype across iterations: cast or reshape it back "
        f"(e.g. `.astype(jnp.{db})`), or make it part of the scanned outputs."
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
  """``(key path, was, now)`` of the first node where two pytrees' structures differ,
  in Python terms (``tuple of 2`` -> ``list of 2``)."""
  containers = (tuple, list, dict)
  if type(a) is not type(b) or not isinstance(a, containers) or len(a) != len(b):
    return path, describe_node(a), describe_node(b)
  if isinstance(a, dict):
    if set(a) != set(b):
      return path, describe_node(a), describe_node(b)
    pairs = [(jax.tree_util.DictKey(k), a[k], b[k]) for k in a]
  else:
    pairs = [(jax.tree_util.SequenceKey(i), x, y) for i, (x, y) in enumerate(zip(a, b))]
  for key, x, y in pairs:
    if jax.tree.structure(x) != jax.tree.structure(y):
      return _structure_difference(x, y, path + (key,))
  return path, describe_node(a), describe_node(b)


class LayerLoop:
  """Runs a body once per layer over the lifted modules."""

  period = 1  # layers per unit of the loop (a cycle loop runs a pattern's cycles)

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
  ):
    self.lifted, self.treatment, self.leaves = lifted, treatment, leaves
    self.variables = variables
    self.values = [v._value for v in variables]
    self.what, self.data_transform = what, data_transform
    self.module, self.length, self.reverse = module, length, reverse
    self.metadata_params = metadata_params
    self.changed: dict[int, Any] = {}
    self.stacked = treatment.indices(STACKED)
    self.carried = treatment.indices(CARRY)
    self.count_of = {s.count: s for s in treatment.streams}
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
      slices = self._transform_data(slices)
    for i, value in zip(self.stacked, slices):
      flat[i] = value
    for i, value in zip(self.carried, carry_values):
      flat[i] = value
    return flat

  def _read_back(self, changes: Changes, flat, user_carry, new_carry, ys, carry_label="carry"):
    """After the body: ``((carry values, carry), (written, ys))`` of one iteration."""
    check_no_nodes((new_carry, ys), self.what)
    changed = changes.values
    if changes.structure is not None:
      self.structure = changes.structure
    for i in changed:
      self._check_writable(i)
    check_same_type(user_carry, new_carry, self.what, carry_label)
    new_carry_values = []
    for i in self.carried:
      value = changed.get(i, flat[i])
      if i in changed:
        self.carry_written.add(i)
        check_same_type(flat[i], value, self.what, f"carried variable `{self._name(i)}`: its value")
      new_carry_values.append(value)
    written = {i: changed[i] for i in self.stacked if i in changed}
    # Variables made inside (keys -1, -2, ...): one per layer, stacked like the ys.
    written.update({-1 - k: v for k, v in enumerate(changes.made)})
    return (new_carry_values, new_carry), (written, ys)

  def _transform_data(self, slices):
    graphdef = self.lifted.graphdef
    paths = tuple(graphdef.var_paths[i] for i in self.stacked)
    # Each entry keeps its kind and the layer's metadata (the partition name removed),
    # so the hook can filter (`state.filter(sr.Param)`) and read `sharding`.
    entries = graphdef.variables
    state = State.from_parts(
      paths,
      [entries[i].kind for i in self.stacked],
      [entries[i].metadata for i in self.stacked],
      slices,
    )
    assert self.data_transform is not None  # _substitute calls this only when it is set
    out = self.data_transform(state)
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
    if kind == RNG:
      if i in self.count_of:
        self.used.add(i)
        return
      kind = READONLY
    if kind in (BROADCAST, READONLY):
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
    full, rest = divmod(self.length, self.period)
    carried, tail = self._carried_values(None), None
    if rest and self.reverse:
      (carried, carry), tail = self._tail(body, carried, carry, xs, remat, offload)
    lengths = (full,) if lengths is None else tuple(lengths)
    if remat and math.prod(lengths) != full:
      carried, carry, written = self.segments(
        body,
        carry,
        full,
        lengths,
        policy=policy,
        prevent_cse=prevent_cse,
        carried=carried,
        offload=offload,
      )
      ys = None
    else:
      carried, carry, written, ys = self.levels(
        body,
        carry,
        self._unit_xs(xs),
        lengths,
        reverse=self.reverse,
        unroll=unroll,
        remat=remat,
        policy=policy,
        prevent_cse=prevent_cse,
        carried=carried,
        offload=offload,
      )
    if rest and not self.reverse:
      (carried, carry), tail = self._tail(body, carried, carry, xs, remat, offload)
    if tail is not None:
      written = self._join(written, tail[0])
    self.changed = self._changed(written, carried)
    return carry, self._layer_order(ys, None if tail is None else tail[1])

  # A cycle loop's hooks: its xs by cycle, the short last cycle, its ys in layer order.
  def _unit_xs(self, xs):
    return xs

  def _tail(self, body, carried, carry, xs, remat: bool, offload: bool) -> tuple[tuple, tuple]:
    raise AssertionError("a loop over layers has no short last unit")

  def _join(self, written: dict, tail: dict) -> dict:
    raise AssertionError("a loop over layers has no short last unit")

  def _layer_order(self, ys, tail_ys):
    return ys

  def finish(self) -> None:
    """Writes what the loop changed into the caller's modules (a Variable made inside
    comes out stacked, layer axis 0)."""
    made = None if self.structure is None else Restructured(None, self.made, self.structure)
    commit(
      self.variables,
      self.changed,
      self.what,
      made,
      nodes=split_call((self.module,), {})[0] if made else (),
      streams=self.used,
      stacked_axis=0,
      partition_name=(self.metadata_params or {}).get("partition_name"),
      keep_metadata=True,
    )

  def sources(self) -> list[tuple[str, int]]:
    """``(description, layer count)`` of each stacked Variable, for error messages."""
    return stacked_sources(self.treatment, self.lifted, self.variables)

  def _carried_values(self, carried: list | None) -> list:
    return [self.values[i] for i in self.carried] if carried is None else carried

  def _stacked_inputs(self) -> list:
    """The stacked values the loop runs over, layer axis first."""
    return [_move_axis(self.values[i], self.treatment.stacked_axis(i), 0) for i in self.stacked]

  def levels(
    self,
    body: Callable,
    carry: Any,
    xs: Any,
    lengths: Sequence[int],
    *,
    reverse: bool = False,
    unroll: int | bool = 1,
    remat: bool = False,
    policy: Callable | None = None,
    prevent_cse: bool = True,
    carried: list | None = None,
    offload: bool = False,
  ):
    """``loop``'s scans: ``(carry values, carry, written, ys)``, ``written`` by flat
    index, layer axis first; ``carried``: the carried values to start from."""
    lengths = tuple(lengths)
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
    state = (self._carried_values(carried), carry)
    depth = len(lengths)

    # Closures rather than functools.partial: jax inspects a partial's signature at
    # every scan and checkpoint, which costs tens of microseconds each.
    def level(d, state, x):
      if d == depth:
        return self._layer(body, state, x)

      def step(state, x):
        return level(d + 1, state, x)

      if offload and (d < depth - 1 or depth == 1):
        # Without remat (sr.scan) the step saves what a plain scan saves, prevent_cse
        # being needless under a scan.
        step = offloaded(
          step, policy if d == depth - 1 else None, remat, prevent_cse if remat else False
        )
      elif remat:
        step = jax.checkpoint(
          step, policy=policy if d == depth - 1 else None, prevent_cse=prevent_cse
        )
      return jax.lax.scan(
        step, state, x, length=lengths[d], reverse=reverse, unroll=unroll if d == depth - 1 else 1
      )

    (carry_values, carry), (written, ys) = level(
      0, state, (stacked_in, jax.tree.map(fold, xs), index)
    )
    written = {i: jax.tree.map(unfold, v) for i, v in written.items()}
    return carry_values, carry, written, jax.tree.map(unfold, ys)

  def _changed(self, written: dict, carry_values: list) -> dict:
    self.treatment.check_stream_names()  # the body is traced: the names drawn are known
    changed = {}
    self.made = [written[i] for i in sorted((i for i in written if i < 0), reverse=True)]
    for i, value in written.items():
      if i >= 0:
        changed[i] = _move_axis(value, 0, self.treatment.axes[i])
    for i, value in zip(self.carried, carry_values):
      if i in self.carry_written:
        changed[i] = value
    return changed

  def segments(
    self,
    body: Callable,
    carry: Any,
    n: int,
    lengths: Sequence[int],
    *,
    policy: Callable | None = None,
    prevent_cse: bool = False,
    carried: list | None = None,
    offload: bool = False,
  ):
    """``loop(body, carry, None, lengths=lengths, remat=True)`` for ``n < prod(lengths)``
    layers: ``(carry values, carry, written)``. Level ``d`` scans its full steps of
    ``m = prod(lengths[d+1:])`` layers, then one short step, each under
    ``jax.checkpoint``."""
    lengths = tuple(lengths)
    depth = len(lengths)
    streams = bool(self.treatment.streams)

    def layers(state, values, count, offset):  # the innermost level: single layers
      index = (
        lax.iota(jnp.uint32, count) + lax.convert_element_type(offset, jnp.uint32)
        if streams
        else None
      )
      step = lambda state, x: self._layer(body, state, x)
      if offload and depth == 1:
        step = offloaded(step, policy, True, prevent_cse)
      else:
        step = jax.checkpoint(step, policy=policy, prevent_cse=prevent_cse)
      state, (written, _) = lax.scan(step, state, (values, None, index), length=count)
      return state, written

    def segment(d, state, values, count, offset):
      """Layers ``[offset, offset + count)``, whose stacked values are ``values``."""
      if d == depth - 1:
        return layers(state, values, count, offset)
      m = math.prod(lengths[d + 1 :])
      full, rest = divmod(count, m)
      parts = []
      if full > 1:

        def step(state, i):
          sub = [jax.tree.map(lambda v: lax.dynamic_slice_in_dim(v, i * m, m), v) for v in values]
          return segment(d + 1, state, sub, m, offset + i * m)

        step = (
          offloaded(step, None, True, prevent_cse)
          if offload
          else jax.checkpoint(step, prevent_cse=prevent_cse)
        )
        state, written = lax.scan(step, state, lax.iota(jnp.int32, full))
        merge = lambda v: lax.reshape(v, (full * m,) + v.shape[2:])
        parts.append({i: jax.tree.map(merge, v) for i, v in written.items()})
      # A single step runs outside any scan, where XLA would merge its recomputation
      # with the forward pass and keep the residuals: prevent_cse=True stops it. (Two
      # in a row still hold both residuals at once; sr.plan_remat never proposes that.)
      singles = ([(0, m)] if full == 1 else []) + ([(full * m, rest)] if rest else [])
      for begin, size in singles:
        sub = [jax.tree.map(lambda v: lax.slice_in_dim(v, begin, begin + size), v) for v in values]

        def single(state, sub, begin=begin, size=size):
          return segment(d + 1, state, sub, size, offset + begin)

        single = (
          offloaded(single, None, True, True)
          if offload
          else jax.checkpoint(single, prevent_cse=True)
        )
        state, written = single(state, sub)
        parts.append(written)
      if len(parts) == 1:
        return state, parts[0]
      join = lambda *vs: lax.concatenate(vs, 0)
      return state, {i: jax.tree.map(join, *[p[i] for p in parts]) for i in parts[0]}

    state = (self._carried_values(carried), carry)
    (carry_values, carry), written = segment(0, state, self._stacked_inputs(), n, 0)
    return carry_values, carry, written


def _move_axis(x, source: int, destination: int):
  if source == destination:
    return x
  return jax.tree.map(lambda leaf: jnp.moveaxis(leaf, source, destination), x)
