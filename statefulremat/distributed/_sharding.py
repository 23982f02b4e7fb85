"""SPMD sharding from ``sharding`` metadata: logical axis names -> PartitionSpecs ->
mesh axes -> NamedShardings, all of it JAX's own (``jax.sharding``), nothing home-made.

A Variable names its axes logically (``sr.Param(w, sharding=("embed", "mlp"))``, or
``kernel_metadata={"sharding": ...}`` on a layer); a stack adds its layer axis's name
(``metadata_params={"partition_name": "layers"}``). ``get_partition_spec`` turns that
into ``PartitionSpec("layers", "embed", "mlp")``; ``logical_to_mesh`` maps logical
names to mesh axes with flax-style rules (``[("mlp", "model"), ("embed", None)]``);
``shard`` puts a model's arrays on a ``Mesh`` in place (or, traced, constrains them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.core
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..core._errors import StateMismatchError, TransformError, describe_mesh, format_path
from ..core._module import Module
from ..core._split_merge import state as state_of
from ..core._split_merge import update
from ..core._stacks import LAYER_AXIS
from ..core._state import State, thaw_metadata

M = TypeVar("M")  # the model sr.shard returns, its own type

Rules = Sequence[tuple[str, Any]]


def get_partition_spec(state) -> State:
  """A State like ``state`` whose values are the ``PartitionSpec`` of each entry's
  ``sharding`` metadata (``PartitionSpec()``, replicated, where it has none; a stacked
  entry without it still names its layer axis, if that has a ``partition_name``:
  ``PartitionSpec("layers", None)``).

  Takes a State or a module (its whole State).

  Args:
    state: a State, or a Module (its whole State).

  Returns:
    A State with the same entries, each holding a ``jax.sharding.PartitionSpec`` of
    logical axis names.

  Raises:
    TypeError: ``state`` is neither a State nor a Module.
    sr.StateMismatchError: an entry's ``sharding`` does not name one axis per
      dimension of its array.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> layer = sr.nn.Linear(2, 4, kernel_metadata={"sharding": ("embed", "mlp")},
  ...                      rngs=sr.Rngs(0))
  >>> specs = sr.get_partition_spec(layer)
  >>> specs["kernel"], specs["bias"]
  (P('embed', 'mlp'), P())
  """
  if isinstance(state, Module):
    state = state_of(state)
  elif not isinstance(state, State):
    raise TypeError(
      f"sr.get_partition_spec takes a State or a module, got {type(state).__name__}. "
      "Fix: pass `model` or `sr.state(model)`."
    )
  specs = [
    _spec_of(path, value, thaw_metadata(meta))
    for path, value, meta in zip(state._spec.paths, state._values, state._spec.metas)
  ]
  return State._make(state._spec, specs)


def logical_to_mesh(specs, rules: Rules):
  """``specs`` (a PartitionSpec, or any pytree of them such as ``get_partition_spec``'s
  State) with logical axis names replaced by mesh axes through ``rules``.

  ``rules`` is a sequence of ``(logical name, mesh axis | tuple of mesh axes | None)``,
  as in flax: for each name the first rule whose mesh axes this spec has not used yet
  applies; a name with no rule is replicated (None).

  Args:
    specs: a ``PartitionSpec`` of logical names, or a pytree of them (a State).
    rules: ``(logical name, mesh axis | tuple of mesh axes | None)`` pairs, tried in
      order.

  Returns:
    ``specs`` with the same structure, each ``PartitionSpec`` naming mesh axes.

  Raises:
    sr.TransformError: a rule is not a ``(str, mesh axes)`` pair.

  >>> from jax.sharding import PartitionSpec as P
  >>> import statefulremat as sr
  >>> rules = [("batch", "data"), ("mlp", "model"), ("embed", None)]
  >>> sr.logical_to_mesh(P("layers", "embed", "mlp"), rules)
  P(None, None, 'model')
  """
  rules = _check_rules(rules)
  return jax.tree.map(
    lambda spec: _to_mesh(spec, rules), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
  )


def shard(model: M, mesh: jax.sharding.Mesh, rules: Rules = ()) -> M:
  """Places every array of ``model`` on ``mesh`` as its ``sharding`` metadata says
  (through ``rules``), in place; returns ``model``, so ``model = sr.shard(Model(...),
  mesh, rules)`` reads as it does. Each array's ``.sharding`` is then the
  ``NamedSharding`` its spec gives.

  Outside a trace the arrays move (``jax.device_put``); inside ``sr.jit`` they are
  constrained (``jax.lax.with_sharding_constraint``; on a mesh with ``Explicit`` axes,
  ``jax.make_mesh``'s default, ``jax.sharding.reshard``, and the trace must run under
  that mesh: ``with jax.set_mesh(mesh):``), so a training step keeps its parameters
  where their specs say. Nothing moves unless every entry fits: a mesh axis the mesh
  lacks or a dimension the mesh axis does not divide raises, naming the path.

  Args:
    model: the Module whose arrays to place, in place.
    mesh: the ``jax.sharding.Mesh`` to place them on.
    rules: ``(logical name, mesh axes)`` pairs, as ``sr.logical_to_mesh`` takes them;
      empty (the default) replicates every array.

  Returns:
    ``model`` itself, its arrays placed (or, traced, constrained).

  Raises:
    TypeError: ``model`` is not a Module, or ``mesh`` not a ``jax.sharding.Mesh``.
    sr.TransformError: a rule is not a ``(str, mesh axes)`` pair.
    sr.StateMismatchError: a spec does not fit its array (another number of axes, a
      mesh axis the mesh lacks, a dimension the mesh axes do not divide), or, called
      in a trace on a mesh with ``Explicit`` axes, the trace does not run under it.

  >>> import jax, jax.numpy as jnp, numpy as np, statefulremat as sr
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  >>> layer = sr.nn.Linear(2, 4, kernel_metadata={"sharding": (None, "mlp")},
  ...                      rngs=sr.Rngs(0))
  >>> sr.shard(layer, mesh, rules=[("mlp", "model")]) is layer
  True
  >>> layer.kernel.value.sharding.spec
  P(None, 'model')
  """
  if not isinstance(model, Module):
    raise TypeError(
      f"sr.shard places a module's arrays; got {type(model).__name__}. Fix: pass the "
      "model (for a State of specs, use sr.get_partition_spec and sr.logical_to_mesh)."
    )
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
      f"sr.shard(model, mesh, rules): mesh must be a jax.sharding.Mesh, got "
      f"{type(mesh).__name__}. Fix: e.g. jax.make_mesh((2, 4), ('data', 'model'))."
    )
  state = state_of(model)
  specs = logical_to_mesh(get_partition_spec(state), rules)._values
  for path, value, spec in zip(state._spec.paths, state._values, specs):
    _check_fits(path, value, spec, mesh)
  _check_trace_mesh(state, mesh)
  placed = [_place(v, NamedSharding(mesh, spec)) for v, spec in zip(state._values, specs)]
  update(model, State._make(state._spec, placed))
  return model


# -- helpers ----------------------------------------------------------------------


def _spec_of(path: tuple, value, metadata: dict) -> PartitionSpec:
  sharding = metadata.get("sharding")
  ndim = np.ndim(value)
  if sharding is None:
    # The layer axis is data: a named one is in the spec even where the layer's own
    # axes are not annotated (those stay replicated).
    entries = [None] * ndim
    for axis, name in metadata.get(LAYER_AXIS, ()):
      if name is not None and 0 <= axis < ndim:
        entries[axis] = name
    return PartitionSpec(*entries) if any(entries) else PartitionSpec()
  one_short = isinstance(sharding, (tuple, list)) and len(sharding) == ndim - 1
  axis, name = metadata.get(LAYER_AXIS, ((None, ""),))[0]
  if one_short and name is None:
    # A stack whose layer axis has no partition name: that axis is replicated.
    sharding = (*sharding[:axis], None, *sharding[axis:])
  elif one_short or not isinstance(sharding, (tuple, list)) or len(sharding) != ndim:
    hint = ""
    if one_short:
      hint = (
        " It is one short: if this is a stacked variable, name the layer axis with "
        "metadata_params={'partition_name': 'layers'} on its scan/remat_scan/vmap "
        "(a name with no rule stays replicated)."
      )
    raise StateMismatchError(
      f"`{format_path(path)}` has sharding={sharding!r} for an array of shape "
      f"{tuple(np.shape(value))}: give one axis name (or None) per dimension.{hint}"
    )
  return PartitionSpec(*sharding)


def _check_rules(rules) -> list[tuple[str, tuple]]:
  checked = []
  for rule in rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise TransformError(
        f"logical_to_mesh: each rule is a (logical name, mesh axis) pair, got {rule!r}. "
        "Fix: e.g. rules=[('batch', 'data'), ('mlp', 'model'), ('embed', None)]."
      )
    name, axes = rule
    checked.append((name, _names(axes)))
  return checked


def _names(entry) -> tuple:
  """A spec entry, or a rule's mesh axes, as a tuple of names (None: no name)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _to_mesh(spec, rules) -> PartitionSpec:
  if not isinstance(spec, PartitionSpec):
    return spec
  used: set[str] = set()
  out = []
  for entry in spec:
    axes: list[str] = []
    for name in _names(entry):
      for logical, mesh_axes in rules:
        if logical == name and not used.intersection(mesh_axes):
          axes.extend(mesh_axes)
          used.update(mesh_axes)
          break
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return PartitionSpec(*out)


