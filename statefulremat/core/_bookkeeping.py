"""What statefulremat keeps on modules outside their graph.

A few attributes are the library's own notes, not part of any model: every walk
(split, iteration, display, pickling, restructuring) skips them, so they never enter
a GraphDef, a State or a repr. They are named here, once, and read through these names:

* ``OWNER`` on a module: ``(weak reference to the parent, key path)``, where it
  hangs (a Variable keeps the same in its ``_owner`` slot); error messages name
  objects by it. Rebuilt on load, never pickled.
* ``LAYER_KEYS`` on an ``Rngs`` rebuilt inside a layer loop: the keys each stream
  name draws for this layer (``_rules.LayerKeys``).
* ``STACK_INFO`` on a class made by a class form over layers: its ``StackInfo``
  (``_stacks``), the class's own (read from its ``__dict__``, never inherited).
* ``LAYER_ORIGIN`` on a layer taken out of a stack (``stack.layer(i)``): the stack
  class, its stacked paths and the RNG state it drew from (``_stacks.LayerOrigin``).
* ``TRANSFORMED`` on a class made by a class form (``sr.remat(Block)``): True; such
  a class cannot be found again by name, so its instances refuse to pickle.
"""

from __future__ import annotations

_PREFIX = "_sr_"
OWNER = _PREFIX + "owner"
LAYER_KEYS = _PREFIX + "layer_keys"
TRANSFORMED = _PREFIX + "transformed"
STACK_INFO = _PREFIX + "stack"
LAYER_ORIGIN = _PREFIX + "origin"


def is_bookkeeping(name: str) -> bool:
  """Whether attribute ``name`` is one of the library's notes (skipped by walks)."""
  return name.startswith(_PREFIX)
