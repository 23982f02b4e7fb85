"""The class form shared by the transforms: a subclass whose methods are transformed,
cached per equal arguments and pickled by the call that made it (README.md)."""

from __future__ import annotations

import copyreg
import functools
import pickle
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, Protocol, TypeGuard, TypeVar, overload

from ..core._bookkeeping import MADE_BY, STACK_INFO, TRANSFORMED
from ..core._caches import class_forms, joined_metaclasses, made_classes
from ..core._module import Module
from ..core._stacks import cycle_unit, stack_info

M = TypeVar("M", bound=Module)
P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable)


class Transform(Protocol):
  """What ``sr.remat`` / ``sr.scan`` / ``sr.remat_scan`` / ``sr.vmap`` return when given
  only keywords (a decorator): applied to a Module class it gives a class typed as that
  class (``type[Block]``), to a function one with the same signature."""

  @overload
  def __call__(self, target: type[M], /) -> type[M]: ...
  @overload
  def __call__(self, target: Callable[P, R], /) -> Callable[P, R]: ...


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
  """``class {label}{cls}(cls)`` with ``namespace`` and ``methods`` replaced by ``wrap(m)``."""
  methods = method_names(methods)
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
  return made_type(f"{label}{cls.__name__}", cls, namespace)


class MadeClass(type):
  """The metaclass of the classes the class forms make (see the module docstring)."""


def made_type(name: str, base: type, namespace: dict[str, Any]) -> type:
  """``type(name, (base,), namespace)`` under ``MadeClass`` and ``base``'s own metaclass."""
  meta = type(base)
  if not issubclass(meta, MadeClass):
    if meta is type:
      meta = MadeClass
    elif (joined := joined_metaclasses.get(meta)) is not None:
      meta = joined
    else:
      meta = joined_metaclasses[meta] = type(f"Made{meta.__name__}", (MadeClass, meta), {})
      copyreg.pickle(meta, _reduce_class)
  return meta(name, (base,), namespace)


def method_names(methods: Sequence[str] | str | None) -> list[str]:
  """A class form's ``methods`` as a list (default ``["__call__"]``)."""
  return (
    ["__call__"] if methods is None else [methods] if isinstance(methods, str) else list(methods)
  )


def function_target(
  transform: str, target, *, takes: str, methods=None, init_in_axes=None
) -> Callable[..., Any]:
  """``target``, checked as a function form's (``takes``: what the transform takes)."""
  if methods is not None:
    raise TypeError(f"{transform}(methods=...) applies to a Module class, not a function.")
  if not callable(target):
    raise TypeError(
      f"{transform} takes {takes}; got a {type(target).__name__}: {target!r}. Fix: pass "
      "the function, or the layer class to stack."
    )
  if init_in_axes is not None:
    raise TypeError(
      f"{transform}(init_in_axes=...) maps the constructor arguments of a Module class "
      f"(the class form), but {display_name(target)} is a function. Fix: map the "
      "function's arguments with in_axes."
    )
  return target


def cached_class_form(transform: F) -> F:
  """``transform`` whose class form returns one class per equal arguments."""

  @functools.wraps(transform)
  def call(target=None, *args, **kwargs):
    if not (isinstance(target, (type, tuple, list)) or is_class_partial(target)):
      return transform(target, *args, **kwargs)
    try:
      key = _frozen((transform.__name__, target, args, kwargs))
      made = made_classes.get(key)
    except TypeError:  # an argument not hashable by value: a new class each time
      key = made = None
    if made is None:
      made = transform(target, *args, **kwargs)
      if isinstance(made, type) and key is not None:
        made_classes[key] = made
      if isinstance(made, MadeClass) and MADE_BY not in made.__dict__:
        setattr(made, MADE_BY, (transform.__name__, target, args, dict(kwargs)))
    return made

  class_forms[transform.__name__] = call
  return call  # pyright: ignore[reportReturnType]


