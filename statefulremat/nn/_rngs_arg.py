"""The check every layer makes of its ``rngs`` argument, in one place."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core._rngs import Rngs, RngStream


def check_rngs(layer: str, rngs, *, optional: bool = False, stream: bool = False) -> None:
  """Raises a ``TypeError`` that shows the fix unless ``rngs`` is an ``sr.Rngs``.

  ``optional``: ``None`` is accepted too; ``stream``: an ``sr.RngStream`` too. A
  layer draws its keys by name (``rngs.params()``, ``rngs.dropout()``), so a bare key
  or an int seed, which nnx and PyTorch habits suggest, is refused with the wrapping
  that makes it right: ``rngs=sr.Rngs(key)`` / ``rngs=sr.Rngs(0)``.

  >>> import jax, statefulremat as sr
  >>> from statefulremat.nn._rngs_arg import check_rngs
  >>> check_rngs("Linear", sr.Rngs(0))
  >>> try:
  ...   check_rngs("Linear", jax.random.key(0))
  ... except TypeError as e:
  ...   print(str(e)[str(e).index("Fix"):])
  Fix: `rngs=sr.Rngs(key)`.
  """
  if (
    isinstance(rngs, Rngs)
    or (optional and rngs is None)
    or (stream and isinstance(rngs, RngStream))
  ):
    return
  wanted = "an sr.Rngs" + (", an sr.RngStream" if stream else "") + (" or None" if optional else "")
  if isinstance(rngs, jax.Array) and (
    jnp.issubdtype(rngs.dtype, jax.dtypes.prng_key) or rngs.dtype == "uint32"
  ):
    got, fix = f"a JAX key ({rngs.dtype}{list(rngs.shape)})", "sr.Rngs(key)"
  elif isinstance(rngs, int) and not isinstance(rngs, bool):
    got, fix = f"the int {rngs}", f"sr.Rngs({rngs})"
  else:
    kind = type(rngs)
    name = (
      kind.__qualname__
      if kind.__module__ == "builtins"
      else f"{kind.__module__}.{kind.__qualname__}"
    )
    got, fix = ("None" if rngs is None else f"a {name}"), "sr.Rngs(0)"
  raise TypeError(
    f"{layer}: rngs must be {wanted}, got {got}. A layer draws its keys by stream "
    "name (rngs.params() for its initial parameters, rngs.dropout() ...), so it "
    f"takes named streams, not one key or seed. Fix: `rngs={fix}`."
  )
