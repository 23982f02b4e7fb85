"""``sr.display``: treescope's notebook display, with stacked arrays drawn as figures
that step through the layer axis with a slider."""

from __future__ import annotations

from typing import Any

import numpy as np

_ARRAYS = ("stacked", "all", "none")

# Cells one layer's slice may draw (treescope's ArrayAutovisualizer draws 4,000 for a
# whole array), and at most this many for all the layers of one array together.
_CELLS_PER_LAYER = 4_000
_CELLS = 200_000
_EDGE = 5  # entries kept at each end of an axis that is cut


def stacked_arrays(value, path):
  """A treescope autovisualizer that draws stacked (layered) arrays and nothing else:
  one layer at a time, a slider over the layer axis picks which.

  Every layer stays reachable: where a layer is too big to draw whole, its other
  axes are cut to their first and last entries (the figure's axis labels say so
  and its tooltips give the original indices), never the layer axis.
  """
  from ._treescope_arrays import LayeredArray

  if not isinstance(value, LayeredArray):
    return None
  import treescope

  try:
    figure = layer_slider_figure(value)
  except Exception:  # a tracer, a deleted or not fully addressable array, a key array
    return None
  if figure is None:
    return None
  from treescope import rendering_parts as rp

  from ._treescope_arrays import _data_summary

  stats = _data_summary(value.array).strip()
  summary = f"{value.axes_text()} {stats}".strip()
  label = rp.abbreviation_color(rp.text(f"<{summary}"))
  node = rp.build_custom_foldable_tree_node(
    label=label,
    contents=rp.siblings(
      rp.fold_condition(expanded=rp.indented_children([figure.treescope_part])),
      rp.abbreviation_color(rp.text(">")),
    ),
    # Open: the figure shows as soon as its Variable is (a click), not a click later.
    path=path,
    expand_state=rp.ExpandState.EXPANDED,
  )
  return treescope.VisualizationFromTreescopePart(node)


def layer_slider_figure(value):
  """treescope's ``render_array`` of a ``LayeredArray`` with ``sliders=`` its layer
  axis; None for what it cannot draw (key arrays, one element).

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._treescope_arrays import LayeredArray
  >>> from statefulremat.display._display import layer_slider_figure
  >>> type(layer_slider_figure(LayeredArray(jnp.zeros((3, 2)), 0, "layers"))).__name__
  'TreescopeFigure'
  """
  import jax
  import treescope
  from treescope import dtype_util

  from ._treescope_arrays import LayeredArray

  array = value.array
  if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
    return None
  dtype = np.dtype(array.dtype)
  drawable = (
    dtype_util.is_integer_dtype(dtype)
    or dtype_util.is_floating_dtype(dtype)
    or np.issubdtype(dtype, np.bool_)
  )
  if not drawable or np.size(array) <= 1:
    return None
  shape = np.shape(array)
  layers = shape[value.axis]
  budget = min(_CELLS_PER_LAYER, _CELLS // max(layers, 1))
  kept = _kept_per_axis(shape, value.axis, budget)
  data = array  # cut where it lives: only what is drawn comes to the host
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
  return treescope.render_array(
    cut, sliders=[value.axis], axis_labels=labels or None, axis_item_labels=item_labels or None
  )


def _kept_per_axis(shape, layer_axis: int, budget: int) -> list[int]:
  """How many entries of each axis one layer's figure keeps: all of them while the
  slice fits ``budget`` cells, else the longest axis is halved (an even count, at
  least ``2 * _EDGE``) until it does. The layer axis is always kept whole.

  >>> from statefulremat.display._display import _kept_per_axis
  >>> _kept_per_axis((6, 8, 8), 0, 4000), _kept_per_axis((4, 768, 3072), 0, 4000)
  ([6, 8, 8], [4, 48, 48])
  """
  kept = list(shape)
  others = [a for a in range(len(shape)) if a != layer_axis]

  def cells():
    return int(np.prod([kept[a] for a in others]))

  while others and cells() > budget:
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


def display(obj: Any, *, arrays: str = "stacked") -> None:
  """Shows ``obj`` with treescope: a foldable, coloured tree in a notebook (IPython),
  its text elsewhere.

  In a notebook, modules open with their sub-modules and Variables; each module's
  settings at their constructor defaults sit in one folded line, and RNG streams are
  folded (a click opens either). Stacked arrays (the layer axis of scan, remat_scan
  and vmap modules) are drawn as array figures of one layer at a time, with a slider
  over the layer axis; ``arrays="all"`` draws every array, ``arrays="none"`` none.
  Outside a notebook it prints the repr's text.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.display(sr.Param(jnp.zeros(2)))  # outside a notebook: the text
  Param(value=<jax.Array([0., 0.], dtype=float32)>)
  """
  visualizer = autovisualizer(arrays)
  import treescope

  if _in_notebook():
    treescope.display(obj, autovisualize=visualizer if visualizer else False)
    return
  from ._treescope import compact_text

  print(compact_text(obj))


def _in_notebook() -> bool:
  try:
    import IPython
  except ImportError:
    return False
  return IPython.get_ipython() is not None
