"""The class forms of the stacking transforms: a Module class becomes its stacked class,
a tuple of classes (or partials of them) a pattern stack (README.md)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core._errors import TransformError
from ..core._module import Module
from ..core._pattern_stack import Pattern, PatternStack
from ..core._stacks import (
  Cycle,
  Form,
  Layer,
  Place,
  StackInfo,
  cycle_unit,
  is_stacked,
  set_stack_info,
)
from ._class_form import (
  display_name,
  is_class_partial,
  is_module_class,
  made_type,
  method_names,
  subclass,
  transform_name,
)
from ._rules import Rules
from ._stacked import stack_namespace


@dataclasses.dataclass(frozen=True)
class Position:
  """One position of a pattern as a class form's target: ``unit`` with its ``place``."""

  unit: Layer
  place: Place


def class_form(
  target,
  form: Form,
  *,
  what: str,
  rules: Callable[[], Rules],
  count: Callable[[int], int | None],
  run: Callable[[Callable, int], Callable],
  position_class: Callable[[Position, int], type],
  methods: Sequence[str] | None,
  metadata_params: Mapping,
  init_in_axes: Any = None,
  lengths: tuple[int, ...] | None = None,
) -> type | None:
  """The class form of scan, remat_scan or vmap over ``target``; None for a function.
  ``rules()``: the collection rules; ``count(period)``: the checked number of layers (period
  1 for a class, else the pattern's); ``run(fn, period)``: the function form over ``fn``;
  ``position_class(position, n)``: a position's stacked class."""
  if is_pattern(target):
    return pattern_class(target, form, what, count, run, position_class, methods, init_in_axes)
  if isinstance(target, Position):
    unit, place = target.unit, target.place
  elif is_class_partial(target):  # a pattern's element given alone
    unit, place = Layer(target.func, target), None
  elif is_module_class(target):
    unit, place = Layer(target), None
  else:
    return None
  rules_ = rules()
  length = count(1)  # checked before any method is wrapped
  cls = subclass(
    unit.cls,
    form.value,
    lambda method: run(method, 1),
    methods,
    stack_namespace(unit.cls, rules_),
    f"A stack of {unit.cls.__name__} layers under {transform_name(form.value)}.",
  )
  if place is not None:
    cls.__qualname__ = f"{cls.__qualname__}[{place.position}]"
  info = StackInfo(
    form,
    length,
    f"sr.{cls.__name__}(...)",
    unit,
    rules=rules_,
    partition_name=dict(metadata_params).get("partition_name"),
    init_in_axes=init_in_axes,
    place=place,
    lengths=lengths,
  )
  return set_stack_info(cls, info)


def is_pattern(target) -> bool:
  """Whether ``target`` is a tuple of classes (a pattern for a class form)."""
  return isinstance(target, (tuple, list)) and not isinstance(target, Pattern)


def target_repr(pattern) -> str:
  """How errors name a target: ``f``, ``Block``, or a pattern ``(Local, Local, Global)``."""
  if isinstance(pattern, Position):
    return display_name(pattern.unit.cls)
  if is_class_partial(pattern):
    return display_name(pattern.func)
  if not is_pattern(pattern):
    return display_name(pattern)
  names = [
    getattr(e, "__name__", None)
    or (
      f"partial({e.func.__name__}, ...)"
      if isinstance(e, functools.partial) and hasattr(e.func, "__name__")
      else f"{type(e).__name__}(...)"
      if isinstance(e, Module)
      else repr(e)
    )
    for e in pattern
  ]
  return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


def elements(what: str, pattern) -> list[tuple[type, Callable | None]]:
  """``(layer class, factory or None)`` per position; raises on anything else."""
  if not pattern:
    raise TransformError(
      f"{what}: the pattern is empty. Give a tuple of Module classes, one per position "
      "of the repeating cycle, e.g. `(Local, Local, Global)`."
    )
  out = []
  for k, element in enumerate(pattern):
    if is_module_class(element):
      out.append((element, None))
    elif isinstance(element, functools.partial) and is_module_class(element.func):
      out.append((element.func, element))
    else:
      name = getattr(element, "__name__", None)
      got = (
        f"the function {name}"
        if callable(element) and name is not None
        else f"a {type(element).__name__} instance"
        if isinstance(element, Module)
        else f"{type(element).__name__} {element!r}"
      )
      raise TransformError(
        f"{what}: position {k} of the pattern is {got}, not a Module class. Every "
        "element of a pattern is a Module class or a `functools.partial` of one, e.g. "
        "`(Local, functools.partial(Block, window=512))`. Nothing was built."
      )
  return out


