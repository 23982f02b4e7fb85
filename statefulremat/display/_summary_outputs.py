"""The output shapes of ``sr.summary``: the model's module calls, traced abstractly.

For the length of one ``jax.eval_shape`` trace of a copy of the model, the
``__call__`` of each module class in it is wrapped to record its outputs' shapes (and
restored in ``finally``). A module called inside a transform's body (a scan layer,
rebuilt from the stack) takes the path of the module whose call is running plus its
own path below the layer, so a stack's sub-layers get rows like ``blocks.linear``.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

_PATCH_LOCK = threading.Lock()  # one summary at a time wraps the classes' __call__


def trace_outputs(model, modules, inputs, method, kwargs) -> dict[tuple, list[str]]:
  from ..core._split_merge import merge, split
  from ..core._variables import path_of

  graphdef, state = split(model)
  row_paths = {id(m): path for path, m in modules}
  outputs: dict[tuple, list[str]] = {}
  running: list[tuple] = []  # paths of the module calls in progress
  originals: dict[int, Any] = {}  # id(module of the traced copy) -> the model's module
  roots: dict[int, tuple] = {}  # id(root of a rebuilt layer) -> (root, path of its stack)

  def path_of_call(module) -> tuple:
    original = originals.get(id(module))
    if original is not None:
      return row_paths[id(original)]
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
    copy = merge(graphdef, state)
    _pair(model, copy, originals)
    return getattr(copy, method)(*inputs, **kwargs)

  with _PATCH_LOCK:
    patched = _patch_calls({type(m) for _, m in modules}, record)
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


def _pair(original, copy, pairs: dict) -> None:
  """Maps id(each module of ``copy``) to the module of ``original`` in its place."""
  from ..core._module import Module

  if isinstance(original, Module):
    if id(copy) in pairs:
      return
    pairs[id(copy)] = original
    for k, v in vars(original).items():
      if not k.startswith("_sr_"):
        _pair(v, vars(copy)[k], pairs)
  elif isinstance(original, (list, tuple)):
    for a, b in zip(original, copy):
      _pair(a, b, pairs)
  elif isinstance(original, dict):
    for k, v in original.items():
      _pair(v, copy[k], pairs)


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
  from ..core._variables import owner_chain

  for parent, _ in owner_chain(obj):
    if parent is None:
      break
    obj = parent
  return obj


def _shapes_text(tree) -> str:
  """``float32[5,2]`` for an array; containers keep their brackets."""

  class Shape:
    def __init__(self, x):
      self.text = f"{x.dtype}[{','.join(map(str, np.shape(x)))}]" if hasattr(
          x, "dtype") else type(x).__name__

    def __repr__(self):
      return self.text

  from ..core._module import Module

  if hasattr(tree, "dtype"):
    return repr(Shape(tree))
  # Modules are pytrees too: a returned module shows as its class name, not its leaves.
  return repr(jax.tree.map(Shape, tree, is_leaf=lambda x: isinstance(x, Module)))
