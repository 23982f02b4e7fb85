"""Part 3: step time of the jitted gradient, as a ratio to raw JAX.

For each depth and construction every library's compiled gradient function is called
``calls`` times, the libraries interleaved (one call each per round, the order rotating
from round to round) so that a busy machine slows them alike; each call is blocked with
``jax.block_until_ready``. The ratio is a library's median over raw JAX's median.
"""

from __future__ import annotations

import time

import jax

from .compiling import stats
from .models import LIBRARIES, STRATEGIES, NotApplicable, builders


def interleaved(fns: dict, calls: int) -> tuple[dict, dict]:
  """``(ms, µs)`` per name: milliseconds per synchronised call, and microseconds until
  each call returned (its dispatch). ``fns`` maps a name to ``(fn, args)``; every round
  calls each once, in an order that rotates from round to round."""
  names = list(fns)
  steps = {name: [] for name in names}
  dispatch = {name: [] for name in names}
  for i in range(calls):
    shift = i % len(names)
    for name in names[shift:] + names[:shift]:
      fn, args = fns[name]
      start = time.perf_counter()
      out = fn(*args)
      returned = time.perf_counter()
      jax.block_until_ready(out)
      steps[name].append((time.perf_counter() - start) * 1e3)
      dispatch[name].append((returned - start) * 1e6)
  return steps, dispatch


def run(depths, width: int, batch: int, calls: int, *, compiled=None, log=print) -> list[dict]:
  """One entry per library x strategy x depth: ``ms`` (min/median/max) and ``ratio``.

  ``compiled`` maps ``(library, strategy, n)`` to an already compiled ``(jitted, args)``
  for the same width and batch; anything missing is built and compiled here.
  """
  compiled = compiled or {}
  build = builders()
  entries = []
  for n in depths:
    for strategy in STRATEGIES:
      fns, results = {}, {}
      for lib in LIBRARIES:
        results[lib] = {"library": lib, "strategy": strategy, "n": n}
        try:
          fn, args = compiled.get((lib, strategy, n)) or _fresh(
            build[lib], strategy, n, width, batch
          )
        except NotApplicable as e:
          results[lib].update(status="n/a", reason=str(e))
          continue
        for _ in range(2):  # compile (if needed) and settle
          jax.block_until_ready(fn(*args))
        fns[lib] = (fn, args)
        results[lib]["status"] = "ok"
      samples, _ = interleaved(fns, calls)
      for lib, ms in samples.items():
        results[lib]["ms"] = stats(ms)
      if "raw" in samples:
        base = results["raw"]["ms"]["median"]
        for lib in samples:
          results[lib]["ratio"] = results[lib]["ms"]["median"] / base
      entries.extend(results.values())
      log(
        f"  N={n:<4d} {strategy:14s} "
        + " | ".join(
          f"{lib} {r['ms']['median']:.2f} ms ({r.get('ratio', float('nan')):.3f}x)"
          for lib, r in results.items()
          if r["status"] == "ok"
        )
      )
  return entries


def _fresh(build, strategy, n, width, batch):
  case = build(strategy, n, width, batch)
  return case.new(), case.args
