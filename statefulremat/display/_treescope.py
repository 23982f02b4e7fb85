"""treescope rendering of modules, variables and State.

Every object renders through ``__treescope_repr__`` and ``treescope.repr_lib`` (no
treescope internals); Variables are coloured by collection. Three things are ours:

* a stacked module (the class forms of scan, remat_scan and vmap) names the user's
  class and its layer count, ``RematScan[Block] × 100`` (not the generated
  ``RematScanBlock``), and each stacked variable's layer axis in place, in ``.shape``
  order: ``float32(layers:6, 8, 8)``, or with ``sharding`` names
  ``float32(layers:6, embed:8, mlp:8)``. The name is the stack's partition name, else
  ``layers``. The value is wrapped in a ``LayeredArray``, which treescope's array
  visualiser reads through an ``NDArrayAdapter``, so the HTML figure labels its axes
  with the same names;
* every array shows its statistics, the big ones too (``_treescope_arrays``), and
  where arrays are drawn as figures, the text of the view writes each figure as the
  line it folds to, never as ``<Arrayviz rendering>`` (``_figure_text``);
* a module or Variable reached twice (shared) is drawn once, with a comment naming
  its other places (``# shared: also at tied``); later places say where it is drawn:
  ``Param(<shared: drawn at first.w>)`` (and treescope's own "repeated object"
  comment, which carries a memory address, never fires).

A module shows its attributes as constructor arguments, except its settings at their
constructor defaults (``precision=None``, ``dot_general=jax.lax.dot_general``; see
``_repr.settings_at_defaults``): ``repr()`` leaves them out, and treescope's foldable
view (``sr.display``, HTML) keeps them in one folded line, ``# 7 at defaults: ...``.
That view opens every module on its sub-modules and Variables and starts RNG plumbing
(an Rngs, its streams) folded; a click opens or shuts any of them.

A GraphDef draws as the module tree it describes, each Variable with its kind and
metadata but no value. ``repr()`` of any of these objects is treescope's text.

treescope is imported on first render, so ``import statefulremat`` stays light.
"""

from __future__ import annotations

import contextvars

from jax.core import Tracer
from jax.sharding import PartitionSpec

from ..core._errors import format_path
from ..core._module import Module, arrivals
from ..core._rngs import Rngs, RngStream
from ..core._stacks import LAYER_AXIS, _pattern_of, axis_name, layer_axis
from ..core._variables import Variable, entries
from ._array_stats import is_concrete
from ._pattern_names import pattern_names
from ._repr import (
  class_text,
  module_text,
  pattern_text,
  position_text,
  split_settings,
)
from ._static_repr import static_repr
from ._treescope_arrays import ArraySummary, LayeredArray

# id(module or variable) -> every path where one top-level render reaches it, the
# first being where it is drawn.
_FIRST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("sr_first", default=None)


# True while drawing a repr: Variables' arrays that would take several lines are
# drawn as treescope's own one-line summary (what an expanded display folds them to).
_COMPACT: contextvars.ContextVar[bool] = contextvars.ContextVar("sr_compact", default=False)


def compact_text(obj) -> str:
  """treescope's text for ``obj``, Variables' long arrays folded to one-line summaries.

  Any node wider than treescope's target width goes on several lines, however tall
  that makes the text (text cannot be unfolded later, as HTML can). No array is drawn
  as a figure, whatever autovisualizer is active (a notebook's): text has none.
  """
  import treescope

  token = _COMPACT.set(True)
  try:
    with (
      treescope.using_expansion_strategy(max_height=None),
      # Text draws no figure: a notebook's autovisualizer would leave placeholders.
      treescope.active_autovisualizer.set_scoped(None),
    ):
      return treescope.render_to_text(obj)
  finally:
    _COMPACT.reset(token)


def text_repr(obj, fallback) -> str:
  """``compact_text(obj)``, or ``fallback(obj)`` if treescope cannot draw it."""
  try:
    return compact_text(obj)
  except Exception:  # a repr must never raise: e.g. a value that refuses to print
    return fallback(obj)


def _is_long(value) -> bool:
  """Whether numpy would print ``value`` on several lines or elide part of it."""
  if not is_concrete(value):
    return False
  text = repr(value) if value.size < 1000 else "..."
  return "\n" in text or "..." in text


def collection_color(kind: type) -> str:
  from treescope import formatting_util

  return formatting_util.color_from_string(kind.collection)


