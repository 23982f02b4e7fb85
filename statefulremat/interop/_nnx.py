"""flax.nnx modules and States <-> our modules: ``from_nnx`` and ``to_nnx``.

Our paths are nnx's paths (attribute names, list indices, dict keys), so variables
match by path; kinds match by collection (``nnx.Param`` is ``params``, as linen
names it). flax is imported on the first call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from ..core._errors import format_path
from ._hints import report_unmatched
from ._names import Match, Source, answers, fits, load, match
from ._paths import Entry, dotted, entries, flat_tree, select_collections
from ._report import Problems, array_str, has_no, where_str

_FIX_NAMES = (
  "give the nnx module the same attribute names and nesting as ours "
  "(lists as `nnx.List`, index `i` <-> our `[i]`; a list of layers fills our "
  "stack at the same path), or map nnx's names to ours with rename=."
)
_FIX_UNUSED = (
  "every nnx variable needs one of ours at the same path: add the layer "
  "to our model, or transfer fewer collections with collections=(...)."
)
_FIXES = (  # a shape, a dtype that differs
  "build both with the same sizes (a stack's layer axis must sit where the nnx module keeps it).",
  "dtypes must match exactly (no silent casts): build both with the same param_dtype.",
)


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
    return flat_tree(nnx.state(source)), True
  if isinstance(source, Mapping):
    return flat_tree(source), False
  raise TypeError(
    f"{what} takes an nnx Module or an nnx State (`nnx.state(module)`), got "
    f"{type(source).__name__}."
  )


def _match(model, flat: dict, collections, rename, what: str, problems: Problems) -> Match:
  """Our variables in the chosen collections matched with ``flat``'s, problems added;
  only the fills whose shapes and dtypes fit are kept."""
  want = select_collections(collections, what)
  ours = entries(model, what)
  kinds = {path: _collection(leaf) for path, leaf in flat.items()}
  if want is None:
    seen = {e.collection for e in ours} | {c for c in kinds.values() if c is not None}
    want = seen - {"rngs"}
  ours = [e for e in ours if e.collection in want]
  theirs = {path for path, c in kinds.items() if c is None or c in want}
  present = {kinds[path] for path in theirs}
  if None not in present:  # raw arrays (a State of them) may be of any collection
    for c in sorted(want - present):
      mine = [e for e in ours if e.collection == c]
      if mine:
        problems.add(
          f"the nnx side has no variables of collection `{c}`, but ours has "
          f"{len(mine)}: {where_str(mine)}.",
          "pass the whole nnx module or state, or transfer only some collections "
          "with collections=('params',).",
        )
    ours = [e for e in ours if e.collection in present]  # the rest is reported above
  sources = [
    Source(path, dotted(path), f"nnx `{format_path(path)}`", leaf, kinds[path], path not in theirs)
    for path, leaf in flat.items()
  ]
  found = match(ours, sources, _names, rename, problems, "nnx")

  def missing(e: Entry) -> str:
    if rename is None:
      return "nnx " + has_no(flat, e.path, format_path)
    return f"no nnx variable is renamed to {answers(e, _names)}."

  report_unmatched(found, missing, _describe, (_FIX_NAMES, _FIX_UNUSED))
  for e, s in found.wrong:
    problems.add(
      f"{e.where()} belongs to collection `{e.collection}`, but nnx has a "
      f"{type(s.leaf).__name__} there (collection `{s.collection}`).",
      "use the same variable kinds on both sides (sr.Param <-> nnx.Param, "
      "sr.BatchStat <-> nnx.BatchStat).",
    )
  fit = lambda e, given: all(_value_of(e, s, layer, problems) is not None for s, layer in given)
  found.fills = [(e, given) for e, given in found.fills if fit(e, given)]
  return found


def _names(e: Entry, layer: int | None) -> list[str]:
  return [e.dotted(layer)]


def _value_of(e: Entry, s: Source, layer: int | None, problems: Problems):
  """``s``'s value (one layer's, with ``layer``) if it has ``e``'s shape and dtype;
  None after adding the problem."""
  value = s.layer_of(_value(s.leaf), e.where(), problems)
  note = "" if layer is None else " per layer"
  return value if value is not None and fits(e, s, layer, value, problems, _FIXES, note) else None


def from_nnx(model, source, *, collections: Any = None, rename: Any = None):
  r"""Loads the variables of a flax.nnx Module (or State) into ``model``, in place.

  Variables match by path (ours and nnx's are the same: attribute names, list
  indices, dict keys), after ``rename``, and by collection (``nnx.Param`` <->
  ``sr.Param``, ``nnx.BatchStat`` <-> ``sr.BatchStat``, other kinds by linen's
  collection name). Shapes and dtypes must match exactly. A stacked variable takes
  either a stacked array at its path (nnx's scan-over-layers modules, built under
  ``nnx.vmap``: ``(L, ...)`` arrays, the layer axis at 0) or a list of layers there
  (``blocks[0]`` … ``blocks[L-1]``, an ``nnx.List`` or a list), one slice per layer;
  a pattern stack's layer ``i`` is ``blocks[i]`` (as ``stack.layer(i)``), and our list
  of layers takes a stacked nnx array at its path, one index per layer.
  RNG state is skipped unless ``collections`` names ``"rngs"`` (nnx's ``Dropout``
  keeps its stream elsewhere than ours). Everything is checked first; on a mismatch
  ``sr.StateMismatchError`` names every variable that does not fit (with the nearest names)
  and the model is unchanged.

  Args:
    model: our module.
    source: an nnx Module, or an nnx State (``nnx.state(module)``; a State of raw
      arrays works too, its kinds unchecked).
    collections: only these collections (names or kinds). Default: every non-RNG
      collection of ours and of ``source``; each must map completely.
    rename: nnx's path, dot-joined with list indices as numbers
      (``layers.3.linear.kernel``), to ours (for layer 3 of our stack at ``blocks``:
      ``blocks.3.linear.kernel``): a callable (returning None leaves the entry out)
      or a mapping of regular expressions to replacements, applied in order like
      ``re.sub``.

  Returns:
    ``model``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> from flax import nnx
  >>> theirs = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
  >>> ours = sr.interop.from_nnx(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)), theirs)
  >>> bool((ours.kernel.value == theirs.kernel[...]).all())
  True

  A list of nnx layers into our stack of them, renamed on the way:

  >>> class Layers(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs) for _ in range(4)])
  >>> class Ours(sr.Module):
  ...   def __init__(self, rngs):
  ...     self.blocks = sr.vmap(sr.nn.Linear, axis_size=4)(3, 3, rngs=rngs)
  >>> theirs = Layers(nnx.Rngs(1))
  >>> ours = sr.interop.from_nnx(Ours(sr.Rngs(0)), theirs,
  ...                            rename={r"^layers\.": "blocks."})
  >>> ours.blocks.kernel.value.shape
  (4, 3, 3)
  >>> bool((ours.blocks.kernel.value[2] == theirs.layers[2].kernel[...]).all())
  True
  """
  what = "sr.interop.from_nnx"
  flat, _ = _flat_nnx(source, what)
  problems = Problems(what, "the model is unchanged")
  return load(model, _match(model, flat, collections, rename, what, problems), _value_of)


def to_nnx(model, target, *, collections: Any = None, rename: Any = None):
  """Writes ``model``'s variables into a flax.nnx Module (in place) or State (a copy).

  The reverse of ``from_nnx``, with the same matching rules and the same ``rename``
  (the target's names, renamed, find ours): a list of layers in the target (an
  ``nnx.List`` at our stack's path) gets one layer of our stack each. Given an nnx
  Module, its variables are updated in place (``nnx.update``); given an nnx State,
  a new State is returned and the one given is left as it is. Everything is checked
  first; on a mismatch ``sr.StateMismatchError`` names every variable that does not fit and
  the target is unchanged.

  Args:
    model: our module.
    target: an nnx Module, or an nnx State.
    collections: only these collections (names or kinds). Default: every non-RNG
      collection of ours and of ``target``; each must map completely.
    rename: the target's path, dot-joined, to ours, as in ``from_nnx``.

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
  found = _match(model, flat, collections, rename, what, problems)
  problems.raise_if_any()
  values: dict = {}
  layers: dict = {}  # a stacked nnx array written from layers of ours: {path: {index: value}}
  for e, given in found.fills:
    for s, layer in given:
      value = e.var.value if layer is None else jnp.take(e.var.value, layer, e.axis)
      if s.index is None:
        values[s.key] = value
      else:
        layers.setdefault(s.key, {})[s.index] = value
  for path, parts in layers.items():
    values[path] = jnp.stack([parts[i] for i in range(len(parts))])
  if is_module:
    nnx.update(target, nnx.from_flat_state(list(values.items())))
    return nnx.state(target)

  def replaced(path, leaf):
    if path not in values:
      return leaf
    return leaf.replace(values[path]) if isinstance(leaf, nnx.Variable) else values[path]

  return nnx.from_flat_state([(path, replaced(path, leaf)) for path, leaf in flat.items()])
