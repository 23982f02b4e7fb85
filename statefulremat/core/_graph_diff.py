"""Where two GraphDefs differ, in words: for the errors of transforms and sr.stack."""

from __future__ import annotations

from ._errors import format_path
from ._graph import GraphDef, GraphNode


def describe_change(before: GraphDef, after: GraphDef) -> str:
  """Where ``after`` first differs from ``before``, in words, for an error message."""
  multi = len(before.nodes) > 1

  def where(path):
    if not multi:
      return f"`{format_path(path)}`"
    root = before.nodes[path[0]]
    kind = root.type.__name__ if isinstance(root.type, type) else "module"
    return f"`{format_path(path[1:])}` of a {kind} argument"

  added = [p for p in after.var_paths if p not in set(before.var_paths)]
  removed = [p for p in before.var_paths if p not in set(after.var_paths)]
  if added:
    return f"a new variable at {where(added[0])}"
  if removed:
    return f"the variable at {where(removed[0])} was removed"
  for i, (a, b) in enumerate(zip(before.nodes, after.nodes)):
    found = first_difference(a, b, (i,) if multi else ())
    if found is not None:
      path, verb = found
      return f"attribute {where(path)} {verb}"
  return "its structure changed"


def first_difference(a: GraphNode, b: GraphNode, path):
  """``(path, verb)`` of the first place two GraphDef trees differ, or None."""
  if a == b:
    return None
  containers = ("module", "list", "tuple", "dict")
  if a.kind != b.kind or a.kind not in containers or a.type != b.type:
    return path, "changed"
  if a.kind in ("module", "dict"):
    keys_a, keys_b = [k for k, _ in a.items], [k for k, _ in b.items]
    new = [k for k in keys_b if k not in keys_a]
    if new:
      return path + (new[0],), "was added"
    gone = [k for k in keys_a if k not in keys_b]
    if gone:
      return path + (gone[0],), "was deleted"
  if len(a.items) != len(b.items):
    return path, f"changed length from {len(a.items)} to {len(b.items)}"
  for (k, x), (j, y) in zip(a.items, b.items):
    if k != j:
      return path, "changed the order of its entries"
    found = first_difference(x, y, path + (k,))
    if found is not None:
      return found
  return path, "changed"
