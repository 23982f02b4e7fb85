"""Attention functions and masks, with flax.nnx's signatures and numerics.

Shapes follow nnx: ``query`` ``[batch..., q_length, num_heads, depth]``, ``key`` /
``value`` ``[batch..., kv_length, num_kv_heads, depth]``, masks and weights
``[batch..., num_heads, q_length, kv_length]``; ``num_heads`` may be a multiple of
``num_kv_heads`` (grouped-query attention). Without dropout,
``dot_product_attention`` calls ``jax.nn.dot_product_attention``, as nnx does.

``call_attention_fn`` is how ``MultiHeadAttention`` calls a user's ``attention_fn``:
with the keywords its signature takes.

nnx's layer calls its ``attention_fn`` with every option (``mask``, the dropout ones,
``dtype``, ``precision``, ``is_causal``), so only functions with nnx's signature fit.
The functions users pass have fewer: ``flax.linen.dot_product_attention`` has no
``is_causal``, ``jax.nn.dot_product_attention`` no dropout, ``dtype`` or ``precision``.
The layer reads the signature (once per function, cached), passes the options it
takes, expresses ``is_causal`` as a mask where it has no ``is_causal``, and raises,
naming ``attention_fn``, where an option in use cannot be expressed, rather than drop
it.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._dtypes import promote_dtype as default_promote_dtype
from ._explicit import drop_dims, explicit_specs, sharding_like


def _validate_qkv_shapes(query, key, value=None):
  arrays = (query, key) if value is None else (query, key, value)
  names = "q, k" if value is None else "q, k, v"
  if not all(a.ndim == arrays[0].ndim for a in arrays[1:]):
    raise ValueError(
      f"{names} must have the same rank, got {', '.join(str(a.ndim) for a in arrays)}."
    )
  if not all(a.shape[:-3] == arrays[0].shape[:-3] for a in arrays[1:]):
    raise ValueError(
      f"{names} batch dims must match, got shapes {', '.join(str(a.shape) for a in arrays)}."
    )


def combine_masks(*masks: jax.Array | None, dtype: Any = jnp.float32) -> jax.Array | None:
  """The logical AND of the given masks (``None`` masks skipped), or ``None`` if none given.

  Args:
    *masks: masks of one rank (broadcastable shapes), nonzero where attending is allowed;
      ``None`` entries are skipped.
    dtype: dtype of the result (default ``jnp.float32``: 0.0 / 1.0).

  Returns:
    The combined mask in ``dtype``, broadcast to the masks' common shape, or ``None``
    when every mask is ``None``.

  Raises:
    ValueError: when the masks given do not all have the same rank.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.nn.combine_masks(jnp.array([1, 1, 0]), None, jnp.array([0, 1, 1])).tolist()
  [0.0, 1.0, 0.0]
  """
  given = [m for m in masks if m is not None]
  if not given:
    return None
  if not all(m.ndim == given[0].ndim for m in given):
    raise ValueError(f"masks must have the same rank, got {tuple(m.ndim for m in given)}.")
  return functools.reduce(jnp.logical_and, given).astype(dtype)


def make_attention_mask(
  query_input: jax.Array,
  key_input: jax.Array,
  pairwise_fn: Callable = jnp.multiply,
  extra_batch_dims: int = 0,
  dtype: Any = jnp.float32,
) -> jax.Array:
  """A ``[batch..., 1, q_len, kv_len]`` mask from per-position query and key inputs.

  ``mask[..., 0, i, j] = pairwise_fn(query_input[..., i], key_input[..., j])``; e.g. a
  padding mask from two 0/1 validity vectors.

  Args:
    query_input: ``[batch..., q_len]``, one value per query position.
    key_input: ``[batch..., kv_len]``, one value per key position.
    pairwise_fn: combines a query and a key value, elementwise (default
      ``jnp.multiply``: both nonzero for 0/1 inputs).
    extra_batch_dims: how many size-1 axes to put in front (default ``0``).
    dtype: dtype of the mask (default ``jnp.float32``).

  Returns:
    The mask, ``[1] * extra_batch_dims + [batch..., 1, q_len, kv_len]``, in ``dtype``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> valid = jnp.array([[1, 1, 0]])
  >>> sr.nn.make_attention_mask(valid, valid).shape
  (1, 1, 3, 3)
  """
  mask = pairwise_fn(jnp.expand_dims(query_input, -1), jnp.expand_dims(key_input, -2))
  mask = jnp.expand_dims(mask, -3)
  mask = jnp.expand_dims(mask, tuple(range(extra_batch_dims)))
  return mask.astype(dtype)


def make_causal_mask(
  x: jax.Array, extra_batch_dims: int = 0, dtype: Any = jnp.float32
) -> jax.Array:
  """A ``[batch..., 1, len, len]`` lower-triangular mask for ``x`` ``[batch..., len]``.

  Args:
    x: ``[batch..., len]``; only its shape is read.
    extra_batch_dims: how many size-1 axes to put in front (default ``0``).
    dtype: dtype of the mask (default ``jnp.float32``).

  Returns:
    The mask, ``[1] * extra_batch_dims + [batch..., 1, len, len]``: 1 where the query
    position is at or after the key position, else 0.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.nn.make_causal_mask(jnp.ones((1, 3)))[0, 0].tolist()
  [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
  """
  idxs = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
  return make_attention_mask(
    idxs, idxs, jnp.greater_equal, extra_batch_dims=extra_batch_dims, dtype=dtype
  )


def dot_product_attention_weights(
  query: jax.Array,
  key: jax.Array,
  bias: jax.Array | None = None,
  mask: jax.Array | None = None,
  broadcast_dropout: bool = True,
  dropout_rng: jax.Array | None = None,
  dropout_rate: float = 0.0,
  deterministic: bool = False,
  dtype: Any = None,
  precision: Any = None,
  promote_dtype: Callable = default_promote_dtype,
  is_causal: bool = False,
) -> jax.Array:
  """Attention weights ``softmax(q k^T / sqrt(depth) + bias)``: ``[batch..., heads, q, kv]``.

  ``mask`` is False (0) where a query must not attend; ``broadcast_dropout`` shares
  one dropout mask across the batch and head axes.

  Args:
    query: ``[batch..., q_len, num_heads, depth]``.
    key: ``[batch..., kv_len, num_kv_heads, depth]``; ``num_heads`` must be a multiple
      of ``num_kv_heads``.
    bias: added to the logits before the softmax, broadcastable to
      ``[batch..., num_heads, q_len, kv_len]`` (default ``None``: none).
    mask: broadcastable to the weights' shape, False (0) where a query must not attend
      (default ``None``: attend everywhere).
    broadcast_dropout: one dropout mask shared across the batch and head axes (default
      ``True``).
    dropout_rng: the key the dropout mask is drawn with; needed when dropout applies.
    dropout_rate: the probability of dropping a weight (default ``0.0``: no dropout).
    deterministic: ``True`` turns dropout off (default ``False``).
    dtype: the computation dtype; default ``None``: the promoted dtype of ``query`` and
      ``key``.
    precision: the ``jax.lax.Precision`` of the einsum (default ``None``).
    promote_dtype: ``(arrays,), dtype=`` -> the arrays cast to one dtype (default
      ``sr.nn.promote_dtype``).
    is_causal: also mask out keys after each query's position (default ``False``).

  Returns:
    The weights, ``[batch..., num_heads, q_len, kv_len]``, summing to 1 over ``kv_len``.

  Raises:
    ValueError: when the ranks, batch axes or depths of ``query`` and ``key`` differ,
      ``num_heads`` is not a multiple of ``num_kv_heads``, or dropout applies and
      ``dropout_rng`` is ``None``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> q = k = jnp.ones((2, 5, 4, 8))
  >>> sr.nn.dot_product_attention_weights(q, k).shape
  (2, 4, 5, 5)
  """
  query, key = promote_dtype((query, key), dtype=dtype)
  dtype = query.dtype
  _validate_qkv_shapes(query, key)
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"q, k depths must match, got {query.shape[-1]} and {key.shape[-1]}.")

  q_heads, k_heads = query.shape[-2], key.shape[-2]
  is_gqa = q_heads != k_heads
  if is_gqa:
    if q_heads % k_heads:
      raise ValueError(
        f"query heads ({q_heads}) must be a multiple of key heads "
        f"({k_heads}) for grouped-query attention."
      )
    query = query.reshape(query.shape[:-2] + (k_heads, q_heads // k_heads, query.shape[-1]))
    key = jnp.expand_dims(key, -2)
    einsum_str = "...qhgd,...kh1d->...hgqk"
  else:
    einsum_str = "...qhd,...khd->...hqk"

  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  weights = jnp.einsum(einsum_str, query, key, precision=precision)
  if is_gqa:
    weights = weights.reshape(weights.shape[:-4] + (q_heads,) + weights.shape[-2:])

  if bias is not None:
    weights = weights + bias
  if is_causal:
    causal = jnp.tril(jnp.ones(weights.shape[-2:], dtype=dtype))
    causal = jnp.broadcast_to(causal, weights.shape if mask is None else mask.shape)
    mask = combine_masks(mask, causal, dtype=dtype)
  if mask is not None:
    weights = jnp.where(mask, weights, jnp.finfo(dtype).min)
  weights = jax.nn.softmax(weights).astype(dtype)

  if not deterministic and dropout_rate > 0.0:
    if dropout_rng is None:
      raise ValueError(
        f"dot_product_attention_weights: dropout_rate={dropout_rate} and "
        "deterministic=False need a key to draw the dropout mask, and dropout_rng is "
        "None. Fix: pass `dropout_rng=rngs.dropout()`, or `deterministic=True`."
      )
    keep_prob = 1.0 - dropout_rate
    # The rank of the (unexpanded) key is the rank of the weights.
    ndim = key.ndim - 1 if is_gqa else key.ndim
    shape = (1,) * (ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
    kwargs = {}
    if specs := explicit_specs("dot_product_attention", weights=weights):
      # Explicit mesh axes: the mask lives where the weights do (but broadcast axes).
      spec = drop_dims(specs[0], range(ndim - 2)) if broadcast_dropout else specs[0]
      kwargs["out_sharding"] = sharding_like(spec, specs)
    keep = jax.random.bernoulli(dropout_rng, keep_prob, shape, **kwargs)
    weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))
  return weights


def dot_product_attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None = None,
  mask: jax.Array | None = None,
  broadcast_dropout: bool = True,
  dropout_rng: jax.Array | None = None,
  dropout_rate: float = 0.0,
  deterministic: bool = False,
  dtype: Any = None,
  precision: Any = None,
  promote_dtype: Callable = default_promote_dtype,
  is_causal: bool = False,
) -> jax.Array:
  """Attention of ``query`` over ``key``/``value``: ``[batch..., q_len, heads, v_depth]``.

  The same function as ``flax.nnx.dot_product_attention`` (without its ``module``
  argument for sowing weights): ``weights @ value`` with the weights of
  ``dot_product_attention_weights``; without dropout it is
  ``jax.nn.dot_product_attention`` (batch axes flattened to one).

  Args:
    query: ``[batch..., q_len, num_heads, depth]``.
    key: ``[batch..., kv_len, num_kv_heads, depth]``; ``num_heads`` must be a multiple
      of ``num_kv_heads``.
    value: ``[batch..., kv_len, num_kv_heads, v_depth]``.
    bias: added to the logits before the softmax, broadcastable to
      ``[batch..., num_heads, q_len, kv_len]`` (default ``None``: none).
    mask: broadcastable to ``[batch..., num_heads, q_len, kv_len]``, False (0) where a
      query must not attend (default ``None``: attend everywhere).
    broadcast_dropout: one dropout mask shared across the batch and head axes (default
      ``True``).
    dropout_rng: the key the dropout mask is drawn with; needed when dropout applies.
    dropout_rate: the probability of dropping a weight (default ``0.0``: no dropout).
    deterministic: ``True`` turns dropout off (default ``False``).
    dtype: the computation dtype; default ``None``: the promoted dtype of ``query``,
      ``key`` and ``value``.
    precision: the ``jax.lax.Precision`` of the einsums (default ``None``); read only
      with dropout (``jax.nn.dot_product_attention`` takes none).
    promote_dtype: ``(arrays,), dtype=`` -> the arrays cast to one dtype (default
      ``sr.nn.promote_dtype``).
    is_causal: also mask out keys after each query's position (default ``False``).

  Returns:
    The attended values, ``[batch..., q_len, num_heads, v_depth]``.

  Raises:
    ValueError: when the ranks or batch axes of ``query``, ``key`` and ``value`` differ,
      ``key`` and ``value`` lengths differ, ``num_heads`` is not a multiple of
      ``num_kv_heads``, or dropout applies and ``dropout_rng`` is ``None``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> q = k = v = jnp.ones((2, 5, 4, 8))
  >>> sr.nn.dot_product_attention(q, k, v).shape
  (2, 5, 4, 8)
  """
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  dtype = query.dtype
  _validate_qkv_shapes(query, key, value)
  if key.shape[-3] != value.shape[-3]:
    raise ValueError(f"k, v lengths must match, got {key.shape[-3]} and {value.shape[-3]}.")

  if dropout_rate == 0.0:
    shape = query.shape
    if len(shape) > 4:

      def to_4d(x: jax.Array) -> jax.Array:
        return jnp.reshape(x, (math.prod(x.shape[:-3]), *x.shape[-3:]))

      query, key, value = to_4d(query), to_4d(key), to_4d(value)
      bias = None if bias is None else to_4d(bias)
      mask = None if mask is None else to_4d(mask)
    if mask is not None:
      mask = mask.astype(jnp.bool_)
    out = jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)
    return jnp.reshape(out, shape) if len(shape) > 4 else out

  weights = dot_product_attention_weights(
    query,
    key,
    bias,
    mask,
    broadcast_dropout,
    dropout_rng,
    dropout_rate,
    deterministic,
    dtype,
    precision,
    promote_dtype,
    is_causal,
  )
  q_heads, v_heads = weights.shape[-3], value.shape[-2]
  if q_heads != v_heads:
    if q_heads % v_heads:
      raise ValueError(f"query heads ({q_heads}) must be a multiple of value heads ({v_heads}).")
    weights = weights.reshape(
      weights.shape[:-3] + (v_heads, q_heads // v_heads) + weights.shape[-2:]
    )
    out = jnp.einsum(
      "...hgqk,...kh1d->...qhgd", weights, jnp.expand_dims(value, -2), precision=precision
    )
    return out.reshape(out.shape[:-3] + (q_heads, out.shape[-1]))
  return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


DROPOUT_OPTIONS = ("dropout_rng", "dropout_rate", "deterministic", "broadcast_dropout")
# The options the layer passes; query, key and value go first, by position.
OPTIONS = frozenset(("mask", *DROPOUT_OPTIONS, "dtype", "precision", "is_causal"))
FITS_EVERY_OPTION = "sr.nn.dot_product_attention or flax.nnx.dot_product_attention"


@functools.lru_cache(maxsize=128)
def _keywords(fn: Callable) -> frozenset[str]:
  """The options of ``MultiHeadAttention``'s call that ``fn`` takes as keywords (all of
  them for a function with ``**kwargs`` or without a readable signature)."""
  try:
    parameters = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    # No signature to read (some builtins): pass every option, as nnx does.
    return OPTIONS
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return OPTIONS
  named = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
  return frozenset(p.name for p in parameters if p.kind in named) & OPTIONS


def describe(fn: Callable) -> str:
  """``fn``'s dotted name (``flax.linen.attention.dot_product_attention``), or its repr."""
  name = getattr(fn, "__qualname__", None)
  module = getattr(fn, "__module__", None)
  return f"{module}.{name}" if isinstance(name, str) and module else repr(fn)


