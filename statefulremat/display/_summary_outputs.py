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

import threading
from typing import Any

import jax
import numpy as np

from ..core._module import Module
from ..core._split_merge import merge
from ..core._state import State
from ..core._variables import owner_chain, path_of
from ._summary_walk import Description

_PATCH_LOCK = threading.Lock()  # one summary at a time wraps the classes' __call__


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
    if id(root) not in roots:
      roots[id(root)] = (root, running[-1] if running else ())
    return roots[id(root)][1] + path_of(module)

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
    row_paths.update((id(_at(copy, m.path)), m.path) for m in description.modules)
    return getattr(copy, method)(*inputs, **kwargs)

  with _PATCH_LOCK:
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


def _at(root, path: tuple):
  """The object at ``path`` below ``root``: attributes of modules, items of the rest."""
  for key in path:
    root = vars(root)[key] if isinstance(root, Module) else root[key]
  return root


def _patch_calls(classes, record) -> list[tuple[type, Any]]:
  """Wraps ``__call__`` where each class (or the base it inherits it from) defines it."""
  owners = {}
  for cls in classes:
    for base in cls.__mro__:
      if "__call__" in base.__dict__:
        owners[base] = base.__dict__["__call__"]
        break
  patched = []
  for cls, original in owners.items():
    if cls is object:
      continue
    cls.__call__ = record(original)
    patched.append((cls, original))
  return patched


def _root_of(obj):
  """The object at the top of ``obj``'s owner chain."""
  for parent, _ in owner_chain(obj):
    if parent is None:
      break
    obj = parent
  return obj


def _shapes_text(tree) -> str:
  """``float32[5,2]`` for an array; containers keep their brackets."""

  class Shape:
    def __init__(self, x):
      self.text = (
        f"{x.dtype}[{','.join(map(str, np.shape(x)))}]" if hasattr(x, "dtype") else type(x).__name__
      )

    def __repr__(self):
      return self.text

  if hasattr(tree, "dtype"):
    return repr(Shape(tree))
  # Modules are pytrees too: a returned module shows as its class name, not its leaves.
  return repr(jax.tree.map(Shape, tree, is_leaf=lambda x: isinstance(x, Module)))
