"""The exceptions statefulremat raises, so users can catch them by kind.

Every message says what was wrong, where (a variable or attribute path such as
``layers[3].linear.kernel``) and how to fix it.
"""

from __future__ import annotations


class StatefulRematError(Exception):
  """Base class of every error statefulremat raises on purpose."""


class TraceContextError(StatefulRematError):
  """A traced value crossed into a Variable that belongs to another trace."""


class GraphError(StatefulRematError, TypeError):
  """A module graph cannot be split, merged, or changed the way it was asked."""


class StateMismatchError(StatefulRematError, ValueError):
  """A State does not fit the module (or the other State) it is combined with."""


def format_path(path: tuple) -> str:
  """Formats a graph path as Python would reach it: ``('layers', 0, 'kernel')`` -> ``layers[0].kernel``."""
  out = []
  for key in path:
    if isinstance(key, str) and key.isidentifier():
      out.append(f".{key}" if out else key)
    else:
      out.append(f"[{key!r}]")
  return "".join(out) or "<root>"
