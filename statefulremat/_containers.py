"""Lists and dicts owned by modules.

Like PyTorch's ``nn.ModuleList``, a list or dict assigned to a module attribute is
adopted: it is copied into a ``ModuleList`` / ``ModuleDict`` (still a ``list`` /
``dict``, and the same pytree) whose mutations bump the structure epoch, so a cached
flattening of the graph notices ``self.layers.append(...)``.
"""

from __future__ import annotations

import jax

from ._variables import structure_epoch


def _bumping(method_name, base):
  method = getattr(base, method_name)

  def mutate(self, *args, **kwargs):
    structure_epoch.bump()
    return method(self, *args, **kwargs)

  mutate.__name__ = method_name
  return mutate


class ModuleList(list):
  """A ``list`` held by a module; its mutations are tracked.

  >>> import statefulremat as sr
  >>> class Net(sr.Module):
  ...   def __init__(self):
  ...     self.layers = [sr.nn.Linear(2, 2, rngs=sr.Rngs(i)) for i in range(2)]
  >>> net = Net()
  >>> type(net.layers).__name__, isinstance(net.layers, list)
  ('ModuleList', True)
  """

  __slots__ = ()


class ModuleDict(dict):
  """A ``dict`` held by a module; its mutations are tracked.

  >>> import statefulremat as sr
  >>> class Heads(sr.Module):
  ...   def __init__(self):
  ...     self.heads = {"a": sr.nn.Linear(2, 1, rngs=sr.Rngs(0))}
  >>> type(Heads().heads).__name__
  'ModuleDict'
  """

  __slots__ = ()


for _name in ["append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
              "__setitem__", "__delitem__", "__iadd__", "__imul__"]:
  setattr(ModuleList, _name, _bumping(_name, list))
for _name in ["__setitem__", "__delitem__", "pop", "popitem", "clear", "update",
              "setdefault", "__ior__"]:
  setattr(ModuleDict, _name, _bumping(_name, dict))

jax.tree_util.register_pytree_with_keys(
    ModuleList,
    lambda xs: ([(jax.tree_util.SequenceKey(i), x) for i, x in enumerate(xs)], None),
    lambda _, xs: ModuleList(xs),
    flatten_func=lambda xs: (list(xs), None),
)
jax.tree_util.register_pytree_with_keys(
    ModuleDict,
    lambda d: ([(jax.tree_util.DictKey(k), v) for k, v in d.items()], tuple(d)),
    lambda keys, vs: ModuleDict(zip(keys, vs)),
    flatten_func=lambda d: (list(d.values()), tuple(d)),
)


def adopt(value):
  """Copies lists and dicts (at any depth inside tuples, lists and dicts) into tracked ones."""
  if type(value) is list or type(value) is ModuleList:
    return ModuleList(adopt(v) for v in value)
  if type(value) is dict or type(value) is ModuleDict:
    return ModuleDict((k, adopt(v)) for k, v in value.items())
  if isinstance(value, tuple) and any(isinstance(v, (list, dict, tuple)) for v in value):
    items = [adopt(v) for v in value]
    return type(value)._make(items) if hasattr(value, "_fields") else type(value)(items)
  return value
