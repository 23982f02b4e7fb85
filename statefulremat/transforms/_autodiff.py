"""sr.grad / sr.value_and_grad: gradients with respect to a module's variables."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Literal, TypedDict, TypeVar, Unpack, overload

import jax
import jax.numpy as jnp

from ..core._errors import format_path
from ..core._filters import Filter, collections_and_guess, filter_repr, to_predicate
from ..core._graph import flatten
from ..core._kinds import Param
from ..core._module import Module
from ..core._state import State, freeze
from ._class_form import M, P, R
from ._lift import Lifted, check_no_nodes, commit, held, split_call
from ._outputs import Restructured, describe_returned
from ._rules import TransformError

Aux = TypeVar("Aux")


class _Options(TypedDict, total=False):
  """The keywords of ``value_and_grad`` and ``grad``, for their overloads."""

  wrt: Filter
  has_aux: bool


# The types: argnums=0 with a module there gives a State; other argnums are typed Any.
@overload
def value_and_grad(
  fn: Callable[Concatenate[M, P], R], argnums: Literal[0] = 0, **options: Unpack[_Options]
) -> Callable[Concatenate[M, P], tuple[R, State]]: ...
@overload
def value_and_grad(
  fn: Callable[P, R], argnums: int | Sequence[int] = 0, **options: Unpack[_Options]
) -> Callable[P, tuple[R, Any]]: ...
def value_and_grad(
  fn: Callable[..., Any],
  argnums: int | Sequence[int] = 0,
  *,
  wrt: Filter = Param,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``; a module argument's gradient is a State.

  Args:
    fn: the function to differentiate, returning a scalar loss (``(loss, aux)`` with
      ``has_aux=True``).
    argnums: the position(s) of the arguments to differentiate (default ``0``). A module
      there gets a ``State`` with the paths of ``sr.state(module, wrt)``, a list, tuple
      or dict of modules a State per module, other arguments ordinary gradients.
    wrt: a filter choosing the variables of the modules at ``argnums`` to differentiate
      (default ``sr.Param``): at least one, only float arrays.
    has_aux: whether ``fn`` returns ``(loss, aux)``, only ``loss`` differentiated
      (default ``False``).

  Returns:
    A function taking ``fn``'s arguments and returning ``(value, grads)``: ``fn``'s
    result and the gradient of the argument at ``argnums`` (a tuple of them for a
    sequence). Other changes to the modules are written back as ``sr.jit`` writes them.

  Raises:
    TypeError: at call, ``argnums`` names a position the call does not have; ``wrt``
      matches a variable that is not a float array; ``fn`` returns a tuple, list or dict
      without ``has_aux=True``, or not a pair with it.
    sr.TransformError: ``wrt`` matches no variable of a module at ``argnums``.
    sr.GraphError: ``fn`` returns a module or a Variable.
    sr.TraceContextError: the call runs inside a plain JAX transform that closes over the
      module, so its new values would leak that transform's tracers.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> model = sr.nn.Linear(2, 1, rngs=sr.Rngs(0))
  >>> def loss(model, x):
  ...   return (model(x) ** 2).mean()
  >>> value, grads = sr.value_and_grad(loss)(model, jnp.ones((4, 2)))
  >>> sorted(grads.flat()), grads["kernel"].shape
  ([('bias',), ('kernel',)], (2, 1))
  """
  single = isinstance(argnums, int)
  targets = (argnums,) if single else tuple(argnums)
  predicate = to_predicate(wrt)
  what = f"sr.grad({getattr(fn, '__name__', 'fn')})"

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if any(t >= len(args) for t in targets):
      raise TypeError(
        f"{what}: argnums={argnums} but only {len(args)} positional arguments were given."
      )
    if any(_module_container(args[t]) for t in targets):
      return _through_containers(fn, args, kwargs, targets, single, wrt, has_aux)
    module_targets = {t for t in targets if isinstance(args[t], Module)}
    array_targets = [t for t in targets if t not in module_targets]
    array_args = tuple(args[t] for t in array_targets)
    args = tuple(None if t in array_targets else a for t, a in enumerate(args))
    nodes, leaves, treedef, positions = split_call(args, kwargs)
    # Walk the differentiated modules first, so a variable they share with another
    # argument (an Optimizer holding the model) is reached, and named, through them.
    first = {id(args[t]) for t in module_targets}
    order = sorted(range(len(nodes)), key=lambda i: id(nodes[i]) not in first)
    nodes = [nodes[i] for i in order]
    positions = tuple(positions[i] for i in order)
    graphdef, variables = flatten(nodes)
    lifted = Lifted(graphdef, treedef, positions)
    ids = [id(n) for n in nodes]
    target_roots = {ids.index(id(args[t])): t for t in module_targets}
    diff_index = _differentiated(graphdef, variables, target_roots, len(nodes) > 1, predicate)
    for t in module_targets:
      if not diff_index.get(t):
        _nothing_to_differentiate(what, wrt, t, args[t])
    diffed = {i for entries in diff_index.values() for i, _ in entries}
    with held(variables):
      values = [v._value for v in variables]
      _refuse_non_float(what, diff_index, variables, values)

      def pure(diff_values, array_values, other_values):
        flat = list(other_values)
        for t in module_targets:
          for (i, _), value in zip(diff_index[t], diff_values[t]):
            flat[i] = value

        def call(*call_args, **call_kwargs):
          call_args = list(call_args)
          for t, value in zip(array_targets, array_values):
            call_args[t] = value
          return fn(*call_args, **call_kwargs)

        out, changes = lifted.run(call, flat, leaves, what, restructure=True)
        loss, aux = _loss_and_aux(out, has_aux, what)
        if changes.structure is not None:  # a sow, a new sub-module: carried out after
          aux = Restructured(aux, changes.made, changes.structure)
        return loss, (aux, changes.values)

      diff_values = {t: [values[i] for i, _ in diff_index[t]] for t in module_targets}
      others = [None if i in diffed else v for i, v in enumerate(values)]
      (loss, (aux, changed)), (g_mod, g_arr) = jax.value_and_grad(
        pure, argnums=(0, 1), has_aux=True
      )(diff_values, array_args, others)
      aux = commit(variables, changed, what, aux, nodes=nodes)

    grads = [
      _as_state(diff_index[t], variables, g_mod[t])
      if t in module_targets
      else g_arr[array_targets.index(t)]
      for t in targets
    ]
    grads = grads[0] if single else tuple(grads)
    return ((loss, aux) if has_aux else loss), grads

  return wrapper