def made_class(recipe: tuple, position: int | None = None) -> type:
  """The class ``recipe`` (a class's ``MADE_BY``) makes, or its ``position``: for pickles."""
  form, target, args, kwargs = recipe
  cls = class_forms[form](target, *args, **kwargs)
  if position is None:
    return cls
  unit = cycle_unit(cls)
  assert unit is not None, cls
  return unit.positions[position]


class _Refused(pickle.PicklingError):
  """A made class that cannot be pickled (raised once, however deep it sits)."""


def _reduce_class(cls: type):
  """How pickle saves a made class: by the call that made it (a user's subclass: by name)."""
  info = stack_info(cls)
  if MADE_BY in cls.__dict__:
    recipe, position = cls.__dict__[MADE_BY], None
  elif info is not None and info.place is not None:
    pattern = info.place.pattern()
    assert pattern is not None
    recipe, position = pattern.__dict__.get(MADE_BY), info.place.position
  elif TRANSFORMED in cls.__dict__ or STACK_INFO in cls.__dict__:
    recipe, position = None, None
  else:
    return cls.__qualname__
  if recipe is None:
    raise _Refused(
      f"cannot pickle {cls.__name__}: it was made by a class form but not through "
      "its public call (`sr.scan(Block, ...)`), so pickle has no call to make it again "
      f"by. {_SAVE_STATE}"
    )
  _check_picklable(cls, recipe)
  return made_class, (recipe,) if position is None else (recipe, position)


_SAVE_STATE = (
  "Or save the state instead: `sr.save(path, model)` (then `sr.restore(path, "
  "Model(...))`), or pickle `sr.state(model)` and load it with `sr.update(model, state)`."
)


def _check_picklable(cls: type, recipe: tuple) -> None:
  """Raises, naming the argument, unless every part of the call ``recipe`` pickles."""
  form, target, args, kwargs = recipe
  call = f"sr.{form}({_target_words(target)}, ...)"
  parts = [("class" if isinstance(target, type) else "target", target)]
  parts += [(f"argument {i}", a) for i, a in enumerate(args, 1)]
  parts += [(f"argument `{k}=`", v) for k, v in kwargs.items()]
  for what, value in parts:
    try:
      pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except _Refused:
      raise
    except Exception as e:  # pickle raises PicklingError, TypeError or AttributeError
      raise _Refused(
        f"cannot pickle {cls.__name__}: pickle makes a class that a class form "
        f"made by calling the class form again, {call}, but its {what} "
        f"({_value_words(value)}) cannot be pickled ({e}). Fix: give {call} what "
        "pickle finds by name, as it needs for any class: classes and functions "
        "defined at the top level of a module (not a lambda, nor a class or function "
        f"defined inside a function). {_SAVE_STATE}"
      ) from e


def _target_words(target) -> str:
  if isinstance(target, (tuple, list)):
    return "(" + ", ".join(_target_words(e) for e in target) + ")"
  if isinstance(target, functools.partial):
    return f"partial({_target_words(target.func)}, ...)"
  return getattr(target, "__name__", None) or type(target).__name__


def _value_words(value) -> str:
  """A class or function by where pickle looks for it, another value by its repr."""
  if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
    return f"{value.__module__}.{value.__qualname__}"
  return reprlib.repr(value)


copyreg.pickle(MadeClass, _reduce_class)


def is_class_partial(target) -> bool:
  """Whether ``target`` is a ``functools.partial`` of a Module class."""
  return isinstance(target, functools.partial) and is_module_class(target.func)


def fresh(transform: Callable) -> Callable:
  """The uncached class form of a ``cached_class_form`` transform."""
  return getattr(transform, "__wrapped__", transform)


def _frozen(value) -> Any:
  """``value`` as a hashable key (``1`` is not ``True``); ``TypeError`` for an array."""
  if isinstance(value, Mapping):
    return ("mapping", tuple((_frozen(k), _frozen(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return (type(value).__name__, tuple(_frozen(v) for v in value))
  if isinstance(value, functools.partial):
    return ("partial", value.func, _frozen(value.args), _frozen(value.keywords))
  hash(value)
  return (type(value), value)
