"""How often a lowering crosses a boundary of CPython's frame-stack chunks, per library.

    python -m benchmarks.frame_chunks [STRATEGY] [N]   # default remat_scan_d2 16

CPython 3.11 and 3.12 keep frames in 16 KiB chunks and free a chunk when its last frame
returns (see ``benchmarks/roomy_stack.py``). Whether a call crosses a boundary depends
on how many bytes of frames lie below it, which nobody controls; so this replays one
lowering of each library's gradient under ``sys.setprofile`` and simulates the chunks
at 64 alignments of the caller's stack at once (every 256 bytes of a chunk), counting
the chunks each would map. A frame's size is CPython 3.11's: its locals, cells, free
variables and value stack, plus 7 words of bookkeeping.

The spread (min to max over alignments) is the toll a fixed stack depth can take; the
mean, compared between libraries, is what each costs on average.
"""

from __future__ import annotations

import gc
import sys

from .models import builders

CHUNK = 16384 - 24  # data bytes of a chunk: 16 KiB less its 3-pointer header
ALIGNMENTS = range(0, CHUNK, 256)
_GENERATOR = 0x20 | 0x80 | 0x200  # generator, coroutine, async generator: own frames


def frame_bytes(code) -> int:
  """Bytes a call of ``code`` takes on CPython 3.11's frame stack."""
  slots = code.co_nlocals + len(code.co_cellvars) + len(code.co_freevars) + code.co_stacksize + 7
  return 8 * slots


def chunk_bytes(size: int) -> int:
  """Data bytes of the chunk CPython maps for a frame of ``size`` bytes: 16 KiB,
  doubled until the frame and 1000 slots more fit (a frame that reserves room, as
  sr.jit's tracing does, gets a chunk of its own with that room), less the header."""
  total = CHUNK + 24
  while total < size + 8 * 1000:
    total *= 2
  return total - 24


class ChunkedStack:
  """CPython's frame stack, as far as chunk allocation goes."""

  def __init__(self, used: int):
    self.used = [used]  # bytes used in each live chunk, the first holding the caller
    self.capacity = [CHUNK]
    self.frames: list[tuple[int, bool]] = []  # (bytes, whether it opened a chunk)
    self.mapped = 0

  def push(self, size: int) -> None:
    opens = self.used[-1] + size > self.capacity[-1]
    if opens:
      self.used.append(size)
      self.capacity.append(chunk_bytes(size))
      self.mapped += 1
    else:
      self.used[-1] += size
    self.frames.append((size, opens))

  def pop(self) -> None:
    size, opened = self.frames.pop()
    if opened:
      self.used.pop()
      self.capacity.pop()
    else:
      self.used[-1] -= size


def simulate(call) -> list[int]:
  """Chunks ``call()`` maps, at each of ``ALIGNMENTS``."""
  stacks = [ChunkedStack(a) for a in ALIGNMENTS]

  def profile(frame, event, arg):
    if frame.f_code.co_flags & _GENERATOR:
      return
    if event == "call":
      size = frame_bytes(frame.f_code)
      for s in stacks:
        s.push(size)
    elif event == "return":
      for s in stacks:
        s.pop()

  gc.disable()
  sys.setprofile(profile)
  try:
    call()
  finally:
    sys.setprofile(None)
    gc.enable()
  return [s.mapped for s in stacks]


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  strategy = argv[0] if argv else "remat_scan_d2"
  n = int(argv[1]) if len(argv) > 1 else 16
  for lib, build in builders().items():
    case = build(strategy, n, 64, 32)
    case.new().lower(*case.args)  # imports and first-use caches out of the way
    fn = case.new()
    mapped = simulate(lambda: fn.lower(*case.args))
    print(
      f"{lib:6} {strategy} N={n}: chunks mapped per lowering, mean "
      f"{sum(mapped) / len(mapped):.0f}, min {min(mapped)}, max {max(mapped)} "
      f"over {len(mapped)} alignments"
    )


if __name__ == "__main__":
  main()