def _name(cls: type, factory) -> str:
  if factory is None:
    return cls.__name__
  given = [repr(a) for a in factory.args] + [f"{k}={v!r}" for k, v in factory.keywords.items()]
  return f"partial({cls.__name__}, {', '.join(given)})"


def pattern_class(pattern, form: Form, what, count, run, position_class, methods, init_in_axes):
  """``class_form`` over a pattern: ``{form}Pattern``, whose methods run each layer's own."""
  length = count(len(pattern))
  found = elements(what, pattern)
  p = len(found)
  if length is None:
    raise TransformError(
      f"{what}: a pattern stack needs `length=` (the number of layers; `axis_size=` "
      f"for sr.vmap), so that each of the {p} positions knows how many layers it holds."
    )
  if not isinstance(length, int) or isinstance(length, bool) or length < p:
    raise TransformError(
      f"{what}: length={length!r} is shorter than the pattern of {p} blocks, so some "
      f"position would hold no layer. Fix: length >= {p} (any length: the last cycle "
      "may be short), or a shorter pattern."
    )
  names = [_name(cls, factory) for cls, factory in found]
  made: list[type] = []  # the pattern class, once made
  positions = [
    position_class(
      Position(Layer(cls, factory), Place(p, k, names[k], lambda: made[0] if made else None)),
      len(range(k, length, p)),
    )
    for k, (cls, factory) in enumerate(found)
  ]
  namespace: dict[str, Any] = {
    "__module__": found[0][0].__module__,
    "__qualname__": f"{form.value}Pattern[{', '.join(names)}]",
    "__doc__": (
      f"A stack of {length} layers repeating ({', '.join(names)}) under "
      f"{transform_name(form.value)}."
    ),
  }
  for name in method_names(methods):
    for cls, _ in found:
      if not callable(getattr(cls, name, None)):
        raise AttributeError(
          f"{what}: {cls.__name__} has no method {name!r}. Name methods that every "
          "class of the pattern defines."
        )
    namespace[name] = run(call_method(name, f"{form.value}Pattern"), p)
  cls = made_type(f"{form.value}Pattern", PatternStack, namespace)
  unit = Cycle(tuple(positions), tuple(names))
  set_stack_info(cls, StackInfo(form, length, what, unit, init_in_axes=init_in_axes))
  made.append(cls)
  return cls


def call_method(name: str, owner: str) -> Callable:
  """``f(layer, *args)``: the layer's own method ``name``, named ``{owner}.{name}``."""

  def call(layer, *args, **kwargs):
    return getattr(layer, name)(*args, **kwargs)

  call.__name__ = name
  call.__qualname__ = f"{owner}.{name}"
  return call


def position_names(stack: PatternStack) -> list[str]:
  unit = cycle_unit(stack)
  assert unit is not None
  return list(unit.names)


def check_positions(stack: PatternStack, what: str) -> list[int]:
  """The number of layers of each position; raises unless they make one pattern."""
  p = len(stack.pattern)
  counts = []
  for k, position in enumerate(stack.pattern):
    if not is_stacked(position):
      raise TransformError(
        f"{what}: `pattern.{k}` of the pattern stack is a {type(position).__name__}, "
        "not a stack. Build pattern stacks with a class form, e.g. "
        "`sr.scan((A, B), length=n, ...)`."
      )
    counts.append(len(position))
  n = sum(counts)
  expected = [len(range(k, n, p)) for k in range(p)]
  if counts != expected:
    raise TransformError(
      f"{what}: the positions of the pattern stack hold {counts} layers; a pattern of "
      f"{p} over {n} layers holds {expected} (layer i at position i % {p}). Fix: "
      "rebuild the stack (or `sr.stack(layers, like=stack)` from its layers)."
    )
  return counts
