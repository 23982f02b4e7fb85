"""The class form shared by the transforms: a subclass whose methods are transformed."""

from __future__ import annotations

from typing import Callable, Sequence

from .._module import Module


def is_module_class(target) -> bool:
  return isinstance(target, type) and issubclass(target, Module)


def transformed_class(cls: type, wrap: Callable, methods: Sequence[str] | None,
                      label: str) -> type:
  """``class LabelCls(cls)`` whose ``methods`` (default ``__call__``) are ``wrap(method)``.

  The method is wrapped as a function whose argument 0 is ``self``, so it goes through
  the transform's function form like any module argument.
  """
  methods = ["__call__"] if methods is None else list(methods)
  if isinstance(methods, str):
    methods = [methods]
  namespace = {}
  for name in methods:
    method = getattr(cls, name, None)
    if not callable(method):
      raise AttributeError(
          f"sr.{label.lower()}({cls.__name__}, methods={methods!r}): {cls.__name__} has "
          f"no method {name!r}. Name methods the class defines.")
    wrapped = wrap(method)
    wrapped.__name__ = name
    namespace[name] = wrapped
  namespace["__module__"] = cls.__module__
  namespace["__qualname__"] = f"{label}{cls.__qualname__}"
  namespace["__doc__"] = f"{cls.__name__} with {', '.join(methods)} under sr.{label.lower()}."
  return type(f"{label}{cls.__name__}", (cls,), namespace)
