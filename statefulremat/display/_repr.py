"""Plain-text reprs: what `repr` falls back to when treescope cannot draw an object,
and which of a module's settings are at their constructor defaults (a repr leaves
those out; treescope's foldable view keeps them, folded)."""

from __future__ import annotations

import collections.abc
import functools
import inspect
import types
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from ..core._bookkeeping import is_bookkeeping
from ..core._caches import init_defaults
from ..core._module import Module
from ..core._stacks import Cycle, _pattern_of, is_stacked, stack_info
from ..core._variables import Variable
from ._pattern_names import pattern_names, position_label
from ._static_repr import static_repr


def value_summary(value) -> str:
  if _is_array(value):
    return f"{value.dtype}[{','.join(map(str, value.shape))}]"
  return repr(value)


def pattern_text(stack) -> str | None:
  """How the layers of a stack of a repeating pattern repeat, or None for any other
  object: ``26 layers: (Local, Local, Global) × 8 + (Local, Local)`` (the last cycle
  cut short). Read off the positions it holds, so an edited stack says what it holds.
  A run of one element is written once with its count, and long elements by short
  labels that ``pattern_names(stack).legend`` spells out: ``12 layers: (Block#1 × 5,
  Block#2) × 2`` (see ``_pattern_names``).

  >>> import functools, statefulremat as sr
  >>> Stack = sr.vmap((sr.nn.Linear, functools.partial(sr.nn.Linear, use_bias=False)),
  ...                 axis_size=5)
  >>> stack = Stack(3, 3, rngs=sr.Rngs(0))
  >>> pattern_text(stack)
  '5 layers: (Linear, partial(Linear, use_bias=False)) × 2 + (Linear)'
  >>> position_text(stack.pattern[1])
  'position 1 of 2: partial(Linear, use_bias=False), 2 layers (1, 3)'
  """
  cls, positions = _pattern_of(stack), getattr(stack, "pattern", None)
  if cls is None or not isinstance(positions, tuple) or not positions:
    return None
  counts = [n for n in map(_layer_count, positions) if n is not None]
  if len(counts) != len(positions):
    return None
  names, n, p = pattern_names(cls), sum(counts), len(counts)
  full, rest = divmod(n, p)
  if counts != [len(range(k, n, p)) for k in range(p)]:
    return f"{layers_text(n)}, not one pattern: its positions hold {counts}"
  text = f"{layers_text(n)}: ({names.cycle()}) × {full}"
  return text + (f" + ({names.cycle(rest)})" if rest else "")


def layers_text(n: int) -> str:
  """``1 layer``, ``3 layers``."""
  return f"{n} layer{'s' * (n != 1)}"


def class_text(cls: type) -> str:
  """How a class is named on screen: a stack's class (made by a transform's class
  form) as the transform over the user's class, ``RematScan[Block]`` (the generated
  ``RematScanBlock`` is named after neither); a pattern stack's over its classes,
  ``RematScan[Local, Local, Global]`` (``RematScan[Block#1 × 5, Block#2]``: long
  elements by labels, see ``pattern_text``); a stack of stacks nests, with the inner
  stack's layer count where its class knows it, ``Vmap[Scan[Block] × 12]``; any other
  class by its name.

  >>> import statefulremat as sr
  >>> from statefulremat.display._repr import class_text
  >>> class_text(sr.vmap(sr.nn.Linear, axis_size=3)), class_text(sr.nn.Linear)
  ('Vmap[Linear]', 'Linear')
  """
  info = stack_info(cls)
  if info is None:
    return cls.__name__
  if isinstance(info.unit, Cycle):  # a pattern stack: the transform over its classes
    return f"{info.form.value}[{pattern_names(cls).cycle()}]"
  of = class_text(info.unit.cls)
  inner = stack_info(info.unit.cls)
  if inner is not None and inner.length is not None:  # a stack of stacks
    of = f"{of} × {inner.length}"
  return f"{info.form.value}[{of}]"


def module_text(module) -> str:
  """``class_text`` of ``module``'s class, with a stack's layer count:
  ``RematScan[Block] × 100``. A pattern stack's count is in its ``pattern_text``.

  >>> import statefulremat as sr
  >>> from statefulremat.display._repr import module_text
  >>> module_text(sr.vmap(sr.nn.Linear, axis_size=3)(2, 2, rngs=sr.Rngs(0)))
  'Vmap[Linear] × 3'
  """
  name, n = class_text(type(module)), _layer_count(module)
  return name if n is None else f"{name} × {n}"


