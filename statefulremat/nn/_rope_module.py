"""flax.nnx's rotary embedding module and its attention function (flax 0.12.12's
``nnx.RoPE`` and ``nnx.dot_product_attention_with_rope``), on ``sr.nn.rope``'s
convention ("rotate half"): the same angles, the same rotation.

``sr.nn.rope(x, positions)`` rotates ``[batch..., length, heads, head_dim]`` in one
call; ``RoPE`` is nnx's module form, applied to one head's ``[..., length, head_dim]``
with its sine and cosine tables optionally precomputed as Variables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core._module import Module
from ..core._variables import Variable
from ._attention import dot_product_attention
from ._rope import rotate_halves


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
