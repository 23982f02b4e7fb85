"""Dtype promotion shared by the layers, with flax.nnx's rules.

A layer computes in ``dtype`` when one is given, else in the promoted dtype of its
inputs and parameters (``jnp.result_type``), raised to a float when ``inexact`` (an
integer input to a float layer computes in float32, not in int).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def canonicalize_dtype(*args: Any, dtype: Any = None, inexact: bool = True) -> Any:
  """The dtype ``args`` should be cast to: ``dtype`` if given, else their promotion.

  Args:
    *args: arrays (or scalars, dtypes); ``None`` entries are skipped.
    dtype: the dtype to use; default ``None``: ``jnp.result_type`` of ``args``.
    inexact: whether the result must be a float or complex type (default ``True``): a
      promoted integer dtype is raised to at least ``jnp.float32``.

  Returns:
    The dtype, as a numpy ``dtype`` (or ``dtype`` itself when given).

  Raises:
    ValueError: when ``inexact`` is ``True`` and the given ``dtype`` is not a float type.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.nn.canonicalize_dtype(jnp.ones(2, jnp.int32), None)
  dtype('float32')
  """
  if dtype is None:
    dtype = jnp.result_type(*[jnp.asarray(x) for x in args if x is not None])
    if inexact and not jnp.issubdtype(dtype, jnp.inexact):
      dtype = jnp.promote_types(jnp.float32, dtype)
  if inexact and not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(f"a layer's computation dtype must be a float type, got {dtype}.")
  return dtype


def promote_dtype(args: tuple, /, *, dtype: Any = None, inexact: bool = True) -> tuple:
  """Casts every array of ``args`` (``None`` passes through) to one common dtype.

  The signature is flax.nnx's ``promote_dtype``, so either can be passed as a layer's
  ``promote_dtype``.

  Args:
    args: a tuple of arrays and ``None`` entries (positional only).
    dtype: the dtype to cast to; default ``None``: the promotion of ``args`` (see
      ``canonicalize_dtype``).
    inexact: whether the common dtype must be a float type (default ``True``).

  Returns:
    A tuple of the same length, each array cast to the common dtype, ``None`` kept.

  Raises:
    ValueError: when ``inexact`` is ``True`` and the given ``dtype`` is not a float type.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> x, w, b = sr.nn.promote_dtype((jnp.ones(2, jnp.bfloat16), jnp.ones(2), None))
  >>> x.dtype, w.dtype, b
  (dtype('float32'), dtype('float32'), None)
  """
  if dtype is None and _one_float_dtype(args):
    return args  # the common case, already promoted: no jnp calls while tracing
  dtype = canonicalize_dtype(*args, dtype=dtype, inexact=inexact)
  return tuple(None if x is None else jnp.asarray(x, dtype) for x in args)


def _one_float_dtype(args: tuple) -> bool:
  """Whether every array of ``args`` is a jax array of one float dtype, none weakly
  typed (``jnp.asarray`` would make it strong)."""
  dtypes = set()
  for x in args:
    if x is None:
      continue
    aval = getattr(x, "aval", None)
    if not isinstance(x, jax.Array) or aval is None or aval.weak_type:
      return False
    dtypes.add(x.dtype)
  return len(dtypes) <= 1 and all(jnp.issubdtype(dtype, jnp.inexact) for dtype in dtypes)