def position_text(position) -> str | None:
  """For the stack of position ``k`` of a pattern stack, which layers of the whole
  stack it holds: ``position 2 of 3: Global, 8 layers (2, 5, …, 23)``; None for any
  other object."""
  info = stack_info(position) if isinstance(position, Module) else None
  name = position_label(type(position)) if info is not None else None
  n = _layer_count(position) if name is not None else None
  if info is None or name is None or n is None:
    return None
  p, k = info.index_map
  return f"position {k} of {p}: {name}, {layers_text(n)} ({layer_numbers(range(k, k + p * n, p))})"


def _layer_count(position) -> int | None:
  if not is_stacked(position):
    return None
  try:
    return len(position)
  except Exception:  # a display never raises: a stack with no stacked Variable, deleted arrays
    return None


def layer_numbers(layers: range) -> str:
  """``0, 3, 6`` or, past four, ``0, 3, …, 24``."""
  if len(layers) <= 4:
    return ", ".join(map(str, layers))
  return f"{layers[0]}, {layers[1]}, …, {layers[-1]}"


def variable_repr(var) -> str:
  parts = [value_summary(var._value)]
  parts += [f"{k}={static_repr(v)}" for k, v in var._metadata.items()]
  return f"{type(var).__name__}({', '.join(parts)})"


def split_settings(module) -> tuple[dict[str, Any], dict[str, Any]]:
  """``module``'s own attributes (its bookkeeping left out) in definition order, in
  two parts: those a repr shows, and its settings at their defaults (the rest)."""
  hidden = set(settings_at_defaults(module))
  own = {k: v for k, v in vars(module).items() if not is_bookkeeping(k)}
  shown = {k: v for k, v in own.items() if k not in hidden}
  return shown, {k: v for k, v in own.items() if k in hidden}


_NO_DEFAULT = inspect.Parameter.empty


def constructor_defaults(cls: type) -> dict[str, Any]:
  """``{name: default}`` for each parameter of ``cls.__init__`` that has a default.

  An ``__init__`` taking ``*args`` or ``**kwargs`` (the class forms of the transforms
  pass them on to the layer class) adds the defaults of the bases' ``__init__``; the
  most derived class's default wins.

  >>> import statefulremat as sr
  >>> from statefulremat.display._repr import constructor_defaults
  >>> d = constructor_defaults(sr.nn.Dropout)
  >>> d["deterministic"], d["rng_collection"], "rate" in d
  (False, 'dropout', False)
  """
  cached = init_defaults.get(cls)
  if cached is not None:
    return cached
  defaults: dict[str, Any] = {}
  for base in cls.__mro__:
    init = base.__dict__.get("__init__")
    if init is None or base is object:
      continue
    try:
      params = inspect.signature(init).parameters.values()
    except (TypeError, ValueError):  # a builtin or C __init__: no defaults to read
      break
    for p in params:
      if p.default is not _NO_DEFAULT and p.kind is not p.POSITIONAL_ONLY:
        defaults.setdefault(p.name, p.default)
    if not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
      break  # this __init__ takes no more: the bases' defaults are not its own
  init_defaults[cls] = defaults
  return defaults


def settings_at_defaults(module) -> list[str]:
  """The names of ``module``'s attributes a repr leaves out: settings at their
  constructor defaults, and empty slots.

  An attribute is left out when its value is the default of the constructor argument
  of the same name (``precision=None``, ``dot_general=jax.lax.dot_general``,
  ``param_dtype=jnp.float32``; see ``same_setting`` for what counts as the same), or
  when it is ``None`` and the constructor gives no other default (a cache not made
  yet, a norm left out). Sub-modules and Variables are always shown.

  >>> import statefulremat as sr
  >>> from statefulremat.display._repr import settings_at_defaults
  >>> settings_at_defaults(sr.nn.Dropout(0.1))
  ['broadcast_dims', 'deterministic', 'rng_collection', 'rngs']
  >>> settings_at_defaults(sr.nn.Dropout(0.1, deterministic=True))
  ['broadcast_dims', 'rng_collection', 'rngs']
  """
  defaults = constructor_defaults(type(module))
  hidden = []
  for name, value in vars(module).items():
    if is_bookkeeping(name) or isinstance(value, (Module, Variable)):
      continue
    default = defaults.get(name, None)
    if (value is None and default is None) or (name in defaults and same_setting(value, default)):
      hidden.append(name)
  return hidden


