"""What statefulremat keeps on modules outside their graph.

A few attributes are the library's own notes, not part of any model: every walk
(split, iteration, display, pickling, restructuring) skips them, so they never enter
a GraphDef, a State or a repr. They are named here, once, and read through these names:

* ``OWNER`` on a module: ``(weak reference to the parent, key path)``, where it
  hangs (a Variable keeps the same in its ``_owner`` slot); error messages name
  objects by it. Rebuilt on load, never pickled.
* ``LAYER_KEYS`` on an ``Rngs`` rebuilt inside a layer loop: the keys each stream
  name draws for this layer (``_rules.LayerKeys``).
* ``LAYER_INDEX`` on a stack rebuilt inside a pipeline stage (a slice of the whole
  stack): ``(1, first)``, its layer ``j`` is layer ``first + j`` of the whole (``first``
  may be traced), so the layer loop seeds the keys of the global indices.
* ``SPLITS`` on a stacked class: a classmethod, ``name -> bool``, whether the class's
  rules split RNG stream ``name``; the ``LayerKeys`` of a layer taken out of a stack
  asks it, so that a pickle of the layer names the class, not the rules' lambdas.
* ``STACK_INFO`` on a class made by a class form over layers: its ``StackInfo``
  (``_stacks``), the class's own (read from its ``__dict__``, never inherited).
* ``LAYER_ORIGIN`` on a layer taken out of a stack (``stack.layer(i)``): the stack
  class, its stacked paths and the RNG state it drew from (``_stacks.LayerOrigin``),
  kept as a plain tuple so that a pickled layer names no private class.
* ``TRANSFORMED`` on a class made by a class form (``sr.remat(Block)``): True. Such a
  class cannot be found by name, so pickle makes it again from its ``MADE_BY``.
* ``MADE_BY`` on a class a class form returned: ``(form, target, args, kwargs)``, the
  call that made it (``sr.scan(Block, length=3)``: ``("scan", Block, (), {"length":
  3})``), the class's own (``transforms/_class_form``).
* ``VERSION`` on a module or a tracked container: how many times its structure
  changed (``_tracing.structure_changed``); a cached walk of its graph holds while it
  stays (``_graph_cache.Stamp``). Copied with the object, as it only counts.
* ``DEFINED_IN`` on a public class: the private module that defines it, now that its
  ``__module__`` is the public one (``name_public_classes``), the class's own.
"""

from __future__ import annotations

_PREFIX = "_sr_"
OWNER = _PREFIX + "owner"
LAYER_KEYS = _PREFIX + "layer_keys"
LAYER_INDEX = _PREFIX + "layer_index"
SPLITS = _PREFIX + "splits"
TRANSFORMED = _PREFIX + "transformed"
MADE_BY = _PREFIX + "made_by"
STACK_INFO = _PREFIX + "stack"
LAYER_ORIGIN = _PREFIX + "origin"
DEFINED_IN = _PREFIX + "defined_in"
VERSION = _PREFIX + "version"


def is_bookkeeping(name: str) -> bool:
  """Whether attribute ``name`` is one of the library's notes (skipped by walks)."""
  return name.startswith(_PREFIX)


def name_public_classes(namespace: dict, module: str) -> None:
  """Names ``module`` (a public module: ``statefulremat``, ``statefulremat.nn``) as the
  ``__module__`` of each class in its ``namespace`` that a private file under it defines,
  so that pickles, reprs and tracebacks say ``statefulremat.State``, a path that moving
  files never breaks. The defining module stays as the class's own ``DEFINED_IN`` for
  the tools that read source by module: doctest's finder (../conftest.py) and Sphinx's
  autodoc and viewcode (docs/conf.py). Classes made later keep their own ``__module__``:
  a user's subclass, the stack class of a class form (``sr.scan(Block, ...)``).
  """
  for value in list(namespace.values()):
    if not isinstance(value, type) or not value.__module__.startswith(module + "."):
      continue
    if any(part.startswith("_") for part in value.__module__.split(".")):
      setattr(value, DEFINED_IN, value.__module__)
      value.__module__ = module
