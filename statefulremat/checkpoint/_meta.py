"""What a checkpoint records of its variables (``variables.json``), and the check of
a model against it before any array is read: paths, kinds, shapes, dtypes and layer
axes; a mismatch lists the first five differences and counts the rest."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..core._errors import StateMismatchError, format_path
from ..core._stacks import LAYER_AXIS
from ..core._variables import Variable
from ._files import FORMAT, CheckpointError, check_files, read_json

# How many differences a StateMismatchError lists before "and N more".
_LISTED = 5


@dataclass(frozen=True, slots=True)
class _Key:
  """A path key other than str/int, known by its repr (JSON cannot hold it)."""

  text: str

  def __repr__(self):
    return self.text


def path_to_json(path: tuple) -> list:
  return [k if type(k) in (str, int) else {"repr": repr(k)} for k in path]


def path_from_json(keys: list) -> tuple:
  return tuple(_Key(k["repr"]) if isinstance(k, dict) else k for k in keys)


def damaged(error: Exception, version: str, saved) -> CheckpointError:
  """The error for orbax data that cannot be read, naming the array and file if known."""
  text = str(error).split(" [tensorstore_spec")[0].strip()
  # tensorstore names the array by its key in the saved tree (the index in `saved`)
  # and the file it failed on; neither is guaranteed, so each is reported if found.
  array = re.search(r'"(\d+)/[^"]*"', text)
  what = "its array data"
  if array and int(array.group(1)) < len(saved):
    what = f"the array of `{format_path(saved[int(array.group(1))][0])}`"
  files = re.findall(r'local file "([^"]+)"', text)
  files = [f for f in files if not f.endswith(os.sep)]
  status = text.split(":")[0]  # tensorstore's status code, e.g. NOT_FOUND
  reason = (
    f"tensorstore: {status}"
    if re.fullmatch(r"[A-Z_]+", status)
    else f"{type(error).__name__}: {text[:200]}"
  )
  reason += f", file {files[-1]!r}" if files else ""
  return CheckpointError(
    f"sr.restore: the checkpoint in {version!r} is damaged: {what} cannot be "
    f"read ({reason}). Its variables.json is intact, so this is not a "
    "missing checkpoint; nothing was restored and the model is unchanged. Fix: "
    "restore from another (earlier) checkpoint, or, to start over on purpose, "
    "delete the directory."
  )


def _axes_words(levels) -> str:
  if not levels:
    return "no axis (not stacked)"
  return " then ".join(f"axis {a}" + (f" ({n!r})" if n else "") for a, n in levels)


def layer_axis_json(var: Variable):
  """The Variable's layer axes (``[[axis, partition name], ...]``), or None."""
  levels = var._metadata.get(LAYER_AXIS)
  return [list(level) for level in levels] if levels else None


def read_meta(version: str) -> tuple[list[tuple[tuple, str, str]], dict]:
  """``(path, kind, spec)`` per saved variable, in the order saved, and ``{path: layer
  axes}`` for the variables whose layer axes were recorded, once the files listed are
  found whole (``check_files``).

  A checkpoint saved before the sizes (or layer axes) were recorded has none to check.
  """
  try:
    meta = read_json(os.path.join(version, "variables.json"))
    if meta["format"] != FORMAT:
      raise ValueError(meta["format"])
    files = {str(k): int(v) for k, v in meta.get("files", {}).items()}
    layer_axes = {
      path_from_json(e["path"]): e["layer_axis"] for e in meta["variables"] if "layer_axis" in e
    }
    saved = [(path_from_json(e["path"]), e["kind"], e["spec"]) for e in meta["variables"]]
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointError(
      f"sr.restore: the checkpoint in {version!r} is damaged: its variables.json "
      f"cannot be read ({type(e).__name__}: {e}). Fix: restore from another "
      "checkpoint."
    ) from None
  check_files(version, files)
  return saved, layer_axes


def check_match(
  saved, variables, specs, root: str, layer_axes: dict, partial: bool = False
) -> list[int]:
  """The position in ``saved`` of each of ``variables``; raises ``StateMismatchError``
  listing the first ``_LISTED`` variables that differ (with ``partial``, the checkpoint
  may hold variables the model's selection lacks).

  A stacked variable whose layer axis moved (same shape, another axis stacks the
  layers) differs too: restoring it would silently mix layers with features.
  """
  keys = [path_from_json(path_to_json(p)) for p, _ in variables]
  theirs = {p: (kind, spec) for p, kind, spec in saved}
  ours = {
    key: (type(var).__name__, spec, var) for key, (_, var), spec in zip(keys, variables, specs)
  }
  problems = []
  for path, (kind, spec, var) in ours.items():
    if path not in theirs:
      problems.append(
        f"the model has `{format_path(path)}` (a {kind} {spec}) but the checkpoint does not"
      )
    elif theirs[path] != (kind, spec):
      problems.append(
        f"`{format_path(path)}`: the checkpoint has a {theirs[path][0]} "
        f"{theirs[path][1]}, the model a {kind} {spec}"
      )
    elif path in layer_axes and layer_axes[path] != layer_axis_json(var):
      problems.append(
        f"`{format_path(path)}`: the checkpoint stacks its layers along "
        f"{_axes_words(layer_axes[path])}, the model along "
        f"{_axes_words(layer_axis_json(var))}"
      )
  problems += [
    f"the checkpoint has `{format_path(path)}` (a {kind} {spec}) but the model does not"
    for path, (kind, spec) in theirs.items()
    if path not in ours and not partial
  ]

  if problems:
    # The first keeps the one-line summary; the next few follow, one per line.
    more = len(problems) - 1
    summary = f" (and {more} more difference{'s' * (more > 1)})" if more else ""
    listed = "".join(f"\n  also {p}" for p in problems[1:_LISTED])
    if len(problems) > _LISTED:
      listed += f"\n  and {len(problems) - _LISTED} more"
    raise StateMismatchError(
      f"sr.restore: {problems[0]}{summary}; nothing was restored from {root!r}."
      f"{listed}\nFix: restore into a model built the way the saved one was (same "
      "layers, sizes, dtypes, RNG key impl and constructor options); to restore part "
      "of a checkpoint, name it with filters: `sr.restore(path, model, sr.Param)` or "
      "`sr.restore(path, model, sr.PathContains('encoder'))`."
    )
  where = {p: i for i, (p, _, _) in enumerate(saved)}
  return [where[key] for key in keys]