def _is_jax_nn_attention(fn: Callable) -> bool:
  while True:  # through partials and decorators (functools.wraps)
    if isinstance(fn, functools.partial):
      fn = fn.func
    elif hasattr(fn, "__wrapped__"):
      fn = fn.__wrapped__
    else:
      return fn is jax.nn.dot_product_attention


def check_attention_fn(
  where: str, fn: Any, *, dropout_rate: float, precision: Any
) -> frozenset[str]:
  """Raises, naming ``attention_fn``, if ``fn`` is not callable or cannot express the
  layer's dropout or ``precision``; returns the keywords it takes."""
  if not callable(fn):
    raise TypeError(
      f"{where}: attention_fn={fn!r} is not a function. Fix: pass a function with "
      f"dot_product_attention's signature, e.g. {FITS_EVERY_OPTION}, or leave the default."
    )
  try:
    takes = _keywords(fn)
  except TypeError:  # an unhashable callable: read it each time (at trace time only)
    takes = _keywords.__wrapped__(fn)
  if dropout_rate > 0.0:
    missing = [k for k in DROPOUT_OPTIONS if k not in takes]
    if missing:
      raise ValueError(
        f"{where}: dropout_rate={dropout_rate} but attention_fn={describe(fn)} takes "
        f"no {', '.join(missing)}, so the attention dropout cannot be passed to it (it "
        "would be dropped silently). Fix: dropout_rate=0.0 (and an sr.nn.Dropout "
        f"elsewhere if you want one), or an attention_fn that takes the dropout "
        f"arguments, e.g. {FITS_EVERY_OPTION}."
      )
  if precision is not None and "precision" not in takes:
    raise ValueError(
      f"{where}: precision={precision!r} but attention_fn={describe(fn)} takes no "
      "precision, so it cannot be passed to it (it would be dropped silently). Fix: "
      "precision=None (the projections still use dtype), or an attention_fn that "
      f"takes precision, e.g. {FITS_EVERY_OPTION}."
    )
  return takes


