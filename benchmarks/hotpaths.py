"""Issue 23's hot paths, measured in one run: ``python -m benchmarks --part hotpaths``.

Three figures a user pays on every call or every trace, each against its baseline in
the same process, as min / median / max and median ratios:

3. raw JAX on modules (``benchmarks/pytree_flatten.py``): the pytree flatten +
   unflatten of a module per Variable against equinox's, and raw ``jax.jit(f)(model,
   x)`` dispatch against raw ``jax.jit(f)(state, x)``;
4. trace + lower of the scan forms from a plain caller at several caller stack depths
   against the hand-written raw JAX construction (``benchmarks/trace_depths.py``);
5. dispatch of one training step against raw ``jax.jit`` and every peer library
   (``benchmarks/dispatch.py``; its section of ``results.json`` is replaced as by
   ``--part dispatch``).

Writes ``hotpaths.json`` and ``hotpaths.md`` into ``--out``.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import dispatch, pytree_flatten, trace_depths


def run(
  quick: bool, out: Path, *, dispatch_part: Callable[[], dict], machine: str, log=print
) -> dict:
  """Runs parts 3, 4 and 5; ``dispatch_part()`` runs the dispatch part into the
  results already in ``out`` and returns them."""
  start = time.perf_counter()
  log("hot paths 3: raw JAX on modules (pytree flatten)")
  flatten = pytree_flatten.measure(quick)
  log("hot paths 4: trace + lower at several caller depths")
  depths = trace_depths.measure(quick)
  log("hot paths 5: dispatch")
  results = dispatch_part()
  hot = {
    "config": {
      "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": machine,
      "quick": quick,
      "command": "python -m benchmarks --part hotpaths" + (" --quick" * quick),
      "seconds": time.perf_counter() - start,
    },
    "pytree_flatten": flatten,
    "trace_depths": depths,
    "dispatch": results["dispatch"],
  }
  out.mkdir(parents=True, exist_ok=True)
  with open(out / "hotpaths.json", "w") as f:
    json.dump(hot, f, indent=1)
  (out / "hotpaths.md").write_text(markdown(hot))
  return hot


def markdown(hot: dict) -> str:
  c = hot["config"]
  return "\n".join(
    [
      "# Hot paths (issue 23, parts 3-5)",
      "",
      f"Measured {c['date']} on {c['machine']} (`{c['command']}`, {c['seconds']:.0f} s), "
      "all three parts in one process.",
      "",
      "## 3. Raw JAX on modules",
      "",
      pytree_flatten.markdown(hot["pytree_flatten"]),
      "## 4. Trace + lower of the scan forms, from a plain caller",
      "",
      trace_depths.markdown(hot["trace_depths"]),
      "## 5. Dispatch of one training step",
      "",
      dispatch.table(hot["dispatch"]),
      "",
    ]
  )
