"""The list of problems a mapping collects before it writes anything, raised as one
``StateMismatchError``."""

from __future__ import annotations

from collections.abc import Callable

from ..core._errors import StateMismatchError

_SHOWN = 10


class Problems:
  """Collects what does not fit, then raises one StateMismatchError naming all of it."""

  def __init__(self, what: str, unchanged: str):
    self.what = what
    self.unchanged = unchanged
    self.lines: list[str] = []
    self.fixes: list[str] = []
    self.count = 0  # variables: a line may sum up many

  def add(self, line: str, fix: str | None = None, count: int = 1) -> None:
    self.lines.append(line)
    self.count += count
    if fix and fix not in self.fixes:
      self.fixes.append(fix)

  def raise_if_any(self) -> None:
    if not self.lines:
      return
    if len(self.lines) == 1 and self.count == 1:
      text = f"{self.what}: {self.lines[0]}"
    else:
      shown = "\n".join(f"  - {line}" for line in self.lines[:_SHOWN])
      more = len(self.lines) - _SHOWN
      text = f"{self.what}: {self.count} variables do not map:\n{shown}" + (
        f"\n  ... and {more} more" if more > 0 else ""
      )
    fixes = "".join(f"\nFix: {fix}" for fix in self.fixes)
    raise StateMismatchError(f"{text}{fixes}\nNothing was written: {self.unchanged}.")


def array_str(value) -> str:
  """``float32[4, 8]`` for an array, the type name for anything else."""
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is None or dtype is None:
    return type(value).__name__
  return f"{dtype}[{', '.join(str(n) for n in shape)}]"


def where_str(entries, shown: int = 3) -> str:
  """The first few entries' places, ``a.kernel, a.bias, b.kernel, ...``."""
  more = ", ..." if len(entries) > shown else ""
  return ", ".join(e.where() for e in entries[:shown]) + more


def has_no(flat: dict[tuple, object], path: tuple, show: Callable[[tuple], str]) -> str:
  """``has no `a.b.c` (`a` has: x, y).``: ``path`` is missing from ``flat``; its longest
  prefix with entries below it, and their next keys."""
  n, below = len(path), set()
  while n > 0 and not below:
    n -= 1
    below = {p[n] for p in flat if len(p) > n and p[:n] == path[:n]}
  return f"has no `{show(path)}` (`{show(path[:n])}` has: {keys_str(below)})."


def keys_str(keys) -> str:
  keys = sorted(str(k) for k in keys)
  if len(keys) > 8:
    keys = keys[:8] + [f"... {len(keys) - 8} more"]
  return ", ".join(keys) if keys else "nothing"
