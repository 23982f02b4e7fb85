"""The class form shared by the transforms: a subclass whose methods are transformed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from ..core._module import Module


def is_module_class(target: object) -> TypeGuard[type[Module]]:
  return isinstance(target, type) and issubclass(target, Module)


def display_name(fn) -> str:
  """How errors name a transformed function: ``f``, or ``Cell.__call__`` for a method."""
  parts = getattr(fn, "__qualname__", getattr(fn, "__name__", "fn")).split(".")
  return ".".join(parts[-2:]) if len(parts) > 1 and parts[-2] != "<locals>" else parts[-1]


def transform_name(label: str) -> str:
  """``"RematScan"`` -> ``"sr.remat_scan"``."""
  return "sr." + "".join(
    "_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(label)
  )


def subclass(
  cls: type,
  label: str,
  wrap: Callable,
  methods: Sequence[str] | str | None,
  namespace: dict[str, Any],
  doc: str,
) -> type:
  """``class {label}{cls}(cls)`` with ``namespace`` and ``methods`` replaced by ``wrap(m)``.

  Each method is wrapped as a function whose argument 0 is ``self``, so it goes through
  the transform's function form like any module argument.
  """
  methods = (
    ["__call__"] if methods is None else [methods] if isinstance(methods, str) else list(methods)
  )
  namespace = {
    **namespace,
    "__module__": cls.__module__,
    "__doc__": doc,
    "_sr_transformed": True,
    "__qualname__": f"{label}{cls.__qualname__}",
  }
  for name in methods:
    method = getattr(cls, name, None)
    if not callable(method):
      raise AttributeError(
        f"{transform_name(label)}({cls.__name__}, methods={methods!r}): {cls.__name__} "
        f"has no method {name!r}. Name methods the class defines."
      )
    wrapped = wrap(method)
    wrapped.__name__ = name
    namespace[name] = wrapped
  return type(f"{label}{cls.__name__}", (cls,), namespace)


def transformed_class(cls: type, wrap: Callable, methods: Sequence[str] | None, label: str) -> type:
  """``class {label}{cls}(cls)`` whose ``methods`` (default ``__call__``) are transformed."""
  names = ", ".join(
    ["__call__"] if methods is None else [methods] if isinstance(methods, str) else methods
  )
  return subclass(
    cls, label, wrap, methods, {}, f"{cls.__name__} with {names} under {transform_name(label)}."
  )


def refuse_init_axes(transform: str, target, init_in_axes) -> None:
  """``init_in_axes`` maps constructor arguments: it only means something for a class."""
  if init_in_axes is not None:
    raise TypeError(
      f"{transform}(init_in_axes=...) maps the constructor arguments of a Module class "
      f"(the class form), but {display_name(target)} is a function. Fix: map the "
      "function's arguments with in_axes."
    )
