"""How the core draws itself without importing the floor above it.

``repr(model)`` and treescope's rendering of modules, Variables, States and GraphDefs
are the display floor's work, but the core defines those classes. So the core calls
what the display floor registered here when it was imported (``statefulremat``
imports it), the way treescope lets a library register handlers for its types: the
core never imports the display floor, and the floors stay one-way.

>>> import statefulremat as sr
>>> from statefulremat.core import _display_hooks
>>> sorted(_display_hooks.registered())
['text', 'treescope', 'value_summary']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._caches import display_hooks


def register(**hooks: Callable[..., Any]) -> None:
  """Called by the display floor: ``text(obj)``, ``treescope(obj, path,
  subtree_renderer)`` and ``value_summary(value)``."""
  display_hooks.update(hooks)


def registered() -> list[str]:
  return list(display_hooks)


def _hook(name: str) -> Callable[..., Any]:
  try:
    return display_hooks[name]
  except KeyError:
    raise RuntimeError(
      f"statefulremat's display floor registered no {name!r} renderer: "
      "`import statefulremat` registers it (a core module imported on its own "
      "cannot draw)."
    ) from None


def text(obj) -> str:
  """``repr(obj)`` of a Module, Variable, State or GraphDef."""
  return _hook("text")(obj)


def treescope(obj, path, subtree_renderer):
  """``obj.__treescope_repr__(path, subtree_renderer)``."""
  return _hook("treescope")(obj, path, subtree_renderer)


def value_summary(value) -> str:
  """A one-line summary of an array (dtype, shape, statistics)."""
  return _hook("value_summary")(value)
