"""``sr.display``: treescope's notebook display, with stacked arrays drawn as figures
(a layers × features image, or a slider over the layers with each layer's norm), and
the same view written as a page that shows its text where no script runs."""

from __future__ import annotations

import html
import os
import pathlib
from typing import Any

from ..core._module import Module
from ._figures import autovisualizer
from ._repr import module_text
from ._treescope import compact_text


def display(
  obj: Any,
  *,
  arrays: str = "stacked",
  path: str | os.PathLike | None = None,
  title: str | None = None,
  description: str | None = None,
) -> None:
  """Shows ``obj`` with treescope: a foldable, coloured tree in a notebook (IPython),
  its text elsewhere; with ``path``, writes that view as an HTML page instead.

  In a notebook, modules open with their sub-modules and Variables; each module's
  settings at their constructor defaults sit in one folded line, and RNG streams are
  folded (a click opens either). Stacked arrays (the layer axis of scan, remat_scan
  and vmap modules) are drawn as figures: one layers × features image where a layer
  is 0-d or 1-d, else one layer at a time with a slider over the layer axis and each
  layer's norm beside it; ``arrays="all"`` draws every array, ``arrays="none"`` none.
  Outside a notebook it prints the repr's text.

  The page at ``path`` is self-contained and draws at once when opened (no loading
  step a screenshot could catch); it opens with a heading, ``title``, and the
  sentence ``description`` under it; where no script runs (a browser with JavaScript
  off, a static preview) it shows the repr's text.

  Args:
    obj: what to show: a module, Variable, ``State``, ``GraphDef`` or any value
      treescope draws.
    arrays: which arrays are drawn as figures: ``"stacked"`` (the layer axis of a
      stack), ``"all"`` or ``"none"``.
    path: where to write the page; ``None`` shows ``obj`` instead.
    title: the page's heading (``<h1>``) and title; ``None`` names ``obj``, as its
      tree does (``RematScan[Block] × 100``). Only with ``path``.
    description: a sentence under the heading saying what the page shows; ``None``
      for none. Only with ``path``.

  Raises:
    ValueError: ``arrays`` is none of the three.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.display(sr.Param(jnp.zeros(2)))  # outside a notebook: the text
  Param(value=<jax.Array([0., 0.], dtype=float32)>)
  """
  visualizer = autovisualizer(arrays)
  if path is not None:
    text = page(obj, arrays=arrays, title=title, description=description)
    pathlib.Path(path).write_text(text, encoding="utf-8")
    return
  if not _in_notebook():
    print(compact_text(obj))
    return
  import treescope
  from treescope.external import jax_support

  # The statistics of every array, the big ones too, also where treescope draws
  # arrays after the tree (its deferred rendering in a notebook).
  with jax_support.summarization_threshold.set_scoped({"default": None}):
    treescope.display(obj, autovisualize=visualizer if visualizer else False)


def page(
  obj: Any, *, arrays: str = "stacked", title: str | None = None, description: str | None = None
) -> str:
  """``obj``'s treescope view as a self-contained HTML page (what ``sr.display(obj,
  path=...)`` writes): a heading (``title``, else ``obj``'s name as its tree gives
  it) and ``description``; every Variable open on its figure, uncompressed, so it
  draws as it loads, and with the repr's text inside ``<noscript>`` for a browser that
  runs no script.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> from statefulremat.display._display import page
  >>> html = page(sr.Param(jnp.zeros(2)), description="A Param of two zeros.")
  >>> "<h1>Param</h1>" in html and "<p>A Param of two zeros.</p>" in html
  True
  >>> "<noscript>" in html and "Param(value=&lt;jax.Array([0., 0.], dtype=float32)&gt;)" in html
  True
  """
  import treescope
  from treescope.external import jax_support

  visualizer = autovisualizer(arrays)
  with (
    jax_support.summarization_threshold.set_scoped({"default": None}),
    treescope.active_autovisualizer.set_scoped(visualizer),
    # A page is for looking: every Variable open on its figure (RNG streams and
    # settings at their defaults stay folded), however tall that makes it.
    treescope.using_expansion_strategy(max_height=None),
  ):
    body = treescope.render_to_html(obj, compressed=False)
  text = html.escape(compact_text(obj))
  if title is None:  # obj named as its tree names it: `RematScan[Block] × 100`, `Param`
    title = module_text(obj) if isinstance(obj, Module) else type(obj).__name__
  heading = html.escape(title)
  intro = f"<h1>{heading}</h1>\n"
  if description:
    intro += f"<p>{html.escape(description)}</p>\n"
  return (
    '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
    f"<title>{heading}</title>{_STYLE}</head><body>\n{intro}"
    f'<noscript><pre class="sr-text">{text}</pre></noscript>\n{body}\n</body></html>\n'
  )


# The heading and its sentence in the page's sans-serif, as wide as the tree's text.
_STYLE = (
  "<style>body > h1, body > p {font-family: system-ui, sans-serif; max-width: 50em}"
  " body > h1 {font-size: 1.5em; margin-bottom: 0.3em}</style>"
)


def _in_notebook() -> bool:
  try:
    import IPython
  except ImportError:
    return False
  return IPython.get_ipython() is not None
