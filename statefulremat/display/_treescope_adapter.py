"""treescope's NDArrayAdapter for ``LayeredArray``: the wrapped array's own adapter,
with the layer axis (and any ``sharding`` names) reported as named axes, so the array
visualiser labels them. Imported only when treescope draws a stack."""

from __future__ import annotations

import numpy as np
from treescope import ndarray_adapters, type_registries


class LayeredArrayAdapter(ndarray_adapters.NDArrayAdapter):
  """Delegates to the adapter of ``LayeredArray.array``; only the axis info differs."""

  @staticmethod
  def _inner(layered) -> ndarray_adapters.NDArrayAdapter:
    adapter = type_registries.lookup_ndarray_adapter(layered.array)
    assert adapter is not None  # a LayeredArray is made only of arrays treescope draws
    return adapter

  # treescope calls these with keywords: the parameter names are its own.

  def get_axis_info_for_array_data(self, array):
    return tuple(
      ndarray_adapters.PositionalAxisInfo(i, size)
      if name is None
      else ndarray_adapters.NamedPositionalAxisInfo(i, name, size)
      for i, (size, name) in enumerate(zip(np.shape(array.array), array.names))
    )

  def get_array_data_with_truncation(self, array, mask, edge_items_per_axis):
    return self._inner(array).get_array_data_with_truncation(
      array=array.array, mask=mask, edge_items_per_axis=edge_items_per_axis
    )

  def get_array_summary(self, array, fast):
    return array.axes_text() if fast else array.summary_text()

  def get_numpy_dtype(self, array):
    return self._inner(array).get_numpy_dtype(array.array)

  def get_sharding_info_for_array_data(self, array):
    return self._inner(array).get_sharding_info_for_array_data(array.array)

  def should_autovisualize(self, array):
    return self._inner(array).should_autovisualize(array.array)