def _check_fits(path: tuple, value, spec: PartitionSpec, mesh) -> None:
  shape = np.shape(value)
  for dim, entry in enumerate(spec):
    axes = _names(entry)
    size = 1
    for axis in axes:
      if axis not in mesh.shape:
        raise StateMismatchError(
          f"`{format_path(path)}`: its spec {spec} names mesh axis {axis!r}, but the "
          f"mesh has {tuple(mesh.axis_names)}. Fix: map the logical name to one of "
          "those in the rules."
        )
      size *= mesh.shape[axis]
    if dim < len(shape) and shape[dim] % size:
      raise StateMismatchError(
        f"`{format_path(path)}`: dimension {dim} (size {shape[dim]}) does not divide "
        f"over mesh axes {axes} ({size} devices); shape {tuple(shape)}, spec {spec}. "
        "Fix: map that logical axis to a smaller mesh axis or None in the rules."
      )


def _check_trace_mesh(state: State, mesh) -> None:
  """Traced under explicit axes, the mesh is part of each array's type: the trace must
  run under that mesh (``jax.set_mesh``), or the program cannot be placed."""
  path = next(
    (p for p, v in zip(state._spec.paths, state._values) if isinstance(v, jax.core.Tracer)), None
  )
  if path is None or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return
  context = jax.sharding.get_abstract_mesh()
  if context != mesh.abstract_mesh:
    where = "no mesh" if context.empty else f"mesh {describe_mesh(context)}"
    raise StateMismatchError(
      f"sr.shard inside a traced function (sr.jit, a transform) on mesh "
      f"{describe_mesh(mesh)}, whose Explicit axes become part of each array's type "
      f"(`{format_path(path)}` first), but the trace runs under {where}. Fix: call "
      "the jitted function inside `with jax.set_mesh(mesh):` with this mesh, or "
      "call sr.shard(model, mesh, rules) outside it, before the step."
    )


def _place(value, sharding: NamedSharding):
  if isinstance(value, jax.core.Tracer):
    if _needs_reshard(sharding):
      # An explicit axis is part of the array's type: with_sharding_constraint only
      # asserts it, reshard changes it.
      return jax.sharding.reshard(value, sharding)
    return jax.lax.with_sharding_constraint(value, sharding)
  if isinstance(value, (jax.Array, np.ndarray)):
    return jax.device_put(value, sharding)
  return value  # a Python number in a Variable: nothing to place


def _needs_reshard(sharding: NamedSharding) -> bool:
  """Whether ``sharding``'s mesh has ``AxisType.Explicit`` axes (then even a replicated
  spec is part of the type) and its spec names no ``AxisType.Auto`` one."""
  kinds = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
  if jax.sharding.AxisType.Explicit not in kinds.values():
    return False
  return all(
    kinds[axis] != jax.sharding.AxisType.Auto for entry in sharding.spec for axis in _names(entry)
  )
