"""The normalisation layers: LayerNorm, RMSNorm, BatchNorm (running averages in
BatchStats), GroupNorm and InstanceNorm (per example, over groups of channels), and the
statistics helpers they share.

The numerics are flax.nnx's: statistics in at least float32 (half-precision inputs
are promoted for the reductions), the fast variance ``E[x^2] - E[x]^2`` clipped at
zero by default, and ``(x - mean) * rsqrt(var + epsilon) * scale + bias``; the feature
axis is the last for GroupNorm.
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