def same_setting(value, default) -> bool:
  """Whether ``value`` is the setting ``default`` names.

  The same object; equal values of the same type (``True`` is not ``1``); the same
  dtype however written (``jnp.float32``, ``np.dtype("float32")``, ``"float32"``);
  arrays of equal shape, dtype and values; ``functools.partial`` of the same function
  and arguments; and two normal forms constructors apply: an axis ``-1`` stored as
  ``(-1,)``, an empty mapping stored as ``()``. Functions compare by identity, and
  anything whose comparison fails or is not a plain bool (a tracer) is not the same.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from statefulremat.display._repr import same_setting
  >>> same_setting(jax.lax.dot_general, jax.lax.dot_general), same_setting(1, True)
  (True, False)
  >>> same_setting(np.dtype("float32"), jnp.float32), same_setting((-1,), -1)
  (True, True)
  >>> same_setting(jnp.zeros(2), jnp.zeros(2)), same_setting(jnp.zeros(2), jnp.ones(2))
  (True, False)
  """
  if value is default:
    return True
  if _is_array(value) or _is_array(default):
    return _same_array(value, default)
  if _is_dtype(default) and (_is_dtype(value) or isinstance(value, str)):
    try:
      return np.dtype(value) == np.dtype(default)
    except TypeError:  # a string that names no dtype
      return False
  if isinstance(value, functools.partial) and isinstance(default, functools.partial):
    return (
      same_setting(value.func, default.func)
      and _same_items(value.args, default.args)
      and _same_items(value.keywords, default.keywords)
    )
  if isinstance(value, types.MethodType) and isinstance(default, types.MethodType):
    return value.__func__ is default.__func__ and value.__self__ is default.__self__
  if callable(value) or callable(default):
    return False  # functions and classes: only the same object is the same
  if type(value) is not type(default):
    if isinstance(value, tuple) and len(value) == 1 and not isinstance(default, (tuple, list, str)):
      return same_setting(value[0], default)  # an axis -1 kept as (-1,)
    return _is_empty(value) and _is_empty(default)  # {} kept as ()
  return _equal(value, default)


def _same_items(a, b) -> bool:
  if isinstance(a, dict):
    return isinstance(b, dict) and a.keys() == b.keys() and all(same_setting(a[k], b[k]) for k in a)
  return len(a) == len(b) and all(same_setting(x, y) for x, y in zip(a, b))


def _equal(a, b) -> bool:
  try:
    eq = a == b
  except Exception:  # e.g. tuples of arrays: "the truth value ... is ambiguous"
    return False
  return bool(eq) if isinstance(eq, (bool, np.bool_)) else False


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def _same_array(a, b) -> bool:
  if not (_is_array(a) and _is_array(b)) or isinstance(a, Tracer) or isinstance(b, Tracer):
    return False
  if np.shape(a) != np.shape(b) or np.dtype(a.dtype) != np.dtype(b.dtype):
    return False
  try:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))
  except Exception:  # a deleted buffer, an array spread over processes
    return False


def _is_dtype(x) -> bool:
  if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
    return True
  # jnp.float32 & co.: scalar types that carry a dtype, with no shape of their own.
  return isinstance(getattr(x, "dtype", None), np.dtype) and not hasattr(x, "shape")


def _is_empty(x) -> bool:
  return (
    isinstance(x, (collections.abc.Sequence, collections.abc.Mapping))
    and not isinstance(x, (str, bytes))
    and len(x) == 0
  )


def module_repr(module, indent: int = 0, seen=None) -> str:
  seen = set() if seen is None else seen
  if id(module) in seen:
    return f"{type(module).__name__}(...)"
  seen.add(id(module))
  pad = "  " * (indent + 1)

  def show(value, depth):
    if isinstance(value, Module):
      return module_repr(value, depth + 1, seen)
    if isinstance(value, Variable):
      return variable_repr(value)
    if isinstance(value, (list, tuple, dict)) and value:
      if isinstance(value, dict):
        items = [f"{k!r}: {show(v, depth + 1)}" for k, v in value.items()]
      else:
        items = [show(v, depth + 1) for v in value]
      inner = ",\n".join("  " * (depth + 2) + item for item in items)
      brackets = "{}" if isinstance(value, dict) else "[]" if isinstance(value, list) else "()"
      return f"{brackets[0]}\n{inner}\n{'  ' * (depth + 1)}{brackets[1]}"
    return static_repr(value)

  shown, _ = split_settings(module)
  if not shown:
    return f"{type(module).__name__}()"
  body = ",\n".join(f"{pad}{k}={show(v, indent)}" for k, v in shown.items())
  return f"{type(module).__name__}(\n{body}\n{'  ' * indent})"
