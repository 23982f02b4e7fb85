"""State: the values of a module graph's variables, keyed by path.

A ``State`` is a pytree whose leaves are the arrays themselves, so ``jax.tree.map``,
optax and orbax take it as is. It also remembers, per entry, the Variable kind and its
metadata, which is what lets it be filtered (``state.filter(sr.Param)``), shown, and
merged back into modules. Paths are tuples of attribute names, list indices and dict
keys: ``("layers", 0, "kernel")``. Indexing walks them: ``state["layers"][0]["kernel"]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, overload

import jax

from . import _display_hooks
from ._errors import StateMismatchError, format_path
from ._filters import Filter, to_predicate
from ._variables import Variable, bare_variable


class _Frozen(tuple):
  """A frozen list or dict: a tuple that is never equal to a plain tuple (or the other
  kind), so ``thaw`` gives back exactly what was frozen."""

  __slots__ = ()

  def __eq__(self, other):
    return type(self) is type(other) and tuple.__eq__(self, other)

  def __ne__(self, other):
    return not self == other

  def __hash__(self):
    return hash((type(self).__name__, tuple(self)))


class _FrozenList(_Frozen):
  __slots__ = ()


class _FrozenDict(_Frozen):
  """``((key, frozen value), ...)`` in the dict's order."""

  __slots__ = ()


def freeze(value):
  """A hashable copy of a metadata value; ``thaw`` undoes it.

  Dicts keep their order (as Python dicts compare regardless of order, two dicts equal
  as dicts but in another order freeze unequal: a harmless cache miss at worst).
  """
  if isinstance(value, dict):
    return _FrozenDict((k, freeze(v)) for k, v in value.items())
  if isinstance(value, list):
    return _FrozenList(freeze(v) for v in value)
  if type(value) is tuple:
    return tuple(freeze(v) for v in value)
  hash(value)
  return value


def thaw(value):
  """The value ``freeze`` was given (lists and dicts again)."""
  if isinstance(value, _FrozenDict):
    return {k: thaw(v) for k, v in value}
  if isinstance(value, _FrozenList):
    return [thaw(v) for v in value]
  if type(value) is tuple:
    return tuple(thaw(v) for v in value)
  return value


def thaw_metadata(frozen) -> dict:
  """A Variable's metadata dict from its frozen form (``()`` means none)."""
  return {k: thaw(v) for k, v in frozen}


@dataclasses.dataclass(frozen=True, slots=True)
class _PathKey:
  """A pytree key entry for one State entry; prints as ``.layers[0].kernel``."""

  path: tuple

  def __str__(self):
    text = format_path(self.path)
    return text if text.startswith("[") else "." + text

  __repr__ = __str__


class _Spec:
  """What a State is besides its values: paths, kinds, metadata. Hashable."""

  __slots__ = ("paths", "kinds", "metas", "_hash")

  def __init__(self, paths: tuple, kinds: tuple, metas: tuple):
    self.paths, self.kinds, self.metas = paths, kinds, metas
    self._hash = None

  def __eq__(self, other):
    return isinstance(other, _Spec) and (
      self.paths == other.paths and self.kinds == other.kinds and self.metas == other.metas
    )

  def __hash__(self):
    if self._hash is None:
      self._hash = hash((self.paths, self.kinds, self.metas))
    return self._hash


