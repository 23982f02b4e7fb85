"""Rotary position embeddings (RoPE), as Gemma and Llama apply them to queries and keys.

The "rotate half" convention of flax's Gemma example (``examples/gemma/
positional_embeddings.py``, ``apply_rope``) and of Hugging Face's Llama
(``rotate_half``): the head dimension is split into two halves ``x1 = x[..., :d/2]``,
``x2 = x[..., d/2:]``, and pair ``(x1[i], x2[i])`` is rotated by the angle
``position / base ** (2 i / d)``. (The other convention, GPT-J's and the RoFormer
paper's, rotates adjacent pairs ``(x[2i], x[2i+1])``; weights trained with one do not
work with the other.)

``RoPE`` and ``dot_product_attention_with_rope`` are flax.nnx's module form (flax
0.12.12's ``nnx.RoPE`` and ``nnx.dot_product_attention_with_rope``) on the same
convention: ``RoPE`` rotates one head's ``[..., length, head_dim]``, with its sine and
cosine tables optionally precomputed as Variables.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ..core._module import Module
from ..core._variables import Variable
from ._attention import dot_product_attention


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


class RoPE(Module):
  """Rotary position embedding of ``[..., length, embedding_size]`` (one head), as
  ``flax.nnx.RoPE``.

  With ``d = embedding_size`` and frequencies ``theta ** (-2 i / d)``, position ``p``
  rotates the pair ``(x[..., i], x[..., i + d/2])`` by ``p * theta ** (-2 i / d)``:
  ``sr.nn.rope``'s convention, per head. Given ``embedding_size`` and
  ``max_seq_len``, the sine and cosine tables are computed once and kept as
  Variables (``cached_sin``, ``cached_cos``; collection ``"variables"``, not trained),
  read for calls without positions.

  Args:
    theta: the base of the frequencies (10000 for Llama 2 and Gemma).
    embedding_size: the head size ``d`` (even); give it with ``max_seq_len`` to
      precompute the tables.
    max_seq_len: the longest sequence the precomputed tables cover.

  Raises:
    ValueError: only one of ``embedding_size`` and ``max_seq_len`` given, or an odd or
      non-positive ``embedding_size``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> rope = sr.nn.RoPE(embedding_size=4, max_seq_len=8)
  >>> x = jnp.ones((3, 4))                          # [length, head_dim]
  >>> bool(jnp.allclose(rope(x), sr.nn.rope(x[:, None], jnp.arange(3))[:, 0]))
  True
  """

  def __init__(
    self,
    theta: float = 10000.0,
    embedding_size: int | None = None,
    max_seq_len: int | None = None,
  ):
    self.theta = theta
    self.cached_sin: Variable | None = None
    self.cached_cos: Variable | None = None
    if (embedding_size is None) != (max_seq_len is None):
      raise ValueError(
        f"sr.nn.RoPE: embedding_size={embedding_size} and max_seq_len={max_seq_len}: "
        "the tables are precomputed for both or neither. Fix: give both (the head "
        "size and the longest sequence), or neither (computed at each call)."
      )
    if embedding_size is not None and max_seq_len is not None:
      sin, cos = self._rotation_for(embedding_size, jnp.arange(float(max_seq_len)))
      self.cached_sin, self.cached_cos = Variable(sin), Variable(cos)

  def _rotation_for(self, embedding_size: int, positions: jax.Array):
    if embedding_size <= 0 or embedding_size % 2:
      raise ValueError(
        f"sr.nn.RoPE: embedding_size={embedding_size}: rope rotates pairs, so the head "
        "size must be positive and even. Fix: give the heads an even size."
      )
    freqs = 1.0 / self.theta ** (jnp.arange(0.0, embedding_size, 2) / embedding_size)
    angles = positions[..., None] * freqs.reshape((1,) * positions.ndim + freqs.shape)
    return jnp.sin(angles), jnp.cos(angles)

  def __call__(self, x: jax.Array, input_positions: jax.Array | None = None) -> jax.Array:
    """``x`` ``[..., length, embedding_size]`` rotated: by the cached tables when no
    ``input_positions`` are given and they exist, else by ``input_positions``
    (``[..., length]``; default ``arange(length)``). Same shape."""
    length, size = x.shape[-2:]
    if input_positions is None and self.cached_sin is not None and self.cached_cos is not None:
      sin, cos = self.cached_sin.value[:length], self.cached_cos.value[:length]
    else:
      if input_positions is None:
        input_positions = jnp.arange(float(length))
      elif input_positions.shape[-1] != length:
        raise ValueError(
          f"sr.nn.RoPE: input_positions has {input_positions.shape[-1]} positions "
          f"(shape {tuple(input_positions.shape)}) for a sequence of {length} (x of "
          f"shape {tuple(x.shape)}). Fix: give one position per token."
        )
      sin, cos = self._rotation_for(size, input_positions)
    lead = (1,) * (x.ndim - cos.ndim)
    return rotate_halves(x, sin.reshape(lead + sin.shape), cos.reshape(lead + cos.shape))


def dot_product_attention_with_rope(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  rope: RoPE,
  input_positions: jax.Array | None = None,
  **kwargs,
) -> jax.Array:
  """``dot_product_attention`` of queries and keys rotated by ``rope``, as
  ``flax.nnx.dot_product_attention_with_rope``: an ``attention_fn`` for
  ``sr.nn.MultiHeadAttention`` through ``functools.partial(..., rope=rope)``.

  Args:
    query: ``[batch..., q_length, heads, head_dim]``.
    key: ``[batch..., kv_length, heads, head_dim]``.
    value: ``[batch..., kv_length, heads, v_dim]``.
    rope: the ``sr.nn.RoPE`` to rotate queries and keys with, head by head.
    input_positions: ``[batch..., length]`` positions (default: ``rope``'s tables or
      ``arange(length)``).
    **kwargs: passed on to ``sr.nn.dot_product_attention`` (mask, dropout, ...).

  Returns:
    ``[batch..., q_length, heads, v_dim]``.

  >>> import functools, jax.numpy as jnp, statefulremat as sr
  >>> rope = sr.nn.RoPE(embedding_size=8, max_seq_len=16)
  >>> attention = sr.nn.MultiHeadAttention(
  ...   num_heads=2, in_features=16, decode=False, rngs=sr.Rngs(0),
  ...   attention_fn=functools.partial(sr.nn.dot_product_attention_with_rope, rope=rope))
  >>> attention(jnp.ones((1, 5, 16))).shape
  (1, 5, 16)
  """
  apply = jax.vmap(rope, in_axes=(-2, None), out_axes=-2)  # each head: [..., length, head_dim]
  query, key = apply(query, input_positions), apply(key, input_positions)
  return dot_product_attention(query, key, value, **kwargs)
