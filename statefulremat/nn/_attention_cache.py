"""The key/value cache of autoregressive decoding, for ``MultiHeadAttention``.

``init_cache`` (the layer's method) makes three ``Cache`` Variables: ``cached_key``,
``cached_value`` (``(batch..., max_length, num_kv_heads, head_dim)``) and
``cache_index``, the next position. A decoding call feeds one position: ``cache_slot``
checks the step against the cache and finds the position it goes to (raising, rather
than letting ``dynamic_update_slice`` clamp a write past the end onto the last
position); ``cache_write`` writes it there and returns the keys and values cached so
far with the mask that lets the query see exactly them.

Under explicit mesh axes the step is written where the cache lives, and the keys and
values cached so far are read back where the step's were (the projections' placement),
so the attention gets them placed as it does without decoding: its contractions need
the keys' and values' batch and head axes sharded exactly as the queries' (jax 0.12
refuses a replicated operand against a sharded one, which earlier versions let pass).
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer

from ..core._errors import format_path
from ..core._variables import Variable, path_of
from ._attention import combine_masks
from ._explicit import explicit_specs


class Decoding(Protocol):
  """What the cache reads of its layer (``MultiHeadAttention`` has it)."""

  in_features: int
  cached_key: Variable | None
  cached_value: Variable | None
  cache_index: Variable | None

  def _where(self) -> str: ...


def _cache(layer: Decoding) -> tuple[Variable, Variable, Variable]:
  cached_key, cached_value, cache_index = layer.cached_key, layer.cached_value, layer.cache_index
  if cached_key is None or cached_value is None or cache_index is None:
    raise ValueError(
      f"{layer._where()}: decode=True needs the key/value cache, and it has none. "
      f"Fix: call `init_cache((batch, max_length, {layer.in_features}))` on it "
      "before decoding, outside any transform (it creates Variables); on a stack, "
      "`stack.attn.init_cache(...)` makes one cache per layer, stacked along the "
      "layer axis (on a pattern stack, once per position: "
      "`stack.pattern[k].attn.init_cache(...)`)."
    )
  return cached_key, cached_value, cache_index


def cache_slot(
  layer: Decoding, key: jax.Array, value: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Checks one decoding step's ``key`` / ``value`` against the cache; returns them
  and the position they go to."""
  cached_key, cached_value, cache_index = _cache(layer)
  *batch_dims, max_length, num_kv_heads, depth = cached_key.shape
  cached, batch = tuple(batch_dims), tuple(key.shape[:-3])
  if batch != cached:
    raise ValueError(_batch_mismatch(layer, cached_key, batch, max_length))
  expected = cached + (1, num_kv_heads, depth)
  if key.shape != expected:
    raise ValueError(
      f"{layer._where()}: decode=True feeds one position at a time, but the input has "
      f"length {key.shape[-3]} (key of shape {key.shape}, expected {expected}). Fix: "
      "call it once per position, with inputs of shape (batch..., 1, "
      f"{layer.in_features}); to fill the cache with a prompt, decode its positions one "
      "by one."
    )
  return key, value, _check_room(layer, cache_index.value, max_length)


def _batch_mismatch(layer: Decoding, cached_key: Variable, batch: tuple, max_length: int) -> str:
  """The message for a decoding step whose batch is not the one the cache was made for."""

  def of(dims: tuple) -> str:
    return f"a batch of {dims[0]}" if len(dims) == 1 else f"a batch of shape {dims}"

  cached = tuple(cached_key.shape[:-3])
  path = path_of(cached_key)
  where = f"`{format_path(path)}`" if path else "its `cached_key`"
  shape = f"({', '.join(map(str, batch + (max_length, layer.in_features)))})"
  return (
    f"{layer._where()}: decoding {of(batch) if batch else 'an input without a batch axis'}"
    f" into a key/value cache made for {of(cached) if cached else 'no batch axis'} "
    f"({where} has shape {tuple(cached_key.shape)}: batch..., max_length, num_kv_heads, "
    f"head_dim). Fix: make the cache for this batch, `init_cache({shape})` (it starts a "
    f"new sequence); on a stack, `stack.attn.init_cache({shape})`, on a pattern stack "
    f"for each position k, `stack.pattern[k].attn.init_cache({shape})`. Or decode "
    f"{of(cached) if cached else 'inputs without a batch axis'}, as the cache was made."
  )


