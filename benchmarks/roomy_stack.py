"""Runs a measurement where CPython's frame stack has room, so no library pays for
where a chunk boundary happens to fall.

CPython 3.11 and 3.12 (and 3.13 before its fix) keep frames in 16 KiB chunks and free
a chunk as soon as the last frame in it returns (CPython issue gh-142183; the fix
keeps one spare chunk). Tracing calls into JAX's deep recursion thousands of times,
and every call that crosses a chunk boundary maps a fresh chunk and unmaps it on
return: from a handful to hundreds of times per lowering, depending only on how deep
the caller stands. That moved trace+lower by 10-20 %, either way: a library's ratio to
raw JAX changed between ``python -m benchmarks`` and a script, and between two stack
depths of one script, although each did the same work (``strace`` counts the 16 KiB
``mmap`` calls; ``benchmarks/frame_chunks.py`` simulates the chunks at every
alignment, where statefulremat and raw JAX cross about equally often on average).

``in_roomy_stack(fn)`` calls ``fn()`` from a frame of 512 KiB. CPython gives that
frame a chunk of its own, 1 MiB, so ``fn`` and every call under it (the deepest
lowering here, remat_scan d=3 at N=256, goes 40 KiB deep) find room in the 512 KiB
left, and no chunk boundary is crossed: each library's seconds are its own work, as
on a CPython with the fix.

>>> in_roomy_stack(lambda: "measured")
'measured'
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_SLOTS = 1 << 16  # local variables of 8 bytes: a 512 KiB frame


@functools.cache
def _roomy_caller() -> Callable:
  # The locals exist only to size the frame (CPython reserves a slot for each local
  # when the frame is pushed, and leaves them unset), so the code is generated.
  names = " = ".join(f"_{i:x}" for i in range(_SLOTS))
  source = f"def call(fn):\n  if fn is None:\n    {names} = None\n  return fn()\n"
  namespace: dict = {}
  exec(compile(source, __file__, "exec"), namespace)  # noqa: S102 (source above)
  return namespace["call"]


def in_roomy_stack(fn: Callable[[], Any]) -> Any:
  """``fn()``, called where CPython's frame stack has 512 KiB free in one chunk."""
  return _roomy_caller()(fn)
