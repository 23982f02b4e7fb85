"""Where two GraphDefs differ, in words: for the errors of transforms and sr.stack."""

from __future__ import annotations

from ._errors import format_path
from ._graph import _DICT, _LIST, _NODE, _TUPLE, GraphDef


def describe_change(before: GraphDef, after: GraphDef) -> str:
  """Where ``after`` first differs from ``before``, in words, for an error message."""
  multi = len(before.tree) > 1

  def where(path):
    if not multi:
      return f"`{format_path(path)}`"
    root = before.tree[path[0]]
    kind = root[1].__name__ if isinstance(root[1], type) else "module"
    return f"`{format_path(path[1:])}` of a {kind} argument"

  added = [p for p in after.var_paths if p not in set(before.var_paths)]
  removed = [p for p in before.var_paths if p not in set(after.var_paths)]
  if added:
    return f"a new variable at {where(added[0])}"
  if removed:
    return f"the variable at {where(removed[0])} was removed"
  for i, (a, b) in enumerate(zip(before.tree, after.tree)):
    found = first_difference(a, b, (i,) if multi else ())
    if found is not None:
      path, verb = found
      return f"attribute {where(path)} {verb}"
  return "its structure changed"


def first_difference(a, b, path):
  """``(path, verb)`` of the first place two GraphDef trees differ, or None."""
  if a == b:
    return None
  if a[0] != b[0] or a[0] not in (_NODE, _LIST, _TUPLE, _DICT) or a[1] != b[1]:
    return path, "changed"
  keyed = a[0] in (_NODE, _DICT)
  if keyed:
    keys_a, keys_b = [x[0] for x in a[2]], [y[0] for y in b[2]]
    new = [k for k in keys_b if k not in keys_a]
    if new:
      return path + (new[0],), "was added"
    gone = [k for k in keys_a if k not in keys_b]
    if gone:
      return path + (gone[0],), "was deleted"
  if len(a[2]) != len(b[2]):
    return path, f"changed length from {len(a[2])} to {len(b[2])}"
  for i, (x, y) in enumerate(zip(a[2], b[2])):
    if keyed:
      if x[0] != y[0]:
        return path, "changed the order of its entries"
      found = first_difference(x[1], y[1], path + (x[0],))
    else:
      found = first_difference(x, y, path + (i,))
    if found is not None:
      return found
  return path, "changed"
