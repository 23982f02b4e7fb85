"""flax.linen variables <-> our modules: ``from_linen`` and ``to_linen``.

linen variables are nested dicts, ``{collection: {module name: ... {name: array}}}``,
so nothing here imports flax. The names and layer axes come from ``_paths``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from ..core._split_merge import update
from ..core._state import State
from ._paths import (Entry, entries, flat_tree, nearest, placed_like,
                     select_collections)
from ._report import Problems, array_str, keys_str, shape_str, where_str

_FIX_NAMES = (
    "name the linen submodules after our attributes (in a compact method "
    "`nn.Dense(..., name='linear')`, in setup `self.linear = nn.Dense(...)`); a list "
    "attribute `layers` is linen's `layers_0`, `layers_1`, ... (see sr.interop).")
_FIX_UNUSED = ("every linen entry needs a variable of ours at the same path: add the "
               "layer to our model, drop the entry, or transfer fewer collections with "
               "collections=(...).")
_FIX_STACK = ("a stacked variable takes linen's nn.scan layout (one layer axis) or "
              "nn.remat_scan's (nested layer axes whose product is the layer count) at "
              "our layer axis; check the layer count and the per-layer shapes.")
_FIX_SHAPE = ("build our layers with the linen model's sizes (features, kernel sizes, "
              "vocabulary, ...).")
_FIX_DTYPE = ("dtypes must match exactly (no silent casts): cast the linen arrays "
              "(`jax.tree.map(lambda x: x.astype(...), variables)`) or build our model "
              "with that param_dtype.")


def _is_leaf(node) -> bool:
  return not isinstance(node, Mapping)


def _linen_str(collection: str, path: tuple) -> str:
  return "/".join((collection,) + tuple(str(k) for k in path))


def _linen_entries(model, collections, what: str, problems: Problems) -> list[Entry]:
  """Our non-RNG variables in the chosen collections; linen name clashes reported."""
  want = select_collections(collections, what)
  if want is not None and "rngs" in want:
    raise ValueError(
        f"{what}: collections= names 'rngs', but RNG state is not part of linen "
        "variables (linen takes keys in `init`/`apply(..., rngs=...)`). Leave it out.")
  chosen = [e for e in entries(model, what)
            if e.collection != "rngs" and (want is None or e.collection in want)]
  seen: dict[tuple, Entry] = {}
  for e in chosen:
    key = (e.collection,) + e.linen
    for n in range(2, len(key) + 1):
      other = seen.get(key[:n])
      if other is not None:
        problems.add(
            f"{e.where()} and {other.where()} both map to linen "
            f"`{_linen_str(key[0], key[1:n])}`.",
            "rename one attribute: linen joins a list or dict attribute's name and "
            "keys with `_`, so `layers[0]` and an attribute `layers_0` collide.")
        break
    else:
      seen[key] = e
  prefixes = {k[:n] for k in seen for n in range(2, len(k))}
  for key, e in seen.items():
    if key in prefixes:
      problems.add(f"{e.where()} maps to linen `{_linen_str(key[0], key[1:])}`, where "
                   "another of our variables needs a submodule of that name.",
                   "rename one of the two attributes.")
  return chosen


def _check_variables(variables, what: str) -> None:
  if not isinstance(variables, Mapping) or not all(
      isinstance(v, Mapping) for v in variables.values()):
    raise TypeError(
        f"{what} takes linen variables: a dict of collections such as "
        "{'params': {...}, 'batch_stats': {...}} (what `linen_model.init` returns), "
        f"got {type(variables).__name__}"
        + (" whose values are not all dicts" if isinstance(variables, Mapping) else "")
        + ". Pass the whole variables dict (wrap bare params as {'params': params}).")


def from_linen(model, variables: Mapping, *, collections: Any = None):
  """Loads flax.linen variables into ``model``, in place, by name; returns ``model``.

  Each of our variables takes the linen entry at its collection and linen name (see
  ``sr.interop`` for the rules): ``sr.Param`` from ``params``, ``sr.BatchStat`` from
  ``batch_stats``, other kinds from their ``collection``; RNG state is not part of
  linen variables and is left as it is. A stacked variable (class form of
  ``sr.scan`` / ``sr.remat_scan`` / ``sr.vmap``) takes linen's ``nn.scan`` layout
  (``(L, ...)``) or ``nn.remat_scan``'s (``(a, b, ..., ...)`` with ``a * b * ... ==
  L``), whatever our own ``lengths``. Shapes and dtypes must match exactly. The
  model then holds linen's arrays (placed like the ones they replace), not copies.

  Everything is checked before anything is written: a missing, unused or misplaced
  linen entry, or a shape or dtype that differs, raises ``InteropError`` naming each
  one, and leaves the model unchanged.

  Args:
    model: our module (``sr.Module``).
    variables: linen variables, ``{"params": {...}, "batch_stats": {...}}``.
    collections: transfer only these collections (names such as ``"params"`` or
      kinds such as ``sr.Param``). Default: every collection of ours and of
      ``variables``; each must map completely.

  >>> import jax, jax.numpy as jnp, flax.linen as nn, statefulremat as sr
  >>> class Net(sr.Module):
  ...   def __init__(self, rngs):
  ...     self.layers = [sr.nn.Linear(2, 4, rngs=rngs), sr.nn.Linear(4, 1, rngs=rngs)]
  >>> linen_net = nn.Sequential([nn.Dense(4), nn.Dense(1)])  # `layers_0`, `layers_1`
  >>> variables = linen_net.init(jax.random.key(0), jnp.ones((1, 2)))
  >>> net = sr.interop.from_linen(Net(sr.Rngs(0)), variables)
  >>> bool((net.layers[1].kernel.value == variables["params"]["layers_1"]["kernel"]).all())
  True
  """
  what = "sr.interop.from_linen"
  _check_variables(variables, what)
  problems = Problems(what, "the model is unchanged")
  ours = _linen_entries(model, collections, what, problems)
  want = select_collections(collections, what)
  if want is None:
    want = {e.collection for e in ours} | set(variables)
  flats: dict[str, dict] = {}

  def flat(c):
    if c not in flats:
      flats[c] = flat_tree(variables[c], _is_leaf)
    return flats[c]

  absent = set()
  for c in sorted(want - set(variables)):
    mine = [e for e in ours if e.collection == c]
    if mine:
      absent.add(c)
      problems.add(
          f"linen variables have no `{c}` collection (they have: "
          f"{keys_str(variables)}), but ours has {len(mine)} variable(s) in it: "
          f"{where_str(mine)}.",
          "pass the whole variables dict (every collection `init` returned), or load "
          "only some with collections=('params',).")
  used: set[tuple] = set()
  new: dict[tuple, Any] = {}
  for e in ours:
    c = e.collection
    if c in absent:
      continue
    if e.linen in flat(c):
      used.add((c, e.linen))
      value = _from_linen_value(e, flat(c)[e.linen], _linen_str(c, e.linen), problems)
      if value is not None:
        new[e.path] = value
      continue
    elsewhere = [o for o in variables if o != c and e.linen in flat(o)]
    if elsewhere:
      used.add((elsewhere[0], e.linen))
      problems.add(
          f"{e.where()} belongs to collection `{c}`, but linen has it as "
          f"`{_linen_str(elsewhere[0], e.linen)}` (collection `{elsewhere[0]}`).",
          "keep each variable in its kind's collection (sr.Param <-> params, "
          "sr.BatchStat <-> batch_stats); in linen, `self.variable('batch_stats', ...)`.")
      continue
    prefix, below = nearest(flat(c), e.linen)
    problems.add(f"{e.where()}: linen has no `{_linen_str(c, e.linen)}` "
                 f"(`{_linen_str(c, prefix)}` has: {keys_str(below)}).", _FIX_NAMES)
  for c in sorted(want & set(variables), key=str):
    for path, value in flat(c).items():
      if (c, path) not in used:
        problems.add(f"linen `{_linen_str(c, path)}` ({array_str(value)}) matches no "
                     "variable of ours.", _FIX_UNUSED)
  problems.raise_if_any()
  update(model, State(new))
  return model


def _from_linen_value(e: Entry, value, where: str, problems: Problems):
  """``value`` in our layout (layer axes flattened), or None after adding a problem."""
  unbox = getattr(value, "unbox", None)  # linen's nn.Partitioned & co. box arrays
  if callable(unbox):
    value = unbox()
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is None or dtype is None:
    problems.add(f"{e.where()}: linen `{where}` is a {type(value).__name__}, not an "
                 "array.")
    return None
  shape, ours = tuple(shape), e.shape
  if shape != ours and not _nested_layout(e, shape):
    layers = (f" ({ours[e.axis]} layers on axis {e.axis})" if e.axis is not None
              else "")
    problems.add(f"{e.where()}: shape mismatch: ours is {shape_str(ours)}{layers}, "
                 f"linen `{where}` is {shape_str(shape)}.",
                 _FIX_STACK if e.axis is not None else _FIX_SHAPE)
    return None
  if dtype != e.dtype:
    problems.add(f"{e.where()}: dtype mismatch: ours is {e.dtype}, linen `{where}` is "
                 f"{dtype}.", _FIX_DTYPE)
    return None
  value = jnp.asarray(value)
  return placed_like(e.var, value if shape == ours else value.reshape(ours))


def _nested_layout(e: Entry, shape: tuple) -> bool:
  """Whether ``shape`` is ours with the layer axis split into nested layer axes."""
  if e.axis is None:
    return False
  a, ours = e.axis, e.shape
  k = len(shape) - len(ours) + 1
  return (k >= 2 and shape[:a] == ours[:a] and shape[a + k:] == ours[a + 1:]
          and math.prod(shape[a:a + k]) == ours[a])


def to_linen(model, *, collections: Any = None, flat_stacks: bool = False) -> dict:
  """``model``'s variables as flax.linen variables: ``{"params": {...}, ...}``.

  The reverse of ``from_linen``, with the same names (see ``sr.interop``). A
  ``sr.remat_scan`` stack gives linen's ``nn.remat_scan`` layout, its flat layer axis
  split into ``lengths``; a ``sr.scan`` / ``sr.vmap`` stack (or any stack, with
  ``flat_stacks=True``) gives the ``nn.scan`` layout, one layer axis. RNG state is
  left out. The arrays are ours, not copies (JAX arrays are immutable; but donating
  them to a jitted function, ``donate_argnums``, would delete our model's buffers).

  Args:
    model: our module.
    collections: only these collections (names or kinds); default all but RNG state.
    flat_stacks: one flat layer axis for ``remat_scan`` stacks too.

  Returns:
    a dict of plain dicts, for ``linen_model.apply(variables, ...)``.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> Deep = sr.remat_scan(sr.nn.Linear, lengths=(2, 3))
  >>> deep = Deep(4, 4, rngs=sr.Rngs(0))
  >>> jax.tree.map(jnp.shape, sr.interop.to_linen(deep))
  {'params': {'bias': (2, 3, 4), 'kernel': (2, 3, 4, 4)}}
  >>> jax.tree.map(jnp.shape, sr.interop.to_linen(deep, flat_stacks=True))["params"]
  {'bias': (6, 4), 'kernel': (6, 4, 4)}
  """
  what = "sr.interop.to_linen"
  problems = Problems(what, "no variables were returned")
  ours = _linen_entries(model, collections, what, problems)
  problems.raise_if_any()
  out: dict[str, dict] = {}
  for e in ours:
    node = out.setdefault(e.collection, {})
    for name in e.linen[:-1]:
      node = node.setdefault(name, {})
    value = e.var.value
    shape = e.linen_shape(flat=flat_stacks)
    node[e.linen[-1]] = value if shape == e.shape else jnp.reshape(value, shape)
  return out
