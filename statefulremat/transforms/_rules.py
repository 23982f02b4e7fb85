"""Collection rules: how scan, remat_scan and vmap treat each variable (one of
stacked, broadcast, carry, rng, read-only; transforms/README.md), and the RNG streams."""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypedDict, cast

import jax
import jax.numpy as jnp

from ..core._bookkeeping import LAYER_INDEX, LAYER_KEYS
from ..core._errors import TransformError, format_path
from ..core._filters import filter_repr, is_everything, to_predicate
from ..core._frozen import EMPTY
from ..core._graph import flatten
from ..core._module import iter_graph
from ..core._rngs import LayerKeys, Rngs, RngStream
from ..core._stacks import cycle, stack_info
from ..core._variables import Variable, owner_chain

STACKED, BROADCAST, CARRY, RNG, READONLY = "stacked", "broadcast", "carry", "rng", "read-only"


def stream_predicate(filter) -> Callable[[str], bool]:
  """Turns a stream filter into a ``name -> bool`` predicate."""
  if filter is True or filter is Ellipsis:
    return lambda name: True
  if filter is False or filter is None:
    return lambda name: False
  if isinstance(filter, str):
    return lambda name: name == filter
  if isinstance(filter, (tuple, list)):
    preds = [stream_predicate(f) for f in filter]
    return lambda name: any(p(name) for p in preds)
  if callable(filter):
    return cast(Callable[[str], bool], filter)  # a user's `name -> bool` predicate
  raise TypeError(
    f"{filter!r} is not a stream filter: use True/False, a stream name such as "
    "'dropout', a tuple of names, or a name -> bool callable."
  )


def _explicit_names(filter) -> list[str]:
  if isinstance(filter, str):
    return [filter]
  if isinstance(filter, (tuple, list)):
    return [n for f in filter for n in _explicit_names(f)]
  return []


@dataclasses.dataclass(frozen=True)
class Collections:
  """A transform's four collection keywords as one frozen value, read by ``Rules``."""

  variable_axes: Mapping[Any, Any] = EMPTY
  variable_broadcast: Any = False
  variable_carry: Any = False
  split_rngs: Any = EMPTY


class StackOptions(TypedDict, total=False):
  """The keywords scan, remat_scan and vmap share, for their overloads."""

  variable_axes: Mapping[Any, Any]
  variable_broadcast: Any
  split_rngs: Mapping[Any, Any]
  metadata_params: Mapping[Any, Any]
  methods: Sequence[str] | None
  init_in_axes: Any


def public(options: dict) -> dict:
  """A transform's ``options`` as its public keywords (``variable_carry`` only when set)."""
  out = dict(options)
  out.update(vars(out.pop("collections")))
  if out["variable_carry"] is False:
    del out["variable_carry"]
  return out


