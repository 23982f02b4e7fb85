"""LinearGeneral: a dense layer over several input axes into several output axes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core._frozen import EMPTY as _EMPTY
from ..core._kinds import Param
from ..core._module import Module
from ..core._rngs import Rngs
from ._dtypes import promote_dtype as default_promote_dtype
from ._explicit import explicit_specs, sharding_like
from ._linear import Initializer, default_bias_init, default_kernel_init, not_none, promoted
from ._rngs_arg import check_rngs


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
  return tuple(x) if isinstance(x, Sequence) else (x,)


def _normalize_axes(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
  return tuple(sorted(ax if ax >= 0 else ndim + ax for ax in axes))


class LinearGeneral(Module):
  """A linear map contracting the input's ``axis`` into ``out_features`` axes.

  As ``flax.nnx.LinearGeneral``: ``kernel`` has shape ``(*batch_sizes, *in_features,
  *out_features)`` and ``bias`` ``(*batch_sizes, *out_features)``; the initialisers
  see the kernel flattened to 2-D ``(prod(batch+in), prod(out))`` (so fan-in/fan-out
  are those of the equivalent ``Linear``), then reshaped. ``MultiHeadAttention``
  builds its projections from it.

  Args:
    in_features: size(s) of the contracted input axes.
    out_features: size(s) of the output axes appended to the result.
    axis: the input axes to contract (default ``-1``), one per ``in_features``.
    batch_axis: ``{axis: size}`` of leading input axes that get their own kernel
      (batched matmul); they must be ``0, 1, ...``. Stored as a tuple of pairs
      (default ``{}``: none).
    use_bias: add ``bias`` (default ``True``).
    dtype: computation dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    kernel_init: ``init(key, shape, dtype)`` of the flattened 2-D kernel (default
      ``jax.nn.initializers.lecun_normal()``).
    bias_init: ``init(key, shape, dtype)`` of the flattened bias (default zeros).
    precision: ``lax.Precision`` of the contraction (default ``None``).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    dot_general: the contraction; default ``None``: ``lax.dot_general``.
    preferred_element_type: accumulation/output dtype passed to ``dot_general``
      (default ``None``: JAX's choice).
    rngs: draws ``rngs.params()`` for the kernel, then the bias.
    kernel_metadata: metadata put on the ``kernel`` Variable (default ``{}``: none).
    bias_metadata: metadata put on the ``bias`` Variable (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``in_features`` and ``axis`` differ in length, or the keys of
      ``batch_axis`` are not the leading axes ``0, 1, ...``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> layer = sr.nn.LinearGeneral((2, 3), (4, 5), axis=(1, -1), rngs=sr.Rngs(0))
  >>> layer.kernel.shape, layer.bias.shape, layer(jnp.ones((16, 2, 3))).shape
  ((2, 3, 4, 5), (4, 5), (16, 4, 5))
  """

  def __init__(
    self,
    in_features: int | Sequence[int],
    out_features: int | Sequence[int],
    *,
    axis: int | Sequence[int] = -1,
    batch_axis: Mapping[int, int] = _EMPTY,
    use_bias: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    precision: Any = None,
    promote_dtype: Callable = default_promote_dtype,
    dot_general: Callable | None = None,
    preferred_element_type: Any = None,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("LinearGeneral", rngs)
    self.in_features = _as_tuple(in_features)
    self.out_features = _as_tuple(out_features)
    self.axis = _as_tuple(axis)
    self.batch_axis = tuple(sorted(dict(batch_axis).items()))
    if len(self.in_features) != len(self.axis):
      raise ValueError(
        f"LinearGeneral: in_features={self.in_features} and axis={self.axis} must "
        "have the same length (one contracted axis per input feature size)."
      )
    batch_dims = tuple(ax for ax, _ in self.batch_axis)
    if batch_dims != tuple(range(len(batch_dims))):
      raise ValueError(
        f"LinearGeneral: batch_axis keys {batch_dims} must be the consecutive leading "
        "axes 0, 1, ..."
      )
    batch_shape = tuple(size for _, size in self.batch_axis)
    kernel_shape = (*batch_shape, *self.in_features, *self.out_features)
    flat = (math.prod(batch_shape) * math.prod(self.in_features), math.prod(self.out_features))
    kernel = kernel_init(rngs.params(), flat, param_dtype)
    self.kernel = Param(jnp.reshape(kernel, kernel_shape), **(kernel_metadata or {}))
    if use_bias:
      bias_shape = (*batch_shape, *self.out_features)
      bias = bias_init(rngs.params(), (math.prod(bias_shape),), param_dtype)
      self.bias = Param(jnp.reshape(bias, bias_shape), **(bias_metadata or {}))
    else:
      self.bias = None
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.promote_dtype = promote_dtype
    self.dot_general = dot_general
    self.preferred_element_type = preferred_element_type

  def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
    """Contracts ``inputs`` over ``axis``; the output axes are appended at the end.

    Under explicit mesh axes the output keeps the sharding of the input's batch and
    free axes and takes the kernel's output axes', unless ``out_sharding`` is given.
    """
    ndim = inputs.ndim
    axis = _normalize_axes(self.axis, ndim)
    # nnx pairs the sorted input axes with the kernel's input axes in order.
    if (
      any(not 0 <= ax < ndim for ax in axis)
      or tuple(inputs.shape[ax] for ax in axis) != self.in_features
    ):
      raise ValueError(
        f"LinearGeneral was built with in_features={self.in_features} on axis="
        f"{self.axis} but got an input of shape {tuple(inputs.shape)}."
      )
    batch_axis = _normalize_axes(tuple(ax for ax, _ in self.batch_axis), ndim)
    n_batch = len(batch_axis)
    # Non-contracted input axes, with 1s except on batch axes: the bias broadcast shape.
    expanded_batch_shape = tuple(
      inputs.shape[ax] if ax in batch_axis else 1 for ax in range(ndim) if ax not in axis
    )
    inputs, kernel, bias = promoted(self, inputs, self.kernel, self.bias)
    if out_sharding is None and (
      specs := explicit_specs("LinearGeneral", inputs=inputs, kernel=kernel)
    ):
      # Explicit mesh axes: dot_general's output order, batch axes, the input's free
      # axes, then the kernel's output axes.
      xs, ks = specs
      free = [xs[ax] for ax in range(ndim) if ax not in axis and ax not in batch_axis]
      out_sharding = sharding_like(
        [xs[ax] for ax in batch_axis] + free + list(ks[n_batch + len(axis) :]), specs
      )
    dot_general = self.dot_general or lax.dot_general
    kwargs = not_none(out_sharding=out_sharding, preferred_element_type=self.preferred_element_type)
    contract = tuple(range(n_batch, n_batch + len(axis)))
    out = dot_general(
      inputs,
      kernel,
      ((axis, contract), (batch_axis, tuple(range(n_batch)))),
      precision=self.precision,
      **kwargs,
    )
    if bias is not None:
      out += lax.reshape(bias, (*expanded_batch_shape, *self.out_features))  # cheap to trace
    return out