def _differentiated(graphdef, variables, target_roots: dict, multi: bool, predicate) -> dict:
  """``{argument: [(flat index, local path), ...]}``: each module argument's Variables."""
  found: dict = {t: [] for t in target_roots.values()}
  for i, (path, var) in enumerate(zip(graphdef.var_paths, variables)):
    root, local = (path[0], path[1:]) if multi else (0, path)
    t = target_roots.get(root)
    if t is not None and predicate(local, var):
      found[t].append((i, local))
  return found


def _loss_and_aux(out, has_aux: bool, what: str) -> tuple:
  """``(loss, aux)`` of what the function returned, which must fit ``has_aux``."""
  if has_aux:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
        f"{what}: has_aux=True needs the function to return a pair "
        f"(loss, aux), got {describe_returned(out)}. Return `loss, aux`, or drop "
        "has_aux=True if there is no aux."
      )
    loss, aux = out
  elif isinstance(out, (tuple, list, dict)):
    raise TypeError(
      f"{what}: the function returned {describe_returned(out)}, "
      "not a scalar loss. If it returns `(loss, aux)`, pass `has_aux=True`: "
      f"`sr.value_and_grad(fn, has_aux=True)` gives `(loss, aux), grads`."
    )
  else:
    loss, aux = out, None
  check_no_nodes(aux, what)
  return loss, aux


def _refuse_non_float(what: str, diff_index: dict, variables, values) -> None:
  """Raises if a differentiated Variable holds a leaf that is not a float array."""
  for entries in diff_index.values():
    for i, local in entries:
      value = values[i]
      for leaf in (value,) if hasattr(value, "dtype") else jax.tree.leaves(value):
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
          raise TypeError(
            f"{what}: the `wrt` filter matches `{format_path(local)}` "
            f"({type(variables[i]).__name__}, {dtype}), which is not a float array "
            "and has no gradient. Narrow the filter to the variables to "
            "differentiate, e.g. `wrt=sr.Param`."
          )