def cache_write(
  layer: Decoding, key: jax.Array, value: jax.Array, index: jax.Array, mask: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Writes ``key`` / ``value`` at ``index`` and moves the index on; returns the cached
  keys and values (placed where ``key`` / ``value`` were) and ``mask`` combined with the
  positions cached so far."""
  cached_key, cached_value, cache_index = _cache(layer)
  *batch_dims, max_length, _, _ = cached_key.shape
  step_shardings = None
  if explicit_specs(
    "MultiHeadAttention",
    key=key,
    value=value,
    cached_key=cached_key.value,
    cached_value=cached_value.value,
  ):
    # Explicit mesh axes: the step is written where the cache lives (init_cache
    # makes it replicated; sr.shard or a reshard may place it otherwise) ...
    step_shardings = jax.typeof(key).sharding, jax.typeof(value).sharding
    key = jax.sharding.reshard(key, jax.typeof(cached_key.value).sharding)
    value = jax.sharding.reshard(value, jax.typeof(cached_value.value).sharding)
  zero = jnp.array(0, dtype=lax.dtype(index.dtype))
  indices = (zero,) * len(batch_dims) + (index, zero, zero)
  key = lax.dynamic_update_slice(cached_key.value, key, indices)
  value = lax.dynamic_update_slice(cached_value.value, value, indices)
  cached_key.value = key
  cached_value.value = value
  cache_index.value = index + 1
  if step_shardings is not None:
    # ... and read back where the step was, the queries' batch and head placement
    # (a replicated cache is sliced locally, one placed as the step is left as is).
    key = jax.sharding.reshard(key, step_shardings[0])
    value = jax.sharding.reshard(value, step_shardings[1])
  # The single query may attend only to the positions already cached.
  mask = combine_masks(
    mask,
    jnp.broadcast_to(jnp.arange(max_length) <= index, tuple(batch_dims) + (1, 1, max_length)),
  )
  return key, value, mask


def _check_room(layer: Decoding, index: jax.Array, max_length: int) -> jax.Array:
  """Raises when every cache position is used: a write there would be clamped
  onto the last position (``dynamic_update_slice``), a silently wrong result.
  Returns ``index``."""

  def report(index, where=None):  # eager: the path is read only when it raises
    if (np.asarray(index) >= max_length).any():
      raise ValueError(
        f"{where or layer._where()}: decoding past the end of the key/value cache: "
        f"it holds max_length={max_length} positions and all are used (cache_index="
        f"{int(index.max())}). Fix: give the sequence a longer cache, "
        f"`init_cache((batch, max_length, {layer.in_features}))` with max_length at "
        "least the number of positions decoded (it also starts a new sequence); on "
        "a stack call it on the stack's attention, `stack.attn.init_cache(...)` "
        "(on a pattern stack, `stack.pattern[k].attn.init_cache(...)` per position)."
      )
    return index

  if not isinstance(index, Tracer):
    return report(index)  # eager: raise before anything is written
  # Traced (sr.jit, a stack's scan): the host is called only when the cache is full,
  # and its error stops the call before the transform writes anything back. A
  # pure_callback whose result the write uses, so it is not pruned: the effect of
  # jax.debug.callback cost every decode call ~0.2 ms on CPU where this costs ~0.03.
  # The path is read now: the host call runs after the trace's modules are gone.
  checked = functools.partial(
    jax.pure_callback,
    functools.partial(report, where=layer._where()),
    jax.ShapeDtypeStruct(index.shape, index.dtype),
    vmap_method="broadcast_all",
  )
  return lax.cond(index >= max_length, checked, lambda i: i, index)
