"""BatchNorm: normalisation by batch statistics, with running averages in BatchStats."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..core._frozen import EMPTY as _EMPTY
from ..core._kinds import BatchStat
from ..core._module import Module
from ..core._rngs import Rngs
from ._dtypes import promote_dtype as default_promote_dtype
from ._linear import Initializer, freeze, named, param_maker, promoted
from ._normalization import (
  canonicalize_axes,
  check_feature_axes,
  keep_stats_options,
  layer_stats,
  normalize,
)
from ._rngs_arg import check_rngs


class BatchNorm(Module):
  """Batch normalisation with Params ``scale``, ``bias`` and BatchStats ``mean``, ``var``.

  In training mode (``use_running_average=False``) it normalises with the statistics
  of the batch (every axis but ``axis``) and updates the running averages,
  ``mean <- momentum * mean + (1 - momentum) * batch_mean`` (likewise ``var``); in
  evaluation mode it normalises with the running averages and changes nothing.
  ``model.train()`` / ``model.eval()`` flip ``use_running_average``. Everything —
  defaults, statistics in float32, the update rule — is ``flax.nnx.BatchNorm``'s.
  Training on an empty batch raises (its statistics would be NaN, the running
  averages with them); evaluation on one returns an empty output.

  Args:
    num_features: size of the feature axis.
    use_running_average: evaluation mode (default ``False``: training); the call
      argument overrides it, ``None`` requires it.
    axis: the feature axis (default ``-1``), or a tuple of axes whose sizes multiply to
      ``num_features``.
    momentum: decay of the running averages (default ``0.99``).
    epsilon: added to the variance (default ``1e-5``).
    dtype: result dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype ``scale`` and ``bias`` are initialised in (default
      ``jnp.float32``; the running averages are always float32).
    use_bias: whether ``bias`` exists (default ``True``).
    use_scale: whether ``scale`` exists (default ``True``).
    bias_init: initialiser of ``bias`` (default ``jax.nn.initializers.zeros``).
    scale_init: initialiser of ``scale`` (default ``jax.nn.initializers.ones``).
    axis_name: a mapped axis (``jax.vmap`` / ``shard_map``) to average the batch
      statistics over (default ``None``: none).
    axis_index_groups: groups of indices along ``axis_name`` averaged separately, as
      ``jax.lax.pmean`` takes them (default ``None``: all together).
    use_fast_variance: ``E[x^2] - E[x]^2`` instead of ``E[(x - E[x])^2]`` (default
      ``True``).
    promote_dtype: ``(x, mean, var, scale, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    rngs: draws ``rngs.params()`` per parameter, as nnx does.
    bias_metadata: metadata put on ``bias`` (default ``{}``: none).
    scale_metadata: metadata put on ``scale`` (default ``{}``: none).
    mean_metadata: metadata put on ``mean`` (default ``{}``: none).
    var_metadata: metadata put on ``var`` (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> bn = sr.nn.BatchNorm(3, momentum=0.5, rngs=sr.Rngs(0))
  >>> x = jnp.arange(12.0).reshape(4, 3)   # column means 4.5, 5.5, 6.5
  >>> _ = bn(x)                      # training: uses and updates the statistics
  >>> bn.mean.value.tolist()
  [2.25, 2.75, 3.25]
  >>> y = bn.eval()(x)               # evaluation: uses the running averages
  >>> bn.mean.value.tolist()
  [2.25, 2.75, 3.25]
  """

  def __init__(
    self,
    num_features: int,
    *,
    use_running_average: bool | None = False,
    axis: int | tuple[int, ...] = -1,
    momentum: float = 0.99,
    epsilon: float = 1e-5,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    use_bias: bool = True,
    use_scale: bool = True,
    bias_init: Initializer = jax.nn.initializers.zeros,
    scale_init: Initializer = jax.nn.initializers.ones,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
    promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
    bias_metadata: Mapping[str, Any] = _EMPTY,
    scale_metadata: Mapping[str, Any] = _EMPTY,
    mean_metadata: Mapping[str, Any] = _EMPTY,
    var_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("BatchNorm", rngs)
    shape = (num_features,)
    self.mean = BatchStat(jnp.zeros(shape, jnp.float32), **(mean_metadata or {}))
    self.var = BatchStat(jnp.ones(shape, jnp.float32), **(var_metadata or {}))
    param = param_maker(rngs, param_dtype)
    self.scale = param(scale_init, shape, scale_metadata) if use_scale else None
    self.bias = param(bias_init, shape, bias_metadata) if use_bias else None
    self.num_features = num_features
    self.use_running_average = use_running_average
    self.axis = freeze(axis)
    self.momentum = momentum
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.use_scale = use_scale
    keep_stats_options(self, axis_name, axis_index_groups, use_fast_variance, promote_dtype)

  def __call__(
    self, x: jax.Array, use_running_average: bool | None = None, *, mask: jax.Array | None = None
  ) -> jax.Array:
    """Normalises ``x``; ``use_running_average`` overrides the layer's mode for this call.

    ``mask`` (same rank as ``x``) restricts the batch statistics to its entries.
    """
    if use_running_average is None:
      use_running_average = self.use_running_average
    if use_running_average is None:
      raise ValueError(
        "BatchNorm does not know whether to use batch statistics: its "
        "use_running_average is None. Either set the mode on the model "
        "(`model.train()` / `model.eval()`), build it with "
        "`BatchNorm(..., use_running_average=False)`, or call "
        "`bn(x, use_running_average=True)`."
      )
    check_feature_axes("BatchNorm", x, self.axis, self.num_features, self, "axis")
    feature_axes = canonicalize_axes(x.ndim, self.axis)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    x, mean, var, scale, bias = promoted(self, x, self.mean, self.var, self.scale, self.bias)
    if not use_running_average:
      if not math.prod(x.shape[a] for a in reduction_axes):
        # Shapes are static, so this raises while tracing too: before anything is written.
        raise ValueError(
          f"{named('BatchNorm', self)}: training on an empty batch (input shape "
          f"{tuple(x.shape)}, no entries along the axes {reduction_axes} it averages "
          "over). Its batch statistics would be NaN, and so, for good, would the running "
          "averages `mean` and `var`; nothing was changed. Fix: skip the step when the "
          "batch is empty (e.g. `if x.shape[0]:`), or normalise with the running "
          "averages: `bn(x, use_running_average=True)` or `model.eval()`."
        )
      mean, var = layer_stats(self, x, reduction_axes, mask)
      # Batch statistics are a flat (features,) vector whatever the feature axes.
      mean, var = mean.reshape(-1), var.reshape(-1)
      m = self.momentum
      self.mean.value = m * self.mean.value + (1 - m) * mean
      self.var.value = m * self.var.value + (1 - m) * var
    return normalize(
      x, mean, var, scale, bias, reduction_axes, feature_axes, self.dtype, self.epsilon
    )
