"""SpectralNorm and WeightNorm: wrappers that normalise another layer's weights.

Both wrap a layer (``Linear``, ``Conv``, ...) and run it with some of its Params
replaced by a normalised version, with flax.nnx 0.12's names, signatures, state and
per-call numerics, so ``sr.interop.from_nnx`` moves their weights with no rename.

One deliberate difference from nnx 0.12: nnx writes the normalised weights back into
the wrapped layer's Params (flax issue #5576), so the next call normalises the
already normalised weights and training updates those. Here the normalised weights
exist only during the wrapped layer's call: the Param keeps the weight being trained
(``w`` of the papers; linen's ``SpectralNorm`` / ``WeightNorm`` and PyTorch do the
same). A first call computes what nnx's first call computes, gradients included.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core._errors import GraphError, StateMismatchError, format_path
from ..core._filters import PathContains, to_predicate
from ..core._kinds import BatchStat, Param
from ..core._module import Module
from ..core._rngs import Rngs
from ..core._variables import Variable, path_of
from ._dtypes import canonicalize_dtype
from ._dtypes import promote_dtype as default_promote_dtype
from ._linear import Initializer, freeze, named
from ._normalization import canonicalize_axes
from ._rngs_arg import check_rngs


def _l2_normalize(x: jax.Array, axis: Any = None, eps: float = 1e-12) -> jax.Array:
  """``x`` divided by its L2 norm over ``axis`` (all axes for None), nnx's formula."""
  return x * lax.rsqrt((x * x).sum(axis=axis, keepdims=True) + eps)


def _around(wrapper: str, layer: Module) -> str:
  """How a wrapper being built is named: by the place of the layer it wraps, if any."""
  path = path_of(layer)
  return (
    f"{wrapper} around the {type(layer).__name__} at `{format_path(path)}`" if path else wrapper
  )


def _check_layer(wrapper: str, layer: Any) -> None:
  if isinstance(layer, Module):
    return
  kind = type(layer)
  fix = f"pass a layer instance, e.g. sr.nn.{wrapper}(sr.nn.Linear(4, 8, rngs=rngs), rngs=rngs)"
  if kind.__module__.startswith("flax"):
    got = f"a flax {kind.__qualname__}"
    fix = (
      "build the layer with sr.nn (e.g. sr.nn.Linear) and wrap that; copy nnx "
      "weights in afterwards with sr.interop.from_nnx(ours, theirs)"
    )
  elif isinstance(layer, type):
    got = f"the class {layer.__qualname__} (not an instance)"
  else:
    got = "a function" if callable(layer) else f"a {kind.__qualname__}"
  raise GraphError(
    f"{wrapper} wraps a layer whose Params it normalises (an sr.Module such as "
    f"sr.nn.Linear or sr.nn.Conv), got {got}. Fix: {fix}."
  )


def _params(layer: Module) -> list[tuple[tuple, Variable]]:
  """``[(path, Param)]`` of ``layer``, paths relative to it, in ``sr.state`` order."""
  return [(p, v) for p, v in layer.iter_variables() if isinstance(v, Param)]


def _shapes(params: list[tuple[tuple, Variable]]) -> str:
  return ", ".join(f"`{format_path(p)}` {tuple(v.shape)}" for p, v in params) or "none"


@contextlib.contextmanager
def _substituted(values: list[tuple[Variable, Any]]) -> Iterator[None]:
  """Gives each Variable its new value for the duration of the block, then puts the
  very same old value back (also when the block raises), so a transform around the
  call sees these Variables unchanged and gradients flow through the new values."""
  old = []
  try:
    for var, value in values:
      old.append((var, var.value))
      var.value = value
    yield
  finally:
    for var, value in reversed(old):
      var.value = value


