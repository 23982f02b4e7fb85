"""``sr.pipeline``'s program: a ``shard_map`` over the stages, a ``scan`` of steps (README.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ...core._graph import flatten
from ...core._kinds import RngCount, RngKey
from ...core._split_merge import merge
from ...core._stacks import axis_size, layer_axis
from ...core._state import State
from .._class_form import display_name
from .._lift import Lifted, advance, commit, split_call
from .._remat_scan_args import AUTO
from .._remat_scan_loop import avals, remat_scan_function
from .._rules import TransformError, mark_layer_index
from ..accumulate._microbatches import join, split_rows
from ..memory._remat_search import search


def schedule_steps(k: int, stages: int, repeats: int) -> int:
  """The schedule's time steps: stage 0 starts pass r of microbatch m at r·P + m."""
  return (repeats - 1) * max(k, stages) + k + stages - 1


def stacked_axes(stack) -> tuple[Any, list, list[int | None]]:
  """``(graphdef, variables, layer axis of each or None)``."""
  graphdef, variables = flatten(split_call((stack,), {})[0])
  axes = []
  for var in variables:
    found = layer_axis(var)
    axes.append(None if found is None else found[0])
  return graphdef, variables, axes


def program(fn: Callable, spec, *, what: str, nesting, budget: int | None, options: dict):
  """The traced pipeline ``run(stack, x, *args, **kwargs) -> y`` of ``spec`` (a
  ``PipelineSpec``), under a mesh with ``spec.axis``; each stage planned where ``nesting``
  or the policy is ``"auto"``."""
  k, axis, repeats = spec.microbatches, spec.axis, spec.repeats
  plans: dict = {}  # planned: one plan per (stage structure, shapes)
  auto = AUTO in (nesting, options["policy"])

  def body(layer, carry, *args, **kwargs):
    return fn(layer, carry, *args, **kwargs)

  def skipping(layer, carry, *args, **kwargs):
    x, c, size = carry
    y = fn(layer, x, *args, **kwargs)
    y = jax.tree.map(lambda new, old: jnp.where(c < size, new, old), y, x)
    return y, c + 1, size

  @functools.wraps(fn)
  def run(stack, x, *args, **kwargs):
    graphdef, variables, axes = stacked_axes(stack)
    mesh = jax.sharding.get_abstract_mesh()
    stages = mesh.shape[axis]
    n = next(axis_size(v._value, a) for v, a in zip(variables, axes) if a is not None)
    layout = Layout(n, stages, repeats)
    chunk, period = layout.chunk, max(k, stages)
    steps = schedule_steps(k, stages, repeats)
    like = State.from_variables(zip(graphdef.var_paths, variables))
    layer_axis = {i: a for i, a in enumerate(axes) if a is not None}
    stacked = list(layer_axis)
    others = [i for i, a in enumerate(axes) if a is None]
    counts = [i for i in others if isinstance(variables[i], RngCount)]
    bad = [i for i in others if not isinstance(variables[i], (RngCount, RngKey))]
    if bad:
      var = variables[bad[0]]
      raise TransformError(
        f"{what}: `{var.path_str()}` ({type(var).__name__}) has no layer axis, so it "
        "cannot be spread over the stages (only RNG streams may be unstacked). Fix: "
        "give it the layer axis (one value per layer), or keep it out of the stack."
      )
    stage_fn = skipping if layout.padded else body
    stage_what = f"sr.remat_scan({display_name(stage_fn)})"
    values = [v._value for v in variables]
    xs = jax.tree.map(lambda v: split_rows(v, k), x)
    extras, extras_tree = jax.tree.flatten((args, kwargs))
    dynamic = [j for j, leaf in enumerate(extras) if is_array(leaf)]

    def with_extras(given):
      given = dict(zip(dynamic, given))
      return jax.tree.unflatten(extras_tree, [given.get(j, v) for j, v in enumerate(extras)])

    # The stage's chunk is the stack's own structure with fewer layers: lifted as one
    # argument, so each step runs it through the kernel (Lifted.run).
    lifted = Lifted(graphdef, jax.tree.structure(((0,), {})), (0,))
    lengths, layers, stage_options = (chunk,), chunk, options  # one level, unless planned

    if auto:

      def chunk_shape(i):
        shape = list(jnp.shape(values[i]))
        if i in layer_axis:
          shape[layer_axis[i]] = chunk
        return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(values[i]))

      carry = jax.tree.map(per_device, jax.tree.map(lambda v: v[0], xs), x)
      if layout.padded:
        carry = (carry, jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
      key = (
        graphdef,
        chunk,
        avals(carry),
        extras_tree,
        tuple(avals(v) if is_array(v) else v for v in extras),
      )
      plan = plans.get(key)
      if plan is None:
        module = merge(graphdef, like.with_values([chunk_shape(i) for i in range(len(values))]))

        def planned(layer, c):  # the extra arrays as zeros: the plan needs only shapes
          a, kw = with_extras(
            [jnp.zeros(jnp.shape(extras[j]), jnp.result_type(extras[j])) for j in dynamic]
          )
          return stage_fn(layer, c, *a, **kw)

        given = None if nesting == AUTO else (chunk,)
        policy, carries = options["policy"], options["carries"]
        plan = search(module, carry, planned, budget, policy, carries, lengths=given)
      lengths, layers = plan.lengths, plan.n
      stage_options = {**options, "policy": plan.policy, "carries": plan.carries}
    inner = remat_scan_function(stage_fn, lengths, layers, None, what=stage_what, **stage_options)

    explicit = dict(zip(mesh.axis_names, mesh.axis_types))[axis] == AxisType.Explicit

    def to_layout(v, a):
      v = _move_axis(v, a, 0)
      return v if layout.identity else relaid(v, layout, axis, explicit)

    def from_layout(v, i):
      """A written value back in the stack's own layout and (Explicit axes) sharding."""
      a = layer_axis[i]
      if not layout.identity:
        home = home_spec(_move_axis(values[i], a, 0), explicit)
        v = moved(v, layout.inverse, axis, explicit, stages, home)
      return _move_axis(v, 0, a)

    laid = [to_layout(values[i], layer_axis[i]) for i in stacked]
    found: dict = {}  # what the stage's body wrote, learnt while tracing it

    def stage_program(laid, fixed, xs, given):
      s = lax.axis_index(axis)
      varying = lambda v: lax.pcast(v, (axis,), to="varying")
      call_args, call_kwargs = with_extras(given)

      def at(u):
        """Whether offset ``u`` (a step less a stage) is pass r of microbatch m: (valid, m, r)."""
        r, m = u // period, u % period
        valid = (u >= 0) & (m < k) & (r < repeats)
        return valid, jnp.clip(m, 0, k - 1), jnp.clip(r, 0, repeats - 1)

      def one_step(m, r, local, inp):
        """Stage s's pass r of microbatch m: (output, the written chunk values)."""
        q = r * stages + s
        flat: list[Any] = [None] * len(values)
        for j, i in enumerate(stacked):  # the layer axis back where the stack has it
          v = lax.dynamic_slice_in_dim(local[j], r * chunk, chunk) if repeats > 1 else local[j]
          flat[i] = _move_axis(v, 0, layer_axis[i])
        for j, i in enumerate(others):
          flat[i] = fixed[j]
        for i in counts:  # microbatch m draws as the sequential run's m-th call
          flat[i] = advance(flat[i], m)
        carry = (inp, jnp.zeros((), jnp.int32), layout.size(q)) if layout.padded else inp

        def run_chunk(module):
          mark_layer_index(module, layout.offset(q))
          return inner(module, carry, *call_args, **call_kwargs)

        out, changes = lifted.run(run_chunk, flat, [], what)
        out = out[0] if layout.padded else out
        wrote = changes.values
        found["written"] = [j for j, i in enumerate(stacked) if i in wrote]
        found["counts"] = [i for i in counts if i in wrote]
        new = [_move_axis(wrote[stacked[j]], layer_axis[stacked[j]], 0) for j in found["written"]]
        found["dtypes"] = [jnp.result_type(v) for v in new]
        return out, new

      one_step(*at(-s)[1:], laid, jax.tree.map(lambda v: varying(v[0]), xs))  # learns `found`
      written = found["written"]
      forward = [(i, (i + 1) % stages) for i in range(stages if repeats > 1 else stages - 1)]

      def step(state, t):
        recv, buf, outs, local_w = state
        if repeats > 1:  # stage 0 keeps what came round from stage S-1 for the next pass
          came, slot, pass_ = at(t - stages)
          back = came & (pass_ < repeats - 1) & (s == 0)
          buf = jax.tree.map(
            lambda b, v: jnp.where(back, lax.dynamic_update_index_in_dim(b, v, slot, 0), b),
            buf,
            recv,
          )
        valid, m, r = at(t - s)
        inp = jax.tree.map(
          lambda b, v: jnp.where(s == 0, lax.dynamic_index_in_dim(b, m, 0, False), v), buf, recv
        )
        local = list(laid)
        for j, v in zip(written, local_w):
          local[j] = v
        # Circular: under jax.checkpoint, so the step scan keeps no chunk of weights per step.
        out, new = (jax.checkpoint(one_step) if repeats > 1 else one_step)(m, r, local, inp)
        updated = []
        for v, old in zip(new, local_w):
          if repeats > 1:
            v = lax.dynamic_update_slice_in_dim(old, v, r * chunk, 0)
          updated.append(jnp.where(valid, v, old))
        last = valid & (s == stages - 1) & (r == repeats - 1)
        outs = jax.tree.map(
          lambda o, v: jnp.where(last, lax.dynamic_update_index_in_dim(o, v, m, 0), o), outs, out
        )
        recv = jax.tree.map(lambda v: lax.ppermute(v, axis, forward), out)
        return (recv, buf, outs, updated), None

      init = (
        jax.tree.map(lambda v: varying(jnp.zeros_like(v[0])), xs),
        jax.tree.map(varying, xs),
        jax.tree.map(varying, xs),
        # In the dtype the body writes, as after the sequential run's first microbatch
        # (a BatchNorm's float32 statistics updated from a float64 batch are float64).
        [lax.convert_element_type(laid[j], d) for j, d in zip(written, found["dtypes"])],
      )
      (_, _, outs, local_w), _ = lax.scan(step, init, jnp.arange(steps, dtype=jnp.int32))
      outs = jax.tree.map(
        lambda o: lax.psum(jnp.where(s == stages - 1, o, jnp.zeros_like(o)), axis), outs
      )
      return outs, local_w

    fixed = [values[i] for i in others]
    # Under jit even when called eagerly: an eager shard_map compiles each primitive.
    program = jax.jit(
      jax.shard_map(
        stage_program,
        mesh=mesh,
        in_specs=(PartitionSpec(axis), PartitionSpec(), PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec(axis)),
        axis_names={axis},
      )
    )
    outs, local_w = program(laid, fixed, xs, [extras[j] for j in dynamic])
    written, used = found["written"], found["counts"]
    changed = {stacked[j]: from_layout(v, stacked[j]) for j, v in zip(written, local_w)}
    commit(variables, changed, what, streams=used, draws=k)  # each microbatch drew once
    return jax.tree.map(join, outs, x)

  return run


class Layout:
  """Where each of the N layers sits in the pipeline's (S·R·C)-long layer axis: ``slots``
  holds the stack's layer at each place (a short chunk repeats its last one), ``inverse``
  each layer's place."""

  def __init__(self, n: int, stages: int, repeats: int):
    self.stages = stages
    self.base, self.extra = divmod(n, stages * repeats)
    self.chunk = self.base + (self.extra > 0)
    self.padded = self.extra > 0
    # Place (s, r, c) holds layer c of chunk q = r·S + s, stage s's pass r.
    s, r, c = np.indices((stages, repeats, self.chunk))
    q = r * stages + s
    size = self.size(q)
    slots = np.where(size > 0, self.offset(q) + np.minimum(c, size - 1), 0).ravel()
    kept = (c < size).ravel()
    self.slots = slots.astype(np.int32)
    self.inverse = np.zeros(n, np.int32)
    self.inverse[slots[kept]] = np.flatnonzero(kept)
    self.identity = len(slots) == n and bool((slots == np.arange(n)).all())

  def offset(self, q):
    """The stack's index of chunk ``q``'s first layer (``q`` traced, or numpy's)."""
    minimum = np.minimum if isinstance(q, np.ndarray) else jnp.minimum
    return q * self.base + minimum(q, self.extra)

  def size(self, q):
    return self.base + (q < self.extra)


def is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def per_device(mb, whole):
  """One microbatch's shape per device where Explicit axes show it, else the whole one."""
  shape = jnp.shape(mb)
  sharding = getattr(jax.typeof(whole), "sharding", None)
  if sharding is not None and not sharding.mesh.empty and any(sharding.spec):
    try:
      shape = NamedSharding(sharding.mesh, sharding.spec).shard_shape(shape)
    except ValueError:
      pass
  return jax.ShapeDtypeStruct(shape, jnp.result_type(mb))


def relaid(v, layout: Layout, axis: str, explicit: bool):
  """``v`` (layer axis first) moved into the pipeline's layout; its gradient moves back."""
  stages, home = layout.stages, home_spec(v, explicit)

  @jax.custom_vjp
  def move(v):
    return moved(v, layout.slots, axis, explicit, stages)

  move.defvjp(
    lambda v: (move(v), None),
    lambda _, ct: (moved(ct, layout.inverse, axis, explicit, stages, home),),
  )
  return move(v)


def home_spec(v, explicit: bool):
  """``v``'s spec where Explicit axes show it (the layout to move back into), else None."""
  return jax.typeof(v).sharding.spec if explicit else None


def moved(v, order, axis: str, explicit: bool, stages: int, spec=None):
  """``v`` (layer axis first) with its layers in ``order``, sharded over the stages where
  its length divides among them, else as ``spec`` (or replicated)."""
  lead = axis if len(order) % stages == 0 else None
  if explicit:
    if spec is None:
      rest = tuple(jax.typeof(v).sharding.spec)[1:]
      rest += (None,) * (jnp.ndim(v) - 1 - len(rest))
      spec = PartitionSpec(lead, *rest)
    return v.at[order].get(out_sharding=spec)
  free = (PartitionSpec.UNCONSTRAINED,) * (jnp.ndim(v) - 1)
  return lax.with_sharding_constraint(jnp.take(v, order, axis=0), PartitionSpec(lead, *free))


def _move_axis(v, source: int, destination: int):
  return v if source == destination else jnp.moveaxis(v, source, destination)
