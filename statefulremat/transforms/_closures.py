"""What a body reads from outside its arguments, so an eager transform never goes stale.

``sr.scan(f)``, ``sr.remat_scan(f)`` and ``sr.vmap(f)`` called outside any trace run
through a cached ``sr.jit`` (``compiled_when_eager``): one compile per module
structure. A compiled body has the Python values it closed over baked in, so a stored
``run = sr.scan(f, ...)`` called again after ``scale = 3.0`` would serve the first
call's result. A plain Python loop would not, and an eager call reads as one.

``Watch`` records, when the body is compiled, every value it can reach by name: its
closure cells, the globals its code (nested functions and lambdas included) names,
and the same for the user's own functions among them (not for library code, whose
module-level names do not change). Each later eager call compares them; anything
rebound (by identity), or a list, dict, set or numpy array changed in place (by
value), makes the caller compile again. Attributes of other objects mutated in place
are not followed (``config.scale = 3`` on an object the body reads): as under
``jax.jit``, pass such values as arguments.
"""

from __future__ import annotations

import copy
import functools
import sysconfig
import types
from collections.abc import Callable
from typing import Any

import numpy as np

_LIBRARY_DIRS = tuple(
  sorted(
    {
      path
      for key in ("stdlib", "platstdlib", "purelib", "platlib")
      if (path := sysconfig.get_paths().get(key))
    }
  )
)
_OWN_PACKAGE = __name__.split(".")[0] + "."
_MAX_DEPTH = 4
_MISSING = object()
_BY_VALUE = (list, dict, set, np.ndarray)


def _is_user_function(fn) -> bool:
  if not isinstance(fn, types.FunctionType):
    return False
  if (fn.__module__ or "").startswith(_OWN_PACKAGE):
    return False
  return not fn.__code__.co_filename.startswith(_LIBRARY_DIRS)


def _unwrap(fn) -> types.FunctionType | None:
  for _ in range(8):
    if isinstance(fn, types.MethodType):
      fn = fn.__func__
    elif isinstance(fn, functools.partial):
      fn = fn.func
    elif isinstance(fn, types.FunctionType):
      return fn
    else:
      return None
  return None


def _names(code: types.CodeType) -> set[str]:
  """The global names ``code`` and the functions defined inside it may read."""
  names = set(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= _names(const)
  return names


def _snapshot(value):
  if isinstance(value, np.ndarray):
    return value.copy()
  if isinstance(value, (list, dict, set)):
    try:
      return copy.copy(value)
    except Exception:  # an odd subclass: compare by identity only
      return _MISSING
  return _MISSING


def _same(value, entry) -> bool:
  obj, snapshot = entry
  if value is not obj:
    return False
  if snapshot is _MISSING:
    return True
  if isinstance(snapshot, np.ndarray):
    return (
      snapshot.shape == value.shape
      and snapshot.dtype == value.dtype
      and bool(np.array_equal(snapshot, value, equal_nan=True))
    )
  try:
    return bool(snapshot == value)
  except Exception:  # containers of arrays: == is ambiguous, so treat as changed
    return False


class Watch:
  """The outside values ``fn`` reads, as they were when it was compiled."""

  __slots__ = ("_cells", "_globals")

  def __init__(self, fn: Callable):
    self._cells: list[tuple[types.CellType, tuple[Any, Any]]] = []
    self._globals: list[tuple[dict, str, tuple[Any, Any]]] = []
    self._collect(_unwrap(fn), 0, set())

  def _collect(self, fn, depth: int, seen: set) -> None:
    if fn is None or depth > _MAX_DEPTH or fn.__code__ in seen:
      return
    seen.add(fn.__code__)
    reached = []
    for cell in fn.__closure__ or ():
      try:
        value = cell.cell_contents
      except ValueError:  # not bound yet (a name the function defines later)
        continue
      self._cells.append((cell, (value, _snapshot(value))))
      reached.append(value)
    namespace = fn.__globals__
    for name in sorted(_names(fn.__code__)):
      value = namespace.get(name, _MISSING)
      if value is _MISSING or isinstance(value, types.ModuleType):
        continue
      self._globals.append((namespace, name, (value, _snapshot(value))))
      reached.append(value)
    for value in reached:
      inner = _unwrap(value)
      if inner is not None and _is_user_function(inner):
        self._collect(inner, depth + 1, seen)

  def changed(self) -> bool:
    """Whether anything recorded was rebound or changed in place since."""
    for cell, entry in self._cells:
      try:
        value = cell.cell_contents
      except ValueError:
        return True
      if not _same(value, entry):
        return True
    for namespace, name, entry in self._globals:
      if not _same(namespace.get(name, _MISSING), entry):
        return True
    return False
