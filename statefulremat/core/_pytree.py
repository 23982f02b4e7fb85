"""Modules are JAX pytrees: raw ``jax.jit``, ``jax.grad`` and ``jax.tree.map`` take them.

Every Module class (each subclass too, as it is defined) is registered with JAX as a
pytree node whose

* leaves are its Variables' values in split order: ``jax.tree.leaves(model)`` are
  the arrays of ``jax.tree.leaves(sr.state(model))``, in the same order;
* aux data is its ``GraphDef``, so two modules have the same tree structure exactly
  when they have the same graph (classes, static attributes, Variable kinds);
* keys name each Variable's path: ``jax.tree_util.keystr`` gives ``.layers[0].kernel``
  (one ``ModulePathKey`` per leaf).

The walk that finds a module's Variables is kept per module while its graph's
structure stays as walked (``_graph_cache.Stamp``), so a flatten reads the Variables' current
values and no more; a module that raw JAX rebuilt comes with its walk. A new or
deleted attribute, a replaced sub-module, ``.eval()`` or ``set_metadata`` is seen by
the next flatten.

Unflattening builds a fresh object graph, as ``sr.merge`` does: an instance of the
same class (a stack stays a stack), shared sub-modules and Variables one object again.
Sharing is kept within one module: two modules passed side by side are two pytree
nodes, so a Variable they share comes back as two (hold both in one parent module, or
use ``sr.jit``). The modules raw JAX returns are ordinary modules.

So raw JAX works on modules *functionally*, as in equinox and flax.nnx 0.12:

* ``jax.tree.map(f, model)`` returns a new module; ``model`` is left as it was;
* ``jax.jit(f)(model, x)`` hands ``f`` a fresh copy of ``model`` holding tracers. ``f``
  may change the copy (``m.mean.value = ...``), but the change comes out only if ``f``
  returns the module, as a new module; the caller's ``model`` never changes;
* ``jax.grad(loss)(model, x)`` returns a module of the same class whose Variables hold
  the gradients. Every leaf is differentiated, so a model holding integer state (RNG
  keys and counts) needs ``sr.grad`` (or ``allow_int=True``);
* ``jax.vmap(f)(stack, xs)`` maps every leaf over its leading axis (a stack's layers).

``sr.jit``, ``sr.grad`` and the other ``sr`` transforms keep the in-place style
instead: they write every change back into the caller's objects, and ``sr.grad``
returns a ``State`` of the ``wrt`` variables only. Inside their traced functions,
flattening a module reached by closure raises, as reading its ``.value`` does.

>>> import jax, jax.numpy as jnp, statefulremat as sr
>>> model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
>>> [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(model)]
['.bias', '.kernel']
>>> @jax.jit
... def sgd(model, x):
...   grads = jax.grad(lambda m: jnp.sum(m(x) ** 2))(model)   # a Linear of gradients
...   return jax.tree.map(lambda p, g: p - 0.1 * g, model, grads)
>>> new = sgd(model, jnp.ones((1, 2)))
>>> type(new).__name__, new is model, bool((new.kernel.value != model.kernel.value).any())
('Linear', False, True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from . import _graph, _graph_build, _graph_cache, _module
from ._caches import structure_epoch
from ._tracing import guard as _guard
from ._variables import _closure_read

_GetAttrKey = jax.tree_util.GetAttrKey
_SequenceKey = jax.tree_util.SequenceKey
_DictKey = jax.tree_util.DictKey


@dataclasses.dataclass(frozen=True, slots=True)
class ModulePathKey:
  """The key of one leaf of a module: the path of its Variable.

  JAX gives each child of a pytree node one key entry, and a module's children are
  its Variables wherever they sit, so one entry holds the whole path: ``keys`` are the
  standard entries (``GetAttrKey`` for an attribute, ``SequenceKey`` for a list or tuple
  item, ``DictKey`` for a dict key), ``str`` joins them (``.layers[0].kernel``, what
  ``jax.tree_util.keystr`` shows) and ``name`` is the last attribute name.

  >>> import jax, statefulremat as sr
  >>> class Net(sr.Module):
  ...   def __init__(self):
  ...     self.layers = [sr.nn.Linear(2, 2, rngs=sr.Rngs(0))]
  >>> (path, _), _ = jax.tree_util.tree_leaves_with_path(Net())
  >>> path[0], path[0].name, path[0].keys[1]
  (ModulePathKey('.layers[0].bias'), 'bias', SequenceKey(idx=0))
  """

  keys: tuple

  @property
  def name(self) -> Any:
    """The last attribute name on the path (``"kernel"`` for ``.layers[0].kernel``)."""
    return next(k.name for k in reversed(self.keys) if isinstance(k, _GetAttrKey))

  def __str__(self) -> str:
    return "".join(map(str, self.keys))

  def __repr__(self) -> str:
    return f"ModulePathKey({str(self)!r})"


# -- the walk, cached per module -----------------------------------------------------
#
# Raw JAX flattens a module on every call (a `jax.jit` dispatch, `jax.tree.map`), and
# walking the graph costs microseconds per Variable: the walk is kept per module in the
# graph cache (`_graph_cache`) while no structure changes, as `sr.jit` keeps its own,
# so a flatten then only reads the Variables' current values.


_walks = _graph_cache.walks


def _walk(module) -> _graph_cache.Walk:
  walk = _graph_cache.walk_of((module,))
  if walk is not None:
    return walk
  stamp = _graph_cache.Stamp(walked=True)
  graphdef, variables = _graph.flatten([module], stamp=stamp)
  graphdef = _graph_cache.canonical(graphdef)
  walk = _graph_cache.remember((module,), stamp, graphdef, variables)
  assert walk is not None  # a module can be referred to weakly
  return walk


def _values(variables) -> list:
  # While sr.jit & co. trace a user's function, a module made before the trace began
  # was reached by closure: flattening it would bake its values in as constants, so
  # it raises as reading `.value` does.
  if _guard.depth:
    for v in variables:
      if v._serial < _guard.start:
        _closure_read(v)
  return [v._value for v in variables]


def _flatten(module):
  # `_walk` and `_values` inlined for the cache hit: this runs on every raw JAX call.
  walk = _walks.get(id(module))
  if walk is None or walk.stamp.epoch != structure_epoch.value or walk() is not module:
    walk = _walk(module)
  if _guard.depth:
    return _values(walk.variables), walk.graphdef
  return [v._value for v in walk.variables], walk.graphdef


def _keys(graphdef: _graph.GraphDef) -> list[ModulePathKey]:
  """The key of each Variable, in order: its first path, read off the GraphDef."""
  key_of = {"module": _GetAttrKey, "list": _SequenceKey, "tuple": _SequenceKey, "dict": _DictKey}
  return [
    ModulePathKey(tuple(key_of[kind](key) for kind, key in path))
    for path, _ in _graph.variable_nodes(graphdef.nodes[0])
  ]


def _flatten_with_keys(module):
  walk = _walk(module)
  keys = _graph_cache.derived(walk.graphdef, "keys", _keys)
  return list(zip(keys, _values(walk.variables))), walk.graphdef


def _unflatten(graphdef, leaves):
  # The Variables take the current trace: inside a raw `jax.jit` the function may
  # change its (fresh) copy of the module and return it. The new module's walk is
  # known already, so flattening it again (the next step of a loop) walks nothing.
  roots, _ = _graph_build.unflatten(graphdef, leaves)  # remembers its walk
  return roots[0]


def register(cls: type) -> None:
  """Registers the Module class ``cls`` as a pytree node (see the module docstring)."""
  jax.tree_util.register_pytree_with_keys(
    cls, _flatten_with_keys, _unflatten, flatten_func=_flatten
  )


_module.on_new_class(register)
