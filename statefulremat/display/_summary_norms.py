"""Norms for ``sr.summary``: the L2 norm of each Param (and of its gradient), per layer
where it has a layer axis — what levanter logs for its scanned stacks, and what one looks
at when a deep model diverges.

Each array takes one reduction on its device (a sum of squares, per layer for a stacked
one); the small results come back to the host together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ..core._errors import format_path
from ..core._stacks import stack_info
from ._array_stats import is_concrete, squares
from ._repr import class_text, layer_numbers, layers_text
from ._summary_walk import Description


@dataclasses.dataclass(frozen=True)
class LayerNorms:
  """The L2 norm of each layer's Params of one stack (its stacked Params; the ones it
  broadcasts belong to no layer), and of their gradients when ``sr.summary`` was given
  ``grads`` (else None). ``params[i]`` is the norm of layer ``i``. For the stack of one
  position of a pattern stack, ``stack_layers[i]`` is the number its layer ``i`` has in
  the whole stack (the table shows those numbers); None elsewhere.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> Stack = sr.vmap(sr.nn.Linear, axis_size=3)
  >>> norms = sr.summary(Stack(2, 2, rngs=sr.Rngs(0))).layer_norms[0]
  >>> norms.path_text, norms.params.shape, norms.grads
  ('(root)', (3,), None)
  """

  path: tuple
  class_name: str
  params: np.ndarray
  grads: np.ndarray | None = None
  stack_layers: range | None = None

  @property
  def path_text(self) -> str:
    return format_path(self.path) if self.path else "(root)"

  def lines(self, show: int = 32) -> list[str]:
    """A title and one line per layer; past ``show`` layers, the first and last 8,
    and the layers with the largest norms, ``…`` between them."""
    layers, grads = len(self.params), self.grads
    numbers = self.stack_layers if self.stack_layers is not None else range(layers)
    of_stack = ""
    if self.stack_layers is not None:
      of_stack = f" ({layer_numbers(self.stack_layers)} of the pattern stack)"
    title = (
      f"{self.path_text}: {self.class_name}, {layers_text(layers)}{of_stack}, "
      f"L2 norm of each layer's Params{' and gradients' if grads is not None else ''}"
    )
    keep = set(range(layers))
    if layers > show:
      keep = {*range(8), *range(layers - 8, layers), int(np.nanargmax(self.params))}
      if grads is not None:
        keep.add(int(np.nanargmax(grads)))
    header = ["layer", "params", *(["grads"] * (grads is not None))]
    gap = ["…"] + [""] * (len(header) - 1)
    body, last = [], -1
    for i in sorted(keep):
      if i > last + 1:
        body.append(gap)
      norms = [self.params[i]] if grads is None else [self.params[i], grads[i]]
      body.append([str(numbers[i]), *map(norm_text, norms)])
      last = i
    if last < layers - 1:
      body.append(gap)
    return [title, *columns([header, *body], numeric=set(range(len(header))))]


class Norms:
  """Each Param's sum of squares (of its value and its gradient), per layer where it
  has a layer axis: one reduction per array, fetched from the device together. Keyed
  by the Param's position in ``description.variables``."""

  def __init__(self, description: Description, grads):
    self.description = description
    params = [(i, e) for i, e in enumerate(description.variables) if e.is_param]
    by_path = _grads_by_path(grads, params) if grads is not None else None
    sums = {}
    if all(is_concrete(e.variable._value) for _, e in params):
      sums["p"] = {i: squares(e.variable._value, e.layer_axis) for i, e in params}
    if by_path is not None and "p" in sums:
      sums["g"] = {
        i: squares(by_path[e.path], e.layer_axis) for i, e in params if e.path in by_path
      }
    sums = jax.device_get(sums)
    self.params, self.grads = sums.get("p"), sums.get("g")
    # Innermost first: a Variable's stack is the longest stack path above it.
    self.stacks = sorted((m.path for m in description.modules if m.is_stack), key=len, reverse=True)

  def stack_of(self, path: tuple) -> tuple | None:
    return next((s for s in self.stacks if path[: len(s)] == s), None)

  @staticmethod
  def total(variables, sums) -> float | None:
    """The L2 norm of ``variables``' entries in ``sums``; None where it has none."""
    held = [sums[i] for i in variables if i in sums] if sums is not None else []
    if not held:
      return None
    return float(np.sqrt(sum(float(np.sum(x)) for x in held)))

  def layer_norms(self) -> list[LayerNorms]:
    if self.params is None:
      return []
    out = []
    for module in self.description.modules:
      if not module.is_stack:
        continue
      stacked = [i for i in module.stacked if i in self.params]
      lengths = {np.shape(self.params[i]) for i in stacked}
      if len(lengths) != 1:  # no stacked Params, or nested stacks of other lengths
        continue

      def per_layer(sums):
        return np.sqrt(sum(sums[i] for i in stacked if i in sums))

      grads = per_layer(self.grads) if self.grads is not None else None
      params = per_layer(self.params)
      # One position of a pattern stack: its layer i is layer k + i * P of the stack.
      p, k = getattr(stack_info(module.cls), "index_map", (1, 0))
      numbers = range(k, k + p * len(params), p) if p > 1 else None
      out.append(LayerNorms(module.path, class_text(module.cls), params, grads, numbers))
    return out

  def flat(self) -> dict[str, float]:
    out = {}
    for prefix, sums in (("params", self.params), ("grad", self.grads)):
      if sums is None:
        continue
      for i, value in sums.items():  # in the order of `description.variables`
        path = self.description.variables[i].path
        stack = self.stack_of(path) if np.ndim(value) else None
        if stack is None:
          out[f"{prefix}/norm/{_dotted(path)}"] = float(np.sqrt(np.sum(value)))
          continue
        for n, sq in enumerate(value):
          key = _dotted(path[: len(stack)] + (n,) + path[len(stack) :])
          out[f"{prefix}/norm/{key}"] = float(np.sqrt(sq))
      out[f"{prefix}/norm/total"] = float(np.sqrt(sum(float(np.sum(x)) for x in sums.values())))
    return out