def _mark_shared(value, path: tuple, first: dict):
  """``value`` with every module or Variable drawn elsewhere first replaced by a mark."""
  if isinstance(value, (Module, Variable)):
    where = first.get(id(value), [path])[0]
    return value if where == path else SharedMark(type(value), where)
  if isinstance(value, (list, tuple, dict)):
    items = dict(entries(value))
    marked = {k: _mark_shared(v, path + (k,), first) for k, v in items.items()}
    if all(marked[k] is v for k, v in items.items()):
      return value  # nothing shared below: draw the user's own object
    if isinstance(value, dict):
      return type(value)(marked)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
      return type(value)(*marked.values())
    return type(value)(marked.values())
  return _without_address(value)


def _without_address(value):
  """``value``, or its name when treescope would print a memory address for it."""
  if isinstance(value, PartitionSpec):  # treescope's fallback adds `# <jax.P at 0x…>`
    return _Text(repr(value))
  if (
    isinstance(value, (str, int, float, type(None)))
    or hasattr(value, "__treescope_repr__")
    or " at 0x" not in repr(value)
  ):
    return value
  if isinstance(value, type) or "<" not in getattr(value, "__qualname__", "<"):
    return value  # treescope names importable functions and classes by qualified name
  return _Text(static_repr(value))


class _Text:
  """Drawn as the given text."""

  def __init__(self, text: str):
    self.text = text

  def __treescope_repr__(self, path, subtree_renderer):
    from treescope import rendering_parts

    return rendering_parts.text(self.text)


def render_module(module, path, subtree_renderer):
  from ._figure_text import drawing_scope

  first = _FIRST.get()
  token = None
  if first is None:  # drawn from here: stacks above it still name their layer axis
    first = {}  # every path reaching each module and Variable, in drawing order
    for place, obj, _ in arrivals(module):
      first.setdefault(id(obj), []).append(place)
    token = _FIRST.set(first)
  try:
    # An array attribute's figure, if any, reads as its folded line in text.
    with drawing_scope():
      rendering = _constructor(module, path, subtree_renderer, first)
    return _with_other_places(rendering, first.get(id(module), ()))
  finally:
    if token is not None:
      _FIRST.reset(token)


def _constructor(module, path, subtree_renderer, first: dict):
  """``Kind(name=value, ...)`` as ``repr_lib.render_object_constructor`` draws it, and
  in treescope's foldable view (not a repr) how it first shows:

  * a module opens; its settings at their defaults sit in one line of their own that
    starts folded: ``# 7 at defaults: dtype, ...``;
  * RNG plumbing (an Rngs, a stream) starts folded, its modules and Variables as
    ``…``: ``Rngs(params=…, dropout=…)``.

  A user can click any of them open or shut. A stack of a repeating pattern draws its
  cycle once, as its positions, and says which layers each holds in a comment after
  the opening bracket (``_opening``); each line of the legend of its short labels is
  a comment line of its own before the attributes (``# Block#1 = partial(Block, ...)``).
  """
  from treescope import rendering_parts as rp

  here = first.get(id(module), [()])[0]
  shown, folded = split_settings(module)
  shown = {k: _mark_shared(v, here + (k,), first) for k, v in shown.items()}
  folded = {k: _mark_shared(v, here + (k,), first) for k, v in folded.items()}
  compact = _COMPACT.get()  # a repr: what differs from the defaults, laid out as it fits
  plumbing = not compact and isinstance(module, (Rngs, RngStream))
  pattern = pattern_text(module)
  comment = pattern or position_text(module)
  positions = shown.get("pattern")
  if comment and isinstance(positions, tuple):
    shown["pattern"] = tuple(positions)  # drawn as the tuple it is
  legend = pattern_names(module).legend if pattern else ()
  children = [
    rp.fold_condition(
      expanded=rp.build_full_line_with_annotations(rp.comment_color(rp.text(f"# {line}")))
    )
    for line in legend
  ]
  for i, (name, value) in enumerate(shown.items()):
    drawn = subtree_renderer(value, path=_attribute_path(path, name))
    if plumbing and isinstance(value, (Module, Variable)):
      drawn = rp.RenderableAndLineAnnotations(
        rp.fold_condition(collapsed=rp.text("…"), expanded=drawn.renderable), drawn.annotations
      )
    # As repr_lib's: a comma after all but the last (a space after it when folded).
    comma = rp.siblings(",", rp.fold_condition(collapsed=rp.text(" ")))
    if i == len(shown) - 1:
      comma = rp.fold_condition(expanded=rp.text(","))
    children.append(_field(name, drawn, comma))
  if folded and not compact:
    # Only in the open module: folded to one line, the module shows what differs.
    children.append(
      rp.fold_condition(expanded=_defaults_group(folded, path, subtree_renderer).renderable)
    )
  state = rp.ExpandState.COLLAPSED if plumbing else rp.ExpandState.EXPANDED
  return rp.build_foldable_tree_node_from_children(
    prefix=_opening(module, comment),
    children=children,
    suffix=rp.siblings(")", rp.roundtrip_condition(roundtrip=rp.text(">"))),
    path=path,
    expand_state=rp.ExpandState.WEAKLY_COLLAPSED if compact else state,
  )


