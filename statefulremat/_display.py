"""``sr.display``: treescope's notebook display, with stacked arrays drawn as figures."""

from __future__ import annotations

from typing import Any

_ARRAYS = ("stacked", "all", "none")


def stacked_arrays(value, path):
  """A treescope autovisualizer that draws stacked (layered) arrays and nothing else."""
  from ._treescope import LayeredArray

  if not isinstance(value, LayeredArray):
    return None
  import treescope

  return treescope.ArrayAutovisualizer()(value, path)


def autovisualizer(arrays: str):
  """The autovisualizer for ``arrays``: "stacked", "all" or "none"."""
  if arrays not in _ARRAYS:
    raise ValueError(
        f"sr.display(..., arrays={arrays!r}): say which arrays to draw as figures, "
        f"one of {', '.join(map(repr, _ARRAYS))}.")
  if arrays == "stacked":
    return stacked_arrays
  if arrays == "all":
    import treescope

    return treescope.ArrayAutovisualizer()
  return None


def display(obj: Any, *, arrays: str = "stacked") -> None:
  """Shows ``obj`` with treescope: a foldable, coloured tree in a notebook (IPython),
  its text elsewhere. Stacked arrays (the layer axis of scan, remat_scan and vmap
  modules) are drawn as array figures with the layer axis labelled; ``arrays="all"``
  draws every array, ``arrays="none"`` none.

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
