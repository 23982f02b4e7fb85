"""``sr.saved_residuals``: what reverse-mode autodiff of a function of modules keeps."""

from __future__ import annotations

import inspect
import os
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import Jaxpr, Literal

from ...core._errors import format_path
from ...core._filters import Filter, to_predicate
from ...core._kinds import Param
from ...core._module import Module
from .._class_form import display_name
from .._lift import check_no_nodes, is_node, lift
from ._jaxpr_reading import (
  STACK_CARRY,
  called_body,
  checkpoint_name_of,
  is_offload_copy,
  reduce_precision_primitive,
)

_PACKAGE = str(pathlib.Path(__file__).resolve().parent.parent) + os.sep


class Residual(NamedTuple):
  """One array that reverse-mode autodiff keeps: its ``checkpoint_name`` (or None), shape,
  dtype, ``source`` (the user's ``file:line (function)``, or the input it is), ``op``
  (None for an input) and whether it is ``offloaded`` to host memory."""

  name: str | None
  shape: tuple[int, ...]
  dtype: np.dtype
  source: str
  op: str | None = None
  offloaded: bool = False

  def __str__(self) -> str:
    aval = f"{self.dtype}[{','.join(map(str, self.shape))}]"
    where = " (offloaded to host)" if self.offloaded else ""
    if self.name is not None:
      return f"{aval} named {self.name!r}{where} from {self.source}"
    if self.op is not None:
      return f"{aval} output of {self.op}{where} from {self.source}"
    return f"{aval}{where} from {self.source}"


def saved_residuals(fn: Callable, *args, wrt: Filter = Param, **kwargs) -> list[Residual]:
  """What reverse-mode autodiff of ``fn(*args, **kwargs)`` saves for the backward pass.

  As ``jax.ad_checkpoint.print_saved_residuals``, for functions of modules; nothing is
  computed and the modules are left unchanged.

  Args:
    fn: a function taking modules like ``sr.grad``'s functions (anywhere in its
      arguments), or a module (``sr.saved_residuals(model, x)`` for ``model(x)``).
    *args: ``fn``'s positional arguments; the gradient is taken with respect to every
      floating-point array among them.
    wrt: a filter choosing the modules' variables the gradient is taken with respect to
      (default ``sr.Param``; only float ones count).
    **kwargs: ``fn``'s keyword arguments.

  Returns:
    The residuals of that ``jax.vjp``, a list of ``Residual`` records ``(name, shape,
    dtype, source, op)``, ``print``-able one per line.

  Raises:
    sr.GraphError: ``fn`` returns a module or a Variable, or its modules cannot be
      lifted (an array held outside any Variable).

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> from jax.ad_checkpoint import checkpoint_name
  >>> model = sr.nn.Linear(4, 4, rngs=sr.Rngs(0))
  >>> def block(model, x):
  ...   h = checkpoint_name(jnp.sin(model(x)), "h")
  ...   return jnp.sum(jnp.sin(h))
  >>> def saved(policy):
  ...   res = sr.saved_residuals(sr.remat(block, policy=policy), model, jnp.ones((2, 4)))
  ...   return [(r.name, r.shape) if r.name else (r.source.split(" ")[0], r.shape)
  ...           for r in res]
  >>> saved(jax.checkpoint_policies.nothing_saveable)   # only the inputs
  [('Param', (4,)), ('Param', (4, 4)), ('argument', (2, 4))]
  >>> saved(jax.checkpoint_policies.save_only_these_names("h"))   # and 'h'
  [('Param', (4,)), ('Param', (4, 4)), ('argument', (2, 4)), ('h', (2, 4))]
  """
  if isinstance(fn, Module):  # a module is its own function: model(x)
    fn, args = type(fn).__call__, (fn, *args)
  what = f"sr.saved_residuals({display_name(fn)})"
  predicate = to_predicate(wrt)
  lifted, variables, leaves, nodes = lift(args, kwargs)
  graphdef, positions = lifted.graphdef, lifted.node_positions
  described = _argument_names(fn, args, kwargs)
  node_names = [described[p] for p in positions]
  at_nodes = set(positions)
  leaf_names = [d for i, d in enumerate(described) if i not in at_nodes]

  # Differentiated: the float Variables that `wrt` matches and the float arrays.
  multi = len(nodes) > 1
  inputs = []  # (description, value, differentiated)
  for path, var in zip(graphdef.var_paths, variables):
    root, local = (path[0], path[1:]) if multi else (0, path)
    where = f"{node_names[root]}.{format_path(local)}" if local else node_names[root]
    diff = bool(predicate(local, var)) and _is_float(var._value)
    inputs.append((f"{type(var).__name__} `{where}`", var._value, diff))
  traced_leaves = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]
  for i in traced_leaves:
    inputs.append((f"argument `{leaf_names[i]}`", leaves[i], _is_float(leaves[i])))
  n_vars = len(variables)

  def pure(diff_values, other_values):
    given = {True: iter(diff_values), False: iter(other_values)}
    flat = [next(given[diff]) for _, _, diff in inputs]
    call_leaves = list(leaves)
    for i, value in zip(traced_leaves, flat[n_vars:]):
      call_leaves[i] = value
    # What the function writes or adds is measured, never kept: the changes are dropped.
    out, _ = lifted.run(fn, flat[:n_vars], call_leaves, what, restructure=True)
    check_no_nodes(out, what)
    return out

  diff_values = [value for _, value, diff in inputs if diff]
  other_values = [value for _, value, diff in inputs if not diff]
  residuals_of = lambda d, o: jax.tree.leaves(jax.vjp(lambda d: pure(d, o), d)[1])
  jaxpr = jax.make_jaxpr(residuals_of)(diff_values, other_values).jaxpr
  # The inputs as the jaxpr takes them, differentiated first; a Variable may hold a pytree
  # (a tuple of arrays): its leaves share its description.
  ordered = sorted(inputs, key=lambda entry: not entry[2])
  names = [description for description, value, _ in ordered for _ in jax.tree.leaves(value)]
  return _classify(jaxpr, names)


