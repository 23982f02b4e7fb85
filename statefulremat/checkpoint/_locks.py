"""The locks of a checkpoint path: saves one after the other, restores never under a delete.

A save holds ``SaveLock`` on the checkpoint directory from choosing its version to
its commit: an exclusive ``flock`` on the directory itself (other processes) and a
per-path thread lock (other threads of this process; ``flock`` locks belong to open
file descriptions, so they would order those too, but not where ``flock`` is missing).
A restore holds a shared ``flock`` on the version it reads and counts itself in the
path's ``_Threads``; a commit deletes a superseded version only under the exclusive
lock on it. Where ``flock`` does not exist (Windows) or the filesystem refuses it,
only the threads of one process are ordered.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading

from ..core._caches import checkpoint_threads, checkpoint_threads_lock

try:
  import fcntl
except ImportError:  # Windows: the threads of one process are still ordered
  fcntl = None

# What flock raises where the filesystem has no such locks (Lustre without -o flock,
# some FUSE and network filesystems): saving goes on with the threads' locks alone.
_NO_FLOCK = {
  errno.ENOLCK,
  errno.EOPNOTSUPP,
  errno.ENOSYS,
  errno.EINVAL,
  errno.EBADF,
  getattr(errno, "ENOTSUP", errno.EOPNOTSUPP),
}


def flock(path: str, shared: bool) -> int | None:
  """An open descriptor of ``path`` (a directory), ``flock``-ed; ``None`` where there is
  no such lock. Raises ``FileNotFoundError`` if ``path`` is gone."""
  if fcntl is None:
    return None
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    raise
  except OSError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
  except BaseException as e:
    os.close(fd)
    if isinstance(e, OSError) and e.errno in _NO_FLOCK:
      return None
    raise
  return fd


def unlock(fd: int | None) -> None:
  if fd is None:
    return
  assert fcntl is not None  # descriptors come from flock, which needs fcntl
  try:
    # Explicitly: a child forked meanwhile shares the descriptor, and closing ours
    # alone would leave the path locked for as long as the child lives.
    fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)


class _Threads:
  """A path's locks among this process's threads (what ``flock`` gives between
  processes, also where it is missing): one save at a time, and restores (shared)
  against the deletion of superseded versions (exclusive, and served first)."""

  def __init__(self):
    self.save = threading.Lock()
    self._changed = threading.Condition()
    self._readers = 0
    self._deleters = 0  # waiting or deleting

  @contextlib.contextmanager
  def reading(self):
    with self._changed:
      self._changed.wait_for(lambda: not self._deleters)
      self._readers += 1
    try:
      yield
    finally:
      with self._changed:
        self._readers -= 1
        self._changed.notify_all()

  @contextlib.contextmanager
  def deleting(self):
    with self._changed:
      self._deleters += 1  # from now on no restore starts reading
    try:
      with self._changed:
        self._changed.wait_for(lambda: not self._readers)
      yield
    finally:
      with self._changed:
        self._deleters -= 1
        self._changed.notify_all()


def threads_of(root: str) -> _Threads:
  key = os.path.normcase(os.path.realpath(root))
  with checkpoint_threads_lock:
    return checkpoint_threads.setdefault(key, _Threads())


class SaveLock:
  """What a save holds on its path from ``begin`` to the end of its ``commit`` or
  ``abandon``: the threads' lock and an exclusive ``flock`` of the directory."""

  def __init__(self, root: str):
    self._threads = threads_of(root).save
    self._threads.acquire()
    try:
      self._fd = flock(root, shared=False)
    except BaseException:
      self._threads.release()
      raise
    self._held = True

  def release(self) -> None:
    """Releases the lock (once; later calls do nothing), from any thread."""
    if not self._held:
      return
    self._held = False
    try:
      unlock(self._fd)
    finally:
      self._threads.release()
