"""The modules that come out of ``sr.vmap`` (README.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core._errors import format_path
from ...core._filters import filter_repr
from ...core._graph import flatten, rewrite
from ...core._stacks import mark_frozen
from .._lift import is_node, lift, split_call
from .._outputs import ModulesOut, merge
from .._rules import STACKED, TransformError

_NO_ARGUMENTS = lift((), {})[0]  # the kernel's step for a function of no module
_MODULE = object()  # where a module sits in a result, while out_axes are read


def vmap_creating(
  fn, args, kwargs, stack_class, *, what, in_axes, out_axes, axis_size, axis_name, metadata_params
):
  """``sr.vmap(f)(*args)`` where no argument holds a module: ``jax.vmap(f)``, the modules
  ``f`` returns coming out as stacks of ``stack_class(Block, n, axis)``, the mapped axis
  where ``out_axes`` puts it (the "Deep stacks" guide)."""
  record: dict = {}

  def one(*call_args):
    out, _ = _NO_ARGUMENTS.run(lambda: fn(*call_args, **kwargs), [], [], what, copies=True)
    if type(out) is not ModulesOut:
      record["info"] = (None, jax.tree.structure(out), [], ())
      return [], out
    graphdef, treedef, positions, _, _ = out.info
    marked = merge(treedef, positions, [_MODULE] * len(positions), out.leaves)
    placed = [
      (path, axis) for path, leaf, axis in leaf_axes(out_axes, marked, what) if leaf is _MODULE
    ]
    record["info"] = (graphdef, treedef, placed, positions)
    # The modules leave as their Variables' values (mapped axis in front, moved after);
    # the rest keeps its structure, modules left out, so out_axes fits it as jax's.
    return out.values, jax.tree.map(lambda x: None if x is _MODULE else x, marked)

  ins = tuple(in_axes) if isinstance(in_axes, list) else in_axes
  try:
    values, rest = jax.vmap(
      one, in_axes=ins, out_axes=(0, out_axes), axis_size=axis_size, axis_name=axis_name
    )(*args)
  except ValueError as e:
    if isinstance(e, TransformError) or not any(
      word in str(e) for word in ("axis size", "axis_size", "in_axes")
    ):
      raise
    raise TransformError(
      f"{what}: {e} No argument holds a module, so this maps the function over its "
      "arguments as `jax.vmap` does (the modules it returns come out stacked). Fix "
      "in_axes, or pass `axis_size=` when nothing is mapped; to map a module's "
      "variables, argument 0 must be the module."
    ) from None
  graphdef, treedef, placed, positions = record["info"]
  others = jax.tree.leaves(rest)
  if not positions:
    return jax.tree.unflatten(treedef, others)
  n = jnp.shape(values[0])[0] if values else axis_size
  multi = len(placed) > 1
  axes = [
    _placed_axis(what, placed[path[0]] if multi else placed[0], path[1:] if multi else path, value)
    for path, value in zip(graphdef.var_paths, values)
  ]
  root_axes: dict = {}
  for path, axis in zip(graphdef.var_paths, axes):
    root_axes.setdefault(path[0] if multi else 0, axis)
  values = [jnp.moveaxis(v, 0, axis) for v, axis in zip(values, axes)]
  out = ModulesOut(others, values, (graphdef, treedef, positions, 0, 0))
  root_axis = lambda j: root_axes.get(j, 0)  # noqa: E731
  return _restacked(out, axes, root_axis, n, stack_class, metadata_params).rebuild()


def leaf_axes(out_axes, out, what: str | None = None) -> list:
  """``(path, leaf, axis)`` for each leaf of ``out`` (modules and Variables as leaves),
  ``axis`` its ``out_axes`` entry. A misfit raises a TransformError naming ``what``, or
  without it the ValueError of ``jax.tree``."""
  found: list = []

  def add(path, axis, sub):
    for inner, leaf in jax.tree_util.tree_leaves_with_path(sub, is_leaf=is_node):
      found.append((path + inner, leaf, axis))

  try:
    jax.tree_util.tree_map_with_path(add, out_axes, out, is_leaf=lambda x: x is None)
  except ValueError as e:
    if what is None:
      raise
    raise TransformError(
      f"{what}: out_axes={out_axes!r} is not a prefix of the function's output "
      f"({jax.tree_util.tree_structure(out, is_leaf=is_node)}): {e} Fix: give one "
      "axis (e.g. `out_axes=0`), or a tuple / dict shaped like the output."
    ) from None
  return found


def _placed_axis(what, placed, var_path, value) -> int:
  """Where ``placed`` (output path, axis) puts a made Variable's mapped axis, non-negative."""
  path, axis = placed
  where = f"the output `{jax.tree_util.keystr(path)}`" if path else "the output"
  ndim = jnp.ndim(value)
  if axis is None:
    raise TransformError(
      f"{what}: {where} is a module made inside the function, and out_axes gives it "
      "None (not mapped), but each index builds its own, so it comes out as a stack "
      "along the mapped axis. Fix: give it an axis (`out_axes=0` puts the layer axis "
      "in front)."
    )
  if not isinstance(axis, int) or not -ndim <= axis < ndim:
    raise TransformError(
      f"{what}: out_axes puts the mapped axis of {where} at {axis!r}, but its "
      f"Variable `{format_path(var_path)}` has {ndim} axes with it (shape "
      f"{tuple(jnp.shape(value))}, mapped axis in front). Fix: give an axis in "
      f"{-ndim}..{ndim - 1}."
    )
  return axis % ndim


