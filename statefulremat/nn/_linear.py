"""Linear: y = x @ kernel + bias."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._module import Module
from .._rngs import Rngs
from .._variables import Param

default_kernel_init = jax.nn.initializers.lecun_normal()


class Linear(Module):
  """A dense layer with ``kernel`` (in, out) and ``bias`` (out,), as ``flax.nnx.Linear``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> layer = sr.nn.Linear(3, 4, rngs=sr.Rngs(0))
  >>> layer(jnp.ones((2, 3))).shape
  (2, 4)
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               precision: Any = None,
               kernel_init=default_kernel_init,
               bias_init=jax.nn.initializers.zeros,
               kernel_metadata: dict | None = None, bias_metadata: dict | None = None,
               rngs: Rngs):
    self.kernel = Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                        **(kernel_metadata or {}))
    self.bias = (Param(bias_init(rngs.params(), (out_features,), param_dtype),
                       **(bias_metadata or {})) if use_bias else None)
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel, bias = self.kernel.value, self.bias.value if self.bias is not None else None
    dtype = self.dtype or jnp.result_type(x, kernel)
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    y = jnp.matmul(x, kernel, precision=self.precision)
    if bias is not None:
      y = y + jnp.reshape(bias.astype(dtype), (1,) * (y.ndim - 1) + (-1,))
    return y
