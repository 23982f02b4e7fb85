"""Dropout: zero a random fraction of the inputs in training mode."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ..core._module import Module
from ..core._rngs import Rngs, RngStream
from ._explicit import drop_dims, explicit_specs, sharding_like
from ._rngs_arg import check_rngs


def draw_key(rngs, name: str, layer: str) -> jax.Array:
  """A key from ``rngs``: an ``Rngs`` (stream ``name``), an ``RngStream``, or a key."""
  if isinstance(rngs, Rngs):
    return rngs[name]()
  if isinstance(rngs, RngStream):
    return rngs()
  if rngs is None:
    raise ValueError(
      f"{layer} is in training mode but has no RNG to draw its mask from. Fix: build "
      f"it with `rngs=sr.Rngs({name}=0)` (or any Rngs with a {name!r} or default "
      f"stream), pass `rngs=sr.Rngs({name}=...)` to the call, or switch to evaluation "
      "mode (`model.eval()` / `deterministic=True`)."
    )
  if isinstance(rngs, jax.Array) and (
    jnp.issubdtype(rngs.dtype, jax.dtypes.prng_key)
    or (rngs.dtype == jnp.uint32 and rngs.shape[-1:] == (2,))
  ):
    return rngs
  raise TypeError(
    f"{layer}: rngs must be an sr.Rngs, an sr.RngStream or a JAX key, got {type(rngs).__name__}."
  )


class Dropout(Module):
  """Zeroes each input with probability ``rate`` and scales the rest by ``1/(1 - rate)``.

  As ``flax.nnx.Dropout`` (same mask for the same key: ``jax.random.bernoulli`` of
  the keep probability), except that the ``rngs`` given here is kept as is, shared
  with the rest of the model, not forked: the layer draws
  ``self.rngs[rng_collection]()`` at each training call, so the stream's counter
  advances and consecutive calls (also through ``sr.jit``) get new masks.
  ``rate=0`` or ``deterministic=True`` returns the input; ``rate=1`` returns zeros.
  ``model.eval()`` / ``model.train()`` flip ``deterministic``.

  Args:
    rate: the drop probability (not the keep probability).
    broadcast_dims: axes that share one mask value (e.g. ``(1,)`` drops whole
      time steps' features consistently across the sequence axis 1).
    deterministic: evaluation mode (the call argument overrides it).
    rng_collection: the stream drawn from.
    rngs: an ``sr.Rngs`` (or ``sr.RngStream``), stored as ``self.rngs``; may be
      ``None`` if every training call passes ``rngs=``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> drop = sr.nn.Dropout(0.5, rngs=sr.Rngs(dropout=0))
  >>> y = drop(jnp.ones((2, 4)))
  >>> sorted(set(y.ravel().tolist())) in ([0.0, 2.0], [2.0], [0.0])
  True
  >>> drop.eval()(jnp.ones(3)).tolist()
  [1.0, 1.0, 1.0]
  """

  def __init__(
    self,
    rate: float,
    *,
    broadcast_dims: Sequence[int] = (),
    deterministic: bool | None = False,
    rng_collection: str = "dropout",
    rngs: Rngs | RngStream | None = None,
  ):
    check_rngs("Dropout", rngs, optional=True, stream=True)
    if not 0.0 <= rate <= 1.0:
      raise ValueError(f"Dropout rate must be in [0, 1], got {rate}.")
    self.rate = rate
    self.broadcast_dims = tuple(broadcast_dims)
    self.deterministic = deterministic
    self.rng_collection = rng_collection
    self.rngs = rngs

  def __call__(
    self,
    inputs: jax.Array,
    *,
    deterministic: bool | None = None,
    rngs: Rngs | RngStream | jax.Array | None = None,
  ) -> jax.Array:
    """Applies dropout; ``deterministic`` / ``rngs`` override the layer's, this call.

    Under explicit mesh axes the mask is drawn with the input's sharding.
    """
    deterministic = self.deterministic if deterministic is None else deterministic
    if deterministic is None:
      raise ValueError(
        "Dropout does not know whether it is training: its deterministic is None. "
        "Set the mode (`model.train()` / `model.eval()`), build it with "
        "`Dropout(..., deterministic=False)`, or call `drop(x, deterministic=True)`."
      )
    if self.rate == 0.0 or deterministic:
      return inputs
    # rate 1 would divide by a zero keep probability (NaN gradients): zeros instead.
    if self.rate == 1.0:
      return jnp.zeros_like(inputs)
    key = draw_key(rngs if rngs is not None else self.rngs, self.rng_collection, "Dropout")
    keep_prob = 1.0 - self.rate
    shape = list(inputs.shape)
    for dim in self.broadcast_dims:
      shape[dim] = 1
    if specs := explicit_specs("Dropout", inputs=inputs):
      # Explicit mesh axes: draw the mask where the input lives (as flax.nnx does),
      # replicated along the broadcast (size-1) axes, then broadcast it back there.
      drawn = sharding_like(drop_dims(specs[0], self.broadcast_dims), specs)
      mask = jax.random.bernoulli(key, p=keep_prob, shape=shape, out_sharding=drawn)
      mask = jnp.broadcast_to(mask, inputs.shape, out_sharding=jax.typeof(inputs).sharding)
    else:
      mask = jax.random.bernoulli(key, p=keep_prob, shape=shape)
      mask = jnp.broadcast_to(mask, inputs.shape)
    return lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))
