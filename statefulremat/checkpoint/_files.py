"""The on-disk layout of an ``sr.save`` checkpoint, and why a save is all or nothing.

A checkpoint is a directory::

  path/
    sr_checkpoint.json     the pointer: {"format": ..., "current": "sr-3"}
    sr-3/
      state/               orbax-checkpoint data (one array per variable)
      variables.json       per variable: path, kind, dtype and shape

``variables.json`` also lists every file of ``state/`` with its size, so a restore
finds a file deleted or cut short (an interrupted copy) and names it before orbax
reads anything (orbax's own read errors on such a file are a ``FileNotFoundError``,
or worse, a race of failing reads).

A save writes a new ``sr-<n>`` next to the current one, then replaces the pointer
with ``os.replace`` (atomic on POSIX), and only then deletes the older versions.
Whatever point a save dies at, the pointer names a version that was complete
before it was flipped, so the previous checkpoint stays loadable; a dead save's
``sr-<n>`` is invisible (nothing points at it) and the next save deletes it. Orbax's
own ``force=True`` overwrite would not do: it deletes the old checkpoint first.

Saves to one path from several threads or processes run one after the other: a save
holds an exclusive lock on the checkpoint directory from choosing its version number
to its commit (or abandon), writes its pointer through a temporary of its own, and
deletes only what its version supersedes (the previously current version and dead
ones numbered below its own), never a version numbered above it. A restore holds a
shared lock on the version it reads, from reading the pointer until its arrays are
read; a save takes that lock exclusively only to delete the superseded version, so a
restore during a save reads the last committed version and never waits for a whole
save. The locks are ``flock`` locks on the directories themselves (no lock files:
the directory holds only the pointer and versions) and, for the threads of one
process, in-process locks. Where ``flock`` does not exist (Windows) or the filesystem
refuses it, only the threads of one process are ordered; on NFS a directory's
``flock`` orders the processes of one host, not processes on different hosts. In a
multi-process run, every process calls ``sr.save`` and the primary alone takes the
lock, creates versions and flips the pointer: ``_sync``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import threading

from ..core._errors import StatefulRematError
from . import _locks

POINTER = "sr_checkpoint.json"
FORMAT = "statefulremat-checkpoint"
_VERSION = re.compile(r"sr-(\d+)")


class CheckpointError(StatefulRematError):
  """A path holds something other than a sound ``sr.save`` checkpoint, or cannot take one.

  A path with no checkpoint at all raises ``FileNotFoundError`` (also a
  ``CheckpointError``), so resuming reads ``except FileNotFoundError: start fresh``.
  Every other ``CheckpointError`` (a damaged checkpoint, a foreign directory) is
  deliberately not an ``OSError``: that loop must stop on it, not start over.

  >>> import os, tempfile, statefulremat as sr
  >>> with tempfile.TemporaryDirectory() as tmp:
  ...   open(os.path.join(tmp, "notes.txt"), "w").close()
  ...   try:
  ...     sr.restore(tmp, sr.nn.Linear(2, 2, rngs=sr.Rngs(0)))
  ...   except sr.CheckpointError as e:
  ...     print("refused:", type(e).__name__)
  refused: CheckpointError
  """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
  """No checkpoint at the path (catch it as ``FileNotFoundError``)."""


def resolve(path, fn: str) -> str:
  """``path`` (str or os.PathLike) as an absolute path; orbax wants absolute ones."""
  try:
    return os.path.abspath(os.fspath(path))
  except TypeError:
    raise TypeError(
      f"sr.{fn} takes the checkpoint path first, a str or os.PathLike, got "
      f"{type(path).__name__}. Call it as sr.{fn}(path, model)."
    ) from None


def _ours(name: str) -> bool:
  # Versions, what orbax leaves beside them, and the pointer's temporaries.
  return name.startswith(POINTER) or _VERSION.match(name) is not None


def read_json(path: str):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def write_json(path: str, obj) -> None:
  """Writes ``obj`` and flushes it to disk before returning."""
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1)
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
  # Makes the rename itself durable; some systems (Windows) cannot open a directory.
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def current(root: str, fn: str = "restore") -> str | None:
  """The directory of the checkpoint ``root``'s pointer names.

  Raises ``CheckpointNotFoundError`` when there is none (``fn="save"``: returns
  ``None`` instead) and ``CheckpointError`` when ``root`` holds something else.
  """
  if os.path.isdir(root):
    pointer = os.path.join(root, POINTER)
    if os.path.isfile(pointer):
      name = _pointed(pointer)
      while True:
        if isinstance(name, str) and _VERSION.fullmatch(name):
          version = os.path.join(root, name)
          if os.path.isdir(version):
            return version
        # A save may have superseded (and deleted) it since the pointer was read.
        again = _pointed(pointer)
        if again == name:
          break
        name = again
      raise CheckpointError(
        f"sr.{fn}: the checkpoint pointer {pointer!r} is damaged or names a "
        f"missing version ({name!r}). Something other than sr.save changed the "
        "directory. Fix: restore from another checkpoint, or delete the "
        "directory and save again."
      )
    foreign = sorted(n for n in os.listdir(root) if not _ours(n))
    if foreign:
      raise CheckpointError(
        f"sr.{fn}: {root!r} is not a statefulremat checkpoint: it has no {POINTER} "
        f"and holds other files ({', '.join(map(repr, foreign[:3]))}"
        f"{', ...' if len(foreign) > 3 else ''}). "
        + (
          "Fix: save into a new or empty directory; sr.save does not write among other files."
          if fn == "save"
          else "Fix: pass the directory sr.save wrote (for a plain orbax checkpoint, "
          "use orbax.checkpoint directly)."
        )
      )
  elif os.path.exists(root):
    raise CheckpointError(
      f"sr.{fn}: {root!r} is a file, not a checkpoint directory. Fix: "
      + (
        "pass a new path (sr.save writes a directory there), or remove the file."
        if fn == "save"
        else "pass the directory sr.save wrote."
      )
    )
  if fn == "save":
    return None
  raise CheckpointNotFoundError(
    f"sr.restore: there is no checkpoint at {root!r} ("
    + (
      "the directory holds no finished sr.save"
      if os.path.isdir(root)
      else "the path does not exist"
    )
    + "). Fix: check the path (relative paths are from the current directory, "
    f"{os.getcwd()!r}), or save one first with sr.save(path, model)."
  )


def _pointed(pointer: str):
  """What the pointer file names (``None`` if it cannot be read)."""
  try:
    return read_json(pointer)["current"]
  except (OSError, ValueError, KeyError, TypeError):
    return None


def file_sizes(version: str) -> dict[str, int]:
  """Every file under ``version``: its path there (``/``-separated) -> its size."""
  sizes = {}
  for parent, _, names in os.walk(version):
    for name in names:
      path = os.path.join(parent, name)
      sizes[os.path.relpath(path, version).replace(os.sep, "/")] = os.path.getsize(path)
  return dict(sorted(sizes.items()))


def check_files(version: str, sizes: dict[str, int]) -> None:
  """Raises ``CheckpointError`` naming the files of ``sizes`` missing or resized."""
  problems = []
  for name, size in sizes.items():
    path = os.path.join(version, *name.split("/"))
    try:
      actual = os.path.getsize(path)
    except OSError:
      problems.append(f"{path!r} is missing")
      continue
    if actual != size:
      problems.append(f"{path!r} has {actual} bytes instead of the {size} saved")
  if problems:
    more = len(problems) - 1
    more = f" (and {more} more file{'s' * (more > 1)})" if more else ""
    raise CheckpointError(
      f"sr.restore: the checkpoint in {version!r} is damaged: {problems[0]}{more}. "
      "This is not a missing checkpoint; nothing was restored and the model is "
      "unchanged. Fix: restore from another (earlier) checkpoint or a complete copy "
      "of this one, or, to start over on purpose, delete the directory."
    )


# -- locks: saves of a path one after the other, no version deleted under a restore ------


@contextlib.contextmanager
def reading(root: str):
  """The directory of the version ``root``'s pointer names (raising as ``current``
  does), which no save deletes before the block ends: a shared lock on it."""
  threads = _locks.threads_of(root)
  while True:
    version = current(root)
    assert version is not None  # fn="restore": raises rather than returning None
    with threads.reading():
      try:
        fd = _locks.flock(version, shared=True)
      except FileNotFoundError:  # superseded and deleted since the pointer was read
        continue
      try:
        # The lock keeps the version only if it was not superseded before: a save
        # deletes a version only after pointing away from it.
        if current(root) == version:
          yield version
          return
      finally:
        _locks.unlock(fd)


def begin(root: str) -> tuple[str, _locks.SaveLock]:
  """Takes ``root``'s save lock and creates the directory of a new, not yet visible
  version; the caller releases the lock once it has committed or abandoned it."""
  os.makedirs(root, exist_ok=True)  # Saves.begin refused files and foreign directories
  lock = _locks.SaveLock(root)
  try:
    current(root, "save")  # again: the directory may have changed before the lock
    taken = [int(m.group(1)) for m in map(_VERSION.match, os.listdir(root)) if m]
    number = max(taken, default=0) + 1
    while True:
      version = os.path.join(root, f"sr-{number}")
      try:
        os.mkdir(version)
        break
      except FileExistsError:  # a writer the lock does not reach (no flock there)
        number += 1
  except BaseException:
    lock.release()
    raise
  return version, lock


def newest(root: str) -> str:
  """The directory of ``root``'s highest-numbered version (the one ``begin`` made)."""
  taken = [int(m.group(1)) for m in map(_VERSION.fullmatch, os.listdir(root)) if m]
  if not taken:
    raise CheckpointError(
      f"sr.save: no version directory in {root!r} after the primary process began "
      "one: the processes do not share this path. Fix: save to a path every "
      "process sees (a shared filesystem)."
    )
  return os.path.join(root, f"sr-{max(taken)}")


