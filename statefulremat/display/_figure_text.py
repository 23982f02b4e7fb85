"""Figures in text: where treescope's HTML draws an array as a figure, its text reads
as the figure's folded line, never as treescope's ``<Arrayviz rendering>`` placeholder.

Under an autovisualizer (a notebook after ``treescope.basic_interactive_setup()``,
``sr.display``, a page), treescope draws an array as a figure; its text of the same
view (``treescope.render_to_text`` printed in that notebook) writes each figure as
``<Arrayviz rendering>``. Our renderers draw inside ``drawing_scope``: the active
autovisualizer's figure of an array is a part that renders its figure in HTML and, in
text, the line the figure folds to: dtype, shape, statistics.

  <jax.Array float32(2, 3) ≈-0.26 ±0.63 [≥-0.88, ≤0.76] nonzero:6>
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import numpy as np
import treescope
from jax.core import Tracer
from treescope import rendering_parts as rp

from ._treescope_arrays import ArraySummary, LayeredArray


def drawing_scope(*, stacks_first: bool = False):
  """A scope in which the active autovisualizer's figures of arrays read as their
  folded line in text (``with_text``); with ``stacks_first``, a stacked array is drawn
  as ours (``_figures.stacked_arrays``: the layers at a glance), the rest as the
  active autovisualizer draws them. Nothing changes where none is active."""
  from ._figures import stacked_arrays

  active = treescope.active_autovisualizer
  current = active.get()
  if current is None:
    return contextlib.nullcontext()
  inner = getattr(current, "sr_inner", current)  # already drawn inside this scope
  first = stacks_first and inner is not stacked_arrays
  if inner is not current and not first:
    return contextlib.nullcontext()

  def visualize(value, path):
    result = (stacked_arrays(value, path) if first else None) or inner(value, path)
    return with_text(value, result)

  visualize.sr_inner = inner  # type: ignore[attr-defined]
  return active.set_scoped(visualize)


def with_text(value, result):
  """An autovisualizer's ``result`` for ``value``, its figure read in text as the
  line it folds to when ``value`` is an array (``folded_line``); else ``result``."""
  if not isinstance(result, treescope.VisualizationFromTreescopePart):
    return result
  if isinstance(result.rendering.renderable, HtmlOrText) or folded_line(value) is None:
    return result
  return treescope.VisualizationFromTreescopePart(
    rp.RenderableAndLineAnnotations(
      renderable=HtmlOrText(result.rendering.renderable, lambda: _line(value)),
      annotations=HtmlOrText(result.rendering.annotations, rp.empty_part),
    )
  )


def folded_line(value) -> str | None:
  """The line an array's figure folds to, its text: ``<float32(layers:6, 8) ≈0.0 …>``
  for a stacked array (as ``_figures.stacked_arrays`` labels it), ``<jax.Array
  float32(2, 3) ≈0.0 …>`` for another; None for what is not an array.

  >>> import jax.numpy as jnp
  >>> from statefulremat.display._figure_text import folded_line
  >>> folded_line(jnp.zeros((2, 3)))
  '<jax.Array float32(2, 3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:6>'
  >>> folded_line("text") is None
  True
  """
  if isinstance(value, LayeredArray):
    return f"<{value.summary_text()}>"
  if isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, Tracer):
    return ArraySummary(value).text()
  return None


def _line(value) -> rp.RenderableTreePart:
  return rp.abbreviation_color(rp.text(folded_line(value) or ""))


@dataclasses.dataclass(frozen=True)
class HtmlOrText(rp.RenderableTreePart):
  """``html`` in HTML, ``text()`` in text. Laid out as ``html`` is, so a text of the
  view folds and opens where its HTML does; ``text`` is made only when text is."""

  html: rp.RenderableTreePart
  text: Any  # () -> RenderableTreePart

  def _compute_collapsed_width(self) -> int:
    return self.html.collapsed_width

  def _compute_newlines_in_expanded_parent(self) -> int:
    return self.html.newlines_in_expanded_parent

  def _compute_layout_marks_in_this_part(self) -> frozenset[Any]:
    return self.html.layout_marks_in_this_part

  def foldables_in_this_part(self):
    return self.html.foldables_in_this_part()

  def html_setup_parts(self, context, /):
    return self.html.html_setup_parts(context)

  def render_to_html(self, stream, *, at_beginning_of_line: bool = False, render_context):
    self.html.render_to_html(
      stream, at_beginning_of_line=at_beginning_of_line, render_context=render_context
    )

  def render_to_text(self, stream, *, expanded_parent, indent, roundtrip_mode, render_context):
    self.text().render_to_text(
      stream,
      expanded_parent=expanded_parent,
      indent=indent,
      roundtrip_mode=roundtrip_mode,
      render_context=render_context,
    )
