"""sr.vmap's refusals: a plain module's Variable mapped by the default rule, and a
write to an unmapped Variable that depends on the mapped axis."""

from __future__ import annotations

import jax.numpy as jnp

from ...core._errors import format_path
from ...core._filters import filter_repr
from ...core._stacks import layer_axis
from .._rules import TransformError


def refuse_mapping_plain(what, lifted, treatment, variables, stacked) -> None:
  """Raises if the default ``variable_axes`` would map a Variable with no layer axis,
  handing each example one row of a parameter (wrong numbers of the right shape)."""
  for i in stacked:
    var = variables[i]
    if layer_axis(var) is not None:
      continue
    path = format_path(treatment.display_path(lifted.graphdef.var_paths[i]))
    kind = filter_repr(type(var))
    raise TransformError(
      f"{what}: `{path}` ({type(var).__name__}, shape {tuple(jnp.shape(var._value))}) belongs to a "
      "plain module and carries no layer axis, but the default variable_axes="
      "{True: 0} would map its axis 0 alongside the inputs, giving each example one "
      "slice of it. Nothing was run. Fix: to apply the same module to every example, "
      "pass `variable_broadcast=True` (read-only; or e.g. "
      f"`variable_broadcast={kind}`); for an ensemble of independently initialised "
      "modules, build it with the class form (`sr.vmap(Block, axis_size=n)(...)`) or "
      "`sr.stack(layers)`; to map this variable on purpose, give the rule explicitly "
      f"(`variable_axes={{{kind}: 0}}`)."
    )


def refuse_shared_write(what, lifted, variables, written) -> None:
  names = []
  for i in written:
    var = variables[i]
    path = var.path_str() or format_path(lifted.graphdef.var_paths[i])
    names.append(f"`{path}` ({type(var).__name__}, collection {var.collection!r})")
  var = variables[written[0]]
  also = f" (it also wrote to {', '.join(names[1:])})" if len(names) > 1 else ""
  raise TransformError(
    f"{what}: the function wrote to {names[0]}, which is not mapped (broadcast or "
    f"matched by no rule){also}, and a value written depends on the mapped axis, so "
    "each layer's write may differ. Nothing was written. (A write that does not depend "
    "on it, e.g. a step counter, is kept: the caller sees the one value.) Fix: map it "
    "with "
    f"`variable_axes={{{var.collection!r}: 0}}`, or write a value that does not "
    "depend on the mapped inputs."
  ) from None