def _opening(module, comment: str | None):
  """``RematScan[Block] × 100(``: the module's name as its tree names it outside
  roundtrip mode (the class's in it), then ``comment`` while the node is open:
  ``RematScan[Local, Global](  # 26 layers: ...``."""
  from treescope import rendering_parts as rp

  kind = type(module)
  kind_name = rp.maybe_qualified_type_name(kind)
  if _pattern_of(kind) is not None:  # its __qualname__ spells every element in full
    kind_name = rp.text(f"{kind.__module__}.{kind.__name__}[{pattern_names(kind).cycle()}]")
  title = module_text(module)
  if title != kind.__name__:
    kind_name = rp.roundtrip_condition(roundtrip=kind_name, not_roundtrip=rp.text(title))
  prefix = rp.siblings(rp.roundtrip_condition(roundtrip=rp.text("<")), kind_name, "(")
  if comment:
    prefix = rp.siblings(
      prefix, rp.fold_condition(expanded=rp.comment_color(rp.text(f"  # {comment}")))
    )
  return prefix


def _attribute_path(path, name: str):
  return None if path is None else f"{path}.{name}"


def _field(name: str, drawn, comma):
  """A line of a constructor: ``name=`` and the attribute as ``drawn``, then ``comma``."""
  from treescope import rendering_parts as rp

  return rp.build_full_line_with_annotations(rp.siblings_with_annotations(f"{name}=", drawn), comma)


def _defaults_group(folded: dict, path, subtree_renderer):
  """A folded line naming the attributes at their defaults; open, one per line."""
  from treescope import rendering_parts as rp

  names = ", ".join(folded)
  if len(names) > _NAMES_WIDTH:
    names = names[:_NAMES_WIDTH].rsplit(", ", 1)[0] + ", …"
  label = rp.comment_color(
    rp.fold_condition(
      collapsed=rp.text(f"# {len(folded)} at defaults: {names}"),
      expanded=rp.text(f"# {len(folded)} at defaults:"),
    )
  )
  lines = [
    _field(name, subtree_renderer(value, path=_attribute_path(path, name)), rp.text(","))
    for name, value in folded.items()
  ]
  return rp.build_custom_foldable_tree_node(
    contents=rp.fold_condition(expanded=rp.indented_children(lines)),
    label=label,
    expand_state=rp.ExpandState.COLLAPSED,
  )


_NAMES_WIDTH = 60  # characters of names a folded defaults line lists


def render_variable(var, path, subtree_renderer):
  from treescope import repr_lib
  from treescope.external import jax_support

  from ._figure_text import drawing_scope

  value = var._value
  layer = layer_axis(var)
  if layer is not None and hasattr(value, "shape"):
    inner = [(a, axis_name(n)) for a, n in var._metadata[LAYER_AXIS][1:]]
    sharding = var._metadata.get("sharding")
    value = LayeredArray(value, layer[0], axis_name(layer[1]), sharding, inner)
  elif _COMPACT.get() and _is_long(value):
    value = ArraySummary(value)
  elif isinstance(value, Tracer):  # treescope would add the tracer's default repr, an address
    value = _Text(repr(value))
  # The layer axis is drawn in the array's shape: not repeated as metadata.
  attributes = {
    k: _without_address(v) for k, v in {"value": value, **var._metadata}.items() if k != LAYER_AXIS
  }
  # An unstacked array past treescope's size threshold gets its statistics too.
  # Where arrays are drawn as figures (an autovisualizer is active, as
  # `treescope.basic_interactive_setup()` makes it in a notebook), a stacked array is
  # drawn as ours (the layers at a glance), and any figure reads as its folded line in
  # text.
  with (
    jax_support.summarization_threshold.set_scoped({"default": None}),
    drawing_scope(stacks_first=isinstance(value, LayeredArray)),
  ):
    rendering = repr_lib.render_object_constructor(
      type(var), attributes, path, subtree_renderer, color=collection_color(type(var))
    )
  return _with_other_places(rendering, (_FIRST.get() or {}).get(id(var), ()))


