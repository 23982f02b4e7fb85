"""sr.pipeline: a stack's layers spread over a mesh axis, microbatches flowing through.

One SPMD program: ``jax.shard_map`` over the mesh axis ``axis`` (S stages; the other
mesh axes stay automatic, so a batch sharded over ``"data"`` stays so), inside it one
``lax.scan`` over the schedule's time steps. At step ``t`` stage ``s`` works on
``u = t - s``: pass ``r = u // P`` of microbatch ``m = u % P`` (``P = max(k, S)``), a
bubble when that is outside ``k`` microbatches and ``R`` passes. Each step runs the
stage's chunk of layers through the library's own ``sr.remat_scan`` (one level with
``policy``, or the nesting ``lengths="auto"`` plans for the chunk under a per-device
``memory_budget``) on a module rebuilt from the chunk's values (per-layer rules, RNG seeding and state read-back are
``remat_scan``'s), with each RNG stream's count set to ``c0 + m`` and the layers seeded
by their global index; a bubble's state writes are dropped (the old values selected).
Activations move with ``jax.lax.ppermute`` (stage ``s`` to ``s + 1``; circular wraps
``S - 1`` to stage 0, which keeps them until the microbatch's next pass).

The Q = S·R chunks are the stack's layers in order, ``N // Q`` or one more each (the
first ``N % Q``); chunk ``q = r·S + s`` is stage ``s``'s pass ``r``. Where that layout
differs from the stack's (circular, or N not divisible by Q) the stacked values are
gathered into it inside the trace, each chunk padded to the longest with layers the
stage skips (the carry passes them unchanged), and written state is gathered back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from ..core._graph import flatten
from ..core._kinds import RngCount, RngKey
from ..core._split_merge import merge
from ..core._state import State
from ._accumulate import split_rows
from ._class_form import display_name
from ._lift import refuse_layer_list, write_back
from ._module_arg import check_no_modules, compiled_when_eager
from ._pattern import is_pattern_stack
from ._pipeline_checks import check_batch, check_layer_sharding, find_mesh, stacked_axes
from ._pipeline_layout import Layout, is_array, join, per_device
from ._remat_scan import plan_remat, remat_scan
from ._remat_scan_args import AUTO, resolve_plan
from ._rules import TransformError, layer_index_map

SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """How ``sr.pipeline`` runs a stack: the mesh axis of the stages, the number of
  microbatches, the schedule (``"gpipe"`` or ``"circular"``) and its repeats.

  ``spec.apply(fn)`` is ``sr.pipeline(fn, **fields)``.

  >>> import statefulremat as sr
  >>> spec = sr.PipelineSpec(microbatches=4, schedule="circular", repeats=2)
  >>> spec.axis, spec.bubble_fraction(stages=4)
  ('stage', 0.2727...)
  """

  axis: str = "stage"
  microbatches: int = 1
  schedule: str = "gpipe"
  repeats: int = 1
  policy: Callable | None = None

  def __post_init__(self):
    _check_options(self)

  def bubble_fraction(self, stages: int) -> float:
    """The share of stage steps that are bubbles: (S−1)/(R·k+S−1) for k ≥ S."""
    steps = _steps(self.microbatches, stages, self.repeats)
    return (steps - self.repeats * self.microbatches) / steps

  def apply(self, fn: Callable) -> Callable:
    return pipeline(
      fn,
      axis=self.axis,
      microbatches=self.microbatches,
      schedule=self.schedule,
      repeats=self.repeats,
      policy=self.policy,
    )

  def _pipelined(self, fn: Callable, **how) -> Callable:
    """``sr.remat_scan(fn, ..., pipeline=self)``: ``how`` is ``pipelined``'s."""
    return pipelined(fn, self, **how)


