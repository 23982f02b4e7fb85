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

One program saves to a path at a time (no locking). In a multi-process run, every
process calls ``sr.save`` and the primary alone creates versions and flips the
pointer: ``_checkpoint_sync``.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from ._errors import StatefulRematError

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
        f"{type(path).__name__}. Call it as sr.{fn}(path, model).") from None


def _ours(name: str) -> bool:
  # Versions, what orbax leaves beside them, and the pointer's temporary.
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
      try:
        name = read_json(pointer)["current"]
      except (OSError, ValueError, KeyError, TypeError):
        name = None
      version = os.path.join(root, name) if isinstance(name, str) else ""
      if not (isinstance(name, str) and _VERSION.fullmatch(name)
              and os.path.isdir(version)):
        raise CheckpointError(
            f"sr.{fn}: the checkpoint pointer {pointer!r} is damaged or names a "
            f"missing version ({name!r}). Something other than sr.save changed the "
            "directory. Fix: restore from another checkpoint, or delete the "
            "directory and save again.")
      return version
    foreign = sorted(n for n in os.listdir(root) if not _ours(n))
    if foreign:
      raise CheckpointError(
          f"sr.{fn}: {root!r} is not a statefulremat checkpoint: it has no {POINTER} "
          f"and holds other files ({', '.join(map(repr, foreign[:3]))}"
          f"{', ...' if len(foreign) > 3 else ''}). "
          + ("Fix: save into a new or empty directory; sr.save does not write "
             "among other files." if fn == "save" else
             "Fix: pass the directory sr.save wrote (for a plain orbax checkpoint, "
             "use orbax.checkpoint directly)."))
  elif os.path.exists(root):
    raise CheckpointError(
        f"sr.{fn}: {root!r} is a file, not a checkpoint directory. Fix: "
        + ("pass a new path (sr.save writes a directory there), or remove the file."
           if fn == "save" else "pass the directory sr.save wrote."))
  if fn == "save":
    return None
  raise CheckpointNotFoundError(
      f"sr.restore: there is no checkpoint at {root!r} ("
      + ("the directory holds no finished sr.save" if os.path.isdir(root)
         else "the path does not exist")
      + "). Fix: check the path (relative paths are from the current directory, "
      f"{os.getcwd()!r}), or save one first with sr.save(path, model).")


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
        "of this one, or, to start over on purpose, delete the directory.")


def begin(root: str) -> str:
  """Creates and returns the directory of a new, not yet visible version."""
  current(root, "save")  # refuses files and foreign directories
  os.makedirs(root, exist_ok=True)
  taken = [int(m.group(1)) for m in map(_VERSION.match, os.listdir(root)) if m]
  version = os.path.join(root, f"sr-{max(taken, default=0) + 1}")
  os.mkdir(version)
  return version


def newest(root: str) -> str:
  """The directory of ``root``'s highest-numbered version (the one ``begin`` made)."""
  taken = [int(m.group(1)) for m in map(_VERSION.fullmatch, os.listdir(root)) if m]
  if not taken:
    raise CheckpointError(
        f"sr.save: no version directory in {root!r} after the primary process began "
        "one: the processes do not share this path. Fix: save to a path every "
        "process sees (a shared filesystem).")
  return os.path.join(root, f"sr-{max(taken)}")


def commit(root: str, version: str) -> None:
  """Points ``root`` at ``version`` atomically, then deletes every other version."""
  temporary = os.path.join(root, POINTER + ".tmp")
  write_json(temporary, {"format": FORMAT, "current": os.path.basename(version)})
  os.replace(temporary, os.path.join(root, POINTER))
  _fsync_dir(root)
  for name in os.listdir(root):
    if _ours(name) and name != POINTER and name != os.path.basename(version):
      _remove(os.path.join(root, name))


def abandon(root: str, version: str) -> None:
  """Deletes a failed save's ``version``, unless the pointer already names it."""
  try:
    if current(root, "save") == version:
      return
  except CheckpointError:
    pass
  _remove(version)
  _remove(os.path.join(root, POINTER + ".tmp"))


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    try:
      os.remove(path)
    except OSError:
      pass
