"""Linear: ``y = x @ kernel + bias`` over the last axis, as ``flax.nnx.Linear``."""

from __future__ import annotations

import functools
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
