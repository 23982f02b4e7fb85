"""Embed: a lookup table from integer ids to vectors, as ``flax.nnx.Embed``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..core._frozen import EMPTY as _EMPTY
from ..core._module import Module
from ..core._rngs import Rngs
from ._dtypes import promote_dtype as default_promote_dtype
from ._explicit import explicit_specs, sharding_like
from ._linear import Initializer, check_features, located, param_maker
from ._rngs_arg import check_rngs

default_embed_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


class Embed(Module):
  """An ``embedding`` table of shape ``(num_embeddings, features)``.

  Calling it looks rows up by integer id (``jnp.take``; out-of-range ids give NaN,
  negative ids count from the end); ``attend(query)`` is the transposed use, the
  logits of tied input/output embeddings. Defaults and numerics are nnx's.

  Args:
    num_embeddings: vocabulary size.
    features: size of each embedding vector.
    dtype: dtype of the looked-up vectors (default: the embedding's).
    param_dtype: dtype the table is initialised in.
    embedding_init: initialiser (default: variance scaling 1.0, fan-in, normal).
    promote_dtype: ``(arrays,), dtype=, inexact=`` -> promoted arrays.
    rngs: draws ``rngs.params()`` once.
    embedding_metadata: metadata put on ``embedding`` (e.g. ``{"sharding": ...}``).

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> embed = sr.nn.Embed(10, 4, rngs=sr.Rngs(0))
  >>> embed(jnp.array([[1, 2, 3]])).shape, embed.attend(jnp.ones((2, 4))).shape
  ((1, 3, 4), (2, 10))
  """

  def __init__(
    self,
    num_embeddings: int,
    features: int,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    embedding_init: Initializer = default_embed_init,
    promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
    embedding_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("Embed", rngs)
    param = param_maker(rngs, param_dtype)
    self.embedding = param(embedding_init, (num_embeddings, features), embedding_metadata)
    self.num_embeddings = num_embeddings
    self.features = features
    self.dtype = dtype or self.embedding.dtype
    self.param_dtype = param_dtype
    self.promote_dtype = promote_dtype

  def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
    """Looks up integer ``inputs`` of any shape: returns ``inputs.shape + (features,)``.

    Under explicit mesh axes the output keeps the ids' sharding and takes the
    table's feature-axis sharding, unless ``out_sharding`` is given.
    """
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(
        located(
          f"Embed takes integer ids, got an input of dtype {inputs.dtype} and shape "
          f"{tuple(inputs.shape)}; expected an integer array (of any shape; the output "
          f"is its shape + ({self.features},)). Fix: cast the ids "
          "(`x.astype(jnp.int32)`), or use `embed.attend(x)` for float queries.",
          self,
        )
      )
    (embedding,) = self.promote_dtype((self.embedding.value,), dtype=self.dtype, inexact=False)
    shape = inputs.shape + (self.features,)
    if out_sharding is None and (
      specs := explicit_specs("Embed", embedding=embedding, inputs=inputs)
    ):
      # Explicit mesh axes: the ids' axes, then the table's feature axis.
      sharding = sharding_like(specs[1] + specs[0][1:], specs)
      if self.num_embeddings == 1:
        return jnp.broadcast_to(embedding, shape, out_sharding=sharding)
      # jnp.take's gather: out-of-range ids fill with NaN, negative ones wrap.
      return embedding.at[inputs].get(mode="fill", out_sharding=sharding)
    if self.num_embeddings == 1:
      return jnp.broadcast_to(embedding, shape)
    if out_sharding is not None:
      take = jax.sharding.auto_axes(lambda e, i: jnp.take(e, i, axis=0), out_sharding=out_sharding)
      # jax's auto_axes is unannotated: pyright infers its `f=None` (decorator) branch too.
      return take(embedding, inputs)  # pyright: ignore[reportCallIssue]
    return jnp.take(embedding, inputs, axis=0)

  def attend(self, query: jax.Array, out_sharding: Any = None) -> jax.Array:
    """Inner products of ``query`` (last axis ``features``) with every embedding.

    Under explicit mesh axes the logits keep the query's batch sharding and take the
    table's vocabulary-axis sharding, unless ``out_sharding`` is given.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> embed = sr.nn.Embed(5, 3, rngs=sr.Rngs(0))
    >>> embed.attend(jnp.ones(3)).shape
    (5,)
    """
    check_features("Embed.attend", query, -1, self.features, name="features", module=self)
    query, embedding = self.promote_dtype((query, self.embedding.value), dtype=self.dtype)
    if out_sharding is None and (
      specs := explicit_specs("Embed.attend", query=query, embedding=embedding)
    ):
      # Explicit mesh axes: the query's batch axes, then the table's vocabulary axis.
      out_sharding = sharding_like(specs[0][:-1] + specs[1][:1], specs)
    kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
    return jnp.dot(query, embedding.T, **kwargs)
