"""Arrays as the treescope rendering draws them: ``ArraySummary`` on one line (dtype,
shape in ``.shape`` order with named axes named in place, statistics) and
``LayeredArray``, a stack's array whose layer axis is named, which treescope's array
visualiser reads through ``_treescope_adapter.LayeredArrayAdapter``.

Every array of ours gets its statistics, however big: treescope leaves arrays past its
``summarization_threshold`` (100,000 entries on a CPU) at "too large to summarize", so
the kernels of a stack went without while its biases had them. The statistics are
computed once per JAX array (one pass, on its device past 10 million entries) and
kept while the array lives: a page draws the same summary in several places.
"""

from __future__ import annotations

import functools

import numpy as np

from ._array_stats import data_summary


class ArraySummary:
  """An array drawn on one line: dtype, shape in ``.shape`` order (a named axis as
  ``name:size`` in its place), statistics.

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._treescope_arrays import ArraySummary
  >>> ArraySummary(jnp.zeros((2, 3))).axes_text()
  'float32(2, 3)'
  >>> ArraySummary(jnp.zeros((6, 8)), [None, "embed"]).axes_text()
  'float32(6, embed:8)'
  """

  def __init__(self, array, names=None):
    self.array = array
    self.names = [None] * np.ndim(array) if names is None else list(names)

  def axes_text(self) -> str:
    shape = np.shape(self.array)
    axes = [str(n) if label is None else f"{label}:{n}" for n, label in zip(shape, self.names)]
    return f"{self.array.dtype}({', '.join(axes)})"

  def summary_text(self) -> str:
    """Its axes and statistics: ``float32(2, 3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:6``."""
    return f"{self.axes_text()} {data_summary(self.array)}".rstrip()

  def text(self) -> str:
    """The line: ``<jax.Array float32(2, 3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:6>``."""
    kind = "np.ndarray" if isinstance(self.array, np.ndarray) else "jax.Array"
    return f"<{kind} {self.summary_text()}>"

  def __treescope_repr__(self, path, subtree_renderer):
    from treescope import rendering_parts

    return rendering_parts.text(self.text())


class LayeredArray(ArraySummary):
  """An array whose ``axis`` is a stack's layer axis named ``name`` (for display).

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._treescope_arrays import LayeredArray
  >>> LayeredArray(jnp.zeros((6, 8, 8)), 0, "layers").axes_text()
  'float32(layers:6, 8, 8)'
  >>> LayeredArray(jnp.zeros((6, 8, 4)), 0, "layers", ("embed", "mlp")).axes_text()
  'float32(layers:6, embed:8, mlp:4)'

  ``inner`` names the layer axes of the stacks inside it (a stack of stacks), as
  ``(axis, name)`` pairs:

  >>> LayeredArray(jnp.zeros((3, 2, 8)), 0, "layers", ("embed",), [(1, "depth")]).axes_text()
  'float32(layers:3, depth:2, embed:8)'
  """

  def __init__(self, array, axis: int, name: str, sharding=None, inner=()):
    levels = [(axis, name), *inner]
    super().__init__(array, _axis_names(np.ndim(array), levels, sharding))
    self.axis, self.name = axis, name
    _register_adapter()  # before treescope looks for an adapter to visualise it


def _axis_names(ndim: int, levels: list, sharding) -> list:
  """Each axis's name: a layer axis's (``levels``: ``(axis, name)`` pairs), else the
  ``sharding`` metadata's, else None. ``sharding`` may leave out the layer axes."""
  names: list = [None] * ndim
  layer_axes = sorted(a for a, _ in levels)
  if sharding is not None and len(sharding) == ndim - len(layer_axes):
    sharding = list(sharding)
    for a in layer_axes:  # in increasing order: each lands where it is in the shape
      sharding.insert(a, None)
  if sharding is not None and len(sharding) == ndim:
    names = [s if isinstance(s, str) else None for s in sharding]
  for a, name in levels:
    names[a] = name
  return names


@functools.cache
def _register_adapter() -> None:
  """Lets treescope's array visualiser draw a LayeredArray with its axis names (once)."""
  from treescope import type_registries

  from ._treescope_adapter import LayeredArrayAdapter

  type_registries.NDARRAY_ADAPTER_REGISTRY[LayeredArray] = LayeredArrayAdapter()
