"""``PReLU``, the activation layer with a learned ``negative_slope``.

The activation functions ``sr.nn`` exports, the ones ``flax.nnx`` exports by its names,
are ``jax.nn``'s own functions (``tanh`` is ``jax.numpy.tanh``), re-exported by
``sr.nn``'s ``__init__``, not copies: ``sr.nn.relu is jax.nn.relu``, so ported nnx code
computes the same thing.

>>> import jax, jax.numpy as jnp, statefulremat as sr
>>> sr.nn.relu is jax.nn.relu, sr.nn.relu(jnp.array([-1.0, 2.0])).tolist()
(True, [0.0, 2.0])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..core._frozen import EMPTY as _EMPTY
from ..core._kinds import Param
from ..core._module import Module
from ._dtypes import promote_dtype as default_promote_dtype


class PReLU(Module):
  """A leaky ReLU whose slope for negative inputs, ``negative_slope``, is learned.

  As ``flax.nnx.PReLU``: ``negative_slope`` is a scalar Param (initially
  ``negative_slope_init``); without a ``dtype`` the slope is cast to the input's
  dtype (linen's behaviour), with one both are promoted to it. It takes no ``rngs``,
  as nnx's does not.

  Args:
    negative_slope_init: the initial slope.
    dtype: computation dtype (default: the input's).
    param_dtype: dtype of ``negative_slope``.
    promote_dtype: ``(inputs, negative_slope), dtype=`` -> promoted arrays.
    negative_slope_metadata: metadata put on the Variable.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.nn.PReLU(0.5)(jnp.array([-2.0, 3.0])).tolist()
  [-1.0, 3.0]
  """

  def __init__(
    self,
    negative_slope_init: float = 0.01,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    promote_dtype: Callable = default_promote_dtype,
    negative_slope_metadata: Mapping[str, Any] = _EMPTY,
  ):
    self.negative_slope = Param(
      jnp.asarray(negative_slope_init, dtype=param_dtype), **(negative_slope_metadata or {})
    )
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.promote_dtype = promote_dtype

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """``inputs`` where non-negative, ``negative_slope * inputs`` elsewhere."""
    slope = self.negative_slope.value
    if self.dtype is not None:
      inputs, slope = self.promote_dtype((inputs, slope), dtype=self.dtype)
    else:
      slope = jnp.asarray(slope, jnp.asarray(inputs).dtype)
    return jnp.where(inputs >= 0, inputs, slope * inputs)
