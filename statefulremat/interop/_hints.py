"""Wording what does not map by name: a bounded message, and the rename that would fix it.

A few unmatched variables are listed one by one, each with the nearest names of the
other side. Many (a whole model named differently: 80 of ours, 80 of theirs) are
summed up in two lines, a few examples of each side and a count, and when one
regular expression would map them (``layers_3.mlp.kernel`` -> ``blocks.3.mlp.kernel``,
or a stacked ``layers.mlp.kernel`` -> a list of layers at ``blocks``), the fix says
that ``rename=``, checked against our names.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from ._names import Match, Source
from ._paths import Entry

_DETAIL = 6  # up to this many unmatched variables are listed one by one
_EXAMPLES = 4  # otherwise, this many of each side
_INDEX = re.compile(r"(?:^|(?<=[._]))(\d+)(?=\.|$)")
# What follows the head a rule renames, as a pattern and its replacement:
_INDEXED = (r"(\d+)\.", r"\1.")  # a layer index, then more of the name
_LAST = (r"(\d+)$", r"\1")  # a layer index ending the name
_SUFFIX = ("", "")  # nothing: the rest is a suffix both names share


def report_unmatched(
  found: Match,
  missing: Callable[[Entry], str],
  describe: Callable[[Any], str],
  fixes: tuple[str, str],
) -> None:
  """Adds to ``found``'s problems the variables of ours it left unfilled (worded by
  ``missing``) and the sources it left unused (their values worded by ``describe``),
  with ``fixes`` (for each kind) or the rename that would map them."""
  problems, side = found.problems, found.side
  left = [s for s in found.unused if not s.extra]
  hint = suggest(found, left)
  fix_names, fix_unused = (hint, hint) if hint else fixes
  if len(found.missing) + len(left) <= _DETAIL:
    sources = {s.target: s.label() for s in left if s.target is not None}
    ours: dict[str, str] = {}
    for e in found.missing:
      for layer in [None, *range(e.layers or 0)]:
        ours.update((name, f"`{name}`") for name in found.names(e, layer))
    for e in found.missing:
      near = _nearest("Nearest unused", found.names(e, None), sources)
      problems.add(f"{e.where()}: {missing(e)}{near}", fix_names)
    for s in left:
      renamed = f", renamed `{s.target}`," if s.target != s.name else ""
      near = _nearest("Nearest of ours still unfilled", [s.target or ""], ours)
      problems.add(
        f"{s.shown} ({describe(s.leaf)}){renamed} matches no variable of ours.{near}", fix_unused
      )
    return
  if found.missing:
    first, rest = found.missing[0], found.missing[1:_EXAMPLES]
    problems.add(
      f"{_count(len(found.missing), 'variable')} of ours unfilled: {first.where()}: "
      f"{missing(first)}"
      + (f" Also {', '.join(e.where() for e in rest)}" if rest else "")
      + _more(len(found.missing) - 1 - len(rest)),
      fix_names,
      count=len(found.missing),
    )
  if left:
    examples = ", ".join(s.label() for s in left[:_EXAMPLES])
    problems.add(
      f"{_count(len(left), f'{side} entry', f'{side} entries')} match no variable of "
      f"ours: {examples}{_more(len(left) - _EXAMPLES)}",
      fix_unused,
      count=len(left),
    )


def _nearest(heading: str, names: list[str], shown: dict[str, str]) -> str:
  """`` {heading}: …`` with the (up to three) keys of ``shown`` closest to ``names``."""
  close: list[str] = []
  for name in names:
    close += [c for c in difflib.get_close_matches(name, list(shown), n=3) if c not in close]
  return f" {heading}: " + ", ".join(shown[c] for c in close[:3]) + "." if close else ""


def _count(n: int, one: str, many: str | None = None) -> str:
  return f"{n} {one if n == 1 else many or one + 's'}"


def _more(n: int) -> str:
  return f" … and {n} more." if n > 0 else "."


def suggest(found: Match, left: list[Source]) -> str | None:
  """The rename that maps the most of ``left`` onto names of ours still unfilled, as
  a sentence for the message; None when no one rule maps any."""
  if not left or not found.missing:
    return None
  heads: dict[Any, set[str]] = {}  # what follows a head -> our heads before it
  for name in _unfilled_names(found):
    for key, head, _ in _heads(name):
      heads.setdefault(key, set()).add(head)
  votes: Counter = Counter()
  for s in left:
    assert s.target is not None  # an unused source was renamed to a name
    for key, head, rest in _heads(s.target):
      if key in heads:
        votes.update((head, ours, rest) for ours in heads[key] if ours != head)
        break
  rules = []
  for (head, ours_head, (index, index_repl)), _ in votes.most_common(5):
    pattern, repl = "^" + re.escape(head) + index, ours_head + index_repl
    mapped = [s for s in left if re.sub(pattern, repl, s.target or "") in found.known]
    if mapped:  # ranked by how many it maps, then (on a tie) our dotted path
      rules.append(((len(mapped), repl.endswith(".")), pattern, repl, mapped))
  if not rules:
    return None
  _, pattern, repl, mapped = max(rules, key=lambda rule: rule[0])
  example = mapped[0].target or ""
  rule = f'{{r"{pattern}": r"{repl}"}}'
  where = (
    f"rename={rule}"
    if found.rename is None
    else f"add {rule} at the end of your rename="
    if isinstance(found.rename, Mapping)
    else f"apply {rule} to what your rename= returns"
  )
  entries = _count(len(left), f"{found.side} entry", f"{found.side} entries")
  return (
    f"{where} maps {len(mapped)} of the {entries} left over onto ours (`{example}` -> "
    f"`{re.sub(pattern, repl, example)}`); layers are numbered as `stack.layer(i)` "
    "numbers them."
  )


def _heads(name: str) -> list[tuple[Any, str, tuple[str, str]]]:
  """``(key, head, rest)`` for each way a rule may rename the head of ``name``: the key
  is what follows the head (with a layer index, ``(3, ".mlp.kernel")`` after
  ``layers.`` in ``layers.3.mlp.kernel`` or ``layers_3``; else each dotted suffix),
  ``rest`` the rule's pattern and replacement for it."""
  m = _INDEX.search(name)
  if m is not None:
    tail = name[m.end(1) :]
    return [((int(m[1]), tail), name[: m.start(1)], _INDEXED if tail.startswith(".") else _LAST)]
  words = name.split(".")
  return [(".".join(words[k:]), ".".join(words[:k]) + ".", _SUFFIX) for k in range(1, len(words))]


def _unfilled_names(found: Match) -> list[str]:
  """Every name our unfilled variables answer to (a stack's by layer, a pattern
  stack's by global index, a list's item as an index of a stacked array)."""
  out: list[str] = []
  for e in found.missing:
    whole = found.names(e, None)
    out += whole + [name for name, _, _ in e.stacked_names(whole)]
    for i in range(e.layers or 0):
      local = found.names(e, i)
      out += local if e.pattern is None else e.global_names(local, i)
  return out
