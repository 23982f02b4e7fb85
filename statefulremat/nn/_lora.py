"""LoRA: low-rank adapters ``x @ lora_a @ lora_b``, as ``flax.nnx.LoRA`` / ``LoRALinear``.

The adapters are ``LoRAParam`` Variables, a ``Param`` kind of their own, so a filter
picks them alone: train only the adapters with ``sr.grad(loss, wrt=sr.nn.LoRAParam)``
(the base weights stay fixed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..core._frozen import EMPTY as _EMPTY
from ..core._kinds import Param
from ..core._module import Module
from ..core._rngs import Rngs
from ..core._variables import A
from ._dtypes import promote_dtype as default_promote_dtype
from ._linear import Linear, check_features, param_maker, promoted
from ._rngs_arg import check_rngs

default_a_initializer = jax.nn.initializers.he_uniform()
default_b_initializer = jax.nn.initializers.zeros


class LoRAParam(Param[A]):
  """A LoRA adapter weight: a ``Param`` (collection ``"params"``) that filters can
  single out, as ``flax.nnx.LoRAParam``.

  Args:
    value: the adapter's array, e.g. ``lora_a`` of shape ``(in_features, lora_rank)``.
    **metadata: free-form metadata readable as attributes (e.g. ``sharding=...``).

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> lora = sr.nn.LoRA(3, 2, 4, rngs=sr.Rngs(0))
  >>> sorted(sr.state(lora, sr.nn.LoRAParam).flat())
  [('lora_a',), ('lora_b',)]
  """


class LoRA(Module):
  """A low-rank adapter: ``x @ lora_a @ lora_b``, plus ``base_module(x)`` if given.

  As ``flax.nnx.LoRA``: ``lora_a`` is ``(in_features, lora_rank)`` (``he_uniform``),
  ``lora_b`` is ``(lora_rank, out_features)`` (zeros, so a new adapter changes
  nothing), both of ``lora_param_type``.

  Args:
    in_features: size of the input's last axis.
    lora_rank: the adapter's rank, the inner size of ``lora_a @ lora_b``.
    out_features: size of the output's last axis.
    base_module: a layer called on the same input, its output added; default ``None``:
      the adapter alone.
    dtype: computation dtype; default ``None``: the promotion of the input's and the
      adapters' dtypes.
    param_dtype: dtype the adapters are initialised in (default ``jnp.float32``).
    a_initializer: initialiser of ``lora_a`` (default
      ``jax.nn.initializers.he_uniform()``).
    b_initializer: initialiser of ``lora_b`` (default ``jax.nn.initializers.zeros``).
    lora_param_type: the Variable kind of the adapters (default ``sr.nn.LoRAParam``).
    promote_dtype: ``(x, lora_a, lora_b), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    rngs: draws ``rngs.params()`` for ``lora_a``, then ``lora_b``.
    a_metadata: metadata put on ``lora_a`` (default ``{}``: none).
    b_metadata: metadata put on ``lora_b`` (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``, or ``base_module`` is not callable.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> base = sr.nn.Linear(3, 4, rngs=sr.Rngs(0))
  >>> lora = sr.nn.LoRA(3, 2, 4, base_module=base, rngs=sr.Rngs(1))
  >>> x = jnp.ones((5, 3))
  >>> lora.lora_a.shape, lora.lora_b.shape, bool((lora(x) == base(x)).all())
  ((3, 2), (2, 4), True)
  """

  def __init__(
    self,
    in_features: int,
    lora_rank: int,
    out_features: int,
    *,
    base_module: Module | None = None,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    a_initializer: Callable = default_a_initializer,
    b_initializer: Callable = default_b_initializer,
    lora_param_type: type = LoRAParam,
    promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
    a_metadata: Mapping[str, Any] = _EMPTY,
    b_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("LoRA", rngs)
    if base_module is not None and not callable(base_module):
      raise TypeError(
        f"LoRA: base_module must be callable (a layer whose output the adapter adds "
        f"to), got a {type(base_module).__name__}. Fix: pass the layer itself, or "
        "base_module=None for a standalone adapter."
      )
    self.in_features = in_features
    self.out_features = out_features
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.lora_param_type = lora_param_type
    self.base_module = base_module
    self.promote_dtype = promote_dtype
    param = param_maker(rngs, param_dtype, lora_param_type)
    self.lora_a = param(a_initializer, (in_features, lora_rank), a_metadata)
    self.lora_b = param(b_initializer, (lora_rank, out_features), b_metadata)

  def __call__(self, x: jax.Array, **kwargs: Any) -> jax.Array:
    """``x @ lora_a @ lora_b`` (+ ``base_module(x, **kwargs)``) over ``x``'s last axis."""
    check_features("LoRA", x, -1, self.in_features, module=self)
    x, lora_a, lora_b = promoted(self, x, self.lora_a, self.lora_b)
    out = x @ lora_a @ lora_b
    if self.base_module is not None:
      out += self.base_module(x, **kwargs)
    return out


class LoRALinear(Linear):
  """A ``Linear`` whose output gets a low-rank adapter added: ``linear(x) + lora(x)``.

  As ``flax.nnx.LoRALinear``: the ``kernel`` and ``bias`` are a ``Linear``'s (its
  state is a ``Linear``'s plus ``lora.lora_a`` / ``lora.lora_b``); the keyword
  arguments other than the LoRA ones go to ``Linear``.

  Args:
    in_features: size of the input's last axis.
    out_features: size of the output's last axis.
    lora_rank: the adapter's rank.
    lora_dtype: the adapter's computation dtype; default ``None``: inferred from the
      input and the adapters.
    lora_param_dtype: dtype the adapters are initialised in (default ``jnp.float32``).
    a_initializer: initialiser of ``lora.lora_a`` (default
      ``jax.nn.initializers.he_uniform()``).
    b_initializer: initialiser of ``lora.lora_b`` (default zeros: a new adapter adds
      nothing).
    lora_param_type: the Variable kind of the adapters (default ``sr.nn.LoRAParam``).
    lora_promote_dtype: the adapter's ``promote_dtype`` (default
      ``sr.nn.promote_dtype``).
    rngs: draws the ``Linear``'s parameters, then the adapter's.
    a_metadata: metadata put on ``lora.lora_a`` (default ``{}``: none).
    b_metadata: metadata put on ``lora.lora_b`` (default ``{}``: none).
    **kwargs: ``Linear``'s other arguments (``use_bias``, ``dtype``, ...).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> layer = sr.nn.LoRALinear(3, 4, lora_rank=2, rngs=sr.Rngs(0))
  >>> layer.kernel.shape, layer.lora.lora_a.shape, layer(jnp.ones((5, 3))).shape
  ((3, 4), (3, 2), (5, 4))
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    lora_rank: int,
    lora_dtype: Any = None,
    lora_param_dtype: Any = jnp.float32,
    a_initializer: Callable = default_a_initializer,
    b_initializer: Callable = default_b_initializer,
    lora_param_type: type = LoRAParam,
    lora_promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
    a_metadata: Mapping[str, Any] = _EMPTY,
    b_metadata: Mapping[str, Any] = _EMPTY,
    **kwargs: Any,
  ):
    super().__init__(in_features, out_features, rngs=rngs, **kwargs)
    self.lora = LoRA(
      in_features,
      lora_rank,
      out_features,
      dtype=lora_dtype,
      param_dtype=lora_param_dtype,
      a_initializer=a_initializer,
      b_initializer=b_initializer,
      lora_param_type=lora_param_type,
      promote_dtype=lora_promote_dtype,
      rngs=rngs,
      a_metadata=a_metadata,
      b_metadata=b_metadata,
    )

  def __call__(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
    """``Linear``'s output plus the adapter's."""
    return super().__call__(x, out_sharding=out_sharding) + self.lora(x)
