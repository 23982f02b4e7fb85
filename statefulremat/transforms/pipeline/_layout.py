"""The pipeline's layout: where each layer sits among the stages' chunks (``Layout``),
and the shape of one microbatch per device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding


class Layout:
  """Where each of the N layers sits in the pipeline's (S·R·C)-long layer axis."""

  def __init__(self, n: int, stages: int, repeats: int):
    q = stages * repeats
    self.base, self.extra = divmod(n, q)
    self.chunk = self.base + (self.extra > 0)
    self.stages, self.repeats = stages, repeats
    slots = np.zeros(stages * repeats * self.chunk, np.int32)
    self.inverse = np.zeros(n, np.int32)
    for s in range(stages):
      for r in range(repeats):
        c_q = r * stages + s
        offset, size = self.offset(c_q), self.size(c_q)
        for c in range(self.chunk):
          slot = (s * repeats + r) * self.chunk + c
          slots[slot] = offset + min(c, size - 1) if size else 0
          if c < size:
            self.inverse[offset + c] = slot
    self.slots = slots
    self.identity = len(slots) == n and bool((slots == np.arange(n)).all())
    self.padded = self.extra > 0

  def offset(self, q):
    return q * self.base + (
      np.minimum(q, self.extra) if isinstance(q, int) else jnp.minimum(q, self.extra)
    )

  def size(self, q):
    return self.base + (q < self.extra)


def is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def per_device(mb, whole):
  """One microbatch's shape per device where Explicit axes show it, else the whole one."""
  shape = jnp.shape(mb)
  sharding = getattr(jax.typeof(whole), "sharding", None)
  if sharding is not None and not sharding.mesh.empty and any(sharding.spec):
    try:
      shape = NamedSharding(sharding.mesh, sharding.spec).shard_shape(shape)
    except ValueError:
      pass
  return jax.ShapeDtypeStruct(shape, jnp.result_type(mb))
