"""Stacks of a repeating pattern: a tuple of classes as one cycle.

``sr.scan((Local, Local, Global), length=26, ...)`` (likewise ``sr.remat_scan`` and
``sr.vmap``) returns a class whose instances hold one ordinary stack per position of
the pattern, ``stack.pattern[k]``: the layers ``k, k + P, k + 2P, ...`` (P the
pattern's length) of the class ``pattern[k]``, in order. Layer ``i`` is an instance of
``pattern[i % P]``: ``stack.layer(i)`` is ``stack.pattern[i % P].layer(i // P)``; the
last cycle may be short. Calling the stack runs the function form of its transform
over it (``_pattern_loop``: one traced body per cycle), which equals the Python loop
``for i in range(length): x = stack.layer(i)(x)``.

A pattern element may be a ``functools.partial`` of a class (``partial(Block,
window=512)``): its arguments go to that position's constructor, before the ones the
stack is built with.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex, overload

import jax
import jax.numpy as jnp

from ..core._errors import TransformError
from ..core._graph import flatten
from ..core._module import Module
from ..core._stacks import is_stacked
from ._class_form import is_module_class, transform_name


def is_pattern(target) -> bool:
  """Whether ``target`` is a tuple of classes (a pattern for a class form)."""
  return isinstance(target, (tuple, list)) and not isinstance(target, Pattern)


def pattern_repr(pattern) -> str:
  """How errors name a pattern: ``(Local, Local, Global)``."""
  if not isinstance(pattern, (tuple, list)):
    return repr(pattern)
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


def is_pattern_stack(module) -> bool:
  return isinstance(module, PatternStack)


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


def _as_index(k) -> int | None:
  """``k`` as a Python int where Python's sequences take it (numpy and JAX integers
  too, as ``operator.index`` does), else None."""
  try:
    return operator.index(k)
  except TypeError:
    return None


class Pattern(tuple):
  """The positions of a pattern stack: ``stack.pattern[k]`` is the stack of position
  ``k`` (a tuple; stored like one in the module graph)."""

  @overload
  def __getitem__(self, k: SupportsIndex) -> Any: ...  # one position's stack
  @overload
  def __getitem__(self, k: slice) -> tuple: ...
  def __getitem__(self, k):
    if not isinstance(k, slice):
      n, index = len(self), _as_index(k)
      if index is None or not -n <= index < n:
        names = ", ".join(type(s)._sr_pattern_name for s in self)
        raise IndexError(
          f"stack.pattern[{k!r}]: the pattern has {n} positions ({names}); use 0..{n - 1} "
          f"(or -{n}..-1). Layer i of the stack is `stack.layer(i)`, at position i % {n}."
        )
      k = index
    return super().__getitem__(k)


class PatternStack(Module):
  """A stack of a repeating pattern of blocks (see the module docstring).

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> class Up(sr.Module):
  ...   def __init__(self, *, rngs):
  ...     self.w = sr.Param(jnp.ones(()) * 2.0)
  ...   def __call__(self, x):
  ...     return x * self.w.value
  >>> class Down(sr.Module):
  ...   def __init__(self, *, rngs):
  ...     self.b = sr.Param(jnp.ones(()))
  ...   def __call__(self, x):
  ...     return x - self.b.value
  >>> stack = sr.remat_scan((Up, Down), length=5, lengths=(3,))(rngs=sr.Rngs(0))
  >>> len(stack), [type(stack.layer(i)).__name__ for i in range(5)]
  (5, ['Up', 'Down', 'Up', 'Down', 'Up'])
  >>> float(stack(jnp.float32(1.0)))  # ((1*2 - 1)*2 - 1)*2
  2.0
  """

  _sr_positions: tuple = ()
  _sr_length: int = 0
  _sr_what: str = ""
  # Set by the class form (pattern_class); declared here for the type checker only.
  _sr_init_in_axes: Any
  _sr_names: tuple[str, ...]

  def __init__(self, *args, **kwargs):
    positions = type(self)._sr_positions
    axes = type(self)._sr_init_in_axes
    # Each position's build advances the RNG streams it draws from: a failure at a
    # later position puts back what the earlier ones drew, so nothing has changed.
    modules = jax.tree.leaves((args, kwargs), is_leaf=lambda x: isinstance(x, Module))
    given = flatten([x for x in modules if isinstance(x, Module)])[1]
    before = [v._value for v in given]
    built = []
    try:
      for k, position in enumerate(positions):
        built.append(position(*_position_args(self, k, args, axes), **kwargs))
    except BaseException as e:
      for var, value in zip(given, before):
        var._value = value
      if isinstance(e, Exception):
        e.add_note(
          f"(while {type(self)._sr_what} built position {k} of its pattern, "
          f"{position._sr_pattern_name}; nothing was built)"
        )
      raise
    self.pattern = Pattern(built)

  @classmethod
  def _sr_from_positions(cls, stacks):
    """A stack of this class holding ``stacks`` (one per position); ``sr.stack``."""
    out = object.__new__(cls)
    out.pattern = Pattern(stacks)
    return out

  def __len__(self) -> int:
    return sum(len(s) for s in self.pattern)

  def layer(self, i: int):
    """Layer ``i`` as an ordinary module: ``stack.pattern[i % P].layer(i // P)``."""
    n, p, index = len(self), len(self.pattern), _as_index(i)
    if index is None or not -n <= index < n:
      raise IndexError(
        f"layer {i!r} of a pattern stack of {n} layers: use 0..{n - 1} (or -{n}..-1)."
      )
    i = index % n
    return self.pattern[i % p].layer(i // p)


def _position_args(stack, k: int, args: tuple, axes) -> tuple:
  """The constructor arguments of position ``k``: those ``init_in_axes`` maps cut to
  the layers ``k, k + P, ...`` along their axis."""
  if axes is None:
    return args
  cls = type(stack)
  n, p = cls._sr_length, len(cls._sr_positions)
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,) * len(args)
  if len(axes) != len(args):
    raise TransformError(
      f"{cls._sr_what}: init_in_axes={axes!r} has {len(axes)} entries for {len(args)} "
      "positional constructor arguments. Fix: one entry (an axis, or None to pass it "
      "whole to every layer) per positional argument."
    )
  out = []
  for j, (arg, axis) in enumerate(zip(args, axes)):
    if axis is None:
      out.append(arg)
      continue
    shape = tuple(jnp.shape(arg))
    if not -len(shape) <= axis < len(shape) or shape[axis] != n:
      raise TransformError(
        f"{cls._sr_what}: init_in_axes maps constructor argument {j} along axis {axis}, "
        f"one slice per layer, so it needs {n} entries there; it has shape {shape}. "
        f"Fix: give it {n} entries at axis {axis}, or None in init_in_axes."
      )
    out.append(jnp.take(arg, jnp.arange(k, n, p), axis=axis))
  return tuple(out)


def pattern_class(
  pattern,
  label: str,
  *,
  length: int | None,
  what: str,
  position_class: Callable[[type, int], type],
  run: Callable[[str], Callable],
  methods: Sequence[str] | None,
  init_in_axes: Any = None,
) -> type:
  """The class form over a pattern: ``{label}Pattern`` of the given classes.

  ``position_class(cls, n)`` makes the stacked class of one position (``n`` layers);
  ``run(name)`` the function that runs method ``name`` of every layer in order (the
  transform's function form, given ``lambda layer, *a: getattr(layer, name)(*a)``).
  """
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
  positions = []
  for k, (cls, factory) in enumerate(found):
    position = position_class(cls, len(range(k, length, p)))
    position._sr_layer_factory = factory
    position._sr_index_map = (p, k)
    position._sr_pattern_name = names[k]
    position.__qualname__ = f"{position.__qualname__}[{k}]"
    positions.append(position)
  methods = (
    ["__call__"] if methods is None else [methods] if isinstance(methods, str) else list(methods)
  )
  namespace: dict[str, Any] = {
    "_sr_positions": tuple(positions),
    "_sr_length": length,
    "_sr_what": what,
    "_sr_init_in_axes": init_in_axes,
    "_sr_names": tuple(names),
    "__module__": found[0][0].__module__,
    "__qualname__": f"{label}Pattern[{', '.join(names)}]",
    "__doc__": (
      f"A stack of {length} layers repeating ({', '.join(names)}) under {transform_name(label)}."
    ),
  }
  for name in methods:
    for cls, _ in found:
      if not callable(getattr(cls, name, None)):
        raise AttributeError(
          f"{what}: {cls.__name__} has no method {name!r}. Name methods that every "
          "class of the pattern defines."
        )
    namespace[name] = _method(run(name), name)
  cls = type(f"{label}Pattern", (PatternStack,), namespace)
  for position in positions:
    position._sr_pattern_parent = cls
  return cls


def _method(run: Callable, name: str) -> Callable:
  def method(self, *args, **kwargs):
    return run(self, *args, **kwargs)

  method.__name__ = name
  return method


def call_method(name: str, owner: str) -> Callable:
  """``f(layer, *args)``: the layer's own method ``name`` (what a class form runs);
  errors name it ``{owner}.{name}``."""

  def call(layer, *args, **kwargs):
    return getattr(layer, name)(*args, **kwargs)

  call.__name__ = name
  call.__qualname__ = f"{owner}.{name}"
  return call


def position_names(stack: PatternStack) -> list[str]:
  return list(type(stack)._sr_names)


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
