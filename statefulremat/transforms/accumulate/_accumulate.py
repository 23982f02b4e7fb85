"""sr.accumulate: gradient accumulation over microbatches, every state write kept."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ...core._errors import TransformError, format_path
from .._class_form import display_name
from .._lift import Lifted, check_no_nodes, commit, held, is_node, lift, serialised
from .._module_arg import check_no_modules
from .._outputs import describe_returned
from ._microbatches import split_rows


def accumulate(fn: Callable, *, microbatches: int) -> Callable:
  """Gradient accumulation: ``fn`` run on ``microbatches`` slices of the batch, averaged.

  Args:
    fn: ``fn(model, *batch, **kwargs) -> (loss, grads)`` (or ``((loss, aux), grads)``);
      ``model`` is a module or a pytree of modules (modules go there only).
    microbatches: ``k`` >= 1, which must divide every batch array's axis 0.

  Returns:
    ``accumulate(fn, microbatches=k)(model, *batch, **kwargs) -> (loss, grads)``
    (``((loss, aux), grads)`` with aux, stacked per microbatch): the mean loss and the
    mean of each gradient leaf over the microbatches, in ``fn``'s structure.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> model = sr.nn.Linear(3, 1, rngs=sr.Rngs(0))
  >>> def loss_fn(model, x, y):
  ...   return jnp.mean((model(x) - y) ** 2)
  >>> x, y = jax.random.normal(jax.random.key(1), (8, 3)), jnp.ones((8, 1))
  >>> step = sr.accumulate(sr.value_and_grad(loss_fn), microbatches=4)
  >>> loss, grads = step(model, x, y)  # 4 microbatches of 2 rows
  >>> whole, full = sr.value_and_grad(loss_fn)(model, x, y)
  >>> bool(jnp.allclose(loss, whole)), bool(jnp.allclose(grads["kernel"], full["kernel"]))
  (True, True)
  """
  what = f"sr.accumulate({display_name(fn)})"
  if not callable(fn):
    raise TransformError(
      f"sr.accumulate: fn must be a function `fn(model, *batch) -> (loss, grads)`, got "
      f"{type(fn).__name__}. Fix: `sr.accumulate(sr.value_and_grad(loss_fn), "
      "microbatches=k)`."
    )
  if (
    not isinstance(microbatches, numbers.Integral)
    or isinstance(microbatches, bool)
    or microbatches < 1
  ):
    raise TransformError(
      f"{what}: microbatches={microbatches!r}, but it is the number of microbatches "
      "the batch is split into: an int >= 1. Fix: e.g. `microbatches=4` (1 runs the "
      "whole batch at once)."
    )
  k = int(microbatches)

  @functools.wraps(fn)
  def wrapper(model, *batch, **kwargs):
    lifted, variables, others, nodes = lift((model,), {})
    if not nodes or not all(is_node(n) for n in jax.tree.leaves(model, is_leaf=is_node)):
      raise TransformError(
        f"{what}: argument 0 must be the model (a module, or a tuple/dict of modules), "
        f"got {type(model).__name__}. It is called as `fn(model, *batch)`, with the "
        "batch arrays after the model. Fix: `sr.accumulate(fn, microbatches=k)(model, "
        "x, y)`."
      )
    check_no_modules(batch, what, "argument", first=1)
    check_no_modules(kwargs, what, "the keyword argument")
    leaves, batch_tree = jax.tree.flatten(batch)
    if not leaves:
      raise TransformError(
        f"{what}: there is no batch to split: the arguments after the model hold no "
        "array. Fix: pass the batch positionally after the model, `step(model, x, y)`."
      )
    _check_one_batch_size(leaves, batch, what)
    split = [_microbatched(x, j, batch, k, what) for j, x in enumerate(leaves)]

    with held(variables):
      values = [v._value for v in variables]
      out, changed = _scan(fn, k, what, lifted, values, others, split, batch_tree, kwargs)
      commit(variables, changed, what)
    return out

  return serialised(wrapper)


def _microbatched(x, j: int, batch: tuple, k: int, what: str):
  """``x`` reshaped to ``(k, B // k, ...)``: microbatch ``m`` is rows ``m·B/k …``."""
  shape = tuple(jnp.shape(x))
  if not shape or shape[0] % k:
    where = _leaf_where(batch, j)
    rows = "it is a scalar" if not shape else f"{shape[0]} rows"
    fix = (
      f"pass a batch whose size is a multiple of {k} (e.g. "
      f"{max(k, shape[0] - shape[0] % k)} rows), or choose microbatches among the "
      f"divisors of {shape[0]}"
      if shape
      else "pass the values every microbatch shares as keyword arguments (they are "
      "given whole to each)"
    )
    raise TransformError(
      f"{what}: {where} has shape {shape}, which does not split along axis 0 into "
      f"microbatches={k} equal microbatches ({rows}). Fix: {fix}."
    )
  return split_rows(x, k)


def _check_one_batch_size(leaves: list, batch: tuple, what: str) -> None:
  """Every batch array has the same number of rows (one per example)."""
  sized = [(j, jnp.shape(x)[0]) for j, x in enumerate(leaves) if jnp.ndim(x)]
  for j, rows in sized[1:]:
    if rows != sized[0][1]:
      first, n = sized[0]
      raise TransformError(
        f"{what}: {_leaf_where(batch, first)} has {n} rows but {_leaf_where(batch, j)} "
        f"has {rows}; every array of the batch is split along axis 0 into the same "
        "microbatches, so they must have the same number of rows (one per example). "
        "Nothing was run. Fix: pass arrays of one batch size, or values every "
        "microbatch shares as keyword arguments (they are given whole to each)."
      )


def _leaf_where(batch: tuple, j: int) -> str:
  path = jax.tree_util.tree_flatten_with_path(batch)[0][j][0]
  inner = jax.tree_util.keystr(path[1:])
  return f"argument {1 + path[0].idx}" + (f" at `{inner}`" if inner else "")


def _check_same_shape(what: str, path: tuple, old, new) -> None:
  if jax.tree.map(jnp.shape, old) != jax.tree.map(jnp.shape, new):
    raise TransformError(
      f"{what}: fn changed `{format_path(path)}` from {_describe(old)} to "
      f"{_describe(new)}; a value carried from one microbatch to the next keeps its "
      "shape. Fix: write a value of the same shape (build the Variable with its final "
      "shape in `__init__`)."
    )


def _spec(x) -> tuple:
  """``x``'s partition spec where explicit mesh axes show it, else ``()``."""
  spec = tuple(getattr(getattr(x, "sharding", None), "spec", None) or ())
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return spec


def _like(value, like):
  """``value`` in ``like``'s dtype and (explicit) sharding."""
  if jnp.result_type(value) != like.dtype:
    value = jax.lax.convert_element_type(value, like.dtype)
  spec = _spec(like)
  if spec != _spec(jax.typeof(value)):
    value = jax.sharding.reshard(value, P(*spec))
  return value


def _scan(
  fn, k, what, lifted: Lifted, values: list, others: list, split: list, batch_tree, kwargs: dict
):
  """Runs the scan; ``(out, {index: new value})`` of the Variables ``fn`` changed."""
  found: dict[str, Any] = {}

  def step(vals, mb):
    """One microbatch: ``(loss, aux, grads, {index: new value})``."""
    call = lambda model: fn(model, *jax.tree.unflatten(batch_tree, mb), **kwargs)
    out, changes = lifted.run(call, list(vals), others, what)
    return (*_parse(out, what), changes.values)

  def probe(vals, mb):
    loss, _, grads, changed = step(vals, mb)
    found["changed"] = sorted(changed)
    return loss, grads, [changed[i] for i in found["changed"]]

  # A first trace on microbatch 0's shapes tells the gradients' shapes and which Variables
  # fn writes: only those are carried (the parameters stay out of sr.jit's outputs).
  mb0 = jax.eval_shape(lambda s: [x[0] for x in s], split)
  loss0, grads0, written = jax.eval_shape(probe, values, mb0)
  carried = found["changed"]
  paths = lifted.graphdef.var_paths
  init = []
  for i, new in zip(carried, written):
    leaves = jax.tree.leaves(values[i])
    if not leaves or not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
      raise TransformError(
        f"{what}: fn writes `{format_path(paths[i])}`, whose value "
        f"({type(values[i]).__name__}) is not an array, so it cannot be carried from "
        "one microbatch to the next. Fix: hold arrays in Variables."
      )
    _check_same_shape(what, paths[i], values[i], new)
    # The carry starts in the dtype and sharding fn writes (a BatchNorm statistic created replicated
    # comes out sharded like the features), as after the loop's first microbatch.
    init.append(jax.tree.map(_like, values[i], new))
  _check_grads(grads0, what)

  def zeros(like):  # summed in float32 at least, sharded as explicit mesh axes show
    spec = _spec(like)
    dtype = jnp.promote_types(like.dtype, jnp.float32)
    return jnp.zeros(like.shape, dtype, out_sharding=P(*spec) if spec else None)

  def body(carry, mb):
    state, total = carry
    vals = list(values)
    for i, v in zip(carried, state):
      vals[i] = v
    loss, aux, grads, changed = step(vals, mb)
    extra = sorted(set(changed) - set(carried))
    if extra:  # fn wrote other Variables than in the first trace
      raise TransformError(
        f"{what}: fn wrote `{format_path(paths[extra[0]])}` when traced over the "
        "microbatches but not when traced once before; what fn writes must not depend "
        "on the trace. Fix: write the same Variables on every call."
      )
    new_state = []
    for i, old in zip(carried, state):
      new = changed.get(i, old)
      _check_same_shape(what, paths[i], old, new)
      new_state.append(
        jax.tree.map(lambda n, o: jax.lax.convert_element_type(n, jnp.result_type(o)), new, old)
      )
    total = jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, (loss, grads))
    return (new_state, total), aux

  init = (init, jax.tree.map(zeros, (loss0, grads0)))
  (state, total), auxs = jax.lax.scan(body, init, split)
  loss, grads = jax.tree.map(lambda t, like: (t / k).astype(like.dtype), total, (loss0, grads0))
  out = (loss, grads) if auxs is None else ((loss, auxs), grads)
  return out, dict(zip(carried, state))


