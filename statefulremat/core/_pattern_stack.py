"""Stacks of a repeating pattern: one stack per position of a cycle of classes.

A pattern stack (``sr.scan((Local, Local, Global), length=26, ...)``, likewise
``sr.remat_scan`` and ``sr.vmap``) holds one ordinary stack per position of the
pattern, ``stack.pattern[k]``: the layers ``k, k + P, k + 2P, ...`` (P the pattern's
length) of the class ``pattern[k]``, in order. Layer ``i`` is an instance of
``pattern[i % P]``: ``stack.layer(i)`` is ``stack.pattern[i % P].layer(i // P)``; the
last cycle may be short. It is data: its class's ``StackInfo`` lists the stacked class
of each position; the transform that made the class runs it (one traced body per
cycle), which equals the Python loop ``for i in range(length): x = stack.layer(i)(x)``.
"""

from __future__ import annotations

import operator
from typing import Any, SupportsIndex, overload

import jax
import jax.numpy as jnp

from ._graph import flatten
from ._module import Module
from ._stacks import check_init_leaf, cycle_unit, init_axes, not_subscriptable, stack_info


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
        names = ", ".join(_place_name(s) for s in self)
        raise IndexError(
          f"stack.pattern[{k!r}]: the pattern has {n} positions ({names}); use 0..{n - 1} "
          f"(or -{n}..-1). Layer i of the stack is `stack.layer(i)`, at position i % {n}."
        )
      k = index
    return super().__getitem__(k)

  def __reduce__(self):
    # Pickled as a plain tuple, naming no private class; PatternStack.__setstate__
    # makes it a Pattern again.
    return tuple, (tuple(self),)


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

  def __init__(self, *args, **kwargs):
    info = stack_info(self)
    unit = cycle_unit(self)
    if info is None or unit is None:
      raise TypeError(
        f"{type(self).__name__} is a PatternStack without a pattern. Build pattern "
        "stacks with a class form, e.g. `sr.scan((A, B), length=n, ...)`."
      )
    # Each position's build advances the RNG streams it draws from: a failure at a
    # later position puts back what the earlier ones drew, so nothing has changed.
    modules = jax.tree.leaves((args, kwargs), is_leaf=lambda x: isinstance(x, Module))
    given = flatten([x for x in modules if isinstance(x, Module)])[1]
    before = [v._value for v in given]
    built = []
    try:
      for k, position in enumerate(unit.positions):
        built.append(position(*_position_args(info, k, args), **kwargs))
    except BaseException as e:
      for var, value in zip(given, before):
        var._value = value
      if isinstance(e, Exception):
        e.add_note(
          f"(while {info.what} built position {k} of its pattern, "
          f"{unit.names[k]}; nothing was built)"
        )
      raise
    self.pattern = Pattern(built)

  def __len__(self) -> int:
    return sum(len(s) for s in self.pattern)

  def __setstate__(self, state):
    if isinstance(state.get("pattern"), tuple):
      state = {**state, "pattern": Pattern(state["pattern"])}
    super().__setstate__(state)

  def __getattr__(self, name: str):
    # Only for names not found: a sub-module of the blocks lives in their positions.
    pattern = vars(self).get("pattern")
    if name.startswith("_") or pattern is None:
      raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    having = [k for k, position in enumerate(pattern) if hasattr(position, name)]
    where = (
      f"position{'s' * (len(having) > 1)} {', '.join(map(str, having))} of "
      f"{len(pattern)} ha{'ve' if len(having) > 1 else 's'} it: "
      f"`stack.pattern[{having[0]}].{name}`"
      if having
      else "no position has it either"
    )
    raise AttributeError(
      f"{type(self).__name__!r} object has no attribute {name!r}: a pattern stack holds "
      f"its layers by position, one stack per position in `stack.pattern`, and {where} "
      f"(layer i is `stack.layer(i)`)."
    )

  def __getitem__(self, i):
    not_subscriptable(self, i)

  def layer(self, i: int):
    """Layer ``i`` as an ordinary module: ``stack.pattern[i % P].layer(i // P)``."""
    n, p, index = len(self), len(self.pattern), _as_index(i)
    if index is None or not -n <= index < n:
      raise IndexError(
        f"layer {i!r} of a pattern stack of {n} layers: use 0..{n - 1} (or -{n}..-1)."
      )
    i = index % n
    return self.pattern[i % p].layer(i // p)


def _place_name(position) -> str:
  info = stack_info(position)
  return "?" if info is None or info.place is None else info.place.name


def _position_args(info, k: int, args: tuple) -> tuple:
  """The constructor arguments of position ``k`` of the pattern stack class whose
  ``StackInfo`` is ``info``: those ``init_in_axes`` maps cut to the layers ``k, k + P,
  ...`` along their axis."""
  axes, n, p, what = info.init_in_axes, info.length, len(info.unit.positions), info.what
  if axes is None:
    return args
  out = []
  for j, (arg, axis) in enumerate(zip(args, init_axes(what, axes, args))):
    if axis is not None:  # this position's layers only
      check_init_leaf(what, j, axis, tuple(jnp.shape(arg)), n)
      arg = jnp.take(arg, jnp.arange(k, n, p), axis=axis)
    out.append(arg)
  return tuple(out)


def from_positions(cls: type, stacks) -> PatternStack:
  """A pattern stack of class ``cls`` holding ``stacks`` (one per position); ``sr.stack``."""
  out = object.__new__(cls)
  out.pattern = Pattern(stacks)
  return out
