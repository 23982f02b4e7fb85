"""sr.pipeline and sr.PipelineSpec: the front that checks a call and runs the traced
program (``_program``) under the stack's mesh."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from .._class_form import display_name
from .._lift import serialised
from .._module_arg import check_loop_call
from .._remat_scan_args import AUTO, resolve_plan
from .._remat_scan_loop import STAGE_DEFAULTS
from .._rules import TransformError
from ._checks import check_batch, check_layer_sharding, check_whole_cycles, find_mesh
from ._program import program, schedule_steps

SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """How ``sr.pipeline`` runs a stack (``spec.apply(fn)`` is ``sr.pipeline(fn, **fields)``).

  Args:
    axis: the name of the mesh axis the stages are spread over; ``"stage"`` by default.
    microbatches: the number of microbatches the carry's batch is split into; 1 by default.
    schedule: ``"gpipe"`` (the default: each stage holds one run of consecutive
      layers) or ``"circular"`` (each stage holds ``repeats`` chunks).
    repeats: how many times a microbatch goes round the stages, for ``"circular"``; 1 by default.
    policy: the ``jax.checkpoint`` policy of each stage's layers (what they save);
      None (the default) saves nothing.

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
  policy: Callable | None = None

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

  def _pipelined(self, fn: Callable, **how) -> Callable:
    """``sr.remat_scan(fn, ..., pipeline=self)``: ``how`` is ``pipelined``'s."""
    return pipelined(fn, self, **how)


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
      or with ``lengths="auto"`` the plan's choice).
    lengths: ``None`` (the default: one level per stage) or ``"auto"`` (planned for one
      stage's layers and one microbatch under ``memory_budget``).
    memory_budget: with ``lengths="auto"``, bytes per device, or a string such as
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
  return pipelined(
    fn,
    spec,
    what=what,
    lengths=nesting if nesting == AUTO else None,
    layers=None,
    memory_budget=budget,
    options={**STAGE_DEFAULTS, "policy": policy},
  )


def pipelined(
  fn: Callable, spec: PipelineSpec, *, what: str, lengths, layers, memory_budget, options: dict
) -> Callable:
  """``sr.pipeline`` and ``sr.remat_scan(..., pipeline=spec)``: ``options`` are each
  stage's remat_scan options (``RematScanForm.options``); ``layers`` the N that
  ``lengths`` / ``length`` gave."""
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
    options = {**options, "policy": spec.policy}
  traced = serialised(
    program(
      fn,
      microbatches=spec.microbatches,
      axis=spec.axis,
      repeats=spec.repeats,
      what=what,
      auto=lengths == AUTO,
      budget=memory_budget,
      options=options,
    )
  )

  @functools.wraps(fn)
  def wrapper(stack, x, *args, **kwargs):
    check_loop_call(what, "sr.pipeline(f, ...)(stack, x)", stack, x, args, kwargs)
    mesh = find_mesh(stack, spec.axis, what)
    check_whole_cycles(stack, mesh.shape[spec.axis] * spec.repeats, what)
    check_batch(x, spec.microbatches, what)
    check_layer_sharding(stack, mesh, spec, what, layers)
    if jax.sharding.get_abstract_mesh().empty and isinstance(mesh, jax.sharding.Mesh):
      # No mesh set: find_mesh took the one the stack's arrays are placed on.
      with jax.set_mesh(mesh):
        return traced(stack, x, *args, **kwargs)
    return traced(stack, x, *args, **kwargs)

  return wrapper