def _is_float(value) -> bool:
  leaves = jax.tree.leaves(value)
  return bool(leaves) and all(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf in leaves)


def _argument_names(fn, args: tuple, kwargs: dict) -> list[str]:
  """How each leaf of ``(args, kwargs)`` (modules as leaves) is called: ``x[0]``."""
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    params = []
  kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  positional = [p.name for p in params if p.kind in kinds]
  names = []
  for path, _ in jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_node)[0]:
    where, index, rest = path[0].idx, path[1], path[2:]
    if where == 0:
      i = index.idx
      base = positional[i] if i < len(positional) else f"args[{i}]"
    else:
      base = str(index.key)
    names.append(base + jax.tree_util.keystr(rest))
  return names


def _classify(jaxpr: Jaxpr, input_names: list[str]) -> list[Residual]:
  """One record per distinct residual (``jaxpr``'s outputs), in JAX's order."""
  producers = _producers(jaxpr)
  offloaded = set()  # an offloaded residual is the host copy of a value: described as it
  wanted = {}  # each residual once, in order: literals by identity
  for v in jaxpr.outvars:
    v, copied = _looked_through(v, producers)
    if copied:
      offloaded.add(v)
    wanted.setdefault(id(v) if isinstance(v, Literal) else v, v)
  records = [_record(v.aval, None, "a literal") for v in wanted.values() if isinstance(v, Literal)]
  variables = {v for v in wanted.values() if not isinstance(v, Literal)}
  records += [_record(v.aval, None, "a constant") for v in jaxpr.constvars if v in variables]
  records += [
    _record(v.aval, None, input_names[i], offloaded=v in offloaded)
    for i, v in enumerate(jaxpr.invars)
    if v in variables
  ]
  for eqn in jaxpr.eqns:
    for k, v in enumerate(eqn.outvars):
      if v in variables:
        name, op, source, moved_inside = _origin(eqn, k)
        records.append(_record(v.aval, name, source, op, v in offloaded or moved_inside))
  return records


def _producers(jaxpr: Jaxpr) -> dict[Any, tuple[Any, int]]:
  """``{var: (eqn, k)}``: the equation whose output ``k`` each variable is."""
  return {out: (e, k) for e in jaxpr.eqns for k, out in enumerate(e.outvars)}


def _looked_through(v, producers: dict) -> tuple[Any, bool]:
  """``v`` past remat's ``reduce_precision`` and offload copies; whether one was a copy."""
  rounding_p = reduce_precision_primitive()
  offloaded = False
  while not isinstance(v, Literal) and v in producers:
    eqn = producers[v][0]
    copy = is_offload_copy(eqn)
    if not copy and eqn.primitive is not rounding_p:
      break
    offloaded |= copy
    v = eqn.invars[0]
  return v, offloaded


def _record(aval, name, source, op=None, offloaded=False) -> Residual:
  return Residual(name, tuple(aval.shape), aval.dtype, source, op, offloaded)


def _origin(eqn, k: int, depth: int = 0) -> tuple[str | None, str | None, str, bool]:
  """``(name, op, source, offloaded)`` of output ``k`` of ``eqn``, traced into bodies."""
  name = checkpoint_name_of(eqn)
  if name == STACK_CARRY:  # named by the library, where no line of the user's is
    return name, None, "each step's input carry (carries='offload')", False
  if name is not None:
    return name, None, _where(eqn), False
  body = called_body(eqn)
  if body is not None and depth < 16:
    producers = _producers(body)
    v, offloaded = _looked_through(body.outvars[k], producers)
    if not isinstance(v, Literal) and v in producers:
      name, op, source, inner = _origin(*producers[v], depth + 1)
      return name, op, source, offloaded or inner
  op = eqn.primitive.name
  if op in ("jit", "pjit"):
    op = f"jit({eqn.params.get('name', '?')})"
  return None, op, _where(eqn), False


def _where(eqn) -> str:
  """``file:line (function)`` of the innermost frame outside JAX and statefulremat."""
  lines = source_info_util.summarize(eqn.source_info, num_frames=64).splitlines()
  return next(
    (line for line in reversed(lines) if not line.startswith(_PACKAGE)),
    lines[-1] if lines else "unknown",
  )
