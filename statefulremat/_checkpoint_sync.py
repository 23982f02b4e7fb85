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
first waits for that path's previous background save, and raises its error if it
failed and nobody has seen it, so a failed background save is never silent.
"""

from __future__ import annotations

import atexit
import sys
import threading
import zlib
from typing import Callable

import jax

from ._checkpoint_files import CheckpointError, begin, current, newest


def is_primary() -> bool:
  return jax.process_index() == 0


class Saves:
  """The saves of one path in this process: a sequence number (identical in every
  process, since each runs the same saves in the same order) names its barriers."""

  _count: dict[str, int] = {}

  def __init__(self, root: str):
    self.root = root
    self.seq = Saves._count[root] = Saves._count.get(root, 0) + 1

  def barrier(self, stage: str) -> None:
    if jax.process_count() == 1:
      return
    from orbax.checkpoint import multihost

    # Barrier names must be unique and equal across processes: the path (hashed, as
    # keys of the coordination service are best short) and this save's number.
    multihost.sync_global_processes(
        f"statefulremat.save.{zlib.crc32(self.root.encode()):08x}.{self.seq}.{stage}")

  def begin(self) -> str:
    """The new version's directory, the same in every process."""
    current(self.root, "save")  # every process refuses a foreign path by itself
    version = begin(self.root) if is_primary() else None
    self.barrier("begun")
    return version if version is not None else newest(self.root)


class SaveHandle:
  """An ``sr.save(path, model, blocking=False)`` still writing: ``wait()`` blocks until
  the checkpoint is committed (and raises what the save raised).

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
    self._thread = threading.Thread(target=self._run, args=(finish,), daemon=False,
                                    name=f"sr.save({path!r})")
    with _lock:
      _pending[path] = self
    self._thread.start()

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
    state = ("writing" if not self.done() else
             "failed" if self._error is not None else "committed")
    return f"SaveHandle({self.path!r}, {state})"


_pending: dict[str, SaveHandle] = {}
_lock = threading.Lock()


def wait_previous(root: str, fn: str) -> None:
  """Waits for ``root``'s background save, if any; raises its error if unseen."""
  with _lock:
    handle = _pending.pop(root, None)
  if handle is None:
    return
  handle._thread.join()
  if handle._error is not None and not handle._seen:
    handle._seen = True
    raise CheckpointError(
        f"sr.{fn}: the earlier sr.save({root!r}, ..., blocking=False) failed "
        f"({type(handle._error).__name__}: {handle._error}); the checkpoint there is "
        "the one before it. Nothing was done now. Fix: call this again (the error is "
        "reported once), and call `.wait()` on a background save's handle to see its "
        "errors where they happen.") from handle._error


@atexit.register
def _report_unseen_failures() -> None:
  # Threads are joined before atexit runs: every background save has ended by now.
  for handle in list(_pending.values()):
    if handle._error is not None and not handle._seen:
      print(f"statefulremat: sr.save({handle.path!r}, ..., blocking=False) failed and "
            f"was never waited on: {type(handle._error).__name__}: {handle._error}",
            file=sys.stderr)
