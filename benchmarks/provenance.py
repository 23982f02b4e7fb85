"""Where, when and how a benchmark ran: the keys every result's ``config`` shares, and the
command line of a part run alone (``python -m benchmarks.planner [--quick] [--out DIR]``).

    >>> sorted(provenance(True, "a test machine", "python -m benchmarks.planner --quick"))
    ['command', 'date', 'device', 'jax', 'machine', 'quick']
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from collections.abc import Callable
from pathlib import Path

import jax


def machine() -> str:
  """The CPU's model, its cores and the OS, as the results' headers print them."""
  cpu = platform.processor() or platform.machine()
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def provenance(quick: bool, machine: str, command: str) -> dict:
  """The ``config`` keys of a result that say where, when and how it was measured."""
  return {
    "quick": quick,
    "machine": machine,
    "command": command,
    "device": str(jax.devices()[0]),
    "jax": jax.__version__,
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
  }


def part_main(module: str, doc: str, run: Callable, quick_help: str, argv=None):
  """``python -m benchmarks.<module> [--quick] [--out DIR]``: ``run(quick, out, machine=,
  command=)`` with this machine and the command as typed; returns what ``run`` returns."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help=quick_help)
  parser.add_argument("--out", default=None, help="output folder (default benchmarks/results)")
  args = parser.parse_args(argv)
  command = f"python -m benchmarks.{module}" + (" --quick" if args.quick else "")
  out = {} if args.out is None else {"out": args.out}
  return run(args.quick, **out, machine=machine(), command=command)
