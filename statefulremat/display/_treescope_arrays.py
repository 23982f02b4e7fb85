"""Arrays as the treescope rendering draws them: ``ArraySummary`` on one line (dtype,
shape with named axes after a ``|``, statistics) and ``LayeredArray``, a stack's
array whose layer axis is named, which treescope's array visualiser reads through
``_treescope_adapter.LayeredArrayAdapter``.
"""

from __future__ import annotations

import numpy as np


class ArraySummary:
  """An array drawn on one line: dtype, shape (named axes after a ``|``), statistics.

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._treescope_arrays import ArraySummary
  >>> ArraySummary(jnp.zeros((2, 3))).axes_text()
  'float32(2, 3)'
  >>> ArraySummary(jnp.zeros((6, 8)), [None, "embed"]).axes_text()
  'float32(6 | embed:8)'
  """

  def __init__(self, array, names=None):
    self.array = array
    self.names = [None] * np.ndim(array) if names is None else list(names)

  def axes_text(self) -> str:
    shape = np.shape(self.array)
    positional = [str(n) for n, label in zip(shape, self.names) if label is None]
    named = [f"{label}:{n}" for n, label in zip(shape, self.names) if label is not None]
    dtype = str(self.array.dtype)
    if not named:
      return f"{dtype}({', '.join(positional)})"
    positional = ", ".join(positional) + " " if positional else ""
    return f"{dtype}({positional}| {', '.join(named)})"

  def __treescope_repr__(self, path, subtree_renderer):
    from treescope import rendering_parts

    kind = "np.ndarray" if isinstance(self.array, np.ndarray) else "jax.Array"
    stats = _data_summary(self.array)
    body = f"<{kind} {self.axes_text()}{' ' + stats.strip() if stats else ''}>"
    return rendering_parts.text(body)


class LayeredArray(ArraySummary):
  """An array whose ``axis`` is a stack's layer axis named ``name`` (for display).

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._treescope_arrays import LayeredArray
  >>> LayeredArray(jnp.zeros((6, 8, 8)), 0, "layers").axes_text()
  'float32(8, 8 | layers:6)'
  """

  def __init__(self, array, axis: int, name: str, sharding=None):
    super().__init__(array, _axis_names(np.ndim(array), axis, name, sharding))
    self.axis, self.name = axis, name
    _register_adapter()  # before treescope looks for an adapter to visualise it


def _axis_names(ndim: int, axis: int, name: str, sharding) -> list:
  """Each axis's name: the layer axis's, else the ``sharding`` metadata's, else None."""
  names = [None] * ndim
  if sharding is not None and len(sharding) == ndim - 1:  # without the layer axis
    sharding = (*sharding[:axis], None, *sharding[axis:])
  if sharding is not None and len(sharding) == ndim:
    names = [s if isinstance(s, str) else None for s in sharding]
  names[axis] = name
  return names


def _data_summary(array) -> str:
  try:
    from treescope.external import jax_support

    return jax_support.summarize_array_data(array)
  except Exception:  # a tracer or a deleted buffer: no statistics, the shape suffices
    return ""


_ADAPTER_REGISTERED = False


def _register_adapter() -> None:
  """Lets treescope's array visualiser draw a LayeredArray with its axis names."""
  global _ADAPTER_REGISTERED
  if _ADAPTER_REGISTERED:
    return
  from treescope import type_registries

  from ._treescope_adapter import LayeredArrayAdapter

  type_registries.NDARRAY_ADAPTER_REGISTRY[LayeredArray] = LayeredArrayAdapter()
  _ADAPTER_REGISTERED = True
