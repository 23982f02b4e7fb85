"""Every table statefulremat keeps from one call to the next, and nothing else.

No other file of the package holds a module-level table that changes after import: the
files that use one import it from here. ``core/README.md`` says, for each, what it
holds, its key, and when an entry goes.
"""

from __future__ import annotations

import itertools
import threading
import types
import weakref
from typing import Any

import numpy as np

# -- the graph (core) ---------------------------------------------------------------

structure_epoch = types.SimpleNamespace(value=0)  # moves on with any change to any graph
graphdefs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # the first of equals
walks: dict[Any, Any] = {}  # id(root), or the ids of roots walked together -> Walk
serials = itertools.count()  # every Variable gets the next one when it is made
lock_groups: dict[int, tuple] = {}  # id(Variable) -> (weak reference, its graph's lock)
lock_ranks = itertools.count()  # the order in which several graphs' locks are taken
lock_registry = threading.Lock()  # `lock_groups`' merges and new entries

# -- what the floors above register at import (the core imports nothing above it) ----

display_hooks: dict[str, Any] = {}  # "text" / "treescope" / "value_summary" -> renderer
class_hooks: list = []  # called with each Module class as it is defined

# -- the transforms -----------------------------------------------------------------

# Leaf types that hold no tracer: a call's arguments of these skip tree_flatten and the
# trace check. JAX's concrete array class is private, so it is learnt when first seen.
plain_leaf_types: set[type] = {np.ndarray, int, float, bool, complex}
lifted_steps: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # the first of equals
made_classes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # frozen call -> class
class_forms: dict[str, Any] = {}  # "scan" -> the cached class form, for MADE_BY and pickles
joined_metaclasses: dict[type, type] = {}  # a user's metaclass -> it joined with MadeClass
# The planner's compiled temp bytes: (body, stack and carry shapes, remat, backend) ->
# {(lengths, policy, carries): bytes}; the oldest stack's go past PLANNED_STACKS.
planned_bytes: dict[tuple, dict] = {}
PLANNED_STACKS = 32

# -- the display and the checkpoints ------------------------------------------------

array_summaries: dict[int, str] = {}  # id(array) -> its statistics' text, while it lives
init_defaults: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> __init__ defaults
summary_patch_lock = threading.Lock()  # one sr.summary at a time wraps the classes' __call__
checkpoint_threads: dict[str, Any] = {}  # a checkpoint directory -> its threads' locks
checkpoint_threads_lock = threading.Lock()
pending_saves: dict[str, list] = {}  # a checkpoint directory -> its background saves
pending_saves_lock = threading.Lock()
save_numbers: dict[str, int] = {}  # a checkpoint directory -> the number of its last save
