"""ConvTranspose: the transposed (fractionally strided) convolution, as ``flax.nnx.ConvTranspose``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core._frozen import EMPTY as _EMPTY
from ..core._module import Module
from ..core._rngs import Rngs
from ._conv import canonicalize_padding, check_conv_input, conv_output, flatten_batch, per_axis
from ._dtypes import promote_dtype as default_promote_dtype
from ._linear import (
  Initializer,
  default_bias_init,
  default_kernel_init,
  freeze,
  param_maker,
  promoted,
)
from ._rngs_arg import check_rngs


class ConvTranspose(Module):
  """A transposed convolution with ``kernel`` ``(*kernel_size, in, out)`` and ``bias``.

  As ``flax.nnx.ConvTranspose`` (``lax.conv_transpose``): inputs are channels last,
  ``(*batch, *spatial, in_features)``; several batch axes are flattened for the
  convolution and restored, and an input without a batch axis is accepted. With
  ``transpose_kernel=True`` the kernel is ``(*kernel_size, out, in)``, the layout of
  the ``Conv`` it transposes, and the layer computes that convolution's gradient. Its
  output is named ``conv_out``, as ``Conv``'s (``jax.ad_checkpoint.checkpoint_name``).

  Args:
    in_features: number of input channels (the input's last axis).
    out_features: number of output channels.
    kernel_size: an int (1-D) or one size per spatial axis.
    strides: an int or one per spatial axis (default ``None``: 1), the upsampling
      factor.
    padding: ``'SAME'`` (default), ``'VALID'``, ``'CIRCULAR'`` (periodic), an int, or
      ``(low, high)`` pairs per axis, as ``lax.conv_transpose`` reads them.
    kernel_dilation: an int or one per spatial axis (default ``None``: 1).
    use_bias: add ``bias`` (default ``True``).
    dtype: computation dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    precision: ``lax.Precision`` of the convolution (default ``None``).
    kernel_init: ``init(key, shape, dtype)`` of the kernel (default
      ``jax.nn.initializers.lecun_normal()``).
    bias_init: ``init(key, shape, dtype)`` of the bias (default zeros).
    transpose_kernel: flip the kernel's spatial axes and swap its channel axes
      (default ``False``).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    preferred_element_type: accumulation/output dtype passed to the convolution
      (default ``None``: JAX's choice).
    rngs: draws ``rngs.params()`` for the kernel, then the bias.
    kernel_metadata: metadata put on the ``kernel`` Variable (default ``{}``: none).
    bias_metadata: metadata put on the ``bias`` Variable (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``padding`` is not one of the forms above.

  nnx's weight ``mask`` is not supported (an array outside any Variable), as in
  ``Conv``; ``lax.conv_transpose`` takes no ``out_sharding``, so under explicit mesh
  axes the output's sharding is jax's choice.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> up = sr.nn.ConvTranspose(3, 4, kernel_size=(3, 3), strides=2, rngs=sr.Rngs(0))
  >>> up.kernel.shape, up(jnp.ones((1, 4, 4, 3))).shape
  ((3, 3, 3, 4), (1, 8, 8, 4))
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: int | Sequence[int],
    strides: None | int | Sequence[int] = None,
    *,
    padding: Any = "SAME",
    kernel_dilation: None | int | Sequence[int] = None,
    use_bias: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    precision: Any = None,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    transpose_kernel: bool = False,
    promote_dtype: Callable = default_promote_dtype,
    preferred_element_type: Any = None,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("ConvTranspose", rngs)
    kernel_size = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
    if isinstance(padding, str) and padding not in ("SAME", "VALID", "CIRCULAR"):
      raise ValueError(
        f"ConvTranspose: padding={padding!r} is not supported; use 'SAME', 'VALID', "
        f"'CIRCULAR', an int, or a sequence of {len(kernel_size)} ints or (low, "
        "high) pairs."
      )
    canonicalize_padding(padding, len(kernel_size))  # fail early on a bad padding
    channels = (out_features, in_features) if transpose_kernel else (in_features, out_features)
    self.kernel_shape = kernel_size + channels
    param = param_maker(rngs, param_dtype)
    self.kernel = param(kernel_init, self.kernel_shape, kernel_metadata)
    self.bias = param(bias_init, (out_features,), bias_metadata) if use_bias else None
    self.in_features = in_features
    self.out_features = out_features
    self.kernel_size = kernel_size
    self.strides = freeze(strides)
    self.padding = freeze(padding)
    self.kernel_dilation = freeze(kernel_dilation)
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.transpose_kernel = transpose_kernel
    self.promote_dtype = promote_dtype
    self.preferred_element_type = preferred_element_type

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Applies the transposed convolution to ``inputs`` ``(*batch, *spatial, in_features)``."""
    check_conv_input("ConvTranspose", inputs, self.kernel_size, self.in_features, self)
    n_spatial = len(self.kernel_size)
    inputs, batch_shape = flatten_batch(inputs, n_spatial)
    strides = per_axis(self.strides, n_spatial)
    padding = canonicalize_padding(self.padding, n_spatial)
    inputs, kernel, bias = promoted(self, inputs, self.kernel, self.bias)
    y = lax.conv_transpose(
      inputs,
      kernel,
      strides,
      "VALID" if padding == "CIRCULAR" else padding,
      rhs_dilation=per_axis(self.kernel_dilation, n_spatial),
      transpose_kernel=self.transpose_kernel,
      precision=self.precision,
      preferred_element_type=self.preferred_element_type,
    )
    if padding == "CIRCULAR":
      y = self._wrap(y, [n * s for n, s in zip(inputs.shape[1:-1], strides)])
    return conv_output(y, bias, batch_shape)

  def _wrap(self, y: jax.Array, periods: list[int]) -> jax.Array:
    """Folds the full transposed convolution onto ``periods`` (input size x stride)
    along each spatial axis: the circular result.

    ``y`` is padded to two periods per axis so the input starts a whole number of
    periods in (otherwise the result is shifted), then summed over the periods.
    With ``transpose_kernel`` the odd pad goes right, mirroring ``Conv``'s
    ``'CIRCULAR'``, so the layer is that convolution's transpose; otherwise left.
    """
    pads = []
    for size, period in zip(y.shape[1:-1], periods):
      extra = -(size - period) % (2 * period)
      pads.append(
        (extra // 2, (extra + 1) // 2) if self.transpose_kernel else ((extra + 1) // 2, extra // 2)
      )
    y = jnp.pad(y, [(0, 0)] + pads + [(0, 0)])
    for i, period in enumerate(periods, start=1):
      y = y.reshape(y.shape[:i] + (-1, period) + y.shape[i + 1 :]).sum(axis=i)
    return y