class State(Mapping[Any, Any]):
  """The values of a set of variables, keyed by path; a pytree of arrays.

  ``sr.state`` and ``sr.split`` make one from a model; build one yourself from values
  keyed by path.

  Args:
    entries: the values, as ``{path_tuple: value}`` (``{("layers", 0, "kernel"): w}``)
      or as a nested dict (``{"layers": {0: {"kernel": w}}}``); None (the default) for
      an empty State.
    kinds: the Variable subclass of each path (``{("kernel",): sr.Param}``); None (the
      default) or a path left out: ``sr.Variable``.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  >>> state = sr.state(model)
  >>> state["kernel"].shape
  (2, 3)
  >>> sorted(state.flat())
  [('bias',), ('kernel',)]
  >>> doubled = jax.tree.map(lambda x: 2 * x, state)
  >>> bool((doubled["bias"] == 0).all())
  True
  """

  __slots__ = ("_spec", "_values")
  __hash__ = None  # type: ignore[assignment]

  def __init__(self, entries: Mapping | None = None, kinds: Mapping | None = None):
    """Builds a State from ``{path_tuple: value}`` or a nested dict of values.

    ``kinds`` optionally maps paths to Variable subclasses (default ``Variable``).
    Such a State knows no metadata; ``sr.merge`` takes kinds it does not know and the
    metadata from the GraphDef.
    """
    flat = {} if entries is None else _flatten_entries(entries)
    kinds = kinds or {}
    self._values = tuple(flat.values())
    self._spec = _Spec(tuple(flat), tuple(kinds.get(p, Variable) for p in flat), ((),) * len(flat))

  @classmethod
  def _make(cls, spec: _Spec, values) -> State:
    state = object.__new__(cls)
    state._spec = spec
    state._values = tuple(values)
    return state

  @classmethod
  def from_parts(cls, paths, kinds, metadata, values) -> State:
    """A State from its parts, one of each per entry: paths, Variable kinds, frozen
    metadata (as ``GraphDef.variables`` gives it) and values."""
    return cls._make(_Spec(tuple(paths), tuple(kinds), tuple(metadata)), values)

  def with_values(self, values) -> State:
    """The same entries (paths, kinds, metadata) holding ``values``, in order."""
    return State._make(self._spec, values)

  @classmethod
  def from_variables(cls, items) -> State:
    """A State from ``(path, variable)`` pairs."""
    items = list(items)
    paths = tuple(p for p, _ in items)
    kinds = tuple(type(v) for _, v in items)
    metas = tuple(freeze(v._metadata) for _, v in items)
    return cls._make(_Spec(paths, kinds, metas), [v._value for _, v in items])

  # -- reading ---------------------------------------------------------------

  def flat(self) -> dict[tuple[Any, ...], Any]:
    """``{path: value}`` for every entry, paths as full tuples.

    >>> import statefulremat as sr
    >>> class Net(sr.Module):
    ...   def __init__(self):
    ...     self.layers = [sr.nn.Linear(2, 3, rngs=sr.Rngs(0))]
    >>> {path: v.shape for path, v in sr.state(Net()).flat().items()}
    {('layers', 0, 'bias'): (3,), ('layers', 0, 'kernel'): (2, 3)}
    """
    return dict(zip(self._spec.paths, self._values))

  def flat_variables(self) -> dict[tuple[Any, ...], Variable[Any]]:
    """``{path: Variable}``: each entry as a fresh Variable of its kind and metadata.

    The Variables are new boxes, not the module's: setting their values changes
    neither the module nor this State.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> layer = sr.nn.Linear(2, 3, kernel_metadata={"sharding": ("embed", "mlp")},
    ...                      rngs=sr.Rngs(0))
    >>> kernel = sr.state(layer).flat_variables()[("kernel",)]
    >>> type(kernel).__name__, kernel.sharding, kernel is layer.kernel
    ('Param', ('embed', 'mlp'), False)
    """
    return {
      p: bare_variable(k, v, thaw_metadata(m), None)
      for p, k, v, m in zip(self._spec.paths, self._spec.kinds, self._values, self._spec.metas)
    }

  def __getitem__(self, key: Any) -> Any:  # a leaf (array) or a sub-State: the paths decide
    paths = self._spec.paths
    picked = [i for i, p in enumerate(paths) if p and p[0] == key]
    if not picked:
      raise KeyError(f"{key!r} is not in this State; its top-level keys are {list(self)}")
    if len(picked) == 1 and len(paths[picked[0]]) == 1:
      return self._values[picked[0]]
    return self._select(picked, strip=1)

  def __iter__(self) -> Iterator[Any]:
    return iter(dict.fromkeys(p[0] for p in self._spec.paths if p))

  def __len__(self) -> int:
    return len(dict.fromkeys(p[0] for p in self._spec.paths if p))

  def __contains__(self, key) -> bool:
    return any(p and p[0] == key for p in self._spec.paths)

  def _select(self, indices, strip: int = 0) -> State:
    s = self._spec
    return State.from_parts(
      [s.paths[i][strip:] for i in indices],
      [s.kinds[i] for i in indices],
      [s.metas[i] for i in indices],
      [self._values[i] for i in indices],
    )

  # -- filtering and merging -------------------------------------------------

  @overload
  def filter(self, filter: Filter, /) -> State: ...
  @overload
  def filter(self, f1: Filter, f2: Filter, /, *filters: Filter) -> tuple[State, ...]: ...
  def filter(self, *filters: Filter) -> State | tuple[State, ...]:
    """The entries matching each filter: one State, or a tuple for several filters.

    >>> import statefulremat as sr
    >>> state = sr.state(sr.nn.BatchNorm(3, rngs=sr.Rngs(0)))
    >>> sorted(state.filter(sr.BatchStat).flat())
    [('mean',), ('var',)]
    """
    if not filters:
      raise TypeError("State.filter needs at least one filter, e.g. state.filter(sr.Param)")
    items = list(self.flat_variables().items())
    out = [
      self._select([i for i, (p, v) in enumerate(items) if pred(p, v)])
      for pred in map(to_predicate, filters)
    ]
    return out[0] if len(out) == 1 else tuple(out)

  def split(self, *filters: Filter) -> tuple[State, ...]:
    """Partitions the entries: each goes to the first filter that matches it.

    Every entry must land somewhere (else ``StateMismatchError``); end with ``...``
    to catch the rest.

    >>> import statefulremat as sr
    >>> state = sr.state(sr.nn.BatchNorm(3, rngs=sr.Rngs(0)))
    >>> stats, rest = state.split(sr.BatchStat, ...)
    >>> sorted(stats.flat()), sorted(rest.flat())
    ([('mean',), ('var',)], [('bias',), ('scale',)])
    >>> state.split(sr.BatchStat)
    Traceback (most recent call last):
    statefulremat...StateMismatchError: the variable `bias` (Param, collection 'params')
    matches none of the filters ...
    """
    groups = partition(list(self.flat_variables().items()), filters)
    return tuple(self._select(g) for g in groups)

  @staticmethod
  def merge(*states: State) -> State:
    """One State holding the entries of all; on a shared path the later State wins.

    >>> import statefulremat as sr
    >>> model = sr.nn.BatchNorm(3, rngs=sr.Rngs(0))
    >>> params, stats = sr.state(model, sr.Param, sr.BatchStat)
    >>> len(sr.State.merge(params, stats).flat())
    4
    """
    entries: dict[tuple, tuple] = {}  # a path keeps its first place, takes its last entry
    for state in states:
      if not isinstance(state, State):
        raise TypeError(f"State.merge takes States, got {type(state).__name__}")
      s = state._spec
      for p, k, m, v in zip(s.paths, s.kinds, s.metas, state._values):
        entries[p] = (k, m, v)
    kinds, metas, values = zip(*entries.values()) if entries else ((), (), ())
    return State._make(_Spec(tuple(entries), kinds, metas), values)

  def __repr__(self) -> str:
    return _display_hooks.text(self)

  def _plain_repr(self) -> str:
    lines = [
      f"  {format_path(p)}: {k.__name__}({_display_hooks.value_summary(v)})"
      for p, k, v in zip(self._spec.paths, self._spec.kinds, self._values)
    ]
    return "State({\n" + "\n".join(lines) + "\n})" if lines else "State({})"

  def __treescope_repr__(self, path, subtree_renderer):
    return _display_hooks.treescope(self, path, subtree_renderer)

  # -- pickling ----------------------------------------------------------------

  def __getstate__(self):
    # Plain data (metadata thawed): a pickle names sr.State and the Variable kinds, never
    # this file's helpers (_Spec, _FrozenDict), so moving them breaks no pickle.
    spec = self._spec
    return spec.paths, spec.kinds, tuple(map(thaw, spec.metas)), self._values

  def __setstate__(self, state):
    paths, kinds, metas, values = state
    self._spec = _Spec(paths, kinds, tuple(map(freeze, metas)))
    self._values = values