def _as_state(entries: list, variables, grads: list) -> State:
  """The gradients of one module argument as a State of its local paths."""
  return State.from_parts(
    [p for _, p in entries],
    [type(variables[i]) for i, _ in entries],
    [freeze(variables[i]._metadata) for i, _ in entries],
    grads,
  )


def _module_container(arg) -> bool:
  """A list, tuple or dict (nested) whose leaves are all modules: ``[block, block]``."""
  if isinstance(arg, Module) or not isinstance(arg, (list, tuple, dict)):
    return False
  leaves = jax.tree.leaves(arg, is_leaf=lambda x: isinstance(x, Module))
  return bool(leaves) and all(isinstance(x, Module) for x in leaves)


def _through_containers(fn, args, kwargs, targets, single, wrt, has_aux):
  """``value_and_grad`` with each module of a container argument an argument of its own."""
  flat_args, spans, treedefs = [], [], []
  for p, arg in enumerate(args):
    container = p in targets and _module_container(arg)
    parts, treedef = jax.tree.flatten(arg, is_leaf=lambda x: not container or isinstance(x, Module))
    spans.append(range(len(flat_args), len(flat_args) + len(parts)))
    treedefs.append(treedef)
    flat_args.extend(parts)

  def regroup(flat, positions) -> list:
    return [jax.tree.unflatten(treedefs[p], [flat[i] for i in spans[p]]) for p in positions]

  def flat_fn(*flat, **kw):
    return fn(*regroup(flat, range(len(args))), **kw)

  functools.update_wrapper(flat_fn, fn)
  flat_targets = tuple(i for t in targets for i in spans[t])
  value, grads = value_and_grad(flat_fn, flat_targets, wrt=wrt, has_aux=has_aux)(
    *flat_args, **kwargs
  )
  out = regroup(dict(zip(flat_targets, grads)), targets)
  return value, out[0] if single else tuple(out)


def _nothing_to_differentiate(what: str, wrt, position: int, module) -> None:
  have, guess = collections_and_guess((wrt,), module.iter_variables())
  hint = f" Did you mean `wrt={guess!r}`?" if guess else ""
  raise TransformError(
    f"{what}: wrt={filter_repr(wrt)} matches no variable of argument {position} (a "
    f"{type(module).__name__}), so there is nothing to differentiate and the gradient "
    f"would be an empty State. Its variables are in the collections: {have}.{hint} "
    "Fix: pass a filter that matches the variables to differentiate, e.g. "
    "`wrt=sr.Param` (the default) or `wrt='params'`."
  )


@overload
def grad(
  fn: Callable[Concatenate[M, P], Any],
  argnums: Literal[0] = 0,
  *,
  wrt: Filter = Param,
  has_aux: Literal[False] = False,
) -> Callable[Concatenate[M, P], State]: ...
@overload
def grad(
  fn: Callable[Concatenate[M, P], tuple[Any, Aux]],
  argnums: Literal[0] = 0,
  *,
  wrt: Filter = Param,
  has_aux: Literal[True],
) -> Callable[Concatenate[M, P], tuple[State, Aux]]: ...
@overload
def grad(
  fn: Callable[P, Any], argnums: int | Sequence[int] = 0, **options: Unpack[_Options]
) -> Callable[P, Any]: ...
def grad(
  fn: Callable[..., Any],
  argnums: int | Sequence[int] = 0,
  *,
  wrt: Filter = Param,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """Like ``jax.grad``; a module argument's gradient is a State (see ``value_and_grad``).

  Args:
    fn: the function to differentiate, returning a scalar loss (or ``(loss, aux)``).
    argnums: the position(s) of the arguments to differentiate (default ``0``).
    wrt: a filter choosing the modules' variables to differentiate (default ``sr.Param``).
    has_aux: whether ``fn`` returns ``(loss, aux)`` (default ``False``).

  Returns:
    A function taking ``fn``'s arguments and returning ``grads`` (``(grads, aux)`` with
    ``has_aux=True``); it raises as ``sr.value_and_grad``'s does.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> model = sr.nn.Linear(2, 1, rngs=sr.Rngs(0))
  >>> grads = sr.grad(lambda m, x: m(x).sum())(model, jnp.ones((3, 2)))
  >>> grads["bias"].tolist()
  [3.0]
  """
  vg = value_and_grad(fn, argnums, wrt=wrt, has_aux=has_aux)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    value, grads = vg(*args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return wrapper
