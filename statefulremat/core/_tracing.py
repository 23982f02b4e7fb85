"""Traces: which JAX trace a Variable belongs to, and which user code is being traced.

A Variable remembers the JAX trace it was made in (``current_trace``) and a serial
number (``next(serials)``). While statefulremat traces a user's function (``sr.jit``,
``sr.grad``, a transform's body; ``tracing_user_code``), a Variable made before the
outermost such trace began cannot be one the transform lifted (those are rebuilt
inside): it was reached by closure, and its concrete value would be baked into the
compiled function as a constant, stale after the next update. ``guard`` says what is
being traced, so reading such a Variable can raise. ``structure_changed`` notes a
change to a graph's structure, so cached flattenings know when to look again.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.core
import numpy as np

from ._bookkeeping import VERSION
from ._caches import serials, structure_epoch

try:
  # No public API but this one says which trace is current; jax.extend.core has it from
  # jax 0.10 (before, it lived in jax.core, whose copy now warns it is deprecated).
  from jax.extend.core import get_opaque_trace_state
except ImportError as e:
  raise ImportError(
    f"statefulremat needs jax >= 0.10.2 (the floor pyproject.toml declares), and jax "
    f"{jax.__version__} is installed: jax.extend.core.get_opaque_trace_state is missing. "
    f"Fix: pip install 'jax>=0.10.2' 'jaxlib>=0.10.2'."
  ) from e

_Tracer = jax.core.Tracer


def structure_changed(node) -> None:
  """Notes that ``node`` (a module or a tracked container) changed its structure.

  The node's own version moves on (its ``VERSION`` note): a graph's structure version
  is its nodes' versions and its Variables' metadata (``_graph_cache.Stamp``). The
  process-wide ``structure_epoch`` moves on too; it only says whether anything changed
  anywhere, so that while nothing did, a cached walk is trusted without a look.
  """
  object.__setattr__(node, VERSION, getattr(node, VERSION, 0) + 1)
  structure_epoch.value += 1


def current_trace():
  return get_opaque_trace_state(convention="statefulremat")


class _ClosureGuard(threading.local):
  """The outermost user-code trace in progress: its depth, first serial and name.

  Per thread: another thread's trace must not make this thread's reads look like
  closures (no ``__slots__``: slots would be shared by all threads)."""

  def __init__(self):
    self.depth, self.start, self.what = 0, 0, ""


guard = _ClosureGuard()


@contextlib.contextmanager
def tracing_user_code(what: str):
  """Marks the trace of a user's function by ``what`` (e.g. ``sr.jit(step)``).

  Used only while tracing, so it costs nothing on a compiled call.
  """
  if guard.depth == 0:  # the outermost trace
    guard.start, guard.what = next(serials), what
  guard.depth += 1
  try:
    yield
  finally:
    guard.depth -= 1


def contains_tracer(value) -> bool:
  if isinstance(value, _Tracer):
    return True
  if isinstance(value, (jax.Array, np.ndarray, int, float, complex, bool)):
    return False
  return any(isinstance(leaf, _Tracer) for leaf in jax.tree.leaves(value))
