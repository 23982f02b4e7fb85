"""sr.pipeline and sr.PipelineSpec: the checks of a call, then ``_program`` under the mesh."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.core
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ...core._module import Module
from ...core._stacks import axis_size, cycle
from .._class_form import display_name
from .._lift import serialised
from .._module_arg import check_loop_call
from .._remat_scan_args import AUTO, resolve_plan
from .._remat_scan_loop import STAGE_DEFAULTS
from .._rules import TransformError
from ._program import program, schedule_steps, stacked_axes

SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """How ``sr.pipeline`` runs a stack (``spec.apply(fn)`` is ``sr.pipeline(fn, **fields)``).

  Args:
    axis: the name of the mesh axis the stages are spread over; ``"stage"`` by default.
    microbatches: the number of microbatches the carry's batch is split into; 1 by default.
    schedule: ``"gpipe"`` (the default: a stage holds one run of layers) or ``"circular"``.
    repeats: how many times a microbatch goes round the stages, for ``"circular"``; 1 by default.
    policy: the ``jax.checkpoint`` policy of each stage's layers; None (the default) saves nothing.

  Raises:
    sr.TransformError: ``axis`` is not a str, ``microbatches`` or ``repeats`` is not a positive int,
      ``schedule`` is not one of the two, or ``repeats`` is not 1 with ``"gpipe"``.

  >>> import statefulremat as sr
  >>> spec = sr.PipelineSpec(microbatches=4, schedule="circular", repeats=2)
  >>> spec.axis, spec.bubble_fraction(stages=4)
  ('stage', 0.2727...)
  """

  axis: str = "stage"
  microbatches: int = 1
  schedule: str = "gpipe"
  repeats: int = 1
  policy: Callable | str | None = None

  def __post_init__(self):
    what = "sr.pipeline"
    if not isinstance(self.axis, str):
      raise TransformError(
        f"{what}: axis={self.axis!r} must be a mesh axis name (a str), e.g. axis='stage'."
      )
    for name in ("microbatches", "repeats"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TransformError(f"{what}: {name}={value!r} must be a positive int.")
    if self.schedule not in SCHEDULES:
      raise TransformError(f"{what}: schedule={self.schedule!r}; it is one of {SCHEDULES}.")
    if self.schedule == "gpipe" and self.repeats != 1:
      raise TransformError(
        f"{what}: repeats={self.repeats} is for schedule='circular' (each stage holds "
        "R chunks, a microbatch goes round the stages R times); gpipe passes once. Fix: "
        "schedule='circular', or drop repeats."
      )

  def bubble_fraction(self, stages: int) -> float:
    """The share of stage steps that are bubbles: (S−1)/(R·k+S−1) for k ≥ S."""
    steps = schedule_steps(self.microbatches, stages, self.repeats)
    return (steps - self.repeats * self.microbatches) / steps

  def apply(self, fn: Callable) -> Callable:
    return pipeline(fn, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

  def _pipelined(
    self, fn: Callable, *, what: str, lengths, layers, memory_budget, options: dict
  ) -> Callable:
    """``sr.pipeline`` and ``sr.remat_scan(..., pipeline=self)``: ``options``, each stage's
    remat_scan options; ``layers``, the N that ``lengths`` / ``length`` gave."""
    if self.policy is not None:
      if options.get("policy") is not None:
        raise TransformError(
          f"{what}: the policy is given twice, as policy= and in the PipelineSpec. Fix: give it once."
        )
      options = {**options, "policy": self.policy}
    traced = serialised(
      program(fn, self, what=what, nesting=lengths, budget=memory_budget, options=options)
    )

    @functools.wraps(fn)
    def wrapper(stack, x, *args, **kwargs):
      check_loop_call(what, "sr.pipeline(f, ...)(stack, x)", stack, x, args, kwargs)
      mesh = find_mesh(stack, self.axis, what)
      check_whole_cycles(stack, mesh.shape[self.axis] * self.repeats, what)
      check_batch(x, self.microbatches, what)
      check_layer_sharding(stack, mesh, self, what, layers)
      if jax.sharding.get_abstract_mesh().empty and isinstance(mesh, jax.sharding.Mesh):
        # No mesh set: find_mesh took the one the stack's arrays are placed on.
        with jax.set_mesh(mesh):
          return traced(stack, x, *args, **kwargs)
      return traced(stack, x, *args, **kwargs)

    return wrapper


def pipeline(
  fn: Callable,
  *,
  axis: str = "stage",
  microbatches: int,
  schedule: str = "gpipe",
  repeats: int = 1,
  policy: Callable | str | None = None,
  lengths: str | None = None,
  memory_budget: int | str | None = None,
) -> Callable:
  """Runs ``fn`` over a stack's layers spread over the stages of mesh axis ``axis``, the
  carry's batch split into ``microbatches`` flowing through them.

  Args:
    fn: the body ``fn(layer, carry, *args, **kwargs) -> carry``, as ``sr.remat_scan``'s.
    axis: the mesh axis the S stages lie along (default ``"stage"``).
    microbatches: k, the number of microbatches the carry's batch is split into.
    schedule: ``"gpipe"`` (the default: stage s holds layers ``s·N/S …``) or
      ``"circular"`` (S·R chunks, stage s holding chunks s, s+S, …).
    repeats: R, the rounds of ``schedule="circular"`` (default ``1``).
    policy: what each stage's ``sr.remat_scan`` level saves (default ``None``: nothing,
      or with ``lengths="auto"`` the plan's choice); ``"auto"`` plans it per checkpoint name.
    lengths: ``None`` (the default: one level per stage) or ``"auto"`` (planned for one
      stage's layers and one microbatch under ``memory_budget``).
    memory_budget: with ``lengths="auto"`` or ``policy="auto"``, bytes per device, or a string such as
      ``"512MiB"``. Default ``None``.

  Returns:
    ``run(stack, x, *args, **kwargs)``, which returns the carry after every layer (the microbatches
    concatenated back) and writes the layers' state changes back to ``stack``.

  Raises:
    sr.TransformError: an option out of range (as ``sr.PipelineSpec``), or a tuple of
      ``lengths``; at call, no mesh or no ``axis`` in it, a batch ``microbatches`` does
      not divide, or a stack that does not split into the stages.
    sr.GraphError: a module in the carry or the arguments after it.

  >>> import jax, jax.numpy as jnp, numpy as np, statefulremat as sr
  >>> Stack = sr.remat_scan(sr.nn.Linear, lengths=(4,))
  >>> stack = Stack(3, 3, rngs=sr.Rngs(0))
  >>> mesh = jax.make_mesh((1,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> with jax.set_mesh(mesh):
  ...   y = sr.pipeline(lambda layer, x: layer(x), microbatches=2)(stack, jnp.ones((4, 3)))
  >>> bool(np.allclose(y, stack(jnp.ones((4, 3))), atol=1e-5))
  True
  """
  spec = PipelineSpec(axis=axis, microbatches=microbatches, schedule=schedule, repeats=repeats)
  what = f"sr.pipeline({display_name(fn)})"
  if lengths is not None and not isinstance(lengths, str):
    raise TransformError(
      f"{what}: lengths={lengths!r}; each stage runs its own N/S layers, so a nesting "
      "of the whole stack does not apply. Fix: lengths='auto' with memory_budget= "
      "(planned per stage), or leave it out (one level per stage, with policy=)."
    )
  nesting, _, policy, budget, _ = resolve_plan(
    what, () if lengths is None else lengths, None, policy, memory_budget
  )
  return spec._pipelined(
    fn,
    what=what,
    lengths=nesting if nesting == AUTO else None,
    layers=None,
    memory_budget=budget,
    options={**STAGE_DEFAULTS, "policy": policy},
  )


def find_mesh(stack, axis: str, what: str):
  """The mesh set, else the one the stack's arrays are placed on."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    placed = [getattr(var._value, "sharding", None) for var in stacked_axes(stack)[1]]
    mesh = next((s.mesh for s in placed if isinstance(s, NamedSharding)), None)
  if mesh is None:
    raise TransformError(
      f"{what}: no mesh: the stages are the mesh axis {axis!r}, and neither a mesh is "
      "set nor are the stack's arrays placed on one. Fix: call it inside `with "
      f"jax.set_mesh(mesh):` with a mesh that has an axis {axis!r} (e.g. "
      f"jax.make_mesh((4, 2), ({axis!r}, 'data'))), its layer axis sharded over it."
    )
  if axis not in mesh.axis_names:
    raise TransformError(
      f"{what}: axis={axis!r} is not an axis of the mesh, whose axes are "
      f"{tuple(mesh.axis_names)}. Fix: pass axis= one of those (the axis the stack's "
      f"layer axis is sharded over), or add a {axis!r} axis to the mesh."
    )
  return mesh


def check_batch(x, k: int, what: str) -> None:
  leaves = jax.tree_util.tree_leaves_with_path(x)
  if not leaves:
    raise TransformError(f"{what}: the carry has no arrays to split into {k} microbatches.")
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if not shape or shape[0] % k:
      where = jax.tree_util.keystr(path) or "x"
      size = "a scalar" if not shape else f"batch axis 0 of size {shape[0]}"
      raise TransformError(
        f"{what}: microbatches={k} must divide the batch, but the carry `{where}` "
        f"(shape {tuple(shape)}) has {size}. Fix: a microbatch count that divides "
        f"{shape[0] if shape else 'the batch'}, or a batch that is a multiple of {k}."
      )


def check_layer_sharding(stack, mesh, spec, what: str, layers: int | None = None) -> None:
  """With N divisible by S the layer axis must be sharded over ``axis`` where that shows."""
  _, variables, axes = stacked_axes(stack)
  sizes = {axis_size(v._value, a) for v, a in zip(variables, axes) if a is not None}
  if not sizes:
    raise TransformError(
      f"{what}: the module has no stacked variables (no layer axis) to spread over "
      f"the mesh axis {spec.axis!r}. Fix: pass a stack, e.g. built with "
      "sr.remat_scan(Block, lengths=(N,), metadata_params={'partition_name': "
      "'layers'})."
    )
  if len(sizes) > 1:
    raise TransformError(
      f"{what}: the stacked variables disagree on the number of layers: {sorted(sizes)}."
    )
  n, stages = sizes.pop(), mesh.shape[spec.axis]
  if layers is not None and n != layers:
    raise TransformError(
      f"{what}: lengths/length say {layers} layers, but the stack has {n}. Fix: "
      f"lengths whose product is {n} (or length={n})."
    )
  if n % stages or stages == 1:
    return  # the layer axis cannot be sharded over the stages: the pipeline lays it out
  explicit = dict(zip(mesh.axis_names, mesh.axis_types))[spec.axis] == AxisType.Explicit
  for var, a in zip(variables, axes):
    traced = isinstance(var._value, jax.core.Tracer)
    if a is None or (traced and not explicit):
      continue  # traced on an Auto axis: the trace does not know, shard_map places it
    if traced:
      got = jax.typeof(var._value).sharding.spec
    else:
      sharding = getattr(var._value, "sharding", None)
      got = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    entry = got[a] if a < len(got) else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    if spec.axis not in names:
      raise TransformError(
        f"{what}: the layer axis (axis {a}, {n} layers) of `{var.path_str()}` is not "
        f"sharded over the mesh axis {spec.axis!r} (its spec is {got}), so every stage "
        f"would hold all {n} layers. Fix: name the layer axis "
        "(metadata_params={'partition_name': 'layers'}) and shard it, e.g. "
        f"sr.shard(stack, mesh, [('layers', {spec.axis!r}), ...]), or "
        f"jax.device_put its arrays with PartitionSpec({spec.axis!r}) at that axis."
      )


def check_whole_cycles(stack, chunks: int, what: str) -> None:
  """A pattern stack is pipelined by whole cycles, in ``chunks`` equal chunks."""
  positions = cycle(stack) if isinstance(stack, Module) else ()
  if len(positions) < 2:
    return
  counts = [len(position) for position in positions]
  p, n, cycles = len(counts), sum(counts), counts[0]
  if n % p:
    raise TransformError(
      f"{what}: the pattern stack has {n} layers, not a whole number of cycles of "
      f"{p}, and a pipeline stage holds whole cycles. Fix: a length that is a multiple "
      f"of {p} (e.g. {n - n % p or p}), or run it with sr.remat_scan."
    )
  if cycles % chunks:
    raise TransformError(
      f"{what}: the pattern stack holds {cycles} cycles of {p} layers, which do not "
      f"split into {chunks} equal chunks (stages x repeats). Fix: a number of cycles "
      f"divisible by {chunks} (length a multiple of {p * chunks})."
    )
