"""sr.save / sr.restore: a model's State on disk, with orbax-checkpoint.

Every Variable of the model is saved (params, batch stats, RNG keys and counts,
optimizer state, ...), one array each, with a small JSON list of their paths, kinds,
dtypes and shapes beside the orbax data. Restoring checks that list against the model
first, so a mismatch is reported by path before any array is read, and writes the
values into the model only once all of them are read: the model is either fully
restored or left as it was. The directory layout and why a save is atomic:
``checkpoint._files``.

Saved as: arrays as they are (restored onto the model's current shardings); typed
PRNG keys as their ``key_data`` (rewrapped with the model's key impl, which must
match); numpy arrays as numpy arrays (restored as numpy arrays). A Python
``bool``/``int``/``float`` is the 0-d array JAX makes of it (``jnp.result_type``:
``int32``/``float32`` unless ``jax_enable_x64``), which is what it becomes after one
jitted step; so a model saved before training restores after it and vice versa. A
Variable keeps its kind of value: one holding a Python number gets a Python number of
the same type back, one holding an array an array. Variable metadata is
configuration, not state: the model's own is kept.
"""

from __future__ import annotations

import os
from typing import Literal, overload

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from ..core._errors import format_path
from ..core._filters import collections_and_guess, filter_repr, to_predicate
from ..core._graph import flatten
from ..core._module import Module
from ..core._split_merge import deleted_error, update
from ..core._state import State
from ..core._variables import Variable
from ._files import (
  FORMAT,
  CheckpointError,
  abandon,
  commit,
  file_sizes,
  reading,
  resolve,
  write_json,
)
from ._meta import check_match, damaged, layer_axis_json, path_to_json, read_meta
from ._sync import SaveHandle, Saves, is_primary, wait_previous

_PYTHON = (bool, int, float)  # exactly these types: a numpy scalar is not one


def _describe(value) -> tuple[str, str | None]:
  """``(spec, how)``: the spec compared on restore (``float32[8,4]``) and how the value
  is stored (``None``: it cannot be)."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    spec = f"{value.dtype}[{','.join(map(str, np.shape(value)))}]"
    if isinstance(value, jax.Array):
      return spec, "key" if jnp.issubdtype(value.dtype, jax.dtypes.prng_key) else "array"
    return spec, None if value.dtype == object else "numpy"
  if type(value) in _PYTHON:
    return f"{jnp.result_type(value)}[]", "python"
  return f"{type(value).__name__} (not an array)", None


def _model_variables(path, model, fn: str) -> tuple[str, list[tuple[tuple, Variable]]]:
  """``path`` as an absolute path, and ``model``'s Variables by path (none traced)."""
  root = resolve(path, fn)
  if isinstance(model, State):
    raise TypeError(
      f"sr.{fn} takes the model itself, got a State. A checkpoint holds all of a "
      "model's variables and restore writes them back in place, so pass the "
      f"module: sr.{fn}(path, model) (a State is what sr.state(model) gives after)."
    )
  if not isinstance(model, (Module, Variable, list, tuple, dict)):
    raise TypeError(
      f"sr.{fn} takes a path and a Module (or a list/tuple/dict of them), got "
      f"{type(model).__name__} as the model. Call it as sr.{fn}(path, model)."
    )
  graphdef, variables = flatten([model])
  for var_path, var in zip(graphdef.var_paths, variables):
    if isinstance(var._value, jax.core.Tracer):
      raise TypeError(
        f"sr.{fn}: `{format_path(var_path)}` ({type(var).__name__}) holds a traced "
        f"value: sr.{fn} was called inside a JAX transform. Fix: call it outside, "
        "before or after the jitted step."
      )
  return root, list(zip(graphdef.var_paths, variables))


