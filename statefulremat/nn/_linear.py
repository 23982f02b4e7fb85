"""Linear (``y = x @ kernel + bias`` over the last axis), LinearGeneral (over several
input axes into several output axes) and Embed (a lookup table from integer ids to
vectors), as ``flax.nnx``'s; and the helpers every layer shares."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core._errors import format_path
from ..core._frozen import EMPTY as _EMPTY
from ..core._kinds import Param
from ..core._module import Module
from ..core._rngs import Rngs
from ..core._variables import Variable, path_of
from ._dtypes import promote_dtype as default_promote_dtype
from ._explicit import explicit_specs, sharding_like
from ._rngs_arg import check_rngs

# An initializer: `init(key, shape, dtype) -> jax.Array`, as jax.nn.initializers gives.
Initializer = Callable[..., jax.Array]

default_kernel_init = jax.nn.initializers.lecun_normal()
default_bias_init = jax.nn.initializers.zeros


def param_maker(rngs: Rngs, dtype: Any, kind: type = Param) -> Callable[..., Param[jax.Array]]:
  """``param(init, shape, metadata={})``: the ``kind`` Variable (a ``Param``) of
  ``init(rngs.params(), shape, dtype)`` with ``metadata``, as every layer makes its
  parameters (a key per call)."""

  def param(
    init: Initializer, shape: tuple, metadata: Mapping[str, Any] = _EMPTY
  ) -> Param[jax.Array]:
    return kind(init(rngs.params(), shape, dtype), **(metadata or {}))

  return param


def promoted(layer: Any, x: Any, *variables: Variable | None) -> tuple:
  """``x`` and the values of ``variables`` (``None`` kept) through ``layer.promote_dtype``
  to ``layer.dtype``."""
  values = (None if v is None else v.value for v in variables)
  return layer.promote_dtype((x, *values), dtype=layer.dtype)


def not_none(**options: Any) -> dict[str, Any]:
  """The ``options`` that are not None: only what is set is passed, so a user's
  contraction (``dot_general``, ``einsum_op``, ...) without these keywords works."""
  return {name: value for name, value in options.items() if value is not None}


def freeze(x: Any) -> Any:
  """Any sequence but a string (nested too) as a tuple: hashable configuration."""
  if isinstance(x, Sequence) and not isinstance(x, str):
    return tuple(freeze(v) for v in x)
  return x


def named(name: str, module: Any) -> str:
  """``name at `path``` where ``module`` sits in its model, or ``name`` if it is alone."""
  path = path_of(module)
  return f"{name} at `{format_path(path)}`" if path else name


def located(message: str, module: Any = None) -> str:
  """``message`` prefixed with where ``module`` sits in its model, if it is known.

  The path is the one ``Variable.path_str()`` gives (``blocks[0].mlp``); a layer
  used on its own has none, and the message is returned as is.

  >>> import statefulremat as sr
  >>> from statefulremat.nn._linear import located
  >>> class Net(sr.Module):
  ...   def __init__(self):
  ...     self.blocks = [sr.nn.Linear(2, 2, rngs=sr.Rngs(0))]
  >>> located("Linear was built ...", Net().blocks[0])
  'At `blocks[0]`: Linear was built ...'
  """
  path = path_of(module) if module is not None else ()
  return f"At `{format_path(path)}`: {message}" if path else message


def check_features(
  layer: str,
  x: jax.Array | np.ndarray,
  axis: int,
  expected: int,
  name: str = "in_features",
  module: Any = None,
) -> None:
  """Raises a ValueError naming the layer (and ``module``'s path) when
  ``x.shape[axis] != expected``."""
  if not hasattr(x, "shape"):  # a list or a Python scalar
    x = np.asarray(x)
  if x.ndim == 0 or x.shape[axis] != expected:
    want = list(x.shape) if x.ndim else ["...", expected]
    if x.ndim:
      want[axis] = expected
    raise ValueError(
      located(
        f"{layer} was built with {name}={expected} but got an input of shape "
        f"{tuple(x.shape)}; expected shape {shape_str(want)} (axis {axis} must have "
        f"size {expected}). Fix the input, or build the layer with "
        f"{name}={x.shape[axis] if x.ndim else '?'}.",
        module,
      )
    )


def shape_str(dims: list) -> str:
  """``dims`` written as a tuple, strings unquoted: ``(..., 3)``, ``(8,)``."""
  return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


class Linear(Module):
  """A dense layer with ``kernel`` (in, out) and ``bias`` (out,), as ``flax.nnx.Linear``.

  Parameters, defaults and numerics are nnx's: ``lecun_normal`` kernel, zero bias,
  float32 parameters, and the computation in ``dtype`` (default: the promotion of
  the input's and the parameters' dtypes) through ``lax.dot_general``.

  Args:
    in_features: size of the input's last axis.
    out_features: size of the output's last axis.
    use_bias: add ``bias`` (default ``True``).
    dtype: computation dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    precision: ``lax.Precision`` of the matmul (default ``None``: JAX's default).
    kernel_init: ``init(key, shape, dtype)`` of the kernel (default
      ``jax.nn.initializers.lecun_normal()``).
    bias_init: ``init(key, shape, dtype)`` of the bias (default
      ``jax.nn.initializers.zeros``).
    dot_general: the contraction (default ``lax.dot_general``).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    preferred_element_type: accumulation/output dtype passed to ``dot_general``
      (default ``None``: JAX's choice).
    rngs: draws ``rngs.params()`` for the kernel, then the bias.
    kernel_metadata: metadata put on the ``kernel`` Variable (e.g.
      ``{"sharding": ("embed", "mlp")}``; default ``{}``: none).
    bias_metadata: metadata put on the ``bias`` Variable (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs`` (e.g. a bare key or an int seed).

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> layer = sr.nn.Linear(3, 4, kernel_metadata={"sharding": ("embed", "mlp")},
  ...                      rngs=sr.Rngs(0))
  >>> layer(jnp.ones((2, 3))).shape, layer.kernel.sharding
  ((2, 4), ('embed', 'mlp'))
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    use_bias: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    precision: Any = None,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    dot_general: Callable = lax.dot_general,
    promote_dtype: Callable = default_promote_dtype,
    preferred_element_type: Any = None,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("Linear", rngs)
    param = param_maker(rngs, param_dtype)
    self.kernel = param(kernel_init, (in_features, out_features), kernel_metadata)
    self.bias = param(bias_init, (out_features,), bias_metadata) if use_bias else None
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.dot_general = dot_general
    self.promote_dtype = promote_dtype
    self.preferred_element_type = preferred_element_type

  def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
    """Applies the layer to the last axis of ``inputs``.

    Under explicit mesh axes (``jax.make_mesh``'s default) the output keeps the
    input's batch sharding and takes the kernel's output-axis sharding, unless
    ``out_sharding`` is given; elsewhere ``out_sharding`` is passed to ``dot_general``.
    """
    check_features(type(self).__name__, inputs, -1, self.in_features, module=self)
    inputs, kernel, bias = promoted(self, inputs, self.kernel, self.bias)
    if out_sharding is None and (specs := explicit_specs("Linear", inputs=inputs, kernel=kernel)):
      # Explicit mesh axes: the input's batch axes, then the kernel's output axis.
      out_sharding = sharding_like(specs[0][:-1] + specs[1][1:], specs)
    if self.dot_general is lax.dot_general and out_sharding is None:
      return _dense(
        inputs,
        kernel,
        bias,
        precision=self.precision,
        preferred_element_type=self.preferred_element_type,
      )
    kwargs = not_none(out_sharding=out_sharding, preferred_element_type=self.preferred_element_type)
    return _contract(inputs, kernel, bias, self.dot_general, precision=self.precision, **kwargs)


def add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
  # lax, not jnp.reshape: a jnp call is a nested jit, several times the tracing cost
  return y if bias is None else y + lax.expand_dims(bias, tuple(range(y.ndim - 1)))


def _contract(inputs, kernel, bias, dot_general: Callable = lax.dot_general, **options):
  """``dot_general`` of ``inputs``' last axis with ``kernel``'s first, plus ``bias``."""
  dims = (((inputs.ndim - 1,), (0,)), ((), ()))
  return add_bias(dot_general(inputs, kernel, dims, **options), bias)


# An inline jit, like jnp's own functions: identical layers (a 100-layer unrolled stack)
# share one trace and one linearisation instead of tracing the same ops again each time.
# It is inlined into the caller's jaxpr, so the program is the same.
@functools.partial(jax.jit, inline=True, static_argnames=("precision", "preferred_element_type"))
def _dense(inputs, kernel, bias, *, precision, preferred_element_type):
  # Its own name: jax names what a residual is the output of by it ("jitted function
  # '_dense'"), which sr.saved_residuals prints.
  return _contract(
    inputs, kernel, bias, precision=precision, preferred_element_type=preferred_element_type
  )


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
  return tuple(x) if isinstance(x, Sequence) else (x,)


def _normalize_axes(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
  return tuple(sorted(ax if ax >= 0 else ndim + ax for ax in axes))


class LinearGeneral(Module):
  """A linear map contracting the input's ``axis`` into ``out_features`` axes.

  As ``flax.nnx.LinearGeneral``: ``kernel`` has shape ``(*batch_sizes, *in_features,
  *out_features)`` and ``bias`` ``(*batch_sizes, *out_features)``; the initialisers
  see the kernel flattened to 2-D ``(prod(batch+in), prod(out))`` (so fan-in/fan-out
  are those of the equivalent ``Linear``), then reshaped. ``MultiHeadAttention``
  builds its projections from it.

  Args:
    in_features: size(s) of the contracted input axes.
    out_features: size(s) of the output axes appended to the result.
    axis: the input axes to contract (default ``-1``), one per ``in_features``.
    batch_axis: ``{axis: size}`` of leading input axes that get their own kernel
      (batched matmul); they must be ``0, 1, ...``. Stored as a tuple of pairs
      (default ``{}``: none).
    use_bias: add ``bias`` (default ``True``).
    dtype: computation dtype; default ``None``: the promotion of the input's and the
      parameters' dtypes.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    kernel_init: ``init(key, shape, dtype)`` of the flattened 2-D kernel (default
      ``jax.nn.initializers.lecun_normal()``).
    bias_init: ``init(key, shape, dtype)`` of the flattened bias (default zeros).
    precision: ``lax.Precision`` of the contraction (default ``None``).
    promote_dtype: ``(inputs, kernel, bias), dtype=`` -> promoted arrays (default
      ``sr.nn.promote_dtype``).
    dot_general: the contraction; default ``None``: ``lax.dot_general``.
    preferred_element_type: accumulation/output dtype passed to ``dot_general``
      (default ``None``: JAX's choice).
    rngs: draws ``rngs.params()`` for the kernel, then the bias.
    kernel_metadata: metadata put on the ``kernel`` Variable (default ``{}``: none).
    bias_metadata: metadata put on the ``bias`` Variable (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``.
    ValueError: when ``in_features`` and ``axis`` differ in length, or the keys of
      ``batch_axis`` are not the leading axes ``0, 1, ...``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> layer = sr.nn.LinearGeneral((2, 3), (4, 5), axis=(1, -1), rngs=sr.Rngs(0))
  >>> layer.kernel.shape, layer.bias.shape, layer(jnp.ones((16, 2, 3))).shape
  ((2, 3, 4, 5), (4, 5), (16, 4, 5))
  """

  def __init__(
    self,
    in_features: int | Sequence[int],
    out_features: int | Sequence[int],
    *,
    axis: int | Sequence[int] = -1,
    batch_axis: Mapping[int, int] = _EMPTY,
    use_bias: bool = True,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    kernel_init: Initializer = default_kernel_init,
    bias_init: Initializer = default_bias_init,
    precision: Any = None,
    promote_dtype: Callable = default_promote_dtype,
    dot_general: Callable | None = None,
    preferred_element_type: Any = None,
    rngs: Rngs,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("LinearGeneral", rngs)
    self.in_features = _as_tuple(in_features)
    self.out_features = _as_tuple(out_features)
    self.axis = _as_tuple(axis)
    self.batch_axis = tuple(sorted(dict(batch_axis).items()))
    if len(self.in_features) != len(self.axis):
      raise ValueError(
        f"LinearGeneral: in_features={self.in_features} and axis={self.axis} must "
        "have the same length (one contracted axis per input feature size)."
      )
    batch_dims = tuple(ax for ax, _ in self.batch_axis)
    if batch_dims != tuple(range(len(batch_dims))):
      raise ValueError(
        f"LinearGeneral: batch_axis keys {batch_dims} must be the consecutive leading "
        "axes 0, 1, ..."
      )
    batch_shape = tuple(size for _, size in self.batch_axis)
    kernel_shape = (*batch_shape, *self.in_features, *self.out_features)
    flat = (math.prod(batch_shape) * math.prod(self.in_features), math.prod(self.out_features))
    kernel = kernel_init(rngs.params(), flat, param_dtype)
    self.kernel = Param(jnp.reshape(kernel, kernel_shape), **(kernel_metadata or {}))
    if use_bias:
      bias_shape = (*batch_shape, *self.out_features)
      bias = bias_init(rngs.params(), (math.prod(bias_shape),), param_dtype)
      self.bias = Param(jnp.reshape(bias, bias_shape), **(bias_metadata or {}))
    else:
      self.bias = None
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.promote_dtype = promote_dtype
    self.dot_general = dot_general
    self.preferred_element_type = preferred_element_type

  def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
    """Contracts ``inputs`` over ``axis``; the output axes are appended at the end.

    Under explicit mesh axes the output keeps the sharding of the input's batch and
    free axes and takes the kernel's output axes', unless ``out_sharding`` is given.
    """
    ndim = inputs.ndim
    axis = _normalize_axes(self.axis, ndim)
    # nnx pairs the sorted input axes with the kernel's input axes in order.
    if (
      any(not 0 <= ax < ndim for ax in axis)
      or tuple(inputs.shape[ax] for ax in axis) != self.in_features
    ):
      raise ValueError(
        f"LinearGeneral was built with in_features={self.in_features} on axis="
        f"{self.axis} but got an input of shape {tuple(inputs.shape)}."
      )
    batch_axis = _normalize_axes(tuple(ax for ax, _ in self.batch_axis), ndim)
    n_batch = len(batch_axis)
    # Non-contracted input axes, with 1s except on batch axes: the bias broadcast shape.
    expanded_batch_shape = tuple(
      inputs.shape[ax] if ax in batch_axis else 1 for ax in range(ndim) if ax not in axis
    )
    inputs, kernel, bias = promoted(self, inputs, self.kernel, self.bias)
    if out_sharding is None and (
      specs := explicit_specs("LinearGeneral", inputs=inputs, kernel=kernel)
    ):
      # Explicit mesh axes: dot_general's output order, batch axes, the input's free
      # axes, then the kernel's output axes.
      xs, ks = specs
      free = [xs[ax] for ax in range(ndim) if ax not in axis and ax not in batch_axis]
      out_sharding = sharding_like(
        [xs[ax] for ax in batch_axis] + free + list(ks[n_batch + len(axis) :]), specs
      )
    dot_general = self.dot_general or lax.dot_general
    kwargs = not_none(out_sharding=out_sharding, preferred_element_type=self.preferred_element_type)
    contract = tuple(range(n_batch, n_batch + len(axis)))
    out = dot_general(
      inputs,
      kernel,
      ((axis, contract), (batch_axis, tuple(range(n_batch)))),
      precision=self.precision,
      **kwargs,
    )
    if bias is not None:
      out += lax.reshape(bias, (*expanded_batch_shape, *self.out_features))  # cheap to trace
    return out


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
