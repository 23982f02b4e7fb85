"""Sequential: layers and functions applied one after another, as ``flax.nnx.Sequential``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..core._module import Module


def _takes_rngs(fn) -> bool:
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # builtins and C functions without a signature
    return False
  return any(
    p.name == "rngs" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
  )


class Sequential(Module):
  """Applies ``layers`` in order, each output fed to the next, as ``flax.nnx.Sequential``.

  ``Sequential(*layers)`` keeps the layers in the list ``self.layers`` (so parameters
  are named ``layers.0.kernel``, ``layers.2.bias``, ... as nnx names them), modules and
  plain functions (``sr.nn.relu``, ``jax.nn.gelu``) alike. The call passes its
  arguments to the first layer; after that a tuple output is spread as positional
  arguments of the next layer, a dict output as keyword arguments, anything else is its
  one argument. ``rngs=`` given to the call goes to every layer that takes an ``rngs``
  argument. Without layers the call returns its argument (its arguments as a tuple,
  its keyword arguments as a dict, or None). It is the Python loop::

    for layer in self.layers:
      x = layer(x)

  Args:
    *layers: the modules and functions to apply, in order.

  Raises:
    TypeError: when a layer is not callable.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> rngs = sr.Rngs(0)
  >>> model = sr.Sequential(sr.nn.Linear(1, 4, rngs=rngs), jax.nn.relu,
  ...                       sr.nn.Linear(4, 2, rngs=rngs))
  >>> model(jnp.ones((1, 1))).shape
  (1, 2)
  >>> sorted(sr.state(model).flat())[0]
  ('layers', 0, 'bias')
  """

  def __init__(self, *layers: Callable[..., Any]):
    for i, layer in enumerate(layers):
      if not callable(layer):
        raise TypeError(
          f"Sequential: layer {i} is a {type(layer).__name__} ({layer!r}), which cannot "
          "be called. Fix: pass modules or functions, e.g. "
          "`sr.Sequential(sr.nn.Linear(2, 4, rngs=rngs), jax.nn.relu)`."
        )
    self.layers = list(layers)

  def __call__(self, *args, rngs=None, **kwargs) -> Any:
    if not self.layers:
      return args[0] if len(args) == 1 else (args or kwargs or None)
    output = None
    for i, layer in enumerate(self.layers):
      if i > 0:
        if isinstance(output, tuple):
          args, kwargs = output, {}
        elif isinstance(output, dict):
          args, kwargs = (), dict(output)
        else:
          args, kwargs = (output,), {}
      if rngs is not None and _takes_rngs(layer):
        kwargs = {**kwargs, "rngs": rngs}
      output = layer(*args, **kwargs)
    return output
