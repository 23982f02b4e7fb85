"""sr.eval_shape: ``jax.eval_shape`` for functions that take and return modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ..core._module import Module
from ._lift import lift
from ._outputs import ModulesOut


def eval_shape(fn: Callable, *args: Any, **kwargs: Any) -> Any:
  """What ``fn(*args, **kwargs)`` would return, with ``jax.ShapeDtypeStruct`` values,
  computing nothing; the arguments are left as they were.

  Args:
    fn: the function to evaluate (modules may sit anywhere in its arguments), or a
      module, which is then called: ``sr.eval_shape(model, x)`` is ``model(x)``.
    *args: ``fn``'s positional arguments: arrays, modules, Variables, pytrees of them.
    **kwargs: ``fn``'s keyword arguments.

  Returns:
    ``fn``'s result with each array as a ``jax.ShapeDtypeStruct``, and each module in it a new,
    abstract one (its Variables holding ``ShapeDtypeStruct`` s; a stack stays a stack).

  Raises:
    TypeError: ``fn`` is neither callable nor a module.

  >>> import jax, statefulremat as sr
  >>> class Block(sr.Module):
  ...   def __init__(self, *, rngs):
  ...     self.linear = sr.nn.Linear(1024, 1024, kernel_metadata={"sharding": (
  ...         "embed", "mlp")}, rngs=rngs)
  >>> Stack = sr.vmap(Block, axis_size=64, metadata_params={"partition_name": "layers"})
  >>> abstract = sr.eval_shape(lambda: Stack(rngs=sr.Rngs(0)))
  >>> abstract.linear.kernel.value
  ShapeDtypeStruct(shape=(64, 1024, 1024), dtype=float32)
  >>> sr.get_partition_spec(sr.state(abstract))["linear"]["kernel"]
  P('layers', 'embed', 'mlp')
  """
  if isinstance(fn, Module):  # sr.eval_shape(model, x): the module is an argument
    args, fn = (fn, *args), _call
  elif not callable(fn):
    raise TypeError(
      f"sr.eval_shape takes a function (or a module) first, then its arguments; got "
      f"{type(fn).__name__}. Fix: `sr.eval_shape(f, *args)`, e.g. "
      "`sr.eval_shape(lambda: Model(rngs=sr.Rngs(0)))` or `sr.eval_shape(model, x)`."
    )
  what = f"sr.eval_shape({getattr(fn, '__name__', 'fn')})"
  lifted, variables, leaves, _ = lift(args, kwargs)

  def pure(values, leaves):
    # What the function changed is dropped. Every output object is new: an argument returned comes
    # back as an abstract copy, never as the caller's object (whose values stay concrete).
    return lifted.run(fn, values, leaves, what, restructure=True, copies=True)[0]

  out = jax.eval_shape(pure, [v._value for v in variables], leaves)
  return out.rebuild() if isinstance(out, ModulesOut) else out


def _call(module, *args, **kwargs):
  return module(*args, **kwargs)