class Rules:
  """The collection rules of one transform (transforms/README.md)."""

  def __init__(self, what: str, collections: Collections):
    variable_axes, variable_broadcast = collections.variable_axes, collections.variable_broadcast
    variable_carry, split_rngs = collections.variable_carry, collections.split_rngs
    self.what = what
    if not isinstance(variable_axes, Mapping):
      raise TypeError(
        f"{what}: variable_axes must map filters to axes, e.g. "
        f"`variable_axes={{sr.Param: 0}}`, got {variable_axes!r}."
      )
    for axis in variable_axes.values():
      if not isinstance(axis, int):
        raise TypeError(
          f"{what}: variable_axes values must be ints (the stacked axis), got {axis!r}."
        )
    self.axes = [(to_predicate(f), axis) for f, axis in variable_axes.items()]
    # Filters named on purpose; `{True: 0}` (every variable) yields to broadcast/carry.
    self.named_axes = [(to_predicate(f), f) for f in variable_axes if not is_everything(f)]
    self.broadcast = to_predicate(variable_broadcast)
    self.carry = to_predicate(variable_carry)
    entries = split_rngs.items() if isinstance(split_rngs, Mapping) else [(split_rngs, True)]
    self.split_entries = [(stream_predicate(f), bool(v), _explicit_names(f)) for f, v in entries]
    # Collection names typed into a rule, checked against the modules (Treatment).
    typed = [("variable_axes", f) for f in variable_axes]
    typed += [("variable_broadcast", variable_broadcast), ("variable_carry", variable_carry)]
    self.typed_collections = [(label, name) for label, f in typed for name in _explicit_names(f)]

  def for_init(self) -> Rules:
    """The rules of a class form's init: ``params`` split unless ``split_rngs`` says not."""
    if any(pred("params") for pred, _, _ in self.split_entries):
      return self
    rules = copy.copy(self)
    rules.split_entries = self.split_entries + [(lambda name: name == "params", True, ["params"])]
    return rules

  def stacked_axes(self, graphdef, variables, layer) -> dict[int, int]:
    """``{flat index: layer axis}`` of the variables of one layer these rules stack."""
    treatment = Treatment(self, graphdef, variables, [layer], rank_offset=1)
    return {i: treatment.stacked_axis(i) for i in treatment.indices(STACKED)}

  def seed_layer(self, layer, index, shared: set[int]) -> dict[int, Any]:
    """Seeds layer ``index``'s ``shared`` streams as in the stack: ``{flat index: before}``."""
    graphdef, variables = flatten([layer])
    treatment = Treatment(self, graphdef, variables, [layer], rank_offset=1)
    # A stream with one key per layer (stacked by the init) is the layer's own already.
    treatment.streams = [s for s in treatment.streams if s.key in shared]
    if not treatment.streams:
      return {}
    values = [v._value for v in variables]
    treatment.reseed(variables, values, jnp.uint32(index))
    return {i: values[i] for s in treatment.streams for i in (s.key, s.count)}

  def splits(self, name: str) -> bool:
    return next((value for pred, value, _ in self.split_entries if pred(name)), False)

  def splits_default(self, own_names: list[str]) -> bool:
    """Whether a ``default`` stream is split: as itself, or for a name it serves."""
    if self.splits("default"):
      return True
    return any(
      value and any(n not in own_names for n in names) for _, value, names in self.split_entries
    )

  def classify(self, path: tuple, var, shown: tuple | None = None) -> tuple[str, int | None]:
    """``(kind, axis)`` of the Variable at ``path``; ``shown``: the path messages name."""
    broadcast, carry = self.broadcast(path, var), self.carry(path, var)
    where = format_path(path if shown is None else shown)
    if broadcast and carry:
      raise TransformError(
        f"{self.what}: `{where}` ({type(var).__name__}) is matched by both "
        "variable_broadcast and variable_carry. A variable is either read-only in "
        "every iteration or carried from one to the next: narrow one of the filters."
      )
    if broadcast or carry:
      rule, role = (
        ("variable_broadcast", "read-only in every iteration")
        if broadcast
        else ("variable_carry", "carried from one iteration to the next")
      )
      for pred, f in self.named_axes:
        if pred(path, var):
          raise TransformError(
            f"{self.what}: `{where}` ({type(var).__name__}) is matched by "
            f"both variable_axes ({filter_repr(f)}: sliced per iteration) and {rule} "
            f"({role}). Choose one: narrow the variable_axes filter (e.g. "
            f"`sr.All({filter_repr(f)}, sr.Not(...))`) or the {rule} one."
          )
      return (BROADCAST if broadcast else CARRY), None
    for pred, axis in self.axes:
      if pred(path, var):
        return STACKED, axis
    return READONLY, None


def _known_collections(kind: type[Variable] = Variable) -> set[str]:
  """The collection of every Variable kind defined so far (the user's included)."""
  return {kind.collection}.union(*map(_known_collections, kind.__subclasses__()))


def _check_collection_names(rules: Rules, variables) -> None:
  """Raises for a collection name in a rule that no Variable kind has (a misspelling)."""
  present = {v.collection for v in variables}
  known = None
  for label, name in rules.typed_collections:
    if name in present:
      continue
    known = _known_collections() if known is None else known
    if name in known:
      continue
    guess = difflib.get_close_matches(name, sorted(present | known), n=1)
    hint = f" Did you mean {guess[0]!r}?" if guess else ""
    raise TransformError(
      f"{rules.what}: {label} names the collection {name!r}, which no Variable kind "
      f"has, so it matches nothing and the variables meant fall to the other rules."
      f"{hint} The modules' collections: {sorted(present) or 'none'}. Fix: spell the "
      f"collection as its kind names it (sr.Param is 'params', sr.BatchStat "
      f"'batch_stats'), or pass the kind itself (e.g. `sr.Param`)."
    )