@overload
def save(path: str | os.PathLike, model, *, blocking: Literal[True] = True) -> None: ...
@overload
def save(path: str | os.PathLike, model, *, blocking: Literal[False]) -> SaveHandle: ...
@overload
def save(path: str | os.PathLike, model, *, blocking: bool) -> SaveHandle | None: ...
def save(path: str | os.PathLike, model, *, blocking: bool = True) -> SaveHandle | None:
  """Saves every Variable of ``model`` to the directory ``path``, atomically.

  Saving over an earlier checkpoint replaces it; a save that fails or is interrupted
  part way (even killed) leaves the earlier one in place and loadable.

  ``blocking=False`` returns a ``SaveHandle`` as soon as the arrays are copied to host
  memory: the model may change at once without changing what is saved, and
  ``handle.wait()`` blocks until the checkpoint is committed (raising the save's
  error, if any). A later ``sr.save`` or ``sr.restore`` of the same path waits for it
  first. Saves to one path from several threads or processes run one after the other
  (a lock on the path) and the last one's checkpoint stays; a restore meanwhile reads
  the last committed one. In a multi-process run (``jax.distributed.initialize``)
  every process calls ``sr.save`` with the same path; each writes its own shards, and
  the call returns (or the handle's ``wait``) once the checkpoint is committed for all
  of them.

  Args:
    path: a directory (str or os.PathLike; relative to the current directory) that
      does not exist, is empty, or holds an earlier ``sr.save``.
    model: a Module (or a list/tuple/dict of them, as ``sr.state`` takes). Variables
      must hold jax/numpy arrays (typed PRNG keys included) or Python numbers; a
      Python number is saved as the 0-d array JAX makes of it (``int32[]`` for an
      int unless ``jax_enable_x64``), and one that does not fit is refused.
    blocking: wait for the checkpoint to be committed (the default), or return a
      ``SaveHandle`` while it is written in the background.

  Returns:
    None, or with ``blocking=False`` a ``SaveHandle``.

  >>> import os, tempfile, jax.numpy as jnp, statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> with tempfile.TemporaryDirectory() as tmp:
  ...   sr.save(os.path.join(tmp, "ckpt"), model)
  ...   fresh = sr.nn.Linear(2, 3, rngs=sr.Rngs(1))
  ...   sr.restore(os.path.join(tmp, "ckpt"), fresh)
  >>> bool((fresh.kernel.value == model.kernel.value).all())
  True
  """
  root, variables = _model_variables(path, model, "save")
  if not isinstance(blocking, bool):
    raise TypeError(f"sr.save: blocking must be True or False, got {blocking!r}.")
  entries, arrays = _snapshot(variables)
  wait_previous(root, "save")

  import orbax.checkpoint as ocp

  saves = Saves(root)
  version = saves.begin()  # the path's lock is held from here until saves.end()
  checkpointer = None

  def abandon_version():
    try:
      if checkpointer is not None:
        checkpointer.close()
      if is_primary():
        abandon(root, version)
    finally:
      saves.end()

  try:
    if blocking:
      checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    else:
      # Directories made before returning: orbax's thread making them after a failed
      # save would recreate the abandoned version, or write into the next save's.
      checkpointer = ocp.AsyncCheckpointer(
        ocp.StandardCheckpointHandler(),
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
      )
    if arrays:  # orbax refuses an empty tree; a model without variables is just JSON
      checkpointer.save(os.path.join(version, "state"), args=ocp.args.StandardSave(arrays))
  except BaseException:
    abandon_version()
    raise

  def finish():
    try:
      if isinstance(checkpointer, ocp.AsyncCheckpointer):  # i.e. not blocking
        checkpointer.wait_until_finished()
      checkpointer.close()
      if is_primary():
        write_json(
          os.path.join(version, "variables.json"),
          {"format": FORMAT, "variables": entries, "files": file_sizes(version)},
        )
        commit(root, version)
    except BaseException:
      abandon_version()
      raise
    saves.end()
    saves.barrier("committed")

  if blocking:
    finish()
    return None
  try:
    return SaveHandle(root, finish)  # its thread ends the save, and releases the lock
  except BaseException:  # the thread did not start
    abandon_version()
    raise


