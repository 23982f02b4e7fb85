"""Plain-text reprs: what `repr` falls back to when treescope cannot draw an object."""

from __future__ import annotations

import functools

import jax
import numpy as np


def value_summary(value) -> str:
  if isinstance(value, (jax.Array, np.ndarray)) or hasattr(value, "aval"):
    dtype = str(value.dtype)
    return f"{dtype}[{','.join(map(str, value.shape))}]"
  return repr(value)


def static_repr(value) -> str:
  """A static attribute as it would be written: functions and classes by name, and
  never a memory address (``<function f at 0x...>`` changes from run to run)."""
  if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
    # Classes, functions and wrapped functions (jax.nn.relu is a custom_jvp object).
    return value.__qualname__
  if isinstance(value, functools.partial):
    return f"partial({static_repr(value.func)}, ...)"
  text = repr(value)
  return f"<{type(value).__name__}>" if " at 0x" in text else text


def variable_repr(var) -> str:
  parts = [value_summary(var._value)]
  parts += [f"{k}={static_repr(v)}" for k, v in var._metadata.items()]
  return f"{type(var).__name__}({', '.join(parts)})"


def module_repr(module, indent: int = 0, seen=None) -> str:
  from ._module import Module
  from ._variables import Variable

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
    if isinstance(value, (list, tuple)) and value:
      inner = ",\n".join("  " * (depth + 2) + show(v, depth + 1) for v in value)
      open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
      return f"{open_}\n{inner}\n{'  ' * (depth + 1)}{close}"
    if isinstance(value, dict) and value:
      inner = ",\n".join(
          f"{'  ' * (depth + 2)}{k!r}: {show(v, depth + 1)}" for k, v in value.items()
      )
      return f"{{\n{inner}\n{'  ' * (depth + 1)}}}"
    return static_repr(value)

  attrs = [(k, v) for k, v in vars(module).items() if not k.startswith("_sr_")]
  if not attrs:
    return f"{type(module).__name__}()"
  body = ",\n".join(f"{pad}{k}={show(v, indent)}" for k, v in attrs)
  return f"{type(module).__name__}(\n{body}\n{'  ' * indent})"
