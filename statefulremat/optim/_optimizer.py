"""Optimizer: an optax transformation bound to a model, updating it in place."""

from __future__ import annotations

from typing import cast

import jax
import jax.core
import jax.numpy as jnp

from ..core._errors import StateMismatchError, format_path
from ..core._filters import Filter, filter_repr
from ..core._graph import flatten
from ..core._graph_lock import holding, locked
from ..core._kinds import Param
from ..core._module import Module
from ..core._split_merge import state, update
from ..core._state import State
from ..core._variables import A, Variable


class OptState(Variable[A]):
  """Optimizer state (collection ``"opt_state"``): moments, step counts.

  Args:
    value: one leaf of the optax state (a moment's array, a step count).
    **metadata: free-form attributes kept beside it, as ``sr.Variable`` takes them;
      none by default.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.OptState(jnp.zeros(2)).collection
  'opt_state'
  """

  collection = "opt_state"

  def __call__(self, *args, **kwargs):
    # `opt.step` is the step count, so PyTorch's `opt.step()` lands here.
    raise AttributeError(
      f"`{self.path_str()}` is optimizer state (an sr.OptState; `opt.step` is the "
      "step count, read as `opt.step.value`), not a method: sr.Optimizer has no "
      "PyTorch-style step(). Fix: take the gradients with `grads = "
      "sr.grad(loss_fn)(model, ...)` and apply them with `opt.update(grads)`."
    )


class _Paths:
  """The optimized variables' paths at creation: one static, hashable attribute."""

  __slots__ = ("paths", "_hash")

  def __init__(self, paths: tuple):
    self.paths = paths
    self._hash = hash(paths)

  def __eq__(self, other):
    return isinstance(other, _Paths) and self.paths == other.paths

  def __hash__(self):
    return self._hash

  def __repr__(self):
    return f"<{len(self.paths)} paths>"


def _difference(before: tuple, after: tuple) -> str:
  added = [p for p in after if p not in set(before)]
  removed = [p for p in before if p not in set(after)]
  if added:
    return f"a new variable at `{format_path(added[0])}`"
  if removed:
    return f"`{format_path(removed[0])}` is gone"
  return "their order changed"