def _snapshot(variables) -> tuple[list[dict], dict[str, object]]:
  """What a save writes: per Variable its JSON entry and its value as stored (copied
  where it is mutable, so the model may change while a save is under way)."""
  entries, arrays = [], {}
  # Checked before orbax sees the arrays: a background save would fail out of sight.
  deleted = deleted_error(
    [var for _, var in variables], "sr.save: ", CheckpointError, " Nothing was written."
  )
  if deleted is not None:
    raise deleted
  for i, (var_path, var) in enumerate(variables):
    value = var._value
    spec, how = _describe(value)
    where = f"`{format_path(var_path)}` ({type(var).__name__})"
    if how is None:
      raise TypeError(
        f"sr.save: {where} holds a {spec}; a checkpoint takes jax or numpy arrays "
        "(typed PRNG keys included) and Python bool/int/float. Nothing was written. "
        "Fix: store an array in it (e.g. `jnp.asarray(...)`), or keep that value "
        "out of the model's Variables (a plain attribute is configuration)."
      )
    if how == "key":
      value = jax.random.key_data(value)
    elif how == "python":
      value = _python_as_array(value, where)
    elif how == "numpy":
      value = np.array(value)  # a copy: numpy arrays change in place
    arrays[str(i)] = value
    entries.append(
      {
        "path": path_to_json(var_path),
        "kind": type(var).__name__,
        "spec": spec,
        "layer_axis": layer_axis_json(var),
      }
    )
  return entries, arrays


def _python_as_array(value, where: str) -> np.ndarray:
  """A Python number as the 0-d array JAX makes of it (``jnp.asarray(value)``)."""
  dtype = jnp.result_type(value)
  try:
    with np.errstate(over="raise"):  # a float beyond float32 would become inf
      return np.asarray(value, dtype)
  except (OverflowError, FloatingPointError):
    pass
  kind = type(value).__name__
  if type(value) is float or -(2**63) <= value < 2**63:
    raise TypeError(
      f"sr.save: {where} holds the Python {kind} {value}, which does not fit in "
      f"{dtype}, the dtype JAX gives a Python {kind} (it is saved and restored as "
      "that). Fix: enable 64-bit types (jax.config.update('jax_enable_x64', True)) "
      f"or store a 64-bit numpy value in it (np.{kind}64(...))."
    )
  raise TypeError(
    f"sr.save: {where} holds the Python int {value}, which does not fit in 64 "
    "bits. Fix: store it as an array of a wider representation, or as several "
    "smaller numbers."
  )


def _target(value, how: str | None):
  """What orbax should restore to: the model's shape, dtype and sharding."""
  if how == "key":
    value = jax.random.key_data(value)
  elif how == "python":
    return np.empty((), jnp.result_type(value))
  if isinstance(value, jax.Array):
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
  return np.empty(np.shape(value), np.asarray(value).dtype)


def _as_model_holds(restored, old, how: str | None):
  if how == "key":
    return jax.random.wrap_key_data(restored, impl=jax.random.key_impl(old))
  if how == "python":
    return type(old)(restored.item())
  if isinstance(old, np.generic):
    return restored[()]
  return restored