def _flatten_entries(entries: Mapping) -> dict:
  if entries and all(isinstance(k, tuple) for k in entries):
    return dict(entries)
  flat = {}

  def walk(prefix, node):
    if isinstance(node, Mapping) and not isinstance(node, State):
      for k, v in node.items():
        walk(prefix + (k,), v)
    else:
      flat[prefix] = node

  walk((), entries)
  return flat


def partition(items: list[tuple[tuple, Variable]], filters) -> list[list[int]]:
  """Assigns each ``(path, variable)`` to the first filter that matches it."""
  predicates = [to_predicate(f) for f in filters] if filters else [to_predicate(...)]
  groups: list[list[int]] = [[] for _ in predicates]
  for i, (path, var) in enumerate(items):
    for group, pred in zip(groups, predicates):
      if pred(path, var):
        group.append(i)
        break
    else:
      raise StateMismatchError(
        f"the variable `{format_path(path)}` ({type(var).__name__}, collection "
        f"{var.collection!r}) matches none of the filters {filters!r}. Every variable "
        "must land in exactly one State: add a filter for it, or end the filters "
        "with `...` to collect the rest."
      )
  return groups


jax.tree_util.register_pytree_with_keys(
  State,
  lambda s: ([(_PathKey(p), v) for p, v in zip(s._spec.paths, s._values)], s._spec),
  lambda spec, values: State._make(spec, values),
  flatten_func=lambda s: (s._values, s._spec),
)
