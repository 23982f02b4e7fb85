"""One cache per graph: what is worked out from a structure, and each graph's walk.

Two things are expensive to redo and depend only on a graph's structure:

* **per structure** (``per_structure``): what the floors derive from a GraphDef, such
  as the typed view, unflatten's build plan, the pytree keys. Equal GraphDefs share one
  dictionary of these (``sr.split`` makes a new GraphDef on every call), and equal
  GraphDefs are made one object (``canonical``): JAX compares a call's tree structure
  with the one it compiled for, and two models of one structure then compare by
  identity.
* **per graph** (``walk_of`` / ``remember``): for live roots, their GraphDef and their
  Variables in walk order. A raw JAX call flattens its modules each time, and a
  transform inside another receives exactly the roots the outer one rebuilt; walking
  the graph again costs microseconds per Variable. An entry holds while the graph's
  structure is as walked (``Stamp``: no module or tracked container of it changed, no
  Variable's metadata) and goes with its roots:
  modules refuse hashing, so entries are keyed by ``id`` and guarded by weak
  references; a module holds only its version.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import attrgetter, is_not, ne
from typing import Any

from ._bookkeeping import VERSION
from ._caches import graphdefs, structure_epoch, walks

# -- per structure ------------------------------------------------------------------


def canonical(graphdef):
  """The one object of all GraphDefs equal to ``graphdef`` (``graphdef`` if first)."""
  return graphdefs.setdefault(graphdef, graphdef)


def per_structure(graphdef) -> dict:
  """The dictionary of what is derived from ``graphdef``'s structure, shared by every
  GraphDef equal to it. Keys name what is kept (``"nodes"``, ``"build"``, ...)."""
  cache = graphdef._derived
  if cache is None:
    first = canonical(graphdef)
    if first._derived is None:
      first._derived = {}
    cache = graphdef._derived = first._derived
  return cache


def derived(graphdef, name: str, make: Callable[[Any], Any]) -> Any:
  """``make(graphdef)``, worked out once for every GraphDef equal to ``graphdef`` and kept
  under ``name`` (``"nodes"``, ``"build"``, ...)."""
  cache = graphdef._derived or per_structure(graphdef)
  found = cache.get(name)
  if found is None:
    found = cache[name] = make(graphdef)
  return found


# -- per graph ----------------------------------------------------------------------


class Stamp:
  """A graph's structure version when it was walked: the versions of its modules and
  tracked containers (``VERSION``, read as the walk reached each) and its Variables'
  metadata objects (``set_metadata`` makes a new one). It holds while none of them
  changed. ``structure_epoch`` only spares the look while nothing changed anywhere; a
  change to another graph costs this one a look, never a walk. ``walked`` False: not
  known (a graph rebuilt inside a trace), held only while nothing changed anywhere.

  A module is noted by its attribute dictionary, where its ``VERSION`` lives: the look
  is then a few C loops (a never-changed module has no note), and the dictionary does
  not keep the module alive. A tracked container is noted weakly."""

  __slots__ = (
    "epoch",
    "walked",
    "attributes",
    "versions",
    "containers",
    "counts",
    "variables",
    "metas",
  )

  def __init__(self, walked: bool = False):
    self.epoch = structure_epoch.value  # read first: a change during the walk is a miss
    self.walked = walked
    self.attributes, self.versions, self.containers, self.counts = [], [], [], []
    self.variables, self.metas = [], []

  def saw_module(self, attributes: dict) -> None:
    self.attributes.append(attributes)
    self.versions.append(attributes.get(VERSION, 0))

  def saw_container(self, container) -> None:
    self.containers.append(weakref.ref(container))
    self.counts.append(getattr(container, VERSION, 0))

  def saw_variable(self, variable) -> None:
    self.variables.append(variable)
    self.metas.append(variable._metadata)

  def holds(self) -> bool:
    now = structure_epoch.value
    if self.epoch == now:
      return True
    if (
      not self.walked
      or any(map(ne, map(dict.get, self.attributes, repeat(VERSION), repeat(0)), self.versions))
      or any(_version(r()) != v for r, v in zip(self.containers, self.counts))
      or any(map(is_not, map(_metadata, self.variables), self.metas))
    ):
      return False
    self.epoch = now
    return True


_metadata = attrgetter("_metadata")


def _version(container) -> int:
  return -1 if container is None else getattr(container, VERSION, 0)  # gone: changed


class Walk(weakref.ref):
  """A graph's entry: a weak reference to its first root (the entry goes when any root
  does) with the GraphDef and the Variables, valid while ``stamp`` holds."""

  __slots__ = ("stamp", "graphdef", "variables", "key", "others")


def _forget(ref: weakref.ref, key=None, walks=walks) -> None:
  # `walks` bound here: at interpreter exit the module's globals may be gone first.
  key = ref.key if key is None else key  # type: ignore[attr-defined]
  walk = walks.get(key)
  if walk is not None and (walk is ref or ref in walk.others):  # not a newer graph's
    walks.pop(key, None)


def _key(roots: Sequence[Any]):
  return id(roots[0]) if len(roots) == 1 else tuple(map(id, roots))


def remember(roots: Sequence[Any], stamp: Stamp, graphdef, variables: list) -> Walk | None:
  """Notes that ``roots`` walk to ``graphdef`` and ``variables`` while ``stamp`` holds.

  Only graphs of modules are kept (a list or dict root cannot be referred to weakly).
  """
  if not roots:
    return None
  key = _key(roots)
  try:
    walk = Walk(roots[0], _forget)
    walk.others = tuple(weakref.ref(r, lambda ref, k=key: _forget(ref, k)) for r in roots[1:])
  except TypeError:
    return None
  walk.key, walk.stamp, walk.graphdef, walk.variables = key, stamp, graphdef, variables
  walks[key] = walk
  return walk


def walk_of(roots: Sequence[Any]) -> Walk | None:
  """The entry of ``roots`` if it still holds (their structure is as walked), else None."""
  if not roots:
    return None
  walk = walks.get(_key(roots))
  if (
    walk is None
    or walk() is not roots[0]
    or (len(roots) > 1 and any(ref() is not r for ref, r in zip(walk.others, roots[1:])))
    or not walk.stamp.holds()
  ):
    return None
  return walk