class SpectralNorm(Module):
  """Runs ``layer_instance`` with each weight matrix divided by its top singular value.

  The singular value ``sigma`` is estimated by ``n_steps`` of power iteration from a
  stored vector ``u``; with ``update_stats`` the new ``u`` and ``sigma`` are kept,
  so the estimate improves from call to call. Params of one dimension (biases) are
  left as they are; a Param of more than two dimensions (a Conv kernel) is treated
  as the matrix of its leading axes flattened against its last one, or refused with
  ``error_on_non_matrix=True``. Names, state and numerics are ``flax.nnx.SpectralNorm``'s
  (0.12): for the Param at path ``p`` of the wrapped layer, BatchStats
  ``batch_stats[p + ("u",)]`` of shape ``(1, out)`` and ``batch_stats[p + ("sigma",)]``
  (a scalar). Unlike nnx, the Params themselves are never overwritten: the
  normalised matrix exists only during the call (see this module's docstring).

  Args:
    layer_instance: the layer to wrap (an ``sr.Module`` with a kernel).
    n_steps: power-iteration steps per call (below 1: no normalisation at all, as in
      nnx).
    epsilon: added under the square root of the L2 normalisations.
    dtype: dtype of the normalised weights (default: inferred from the weights and
      the statistics).
    param_dtype: dtype of ``u`` and ``sigma``.
    error_on_non_matrix: refuse Params of more than two dimensions.
    update_stats: whether calls keep the new ``u`` and ``sigma``; stored as
      ``use_running_average = not update_stats``, so ``model.train()`` /
      ``model.eval()`` switch it, as they switch BatchNorm.
    rngs: draws ``rngs.params()`` once per normalised Param (for ``u``).

  >>> import jax.numpy as jnp, numpy as np, statefulremat as sr
  >>> layer = sr.nn.SpectralNorm(sr.nn.Linear(4, 3, rngs=sr.Rngs(0)), n_steps=20,
  ...                            rngs=sr.Rngs(1))
  >>> sorted(sr.state(layer, sr.BatchStat).flat())
  [('batch_stats', ('kernel', 'sigma')), ('batch_stats', ('kernel', 'u'))]
  >>> y = layer(jnp.ones((2, 4)))                 # training: u and sigma are updated
  >>> sigma = float(layer.batch_stats["kernel", "sigma"].value)
  >>> bool(np.isclose(sigma, np.linalg.norm(layer.layer_instance.kernel.value, 2)))
  True
  >>> u = layer.batch_stats["kernel", "u"].value
  >>> y2 = layer.eval()(jnp.ones((2, 4)))          # evaluation: the stats stay
  >>> bool((layer.batch_stats["kernel", "u"].value == u).all())
  True
  """

  def __init__(
    self,
    layer_instance: Module,
    *,
    n_steps: int = 1,
    epsilon: float = 1e-12,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    error_on_non_matrix: bool = False,
    update_stats: bool = True,
    rngs: Rngs,
  ):
    _check_layer("SpectralNorm", layer_instance)
    check_rngs("SpectralNorm", rngs)
    where = _around("SpectralNorm", layer_instance)
    self.layer_instance = layer_instance
    self.n_steps = n_steps
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.error_on_non_matrix = error_on_non_matrix
    # model.train() / model.eval() set use_running_average; update_stats is its opposite.
    self.use_running_average = not update_stats
    batch_stats: dict[tuple, BatchStat] = {}
    if n_steps >= 1:
      params = _params(layer_instance)
      for path, var in params:
        if var.ndim <= 1:
          continue
        columns = self._matrix_shape(path, var.shape, where)[1]
        u = jax.nn.initializers.normal()(rngs.params(), (1, columns), param_dtype)
        batch_stats[path + ("u",)] = BatchStat(u)
        batch_stats[path + ("sigma",)] = BatchStat(jnp.ones((), param_dtype))
      if not batch_stats:
        raise ValueError(
          f"{where}: the wrapped "
          f"{type(layer_instance).__name__} has no Param of two or more dimensions to "
          f"normalise (its Params: {_shapes(params)}), so SpectralNorm would do "
          "nothing. Fix: wrap the layer whose kernel you mean to normalise (Linear, "
          "Conv, Einsum, ...)."
        )
    self.batch_stats = batch_stats

  def _matrix_shape(self, path: tuple, shape: tuple, where: str) -> tuple[int, int]:
    """The (rows, columns) a Param of ``shape`` (2 or more dims) is normalised as."""
    rows, columns = math.prod(shape[:-1]), shape[-1]
    if len(shape) > 2 and self.error_on_non_matrix:
      raise ValueError(
        f"{where}: `layer_instance.{format_path(path)}` has shape {tuple(shape)} "
        f"({len(shape)}-D), but error_on_non_matrix=True allows only matrices. "
        f"Fix: pass error_on_non_matrix=False to normalise it as the "
        f"({rows}, {shape[-1]}) matrix of its leading axes against its last, or wrap "
        "a layer whose weights are matrices (e.g. Linear)."
      )
    return rows, columns

  def __call__(self, x: Any, update_stats: bool | None = None) -> jax.Array:
    """Runs the wrapped layer on ``x`` with its weight matrices spectrally normalised.

    ``update_stats`` overrides the mode (``not self.use_running_average``) for this
    call: keep the new ``u`` and ``sigma`` or not.
    """
    if update_stats is None:
      if self.use_running_average is None:
        raise ValueError(
          f"{named('SpectralNorm', self)} does not know whether to update `u` and "
          "`sigma`: its use_running_average is None. Fix: set the mode "
          "(`model.train()` / `model.eval()`), or call `layer(x, "
          "update_stats=True)`."
        )
      update_stats = not self.use_running_average
    normalised, stats = [], []
    if self.n_steps >= 1:
      for path, var in _params(self.layer_instance):
        if var.ndim > 1:
          w, u, sigma = self._normalise(path, var.value)
          normalised.append((var, w))
          stats.append((path, u, sigma))
    with _substituted(normalised):
      y = self.layer_instance(x)
    if update_stats:
      for path, u, sigma in stats:
        for name, value in (("u", u), ("sigma", sigma)):
          stat = self.batch_stats[path + (name,)]
          stat.value = value.astype(stat.dtype)
    return y

  def _normalise(self, path: tuple, w: jax.Array):
    """``(w / sigma in the result dtype, new u, sigma)`` for the Param at ``path``."""
    rows, columns = self._matrix_shape(path, jnp.shape(w), named("SpectralNorm", self))
    u_stat = self.batch_stats.get(path + ("u",))
    if u_stat is None or path + ("sigma",) not in self.batch_stats:
      raise StateMismatchError(
        f"{named('SpectralNorm', self)}: `layer_instance.{format_path(path)}` "
        f"{tuple(jnp.shape(w))} has no `u` / `sigma` in `batch_stats` (they are made "
        f"for the Params the layer had when it was wrapped: "
        f"{_stat_params(self.batch_stats)}). Fix: wrap the layer after its Params "
        "are all in place (build a new SpectralNorm around it)."
      )
    if u_stat.shape != (1, columns):
      raise StateMismatchError(
        f"{named('SpectralNorm', self)}: `batch_stats[{path + ('u',)!r}]` has shape "
        f"{tuple(u_stat.shape)}, but `layer_instance.{format_path(path)}` of shape "
        f"{tuple(jnp.shape(w))} needs (1, {columns}). Fix: wrap the layer after its "
        "Params have their final shapes (build a new SpectralNorm around it)."
      )
    matrix = jnp.reshape(w, (rows, columns))
    u = u_stat.value
    for _ in range(self.n_steps):
      v = _l2_normalize(jnp.matmul(u, matrix.T), eps=self.epsilon)
      u = _l2_normalize(jnp.matmul(v, matrix), eps=self.epsilon)
    u, v = lax.stop_gradient(u), lax.stop_gradient(v)
    sigma = jnp.matmul(jnp.matmul(v, matrix), u.T)[0, 0]
    matrix = matrix / jnp.where(sigma != 0, sigma, 1)
    dtype = canonicalize_dtype(matrix, u, v, sigma, dtype=self.dtype)
    return jnp.asarray(matrix.reshape(jnp.shape(w)), dtype), u, sigma


