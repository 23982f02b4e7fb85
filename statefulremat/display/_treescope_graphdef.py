"""A GraphDef drawn as the module tree it describes: classes, static attributes and each
Variable's kind and metadata, no values."""

from __future__ import annotations

from ._treescope import SharedMark, collection_color


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
