"""LayerNorm, RMSNorm and BatchNorm (running averages in BatchStats), and the statistics
helpers GroupNorm and InstanceNorm share.

The numerics are flax.nnx's: statistics in at least float32 (half-precision inputs
are promoted for the reductions), the fast variance ``E[x^2] - E[x]^2`` clipped at
zero by default, and ``(x - mean) * rsqrt(var + epsilon) * scale + bias``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core._frozen import EMPTY as _EMPTY
from ..core._kinds import BatchStat
from ..core._module import Module
from ..core._rngs import Rngs
from ._dtypes import canonicalize_dtype
from ._dtypes import promote_dtype as default_promote_dtype
from ._linear import Initializer, freeze, located, named, param_maker, promoted
from ._rngs_arg import check_rngs


def canonicalize_axes(rank: int, axes: int | Sequence[int]) -> tuple[int, ...]:
  """Sorted, de-duplicated, non-negative axes."""
  axes = axes if isinstance(axes, Sequence) else (axes,)
  return tuple(sorted({rank + a if a < 0 else a for a in axes}))


def _abs_sq(x):
  if jnp.iscomplexobj(x):
    return lax.square(lax.real(x)) + lax.square(lax.imag(x))
  return lax.square(x)


def compute_stats(
  x: jax.Array,
  axes,
  dtype: Any,
  axis_name: str | None = None,
  axis_index_groups: Any = None,
  use_mean: bool = True,
  use_fast_variance: bool = True,
  mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """``(mean, var)`` of ``x`` over ``axes``, in at least float32 (nnx's numerics).

  ``axis_name`` also averages over a ``pmap`` / ``shard_map`` axis; ``use_mean=False``
  gives a zero mean and the mean square (RMSNorm); ``mask`` selects the entries.

  >>> import jax.numpy as jnp
  >>> from statefulremat.nn._normalization import compute_stats
  >>> mean, var = compute_stats(jnp.array([[1., 3.], [5., 7.]]), (0,), None)
  >>> mean.tolist(), var.tolist()
  ([3.0, 5.0], [4.0, 4.0])
  """
  dtype = jnp.promote_types(jnp.result_type(x) if dtype is None else dtype, jnp.float32)
  x = jnp.asarray(x, dtype)
  axes = canonicalize_axes(x.ndim, axes)

  def means(*xs: jax.Array) -> tuple[jax.Array, ...]:
    mus = tuple(v.mean(axes, where=mask) for v in xs)
    if axis_name is None:
      return mus
    # One collective for both statistics: stack them.
    reduced = lax.pmean(jnp.stack(mus), axis_name, axis_index_groups=axis_index_groups)
    return tuple(reduced)

  if not use_mean:
    (var,) = means(_abs_sq(x))
    return jnp.zeros_like(var), var
  if use_fast_variance:
    mu, mu2 = means(x, _abs_sq(x))
    # mu2 - mu^2 can dip below zero by round-off; a negative variance would NaN.
    return mu, jnp.maximum(0.0, mu2 - _abs_sq(mu))
  (mu,) = means(x)
  (var,) = means(_abs_sq(x - jnp.expand_dims(mu, axes)))
  return mu, var


def layer_stats(layer: Any, x: jax.Array, axes, mask, use_mean: bool = True):
  """``compute_stats`` with ``layer``'s ``dtype``, ``axis_name``, ``axis_index_groups``
  and ``use_fast_variance``."""
  return compute_stats(
    x,
    axes,
    layer.dtype,
    layer.axis_name,
    layer.axis_index_groups,
    use_mean=use_mean,
    use_fast_variance=layer.use_fast_variance,
    mask=mask,
  )


def keep_stats_options(layer, axis_name, axis_index_groups, use_fast_variance, promote_dtype):
  """Keeps on ``layer`` the options ``layer_stats`` and ``promoted`` read."""
  layer.axis_name = axis_name
  layer.axis_index_groups = freeze(axis_index_groups)
  layer.use_fast_variance = use_fast_variance
  layer.promote_dtype = promote_dtype


def normalize(layer, x, mean, var, scale, bias, reduction_axes, feature_axes) -> jax.Array:
  """``(x - mean) * rsqrt(var + epsilon) * scale + bias``, broadcast explicitly, with
  ``layer``'s ``epsilon`` and ``dtype``."""
  reduction_axes = canonicalize_axes(x.ndim, reduction_axes)
  feature_axes = canonicalize_axes(x.ndim, feature_axes)
  stats_shape = tuple(1 if i in reduction_axes else n for i, n in enumerate(x.shape))
  feature_shape = tuple(n if i in feature_axes else 1 for i, n in enumerate(x.shape))
  y = x - mean.reshape(stats_shape)
  mul = lax.rsqrt(var.reshape(stats_shape) + layer.epsilon)
  if scale is not None:
    scale = scale.reshape(feature_shape)
    mul *= scale
  y *= mul
  if bias is not None:
    bias = bias.reshape(feature_shape)
    y += bias
  return jnp.asarray(y, canonicalize_dtype(x, scale, bias, dtype=layer.dtype))


class LayerNorm(Module):
  """Layer normalisation with ``scale`` and ``bias`` of shape ``(num_features,)``.

  Normalises each example over ``reduction_axes`` (default the last), then scales
  and shifts per feature. Defaults are nnx's: ``epsilon=1e-6``, scale ones, bias
  zeros, the fast variance.

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
    reduction_axes: the axes the statistics are taken over (default ``-1``).
    feature_axes: the axes ``scale`` and ``bias`` cover, their sizes multiplying to
      ``num_features`` (default ``-1``).
    axis_name: a mapped axis (``jax.vmap`` / ``shard_map``) to average the statistics
      over too (default ``None``: none).
    axis_index_groups: groups of indices along ``axis_name`` averaged separately, as
      ``jax.lax.pmean`` takes them (default ``None``: all together).
    use_fast_variance: ``E[x^2] - E[x]^2`` instead of ``E[(x - E[x])^2]`` (default
      ``True``).
    promote_dtype: ``(x, scale, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    rngs: draws ``rngs.params()`` per parameter, as nnx does.
    bias_metadata: metadata put on ``bias`` (default ``{}``: none).
    scale_metadata: metadata put on ``scale`` (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.

  >>> import jax, statefulremat as sr
  >>> norm = sr.nn.LayerNorm(6, rngs=sr.Rngs(0))
  >>> y = norm(jax.random.normal(jax.random.key(0), (3, 6)))
  >>> y.shape, round(float(y.mean()), 5) == 0
  ((3, 6), True)
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
    reduction_axes: int | Sequence[int] = -1,
    feature_axes: int | Sequence[int] = -1,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
    promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
    bias_metadata: Mapping[str, Any] = _EMPTY,
    scale_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("LayerNorm", rngs)
    param = param_maker(rngs, param_dtype)
    self.scale = param(scale_init, (num_features,), scale_metadata) if use_scale else None
    self.bias = param(bias_init, (num_features,), bias_metadata) if use_bias else None
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.use_scale = use_scale
    self.reduction_axes = freeze(reduction_axes)
    self.feature_axes = freeze(feature_axes)
    keep_stats_options(self, axis_name, axis_index_groups, use_fast_variance, promote_dtype)

  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """Normalises ``x``; ``mask`` (same rank) restricts the statistics to its entries."""
    check_feature_axes("LayerNorm", x, self.feature_axes, self.num_features, self)
    x, scale, bias = promoted(self, x, self.scale, self.bias)
    mean, var = layer_stats(self, x, self.reduction_axes, mask)
    return normalize(self, x, mean, var, scale, bias, self.reduction_axes, self.feature_axes)


class RMSNorm(Module):
  """Root-mean-square normalisation with ``scale`` of shape ``(num_features,)``.

  ``x * rsqrt(mean(x^2) + epsilon) * scale`` over ``reduction_axes``: no centring,
  no bias. Defaults are nnx's (``epsilon=1e-6``, scale ones).

  Gemma's RMSNorm (flax's Gemma example, Hugging Face's ``GemmaRMSNorm``) multiplies by
  ``1 + scale`` and starts ``scale`` at zeros: ``add_unit_offset=True`` (the spelling of
  Google's ``gemma_pytorch`` and of litgpt). ``scale`` then holds the checkpoints'
  values as they are: flax Gemma's ``scale``, Hugging Face Gemma's ``weight``.

  Args:
    num_features: size of the feature axes (``scale`` shape).
    epsilon: added to the mean square (default ``1e-6``).
    dtype: result dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype ``scale`` is initialised in (default ``jnp.float32``).
    use_scale: whether ``scale`` exists (default ``True``).
    scale_init: initialiser of ``scale``; default ``None``: ones, or zeros with
      ``add_unit_offset=True`` (so the layer starts as plain RMS normalisation either
      way).
    reduction_axes: the axes the statistics are taken over (default ``-1``).
    feature_axes: the axes ``scale`` covers, their sizes multiplying to
      ``num_features`` (default ``-1``).
    axis_name: a mapped axis (``jax.vmap`` / ``shard_map``) to average the statistics
      over too (default ``None``: none).
    axis_index_groups: groups of indices along ``axis_name`` averaged separately, as
      ``jax.lax.pmean`` takes them (default ``None``: all together).
    use_fast_variance: taken for nnx's signature, without effect: the mean square needs
      no centring (default ``True``).
    promote_dtype: ``(x, scale), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    rngs: draws ``rngs.params()`` for ``scale``.
    scale_metadata: metadata put on ``scale`` (default ``{}``: none).
    add_unit_offset: multiply by ``1 + scale`` instead of ``scale`` (default
      ``False``); it needs ``use_scale=True``.

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``add_unit_offset=True`` with ``use_scale=False``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> norm = sr.nn.RMSNorm(2, rngs=sr.Rngs(0))
  >>> x = jnp.array([[3.0, 4.0]])
  >>> bool(jnp.allclose(norm(x), x / jnp.sqrt(jnp.mean(x ** 2))))
  True
  >>> gemma = sr.nn.RMSNorm(2, add_unit_offset=True, rngs=sr.Rngs(0))
  >>> gemma.scale.value.tolist(), bool(jnp.allclose(gemma(x), norm(x)))
  ([0.0, 0.0], True)
  """

  def __init__(
    self,
    num_features: int,
    *,
    epsilon: float = 1e-6,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    use_scale: bool = True,
    scale_init: Callable | None = None,
    reduction_axes: int | Sequence[int] = -1,
    feature_axes: int | Sequence[int] = -1,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
    promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
    scale_metadata: Mapping[str, Any] = _EMPTY,
    add_unit_offset: bool = False,
  ):
    check_rngs("RMSNorm", rngs)
    if add_unit_offset and not use_scale:
      raise ValueError(
        "RMSNorm(add_unit_offset=True, use_scale=False): the unit offset is added to "
        "scale, and there is no scale. Fix: use_scale=True (Gemma's RMSNorm), or "
        "add_unit_offset=False for a norm without scale."
      )
    if scale_init is None:
      zeros, ones = jax.nn.initializers.zeros, jax.nn.initializers.ones
      scale_init = zeros if add_unit_offset else ones
    param = param_maker(rngs, param_dtype)
    self.scale = param(scale_init, (num_features,), scale_metadata) if use_scale else None
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_scale = use_scale
    self.add_unit_offset = add_unit_offset
    self.reduction_axes = freeze(reduction_axes)
    self.feature_axes = freeze(feature_axes)
    keep_stats_options(self, axis_name, axis_index_groups, use_fast_variance, promote_dtype)

  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Normalises ``x``; ``mask`` (same rank) restricts the statistics to its entries."""
    check_feature_axes("RMSNorm", x, self.feature_axes, self.num_features, self)
    x, scale = promoted(self, x, self.scale)
    if scale is not None and self.add_unit_offset:
      scale = 1 + scale
    mean, var = layer_stats(self, x, self.reduction_axes, mask, use_mean=False)
    return normalize(self, x, mean, var, scale, None, self.reduction_axes, self.feature_axes)


def check_feature_axes(
  layer: str,
  x: jax.Array,
  feature_axes,
  num_features: int,
  module: Any = None,
  name: str = "feature_axes",
) -> tuple[int, ...]:
  """A clear error, naming ``module``'s path and the expected shape, when the feature
  axes of ``x`` do not hold ``num_features`` values; returns them, canonicalised."""
  axes = feature_axes if isinstance(feature_axes, Sequence) else (feature_axes,)
  if any(not -x.ndim <= a < x.ndim for a in axes):
    raise ValueError(
      located(
        f"{layer}: {name}={feature_axes} is out of range for an input of shape "
        f"{tuple(x.shape)} (rank {x.ndim}). Fix: pass an input with those axes, or "
        f"build the layer with axes within -{x.ndim}..{x.ndim - 1}.",
        module,
      )
    )
  axes = canonicalize_axes(x.ndim, axes)
  size = math.prod(x.shape[a] for a in axes)
  if size != num_features:
    expected = ""
    if len(axes) == 1:
      want = list(x.shape)
      want[axes[0]] = num_features
      expected = f"; expected shape {tuple(want)}"
    raise ValueError(
      located(
        f"{layer} was built with num_features={num_features} but the input of shape "
        f"{tuple(x.shape)} has {size} features on {name}={feature_axes}"
        f"{expected}. Fix the input, or build the layer with num_features={size}.",
        module,
      )
    )
  return axes


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
    feature_axes = check_feature_axes("BatchNorm", x, self.axis, self.num_features, self, "axis")
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
    return normalize(self, x, mean, var, scale, bias, reduction_axes, feature_axes)
