"""Registers the display floor's renderers with the core (``core._display_hooks``).

Imported with the display package, so ``import statefulremat`` registers them;
treescope itself is imported only when something is drawn.
"""

from __future__ import annotations

from ..core import _display_hooks
from ..core._graph import GraphDef
from ..core._module import Module
from ..core._state import State
from ..core._variables import Variable
from ._repr import module_repr, value_summary, variable_repr
from ._treescope import render_graphdef, render_module, render_state, render_variable, text_repr


def _graphdef_text(graphdef) -> str:
  return f"GraphDef(<{len(graphdef.var_paths)} variables>)"


# Each kind's renderer, and its plain text without treescope's output (a value that
# refuses to print).
_KINDS = (
  (Module, render_module, module_repr),
  (Variable, render_variable, variable_repr),
  (State, render_state, State._plain_repr),
  (GraphDef, render_graphdef, _graphdef_text),
)


def _text(obj) -> str:
  plain = next(fn for cls, _, fn in _KINDS if isinstance(obj, cls))
  return text_repr(obj, plain)


def _treescope(obj, path, subtree_renderer):
  render = next(fn for cls, fn, _ in _KINDS if isinstance(obj, cls))
  return render(obj, path, subtree_renderer)


_display_hooks.register(text=_text, treescope=_treescope, value_summary=value_summary)