def _parse(out, what: str):
  """``(loss, aux, grads)`` from fn's ``(loss, grads)`` or ``((loss, aux), grads)``."""
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TransformError(
      f"{what}: fn must return a pair (loss, grads), as sr.value_and_grad(loss_fn) "
      f"does, but it returned {describe_returned(out)}. Fix: wrap the loss function, "
      "`sr.accumulate(sr.value_and_grad(loss_fn), microbatches=k)`."
    )
  first, grads = out
  aux = None
  if isinstance(first, (tuple, list)):
    if len(first) != 2:
      raise TransformError(
        f"{what}: fn returned ({type(first).__name__} of length {len(first)}, grads); "
        "the first entry is the loss, or (loss, aux) with sr.value_and_grad(loss_fn, "
        "has_aux=True). Fix: return `loss, grads` or `(loss, aux), grads`."
      )
    first, aux = first
    check_no_nodes(aux, what)
  if any(map(is_node, jax.tree.leaves(grads, is_leaf=is_node))):
    kind = f"a module ({type(grads).__name__})" if is_node(grads) else "a pytree of modules"
    raise TransformError(
      f"{what}: fn returned its gradients as {kind}: raw `jax.grad` / "
      "`jax.value_and_grad` over a module return one, the model's structure with "
      "gradients where the arrays were, which accumulate cannot sum into the model's "
      "gradient State. Fix: differentiate with statefulremat's, whose gradients are a "
      "State: `sr.accumulate(sr.value_and_grad(loss_fn), microbatches=k)` (or "
      "`sr.value_and_grad(loss_fn)(model, *batch)` inside fn)."
    )
  check_no_nodes(grads, what)
  if not (
    isinstance(first, (jax.Array, float)) and jnp.issubdtype(jnp.result_type(first), jnp.inexact)
  ):
    raise TransformError(
      f"{what}: fn returned {_describe(first)} as the loss, where a float array is "
      "expected (the first entry of `(loss, grads)`). Fix: return the loss first, as "
      "sr.value_and_grad(loss_fn) does."
    )
  return first, aux, grads


def _check_grads(grads, what: str) -> None:
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    if not jnp.issubdtype(g.dtype, jnp.inexact):
      raise TransformError(
        f"{what}: the gradient at `grads{jax.tree_util.keystr(path)}` has dtype "
        f"{g.dtype}, which cannot be averaged over microbatches. fn must return float "
        "gradients. Fix: differentiate only float variables (`wrt=sr.Param`)."
      )


def _describe(x) -> str:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"{x.dtype}{list(x.shape)}"
  return f"a {type(x).__name__}"
