"""One lock per module graph, so two threads stepping one model take turns.

A call such as ``sr.jit(step)(model, x)`` reads the model's values, computes, and
writes the new values back. Two threads doing that at once on one model would both
read the same values, and the second write-back would replace the first: a step lost
without an error. So the outermost statefulremat call on a thread (a transform,
``Optimizer.update``, ``sr.update``, ``sr.clone``) holds the lock of the graph it
reads from the read to the write-back, and another thread's call on that graph waits.
Calls nested in it (a transform inside a traced function, ``sr.update`` inside
``Optimizer.update``) take no lock: the outer call holds it, so nesting cannot
deadlock.

A graph here is a group of Variables that calls have reached together. A call that
reaches Variables of two groups (an Optimizer holding a model stepped on its own
before) merges them, once neither is in use. Models that share no Variable keep
separate locks, so two threads working on two models do not wait for each other.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from ._caches import lock_groups, lock_ranks, lock_registry


class _Group:
  """One graph's lock; ``into`` is the group it was merged into (None while current)."""

  __slots__ = ("lock", "into", "rank")

  def __init__(self):
    self.lock = threading.Lock()
    self.into: _Group | None = None
    self.rank = next(lock_ranks)  # locks of several groups are taken in this order


def _current(group: _Group) -> _Group:
  while group.into is not None:
    group = group.into
  return group


# id(Variable) -> (weak reference, group). Keyed by id: Variables are unhashable. The
# reference's callback drops the entry when the Variable goes; it runs before the id
# can be reused, and takes no lock (it may run on a thread inside `_group_of`).


def _forget(key: int, ref) -> None:
  entry = lock_groups.get(key)
  if entry is not None and entry[0] is ref:
    lock_groups.pop(key, None)


class _Thread(threading.local):
  holding = False  # this thread's outermost call holds a graph lock


_thread = _Thread()


class Reached(list):
  """A call's Variables, remembering their group (a cached flattening keeps both)."""

  __slots__ = ("group",)

  def __init__(self, variables=()):
    super().__init__(variables)
    self.group: _Group | None = None


def _group_of(variables: Sequence) -> _Group:
  """The group of ``variables``: theirs, a new one, or theirs merged into one."""
  with lock_registry:
    found: dict[int, _Group] = {}
    new = []
    for var in variables:
      entry = lock_groups.get(id(var))
      if entry is None or entry[0]() is not var:
        new.append(var)
      else:
        group = _current(entry[1])
        found[group.rank] = group
    group = found.pop(min(found)) if found else _Group()
    for other in found.values():
      # Wait until no call runs on it, then send later ones to `group`: a call that
      # reaches Variables of both must not overlap one still using the old lock.
      # (A call holding a graph lock never asks the registry, so this cannot cycle.)
      with other.lock:
        other.into = group
    for var in new:
      key = id(var)
      lock_groups[key] = (weakref.ref(var, lambda ref, key=key: _forget(key, ref)), group)
    return group


def holding() -> bool:
  """Whether a call on this thread holds a graph lock (a nested call takes none)."""
  return _thread.holding


def hold(variables: Sequence):
  """Locks the graph of ``variables`` for this thread's outermost call; ``None`` when
  the thread already holds one. Give the result to ``let_go`` in a ``finally``."""
  if _thread.holding:
    return None
  group = variables.group if type(variables) is Reached else None
  if group is None or group.into is not None:  # the common call skips this: one cached group
    group = _current(group if group is not None else _group_of(variables))
    if type(variables) is Reached:
      variables.group = group
  while True:
    group.lock.acquire()
    if group.into is None:
      _thread.holding = True
      return group
    group.lock.release()  # merged into another group meanwhile: take that one
    group = _current(group)


def let_go(held: _Group | None) -> None:
  """Releases what ``hold`` took."""
  if held is not None:
    _thread.holding = False
    held.lock.release()


class locked:
  """``with locked(variables):`` a call's read-to-write-back under the lock of their
  graph, for this thread's outermost call (a nested one takes none). The one way the
  package takes a graph lock; ``sr.jit``'s dispatch spells the same two calls out."""

  __slots__ = ("variables", "group")

  def __init__(self, variables: Sequence):
    self.variables = variables

  def __enter__(self):
    self.group = hold(self.variables)

  def __exit__(self, kind, error, traceback):
    let_go(self.group)
    return False