def commit(root: str, version: str) -> None:
  """Points ``root`` at ``version`` atomically, then deletes what it supersedes.

  That is the previously current version and dead ones (never committed) numbered
  below it, and dead saves' temporary pointers; never a version numbered above it.
  The caller holds the save lock, so no other save is under way.
  """
  name = os.path.basename(version)
  number = int(name.removeprefix("sr-"))  # `version` is a directory begin() made
  # A name of this writer's own: another writer's temporary is never replaced.
  temporary = os.path.join(
    root, f"{POINTER}.tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
  )
  try:
    write_json(temporary, {"format": FORMAT, "current": name})
    os.replace(temporary, os.path.join(root, POINTER))
  except BaseException:
    _remove(temporary)
    raise
  _fsync_dir(root)
  superseded = []
  for entry in os.listdir(root):
    match = _VERSION.match(entry)
    if match and entry != name and int(match.group(1)) < number:
      superseded.append(os.path.join(root, entry))
    elif entry.startswith(POINTER + ".tmp"):
      _remove(os.path.join(root, entry))
  if superseded:
    with _locks.threads_of(root).deleting():
      for path in superseded:
        _delete_unread(path)


def _delete_unread(path: str) -> None:
  """Deletes ``path`` once no restore reads it (an exclusive lock on it)."""
  try:
    fd = _locks.flock(path, shared=False)
  except FileNotFoundError:
    return
  try:
    _remove(path)
  finally:
    _locks.unlock(fd)


def abandon(root: str, version: str) -> None:
  """Deletes a failed save's ``version``, unless the pointer already names it."""
  with contextlib.suppress(CheckpointError):
    if current(root, "save") == version:
      return
  _remove(version)


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      os.remove(path)
