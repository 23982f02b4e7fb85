"""Einsum: a learned contraction ``jnp.einsum(einsum_str, inputs, kernel) + bias``, as ``flax.nnx.Einsum``."""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..core._frozen import EMPTY as _EMPTY
from ..core._module import Module
from ..core._rngs import Rngs
from ._dtypes import promote_dtype as default_promote_dtype
from ._linear import (
  Initializer,
  default_bias_init,
  default_kernel_init,
  located,
  not_none,
  param_maker,
  promoted,
  shape_str,
)
from ._rngs_arg import check_rngs


def _check_einsum_str(einsum_str: str, where: str = "Einsum") -> str:
  """``einsum_str`` without spaces; raises unless it is ``'lhs,rhs->out'``."""
  if not isinstance(einsum_str, str):
    raise TypeError(
      f"{where}: einsum_str must be a string such as '...d,dh->...h', got {einsum_str!r}."
    )
  einsum_str = einsum_str.replace(" ", "")
  if "->" not in einsum_str:
    raise ValueError(
      f"{where}: einsum_str={einsum_str!r} must be explicit, with '->' and the "
      f"output's axes, e.g. {einsum_str + '->...'!r} spelled out."
    )
  if einsum_str.count(",") != 1:
    raise ValueError(
      f"{where}: einsum_str={einsum_str!r} must have exactly two operands, the input "
      f"and the kernel (one ','), not {einsum_str.count(',') + 1}."
    )
  return einsum_str


def _expand(term: str, ndim: int, fill: str) -> str:
  """``term`` with ``...`` replaced by the last ``ndim - (letters)`` letters of ``fill``."""
  if "..." not in term:
    return term
  n = ndim - (len(term) - 3)
  return term.replace("...", fill[len(fill) - n :] if n > 0 else "")


