"""Recurrent cells, as ``flax.nnx``'s: ``SimpleCell``, ``LSTMCell``,
``OptimizedLSTMCell``, ``GRUCell``.

A cell computes one time step, ``cell(carry, x) -> (carry, y)`` (the protocol and its
checks are ``RNNCellBase``'s, in ``_rnn``); ``sr.nn.RNN`` scans it over a
sequence. Names, constructor signatures, sub-layers (``Linear``s named as nnx
names them) and numerics are nnx 0.12's, so ``sr.interop.from_nnx`` moves the weights
of an nnx cell into ours with no rename.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..core._frozen import EMPTY as _EMPTY
from ..core._rngs import Rngs
from ._dtypes import promote_dtype as default_promote_dtype
from ._linear import Initializer, default_bias_init, default_kernel_init
from ._rnn import RNNCellBase

default_recurrent_kernel_init = jax.nn.initializers.orthogonal()


def modified_orthogonal(key: jax.Array, shape: tuple, dtype: Any = jnp.float32) -> jax.Array:
  """An orthogonal matrix drawn in float32, then cast to ``dtype`` (half precision works).

  nnx's default ``recurrent_kernel_init`` of ``LSTMCell``.

  >>> import jax, jax.numpy as jnp
  >>> from statefulremat.nn._cells import modified_orthogonal
  >>> w = modified_orthogonal(jax.random.key(0), (3, 3), jnp.bfloat16)
  >>> w.dtype, bool(jnp.allclose(w.astype(jnp.float32) @ w.T.astype(jnp.float32),
  ...                            jnp.eye(3), atol=1e-2))
  (dtype(bfloat16), True)
  """
  return default_recurrent_kernel_init(key, shape).astype(dtype)


class LSTMCell(RNNCellBase):
  r"""A long short-term memory cell with one ``Linear`` per gate, as ``flax.nnx.LSTMCell``.

  .. math::
      i = \sigma(W_{ii} x + W_{hi} h + b_{hi}), \;
      f = \sigma(W_{if} x + W_{hf} h + b_{hf}), \;
      g = \tanh(W_{ig} x + W_{hg} h + b_{hg}), \;
      o = \sigma(W_{io} x + W_{ho} h + b_{ho}), \;
      c' = f c + i g, \; h' = o \tanh(c')

  Sub-layers (nnx's names): ``ii``, ``if_``, ``ig``, ``io`` (input kernels
  ``(in, hidden)``, no bias) and ``hi``, ``hf``, ``hg``, ``ho`` (recurrent kernels
  ``(hidden, hidden)`` with the bias). The carry is ``(c, h)``; the output is ``h'``.

  Args:
    in_features: size of the input's last axis.
    hidden_features: size of the hidden state (the carry's and the output's last axis).
    gate_fn: the gates' activation (default ``jax.nn.sigmoid``).
    activation_fn: the cell's activation (default ``jnp.tanh``).
    kernel_init: initialiser of the input kernels (default
      ``jax.nn.initializers.lecun_normal()``).
    recurrent_kernel_init: initialiser of the recurrent kernels (default: orthogonal, drawn in
      float32 then cast, so half precision works).
    bias_init: initialiser of the bias (default ``jax.nn.initializers.zeros``).
    dtype: computation dtype; default ``None``: promoted from the inputs and the parameters.
    param_dtype: dtype of the parameters and of the carry (default ``jnp.float32``).
    carry_init: the carry's initialiser; default ``None``: zeros (nnx warns when it is given
      here; prefer ``initialize_carry(..., carry_init=)``).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays, given to every
      ``Linear`` (default ``sr.nn.promote_dtype``).
    keep_rngs: deprecated, as in nnx: keep a ``carry`` stream for ``initialize_carry`` (default
      ``False``).
    rngs: an ``sr.Rngs``; its ``params`` stream draws the parameters.
    kernel_metadata: metadata put on the input kernels (default ``{}``: none).
    recurrent_kernel_metadata: metadata put on the recurrent kernels (default ``{}``: none).
    bias_metadata: metadata put on the recurrent layers' biases (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``in_features`` or ``hidden_features`` is not a positive int.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> cell = sr.nn.LSTMCell(3, 4, rngs=sr.Rngs(0))
  >>> carry = cell.initialize_carry((2, 3))
  >>> (c, h), y = cell(carry, jnp.ones((2, 3)))
  >>> c.shape, y.shape, cell.if_.kernel.shape, cell.hf.bias.shape
  ((2, 4), (2, 4), (3, 4), (4,))
  """

  _carry_arity = 2
  _checks_steps = True

  def __init__(
    self,
    in_features: int,
    hidden_features: int,
    *,
    gate_fn: Callable = jax.nn.sigmoid,
    activation_fn: Callable = jnp.tanh,
    kernel_init: Initializer = default_kernel_init,
    recurrent_kernel_init: Initializer = modified_orthogonal,
    bias_init: Initializer = default_bias_init,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    carry_init: Initializer | None = None,
    promote_dtype: Callable = default_promote_dtype,
    keep_rngs: bool = False,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    recurrent_kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    dense = self._setup(
      "LSTMCell", in_features, hidden_features, dtype, param_dtype, promote_dtype, rngs
    )
    self._keep_carry("LSTMCell", keep_rngs, carry_init, rngs)
    self.gate_fn = gate_fn
    self.activation_fn = activation_fn
    # Input and recurrent terms are summed: one bias is enough.
    bias = (bias_init, bias_metadata)
    inputs = (in_features, hidden_features, kernel_init, kernel_metadata)
    hidden = (hidden_features, hidden_features, recurrent_kernel_init, recurrent_kernel_metadata)
    self.ii, self.if_, self.ig, self.io = (dense(*inputs) for _ in range(4))
    self.hi, self.hf, self.hg, self.ho = (dense(*hidden, bias) for _ in range(4))

  def __call__(self, carry, inputs: jax.Array):
    """One step: ``((c, h), x) -> ((c', h'), h')``."""
    self.check_step(carry, jnp.shape(inputs))
    c, h = carry
    i = self.gate_fn(self.ii(inputs) + self.hi(h))
    f = self.gate_fn(self.if_(inputs) + self.hf(h))
    g = self.activation_fn(self.ig(inputs) + self.hg(h))
    o = self.gate_fn(self.io(inputs) + self.ho(h))
    new_c = f * c + i * g
    new_h = o * self.activation_fn(new_c)
    return (new_c, new_h), new_h


class OptimizedLSTMCell(RNNCellBase):
  """An LSTM whose four gates share one input and one recurrent matmul, as
  ``flax.nnx.OptimizedLSTMCell``.

  The same function as ``LSTMCell``, with fused sub-layers (nnx's names):
  ``dense_i`` (kernel ``(in, 4 * hidden)``, no bias) and ``dense_h`` (kernel
  ``(hidden, 4 * hidden)`` and bias ``(4 * hidden,)``), the gates in the order
  ``i, f, g, o``. Usually faster than ``LSTMCell`` up to a hidden size of about
  2048. The arguments are ``LSTMCell``'s (the recurrent kernel's default initialiser
  is ``orthogonal()``).

  Args:
    in_features: size of the input's last axis.
    hidden_features: size of the hidden state (the carry's and the output's last axis).
    gate_fn: the gates' activation (default ``jax.nn.sigmoid``).
    activation_fn: the cell's activation (default ``jnp.tanh``).
    kernel_init: initialiser of the input kernels (default
      ``jax.nn.initializers.lecun_normal()``).
    recurrent_kernel_init: initialiser of the recurrent kernels (default
      ``jax.nn.initializers.orthogonal()``).
    bias_init: initialiser of the bias (default ``jax.nn.initializers.zeros``).
    dtype: computation dtype; default ``None``: promoted from the inputs and the parameters.
    param_dtype: dtype of the parameters and of the carry (default ``jnp.float32``).
    carry_init: the carry's initialiser; default ``None``: zeros (nnx warns when it is given
      here; prefer ``initialize_carry(..., carry_init=)``).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays, given to every
      ``Linear`` (default ``sr.nn.promote_dtype``).
    keep_rngs: deprecated, as in nnx: keep a ``carry`` stream for ``initialize_carry`` (default
      ``False``).
    rngs: an ``sr.Rngs``; its ``params`` stream draws the parameters.
    kernel_metadata: metadata put on the input kernels (default ``{}``: none).
    recurrent_kernel_metadata: metadata put on the recurrent kernels (default ``{}``: none).
    bias_metadata: metadata put on the bias (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``in_features`` or ``hidden_features`` is not a positive int.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> cell = sr.nn.OptimizedLSTMCell(3, 4, rngs=sr.Rngs(0))
  >>> (c, h), y = cell(cell.initialize_carry((2, 3)), jnp.ones((2, 3)))
  >>> y.shape, cell.dense_i.kernel.shape, cell.dense_h.bias.shape
  ((2, 4), (3, 16), (16,))
  """

  _carry_arity = 2
  _checks_steps = True

  def __init__(
    self,
    in_features: int,
    hidden_features: int,
    *,
    gate_fn: Callable = jax.nn.sigmoid,
    activation_fn: Callable = jnp.tanh,
    kernel_init: Initializer = default_kernel_init,
    recurrent_kernel_init: Initializer = default_recurrent_kernel_init,
    bias_init: Initializer = default_bias_init,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    carry_init: Initializer | None = None,
    promote_dtype: Callable = default_promote_dtype,
    keep_rngs: bool = False,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    recurrent_kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    dense = self._setup(
      "OptimizedLSTMCell", in_features, hidden_features, dtype, param_dtype, promote_dtype, rngs
    )
    self._keep_carry("OptimizedLSTMCell", keep_rngs, carry_init, rngs)
    self.gate_fn = gate_fn
    self.activation_fn = activation_fn
    gates = 4 * hidden_features
    self.dense_i = dense(in_features, gates, kernel_init, kernel_metadata)
    bias = (bias_init, bias_metadata)
    self.dense_h = dense(
      hidden_features, gates, recurrent_kernel_init, recurrent_kernel_metadata, bias
    )

  def __call__(self, carry, inputs: jax.Array):
    """One step: ``((c, h), x) -> ((c', h'), h')``."""
    self.check_step(carry, jnp.shape(inputs))
    c, h = carry
    i, f, g, o = jnp.split(self.dense_i(inputs) + self.dense_h(h), 4, axis=-1)
    new_c = self.gate_fn(f) * c + self.gate_fn(i) * self.activation_fn(g)
    new_h = self.gate_fn(o) * self.activation_fn(new_c)
    return (new_c, new_h), new_h


class SimpleCell(RNNCellBase):
  r"""The Elman cell ``h' = activation_fn(W_i x + b_i + W_h h [+ h])``, as
  ``flax.nnx.SimpleCell``.

  Sub-layers (nnx's names): ``dense_i`` (kernel ``(in, hidden)`` and bias) and
  ``dense_h`` (kernel ``(hidden, hidden)``, no bias). ``residual=True`` adds ``h``
  before the activation. As in nnx, ``dtype`` defaults to float32 here. The carry and
  the output are ``h'``. Other arguments as ``LSTMCell``'s (recurrent kernel:
  ``orthogonal()``).

  Args:
    in_features: size of the input's last axis.
    hidden_features: size of the hidden state (the carry's and the output's last axis).
    dtype: computation dtype (default ``jnp.float32``, as nnx's; ``None``: promoted from the
      inputs and the parameters).
    param_dtype: dtype of the parameters and of the carry (default ``jnp.float32``).
    carry_init: the carry's initialiser; default ``None``: zeros (nnx warns when it is given
      here; prefer ``initialize_carry(..., carry_init=)``).
    residual: add ``h`` before the activation (default ``False``).
    activation_fn: the cell's activation (default ``jnp.tanh``).
    kernel_init: initialiser of the input kernels (default
      ``jax.nn.initializers.lecun_normal()``).
    recurrent_kernel_init: initialiser of the recurrent kernels (default
      ``jax.nn.initializers.orthogonal()``).
    bias_init: initialiser of the bias (default ``jax.nn.initializers.zeros``).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays, given to every
      ``Linear`` (default ``sr.nn.promote_dtype``).
    keep_rngs: deprecated, as in nnx: keep a ``carry`` stream for ``initialize_carry`` (default
      ``False``).
    rngs: an ``sr.Rngs``; its ``params`` stream draws the parameters.
    kernel_metadata: metadata put on the input kernels (default ``{}``: none).
    recurrent_kernel_metadata: metadata put on the recurrent kernels (default ``{}``: none).
    bias_metadata: metadata put on the bias (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``in_features`` or ``hidden_features`` is not a positive int.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> cell = sr.nn.SimpleCell(3, 4, rngs=sr.Rngs(0))
  >>> h, y = cell(cell.initialize_carry((2, 3)), jnp.ones((2, 3)))
  >>> h.shape, cell.dense_i.bias.shape, cell.dense_h.bias
  ((2, 4), (4,), None)
  """

  _checks_steps = True

  def __init__(
    self,
    in_features: int,
    hidden_features: int,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    carry_init: Initializer | None = None,
    residual: bool = False,
    activation_fn: Callable = jnp.tanh,
    kernel_init: Initializer = default_kernel_init,
    recurrent_kernel_init: Initializer = default_recurrent_kernel_init,
    bias_init: Initializer = default_bias_init,
    promote_dtype: Callable = default_promote_dtype,
    keep_rngs: bool = False,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    recurrent_kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    dense = self._setup(
      "SimpleCell", in_features, hidden_features, dtype, param_dtype, promote_dtype, rngs
    )
    self._keep_carry("SimpleCell", keep_rngs, carry_init, rngs)
    self.residual = residual
    self.activation_fn = activation_fn
    # nnx builds the recurrent layer first: the same draws from rngs.params.
    self.dense_h = dense(
      hidden_features, hidden_features, recurrent_kernel_init, recurrent_kernel_metadata
    )
    bias = (bias_init, bias_metadata)
    self.dense_i = dense(in_features, hidden_features, kernel_init, kernel_metadata, bias)

  def __call__(self, carry: jax.Array, inputs: jax.Array):
    """One step: ``(h, x) -> (h', h')``."""
    self.check_step(carry, jnp.shape(inputs))
    new = self.dense_i(inputs) + self.dense_h(carry)
    if self.residual:
      new = new + carry
    new = self.activation_fn(new)
    return new, new


class GRUCell(RNNCellBase):
  r"""A gated recurrent unit, as ``flax.nnx.GRUCell``.

  .. math::
      r = \sigma(W_{ir} x + b_{ir} + W_{hr} h), \;
      z = \sigma(W_{iz} x + b_{iz} + W_{hz} h), \;
      n = \tanh(W_{in} x + b_{in} + r \, W_{hn} h), \;
      h' = (1 - z) n + z h

  Sub-layers (nnx's names): ``dense_i`` (kernel ``(in, 3 * hidden)`` and bias, the
  parts in the order ``r, z, n``) and ``dense_h`` (kernel ``(hidden, 3 * hidden)``,
  no bias). The carry and the output are ``h'``. Other arguments as ``LSTMCell``'s
  (recurrent kernel: ``orthogonal()``).

  Args:
    in_features: size of the input's last axis.
    hidden_features: size of the hidden state (the carry's and the output's last axis).
    gate_fn: the gates' activation (default ``jax.nn.sigmoid``).
    activation_fn: the cell's activation (default ``jnp.tanh``).
    kernel_init: initialiser of the input kernels (default
      ``jax.nn.initializers.lecun_normal()``).
    recurrent_kernel_init: initialiser of the recurrent kernels (default
      ``jax.nn.initializers.orthogonal()``).
    bias_init: initialiser of the bias (default ``jax.nn.initializers.zeros``).
    dtype: computation dtype; default ``None``: promoted from the inputs and the parameters.
    param_dtype: dtype of the parameters and of the carry (default ``jnp.float32``).
    carry_init: the carry's initialiser; default ``None``: zeros (nnx warns when it is given
      here; prefer ``initialize_carry(..., carry_init=)``).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays, given to every
      ``Linear`` (default ``sr.nn.promote_dtype``).
    keep_rngs: deprecated, as in nnx: keep a ``carry`` stream for ``initialize_carry`` (default
      ``False``).
    rngs: an ``sr.Rngs``; its ``params`` stream draws the parameters.
    kernel_metadata: metadata put on the input kernels (default ``{}``: none).
    recurrent_kernel_metadata: metadata put on the recurrent kernels (default ``{}``: none).
    bias_metadata: metadata put on the bias (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``in_features`` or ``hidden_features`` is not a positive int.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> cell = sr.nn.GRUCell(3, 4, rngs=sr.Rngs(0))
  >>> h, y = cell(cell.initialize_carry((2, 3)), jnp.ones((2, 3)))
  >>> y.shape, cell.dense_i.kernel.shape, cell.dense_h.kernel.shape
  ((2, 4), (3, 12), (4, 12))
  """

  _checks_steps = True

  def __init__(
    self,
    in_features: int,
    hidden_features: int,
    *,
    gate_fn: Callable = jax.nn.sigmoid,
    activation_fn: Callable = jnp.tanh,
    kernel_init: Initializer = default_kernel_init,
    recurrent_kernel_init: Initializer = default_recurrent_kernel_init,
    bias_init: Initializer = default_bias_init,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    carry_init: Initializer | None = None,
    promote_dtype: Callable = default_promote_dtype,
    keep_rngs: bool = False,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    recurrent_kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    dense = self._setup(
      "GRUCell", in_features, hidden_features, dtype, param_dtype, promote_dtype, rngs
    )
    self._keep_carry("GRUCell", keep_rngs, carry_init, rngs)
    self.gate_fn = gate_fn
    self.activation_fn = activation_fn
    gates = 3 * hidden_features
    bias = (bias_init, bias_metadata)
    self.dense_i = dense(in_features, gates, kernel_init, kernel_metadata, bias)
    self.dense_h = dense(hidden_features, gates, recurrent_kernel_init, recurrent_kernel_metadata)

  def __call__(self, carry: jax.Array, inputs: jax.Array):
    """One step: ``(h, x) -> (h', h')``."""
    self.check_step(carry, jnp.shape(inputs))
    xi_r, xi_z, xi_n = jnp.split(self.dense_i(inputs), 3, axis=-1)
    hh_r, hh_z, hh_n = jnp.split(self.dense_h(carry), 3, axis=-1)
    r = self.gate_fn(xi_r + hh_r)
    z = self.gate_fn(xi_z + hh_z)
    n = self.activation_fn(xi_n + r * hh_n)
    new = (1.0 - z) * n + z * carry
    return new, new
