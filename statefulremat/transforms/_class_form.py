"""The class form shared by the transforms: a subclass whose methods are transformed."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard, TypeVar

from ..core._bookkeeping import TRANSFORMED
from ..core._module import Module
from ..core._stacks import is_stacked, update_stack_info


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
    TRANSFORMED: True,
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


F = TypeVar("F", bound=Callable)

# Made classes by the frozen arguments that made them: an entry lives while its class
# does (instances, a jit cache or the user hold it), and keeps the user's class alive.
_MADE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def cached_class_form(transform: F) -> F:
  """``transform`` whose class form returns one class per equal arguments.

  ``sr.remat(Block) is sr.remat(Block)``: a model that builds its stack in
  ``__init__`` gets the same class for every instance of one config, so ``sr.jit``
  compiles once for them and ``sr.stack`` takes their layers together. Arguments that
  cannot be compared by value (an array) make a new class each time, as before.
  ``fresh(transform)`` is the uncached form (a class that is then edited: a
  pattern's positions).
  """

  @functools.wraps(transform)
  def call(target=None, *args, **kwargs):
    partial = is_class_partial(target)
    if not (isinstance(target, type) or isinstance(target, (tuple, list)) or partial):
      return transform(target, *args, **kwargs)
    try:
      key = _frozen((transform.__name__, target, args, kwargs))
      made = _MADE.get(key)
    except TypeError:  # an argument not hashable by value
      return transform(target, *args, **kwargs)
    if made is None:
      made = _stack_of_partial(transform, target, args, kwargs) if partial else None
      made = transform(target, *args, **kwargs) if made is None else made
      if isinstance(made, type):
        _MADE[key] = made
    return made

  return call  # pyright: ignore[reportReturnType]


def is_class_partial(target) -> bool:
  """Whether ``target`` is a ``functools.partial`` of a Module class."""
  return isinstance(target, functools.partial) and is_module_class(target.func)


def _stack_of_partial(transform: Callable, target, args: tuple, kwargs: dict) -> type | None:
  """The stacked class of ``partial(Block, ...)``, as the patterns take one: the class
  form of ``Block`` whose layers are built by the partial (its arguments first). None
  where the transform's class form makes no stack (``sr.remat``)."""
  made = transform(target.func, *args, **kwargs)
  if not is_stacked(made):
    return None
  update_stack_info(made, factory=target)
  return made


def fresh(transform: Callable) -> Callable:
  """The uncached class form of a ``cached_class_form`` transform."""
  return getattr(transform, "__wrapped__", transform)


def _frozen(value) -> Any:
  """``value`` as a hashable key equal for equal arguments (types kept: ``1`` is not
  ``True``); raises ``TypeError`` for what has no value equality (an array)."""
  if isinstance(value, Mapping):
    return ("mapping", tuple((_frozen(k), _frozen(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return (type(value).__name__, tuple(_frozen(v) for v in value))
  if isinstance(value, functools.partial):
    return ("partial", value.func, _frozen(value.args), _frozen(value.keywords))
  hash(value)
  return (type(value), value)
