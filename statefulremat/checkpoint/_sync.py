"""Checkpoints across processes and in the background: who writes what, and when.

In a multi-process run (``jax.distributed.initialize``) every process calls
``sr.save`` / ``sr.restore`` with the same path, in the same order, as JAX's
multi-controller model has every process run the same program. Orbax writes each
process's shards and coordinates its own part (a temporary directory, renamed once
every process has written). Around it the primary process (index 0) alone creates the
new version directory, writes ``variables.json`` and flips the pointer, and two
barriers keep the others in step::

  every process checks the path -> the primary creates sr-<n> -> barrier
  -> every process writes sr-<n>/state (orbax)
  -> the primary writes variables.json and flips the pointer -> barrier -> return

No process returns before the checkpoint is committed, and none writes into a
directory that does not exist yet (a save in two processes used to hang there: each
process picked its own version and orbax waited for the primary's).

A save with ``blocking=False`` returns once orbax has copied the arrays to host
memory, so the model may change at once; writing and committing go on in a thread
(``SaveHandle``). Saves and restores of one path in one process run in order: each
first waits for that path's earlier background saves, and raises the error of one
that failed and nobody has seen, so a failed background save is never silent.

Saves of one path from other threads or processes wait for the path's lock
(``_locks.SaveLock``), which the primary process holds from choosing the
version to its commit or abandon; a background save takes it before returning and
its thread releases it. Only the primary takes it: the others would wait for it at
the barrier the primary can pass only by reaching them.
"""

from __future__ import annotations

import atexit
import sys
import threading
import zlib
from collections.abc import Callable

import jax

from ..core._caches import pending_saves, pending_saves_lock, save_numbers
from ._files import CheckpointError, abandon, begin, current, newest


def is_primary() -> bool:
  return jax.process_index() == 0


class Saves:
  """The saves of one path in this process: a sequence number (identical in every
  process, since each runs the same saves in the same order) names its barriers."""

  def __init__(self, root: str):
    self.root = root
    self._lock = None  # the path's SaveLock, in the primary process from begin()
    with pending_saves_lock:
      self.seq = save_numbers[root] = save_numbers.get(root, 0) + 1

  def barrier(self, stage: str) -> None:
    if jax.process_count() == 1:
      return
    from orbax.checkpoint import multihost

    # Barrier names must be unique and equal across processes: the path (hashed, as
    # keys of the coordination service are best short) and this save's number.
    multihost.sync_global_processes(
      f"statefulremat.save.{zlib.crc32(self.root.encode()):08x}.{self.seq}.{stage}"
    )

  def begin(self) -> str:
    """The new version's directory, the same in every process; the primary holds the
    path's lock from now until ``end``."""
    current(self.root, "save")  # every process refuses a foreign path by itself
    version = None
    if is_primary():
      version, self._lock = begin(self.root)
    try:
      self.barrier("begun")
    except BaseException:
      if version is not None:
        abandon(self.root, version)
      self.end()
      raise
    return version if version is not None else newest(self.root)

  def end(self) -> None:
    """Releases the path's lock, if this process holds it (again: does nothing)."""
    if self._lock is not None:
      self._lock.release()


class SaveHandle:
  """An ``sr.save(path, model, blocking=False)`` still writing: ``wait()`` blocks until
  the checkpoint is committed (and raises what the save raised).

  ``sr.save`` makes it; there is no need to build one.

  Args:
    path: the checkpoint directory being written.
    finish: writes and commits the checkpoint; run at once on a background thread.

  >>> import os, tempfile, statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> with tempfile.TemporaryDirectory() as tmp:
  ...   handle = sr.save(os.path.join(tmp, "ckpt"), model, blocking=False)
  ...   model.bias.value = model.bias.value + 1   # does not change what is saved
  ...   handle.wait()
  ...   handle.done()
  True
  """

  def __init__(self, path: str, finish: Callable[[], None]):
    self.path = path
    self._error: BaseException | None = None
    self._seen = False
    self._thread = threading.Thread(
      target=self._run, args=(finish,), daemon=False, name=f"sr.save({path!r})"
    )
    self._thread.start()
    with pending_saves_lock:
      pending_saves.setdefault(path, []).append(self)

  def _run(self, finish) -> None:
    try:
      finish()
    except BaseException as e:  # kept for wait(); a KeyboardInterrupt cannot land here
      self._error = e

  def done(self) -> bool:
    """Whether the save has finished (committed, or failed)."""
    return not self._thread.is_alive()

  def wait(self, timeout: float | None = None) -> None:
    """Blocks until the checkpoint is committed; re-raises the save's error.

    ``timeout`` (seconds): raises ``TimeoutError`` if the save is still writing then.
    """
    self._thread.join(timeout)
    if self._thread.is_alive():
      raise TimeoutError(f"sr.save of {self.path!r} is still writing after {timeout} s.")
    self._seen = True
    if self._error is not None:
      raise self._error

  def __repr__(self):
    state = "writing" if not self.done() else "failed" if self._error is not None else "committed"
    return f"SaveHandle({self.path!r}, {state})"


def wait_previous(root: str, fn: str) -> None:
  """Waits for ``root``'s background saves, if any; raises the error of one that
  failed unseen (the others' are raised by the next calls)."""
  with pending_saves_lock:
    handles = pending_saves.pop(root, [])
  for handle in handles:
    handle._thread.join()
  failed = [h for h in handles if h._error is not None and not h._seen]
  if failed:
    handle = failed[0]
    if failed[1:]:
      with pending_saves_lock:
        pending_saves[root] = failed[1:] + pending_saves.get(root, [])
    handle._seen = True
    raise CheckpointError(
      f"sr.{fn}: the earlier sr.save({root!r}, ..., blocking=False) failed "
      f"({type(handle._error).__name__}: {handle._error}); the checkpoint there is "
      "the one before it. Nothing was done now. Fix: call this again (the error is "
      "reported once), and call `.wait()` on a background save's handle to see its "
      "errors where they happen."
    ) from handle._error


@atexit.register
def _report_unseen_failures() -> None:
  # Threads are joined before atexit runs: every background save has ended by now.
  for handle in [h for handles in list(pending_saves.values()) for h in handles]:
    if handle._error is not None and not handle._seen:
      print(
        f"statefulremat: sr.save({handle.path!r}, ..., blocking=False) failed and "
        f"was never waited on: {type(handle._error).__name__}: {handle._error}",
        file=sys.stderr,
      )
