"""Pooling functions, as ``flax.nnx`` exports them (``flax.linen.pooling``'s).

Inputs are channels-last, ``(*batch, *window dims, features)``: a window reduces over
the ``len(window_shape)`` axes before the last, each batch axis and the feature axis
pooled one by one, and an input without a batch axis is accepted. ``padding`` is
``'SAME'``, ``'VALID'`` (the default) or one ``(low, high)`` pair per window axis.

>>> import jax.numpy as jnp, statefulremat as sr
>>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
>>> sr.nn.max_pool(x, (2, 2), strides=(2, 2))[0, :, :, 0].tolist()
[[5.0, 7.0], [13.0, 15.0]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ._conv import per_axis


def _window(name: str, window_shape: Any, strides: Any, padding: Any, inputs: jax.Array) -> tuple:
  """``window_shape``, ``strides`` and ``padding`` checked against ``inputs``."""
  if isinstance(window_shape, int) or not all(isinstance(w, int) for w in window_shape):
    raise TypeError(
      f"{name}: window_shape must be a tuple of ints, one per window axis, got "
      f"{window_shape!r}. Fix: e.g. `window_shape=(2, 2)` for 2-D pooling (as "
      "flax, not an int)."
    )
  window_shape = tuple(window_shape)
  if not jnp.issubdtype(inputs.dtype, jnp.inexact):
    raise TypeError(
      f"{name}: inputs must be floating point (the window's reduction starts from a "
      f"float: 0.0 or +-inf), got an input of dtype {inputs.dtype} and shape "
      f"{tuple(inputs.shape)}. Fix: `x.astype(jnp.float32)`."
    )
  n = len(window_shape)
  strides = per_axis(strides, n)
  if len(strides) != n:
    raise ValueError(
      f"{name}: strides={strides} has {len(strides)} entries but window_shape="
      f"{window_shape} has {n}. Fix: give one stride per window axis."
    )
  if inputs.ndim < n + 1:
    dims = ", ".join(f"s{i}" for i in range(n))
    raise ValueError(
      f"{name}: window_shape={window_shape} pools {n} axes, so inputs must be "
      f"(*batch, {dims}, features), of rank at least {n + 1}, but got an input of "
      f"shape {tuple(inputs.shape)}. Fix: keep the feature axis last, e.g. "
      f"`x[..., None]` for a single feature."
    )
  if not isinstance(padding, str):
    pairs = tuple(tuple(p) for p in padding)
    if len(pairs) != n or any(len(p) != 2 for p in pairs):
      raise ValueError(
        f"{name}: padding={padding!r} must be 'SAME', 'VALID' or {n} (low, high) "
        f"pairs, one per window axis of window_shape={window_shape}."
      )
    padding = pairs
  return window_shape, strides, padding


def pool(
  inputs: jax.Array,
  init: Any,
  reduce_fn: Callable,
  window_shape: Sequence[int],
  strides: Sequence[int] | None,
  padding: Any,
) -> jax.Array:
  """Reduces each window of ``inputs`` with ``reduce_fn`` from ``init`` (``lax.reduce_window``).

  Args:
    inputs: ``(*batch, *window dims, features)``, a float array.
    init: the reduction's initial value (e.g. ``0.0`` for a sum).
    reduce_fn: ``(T, T) -> T``, e.g. ``lax.add``.
    window_shape: the window, a tuple of ints, one size per window axis.
    strides: an int or one stride per window axis; ``None``: all 1.
    padding: ``'SAME'``, ``'VALID'`` or ``(low, high)`` pairs per window axis.

  Returns:
    The reduced windows, ``(*batch, *pooled window dims, features)``.

  Raises:
    TypeError: when ``window_shape`` is not a tuple of ints, or ``inputs`` is not float.
    ValueError: when ``strides`` or ``padding`` does not give one entry per window axis,
      or ``inputs`` has fewer than ``len(window_shape) + 1`` axes.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> from jax import lax
  >>> sr.nn.pool(jnp.ones((4, 1)), 0.0, lax.add, (2,), None, "VALID")[:, 0].tolist()
  [2.0, 2.0, 2.0]
  """
  return _pool("pool", inputs, init, reduce_fn, window_shape, strides, padding)


def _pool(name, inputs, init, reduce_fn, window_shape, strides, padding) -> jax.Array:
  """``pool``, its arguments checked by ``_window`` (``name`` leads its errors)."""
  window_shape, strides, padding = _window(name, window_shape, strides, padding, inputs)
  n_batch = inputs.ndim - len(window_shape) - 1
  dims = (1,) * n_batch + window_shape + (1,)
  strides = (1,) * n_batch + strides + (1,)
  if not isinstance(padding, str):
    padding = ((0, 0),) * n_batch + padding + ((0, 0),)
  return lax.reduce_window(inputs, init, reduce_fn, dims, strides, padding)


def avg_pool(
  inputs: jax.Array,
  window_shape: Sequence[int],
  strides: Sequence[int] | None = None,
  padding: Any = "VALID",
  count_include_pad: bool = True,
) -> jax.Array:
  """The mean of each window.

  Args:
    inputs: ``(*batch, *window dims, features)``, a float array.
    window_shape: the window, a tuple of ints, one size per window axis.
    strides: an int or one stride per window axis; default ``None``: all 1.
    padding: ``'SAME'``, ``'VALID'`` (default) or ``(low, high)`` pairs per window axis.
    count_include_pad: divide by the full window size, padding included (default
      ``True``), or by the number of real entries in the window (``False``).

  Returns:
    The window means, ``(*batch, *pooled window dims, features)``.

  Raises:
    TypeError: when ``window_shape`` is not a tuple of ints, or ``inputs`` is not float.
    ValueError: when ``strides`` or ``padding`` does not give one entry per window axis,
      or ``inputs`` has fewer than ``len(window_shape) + 1`` axes.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> x = jnp.array([1.0, 2.0, 3.0])[:, None]
  >>> sr.nn.avg_pool(x, (2,), padding="SAME")[:, 0].tolist()
  [1.5, 2.5, 1.5]
  >>> sr.nn.avg_pool(x, (2,), padding="SAME", count_include_pad=False)[:, 0].tolist()
  [1.5, 2.5, 3.0]
  """
  y = _pool("avg_pool", inputs, 0.0, lax.add, window_shape, strides, padding)
  if count_include_pad:
    return y / math.prod(window_shape)
  # The count of real entries per window depends only on the window axes.
  n = len(window_shape)
  ones = jnp.ones((1,) * (inputs.ndim - n - 1) + inputs.shape[-n - 1 : -1] + (1,))
  return y / _pool("avg_pool", ones, 0.0, lax.add, window_shape, strides, padding)


def max_pool(
  inputs: jax.Array,
  window_shape: Sequence[int],
  strides: Sequence[int] | None = None,
  padding: Any = "VALID",
) -> jax.Array:
  """The maximum of each window (padding counts as ``-inf``); arguments as ``pool``.

  Args:
    inputs: ``(*batch, *window dims, features)``, a float array.
    window_shape: the window, a tuple of ints, one size per window axis.
    strides: an int or one stride per window axis; default ``None``: all 1.
    padding: ``'SAME'``, ``'VALID'`` (default) or ``(low, high)`` pairs per window axis.

  Returns:
    The window maxima, ``(*batch, *pooled window dims, features)``.

  Raises:
    TypeError: when ``window_shape`` is not a tuple of ints, or ``inputs`` is not float.
    ValueError: when ``strides`` or ``padding`` does not give one entry per window axis,
      or ``inputs`` has fewer than ``len(window_shape) + 1`` axes.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.nn.max_pool(jnp.array([[1.0], [3.0], [2.0]]), (2,))[:, 0].tolist()
  [3.0, 3.0]
  """
  return _pool("max_pool", inputs, -jnp.inf, lax.max, window_shape, strides, padding)


def min_pool(
  inputs: jax.Array,
  window_shape: Sequence[int],
  strides: Sequence[int] | None = None,
  padding: Any = "VALID",
) -> jax.Array:
  """The minimum of each window (padding counts as ``inf``); arguments as ``pool``.

  Args:
    inputs: ``(*batch, *window dims, features)``, a float array.
    window_shape: the window, a tuple of ints, one size per window axis.
    strides: an int or one stride per window axis; default ``None``: all 1.
    padding: ``'SAME'``, ``'VALID'`` (default) or ``(low, high)`` pairs per window axis.

  Returns:
    The window minima, ``(*batch, *pooled window dims, features)``.

  Raises:
    TypeError: when ``window_shape`` is not a tuple of ints, or ``inputs`` is not float.
    ValueError: when ``strides`` or ``padding`` does not give one entry per window axis,
      or ``inputs`` has fewer than ``len(window_shape) + 1`` axes.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.nn.min_pool(jnp.array([[1.0], [3.0], [2.0]]), (2,))[:, 0].tolist()
  [1.0, 2.0]
  """
  return _pool("min_pool", inputs, jnp.inf, lax.min, window_shape, strides, padding)
