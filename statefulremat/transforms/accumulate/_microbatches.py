"""A batch as microbatches and back, for ``sr.accumulate`` and ``sr.pipeline`` (README.md)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def split_rows(x, k: int):
  """``x`` as ``(k, B // k, ...)``, ``k`` dividing ``B``: microbatch ``m`` is rows
  ``m·B/k …``, spread over the Explicit mesh axes that split ``x``'s rows."""
  shape = tuple(jnp.shape(x))
  rows = shape[0] // k
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec: tuple = tuple(getattr(sharding, "spec", ()))  # a PartitionSpec's entries
  if not spec or spec[0] is None:  # axis 0 replicated, or axes the type does not show
    return jnp.reshape(x, (k, rows) + shape[1:])
  # Each microbatch is spread over axis 0's mesh axes (one all-to-all here), or replicated
  # where its rows do not divide among them: keeping axis 0's sharding would put microbatch
  # m's rows on a 1/k slice of the devices, each gathered as the loop steps through them.
  assert sharding is not None  # it gave a non-empty spec
  names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  size = math.prod(sharding.mesh.shape[n] for n in names)
  out = PartitionSpec(None, spec[0] if rows % size == 0 else None, *spec[1:])
  return jnp.reshape(x, (k, rows) + shape[1:], out_sharding=out)


def explicit_spec(v) -> tuple:
  """``v``'s partition spec where Explicit mesh axes show it in its type, else ``()``."""
  return tuple(getattr(getattr(jax.typeof(v), "sharding", None), "spec", None) or ())


def join(o, like):
  """The microbatches' outputs ``(k, B // k, ...)`` back as one batch, sharded as the
  carry was where Explicit axes show it."""
  shape = tuple(jnp.shape(o))
  whole = (shape[0] * shape[1],) + shape[2:]
  spec = explicit_spec(like)
  if not spec or jnp.shape(like) != whole:
    return jnp.reshape(o, whole)
  return jnp.reshape(o, whole, out_sharding=PartitionSpec(*spec))
