"""The output shapes of ``sr.summary``: the model's module calls, traced abstractly.

For the length of one ``jax.eval_shape`` trace of a copy of the model, the
``__call__`` of each module class in it is wrapped to record its outputs' shapes (and
restored in ``finally``). The copy is rebuilt from the description's GraphDef, so each
row's module sits at the row's path in it: found there, not by walking the copy. A
module called inside a transform's body (a scan layer, rebuilt from the stack) takes
the path of the module whose call is running plus its own path below the layer, so a
stack's sub-layers get rows like ``blocks.linear``.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

from ..core._caches import summary_patch_lock
from ..core._module import Module
from ..core._split_merge import merge, node_at
from ..core._state import State
from ..core._variables import owner_chain, path_of
from ._summary_walk import Description


def trace_outputs(
  model, description: Description, inputs, method, kwargs
) -> dict[tuple, list[str]]:
  """Each module path's outputs, one shape text per call of ``method`` on ``inputs``."""
  state = State.from_variables(zip(description.graphdef.var_paths, description.graph_variables))
  outputs: dict[tuple, list[str]] = {}
  running: list[tuple] = []  # paths of the module calls in progress
  row_paths: dict[int, tuple] = {}  # id(module of the traced copy) -> its row's path
  roots: dict[int, tuple] = {}  # id(root of a rebuilt layer) -> (root, path of its stack)

  def path_of_call(module) -> tuple:
    path = row_paths.get(id(module))
    if path is not None:
      return path
    # A module rebuilt inside a transform's body (a layer of a stack): below the path
    # of the call that first reached its root.
    root = _root_of(module)
    _, stack_path = roots.setdefault(id(root), (root, running[-1] if running else ()))
    return stack_path + path_of(module)

  def record(call):
    def recording(self, *args, **kw):
      path = path_of_call(self)
      running.append(path)
      try:
        out = call(self, *args, **kw)
      finally:
        running.pop()
      outputs.setdefault(path, []).append(_shapes_text(out))
      return out

    return recording

  def run(state, *inputs):
    copy = merge(description.graphdef, state)
    # The copy has the model's structure: each row's module sits at the row's path.
    row_paths.update((id(node_at(copy, m.path)), m.path) for m in description.modules)
    return getattr(copy, method)(*inputs, **kwargs)

  with summary_patch_lock:  # one summary at a time wraps the classes' __call__
    patched = _patch_calls({m.cls for m in description.modules}, record)
    try:
      jax.eval_shape(run, state, *inputs)
    except Exception as e:
      shapes = ", ".join(_shapes_text(x) for x in inputs)
      e.add_note(f"(while sr.summary traced {type(model).__name__}.{method}({shapes}))")
      raise
    finally:
      for cls, original in patched:
        cls.__call__ = original
  return outputs


def _patch_calls(classes, record) -> list[tuple[type, Any]]:
  """Wraps ``__call__`` where each class (or the base it inherits it from) defines it."""
  owners = (next((b for b in cls.__mro__ if "__call__" in b.__dict__), None) for cls in classes)
  patched = [(owner, owner.__dict__["__call__"]) for owner in set(owners) if owner is not None]
  for owner, original in patched:
    owner.__call__ = record(original)
  return patched


def _root_of(obj):
  """The object at the top of ``obj``'s owner chain."""
  for parent, _ in owner_chain(obj):
    if parent is None:
      break
    obj = parent
  return obj


class _Unquoted(str):
  """A text that a container's repr shows as it is, without quotes."""

  __repr__ = str.__str__


def _shapes_text(tree) -> str:
  """``float32[5,2]`` for an array; containers keep their brackets."""

  def shape(x):
    if hasattr(x, "dtype"):
      return _Unquoted(f"{x.dtype}[{','.join(map(str, np.shape(x)))}]")
    return _Unquoted(type(x).__name__)

  # Modules are pytrees too: a returned module shows as its class name, not its leaves.
  return repr(jax.tree.map(shape, tree, is_leaf=lambda x: isinstance(x, Module)))


OUTPUT_WIDTH = 72  # characters of one output's text in the summary's output column

_OPEN, _CLOSE = "([{", {"(": ")", "[": "]", "{": "}"}
_SHORT_DTYPE = re.compile(r"\b(bfloat|float|uint|int|complex)(\d+)\[")
_SHORT_KIND = {"bfloat": "bf", "float": "f", "uint": "u", "int": "i", "complex": "c"}


def shorten(text: str, width: int = OUTPUT_WIDTH) -> str:
  """``text`` (an output's shapes, as ``_shapes_text`` writes them) in ``width``
  characters: if longer, its dtypes as jaxprs write them (``f32[2,4]``), then cut
  after the items that fit, ``…`` for the rest and the open brackets closed. Each
  item kept is whole (a dict's key with its value), so the keys read as they are; a
  shape is never cut.

  >>> from statefulremat.display._summary_outputs import shorten
  >>> shorten("{'x': float32[2,4], 'y': float32[2,4], 'z': float32[2,4]}", 40)
  "{'x': f32[2,4], 'y': f32[2,4], …}"
  >>> shorten("(float32[2,4], {'k': float32[2,4], 'v': float32[2,4]})", 22)
  '(f32[2,4], {…})'
  """
  if len(text) <= width:
    return text
  text = _SHORT_DTYPE.sub(lambda m: f"{_SHORT_KIND[m[1]]}{m[2]}[", text)
  if len(text) <= width:
    return text
  closes: dict[int, int] = {}  # where each opening bracket closes
  opened: list[int] = []  # the brackets open at this point
  cuts: list[tuple[int, tuple[int, ...]]] = []  # where it may be cut, the brackets open there
  for i, c in _structure(text):
    if c in _OPEN:
      opened.append(i)
      if c != "[" or not (i and text[i - 1].isalnum()):  # a container's items start
        cuts.append((i + 1, tuple(opened)))
    elif c in ")]}" and opened:
      closes[opened.pop()] = i
    elif c == "," and text.startswith(", ", i) and opened:
      cuts.append((i + 2, tuple(opened)))
  shortened = [_cut(text, at, still_open, closes) for at, still_open in cuts]
  fitting = [cut for cut in shortened if len(cut) <= width]
  # The last cut that fits (it keeps the most), else the first.
  return fitting[-1] if fitting else shortened[0] if shortened else text


def _structure(text: str):
  """``(index, character)`` of ``text``'s characters outside quoted strings (a key's
  brackets and commas are not the tree's)."""
  quote, escaped = None, False
  for i, c in enumerate(text):
    if quote is not None:
      if escaped:
        escaped = False
      elif c == "\\":
        escaped = True
      elif c == quote:
        quote = None
    elif c in "'\"":
      quote = c
    else:
      yield i, c


def _cut(text: str, at: int, opened: tuple[int, ...], closes: dict[int, int]) -> str:
  """``text`` up to ``at``, then ``…``, and the ``opened`` brackets closed, each
  followed by ``, …`` where its container has more items after it."""
  cut = text[:at] + "…"
  for i in reversed(opened):
    cut += _CLOSE[text[i]]
    if text.startswith(", ", closes.get(i, len(text)) + 1):
      cut += ", …"
  return cut
