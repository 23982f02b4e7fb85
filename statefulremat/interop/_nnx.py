"""flax.nnx modules and States <-> our modules: ``from_nnx`` and ``to_nnx``.

Our paths are nnx's paths (attribute names, list indices, dict keys), so variables
match by path; kinds match by collection (``nnx.Param`` is ``params``, as linen
names it). flax is imported on the first call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..core._errors import format_path
from ..core._split_merge import update
from ..core._state import State
from ._paths import entries, flat_tree, nearest, placed_like, select_collections
from ._report import Problems, array_str, keys_str, shape_str, where_str

_FIX_NAMES = ("give the nnx module the same attribute names and nesting as ours "
              "(lists as `nnx.List`, index `i` <-> our `[i]`).")
_FIX_UNUSED = ("every nnx variable needs one of ours at the same path: add the layer "
               "to our model, or transfer fewer collections with collections=(...).")


def _nnx():
  from flax import nnx

  return nnx


def _collection(leaf) -> str | None:
  """The collection of an nnx Variable (linen's name for its type); None for arrays."""
  nnx = _nnx()
  if not isinstance(leaf, nnx.Variable):
    return None
  registry = nnx.variablelib.VariableTypeCache
  for cls in type(leaf).__mro__:
    for name, known in registry.items():
      if cls is known:
        return name
    if cls is nnx.RngState:
      return "rngs"
  return re.sub(r"(?<!^)(?=[A-Z])", "_", type(leaf).__name__).lower()


def _value(leaf):
  return leaf.get_value() if isinstance(leaf, _nnx().Variable) else leaf


def _describe(leaf) -> str:
  kind = type(leaf).__name__ if isinstance(leaf, _nnx().Variable) else "array"
  return f"{kind}, {array_str(_value(leaf))}"


def _flat_nnx(source, what: str) -> tuple[dict, bool]:
  """``({path: nnx Variable or array}, is_module)`` of an nnx Module or State."""
  nnx = _nnx()
  if isinstance(source, nnx.Module):
    return flat_tree(nnx.state(source), _is_leaf), True
  if isinstance(source, Mapping):
    return flat_tree(source, _is_leaf), False
  raise TypeError(
      f"{what} takes an nnx Module or an nnx State (`nnx.state(module)`), got "
      f"{type(source).__name__}.")


def _is_leaf(node) -> bool:
  return not isinstance(node, Mapping)


def _match(model, flat: dict, collections, what: str, problems: Problems):
  """``[(entry, nnx path, nnx leaf)]`` for our variables in the chosen collections."""
  want = select_collections(collections, what)
  ours = entries(model, what)
  if want is None:
    want = ({e.collection for e in ours}
            | {_collection(leaf) for leaf in flat.values()}) - {"rngs", None}
  ours = [e for e in ours if e.collection in want]
  theirs = {p: leaf for p, leaf in flat.items()
            if _collection(leaf) is None or _collection(leaf) in want}
  present = {_collection(leaf) for leaf in theirs.values()}
  absent = set()
  if None not in present:
    for c in sorted(want - present):
      mine = [e for e in ours if e.collection == c]
      if mine:
        absent.add(c)
        problems.add(
            f"the nnx side has no variables of collection `{c}`, but ours has "
            f"{len(mine)}: {where_str(mine)}.",
            "pass the whole nnx module or state, or transfer only some collections "
            "with collections=('params',).")
  used, pairs = set(), []
  for e in ours:
    if e.collection in absent:
      continue
    leaf = flat.get(e.path)
    if leaf is None:
      prefix, below = nearest(flat, e.path)
      problems.add(f"{e.where()}: nnx has no `{format_path(e.path)}` "
                   f"(`{format_path(prefix)}` has: {keys_str(below)}).", _FIX_NAMES)
      continue
    used.add(e.path)
    c = _collection(leaf)
    if c is not None and c != e.collection:
      problems.add(f"{e.where()} belongs to collection `{e.collection}`, but nnx has a "
                   f"{type(leaf).__name__} there (collection `{c}`).",
                   "use the same variable kinds on both sides (sr.Param <-> nnx.Param, "
                   "sr.BatchStat <-> nnx.BatchStat).")
      continue
    value = _value(leaf)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or tuple(shape) != e.shape:
      problems.add(f"{e.where()}: shape mismatch: ours is {shape_str(e.shape)}, nnx "
                   f"`{format_path(e.path)}` is "
                   f"{shape_str(shape) if shape is not None else type(value).__name__}.",
                   "build both with the same sizes (a stack's layer axis must sit "
                   "where the nnx module keeps it).")
    elif dtype != e.dtype:
      problems.add(f"{e.where()}: dtype mismatch: ours is {e.dtype}, nnx "
                   f"`{format_path(e.path)}` is {dtype}.",
                   "dtypes must match exactly (no silent casts): build both with the "
                   "same param_dtype.")
    else:
      pairs.append((e, e.path, leaf))
  for path, leaf in theirs.items():
    if path not in used:
      problems.add(f"nnx `{format_path(path)}` ({_describe(leaf)}) matches no variable "
                   "of ours.", _FIX_UNUSED)
  return pairs


def from_nnx(model, source, *, collections: Any = None):
  """Loads the variables of a flax.nnx Module (or State) into ``model``, in place.

  Variables match by path (ours and nnx's are the same: attribute names, list
  indices, dict keys) and by collection (``nnx.Param`` <-> ``sr.Param``,
  ``nnx.BatchStat`` <-> ``sr.BatchStat``, other kinds by linen's collection name).
  Shapes and dtypes must match exactly; a stacked variable is copied whole, so
  nnx's scan-over-layers modules (built under ``nnx.vmap``, ``(L, ...)`` arrays)
  map to our stacks with the layer axis at 0. RNG state is skipped unless
  ``collections`` names ``"rngs"`` (nnx's ``Dropout`` keeps its stream elsewhere
  than ours). Everything is checked first; on a mismatch ``InteropError`` names
  every variable that does not fit and the model is unchanged.

  Args:
    model: our module.
    source: an nnx Module, or an nnx State (``nnx.state(module)``; a State of raw
      arrays works too, its kinds unchecked).
    collections: only these collections (names or kinds). Default: every non-RNG
      collection of ours and of ``source``; each must map completely.

  Returns:
    ``model``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> from flax import nnx
  >>> theirs = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
  >>> ours = sr.interop.from_nnx(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)), theirs)
  >>> bool((ours.kernel.value == theirs.kernel[...]).all())
  True
  """
  what = "sr.interop.from_nnx"
  flat, _ = _flat_nnx(source, what)
  problems = Problems(what, "the model is unchanged")
  pairs = _match(model, flat, collections, what, problems)
  problems.raise_if_any()
  update(model, State({path: placed_like(e.var, _value(leaf))
                      for e, path, leaf in pairs}))
  return model


def to_nnx(model, target, *, collections: Any = None):
  """Writes ``model``'s variables into a flax.nnx Module (in place) or State (a copy).

  The reverse of ``from_nnx``, with the same matching rules. Given an nnx Module,
  its variables are updated in place (``nnx.update``); given an nnx State, a new
  State is returned and the one given is left as it is. Everything is checked
  first; on a mismatch ``InteropError`` names every variable that does not fit and
  the target is unchanged.

  Args:
    model: our module.
    target: an nnx Module, or an nnx State.
    collections: only these collections (names or kinds). Default: every non-RNG
      collection of ours and of ``target``; each must map completely.

  Returns:
    the nnx State of the target with our values in it (for a Module,
    ``nnx.state(target)`` after the update).

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> from flax import nnx
  >>> ours = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> theirs = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
  >>> _ = sr.interop.to_nnx(ours, theirs)
  >>> bool((theirs.kernel[...] == ours.kernel.value).all())
  True
  """
  what = "sr.interop.to_nnx"
  nnx = _nnx()
  flat, is_module = _flat_nnx(target, what)
  problems = Problems(what, "the nnx target is unchanged")
  pairs = _match(model, flat, collections, what, problems)
  problems.raise_if_any()
  values = {path: e.var.value for e, path, _ in pairs}
  if is_module:
    nnx.update(target, nnx.from_flat_state(list(values.items())))
    return nnx.state(target)
  return nnx.from_flat_state([
      (path, leaf if path not in values
       else leaf.replace(values[path]) if isinstance(leaf, nnx.Variable)
       else values[path])
      for path, leaf in flat.items()])
