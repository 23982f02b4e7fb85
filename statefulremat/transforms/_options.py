"""The keyword options of the transforms that build stacks, written once for type
checkers: each overload of ``sr.scan``, ``sr.remat_scan`` and ``sr.vmap`` takes
``**options: Unpack[...]`` of these, and the implementation spells the defaults."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict


class MapOptions(TypedDict, total=False):
  """The collection rules (linen's vocabulary) and the class form's options."""

  variable_axes: Mapping[Any, Any]
  variable_broadcast: Any
  split_rngs: Mapping[Any, Any]
  metadata_params: Mapping[Any, Any]
  methods: Sequence[str] | None
  init_in_axes: Any


class LoopOptions(MapOptions, total=False):
  variable_carry: Any
  length: int | None
  data_transform: Callable[..., Any] | None


class ScanOptions(LoopOptions, total=False):
  in_axes: Any
  out_axes: Any
  reverse: bool
  unroll: int | bool
  carries: str


class RematScanOptions(LoopOptions, total=False):
  memory_budget: int | str | None
  policy: Callable[..., Any] | None
  prevent_cse: bool
  carries: str | None
  pipeline: Any


class VmapOptions(MapOptions, total=False):
  in_axes: Any
  out_axes: Any
  axis_size: int | None
  axis_name: str | None
