"""GroupNorm and InstanceNorm: per-example normalisation over groups of channels.

The numerics are ``flax.nnx``'s (statistics from ``compute_stats`` in at least
float32, ``normalize`` as LayerNorm's); the feature axis is the last for GroupNorm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..core._frozen import EMPTY as _EMPTY
from ..core._module import Module
from ..core._rngs import Rngs
from ._dtypes import promote_dtype as default_promote_dtype
from ._linear import Initializer, freeze, located, param_maker, promoted
from ._normalization import (
  canonicalize_axes,
  check_feature_axes,
  keep_stats_options,
  layer_stats,
  normalize,
)
from ._rngs_arg import check_rngs


class GroupNorm(Module):
  """Group normalisation: ``num_groups`` groups of channels, each normalised per example.

  As ``flax.nnx.GroupNorm``: the channels (the last axis, ``num_features``) are split
  into ``num_groups`` groups of ``group_size``; each group is normalised over it and
  the ``reduction_axes`` (default: every axis but the first, the batch), then scaled
  and shifted per channel. Give exactly one of ``num_groups`` and ``group_size``
  (pass ``num_groups=None`` with a ``group_size``).

  Args:
    num_features: number of channels (``scale``/``bias`` shape ``(num_features,)``).
    num_groups: number of groups (default ``32``); must divide ``num_features``.
    group_size: channels per group, instead of ``num_groups`` (default ``None``: given
      by ``num_groups``).
    epsilon: added to the variance (default ``1e-6``).
    dtype: result dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    use_bias: whether ``bias`` exists (default ``True``).
    use_scale: whether ``scale`` exists (default ``True``).
    bias_init: initialiser of ``bias`` (default ``jax.nn.initializers.zeros``).
    scale_init: initialiser of ``scale`` (default ``jax.nn.initializers.ones``).
    reduction_axes: the statistics' axes, the last among them (the channels) split
      into groups; default ``None``: every axis but the first.
    axis_name: a mapped axis (``jax.vmap`` / ``shard_map``) to average the statistics
      over too (default ``None``: none).
    axis_index_groups: groups of indices along ``axis_name`` averaged separately, as
      ``jax.lax.pmean`` takes them (default ``None``: all together).
    use_fast_variance: ``E[x^2] - E[x]^2`` instead of ``E[(x - E[x])^2]`` (default
      ``True``).
    promote_dtype: ``(x, scale, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    rngs: draws ``rngs.params()`` for ``scale``, then ``bias``.
    bias_metadata: metadata put on ``bias`` (default ``{}``: none).
    scale_metadata: metadata put on ``scale`` (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when both or neither of ``num_groups`` and ``group_size`` are given, or
      the one given does not divide ``num_features``.

  >>> import jax, statefulremat as sr
  >>> norm = sr.nn.GroupNorm(6, num_groups=3, rngs=sr.Rngs(0))
  >>> y = norm(jax.random.normal(jax.random.key(0), (2, 5, 6)))
  >>> y.shape, norm.scale.shape, round(float(y[0, :, :2].std()), 3)
  ((2, 5, 6), (6,), 1.0)
  """

  def __init__(
    self,
    num_features: int,
    num_groups: int | None = 32,
    group_size: int | None = None,
    *,
    epsilon: float = 1e-6,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    use_bias: bool = True,
    use_scale: bool = True,
    bias_init: Initializer = jax.nn.initializers.zeros,
    scale_init: Initializer = jax.nn.initializers.ones,
    reduction_axes: int | Sequence[int] | None = None,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
    promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
    bias_metadata: Mapping[str, Any] = _EMPTY,
    scale_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("GroupNorm", rngs)
    if (num_groups is None) == (group_size is None):
      raise ValueError(
        f"GroupNorm: give exactly one of num_groups and group_size, got num_groups="
        f"{num_groups} and group_size={group_size}. num_groups defaults to 32; to "
        "give group_size, pass `num_groups=None, group_size=...`."
      )
    if group_size is not None:
      if not isinstance(group_size, int) or group_size <= 0 or num_features % group_size:
        raise ValueError(
          f"GroupNorm: group_size={group_size} does not divide num_features="
          f"{num_features}. Fix: a group_size among the divisors of {num_features}."
        )
      num_groups = num_features // group_size
    elif not isinstance(num_groups, int) or num_groups <= 0 or num_features % num_groups:
      raise ValueError(
        f"GroupNorm: num_groups={num_groups} does not divide num_features="
        f"{num_features}. Fix: a num_groups among the divisors of {num_features} "
        "(the default is 32)."
      )
    param = param_maker(rngs, param_dtype)
    self.scale = param(scale_init, (num_features,), scale_metadata) if use_scale else None
    self.bias = param(bias_init, (num_features,), bias_metadata) if use_bias else None
    self.feature_axis = -1
    self.num_features = num_features
    self.num_groups = num_groups
    self.group_size = num_features // num_groups
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.use_scale = use_scale
    self.reduction_axes = freeze(reduction_axes)
    keep_stats_options(self, axis_name, axis_index_groups, use_fast_variance, promote_dtype)

  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """Normalises ``x`` of shape ``(batch, ..., num_features)``; ``mask`` (same shape)
    restricts the statistics to its entries."""
    if x.ndim < 2:
      raise ValueError(
        located(
          f"GroupNorm takes inputs of shape (batch, ..., {self.num_features}), rank at "
          f"least 2 (the first axis is the batch, never averaged over), but got one of "
          f"shape {tuple(x.shape)}. Fix: add the batch axis, `x[None]`.",
          self,
        )
      )
    check_feature_axes("GroupNorm", x, -1, self.num_features, self)
    reduction_axes = self.reduction_axes
    if reduction_axes is None:
      reduction_axes = list(range(1, x.ndim - 1)) + [-1]
    reduction_axes = canonicalize_axes(x.ndim, reduction_axes)
    groups = x.shape[:-1] + (self.num_groups, self.group_size)
    if mask is not None:
      mask = mask.reshape(mask.shape[:-1] + (self.num_groups, self.group_size))
    x, scale, bias = promoted(self, x, self.scale, self.bias)
    mean, var = layer_stats(self, x.reshape(groups), list(reduction_axes[:-1]) + [-1], mask)
    # The groups axis is the statistics' last; nnx repeats along axis 1, the same
    # for the default reduction axes and wrong (silently) for others.
    mean = jnp.repeat(mean, self.group_size, axis=-1)
    var = jnp.repeat(var, self.group_size, axis=-1)
    return normalize(self, x, mean, var, scale, bias, reduction_axes[:-1], (self.feature_axis,))


class InstanceNorm(Module):
  """Instance normalisation: each example and channel normalised over the other axes.

  As ``flax.nnx.InstanceNorm``: statistics over every axis but the first (the batch)
  and ``feature_axes`` (default the last), then ``scale`` and ``bias`` per feature.

  Args:
    num_features: size of the feature axes (``scale``/``bias`` shape).
    epsilon: added to the variance (default ``1e-6``).
    dtype: result dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    use_bias: whether ``bias`` exists (default ``True``).
    use_scale: whether ``scale`` exists (default ``True``).
    bias_init: initialiser of ``bias`` (default ``jax.nn.initializers.zeros``).
    scale_init: initialiser of ``scale`` (default ``jax.nn.initializers.ones``).
    feature_axes: the feature axes, never axis 0, the batch (default ``-1``).
    axis_name: a mapped axis (``jax.vmap`` / ``shard_map``) to average the statistics
      over too (default ``None``: none).
    axis_index_groups: groups of indices along ``axis_name`` averaged separately, as
      ``jax.lax.pmean`` takes them (default ``None``: all together).
    use_fast_variance: ``E[x^2] - E[x]^2`` instead of ``E[(x - E[x])^2]`` (default
      ``True``).
    promote_dtype: ``(x, scale, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    rngs: draws ``rngs.params()`` for ``scale``, then ``bias``.
    bias_metadata: metadata put on ``bias`` (default ``{}``: none).
    scale_metadata: metadata put on ``scale`` (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.

  >>> import jax, statefulremat as sr
  >>> norm = sr.nn.InstanceNorm(3, rngs=sr.Rngs(0))
  >>> y = norm(jax.random.normal(jax.random.key(0), (2, 8, 3)))
  >>> y.shape, round(float(y[1, :, 2].mean()), 5) == 0
  ((2, 8, 3), True)
  """

  def __init__(
    self,
    num_features: int,
    *,
    epsilon: float = 1e-6,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    use_bias: bool = True,
    use_scale: bool = True,
    bias_init: Initializer = jax.nn.initializers.zeros,
    scale_init: Initializer = jax.nn.initializers.ones,
    feature_axes: int | Sequence[int] = -1,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
    promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
    bias_metadata: Mapping[str, Any] = _EMPTY,
    scale_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("InstanceNorm", rngs)
    param = param_maker(rngs, param_dtype)
    self.scale = param(scale_init, (num_features,), scale_metadata) if use_scale else None
    self.bias = param(bias_init, (num_features,), bias_metadata) if use_bias else None
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.use_scale = use_scale
    self.feature_axes = freeze(feature_axes)
    keep_stats_options(self, axis_name, axis_index_groups, use_fast_variance, promote_dtype)

  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """Normalises ``x`` of shape ``(batch, ...)``; ``mask`` (same shape) restricts
    the statistics to its entries."""
    feature_axes = check_feature_axes("InstanceNorm", x, self.feature_axes, self.num_features, self)
    if 0 in feature_axes:
      raise ValueError(
        located(
          f"InstanceNorm: feature_axes={self.feature_axes} includes axis 0 of the input "
          f"of shape {tuple(x.shape)}, but axis 0 is the batch. Fix: add a batch axis "
          "(`x[None]`), or build the layer with feature axes after the first.",
          self,
        )
      )
    reduction_axes = [i for i in range(1, x.ndim) if i not in feature_axes]
    x, scale, bias = promoted(self, x, self.scale, self.bias)
    mean, var = layer_stats(self, x, reduction_axes, mask)
    return normalize(self, x, mean, var, scale, bias, reduction_axes, feature_axes)
