"""Conv and ConvTranspose: N-d convolutions over channels-last inputs, as
``flax.nnx.Conv`` and ``flax.nnx.ConvTranspose``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from ..core._frozen import EMPTY as _EMPTY
from ..core._module import Module
from ..core._rngs import Rngs
from ._dtypes import promote_dtype as default_promote_dtype
from ._explicit import explicit_specs, sharding_like
from ._linear import (
  Initializer,
  add_bias,
  default_bias_init,
  default_kernel_init,
  freeze,
  located,
  not_none,
  param_maker,
  promoted,
)
from ._rngs_arg import check_rngs


def per_axis(x, rank: int) -> tuple[int, ...]:
  """A stride or dilation as one int per spatial axis (``None`` is 1)."""
  x = 1 if x is None else x
  return (x,) * rank if isinstance(x, int) else tuple(x)


def flatten_batch(inputs: jax.Array, n_spatial: int) -> tuple[jax.Array, tuple]:
  """``inputs`` ``(*batch, *spatial, features)`` with its batch axes combined into one
  leading axis, and the shape of those batch axes (none, one or several)."""
  batch_shape = inputs.shape[: inputs.ndim - n_spatial - 1]
  if len(batch_shape) != 1:
    inputs = jnp.reshape(inputs, (-1,) + inputs.shape[len(batch_shape) :])
  return inputs, batch_shape


def conv_output(y: jax.Array, bias: jax.Array | None, batch_shape: tuple) -> jax.Array:
  """A convolution's output plus ``bias``, its batch axes restored to ``batch_shape``,
  named ``conv_out`` (a convolution is no dot: ``dots_saveable`` skips it)."""
  y = add_bias(y, bias)
  if len(batch_shape) != 1:
    y = jnp.reshape(y, batch_shape + y.shape[1:])
  return checkpoint_name(y, "conv_out")


def canonicalize_padding(padding: Any, rank: int) -> Any:
  """A padding string as is, or ``rank`` ``(low, high)`` pairs for ``lax``.

  >>> from statefulremat.nn._conv import canonicalize_padding
  >>> canonicalize_padding(1, 2), canonicalize_padding((1, (0, 2)), 2)
  (((1, 1), (1, 1)), ((1, 1), (0, 2)))
  """
  if isinstance(padding, str):
    return padding
  if isinstance(padding, int):
    return ((padding, padding),) * rank
  if isinstance(padding, Sequence) and len(padding) == rank:
    if all(isinstance(p, int) or (isinstance(p, Sequence) and len(p) == 2) for p in padding):
      return tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
  raise ValueError(
    f"invalid Conv padding {padding!r}: use 'SAME', 'VALID', 'CIRCULAR', 'REFLECT', "
    f"'CAUSAL', an int, or a sequence of {rank} ints or (low, high) pairs."
  )


def check_conv_input(
  layer: str, inputs: jax.Array, kernel_size: tuple, in_features: int, module: Any = None
) -> None:
  """Raises a ValueError naming ``module``'s path and the expected shape unless
  ``inputs`` is ``(*batch, *spatial, in_features)`` with one spatial axis per entry
  of ``kernel_size``.

  An input laid out channels-first (PyTorch's NCHW), ``(*batch, in_features,
  *spatial)``, gets the transpose that fixes it instead of a misleading
  ``in_features=<width>``.

  >>> import jax.numpy as jnp
  >>> from statefulremat.nn._conv import check_conv_input
  >>> try:
  ...   check_conv_input("Conv", jnp.zeros((8, 3, 32, 32)), (3, 3), 3)
  ... except ValueError as e:
  ...   print(str(e)[str(e).index("Fix"):])
  Fix: move the channel axis last, `jnp.moveaxis(x, 1, -1)` (the same as
  `x.transpose(0, 2, 3, 1)`), once on the data; outputs are channels-last too.
  """
  n_spatial, shape = len(kernel_size), tuple(inputs.shape)
  if inputs.ndim < n_spatial + 1:
    spatial = ", ".join(f"s{i}" for i in range(n_spatial))
    raise ValueError(
      located(
        f"{layer} with kernel_size={kernel_size} needs inputs of shape (*batch, "
        f"{spatial}, {in_features}), channels-last, of rank at least {n_spatial + 1}, "
        f"but got one of shape {shape}. Fix: add the "
        f"missing spatial axes (a 1-D sequence of length n is (batch, n, "
        f"{in_features})).",
        module,
      )
    )
  if shape[-1] == in_features:
    return
  channel = len(shape) - n_spatial - 1  # where channels-first inputs hold them
  if shape[channel] == in_features:
    perm = tuple(i for i in range(len(shape)) if i != channel) + (channel,)
    names = {1: "W", 2: "HW", 3: "DHW"}.get(n_spatial, "")
    layout = f" (N{names}C, as flax; not PyTorch's NC{names})" if names else ""
    raise ValueError(
      located(
        f"{layer} takes channels-last inputs{layout}: (*batch, *spatial, in_features="
        f"{in_features}), but got an input of shape {shape}, whose axis "
        f"{channel} has the {in_features} channels (channels-first). Fix: move the "
        f"channel axis last, `jnp.moveaxis(x, {channel}, -1)` (the same as "
        f"`x.transpose{perm}`), once on the data; outputs are channels-last too.",
        module,
      )
    )
  raise ValueError(
    located(
      f"{layer} was built with in_features={in_features} but got an input of shape "
      f"{shape}: inputs are channels-last, (*batch, *spatial, channels), so "
      f"the last axis must have size {in_features}. Expected shape: "
      f"{shape[:-1] + (in_features,)}. Fix the input, or build the layer with "
      f"in_features={shape[-1]}.",
      module,
    )
  )


class Conv(Module):
  """A convolution with ``kernel`` ``(*kernel_size, in // groups, out)`` and ``bias``.

  As ``flax.nnx.Conv`` (wrapping ``lax.conv_general_dilated``): inputs are channels
  last, ``(*batch, *spatial, in_features)``; several batch axes are flattened for
  the convolution and restored, and an input without a batch axis is accepted.

  Its output (bias added) is named ``conv_out`` (``jax.ad_checkpoint.checkpoint_name``):
  ``jax.checkpoint_policies.save_only_these_names("conv_out")`` saves the convolutions
  of a block, as ``dots_saveable`` (which skips convolutions) saves its matmuls.

  Args:
    in_features: number of input channels (the input's last axis).
    out_features: number of output channels.
    kernel_size: an int (1-D) or one size per spatial axis.
    strides: an int or one per spatial axis (default ``1``; ``None`` means 1).
    padding: ``'SAME'`` (default), ``'VALID'``, ``'CIRCULAR'`` (periodic),
      ``'REFLECT'``, ``'CAUSAL'`` (1-D, left padding), an int, or ``(low, high)``
      pairs per axis.
    input_dilation: an int or one per spatial axis (default ``1``; ``None`` means 1);
      ``input_dilation`` d is a transposed convolution of stride d.
    kernel_dilation: an int or one per spatial axis (default ``1``; ``None`` means 1):
      the spacing of the kernel's taps (atrous convolution).
    feature_group_count: split the channels into this many groups (default ``1``;
      depthwise when equal to ``in_features``).
    use_bias: add ``bias`` (default ``True``).
    dtype: computation dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    precision: ``lax.Precision`` of the convolution (default ``None``).
    kernel_init: ``init(key, shape, dtype)`` of the kernel (default
      ``jax.nn.initializers.lecun_normal()``).
    bias_init: ``init(key, shape, dtype)`` of the bias (default zeros).
    conv_general_dilated: the convolution (default ``lax.conv_general_dilated``).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    preferred_element_type: accumulation/output dtype passed to the convolution
      (default ``None``: JAX's choice).
    rngs: draws ``rngs.params()`` for the kernel, then the bias.
    kernel_metadata: metadata put on the ``kernel`` Variable (default ``{}``: none).
    bias_metadata: metadata put on the ``bias`` Variable (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``in_features`` or ``out_features`` is not divisible by
      ``feature_group_count``, or ``padding`` is not one of the forms above.

  nnx's weight ``mask`` argument is not supported (it would be an array attribute
  outside any Variable); multiply the kernel yourself if you need one.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> conv = sr.nn.Conv(3, 4, kernel_size=(3, 3), strides=2, padding="CIRCULAR",
  ...                   rngs=sr.Rngs(0))
  >>> conv.kernel.shape, conv(jnp.ones((1, 8, 8, 3))).shape
  ((3, 3, 3, 4), (1, 4, 4, 4))
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: int | Sequence[int],
    strides: None | int | Sequence[int] = 1,
    *,
    padding: Any = "SAME",
    input_dilation: None | int | Sequence[int] = 1,
    kernel_dilation: None | int | Sequence[int] = 1,
    feature_group_count: int = 1,
    use_bias: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    precision: Any = None,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    conv_general_dilated: Callable = lax.conv_general_dilated,
    promote_dtype: Callable = default_promote_dtype,
    preferred_element_type: Any = None,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("Conv", rngs)
    kernel_size = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
    if in_features % feature_group_count or out_features % feature_group_count:
      raise ValueError(
        f"Conv: in_features={in_features} and out_features={out_features} must both "
        f"be divisible by feature_group_count={feature_group_count}."
      )
    canonicalize_padding(padding, len(kernel_size))  # fail early on a bad padding
    self.kernel_shape = kernel_size + (in_features // feature_group_count, out_features)
    param = param_maker(rngs, param_dtype)
    self.kernel = param(kernel_init, self.kernel_shape, kernel_metadata)
    self.bias = param(bias_init, (out_features,), bias_metadata) if use_bias else None
    self.in_features = in_features
    self.out_features = out_features
    self.kernel_size = kernel_size
    self.strides = freeze(strides)
    self.padding = freeze(padding)
    self.input_dilation = freeze(input_dilation)
    self.kernel_dilation = freeze(kernel_dilation)
    self.feature_group_count = feature_group_count
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.conv_general_dilated = conv_general_dilated
    self.promote_dtype = promote_dtype
    self.preferred_element_type = preferred_element_type

  def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
    """Convolves ``inputs`` of shape ``(*batch, *spatial, in_features)``.

    Under explicit mesh axes the output keeps the input's batch (and spatial)
    sharding and takes the kernel's output-channel sharding, unless ``out_sharding``
    is given.
    """
    n_spatial = len(self.kernel_size)
    check_conv_input("Conv", inputs, self.kernel_size, self.in_features, self)
    inputs, batch_shape = flatten_batch(inputs, n_spatial)
    strides = per_axis(self.strides, n_spatial)
    input_dilation = per_axis(self.input_dilation, n_spatial)
    kernel_dilation = per_axis(self.kernel_dilation, n_spatial)

    padding = canonicalize_padding(self.padding, n_spatial)
    if padding in ("CIRCULAR", "REFLECT"):
      dilated = [(k - 1) * d + 1 for k, d in zip(self.kernel_size, kernel_dilation)]
      pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
      mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
      inputs = jnp.pad(inputs, pads, mode=mode)
      padding = "VALID"
    elif padding == "CAUSAL":
      if n_spatial != 1:
        raise ValueError("Conv: 'CAUSAL' padding is only implemented for 1-D convolutions.")
      left = kernel_dilation[0] * (self.kernel_size[0] - 1)
      inputs = jnp.pad(inputs, [(0, 0), (left, 0), (0, 0)])
      padding = "VALID"

    ndim = inputs.ndim
    lhs_spec = (0, ndim - 1) + tuple(range(1, ndim - 1))
    rhs_spec = (ndim - 1, ndim - 2) + tuple(range(0, ndim - 2))
    dimension_numbers = lax.ConvDimensionNumbers(lhs_spec, rhs_spec, lhs_spec)

    inputs, kernel, bias = promoted(self, inputs, self.kernel, self.bias)
    if out_sharding is None and (specs := explicit_specs("Conv", inputs=inputs, kernel=kernel)):
      # Explicit mesh axes: the input's batch (and spatial) axes, the kernel's output
      # channels.
      out_sharding = sharding_like(specs[0][:-1] + specs[1][-1:], specs)
    kwargs = not_none(out_sharding=out_sharding, preferred_element_type=self.preferred_element_type)
    y = self.conv_general_dilated(
      inputs,
      kernel,
      strides,
      padding,
      lhs_dilation=input_dilation,
      rhs_dilation=kernel_dilation,
      dimension_numbers=dimension_numbers,
      feature_group_count=self.feature_group_count,
      precision=self.precision,
      **kwargs,
    )
    return conv_output(y, bias, batch_shape)


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