class Einsum(Module):
  """A ``kernel`` of ``kernel_shape`` contracted with the input by ``einsum_str``.

  As ``flax.nnx.Einsum``: ``y = einsum(einsum_str, inputs, kernel)``, plus a ``bias``
  of ``bias_shape`` (if given) broadcast over the output's axes that come from the
  kernel. ``einsum_str`` names the input first and the kernel second, and must be
  explicit (``'->'``); the call may give another one.

  Args:
    einsum_str: e.g. ``'btd,dnh->btnh'``: the input's axes, the kernel's, then the
      output's.
    kernel_shape: the kernel's shape, one size per kernel letter.
    bias_shape: the bias's shape (the output's kernel axes, in order); default ``None``:
      no bias.
    dtype: computation dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    precision: ``lax.Precision`` of the contraction (default ``None``).
    kernel_init: ``init(key, shape, dtype)`` of the kernel (default
      ``jax.nn.initializers.lecun_normal()``).
    bias_init: ``init(key, shape, dtype)`` of the bias (default zeros).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    einsum_op: the contraction (default ``jnp.einsum``).
    preferred_element_type: accumulation/output dtype passed to ``einsum_op`` (default
      ``None``: JAX's choice).
    rngs: draws ``rngs.params()`` for the kernel, then the bias.
    kernel_metadata: metadata put on the ``kernel`` Variable (default ``{}``: none).
    bias_metadata: metadata put on the ``bias`` Variable (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``, or ``einsum_str`` is not a string.
    ValueError: when ``einsum_str`` has no ``'->'`` or not exactly two operands, or its
      kernel term does not have one letter per ``kernel_shape`` entry.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> layer = sr.nn.Einsum("btd,dnh->btnh", (8, 2, 4), (2, 4), rngs=sr.Rngs(0))
  >>> layer(jnp.ones((3, 5, 8))).shape
  (3, 5, 2, 4)
  """

  def __init__(
    self,
    einsum_str: str,
    kernel_shape: Sequence[int],
    bias_shape: Sequence[int] | None = None,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    precision: Any = None,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    promote_dtype: Callable = default_promote_dtype,
    einsum_op: Callable = jnp.einsum,
    preferred_element_type: Any = None,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("Einsum", rngs)
    einsum_str = _check_einsum_str(einsum_str)
    kernel_shape = tuple(kernel_shape)
    kernel_term = einsum_str.split("->")[0].split(",")[1]
    if "..." not in kernel_term and len(kernel_term) != len(kernel_shape):
      raise ValueError(
        f"Einsum: einsum_str={einsum_str!r} names {len(kernel_term)} kernel axes "
        f"('{kernel_term}') but kernel_shape={kernel_shape} has {len(kernel_shape)}. "
        "Fix: one kernel_shape entry per letter of the second operand."
      )
    bias_shape = None if bias_shape is None else tuple(bias_shape)
    param = param_maker(rngs, param_dtype)
    self.kernel = param(kernel_init, kernel_shape, kernel_metadata)
    self.bias = None if bias_shape is None else param(bias_init, bias_shape, bias_metadata)
    self.einsum_str = einsum_str
    self.kernel_shape = kernel_shape
    self.bias_shape = bias_shape
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.promote_dtype = promote_dtype
    self.einsum_op = einsum_op
    self.preferred_element_type = preferred_element_type

  def __call__(
    self, inputs: jax.Array, einsum_str: str | None = None, out_sharding: Any = None
  ) -> jax.Array:
    """Contracts ``inputs`` with the kernel by ``einsum_str`` (default: the layer's)."""
    einsum_str = _check_einsum_str(self.einsum_str if einsum_str is None else einsum_str)
    lhs, rhs, out = self._terms(einsum_str, jnp.ndim(inputs))
    self._check_input(einsum_str, lhs, rhs, inputs)
    inputs, kernel, bias = promoted(self, inputs, self.kernel, self.bias)
    kwargs = not_none(out_sharding=out_sharding, preferred_element_type=self.preferred_element_type)
    y = self.einsum_op(einsum_str, inputs, kernel, precision=self.precision, **kwargs)
    if bias is not None:
      # The bias covers the output's axes that come from the kernel, in their order.
      shape = [self.kernel_shape[rhs.index(c)] if c in rhs else 1 for c in out]
      y += jnp.reshape(bias, shape)
    return y

  def _terms(self, einsum_str: str, ndim: int) -> tuple[str, str, str]:
    """The input's, the kernel's and the output's letters, ``...`` spelled out."""
    operands, out = einsum_str.split("->")
    lhs, rhs = operands.split(",")
    unused = "".join(c for c in string.ascii_letters if c not in einsum_str)
    n_lhs = ndim - (len(lhs) - 3) if "..." in lhs else 0
    n_rhs = len(self.kernel_shape) - (len(rhs) - 3) if "..." in rhs else 0
    lhs = _expand(lhs, ndim, unused)
    rhs = _expand(rhs, len(self.kernel_shape), unused)
    out = _expand(out, max(n_lhs, n_rhs) + len(out) - 3, unused)
    return lhs, rhs, out

  def _check_input(self, einsum_str: str, lhs: str, rhs: str, inputs) -> None:
    """Raises, naming the layer's path and the expected shape, when ``inputs`` does
    not fit ``lhs`` (rank, or a size shared with the kernel)."""
    shape = tuple(jnp.shape(inputs))
    kernel_size = dict(zip(rhs, self.kernel_shape))
    if len(lhs) == len(shape):
      want = [kernel_size.get(c, n) for c, n in zip(lhs, shape)]
      if tuple(want) == shape:
        return
    else:
      want = [kernel_size.get(c, c) for c in lhs]
    raise ValueError(
      located(
        f"Einsum {einsum_str!r} with a kernel of shape {self.kernel_shape} got an "
        f"input of shape {shape}; expected shape {shape_str(want)} (input axes '{lhs}': "
        "the sizes of the letters it shares with the kernel must match the kernel's). "
        "Fix the input, or the einsum_str / kernel_shape the layer was built with.",
        self,
      )
    )
