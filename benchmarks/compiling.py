"""Parts 1 and 2: XLA compiled memory, trace+lower seconds and compile seconds.

For every depth N and construction, each library's gradient function is made afresh
for every sample (new closures and transform wrappers, so no trace or compile cache
can hide the cost), lowered and compiled; every sweep takes all of them in turn, so a
busy machine slows them alike, each where CPython's frame stack has room
(``benchmarks/roomy_stack.py`` says why).
``memory_analysis()`` of the compiled executable gives temp, argument and output
bytes; they are exact, and the same in every repetition.
"""

from __future__ import annotations

import gc
import statistics
import time

from .models import LIBRARIES, STRATEGIES, NotApplicable, builders, strategy_lengths
from .roomy_stack import in_roomy_stack


def stats(samples: list[float]) -> dict:
  """``min``, ``median``, ``max`` and the samples themselves."""
  return {
    "min": min(samples),
    "median": statistics.median(samples),
    "max": max(samples),
    "samples": samples,
  }


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  return {
    "temp": int(m.temp_size_in_bytes),
    "arguments": int(m.argument_size_in_bytes),
    "outputs": int(m.output_size_in_bytes),
  }


def measure(fn, args: tuple, compile: bool = True):
  """``(trace+lower s, compile s, bytes)`` of a fresh jitted ``fn`` on ``args``; the
  last two None without ``compile``. Compiling fills the cache ``fn``'s calls use."""
  gc.disable()  # a collection inside the timed region would be charged to one library
  try:
    start = time.perf_counter()
    lowered = fn.lower(*args)
    lowered_at = time.perf_counter()
    if not compile:
      return lowered_at - start, None, None
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
  finally:
    gc.enable()
  return lowered_at - start, compiled_at - lowered_at, _memory(compiled)


def run(
  depths,
  width: int,
  batch: int,
  reps: int,
  trace_reps: int = 0,
  *,
  compiler_options=None,
  keep_depths=(),
  log=print,
) -> tuple[list[dict], dict]:
  """Measures every library x strategy x depth.

  Every repetition sweeps all depths, constructions and libraries in turn, so a change
  in the machine's load spreads over all of them instead of bending one curve. The
  first ``reps`` sweeps lower and compile; sweeps up to ``trace_reps`` only lower, as
  trace+lower takes tens of milliseconds for the scan forms and needs more samples.

  Returns ``(entries, kept)``: one entry per combination (``status`` ``"ok"`` with
  ``bytes``, ``trace_lower_s`` and ``compile_s``, or ``"n/a"`` with a ``reason``), and
  ``{(library, strategy, n): (jitted, args)}`` for the depths in ``keep_depths``, whose
  functions are compiled already and can be timed without compiling again.
  """
  build = builders()
  groups, cases = {}, {}
  for n in depths:
    for strategy in STRATEGIES:
      group = groups[(n, strategy)] = {}
      for lib in LIBRARIES:
        entry = group[lib] = {
          "library": lib,
          "strategy": strategy,
          "n": n,
          "lengths": strategy_lengths(strategy, n),
        }
        try:
          cases[(lib, strategy, n)] = build[lib](strategy, n, width, batch)
          entry["status"] = "ok"
        except NotApplicable as e:
          entry.update(status="n/a", reason=str(e))
  samples = {key: ([], []) for key in cases}
  kept = {}
  sweeps = max(reps, trace_reps)
  for rep in range(sweeps):
    log(f"  sweep {rep + 1} of {sweeps}" + ("" if rep < reps else " (trace+lower only)"))
    # One construction's libraries run back to back, in reversed order every other
    # sweep, so each library's sample has a raw sample taken moments apart and neither
    # always goes first (``_add_ratios`` pairs them).
    order = list(cases.items()) if rep % 2 == 0 else _reversed_within_groups(cases)
    for (lib, strategy, n), case in order:
      fn = case.new(compiler_options)
      lower_s, compile_s, nbytes = in_roomy_stack(lambda: measure(fn, case.args, rep < reps))
      samples[(lib, strategy, n)][0].append(lower_s)
      if compile_s is None:
        continue
      samples[(lib, strategy, n)][1].append(compile_s)
      previous = groups[(n, strategy)][lib].setdefault("bytes", nbytes)
      if previous != nbytes:
        raise AssertionError(
          f"{lib} {strategy} N={n}: bytes changed between repetitions: {previous} then {nbytes}"
        )
      if rep == reps - 1 and n in keep_depths:
        kept[(lib, strategy, n)] = (fn, case.args)
  entries = []
  for (n, strategy), group in groups.items():
    for lib, entry in group.items():
      if entry["status"] == "ok":
        lower_s, compile_s = samples[(lib, strategy, n)]
        entry["trace_lower_s"] = stats(lower_s)
        entry["compile_s"] = stats(compile_s)
    _add_ratios(group)
    entries.extend(group.values())
    log(_line(n, strategy, group))
  return entries, kept


def _reversed_within_groups(cases: dict) -> list:
  groups: dict = {}
  for key, case in cases.items():
    groups.setdefault(key[1:], []).append((key, case))
  return [item for group in groups.values() for item in reversed(group)]


def paired_ratio(mine: list[float], raw: list[float]) -> float:
  """The median over sweeps of ``mine[i] / raw[i]``: each ratio compares two samples
  taken moments apart, so a change in the machine's load cancels out of it.

  >>> paired_ratio([2.0, 9.0, 3.0], [1.0, 10.0, 2.0])
  1.5
  """
  return statistics.median(a / b for a, b in zip(mine, raw))


def _add_ratios(results: dict) -> None:
  """Each library's figures over raw JAX's with the same construction.

  Bytes are exact. Trace+lower is the paired ratio (tens of milliseconds, where a
  shared machine's noise is as large as the differences); compile, seconds long, the
  ratio of medians.
  """
  raw = results.get("raw")
  if raw is None or raw["status"] != "ok":
    return
  for entry in results.values():
    if entry["status"] != "ok":
      continue
    entry["ratio"] = {
      **{k: _ratio(entry["bytes"][k], raw["bytes"][k]) for k in entry["bytes"]},
      "trace_lower": paired_ratio(
        entry["trace_lower_s"]["samples"], raw["trace_lower_s"]["samples"]
      ),
      "trace_lower_of_medians": (entry["trace_lower_s"]["median"] / raw["trace_lower_s"]["median"]),
      "compile": entry["compile_s"]["median"] / raw["compile_s"]["median"],
    }


def _ratio(a: int, b: int) -> float:
  return a / b if b else (1.0 if a == b else float("inf"))


def _line(n: int, strategy: str, results: dict) -> str:
  parts = []
  for lib, e in results.items():
    if e["status"] != "ok":
      parts.append(f"{lib} n/a")
    else:
      parts.append(
        f"{lib} {e['bytes']['temp'] / 2**20:.2f} MiB "
        f"{e['trace_lower_s']['median']:.2f}+{e['compile_s']['median']:.2f}s"
      )
  return f"  N={n:<4d} {strategy:14s} " + " | ".join(parts)