def restore(path: str | os.PathLike, model, *filters) -> None:
  """Reads the checkpoint ``sr.save`` wrote at ``path`` into ``model``, in place.

  The checkpoint must hold exactly the model's variables, with the same kinds, shapes
  and dtypes; ``sr.StateMismatchError`` lists the first five that differ (missing,
  extra, or another kind/shape/dtype) and how many more. With ``filters`` (any of them,
  as ``sr.state`` takes them: ``sr.Param``, ``"batch_stats"``,
  ``sr.PathContains("encoder")``, …) only the model's variables they match are read and
  checked, and the checkpoint may hold others: fine-tuning from pretrained parameters is
  ``sr.restore(path, model, sr.Param)``. A filter that matches none of the model's
  variables raises. In a multi-process run every process calls it; each reads its own
  shards (a checkpoint saved by another number of processes restores). Arrays are
  restored onto the model's current shardings, so the model may be placed differently
  than the saved one (another mesh, one device). ``remat_scan`` stacks keep one flat
  layer axis, so a stack restores from one saved with other ``lengths``. A Variable
  holding a Python number matches the 0-d array JAX makes of it (``sr.Param(1.0)`` is
  ``float32[]``) and gets a Python number of its type back. On any error
  (``KeyboardInterrupt`` included) the model is unchanged.

  Args:
    path: the directory (str or os.PathLike) an ``sr.save`` wrote.
    model: the Module (or list/tuple/dict of them) to write the values into, in
      place; the same structure as the one saved.
    *filters: read only the model's variables that any of these matches (as
      ``sr.state`` takes them); none reads all of them.

  Raises:
    FileNotFoundError: there is no checkpoint at ``path`` (the path does not exist,
      or no save into it finished); it is also an ``sr.CheckpointError``. So a
      resume loop may read ``except FileNotFoundError: start fresh``.
    sr.CheckpointError: ``path`` holds something else, or a damaged checkpoint (a
      file of it missing or unreadable); not an ``OSError``, so the resume loop
      above stops on it rather than silently starting over.
    sr.StateMismatchError: the checkpoint does not fit the model.
    TypeError: ``model`` is a State or not a module, its variables hold traced values
      (a call inside a JAX transform), or ``filters`` match none of its variables.

  >>> import os, tempfile, statefulremat as sr
  >>> with tempfile.TemporaryDirectory() as tmp:
  ...   sr.save(tmp, sr.nn.Linear(2, 3, rngs=sr.Rngs(0)))
  ...   try:
  ...     sr.restore(tmp, sr.nn.Linear(2, 4, rngs=sr.Rngs(0)))
  ...   except sr.StateMismatchError as e:
  ...     print(str(e).split(";")[0])
  ...     print(str(e).splitlines()[1])
  sr.restore: `bias`: the checkpoint has a Param float32[3], the model a Param
  float32[4] (and 1 more difference)
    also `kernel`: the checkpoint has a Param float32[2,3], the model a Param float32[2,4]
  """
  root, variables = _model_variables(path, model, "restore")
  variables = _selected(variables, filters)
  wait_previous(root, "restore")
  # The version read stays on disk until the block ends, whatever saves do meanwhile.
  with reading(root) as version:
    saved, layer_axes = read_meta(version)
    specs = [_describe(var._value) for _, var in variables]
    order = check_match(
      saved, variables, [s for s, _ in specs], root, layer_axes, partial=bool(filters)
    )

    import orbax.checkpoint as ocp

    # Orbax reads the arrays named here; the rest of the checkpoint stays on disk.
    targets: dict[str, object] = {str(j): ocp.PLACEHOLDER for j in range(len(saved))}
    for j, (_, var), (_, how) in zip(order, variables, specs):
      targets[str(j)] = _target(var._value, how)
    restored = {}
    if variables:
      try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
          restored = checkpointer.restore(
            os.path.join(version, "state"),
            args=ocp.args.PyTreeRestore(
              item=targets, restore_args=ocp.checkpoint_utils.construct_restore_args(targets)
            ),
          )
      except (OSError, ValueError, KeyError) as e:
        # Orbax's FileNotFoundError must not escape: `except FileNotFoundError: start
        # fresh` would silently throw away a run whose checkpoint is merely damaged.
        raise damaged(e, version, saved) from e
  values = {}
  for j, (var_path, var), (spec, how) in zip(order, variables, specs):
    value = _as_model_holds(restored[str(j)], var._value, how)
    if _describe(value)[0] != spec:  # the JSON and the orbax data disagree
      raise CheckpointError(
        f"sr.restore: `{format_path(var_path)}` in {root!r} reads back as "
        f"{_describe(value)[0]}, though the checkpoint lists {spec}: the checkpoint "
        "is damaged (nothing was restored). Fix: restore from another checkpoint."
      )
    values[var_path] = value
  update(model, State(values))


def _selected(variables: list, filters: tuple) -> list:
  """The variables ``filters`` match (all of them without filters)."""
  if not filters:
    return variables
  predicate = to_predicate(filters)
  chosen = [(p, v) for p, v in variables if predicate(p, v)]
  if not chosen:
    have, guess = collections_and_guess(filters, variables)
    hint = f" Did you mean {guess!r}?" if guess else ""
    raise TypeError(
      f"sr.restore: the filters {', '.join(map(filter_repr, filters))} match no "
      f"variable of the model, so nothing would be restored. Its variables are in "
      f"the collections: {have}.{hint} Fix: pass filters that match what to "
      "restore, e.g. `sr.restore(path, model, sr.Param)`, or none to restore "
      "everything."
    )
  return chosen
