"""sr.pipeline's checks before anything runs: the mesh and its axis, the batch against
the microbatches, and the stack's layer axis sharded over the stages."""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ...core._graph import flatten
from ...core._module import Module
from ...core._stacks import axis_size, cycle, layer_axis
from .._lift import split_call
from .._rules import TransformError


def stacked_axes(stack) -> tuple[Any, list, list[int | None]]:
  """``(graphdef, variables, layer axis of each or None)``."""
  graphdef, variables = flatten(split_call((stack,), {})[0])
  axes = []
  for var in variables:
    found = layer_axis(var)
    axes.append(None if found is None else found[0])
  return graphdef, variables, axes


def find_mesh(stack, axis: str, what: str):
  context = jax.sharding.get_abstract_mesh()
  mesh = None if context.empty else context
  if mesh is None:
    for var in flatten(split_call((stack,), {})[0])[1]:
      sharding = getattr(var._value, "sharding", None)
      if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        break
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
  for var, a in zip(variables, axes):
    if a is None:
      continue
    value = var._value
    if isinstance(value, jax.core.Tracer):
      kinds = dict(zip(mesh.axis_names, mesh.axis_types))
      if kinds[spec.axis] != jax.sharding.AxisType.Explicit:
        continue  # an Auto axis: the trace does not know, shard_map places it
      got = jax.typeof(value).sharding.spec
    else:
      sharding = getattr(value, "sharding", None)
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
  p, n = len(counts), sum(counts)
  cycles = counts[0]
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