def check_returned_inputs(what, out, out_axes, module, treatment, values) -> None:
  """Raises where ``out_axes`` would move a returned module argument's mapped axis."""
  if not any(map(is_node, jax.tree.leaves(out, is_leaf=is_node))):
    return
  rebuilt = flatten(split_call((module,), {})[0])[1]
  try:
    found = leaf_axes(out_axes, out)
  except ValueError:
    return  # out_axes does not fit the output: jax.vmap says so
  index = {id(v): i for i, v in enumerate(rebuilt)}
  for path, leaf, axis in found:
    if not is_node(leaf):
      continue
    graphdef, variables = flatten([leaf])
    for var_path, var in zip(graphdef.var_paths, variables):
      i = index.get(id(var))
      if i is None or treatment.kinds[i] != STACKED:
        continue
      ndim = jnp.ndim(values[i])
      mapped = treatment.axes[i] % ndim
      if isinstance(axis, int) and -ndim <= axis < ndim and axis % ndim == mapped:
        continue
      at = jax.tree_util.keystr(path)
      full = at + ("." if at else "") + format_path(var_path) if var_path else at
      also = (
        f"map the Variable along axis {axis} on the way in too (`variable_axes="
        f"{{{filter_repr(type(var))}: {axis}}}`), "
        if isinstance(axis, int) and -ndim <= axis < ndim
        else ""
      )
      raise TransformError(
        f"{what}: the function returns `{full or '<root>'}` "
        f"({type(var).__name__}, shape {tuple(jnp.shape(values[i]))}) of its module "
        f"argument, where out_axes puts the mapped axis at {axis!r}, but "
        f"variable_axes maps that Variable along axis {mapped}. A module passed in "
        "comes back as the caller's own object, laid out as variable_axes maps it, "
        "so out_axes cannot move its axis (nnx: inconsistent aliasing). Nothing was "
        f"changed. Fix: give {f'the output `{at}`' if at else 'that output'} "
        f"`out_axes={mapped}`, {also}or do not return the module (the caller holds "
        "it already)."
      )


def stacked_outputs(
  what, out: ModulesOut, n: int, stack_class, metadata_params, out_axes
) -> ModulesOut:
  """``out`` with the Variables made inside marked as stacked at ``out_axes`` and each
  module made inside of its stacked class (unchanged for ``out_axes=None``)."""
  if out_axes is None:
    return out
  graphdef, treedef, positions, n_roots, n_variables = out.info
  axes = [
    _placed_axis(what, ((), out_axes), path, value)
    for path, value in zip(graphdef.var_paths[n_variables:], out.values)
  ]
  root_axis = lambda _: axes[0] if axes else 0  # noqa: E731
  return _restacked(out, axes, root_axis, n, stack_class, metadata_params)


def _restacked(out: ModulesOut, axes, root_axis, n, stack_class, metadata_params) -> ModulesOut:
  """``out`` with the Variables made inside marked as stacked at ``axes`` and each module
  made inside (root ``j``) of ``stack_class``, its layer axis ``root_axis(j)``."""
  graphdef, treedef, positions, n_roots, n_variables = out.info
  name = (metadata_params or {}).get("partition_name")
  classes = {
    j: stack_class(root.type, n, root_axis(j))
    for j, root in enumerate(graphdef.nodes)
    if j >= n_roots and root.kind == "module" and n is not None
  }
  graphdef = rewrite(
    graphdef,
    root_classes=classes,
    metadata=lambda i, m: mark_frozen(m, axes[i - n_variables], name) if i >= n_variables else m,
  )
  return ModulesOut(out.leaves, out.values, (graphdef, treedef, positions, n_roots, n_variables))
