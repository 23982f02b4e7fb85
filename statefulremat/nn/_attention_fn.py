"""How ``MultiHeadAttention`` calls a user's ``attention_fn``: with the keywords its
signature takes.

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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._attention import combine_masks

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
