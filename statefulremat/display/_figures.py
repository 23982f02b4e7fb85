"""The figures of stacked arrays: one layers × features image where a layer is 0-d or
1-d, else a slider over the layers with each layer's norm; and the autovisualizers that
draw them inside treescope's views."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ._array_stats import squares
from ._treescope_arrays import LayeredArray

_ARRAYS = ("stacked", "all", "none")

# Cells one layer's slice may draw (treescope's ArrayAutovisualizer draws 4,000 for a
# whole array), and at most this many for all the layers of one array together.
_CELLS_PER_LAYER = 4_000
_CELLS = 200_000
_EDGE = 5  # entries kept at each end of an axis that is cut
_WIDTH = 840  # pixels the layers of a figure may take across


def stacked_arrays(value, path):
  """A treescope autovisualizer that draws stacked (layered) arrays and nothing else.

  The point of looking at a stack is to see how its layers differ. A stacked array
  whose layer is 0-d or 1-d (BatchNorm statistics, biases, scales) is drawn whole as
  one layers × features image, a column per layer; a bigger one one layer at a time, a
  slider over the layer axis picks which, with the L2 norm of each layer beside it.

  Every layer stays reachable: where a layer is too big to draw whole, its other
  axes are cut to their first and last entries (the figure's axis labels say so
  and its tooltips give the original indices), never the layer axis.
  """
  if not isinstance(value, LayeredArray):
    return None
  import treescope

  try:
    parts = stack_figure(value)
  except Exception:  # a tracer, a deleted or not fully addressable array, a key array
    return None
  if parts is None:
    return None
  from treescope import rendering_parts as rp

  label = rp.abbreviation_color(rp.text(f"<{value.summary_text()}"))
  node = rp.build_custom_foldable_tree_node(
    label=label,
    contents=rp.siblings(
      rp.fold_condition(expanded=rp.indented_children(parts)),
      rp.abbreviation_color(rp.text(">")),
    ),
    # Open: the figure shows as soon as its Variable is (a click), not a click later.
    path=path,
    expand_state=rp.ExpandState.EXPANDED,
  )
  return treescope.VisualizationFromTreescopePart(node)


def stack_figure(value) -> list | None:
  """The treescope parts that draw a ``LayeredArray``; None for what cannot be drawn
  (key arrays, one element). A 0-d or 1-d layer is drawn whole, as one image with a
  column per layer (a (100, 32) BatchNorm mean is 100 columns of 32), so how the
  layers differ shows at a glance; a bigger one by ``layer_slider_figure`` and
  ``layer_norms_parts``. Features past the cell budget are cut to their first and
  last entries; the layers never are.

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._treescope_arrays import LayeredArray
  >>> from statefulremat.display._figures import stack_figure
  >>> [type(part).__name__ for part in stack_figure(LayeredArray(jnp.zeros((3, 2)), 0, "l"))]
  ['ArrayvizRendering']
  """
  if np.ndim(value.array) > 2:
    figure = layer_slider_figure(value)
    return None if figure is None else [figure.treescope_part, *layer_norms_parts(value)]
  # The layers run across, as depth reads on a page: a column per layer.
  image = _render_cut(
    value,
    columns=[value.axis],
    rows=[1 - value.axis] if np.ndim(value.array) == 2 else [],
    pixels_per_cell=_pixels_per_layer(np.shape(value.array)[value.axis]),
  )
  return None if image is None else [image.treescope_part]


def _drawable(array) -> bool:
  from treescope import dtype_util

  if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
    return False
  dtype = np.dtype(array.dtype)
  numeric = (
    dtype_util.is_integer_dtype(dtype)
    or dtype_util.is_floating_dtype(dtype)
    or np.issubdtype(dtype, np.bool_)
  )
  return numeric and np.size(array) > 1


def _pixels_per_layer(layers: int) -> int:
  """Cells narrow enough for the layers to fit about ``_WIDTH`` pixels (2 to 7)."""
  return max(2, min(7, _WIDTH // max(layers, 1)))


def layer_slider_figure(value):
  """treescope's ``render_array`` of a ``LayeredArray`` with ``sliders=`` its layer
  axis; None for what it cannot draw (key arrays, one element).

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._treescope_arrays import LayeredArray
  >>> from statefulremat.display._figures import layer_slider_figure
  >>> type(layer_slider_figure(LayeredArray(jnp.zeros((3, 2, 2)), 0, "layers"))).__name__
  'TreescopeFigure'
  """
  return _render_cut(value, sliders=[value.axis])


def _render_cut(value, **layout):
  """treescope's ``render_array`` of ``value`` cut to the cell budget (``_cut``), laid
  out as ``layout`` says; None for what it cannot draw (key arrays, one element)."""
  import treescope

  if not _drawable(value.array):
    return None
  cut, labels, item_labels = _cut(value)
  return treescope.render_array(cut, axis_labels=labels, axis_item_labels=item_labels, **layout)


def layer_norms(value) -> np.ndarray:
  """The L2 norm of each layer of a ``LayeredArray``: one reduction on its device.

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._treescope_arrays import LayeredArray
  >>> from statefulremat.display._figures import layer_norms
  >>> layer_norms(LayeredArray(jnp.ones((3, 2, 2)) * jnp.arange(3.0)[:, None, None],
  ...                          0, "layers")).tolist()
  [0.0, 2.0, 4.0]
  """
  return np.asarray(jnp.sqrt(squares(value.array, value.axis)))


def layer_norms_parts(value) -> list:
  """A line naming the smallest and largest layer norms, and the norms drawn as a
  strip of layers: what the slider shows one layer at a time, at a glance."""
  import treescope
  from treescope import rendering_parts as rp

  norms = layer_norms(value)
  lo, hi = int(np.nanargmin(norms)), int(np.nanargmax(norms))
  name = value.name
  caption = rp.comment_color(
    rp.text(
      f"L2 norm of each layer: least {norms[lo]:.4g} at {name}[{lo}], "
      f"most {norms[hi]:.4g} at {name}[{hi}]"
    )
  )
  strip = treescope.render_array(
    norms,
    around_zero=False,
    axis_labels={0: f"{name}: {len(norms)}"},
    pixels_per_cell=_pixels_per_layer(len(norms)),
  )
  return [caption, strip.treescope_part]


def _cut(value):
  """``value`` with its axes other than the layer axis cut to fit the cell budget of
  one layer (first and last entries kept), as a host ``LayeredArray``; with the axis
  labels and item labels that say what was cut (None where nothing was)."""
  shape = np.shape(value.array)
  budget = min(_CELLS_PER_LAYER, _CELLS // max(shape[value.axis], 1))
  kept = _kept_per_axis(shape, value.axis, budget)
  data = value.array  # cut where it lives: only what is drawn comes to the host
  labels, item_labels = {}, {}
  for axis, (size, keep) in enumerate(zip(shape, kept)):
    if keep >= size:
      continue
    index = np.r_[0 : keep // 2, size - keep // 2 : size]
    data = data.take(index, axis=axis)
    key = value.names[axis] if value.names[axis] is not None else axis
    what = value.names[axis] or f"axis {axis}"
    labels[key] = f"{what}: {size}, the first and last {keep // 2} shown"
    item_labels[key] = [str(i) for i in index]
  cut = LayeredArray(np.asarray(data), value.axis, value.name)
  cut.names = value.names
  return cut, labels or None, item_labels or None


def _kept_per_axis(shape, layer_axis: int, budget: int) -> list[int]:
  """How many entries of each axis one layer's figure keeps: all of them while the
  slice fits ``budget`` cells, else the longest axis is halved (an even count, at
  least ``2 * _EDGE``) until it does. The layer axis is always kept whole.

  >>> from statefulremat.display._figures import _kept_per_axis
  >>> _kept_per_axis((6, 8, 8), 0, 4000), _kept_per_axis((4, 768, 3072), 0, 4000)
  ([6, 8, 8], [4, 48, 48])
  """
  kept = list(shape)
  others = [a for a in range(len(shape)) if a != layer_axis]
  while others and math.prod(kept[a] for a in others) > budget:
    axis = max(others, key=lambda a: kept[a])
    if kept[axis] <= 2 * _EDGE:
      break
    kept[axis] = max(2 * _EDGE, (kept[axis] // 2) // 2 * 2)
  return kept


def autovisualizer(arrays: str):
  """The autovisualizer for ``arrays``: "stacked", "all" or "none"."""
  if arrays not in _ARRAYS:
    raise ValueError(
      f"sr.display(..., arrays={arrays!r}): say which arrays to draw as figures, "
      f"one of {', '.join(map(repr, _ARRAYS))}."
    )
  if arrays == "stacked":
    return stacked_arrays
  if arrays == "all":
    import treescope

    others = treescope.ArrayAutovisualizer()

    def every_array(value, path):
      return stacked_arrays(value, path) or others(value, path)

    return every_array
  return None
