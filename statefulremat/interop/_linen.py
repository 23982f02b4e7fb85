"""flax.linen variables <-> our modules: ``from_linen`` and ``to_linen``.

linen variables are nested dicts, ``{collection: {module name: ... {name: array}}}``,
so nothing here imports flax. The names and layer axes come from ``_paths``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from ._hints import report_unmatched
from ._names import Source, answers, array_of, fits, layer_note, load, made_names, match
from ._paths import Entry, chosen_entries, dotted, flat_tree, select_collections
from ._report import Problems, array_str, has_no, keys_str, where_str

_FIX_NAMES = (
  "name the linen submodules after our attributes (in a compact method "
  "`nn.Dense(..., name='linear')`, in setup `self.linear = nn.Dense(...)`); a list "
  "attribute `layers` is linen's `layers_0`, `layers_1`, ..., which also fill our "
  "stack at `layers`; or map linen's names (`Dense_0`) to ours with rename= (see "
  "sr.interop)."
)
_FIX_UNUSED = (
  "every linen entry needs a variable of ours at the same path: add the "
  "layer to our model, drop the entry, or transfer fewer collections with "
  "collections=(...)."
)
_FIX_STACK = (
  "a stacked variable takes linen's nn.scan layout (one layer axis) or "
  "nn.remat_scan's (nested layer axes whose product is the layer count) at "
  "our layer axis; check the layer count and the per-layer shapes."
)
_FIX_SHAPE = (
  "build our layers with the linen model's sizes (features, kernel sizes, vocabulary, ...)."
)
_FIX_DTYPE = (
  "dtypes must match exactly (no silent casts): cast the linen arrays "
  "(`jax.tree.map(lambda x: x.astype(...), variables)`) or build our model "
  "with that param_dtype."
)


def _linen_str(collection: str, path: tuple) -> str:
  return "/".join((collection,) + tuple(str(k) for k in path))


def _linen_entries(model, collections, what: str, problems: Problems):
  """The collections chosen (None: all) and our variables in them, RNG state left out;
  linen name clashes reported."""
  want = select_collections(collections, what)
  if want is not None and "rngs" in want:
    raise ValueError(
      f"{what}: collections= names 'rngs', but RNG state is not part of linen "
      "variables (linen takes keys in `init`/`apply(..., rngs=...)`). Leave it out."
    )
  chosen = chosen_entries(model, want, what)
  seen: dict[tuple, Entry] = {}
  for e in chosen:
    key = (e.collection,) + e.linen
    taken = next((key[:n] for n in range(2, len(key) + 1) if key[:n] in seen), None)
    if taken is None:
      seen[key] = e
    else:
      problems.add(
        f"{e.where()} and {seen[taken].where()} both map to linen `{_linen_str(taken[0], taken[1:])}`.",
        "rename one attribute: linen joins a list or dict attribute's name and "
        "keys with `_`, so `layers[0]` and an attribute `layers_0` collide.",
      )
  prefixes = {k[:n] for k in seen for n in range(2, len(k))}
  for key, e in seen.items():
    if key in prefixes:
      problems.add(
        f"{e.where()} maps to linen `{_linen_str(key[0], key[1:])}`, where "
        "another of our variables needs a submodule of that name.",
        "rename one of the two attributes.",
      )
  return want, chosen


def _check_variables(variables, what: str) -> None:
  if not isinstance(variables, Mapping) or not all(
    isinstance(v, Mapping) for v in variables.values()
  ):
    raise TypeError(
      f"{what} takes linen variables: a dict of collections such as "
      "{'params': {...}, 'batch_stats': {...}} (what `linen_model.init` returns), "
      f"got {type(variables).__name__}"
      + (" whose values are not all dicts" if isinstance(variables, Mapping) else "")
      + ". Pass the whole variables dict (wrap bare params as {'params': params})."
    )


def from_linen(model, variables: Mapping, *, collections: Any = None, rename: Any = None):
  r"""Loads flax.linen variables into ``model``, in place, by name; returns ``model``.

  Each of our variables takes the linen entry at its collection and linen name (see
  ``sr.interop`` for the rules): ``sr.Param`` from ``params``, ``sr.BatchStat`` from
  ``batch_stats``, other kinds from their ``collection``; RNG state is not part of
  linen variables and is left as it is. A stacked variable (class form of
  ``sr.scan`` / ``sr.remat_scan`` / ``sr.vmap``) takes linen's ``nn.scan`` layout
  (``(L, ...)``) or ``nn.remat_scan``'s (``(a, b, ..., ...)`` with ``a * b * ... ==
  L``), whatever our own ``lengths``, or a list of layers at the stack's name
  (``blocks_0`` … ``blocks_{L-1}``, as linen's ``setup`` names a list; a pattern
  stack's layer ``i``, ``stack.layer(i)``, is ``blocks_i``); a list of layers of ours
  takes an ``nn.scan`` stack at its name, one index of the layer axis each. Shapes and
  dtypes must match exactly. The model then holds linen's arrays (placed like the
  ones they replace), not copies.

  Everything is checked before anything is written: a missing, unused or misplaced
  linen entry, or a shape or dtype that differs, raises ``sr.StateMismatchError`` naming each
  one (with the nearest names), and leaves the model unchanged.

  Args:
    model: our module (``sr.Module``).
    variables: linen variables, ``{"params": {...}, "batch_stats": {...}}``.
    collections: transfer only these collections (names such as ``"params"`` or
      kinds such as ``sr.Param``). Default: every collection of ours and of
      ``variables``; each must map completely.
    rename: linen's name inside its collection, dot-joined
      (``ScanLRNNCell_0.Dense_0.kernel``), to ours: a callable (returning None leaves
      the entry out) or a mapping of regular expressions to replacements, applied
      in order like ``re.sub``. Ours is our path (``layers.0.kernel``; for layer 3 of
      a stack at ``blocks``, ``blocks.3.linear.kernel``) or its linen name
      (``layers_0.kernel``, ``blocks_3.linear.kernel``). The collection is matched by
      kind, not renamed.

  Returns:
    ``model`` itself, now holding linen's arrays.

  Raises:
    sr.StateMismatchError: a linen entry is missing, unused or misplaced, or its shape
      or dtype differs from ours (each named; the model is unchanged).
    TypeError: ``variables`` is not a dict of collections.
    ValueError: ``collections`` names ``"rngs"``, which linen variables do not hold.

  >>> import jax, jax.numpy as jnp, flax.linen as nn, statefulremat as sr
  >>> class Net(sr.Module):
  ...   def __init__(self, rngs):
  ...     self.layers = [sr.nn.Linear(2, 4, rngs=rngs), sr.nn.Linear(4, 1, rngs=rngs)]
  >>> linen_net = nn.Sequential([nn.Dense(4), nn.Dense(1)])  # `layers_0`, `layers_1`
  >>> variables = linen_net.init(jax.random.key(0), jnp.ones((1, 2)))
  >>> net = sr.interop.from_linen(Net(sr.Rngs(0)), variables)
  >>> bool((net.layers[1].kernel.value == variables["params"]["layers_1"]["kernel"]).all())
  True

  Automatic names (``Dense_0``) map by ``rename``:

  >>> class Compact(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     x = jax.nn.relu(nn.Dense(4)(x))  # Dense_0
  ...     return nn.Dense(1)(x)  # Dense_1
  >>> variables = Compact().init(jax.random.key(1), jnp.ones((1, 2)))
  >>> net = sr.interop.from_linen(Net(sr.Rngs(0)), variables,
  ...                             rename={r"^Dense_(\d+)\.": r"layers.\1."})
  >>> bool((net.layers[0].bias.value == variables["params"]["Dense_0"]["bias"]).all())
  True

  An ``nn.scan`` stack into a list of layers, layer ``i`` from index ``i``:

  >>> class Block(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x, _):
  ...     return nn.Dense(2)(x), None
  >>> class Scanned(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
  ...                    length=2)(name="layers")(x, None)[0]
  >>> variables = Scanned().init(jax.random.key(2), jnp.ones((1, 2)))
  >>> class Listed(sr.Module):
  ...   def __init__(self, rngs):
  ...     self.layers = [sr.Module() for _ in range(2)]
  ...     for layer in self.layers:
  ...       layer.Dense_0 = sr.nn.Linear(2, 2, rngs=rngs)
  >>> net = sr.interop.from_linen(Listed(sr.Rngs(0)), variables)
  >>> bool((net.layers[1].Dense_0.kernel.value
  ...       == variables["params"]["layers"]["Dense_0"]["kernel"][1]).all())
  True
  """
  what = "sr.interop.from_linen"
  _check_variables(variables, what)
  problems = Problems(what, "the model is unchanged")
  want, ours = _linen_entries(model, collections, what, problems)
  if want is None:
    want = {e.collection for e in ours} | set(variables)
  for c in sorted(want - set(variables)):
    mine = [e for e in ours if e.collection == c]
    if mine:
      problems.add(
        f"linen variables have no `{c}` collection (they have: "
        f"{keys_str(variables)}), but ours has {len(mine)} variable(s) in it: "
        f"{where_str(mine)}.",
        "pass the whole variables dict (every collection `init` returned), or load "
        "only some with collections=('params',).",
      )
  flats = {c: flat_tree(tree) for c, tree in variables.items()}
  sources = [  # entries of collections not transferred are `extra`: never unused
    Source((c, path), dotted(path), f"linen `{_linen_str(c, path)}`", value, c, c not in want)
    for c, flat in flats.items()
    for path, value in flat.items()
  ]
  ours = [e for e in ours if e.collection in variables]  # the rest is reported above
  found = match(ours, sources, _names, rename, problems, "linen")

  def missing(e: Entry) -> str:
    c = e.collection
    if rename is None:
      return "linen " + has_no(flats[c], e.linen, lambda path: _linen_str(c, path))
    return f"no linen `{c}` entry is renamed to {answers(e, _names)}."

  describe = lambda leaf: array_str(_unboxed(leaf))
  report_unmatched(found, missing, describe, (_FIX_NAMES, _FIX_UNUSED))
  for e, s in found.wrong:
    problems.add(
      f"{e.where()} belongs to collection `{e.collection}`, but linen has it as "
      f"`{_linen_str(*s.key)}` (collection `{s.collection}`).",
      "keep each variable in its kind's collection (sr.Param <-> params, "
      "sr.BatchStat <-> batch_stats); in linen, `self.variable('batch_stats', ...)`.",
    )
  return load(model, found, _from_linen_value)


def _names(e: Entry, layer: int | None) -> list[str]:
  """The names ``e`` (or its layer) answers to: its linen name and our path."""
  linen, ours = ".".join(e.linen_name(layer)), e.dotted(layer)
  return [linen] if linen == ours else [linen, ours]


def _unboxed(value):
  unbox = getattr(value, "unbox", None)  # linen's nn.Partitioned & co. box arrays
  return unbox() if callable(unbox) else value


def _from_linen_value(e: Entry, s: Source, layer: int | None, problems: Problems):
  """The value of ``s`` in our layout (layer axes flattened), or None after adding a
  problem; with ``layer``, one layer's slice."""
  value = array_of(e, s, layer, _unboxed(s.leaf), problems)
  if value is None:
    return None
  shape, ours = tuple(value.shape), e.shape if layer is None else e.layer_shape()
  # linen's nn.remat_scan nests the layer axes: any split of ours fits.
  expected = shape if layer is None and _nested_layout(e, shape) else None
  fix = _FIX_STACK if e.axis is not None and layer is None else _FIX_SHAPE
  if not fits(e, s, layer, value, problems, (fix, _FIX_DTYPE), layer_note(e, layer), expected):
    return None
  value = jnp.asarray(value)
  return value if shape == ours else value.reshape(ours)


def _nested_layout(e: Entry, shape: tuple) -> bool:
  """Whether ``shape`` is ours with the layer axis split into nested layer axes."""
  if e.axis is None:
    return False
  a, ours = e.axis, e.shape
  k = len(shape) - len(ours) + 1
  return (
    k >= 2
    and shape[:a] == ours[:a]
    and shape[a + k :] == ours[a + 1 :]
    and math.prod(shape[a : a + k]) == ours[a]
  )


def to_linen(
  model,
  *,
  collections: Any = None,
  flat_stacks: bool = False,
  unstack: bool = False,
  rename: Any = None,
) -> dict:
  r"""``model``'s variables as flax.linen variables: ``{"params": {...}, ...}``.

  The reverse of ``from_linen``, with the same names (see ``sr.interop``). A
  ``sr.remat_scan`` stack gives linen's ``nn.remat_scan`` layout, its flat layer axis
  split into ``lengths``; a ``sr.scan`` / ``sr.vmap`` stack (or any stack, with
  ``flat_stacks=True``) gives the ``nn.scan`` layout, one layer axis; with
  ``unstack=True``, a list of layers (``blocks_0`` … ``blocks_{L-1}``, as linen's
  ``setup`` names a list of submodules). RNG state is left out. The arrays are ours,
  not copies (JAX arrays are immutable; but donating them to a jitted function,
  ``donate_argnums``, would delete our model's buffers).

  Args:
    model: our module.
    collections: only these collections (names or kinds); default all but RNG state.
    flat_stacks: one flat layer axis for ``remat_scan`` stacks too.
    unstack: each stacked variable as a list of layers.
    rename: here the names are made, so it goes from ours to linen's: it takes our
      dot-joined path (``layers.0.kernel``; with ``unstack``, layer 3 of a stack at
      ``blocks`` is ``blocks.3.linear.kernel``) and returns linen's name inside the
      collection, dot-joined (``Dense_0.kernel``; None leaves the variable out). A
      callable, or a mapping of regular expressions applied in order like ``re.sub``.

  Returns:
    a dict of plain dicts, for ``linen_model.apply(variables, ...)``.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> Deep = sr.remat_scan(sr.nn.Linear, lengths=(2, 3))
  >>> deep = Deep(4, 4, rngs=sr.Rngs(0))
  >>> jax.tree.map(jnp.shape, sr.interop.to_linen(deep))
  {'params': {'bias': (2, 3, 4), 'kernel': (2, 3, 4, 4)}}
  >>> jax.tree.map(jnp.shape, sr.interop.to_linen(deep, flat_stacks=True))["params"]
  {'bias': (6, 4), 'kernel': (6, 4, 4)}
  >>> sorted(sr.interop.to_linen(deep, unstack=True,
  ...                            rename={r"^(\d+)\.": r"Dense_\1."})["params"])
  ['Dense_0', 'Dense_1', 'Dense_2', 'Dense_3', 'Dense_4', 'Dense_5']
  """
  what = "sr.interop.to_linen"
  problems = Problems(what, "no variables were returned")
  _, ours = _linen_entries(model, collections, what, problems)
  problems.raise_if_any()
  # rename goes from our paths; without it, the names are linen's
  linen_name = lambda e, layer: ".".join(e.linen_name(layer))
  named = Entry.dotted if rename is not None else linen_name
  names = made_names(ours, unstack, named, rename, problems, "linen", nested=True)
  problems.raise_if_any()
  out: dict[str, dict] = {}
  for e, layer, name in names:
    node = out.setdefault(e.collection, {})
    plain = rename is None and (layer is None or e.pattern is None)
    *scope, last = e.linen_name(layer) if plain else name.split(".")
    for key in scope:
      node = node.setdefault(key, {})
    value = e.var.value
    if layer is not None:
      node[last] = jnp.take(value, layer, axis=e.axis)
    else:
      shape = e.linen_shape(flat=flat_stacks)
      node[last] = value if shape == e.shape else jnp.reshape(value, shape)
  return out