def _grads_by_path(grads, params) -> dict[tuple, Any]:
  """``grads`` (a State, as ``sr.grad`` returns) by path, checked against the Params."""
  flat = getattr(grads, "flat", None)
  if not callable(flat):
    raise TypeError(
      f"sr.summary(..., grads=...) takes the State sr.grad returns, got "
      f"{type(grads).__name__}. Fix: `grads = sr.grad(loss)(model, x)`, then "
      "`sr.summary(model, grads=grads)`."
    )
  shapes = {e.path: np.shape(e.variable._value) for _, e in params}
  flat_grads = flat()
  if not isinstance(flat_grads, dict):
    raise TypeError(
      f"sr.summary(..., grads=...): `grads.flat()` gave a {type(flat_grads).__name__}, "
      "not a dict of paths to arrays. Fix: pass the State sr.grad returns."
    )
  for path, g in flat_grads.items():
    if path not in shapes:
      raise ValueError(
        f"sr.summary(..., grads=...): `{format_path(path)}` is not a Param of this "
        "model. Fix: pass the gradients of this model's Params, as "
        "`sr.grad(loss)(model, x)` gives them."
      )
    if np.shape(g) != shapes[path]:
      raise ValueError(
        f"sr.summary(..., grads=...): the gradient at `{format_path(path)}` has shape "
        f"{np.shape(g)}, the Param {shapes[path]}. Fix: pass the gradients of this "
        "model, taken at its current structure."
      )
  return flat_grads


def _dotted(path: tuple) -> str:
  return ".".join(map(str, path))


def columns(table: list[list[str]], numeric: set[int]) -> list[str]:
  """Each row's cells padded to their column's width: numbers to the right."""
  widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
  return [
    "  ".join(
      c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
    ).rstrip()
    for cells in table
  ]


def norm_text(x) -> str:
  return "-" if x is None else f"{float(x):.4g}"
