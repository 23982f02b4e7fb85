"""Parameter initialisers, the set ``flax.nnx.initializers`` exposes, by its names.

``jax.nn.initializers``' functions re-exported as they are, plus nnx's ``zeros_init()``
and ``ones_init()`` (builders that return ``zeros`` / ``ones``). Each initialiser is
called as ``init(key, shape, dtype)``, the form every ``sr.nn`` layer takes.

>>> import jax, jax.numpy as jnp, statefulremat as sr
>>> init = sr.nn.initializers.lecun_normal()
>>> init(jax.random.key(0), (3, 2), jnp.float32).shape
(3, 2)
>>> sr.nn.initializers.zeros_init()(jax.random.key(0), (2,), jnp.float32).tolist()
[0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable

from jax.nn.initializers import constant as constant
from jax.nn.initializers import delta_orthogonal as delta_orthogonal
from jax.nn.initializers import glorot_normal as glorot_normal
from jax.nn.initializers import glorot_uniform as glorot_uniform
from jax.nn.initializers import he_normal as he_normal
from jax.nn.initializers import he_uniform as he_uniform
from jax.nn.initializers import kaiming_normal as kaiming_normal
from jax.nn.initializers import kaiming_uniform as kaiming_uniform
from jax.nn.initializers import lecun_normal as lecun_normal
from jax.nn.initializers import lecun_uniform as lecun_uniform
from jax.nn.initializers import normal as normal
from jax.nn.initializers import ones as ones
from jax.nn.initializers import orthogonal as orthogonal
from jax.nn.initializers import truncated_normal as truncated_normal
from jax.nn.initializers import uniform as uniform
from jax.nn.initializers import variance_scaling as variance_scaling
from jax.nn.initializers import xavier_normal as xavier_normal
from jax.nn.initializers import xavier_uniform as xavier_uniform
from jax.nn.initializers import zeros as zeros


def zeros_init() -> Callable:
  """An initialiser of zeros: ``jax.nn.initializers.zeros`` (nnx's builder form).

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> sr.nn.initializers.zeros_init()(jax.random.key(0), (1, 2), jnp.float32).tolist()
  [[0.0, 0.0]]
  """
  return zeros


def ones_init() -> Callable:
  """An initialiser of ones: ``jax.nn.initializers.ones`` (nnx's builder form).

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> sr.nn.initializers.ones_init()(jax.random.key(0), (2,), jnp.float32).tolist()
  [1.0, 1.0]
  """
  return ones