def call_attention_fn(
  where: str,
  fn: Callable,
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  mask: jax.Array | None,
  is_causal: bool,
  dropout_rate: float,
  precision: Any,
  **options: Any,
) -> jax.Array:
  """``fn(query, key, value, **options)`` with the options ``fn`` takes: ``is_causal``
  as a mask where ``fn`` has no ``is_causal``; raises where an option in use cannot be
  expressed."""
  takes = check_attention_fn(where, fn, dropout_rate=dropout_rate, precision=precision)
  if is_causal and "is_causal" not in takes:
    # The same lower-triangular [q, kv] mask jax.nn and sr.nn apply for is_causal.
    causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), jnp.bool_))
    rank = query.ndim if mask is None else mask.ndim
    mask = combine_masks(mask, causal.reshape((1,) * (rank - 2) + causal.shape), dtype=jnp.bool_)
    is_causal = False
  if mask is not None and "mask" not in takes:
    raise ValueError(
      f"{where}: the call has a mask (mask=, is_causal=True, or the decoding cache's) "
      f"but attention_fn={describe(fn)} takes no mask, so it would attend everywhere. "
      f"Fix: an attention_fn with a mask argument, e.g. {FITS_EVERY_OPTION}."
    )
  if mask is not None and _is_jax_nn_attention(fn):
    mask = mask.astype(jnp.bool_)  # jax.nn refuses the 0/1 float masks flax builds
  given = dict(
    options, mask=mask, is_causal=is_causal, dropout_rate=dropout_rate, precision=precision
  )
  # dtype is left out where not taken: the projections already gave q, k, v that dtype.
  kwargs = {k: v for k, v in given.items() if k in takes}
  try:
    return fn(query, key, value, **kwargs)
  except AssertionError as e:
    if query.shape[-2] == key.shape[-2]:
      raise
    raise ValueError(
      f"{where}: attention_fn={describe(fn)} failed ({e}) on grouped-query attention: "
      f"{query.shape[-2]} query heads share {key.shape[-2]} key/value heads, which it "
      "may not take (flax.linen.dot_product_attention does not). Fix: an "
      "attention_fn that takes fewer key/value heads than query heads, e.g. "
      f"{FITS_EVERY_OPTION} or jax.nn.dot_product_attention."
    ) from e
