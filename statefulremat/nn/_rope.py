"""Rotary position embeddings (RoPE), as Gemma and Llama apply them to queries and keys.

The "rotate half" convention of flax's Gemma example (``examples/gemma/
positional_embeddings.py``, ``apply_rope``) and of Hugging Face's Llama
(``rotate_half``): the head dimension is split into two halves ``x1 = x[..., :d/2]``,
``x2 = x[..., d/2:]``, and pair ``(x1[i], x2[i])`` is rotated by the angle
``position / base ** (2 i / d)``. (The other convention, GPT-J's and the RoFormer
paper's, rotates adjacent pairs ``(x[2i], x[2i+1])``; weights trained with one do not
work with the other.)
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np


def is_real(x) -> bool:
  """Whether ``x`` is a real number (a ``bool`` is not)."""
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_rope_input(where: str, x: jax.Array, fix: str) -> None:
  """Raises a ValueError, prefixed by ``where``, unless ``x`` is a float
  ``[..., length, heads, head_dim]`` with an even ``head_dim``."""
  if x.ndim < 3:
    raise ValueError(
      f"{where}: rope rotates queries or keys of shape [batch..., length, heads, "
      f"head_dim], got shape {tuple(x.shape)}. Fix: add the missing axes (a single "
      f"head is `x[..., None, :]`)."
    )
  if x.shape[-1] % 2:
    raise ValueError(
      f"{where}: rope rotates pairs of the head dimension, but head_dim="
      f"{x.shape[-1]} (shape {tuple(x.shape)}) is odd. Fix: {fix}"
    )
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(
      f"{where}: rope rotates float features, got dtype {x.dtype} (shape "
      f"{tuple(x.shape)}). Fix: cast to a float dtype first, e.g. "
      "`x.astype(jnp.float32)`."
    )


def check_positions(where: str, positions: jax.Array, x_shape: tuple) -> None:
  """Raises a ValueError, prefixed by ``where``, unless ``positions`` fits queries or
  keys of shape ``x_shape`` ``[batch..., length, heads, head_dim]``: shape ``[length]``
  or ``[batch..., length]`` (broadcastable to ``x_shape[:-2]``), real numbers."""
  shape = tuple(np.shape(positions))
  expected = tuple(x_shape[:-2])
  batch, length = expected[:-1], expected[-1]
  fits = (
    len(shape) >= 1
    and len(shape) <= len(expected)
    and shape[-1] == length
    and all(p in (1, b) for p, b in zip(shape[-2::-1], batch[::-1]))
  )
  if not fits:
    raise ValueError(
      f"{where}: positions has shape {shape} but the queries/keys it rotates have "
      f"shape {tuple(x_shape)}: expected positions of shape {expected} or "
      f"({length},), one position per token. Fix: pass one position per token, e.g. "
      f"`positions=jnp.arange({length})` (batch rows may share it)."
    )
  dtype = jnp.result_type(positions)
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise ValueError(
      f"{where}: positions must be integers (or floats), got dtype {dtype}. Fix: "
      "pass token positions such as `jnp.arange(length)`."
    )


def rope(
  x: jax.Array, positions: jax.Array, *, base: float = 10000.0, scale_factor: float = 1.0
) -> jax.Array:
  """Rotary position embeddings of queries or keys, Gemma's and Llama's "rotate half".

  With ``d = head_dim``, ``x1, x2 = x[..., :d/2], x[..., d/2:]`` and the angle
  ``theta[..., i] = positions[...] / base ** (2 i / d) / scale_factor``, it returns
  ``concat([x1 cos(theta) - x2 sin(theta), x2 cos(theta) + x1 sin(theta)], -1)``,
  the same for every head. The angles are computed in float32 and the result is cast
  back to ``x``'s dtype. The dot product of a rotated query at position ``m`` and a
  rotated key at position ``n`` depends on ``m - n`` only.

  Args:
    x: queries or keys ``[batch..., length, heads, head_dim]``, ``head_dim`` even.
    positions: each token's position, ``[batch..., length]`` or ``[length]``.
    base: the largest wavelength's scale (10000 for Llama 2 and Gemma; Llama 3 uses
      500000, Gemma 3's global layers 1000000).
    scale_factor: divides every angle, as ``scale_factor`` of flax's Gemma
      ``apply_rope`` (position interpolation: positions ``p`` turn as ``p /
      scale_factor`` did, to stretch a trained context; Gemma 3's global layers use
      8.0 from 4B up). At least 1.0; 1.0 is plain rope.

  Returns:
    ``x`` rotated, same shape and dtype.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> q = jnp.ones((1, 3, 2, 4))                      # [batch, length, heads, head_dim]
  >>> y = sr.nn.rope(q, jnp.arange(3))
  >>> y.shape, y[0, 0, 0].tolist()                    # position 0 is not rotated
  ((1, 3, 2, 4), [1.0, 1.0, 1.0, 1.0])
  >>> [round(v, 3) for v in y[0, 1, 0].tolist()]      # position 1: angles 1 and 0.01
  [-0.301, 0.99, 1.382, 1.01]
  >>> z = sr.nn.rope(q, jnp.arange(3), scale_factor=2.0)   # position 2 turns as 1 did
  >>> bool(jnp.allclose(z[0, 2], y[0, 1]))
  True
  """
  x = jnp.asarray(x)
  check_rope_input("sr.nn.rope", x, "give the heads an even size.")
  check_positions("sr.nn.rope", positions, x.shape)
  if not is_real(scale_factor) or not scale_factor >= 1.0:
    raise ValueError(
      f"sr.nn.rope: scale_factor={scale_factor!r} must be a number >= 1.0: it divides "
      "the angles (positions / scale_factor), stretching the context it was trained "
      "on, never shrinking it (flax's Gemma refuses < 1.0 too). Fix: scale_factor=1.0 "
      "for plain rope, or your model's (8.0 for the global layers of Gemma 3 4B+)."
    )
  half = x.shape[-1] // 2
  timescale = base ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
  positions = jnp.asarray(positions).astype(jnp.float32)
  # Angles [..., length, 1, half], the same for every head; both operands get x's
  # rank first (jax_numpy_rank_promotion may be set to "raise").
  positions = positions.reshape((1,) * (x.ndim - 2 - positions.ndim) + positions.shape + (1, 1))
  angles = positions / timescale.reshape((1,) * (x.ndim - 1) + (half,))
  if scale_factor != 1.0:
    angles = angles / scale_factor
  return rotate_halves(x, jnp.sin(angles), jnp.cos(angles)).astype(x.dtype)


def rotate_halves(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """``x``'s pairs ``(x[..., i], x[..., i + d/2])`` rotated by the angles whose sines and
  cosines are ``sin`` / ``cos`` (``[..., d/2]``, broadcast against ``x``'s halves)."""
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