def _check_options(spec) -> None:
  what = "sr.pipeline"
  if not isinstance(spec.axis, str):
    raise TransformError(
      f"{what}: axis={spec.axis!r} must be a mesh axis name (a str), e.g. axis='stage'."
    )
  for name in ("microbatches", "repeats"):
    value = getattr(spec, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise TransformError(f"{what}: {name}={value!r} must be a positive int.")
  if spec.schedule not in SCHEDULES:
    raise TransformError(f"{what}: schedule={spec.schedule!r}; it is one of {SCHEDULES}.")
  if spec.schedule == "gpipe" and spec.repeats != 1:
    raise TransformError(
      f"{what}: repeats={spec.repeats} is for schedule='circular' (each stage holds "
      "R chunks, a microbatch goes round the stages R times); gpipe passes once. Fix: "
      "schedule='circular', or drop repeats."
    )


def _steps(k: int, stages: int, repeats: int) -> int:
  """The schedule's time steps: stage 0 starts pass r of microbatch m at r·P + m."""
  return (repeats - 1) * max(k, stages) + k + stages - 1


def pipeline(
  fn: Callable,
  *,
  axis: str = "stage",
  microbatches: int,
  schedule: str = "gpipe",
  repeats: int = 1,
  policy: Callable | None = None,
  lengths: str | None = None,
  memory_budget: int | str | None = None,
) -> Callable:
  """Runs ``fn(layer, carry, *args, **kwargs) -> carry`` over a stack's layers spread
  over the mesh axis ``axis`` (S stages), the carry's batch split into
  ``microbatches`` (k) flowing through them.

  ``sr.pipeline(fn, ...)(stack, x)`` equals running
  ``sr.remat_scan(fn, lengths=(N,))(stack, mb)`` on each microbatch ``mb`` of ``x``
  (rows ``m·B/k`` to ``(m+1)·B/k − 1``) in turn and concatenating: per layer, state
  (BatchNorm statistics) sees the microbatches in order, dropout draws that run's keys,
  and every RNG stream advances once per microbatch. ``"gpipe"``: stage s holds layers
  ``s·N/S …``; ``"circular"`` with ``repeats`` R: the layers in S·R chunks, stage s
  holding chunks s, s+S, …, a microbatch going round the stages R times (bubble
  (S−1)/(R·k+S−1)). It is one ``shard_map`` over ``axis`` with ``ppermute`` between
  stages (other mesh axes, e.g. a ``"data"`` axis the batch is sharded over or a
  ``"model"`` axis a kernel is sharded over, stay as they are), so it works under
  ``sr.jit``, ``sr.grad`` and ``sr.Optimizer``. It runs under ``jax.set_mesh(mesh)``
  (or, called eagerly, on the mesh the stack's arrays are placed on); with N divisible
  by S the stack's layer axis must be sharded over ``axis`` (name it with
  ``metadata_params={"partition_name": "layers"}`` and shard with the rule
  ``("layers", axis)``).

  Arguments after the carry (``(stack, x, mask, train=True)``) are broadcast, as
  ``remat_scan`` broadcasts them: every layer and every microbatch gets them whole
  (what differs per example, such as a padding mask per row, belongs in the carry,
  which is split). Each stage runs its layers as ``sr.remat_scan``: one level with
  ``policy`` (what it saves), or, with ``lengths="auto"``, the nesting and policy
  ``sr.plan_remat`` chooses for one stage's layers and one microbatch under
  ``memory_budget`` (bytes, or ``"512MiB"``: per device; the microbatch is counted per
  device where its sharding is known while tracing, under ``Explicit`` axes, else
  whole). The class form is ``sr.remat_scan(Block, lengths=..., pipeline=spec)``
  (``sr.PipelineSpec``).

  >>> import jax, jax.numpy as jnp, numpy as np, statefulremat as sr
  >>> Stack = sr.remat_scan(sr.nn.Linear, lengths=(4,))
  >>> stack = Stack(3, 3, rngs=sr.Rngs(0))
  >>> mesh = jax.make_mesh((1,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> with jax.set_mesh(mesh):
  ...   y = sr.pipeline(lambda layer, x: layer(x), microbatches=2)(stack, jnp.ones((4, 3)))
  >>> bool(np.allclose(y, stack(jnp.ones((4, 3))), atol=1e-5))
  True
  """
  spec = PipelineSpec(
    axis=axis, microbatches=microbatches, schedule=schedule, repeats=repeats, policy=policy
  )
  what = f"sr.pipeline({display_name(fn)})"
  if lengths is not None and not isinstance(lengths, str):
    raise TransformError(
      f"{what}: lengths={lengths!r}; each stage runs its own N/S layers, so a nesting "
      "of the whole stack does not apply. Fix: lengths='auto' with memory_budget= "
      "(planned per stage), or leave it out (one level per stage, with policy=)."
    )
  lengths, _, policy, budget = resolve_plan(
    what, () if lengths is None else lengths, None, policy, memory_budget
  )
  return pipelined(
    fn,
    dataclasses.replace(spec, policy=None),
    what=what,
    lengths=lengths if lengths == AUTO else None,
    layers=None,
    memory_budget=budget,
    policy=policy,
  )


def pipelined(
  fn: Callable, spec: PipelineSpec, *, what: str, lengths, layers, memory_budget, **options
) -> Callable:
  """``sr.pipeline``, and ``sr.remat_scan(..., pipeline=spec)``'s function form:
  ``options`` are ``remat_scan``'s, for each stage's scan; ``layers`` the N that
  ``remat_scan``'s ``lengths`` / ``length`` gave (None: any)."""
  if not isinstance(spec, PipelineSpec):
    raise TransformError(
      f"{what}: pipeline={spec!r}; it takes sr.PipelineSpec(axis=..., "
      "microbatches=..., schedule=..., repeats=...)."
    )
  if spec.policy is not None:
    if options.get("policy") is not None:
      raise TransformError(
        f"{what}: the policy is given twice, as policy= and in the PipelineSpec. Fix: give it once."
      )
    if lengths == AUTO:
      raise TransformError(
        f"{what}: lengths='auto' chooses each stage's policy too; drop the "
        "PipelineSpec's policy, or give lengths= yourself to use it."
      )
    options["policy"] = spec.policy
  traced = compiled_when_eager(_traced(fn, spec, what, lengths == AUTO, memory_budget, options))

  @functools.wraps(fn)
  def wrapper(stack, x, *args, **kwargs):
    refuse_layer_list(stack, what, "sr.pipeline(f, ...)(stack, x)")
    check_no_modules(x, what, "the carry")
    check_no_modules(args, what, "the extra argument")
    check_no_modules(kwargs, what, "the keyword argument")
    if is_pattern_stack(stack):
      raise TransformError(
        f"{what}: pattern stacks are not pipelined yet. Fix: pipeline a plain stack "
        "(sr.remat_scan(Block, ...)), or run this one with sr.remat_scan."
      )
    mesh = find_mesh(stack, spec.axis, what)
    check_batch(x, spec.microbatches, what)
    check_layer_sharding(stack, mesh, spec, what, layers)
    if jax.sharding.get_abstract_mesh().empty:
      with jax.set_mesh(mesh):
        return traced(stack, x, *args, **kwargs)
    return traced(stack, x, *args, **kwargs)

  return wrapper


# -- the traced program ----------------------------------------------------------------


def _traced(
  fn: Callable, spec: PipelineSpec, what: str, auto: bool, budget, options: dict
) -> Callable:
  k, axis, repeats = spec.microbatches, spec.axis, spec.repeats
  plans: dict = {}  # lengths="auto": one plan per (stage structure, shapes)

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
    n = next(jnp.shape(v._value)[a] for v, a in zip(variables, axes) if a is not None)
    layout = Layout(n, stages, repeats)
    chunk, period = layout.chunk, max(k, stages)
    steps = _steps(k, stages, repeats)
    spec_ = State.from_variables(zip(graphdef.var_paths, variables))._spec
    stacked = [i for i, a in enumerate(axes) if a is not None]
    counts = [
      i for i, (v, a) in enumerate(zip(variables, axes)) if a is None and isinstance(v, RngCount)
    ]
    others = [i for i, a in enumerate(axes) if a is None]
    bad = [i for i in others if not isinstance(variables[i], (RngCount, RngKey))]
    if bad:
      var = variables[bad[0]]
      raise TransformError(
        f"{what}: `{var.path_str()}` ({type(var).__name__}) has no layer axis, so it "
        "cannot be spread over the stages (only RNG streams may be unstacked). Fix: "
        "give it the layer axis (one value per layer), or keep it out of the stack."
      )
    stage_fn = skipping if layout.padded else body
    values = [v._value for v in variables]
    xs = jax.tree.map(lambda v: split_rows(v, k), x)
    extras, extras_tree = jax.tree.flatten((args, kwargs))
    dynamic = [j for j, leaf in enumerate(extras) if is_array(leaf)]

    def with_extras(given):
      leaves = list(extras)
      for j, v in zip(dynamic, given):
        leaves[j] = v
      return jax.tree.unflatten(extras_tree, leaves)

    def stage_module(flat):
      """The stage's chunk as a module: the layer axis back where the stack has it."""
      flat = list(flat)
      for i in stacked:
        flat[i] = jnp.moveaxis(flat[i], 0, axes[i]) if axes[i] else flat[i]
      return merge(graphdef, State._make(spec_, flat))

    if auto:

      def chunk_shape(i):
        shape = list(jnp.shape(values[i]))
        shape[axes[i]] = chunk
        return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(values[i]))

      abstract = [
        chunk_shape(i)
        if a is not None
        else jax.ShapeDtypeStruct(jnp.shape(values[i]), jnp.result_type(values[i]))
        for i, a in enumerate(axes)
      ]
      carry = jax.tree.map(per_device, jax.tree.map(lambda v: v[0], xs), x)
      if layout.padded:
        carry = (carry, jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
      key = (
        graphdef,
        chunk,
        _avals(carry),
        extras_tree,
        tuple(_avals(v) if is_array(v) else v for v in extras),
      )
      plan = plans.get(key)
      if plan is None:
        module = merge(graphdef, State._make(spec_, abstract))

        def planned(layer, c):  # the extra arrays as zeros: the plan needs only shapes
          a, kw = with_extras(
            [jnp.zeros(jnp.shape(extras[j]), jnp.result_type(extras[j])) for j in dynamic]
          )
          return stage_fn(layer, c, *a, **kw)

        plan = plans[key] = plan_remat(module, carry, fn=planned, memory_budget=budget)
      inner = remat_scan(
        stage_fn, lengths=plan, **{o: v for o, v in options.items() if o != "policy"}
      )
    else:
      inner = remat_scan(stage_fn, lengths=(chunk,), **options)

    def to_layout(v, a):
      v = jnp.moveaxis(v, a, 0) if a else v
      return v if layout.identity else jnp.take(v, layout.slots, axis=0)

    def from_layout(v, a):
      v = v if layout.identity else jnp.take(v, layout.inverse, axis=0)
      return jnp.moveaxis(v, 0, a) if a else v

    laid = [to_layout(values[i], axes[i]) for i in stacked]
    found: dict = {}  # what the stage's body wrote, learnt while tracing it

    def stage_program(laid, fixed, xs, given):
      s = lax.axis_index(axis)
      varying = lambda v: lax.pcast(v, (axis,), to="varying")
      call_args, call_kwargs = with_extras(given)

      def one_step(t, local, inp):
        """Stage s at step t: (output, the written chunk values, valid, m, r)."""
        u = t - s
        r, m = u // period, u % period
        valid = (u >= 0) & (m < k) & (r < repeats)
        m, r = jnp.clip(m, 0, k - 1), jnp.clip(r, 0, repeats - 1)
        q = r * stages + s
        flat = [None] * len(values)
        for j, i in enumerate(stacked):
          flat[i] = (
            lax.dynamic_slice_in_dim(local[j], r * chunk, chunk) if repeats > 1 else local[j]
          )
        for j, i in enumerate(others):
          flat[i] = fixed[j]
        for i in counts:
          flat[i] = flat[i] + m.astype(flat[i].dtype)
        module = stage_module(flat)
        before = [v._value for v in flatten([module])[1]]
        carry = (inp, jnp.zeros((), jnp.int32), layout.size(q)) if layout.padded else inp
        with layer_index_map(module, 1, layout.offset(q)):
          out = inner(module, carry, *call_args, **call_kwargs)
        out = out[0] if layout.padded else out
        after = [v._value for v in flatten([module])[1]]
        found["written"] = [j for j, i in enumerate(stacked) if after[i] is not before[i]]
        found["counts"] = [i for i in counts if after[i] is not before[i]]
        new = [after[stacked[j]] for j in found["written"]]
        new = [
          jnp.moveaxis(v, axes[stacked[j]], 0) if axes[stacked[j]] else v
          for j, v in zip(found["written"], new)
        ]
        return out, new, valid, m, r

      one_step(jnp.int32(0), laid, jax.tree.map(lambda v: varying(v[0]), xs))  # learns `found`
      written = found["written"]
      forward = [(i, (i + 1) % stages) for i in range(stages if repeats > 1 else stages - 1)]

      def step(state, t):
        recv, buf, outs, local_w = state
        if repeats > 1:  # stage 0 keeps what came round from stage S-1 for the next pass
          u = t - stages
          back = (u >= 0) & (u % period < k) & (u // period < repeats - 1) & (s == 0)
          slot = jnp.clip(u % period, 0, k - 1)
          buf = jax.tree.map(
            lambda b, v: jnp.where(back, lax.dynamic_update_index_in_dim(b, v, slot, 0), b),
            buf,
            recv,
          )
        u = t - s
        m0 = jnp.clip(u % period, 0, k - 1)
        inp = jax.tree.map(
          lambda b, v: jnp.where(s == 0, lax.dynamic_index_in_dim(b, m0, 0, False), v), buf, recv
        )
        local = list(laid)
        for j, v in zip(written, local_w):
          local[j] = v
        out, new, valid, m, r = one_step(t, local, inp)
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

      zeros = jax.tree.map(lambda v: varying(jnp.zeros_like(v[0])), xs)
      init = (
        zeros,
        jax.tree.map(varying, xs),
        jax.tree.map(varying, xs),
        [laid[j] for j in written],
      )
      (_, _, outs, local_w), _ = lax.scan(step, init, jnp.arange(steps, dtype=jnp.int32))
      outs = jax.tree.map(
        lambda o: lax.psum(jnp.where(s == stages - 1, o, jnp.zeros_like(o)), axis), outs
      )
      return outs, local_w

    fixed = [values[i] for i in others]
    # out_specs P(axis) is a prefix of the written values' list, whatever its length
    # (the body's writes are known only once traced).
    program = jax.shard_map(
      stage_program,
      mesh=mesh,
      in_specs=(PartitionSpec(axis), PartitionSpec(), PartitionSpec(), PartitionSpec()),
      out_specs=(PartitionSpec(), PartitionSpec(axis)),
      axis_names={axis},
    )
    outs, local_w = program(laid, fixed, xs, [extras[j] for j in dynamic])
    written, used = found["written"], found["counts"]
    changed = {stacked[j]: from_layout(v, axes[stacked[j]]) for j, v in zip(written, local_w)}
    for i in used:
      changed[i] = values[i] + jnp.asarray(k, values[i].dtype)
    write_back(variables, changed, what)
    return jax.tree.map(join, outs, x)

  return run


def _avals(tree):
  return tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree))
