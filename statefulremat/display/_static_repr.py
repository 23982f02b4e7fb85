"""How a static attribute is written on screen: by name, never by memory address."""

from __future__ import annotations

import functools


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