class Optimizer(Module):
  """Holds a model, an optax transformation and its state; ``update(grads)`` steps.

  The optimizer is a module, so it goes through ``sr.jit`` with the model (pass both;
  the model is shared, not copied) and its state is saved like any other.

  Args:
    model: the Module to optimize; ``update`` changes it in place.
    tx: the optax transformation (``optax.adamw(1e-3)``, a chain, ...); its state is
      made from the ``wrt`` variables at once.
    wrt: the filter of the variables to optimize (as ``sr.state`` takes it);
      ``sr.Param`` by default. The gradients given to ``update`` must have exactly
      their paths.

  >>> import jax.numpy as jnp, optax, statefulremat as sr
  >>> model = sr.nn.Linear(2, 1, rngs=sr.Rngs(0))
  >>> opt = sr.Optimizer(model, optax.sgd(0.1))
  >>> @sr.jit
  ... def train_step(model, opt, x, y):
  ...   loss, grads = sr.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
  ...   opt.update(grads)
  ...   return loss
  >>> x, y = jnp.ones((8, 2)), jnp.zeros((8, 1))
  >>> first = train_step(model, opt, x, y)
  >>> bool(train_step(model, opt, x, y) < first), int(opt.step.value)
  (True, 2)
  """

  def __init__(self, model: Module, tx, *, wrt: Filter = Param):
    self.model = model
    self.tx = tx
    self.wrt = wrt
    params = state(model, wrt)
    leaves, treedef = jax.tree.flatten(tx.init(params))
    mesh = _mesh_of(params)
    self.step = OptState(_replicated(jnp.zeros((), jnp.uint32), mesh))
    self.opt_state = [OptState(_replicated(leaf, mesh)) for leaf in leaves]
    self.opt_state_def = treedef
    self.opt_paths = _Paths(params._spec.paths)

  def update(self, *args: Module | State) -> None:
    """``update(grads)``: applies one optax step to the model's ``wrt`` variables.

    ``grads`` is the State ``sr.grad`` gives for those variables; the model is
    updated in place and the optax state and ``step`` advance too. flax.nnx's
    ``update(model, grads)`` (nnx >= 0.11) is accepted and the same, provided
    ``model`` is this optimizer's own ``opt.model``. Raises ``StateMismatchError`` if
    the gradients' paths, or the model's since the Optimizer was made, differ from
    the optimized ones. Updates from several threads run one at a time (the model's
    graph lock, as ``sr.jit`` holds it), so none is lost.

    >>> import jax, jax.numpy as jnp, optax, statefulremat as sr
    >>> model = sr.nn.Linear(2, 1, rngs=sr.Rngs(0))
    >>> opt = sr.Optimizer(model, optax.sgd(0.5))
    >>> grads = jax.tree.map(jnp.ones_like, sr.state(model, sr.Param))
    >>> opt.update(grads)
    >>> opt.update(model, grads)      # the flax.nnx spelling
    >>> model.bias.value.tolist(), int(opt.step.value)
    ([-1.0], 2)
    """
    # Called outside sr.jit, it reads, computes and writes like a transform: threads
    # updating one model take turns (inside a transform the outer call holds the lock).
    with locked(() if holding() else flatten([self])[1]):
      self._update(args)

  def _update(self, args: tuple) -> None:
    grads = args[0] if len(args) == 1 else self._nnx_grads(args)
    params = state(self.model, self.wrt)
    if not isinstance(grads, State):
      raise TypeError(
        f"Optimizer.update takes the State of gradients from sr.grad, got "
        f"{type(grads).__name__}. Fix: `grads = sr.grad(loss_fn)(model, ...)`, then "
        "`opt.update(grads)`."
      )
    if params._spec.paths != self.opt_paths.paths:
      raise StateMismatchError(
        "Optimizer.update: the model's optimized variables changed since the "
        f"Optimizer was made ({_difference(self.opt_paths.paths, params._spec.paths)})"
        ", so its optax state no longer fits them. Make a new "
        "`sr.Optimizer(model, tx)` after changing the model's structure."
      )
    if grads._spec.paths != params._spec.paths:
      missing = [p for p in params._spec.paths if p not in set(grads._spec.paths)]
      extra = [p for p in grads._spec.paths if p not in set(params._spec.paths)]
      where = (
        f"no gradient for `{format_path(missing[0])}`"
        if missing
        else f"a gradient for `{format_path(extra[0])}`, which is not optimized"
        if extra
        else "the entries are in another order"
      )
      raise StateMismatchError(
        f"Optimizer.update: the gradients do not match the optimized variables "
        f"({where}). Take the gradients with the same filter: "
        f"`sr.grad(loss_fn, wrt={filter_repr(self.wrt)})(model, ...)`."
      )
    opt_state = jax.tree.unflatten(self.opt_state_def, [v.value for v in self.opt_state])
    grads = State._make(params._spec, grads._values)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    import optax

    # apply_updates keeps the tree's structure (a State in, a State out); optax types
    # its result as any tree.
    new_params = cast(State, optax.apply_updates(params, updates))
    update(self.model, new_params)
    for var, leaf in zip(self.opt_state, jax.tree.leaves(opt_state)):
      var.value = leaf
    self.step.value = self.step.value + 1

  def _nnx_grads(self, args: tuple) -> State:
    """The gradients of flax.nnx's ``update(model, grads)``; refuses other calls."""
    if len(args) != 2:
      raise TypeError(
        f"Optimizer.update takes the gradients, got {len(args)} arguments. Fix: "
        "`opt.update(grads)` with `grads = sr.grad(loss_fn)(model, ...)` (flax.nnx's "
        "`opt.update(model, grads)` works too)."
      )
    model, grads = args
    if model is self.model:
      return grads
    if grads is self.model and isinstance(model, State):
      raise TypeError(
        "Optimizer.update got (grads, model): the model goes first. Fix: "
        "`opt.update(model, grads)`, or just `opt.update(grads)`."
      )
    raise ValueError(
      f"Optimizer.update(model, grads) got a model (a {type(model).__name__}) that "
      f"is not the one this Optimizer updates (opt.model, a "
      f"{type(self.model).__name__}); its gradients would be applied to opt.model. "
      "Fix: call `opt.update(grads)` to update opt.model, or make an optimizer for "
      "that model: `sr.Optimizer(model, tx)`. Inside sr.jit, pass the model and the "
      "optimizer as arguments so they stay the same object."
    )

  @property
  def zero_grad(self):
    # A property, not a method: `hasattr(opt, "zero_grad")` stays False.
    raise AttributeError(
      "sr.Optimizer has no zero_grad(): there is nothing to zero in JAX. Gradients "
      "are not accumulated on the parameters; `sr.grad` returns fresh ones on "
      "every call. Fix: delete the call; each step is `grads = sr.grad(loss_fn)"
      "(model, ...)` then `opt.update(grads)`."
    )


def _mesh_of(params):
  """The mesh the parameters are placed on (``sr.shard``), or None."""
  for leaf in jax.tree.leaves(params):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and not isinstance(leaf, jax.core.Tracer):
      return sharding.mesh
  return None


def _replicated(leaf, mesh):
  """A new state array (a step count, optax's own counters) on the parameters' mesh,
  replicated, as a jitted step gives it back: otherwise the first step's output has
  another sharding than its input and the second step compiles again."""
  if (
    mesh is None
    or isinstance(leaf, jax.core.Tracer)
    or not isinstance(getattr(leaf, "sharding", None), jax.sharding.SingleDeviceSharding)
  ):
    return leaf
  return jax.device_put(leaf, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