def _with_other_places(rendering, paths):
  """``rendering`` with a ``# shared: also at ...`` comment if it has other places."""
  if len(paths) < 2:
    return rendering
  from treescope import rendering_parts as rp

  others = ", ".join(format_path(p) if p else "the root" for p in paths[1:])
  comment = rp.comment_color(rp.text(f"  # shared: also at {others}"))
  return rp.RenderableAndLineAnnotations(
    rendering.renderable, rp.siblings(comment, rendering.annotations)
  )


def render_state(state, path, subtree_renderer):
  """A State as the nested dict its indexing follows, each entry its Variable kind."""
  from treescope import repr_lib

  nested: dict = {}
  for p, var in state.flat_variables().items():
    node = nested
    for key in p[:-1]:
      node = node.setdefault(key, {})
    node[p[-1]] = var
  return repr_lib.render_dictionary_wrapper(type(state), nested, path, subtree_renderer)


class SharedMark(_Text):
  """A module or Variable (of class ``kind``) drawn earlier:
  ``Param(<shared: drawn at a.kernel>)``."""

  def __init__(self, kind: type, where: tuple):
    place = format_path(where) if where else "the root"
    super().__init__(f"{class_text(kind)}(<shared: drawn at {place}>)")


def render_graphdef(graphdef, path, subtree_renderer):
  """A GraphDef as the module tree it describes: classes, static attributes and each
  Variable's kind and metadata, with no values; references say where they point."""
  from treescope import rendering_parts as rp

  from ..core._state import thaw_metadata

  drawn: list[tuple[type, tuple]] = []  # (class, path) of each numbered object

  def skeleton(node, where):
    kind, cls = node.kind, node.type
    if kind == "ref":
      return SharedMark(*drawn[node.value])
    if kind == "variable":
      drawn.append((cls, where))
      return _Skeleton(cls, dict(thaw_metadata(node.value)), collection_color(cls))
    if kind == "module":
      drawn.append((cls, where))
      return _Skeleton(cls, {k: skeleton(sub, where + (k,)) for k, sub in node.items})
    if kind in ("list", "tuple", "dict"):
      items = {k: skeleton(sub, where + (k,)) for k, sub in node.items}
      return _Container(cls, items if kind == "dict" else list(items.values()))
    return node.value

  multi = len(graphdef.nodes) > 1
  roots = [skeleton(root, (i,) if multi else ()) for i, root in enumerate(graphdef.nodes)]
  children = [
    rp.build_full_line_with_annotations(
      subtree_renderer(root),
      rp.fold_condition(
        expanded=rp.text(","), collapsed=rp.text(", " if i < len(roots) - 1 else "")
      ),
    )
    for i, root in enumerate(roots)
  ]
  return rp.build_foldable_tree_node_from_children(
    prefix=rp.text(f"{type(graphdef).__name__}("),
    children=children,
    suffix=rp.text(")"),
    path=path,
  )


class _Skeleton:
  """One module or Variable of a GraphDef, drawn like the object without values."""

  def __init__(self, kind: type, attributes: dict, color: str | None = None):
    self.kind, self.attributes, self.color = kind, attributes, color

  def __treescope_repr__(self, path, subtree_renderer):
    from treescope import repr_lib

    return repr_lib.render_object_constructor(
      self.kind, self.attributes, None, subtree_renderer, color=self.color
    )


class _Container:
  """A list, tuple or dict of a GraphDef (a ``ModuleList`` or ``ModuleDict`` shows its
  class)."""

  def __init__(self, kind: type, items: list | dict):
    self.kind, self.items = kind, items

  def __treescope_repr__(self, path, subtree_renderer):
    from treescope import repr_lib

    if self.kind in (list, tuple, dict):
      return subtree_renderer(self.kind(self.items))
    if isinstance(self.items, dict):
      return repr_lib.render_dictionary_wrapper(self.kind, self.items, None, subtree_renderer)
    return repr_lib.render_list_wrapper(self.kind, self.items, None, subtree_renderer)
