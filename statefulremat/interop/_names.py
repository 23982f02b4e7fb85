"""Matching by name: ``rename=``, a list of layers for a stack, and what does not fit.

Both sides name variables by dot-joined paths, list indices as numbers, as PyTorch
state dicts do (``layers.3.linear.kernel``). ``rename`` turns each source name into
ours; then every source entry finds the variable of ours that answers to that name,
whole or as one layer of a stack: a stacked variable at ``blocks.linear.kernel`` (the
stack at ``blocks``) also answers to ``blocks.3.linear.kernel`` for its layer 3, so a
list of layers at the stack's path fills it layer by layer. Layers are numbered as the
user numbers them: layer ``i`` of a pattern stack at ``blocks`` (``stack.layer(i)``)
also answers to ``blocks.i.…``, and a stacked array of the other side (one layer axis
in front) fills a list of layers, or a pattern stack, index by index (``Entry``'s
``global_names`` and ``stacked_names``). ``match`` collects every
problem (two sources for one variable, a list of layers with gaps) before anything
is written; the callers check values and word what is missing or unused for their side.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import jax.numpy as jnp

from ..core._split_merge import update
from ..core._state import State
from ._paths import Entry, placed_like
from ._report import Problems

_FIX_TWICE = (
  "make `rename` map each source name onto a different variable of ours "
  "(a callable rename may return None to leave an entry out)."
)
_FIX_LAYERS = (
  "a list of layers fills a stack only completely: one entry per layer, "
  "numbered 0 to L-1 at the stack's path (`blocks.0.…` … "
  "`blocks.{L-1}.…`); check the layer count, or give the whole stacked "
  "array instead."
)
_FIX_COUNT = (
  "a stacked array fills a list of layers (or a pattern stack) by its first axis, "
  "one index per layer: build both with the same number of layers."
)
_FIX_BOTH = (
  "give a stacked variable either whole or as a list of layers, not both: "
  "drop one of them (a callable rename may return None to leave it out)."
)


@dataclass
class Source:
  """One entry of the other side: its own key, its dotted name and how to show it."""

  key: Any
  name: str
  shown: str  # e.g. "linen `params/a/kernel`"
  leaf: Any
  collection: str | None = None  # None: any of ours (state dicts, raw nnx arrays)
  extra: bool = False  # from a collection not transferred: never reported unused
  target: str | None = None  # ``name`` after rename
  index: int | None = None  # a stacked source's layer ``index`` of ``count``
  count: int = 0

  def label(self) -> str:
    at = "" if self.index is None else f" layer {self.index}"
    if self.target is not None and self.target != self.name:
      return f"{self.shown}{at} (renamed `{self.target}`)"
    return self.shown + at

  def layer_of(self, value, where: str, problems: Problems):
    """``value`` (this source's array), or its layer ``index`` for a slice of a
    stacked source; None after adding a problem if it has not ``count`` layers."""
    if self.index is None:
      return value
    shape = tuple(getattr(value, "shape", ()))
    if not shape or shape[0] != self.count:
      line = (
        f"{self.shown} ({'x'.join(map(str, shape)) or 'no array'}) fills {where} … layer "
        f"by layer from its first axis, but ours has {self.count} layers there."
      )
      if line not in problems.lines:
        problems.add(line, _FIX_COUNT)
      return None
    return value[self.index]


@dataclass
class Match:
  names: Callable[[Entry, int | None], list[str]]
  problems: Problems
  side: str  # how messages name the other side: "linen", "nnx", "state dict"
  rename: Any
  # (entry, its (source, layer or None) pairs): one whole source (layer None) or one per layer
  fills: list[tuple[Entry, list[tuple[Source, int | None]]]] = field(default_factory=list)
  missing: list[Entry] = field(default_factory=list)
  wrong: list[tuple[Entry, Source]] = field(default_factory=list)  # other collection
  unused: list[Source] = field(default_factory=list)
  known: set = field(default_factory=set)  # every name one of ours answers to


def renamer(rename, what: str) -> Callable[[str], str | None]:
  """``rename=`` as a function of a dotted name: a callable as it is, a mapping of
  regular expressions applied in order like ``re.sub``, None the identity."""
  if rename is None:
    return lambda name: name
  if isinstance(rename, Mapping):
    rules = []
    for pattern, repl in rename.items():
      if not isinstance(pattern, (str, re.Pattern)) or not (
        isinstance(repl, str) or callable(repl)
      ):
        raise TypeError(
          f"{what}: rename= maps regular expressions to replacements (strings, as "
          f"re.sub takes them), got {pattern!r}: {repl!r}. E.g. "
          r"rename={r'^layers\.(\d+)\.': r'blocks.\1.'}."
        )
      try:
        rules.append((re.compile(pattern), repl))
      except re.error as err:
        raise ValueError(
          f"{what}: rename= pattern {pattern!r} is not a valid regular expression: "
          f"{err}. Fix the pattern (escape dots: `\\.`)."
        ) from None

    def apply(name: str) -> str:
      for regex, repl in rules:
        name = regex.sub(repl, name)
      return name

    return apply
  if callable(rename):

    def call(name: str) -> str | None:
      out = rename(name)
      if out is not None and not isinstance(out, str):
        raise TypeError(
          f"{what}: rename({name!r}) returned {out!r}; it must return our name as a "
          "dot-joined string (`layers.0.kernel`), or None to leave the entry out."
        )
      return out

    return call
  raise TypeError(
    f"{what}: rename= takes a callable from the source's name to ours or a mapping of "
    f"regular expressions to replacements, got {type(rename).__name__}. E.g. "
    r"rename={r'^model\.': ''} or rename=lambda name: name.replace('Dense_', 'layers.')."
  )


def match(
  ours: list[Entry],
  sources: list[Source],
  names: Callable[[Entry, int | None], list[str]],
  rename,
  problems: Problems,
  side: str,
) -> Match:
  """Pairs ``sources`` (renamed) with ``ours`` by ``names(entry, layer or None)``.

  Reports here what only names can tell: two sources for one slot, a stacked
  variable given both whole and per layer, a list of layers with gaps. The rest
  (missing, unused, wrong collection) is returned for the caller to word.
  """
  apply = renamer(rename, problems.what)
  table: dict[str, tuple[int, int | None]] = {}
  for n, e in enumerate(ours):
    for name in names(e, None):
      table.setdefault(name, (n, None))
  for n, e in enumerate(ours):
    for i in range(e.layers or 0):
      local = names(e, i)
      for name in local + e.global_names(local, i):
        table.setdefault(name, (n, i))
  # Stacked names: a stacked source there gives its layer `index` to each slot.
  stacked: dict[str, dict[int, tuple[int, int | None]]] = {}
  for n, e in enumerate(ours):
    for name, index, layer in e.stacked_names(names(e, None)):
      if name not in table:
        stacked.setdefault(name, {}).setdefault(index, (n, layer))
  result = Match(names, problems, side, rename, known=set(table) | set(stacked))
  by_slot: dict[tuple[int, int | None], list[Source]] = {}
  for s in sources:
    s.target = apply(s.name)
    if s.target is None:
      continue
    slot = table.get(s.target)
    slots = stacked.get(s.target, {})
    if slot is not None:
      by_slot.setdefault(slot, []).append(s)
    elif slots and sorted(slots) == list(range(len(slots))):
      for index, at in slots.items():
        by_slot.setdefault(at, []).append(replace(s, index=index, count=len(slots)))
    else:
      result.unused.append(s)

  def right(e: Entry, s: Source) -> bool:  # in e's collection (or any, for raw arrays)
    return s.collection is None or s.collection == e.collection

  def pick(e: Entry, cands: list[Source], where: str) -> Source | None:
    ok = [s for s in cands if right(e, s)]
    if len(ok) > 1:
      labels = ", ".join(s.label() for s in ok)
      problems.add(f"{where}: {len(ok)} {side} entries map onto it: {labels}.", _FIX_TWICE)
      return None
    if not ok:  # one layer only in another collection: worded by the caller
      result.wrong.append((e, cands[0]))
      result.unused.extend(cands[1:])
      return None
    result.unused.extend(s for s in cands if s not in ok)
    return ok[0]

  for n, e in enumerate(ours):
    # layer (None: whole) -> candidates
    given = {i: by_slot[(n, i)] for i in [None, *range(e.layers or 0)] if (n, i) in by_slot}
    every = [s for cands in given.values() for s in cands]
    if not every:
      result.missing.append(e)
    elif not any(right(e, s) for s in every):
      result.wrong.append((e, every[0]))
      result.unused.extend(every[1:])
    elif None in given and len(given) > 1:
      first = every[len(given[None])]  # the first of the list of layers
      problems.add(
        f"{e.where()}: given both whole ({every[0].label()}) and as a list "
        f"of layers ({first.label()}, …).",
        _FIX_BOTH,
      )
    else:
      picked = {i: pick(e, cands, e.where(i)) for i, cands in given.items()}
      gaps = [] if None in given else [i for i in range(e.layers or 0) if i not in given]
      if gaps:
        have = list(given)
        problems.add(
          f"{e.where()} ({e.layers} layers on axis {e.axis}) is given as a list of "
          f"layers with gaps: layer(s) {_ranges(have)} given, not {_ranges(gaps)} "
          f"(layer {have[0]}: {given[have[0]][0].label()}).",
          _FIX_LAYERS,
        )
      elif None not in picked.values():
        result.fills.append((e, [(s, i) for i, s in picked.items() if s is not None]))
  return result


def load(model, found: Match, value_of: Callable[[Entry, Source, int | None, Problems], Any]):
  """Writes ``found``'s fills into ``model`` once no problem is left; returns ``model``.

  A fill's value is ``value_of(entry, source, layer or None, problems)`` (None after
  adding a problem); the layers of a stack filled per layer are stacked on its layer
  axis.
  """
  new = {}
  for e, given in found.fills:
    values = [value_of(e, s, layer, found.problems) for s, layer in given]
    if any(v is None for v in values):
      continue
    whole = given[0][1] is None  # else filled per layer: a stack
    new[e.path] = placed_like(e.var, values[0] if whole else jnp.stack(values, axis=e.axis or 0))
  found.problems.raise_if_any()
  update(model, State(new))
  return model


def array_of(e: Entry, s: Source, layer: int | None, leaf, problems: Problems):
  """``leaf`` (its layer, for a slice of a stacked source) if it is an array; None
  after adding a problem."""
  value = s.layer_of(leaf, e.where(), problems)
  if value is not None and (
    getattr(value, "shape", None) is None or getattr(value, "dtype", None) is None
  ):
    problems.add(f"{e.where(layer)}: {s.label()} is a {type(value).__name__}, not an array.")
    return None
  return value


def fits(
  e: Entry,
  s: Source,
  layer: int | None,
  value,
  problems: Problems,
  fixes: tuple[str, str],
  note: str = "",
  expected: tuple | None = None,
) -> bool:
  """Whether ``value`` has our shape (one layer's, with ``layer``; ``expected``: the
  shape it must have in the other side's layout) and our dtype. If not, adds the
  problem, ``note`` after our shape, with ``fixes``' fix for a shape or a dtype."""
  where = e.where(layer)
  ours = e.shape if layer is None else e.layer_shape()
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is None or tuple(shape) != (ours if expected is None else expected):
    theirs = type(value).__name__ if shape is None else tuple(shape)
    problems.add(
      f"{where}: shape mismatch: ours is {ours}{note}, {s.label()} is {theirs}.",
      fixes[0],
    )
    return False
  if dtype != e.dtype:
    problems.add(f"{where}: dtype mismatch: ours is {e.dtype}, {s.label()} is {dtype}.", fixes[1])
    return False
  return True


def layer_note(e: Entry, layer: int | None) -> str:
  """What a shape mismatch says after our shape: `` per layer`` for one layer's, the
  layer count for a whole stack's."""
  if layer is not None:
    return " per layer"
  return "" if e.axis is None else f" ({e.layers} layers on axis {e.axis})"


def _ranges(numbers: list[int]) -> str:
  """``0-3, 5`` for [0, 1, 2, 3, 5]."""
  out = []
  # Consecutive numbers keep the same difference to their position in the list.
  for _, pairs in itertools.groupby(enumerate(numbers), lambda pair: pair[1] - pair[0]):
    run = [n for _, n in pairs]
    out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
  return ", ".join(out)


def answers(e: Entry, names: Callable[[Entry, int | None], list[str]]) -> str:
  """The names ``e`` answers to, and for a stack those of its layer 0, for a message."""
  words = " or ".join(f"`{n}`" for n in names(e, None))
  if e.layers:
    layer0 = e.global_names(names(e, 0), 0) or names(e, 0)
    words += (
      f" (or, layer by layer, {' or '.join(f'`{n}`' for n in layer0)} … for its {e.layers} layers)"
    )
  return words


def made_names(
  ours: list[Entry],
  unstack: bool,
  named: Callable[[Entry, int | None], str],
  rename,
  problems: Problems,
  side: str,
  nested: bool,
) -> list[tuple[Entry, int | None, str]]:
  """``(entry, layer or None, name)`` for each variable (each layer, with ``unstack``)
  we write out: ``rename(named(entry, layer))``, a pattern stack's layers by their
  global index (``blocks.5.…``, linen ``blocks_5``).

  Two of ours written to one name, or (``nested``) to a name and a name below it,
  are reported: an output must not lose a variable.
  """
  apply = renamer(rename, problems.what)
  out, seen = [], {}
  for e in ours:
    for layer in range(e.layers) if unstack and e.layers else [None]:
      name = named(e, layer)
      if layer is not None:  # a pattern position's layer: by its global index
        name = (e.global_names([name], layer) or [name])[0]
      name = apply(name)
      if name is None:
        continue
      where = e.where(layer)
      if name in seen:
        problems.add(
          f"{seen[name]} and {where} both become {side} `{name}`.",
          "make `rename` give each of our variables its own name (a callable "
          "rename may return None to leave one out).",
        )
        continue
      seen[name] = where
      out.append((e, layer, name))
  if nested:
    for name, where in seen.items():
      parts = name.split(".")
      for n in range(1, len(parts)):
        above = ".".join(parts[:n])
        if above in seen:
          problems.add(
            f"{where} becomes {side} `{name}`, below {seen[above]}, which "
            f"becomes `{above}`: one name cannot be a variable and hold others.",
            "give the two different names (`rename`).",
          )
  return out