def _stat_params(batch_stats: dict) -> str:
  paths = sorted({format_path(k[:-1]) for k in batch_stats}, key=str)
  return ", ".join(f"`{p}`" for p in paths) or "none"


class WeightNorm(Module):
  """Runs ``layer_instance`` with its kernels L2-normalised per feature, times ``scales``.

  Each Param of the wrapped layer matched by ``variable_filter`` (default: paths
  containing ``"kernel"``) is divided by its L2 norm over every axis but
  ``feature_axes`` and, with ``use_scale``, multiplied by a Param ``scales[path]``
  of the shape of those axes: ``w = g * v / ||v||`` of the weight-normalisation
  paper. Names and numerics are ``flax.nnx.WeightNorm``'s (0.12), ``scales`` keyed
  by the Param's path in the wrapped layer (``scales["kernel",]``). Unlike nnx 0.12,
  the scales are Params (trained; nnx keeps them as plain arrays, flax issue #5577),
  ``param_dtype`` is their dtype (nnx leaves them float32 whatever it is), and the
  wrapped layer's Params are never overwritten (see this module's docstring).

  Args:
    layer_instance: the layer to wrap (an ``sr.Module``).
    feature_axes: the axes that keep their own norm (an int, a tuple, or None for one
      norm over the whole Param).
    use_scale: multiply by the ``scales`` Params.
    scale_init: initialiser of the scales (ones).
    epsilon: added under the square root.
    dtype: dtype of the normalised weights (default: inferred).
    param_dtype: dtype of the scales.
    variable_filter: which of the wrapped layer's Params to normalise (a filter:
      ``sr.PathContains("kernel")``, a ``(path, variable) -> bool`` callable, ...).
    promote_dtype: ``(normalised, weight, scale), dtype=`` -> promoted arrays; the
      first is used.
    rngs: draws ``rngs.params()`` once per scale.

  >>> import jax.numpy as jnp, numpy as np, statefulremat as sr
  >>> linear = sr.nn.Linear(8, 4, use_bias=False, rngs=sr.Rngs(0))
  >>> layer = sr.nn.WeightNorm(linear, rngs=sr.Rngs(1))
  >>> layer.scales[("kernel",)].shape
  (4,)
  >>> w = layer(jnp.eye(8))              # the rows of eye @ w are the rows of w
  >>> np.allclose(np.linalg.norm(w, axis=0), 1.0)    # unit columns, times scales 1
  True
  >>> bool((layer.layer_instance.kernel.value == w).all())   # the Param is not changed
  False
  """

  def __init__(
    self,
    layer_instance: Module,
    *,
    feature_axes: int | Sequence[int] | None = -1,
    use_scale: bool = True,
    scale_init: Initializer = jax.nn.initializers.ones,
    epsilon: float = 1e-12,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    variable_filter: Any = PathContains("kernel"),  # noqa: B008 (immutable)
    promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
  ):
    _check_layer("WeightNorm", layer_instance)
    check_rngs("WeightNorm", rngs)
    where = _around("WeightNorm", layer_instance)
    self.layer_instance = layer_instance
    self.feature_axes = () if feature_axes is None else freeze(feature_axes)
    self.use_scale = use_scale
    self.scale_init = scale_init
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.variable_filter = to_predicate(variable_filter)
    self.promote_dtype = promote_dtype
    params = _params(layer_instance)
    matched = [(p, v) for p, v in params if self.variable_filter(p, v)]
    if not matched:
      raise ValueError(
        f"{where}: variable_filter="
        f"{variable_filter!r} matches none of the wrapped "
        f"{type(layer_instance).__name__}'s Params ({_shapes(params)}), so "
        "WeightNorm would do nothing. Fix: pass a variable_filter that names the "
        "weights to normalise, e.g. variable_filter=sr.PathContains('kernel')."
      )
    scales: dict[tuple, Param] | None = None
    if use_scale:
      scales = {}
      for path, var in matched:
        axes = self._axes(path, var.ndim, where)[0]
        shape = tuple(var.shape[a] for a in axes)
        scales[path] = Param(scale_init(rngs.params(), shape, param_dtype))
    self.scales = scales

  def _axes(self, path: tuple, ndim: int, where: str) -> tuple[tuple, tuple]:
    """``(feature axes, reduction axes)`` of a Param of rank ``ndim``."""
    axes = self.feature_axes if isinstance(self.feature_axes, tuple) else (self.feature_axes,)
    if any(not -ndim <= a < ndim for a in axes):
      raise ValueError(
        f"{where}: feature_axes={self.feature_axes!r} is out "
        f"of range for `layer_instance.{format_path(path)}`, which has {ndim} "
        f"dimensions. Fix: pass axes in [-{ndim}, {ndim - 1}] (-1 is the output "
        "features of Linear and Conv kernels)."
      )
    feature = canonicalize_axes(ndim, axes)
    return feature, tuple(i for i in range(ndim) if i not in feature)

  def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs the wrapped layer on ``x`` (and ``args`` / ``kwargs``, passed on) with its
    matched Params weight-normalised."""
    normalised = []
    for path, var in _params(self.layer_instance):
      if self.variable_filter(path, var):
        normalised.append((var, self._normalise(path, var.value)))
    with _substituted(normalised):
      return self.layer_instance(x, *args, **kwargs)

  def _normalise(self, path: tuple, w: jax.Array) -> jax.Array:
    ndim = jnp.ndim(w)
    feature, reduction = self._axes(path, ndim, named("WeightNorm", self))
    value = _l2_normalize(w, axis=reduction, eps=self.epsilon)
    scale = None
    if self.use_scale:
      stat = (self.scales or {}).get(path)
      want = tuple(jnp.shape(w)[a] for a in feature)
      if stat is None or tuple(stat.shape) != want:
        have = (
          "there is none" if stat is None else f"`scales[{path!r}]` has shape {tuple(stat.shape)}"
        )
        raise StateMismatchError(
          f"{named('WeightNorm', self)}: `layer_instance.{format_path(path)}` "
          f"{tuple(jnp.shape(w))} needs a scale of shape {want}, but {have} (scales "
          "are made for the Params the layer had when it was wrapped). Fix: wrap the "
          "layer after its Params are in place (build a new WeightNorm around it)."
        )
      scale = stat.value
      if len(feature) < ndim:
        scale = jnp.reshape(scale, [jnp.shape(w)[a] if a in feature else 1 for a in range(ndim)])
      value = value * scale
    return self.promote_dtype((value, w, scale), dtype=self.dtype)[0]
