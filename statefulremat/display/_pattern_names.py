"""How a pattern stack's elements are named on screen.

Each position of a pattern is named by what builds it: ``Local``, or
``partial(Block, attn_type='local_sliding')``. Written in full, Gemma 3's pattern (five
local layers, then a global one) repeats its long name five times in every title. So
the display writes a run of three or more of one element once, with its count
(``Local × 5, Global``), and where the full names would still make a long line, names
each distinct element by a short label: its class's name, numbered where several
elements share a class (``Block#1 × 5, Block#2``), with a legend that says what each
label stands for (``Block#1 = partial(Block, attn_type='local_sliding')``).
"""

from __future__ import annotations

import dataclasses
import itertools

from ..core._stacks import cycle_unit, layer_unit, stack_info
from ._static_repr import static_repr

WIDTH = 60  # characters the elements of a pattern may take in full before labels do
RUN = 3  # a run this long of one element is written once, with its count


@dataclasses.dataclass(frozen=True)
class PatternNames:
  """The on-screen name of each position of a pattern (``labels``), and the legend
  lines that say what the short ones stand for (empty where the labels are the full
  names).

  >>> import functools, statefulremat as sr
  >>> from statefulremat.display._pattern_names import pattern_names
  >>> zeros = sr.nn.initializers.zeros
  >>> Local = functools.partial(sr.nn.Linear, use_bias=False, kernel_init=zeros)
  >>> names = pattern_names(sr.vmap((Local,) * 5 + (sr.nn.Linear,), axis_size=6))
  >>> names.cycle()
  'Linear#1 × 5, Linear'
  >>> names.legend
  ('Linear#1 = partial(Linear, use_bias=False, kernel_init=zeros)',)
  >>> pattern_names(sr.vmap((sr.nn.Linear, Local), axis_size=2)).labels
  ('Linear', 'partial(Linear, use_bias=False, kernel_init=zeros)')
  """

  labels: tuple[str, ...]
  legend: tuple[str, ...] = ()

  def cycle(self, count: int | None = None) -> str:
    """The first ``count`` positions (all by default), a run of ``RUN`` or more of
    one label written once with its count."""
    return runs(self.labels[:count])


def runs(names) -> str:
  """``names`` joined by ``', '``, a run of ``RUN`` or more written ``name × n``.

  >>> from statefulremat.display._pattern_names import runs
  >>> runs(["Local"] * 5 + ["Global"]), runs(["Local", "Local", "Global"])
  ('Local × 5, Global', 'Local, Local, Global')
  """
  parts = []
  for name, group in itertools.groupby(names):
    n = len(list(group))
    parts += [f"{name} × {n}"] if n >= RUN else [name] * n
  return ", ".join(parts)


def pattern_names(cls) -> PatternNames:
  """The ``PatternNames`` of a pattern stack class (or instance)."""
  unit = cycle_unit(cls)
  assert unit is not None
  made = [_element(position) for position in unit.positions]
  names = [name for name, _ in made]
  if len(runs(names)) <= WIDTH:
    return PatternNames(tuple(names))
  classes = dict(made)  # full name -> the name of its class
  label, legend = {}, []
  for name, of in classes.items():
    if name == of:  # a plain class: its name is short already
      label[name] = name
      continue
    numbered = [n for n in classes if classes[n] == of and n != of]
    alone = len(numbered) == 1 and of not in classes  # the only element of its class
    label[name] = of if alone else f"{of}#{numbered.index(name) + 1}"
    legend.append(f"{label[name]} = {name}")
  return PatternNames(tuple(label[n] for n in names), tuple(legend))


def _element(position) -> tuple[str, str]:
  """``(full name, class name)`` of the element that builds a position's layers:
  ``partial(Block, window=512)``, its arguments as written (``static_repr``: a
  function by its name, never its address)."""
  unit = layer_unit(position)
  assert unit is not None
  layer, factory = unit.cls, unit.factory
  if factory is None:
    return layer.__name__, layer.__name__
  given = [static_repr(a) for a in factory.args]
  given += [f"{k}={static_repr(v)}" for k, v in factory.keywords.items()]
  return f"partial({', '.join([layer.__name__, *given])})", layer.__name__


def position_label(position_cls) -> str | None:
  """The on-screen name of a position's stack class in its pattern; None where it is
  no position."""
  place = getattr(stack_info(position_cls), "place", None)
  if place is None:
    return None
  pattern = place.pattern()
  return place.name if pattern is None else pattern_names(pattern).labels[place.position]
