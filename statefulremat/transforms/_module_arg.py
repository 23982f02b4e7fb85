"""Argument 0 of scan, remat_scan and vmap (modules nowhere else) and their layer count."""

from __future__ import annotations

import jax
import jax.core

from ..core._errors import GraphError, format_path
from ..core._filters import filter_repr
from ..core._graph import flatten
from ..core._stacks import axis_size, is_stacked, layer_axis, stack_info
from ._lift import Lifted, is_node, refuse_layer_list, split_call
from ._rules import STACKED, Rules, TransformError, Treatment
from ._stacked import layer_view


def lift_module_arg(
  module, what: str, rules: Rules, metadata_params, call_form: str, *, pattern: bool = False
):
  """Lifts argument 0 (``pattern``: a cycle): ``(lifted, variables, treatment, leaves)``."""
  nodes, leaves, treedef, positions = split_call((module,), {})
  if not nodes:
    raise TypeError(
      f"{what}: argument 0 must be the module (or a pytree of modules), got "
      f"{type(module).__name__}. The function is called as {call_form}."
    )
  graphdef, variables = flatten(nodes)
  treatment = Treatment(
    rules,
    graphdef,
    variables,
    nodes,
    display_path=(lambda p: ("pattern", *p)) if pattern else None,
    rules_path=(lambda p: p) if pattern else None,
  )
  check_stacks_sliced(nodes, graphdef, variables, treatment, what, pattern=pattern)
  inner = layer_view(graphdef, treatment, metadata_params)
  return Lifted(inner, treedef, positions), variables, treatment, leaves


def check_stacks_sliced(
  nodes, graphdef, variables, treatment: Treatment, what: str, *, pattern: bool = False
) -> None:
  """Raises if a stacked module's layer axis is not sliced per iteration by ``treatment``."""
  if not any(map(is_stacked, nodes)):
    return
  multi = len(nodes) > 1
  for i, (path, var) in enumerate(zip(graphdef.var_paths, variables)):
    root = nodes[path[0]] if multi else nodes[0]
    found = layer_axis(var) if is_stacked(root) else None
    if found is None or (treatment.kinds[i], treatment.axes[i]) == (STACKED, found[0]):
      continue
    axis, path, stack_cls = found[0], path[1:] if multi else path, type(root)
    got = (
      f"slice it along axis {treatment.axes[i]}"
      if treatment.kinds[i] == STACKED
      else f"treat it as {treatment.kinds[i]}"
    )
    where = (
      f"`{format_path(treatment.display_path(graphdef.var_paths[i]))}` ({type(var).__name__}) "
      f"of the pattern stack's position {graphdef.var_paths[i][0]}, a stacked "
      f"{stack_cls.__name__},"
      if pattern
      else f"`{format_path(path)}` ({type(var).__name__}) of the stacked {stack_cls.__name__}"
    )
    raise TransformError(
      f"{what}: {where} carries the layer axis (axis {axis}, {axis_size(var._value, axis)} "
      f"layers), but this transform's rules {got}, so every iteration would compute with "
      "the whole stack where one layer was meant. Fix: slice it per layer, e.g. "
      f"`variable_axes={{{filter_repr(type(var))}: {axis}}}` (collection "
      f"{var.collection!r}), or pass one layer (`stack.layer(i)`)."
      f"{_class_rules_hint(stack_cls, path, var, axis)}"
    )


def _class_rules_hint(stack_cls: type, path: tuple, var, axis: int) -> str:
  """Where the stack's own class form does not slice ``var`` either: build it with the rule."""
  rules = getattr(stack_info(stack_cls), "rules", None)
  if not isinstance(rules, Rules) or rules.classify(path, var)[0] == STACKED:
    return ""
  kind = filter_repr(type(var))
  return (
    f" Calling the stack runs {stack_cls.__name__}'s own rules, those of the "
    f"class form that built it: build the class with the rule (add `{kind}: "
    f"{axis}` to its variable_axes, or use `{{True: {axis}}}`) and move the "
    "values over with `stack = sr.stack(sr.unstack(stack), like=NewClass)`."
  )


def check_loop_call(what: str, call: str, module, carry, args, kwargs, xs: str = "extra") -> None:
  """Refuses a list of layers as argument 0 (``call``: the right call), modules after it."""
  refuse_layer_list(module, what, call)
  check_no_modules(carry, what, "the carry")
  check_no_modules(args, what, f"the {xs} argument")
  check_no_modules(kwargs, what, "the keyword argument")


def check_no_modules(tree, what: str, label: str, *, first: int | None = None) -> None:
  """Raises if ``tree`` (``first``: positional arguments from ``first`` on) holds a module."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_node):
    if not is_node(leaf):
      continue
    if first is None:
      where = f"{label} `{jax.tree_util.keystr(path)}`"
    else:
      inner = jax.tree_util.keystr(path[1:])
      where = f"{label} {first + path[0].idx}" + (f" at `{inner}`" if inner else "")
    raise GraphError(
      f"{what}: {where} is a {type(leaf).__name__}. Modules go in argument 0 only: "
      "a transform maps or broadcasts a module's Variables by its collection rules "
      "(variable_axes, variable_broadcast, variable_carry), not by in_axes, so a "
      "module anywhere else could be given two treatments at once. Nothing was run. "
      "Fix: pass every module in argument 0 (a tuple or dict of modules is fine "
      "there, e.g. `f((model, other), x)`) and say how its Variables map with "
      "the rules."
    )


def class_length(module) -> int | None:
  """The layer count a stacked module's class was built with (None for a function)."""
  info = stack_info(module) if is_stacked(module) else None
  return None if info is None else info.length


def resolve_length(what: str, sources: list[tuple[str, int]], fallback: int | None = None) -> int:
  """The iteration count all ``(description, size)`` sources agree on, else ``fallback``."""
  if not sources and fallback is not None:
    return fallback
  if not sources:
    raise TransformError(
      f"{what}: cannot tell how many iterations to run: nothing is scanned (no xs, no "
      "stacked variables). Pass `length=`."
    )
  name0, n0 = sources[0]
  for name, n in sources[1:]:
    if n != n0:
      raise TransformError(
        f"{what}: {name0} says {n0} iterations but {name} has {n}. All scanned inputs "
        "and stacked variables must agree on the layer count."
      )
  return n0


def stacked_sources(treatment: Treatment, lifted: Lifted, variables) -> list[tuple[str, int]]:
  out = []
  for i, (kind, axis) in enumerate(zip(treatment.kinds, treatment.axes)):
    if kind == STACKED:
      assert axis is not None  # a stacked variable has its layer axis
      path = format_path(treatment.display_path(lifted.graphdef.var_paths[i]))
      out.append(
        (f"the stacked variable `{path}` (axis {axis})", axis_size(variables[i]._value, axis))
      )
  return out
