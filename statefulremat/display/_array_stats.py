"""Every array's statistics (mean, std, range, zeros), the big ones too, computed once
per jax.Array and kept while it lives."""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from ..core._caches import array_summaries


def data_summary(array) -> str:
  """treescope's statistics of ``array`` (``≈0.0 ±0.0 [≥0.0, ≤0.0] zero:6``), whatever
  its size; computed once per JAX array (immutable). Empty for a tracer or a deleted
  buffer.

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._array_stats import data_summary
  >>> data_summary(jnp.zeros((1000, 1000)))  # past treescope's threshold
  '≈0.0 ±0.0 [≥0.0, ≤0.0] zero:1_000_000'
  """
  if isinstance(array, Tracer) or (isinstance(array, jax.Array) and array.is_deleted()):
    return ""
  if not isinstance(array, jax.Array):  # a numpy array may change in place: not kept
    return _summarize(array)
  key = id(array)
  cached = array_summaries.get(key)
  if cached is not None:
    return cached
  text = _summarize(array)
  try:
    weakref.finalize(array, array_summaries.pop, key, None)
  except TypeError:  # not weak-referenceable: not cached, as its id may be reused
    return text
  array_summaries[key] = text
  return text


def _summarize(array) -> str:
  from treescope.external import jax_support

  if isinstance(array, np.ndarray):
    array = jnp.asarray(array)
  try:
    with jax_support.summarization_threshold.set_scoped({"default": None}):
      return jax_support.summarize_array_data(array).strip()
  except Exception:  # a deleted buffer, an array spread over processes: the shape suffices
    return ""


def is_concrete(value) -> bool:
  """Whether ``value`` is an array with values: numpy's, or a JAX array neither traced
  nor deleted."""
  if isinstance(value, Tracer) or not isinstance(value, (jax.Array, np.ndarray)):
    return False
  return not (isinstance(value, jax.Array) and value.is_deleted())


def squares(x, layer_axis):
  """The sum of squares of ``x``: one per layer along ``layer_axis``, else a scalar."""
  x = jnp.asarray(x)
  x = jnp.abs(x) if jnp.iscomplexobj(x) else x.astype(jnp.float32)
  axes = tuple(a for a in range(x.ndim) if a != layer_axis)
  return jnp.sum(jnp.square(x), axis=axes)