class Stream(NamedTuple):
  """An unstacked RNG stream of the lifted graph (``serves``: a ``default`` stream)."""

  key: int
  count: int
  name: str
  split: bool
  serves: bool


def mark_layer_index(stack, first) -> None:
  """Marks a stack slice in a pipeline stage: its layer ``j`` is layer ``first + j`` of the
  whole stack (for a pattern stack, ``first`` counts cycles)."""
  positions = cycle(stack)
  mark = (1, first * len(positions) if len(positions) > 1 else first)
  for position in positions:
    position.__dict__[LAYER_INDEX] = mark


def _index_map(nodes) -> tuple[int, int] | None:
  """``(period, position)``: layer ``j`` draws the keys of layer ``j * period + position``."""
  marks = [getattr(node, "__dict__", {}).get(LAYER_INDEX) for node in nodes]
  if marks and marks[0] is not None and all(m is marks[0] for m in marks):
    return marks[0]
  if len(nodes) != 1:
    return None
  info = stack_info(nodes[0])
  return None if info is None or info.index_map == (1, 0) else info.index_map


class Treatment:
  """The treatment of every flat variable of one call, and the RNG streams."""

  def __init__(
    self,
    rules: Rules,
    graphdef,
    variables,
    nodes,
    *,
    display_path=None,
    rules_path=None,
    rng_streams: bool = True,
    rank_offset: int = 0,
    skip: int = 0,
  ):
    """``display_path`` / ``rules_path``: a path as messages / filters see it;
    ``rank_offset=1``: values lack the layer axis; the first ``skip`` are read-only."""
    self.rules = rules
    self.display_path = display_path or (lambda p: p)
    rules_path = rules_path or self.display_path
    self.index_map = _index_map(nodes)
    index = {id(v): i for i, v in enumerate(variables)}
    self.streams: list[Stream] = []
    self.own_streams: set[str] = set()  # the names of the streams found, for checks
    self.asked: set[str] = set()  # the names drawn from a default stream while traced
    found = []  # (stream, name, serves): a default stream of an Rngs serves names
    for node in nodes if rng_streams else ():
      for _, obj in iter_graph(node):
        if isinstance(obj, Rngs):
          found += [(vars(obj)[name], name, name == "default") for name in obj.stream_names()]
        elif isinstance(obj, RngStream):
          found.append((obj, obj.tag, False))
    stream_vars: dict[int, Stream] = {}
    for stream, name, serves in found:
      self.own_streams.add(name)
      key_i, count_i = index.get(id(stream.key)), index.get(id(stream.count))
      # A stream whose key already carries a layer axis (vmapped init) is stacked state.
      if key_i is None or count_i is None or key_i in stream_vars or jnp.ndim(stream.key._value):
        continue
      s = Stream(key_i, count_i, name, rules.splits(name), serves)
      self.streams.append(s)
      stream_vars[key_i] = stream_vars[count_i] = s
    self.kinds: list[str] = []
    self.axes: list[int | None] = []
    for i, (path, var) in enumerate(zip(graphdef.var_paths, variables)):
      if i < skip or i in stream_vars:
        kind, axis = (READONLY if i < skip else RNG), None
      else:
        kind, axis = rules.classify(rules_path(path), var, self.display_path(path))
      if kind == STACKED:
        assert axis is not None  # classify gives a stacked variable its axis
        # A pytree value (a sown tuple) is stacked leaf by leaf: each needs the axis.
        ndim = min(map(jnp.ndim, jax.tree.leaves(var._value)), default=0) + rank_offset
        if ndim == 0:
          raise TransformError(
            f"{rules.what}: variable_axes slices `{format_path(self.display_path(path))}`"
            f" ({type(var).__name__}) along axis {axis} per layer, but it is a scalar "
            "(shape ()): it has no layer axis, so it is not stacked. A variable "
            "assigned on a stack's path after the stack was built (e.g. "
            "`stack.block.count = sr.Cache(jnp.array(0))`) lacks the layer axis "
            "(`init_cache` on a stack's attention, `stack.attn.init_cache(...)`, "
            "makes stacked caches). Fix: make it per layer, with the layer axis in "
            "front (`jnp.zeros((len(stack), ...))`), or keep it out of "
            f"variable_axes (e.g. `variable_broadcast={filter_repr(type(var))}`)."
          )
        if not -ndim <= axis < ndim:
          shapes = ", ".join(str(jnp.shape(leaf)) for leaf in jax.tree.leaves(var._value))
          raise TransformError(
            f"{rules.what}: variable_axes puts the layer axis of "
            f"`{format_path(self.display_path(path))}` at {axis}, but its value has "
            f"shape {shapes} (rank {ndim}). Fix: choose an axis "
            f"in [-{ndim}, {ndim}), or exclude this variable from variable_axes."
          )
        axis = axis % ndim
      self.kinds.append(kind)
      self.axes.append(axis)
    if rules.typed_collections:
      _check_collection_names(rules, variables[skip:])

  def indices(self, kind: str) -> list[int]:
    return [i for i, k in enumerate(self.kinds) if k == kind]

  def stacked_axis(self, i: int) -> int:
    """The layer axis of variable ``i``, which is stacked."""
    axis = self.axes[i]
    assert axis is not None, f"variable {i} is not stacked"
    return axis

  def seed_layer(self, flat: list, values, index) -> tuple:
    """Puts one iteration's RNG keys and fresh counts into ``flat``, for ``serve_names``."""
    served = []
    if self.index_map is not None and index is not None:  # the pattern's layer index
      period, position = self.index_map
      index = index * jnp.uint32(period) + jnp.uint32(position)
    for s in self.streams:
      base = jax.random.fold_in(values[s.key], values[s.count])
      if s.split:
        assert index is not None, "a split stream is folded with the iteration index"
        flat[s.key] = jax.random.fold_in(base, index)
      else:
        flat[s.key] = base
      flat[s.count] = jnp.zeros((), jnp.uint32)
      if s.serves:
        served.append((s.key, base))
    return index, served

  def reseed(self, variables, values, index) -> list:
    """``seed_layer`` on rebuilt Variables; returns the fresh counts."""
    flat = [None] * len(variables)
    served = self.seed_layer(flat, values, index)
    counts = []
    for s in self.streams:
      variables[s.key]._value = flat[s.key]
      variables[s.count]._value = flat[s.count]
      counts.append(flat[s.count])
    self.serve_names(served, variables)
    return counts

  def serve_names(self, served: tuple, variables) -> None:
    """Gives the rebuilt Rngs of each default stream its per-name keys (``LayerKeys``)."""
    index, streams = served
    for key_i, base in streams:
      stream_owner = next(owner_chain(variables[key_i]), (None,))[0]
      rngs_owner = next(owner_chain(stream_owner), (None,))[0] if stream_owner else None
      if isinstance(rngs_owner, Rngs):
        rngs_owner.__dict__[LAYER_KEYS] = LayerKeys(base, index, self.rules.splits, self.asked)

  def check_stream_names(self) -> None:
    """Raises if ``split_rngs`` names no stream while a stream has no named rule."""
    named = {n for _, _, names in self.rules.split_entries for n in names}
    if not named:
      return
    # Streams already stacked (one key per layer) follow no split rule.
    live = {s.name for s in self.streams} - {"default"}
    dangling = sorted(named - self.own_streams - self.asked)
    unruled = sorted((live | self.asked) - named)
    if not dangling or not unruled:
      return
    guesses = [m for n in dangling for m in difflib.get_close_matches(n, unruled, n=1)]
    hint = f" Did you mean {guesses[0]!r}?" if guesses else ""
    raise TransformError(
      f"{self.rules.what}: split_rngs names the RNG stream{'s' * (len(dangling) > 1)} "
      f"{', '.join(map(repr, dangling))}, but the modules have no stream of that name "
      f"and the body drew none, so the rule splits nothing; meanwhile "
      f"{', '.join(map(repr, unruled))} (drawn or held by the modules) follow"
      f"{'s' * (len(unruled) == 1)} no named rule, so every iteration gets the same "
      f"key.{hint} The streams: held {sorted(self.own_streams) or 'none'}, drawn from "
      f"a default stream {sorted(self.asked) or 'none'}. Fix: spell the name as the "
      f"stream is named, e.g. `split_rngs={{{(guesses or unruled)[0]!r}: True}}`."
    )
