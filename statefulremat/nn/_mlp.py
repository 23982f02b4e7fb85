"""MLP: the two-layer feed-forward block of transformers and mixers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..core._frozen import EMPTY as _EMPTY
from ..core._module import Module
from ..core._rngs import Rngs, RngStream
from ._dropout import Dropout
from ._linear import Initializer, Linear, default_bias_init, default_kernel_init
from ._rngs_arg import check_rngs


class MLP(Module):
  """``fc1`` -> ``activation`` -> ``dropout`` -> ``fc2`` -> ``dropout``.

  Equivalent to::

    h = dropout(activation(fc1(x)))
    y = dropout(fc2(h))

  with ``fc1 = Linear(in_features, hidden_features)``, ``fc2 = Linear(hidden_features,
  out_features)`` and one ``Dropout(dropout_rate)`` drawn twice (a fresh mask each
  time), the placement of timm's ``Mlp`` and scenic's ``MlpBlock``. There is no
  flax.nnx counterpart; the sub-layers are ordinary ``Linear`` / ``Dropout``.

  Memory names, MaxText's (``jax.ad_checkpoint.checkpoint_name``, what remat policies
  such as ``sr.policies.minimal`` save by): ``mlpwi``, ``fc1``'s output (before the
  activation), and ``mlpwo``, ``fc2``'s (before the dropout).

  Args:
    in_features: size of the input's last axis.
    hidden_features: size of the hidden layer.
    out_features: output size (default ``in_features``).
    activation: applied after ``fc1`` (default ``jax.nn.gelu``, tanh approximation).
    dropout_rate: rate of ``dropout`` (default ``0.0``: disabled, no RNG is drawn).
    deterministic: initial mode of ``dropout`` (default ``False``: training);
      ``model.train()`` / ``eval()`` flip it.
    use_bias: give both ``Linear`` layers a bias (default ``True``).
    dtype: computation dtype of both ``Linear`` layers; default ``None``: inferred from
      inputs and parameters.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    precision: ``lax.Precision`` of both matmuls (default ``None``).
    kernel_init: initialiser of both kernels (default ``Linear``'s, ``lecun_normal()``).
    bias_init: initialiser of both biases (default zeros).
    rngs: draws ``fc1``'s then ``fc2``'s parameters; kept by ``dropout``.
    kernel_metadata: metadata of ``fc1.kernel``, and of ``fc2.kernel`` unless
      ``out_kernel_metadata`` is given, e.g. ``{"sharding": ("embed", "mlp")}``
      (default ``{}``: none).
    bias_metadata: metadata of ``fc1.bias``, and of ``fc2.bias`` unless
      ``out_bias_metadata`` is given (default ``{}``: none).
    out_kernel_metadata: metadata of ``fc2.kernel``, e.g.
      ``{"sharding": ("mlp", "embed")}`` (default ``{}``: ``kernel_metadata``).
    out_bias_metadata: metadata of ``fc2.bias`` (default ``{}``: ``bias_metadata``).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``dropout_rate`` is outside ``[0, 1]``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> mlp = sr.nn.MLP(4, 16, dropout_rate=0.1, rngs=sr.Rngs(0))
  >>> mlp(jnp.ones((2, 4))).shape, mlp.fc1.kernel.shape, mlp.fc2.kernel.shape
  ((2, 4), (4, 16), (16, 4))
  >>> mlp.eval().dropout.deterministic
  True
  """

  def __init__(
    self,
    in_features: int,
    hidden_features: int,
    out_features: int | None = None,
    *,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    dropout_rate: float = 0.0,
    deterministic: bool | None = False,
    use_bias: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    precision: Any = None,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
    out_kernel_metadata: Mapping[str, Any] = _EMPTY,
    out_bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("MLP", rngs)
    out_features = in_features if out_features is None else out_features
    common: dict[str, Any] = dict(
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      kernel_init=kernel_init,
      bias_init=bias_init,
      rngs=rngs,
    )
    self.fc1 = Linear(
      in_features,
      hidden_features,
      kernel_metadata=kernel_metadata,
      bias_metadata=bias_metadata,
      **common,
    )
    self.fc2 = Linear(
      hidden_features,
      out_features,
      kernel_metadata=out_kernel_metadata or kernel_metadata,
      bias_metadata=out_bias_metadata or bias_metadata,
      **common,
    )
    self.dropout = Dropout(dropout_rate, deterministic=deterministic, rngs=rngs)
    self.activation = activation
    self.in_features = in_features
    self.hidden_features = hidden_features
    self.out_features = out_features

  def __call__(
    self,
    x: jax.Array,
    *,
    deterministic: bool | None = None,
    rngs: Rngs | RngStream | jax.Array | None = None,
  ) -> jax.Array:
    """Applies the block to the last axis of ``x``; arguments override ``dropout``'s.

    A key passed as ``rngs`` is split in two, one per dropout.
    """
    if isinstance(rngs, jax.Array):
      first, second = jax.random.split(rngs)
    else:
      first = second = rngs
    h = checkpoint_name(self.fc1(x), "mlpwi")
    h = self.dropout(self.activation(h), deterministic=deterministic, rngs=first)
    y = checkpoint_name(self.fc2(h), "mlpwo")
    return self.dropout(y, deterministic=deterministic, rngs=second)
