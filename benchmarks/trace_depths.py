"""Trace+lower of the scan forms against raw JAX, as a user's script meets it.

    python -m benchmarks.trace_depths [--quick]

``benchmarks/compiling.py`` lowers from a roomy frame (``benchmarks/roomy_stack.py``),
where no lowering crosses a boundary of CPython's 16 KiB frame-stack chunks. A user's
script has no such frame: how many chunks a lowering maps and unmaps depends on how
deep its caller stands. So here every lowering runs from a plain caller, ``depth``
extra Python frames down, for each construction (scan, scan(remat), remat_scan with 2
and 3 levels) and depth N. For each (construction, N, caller depth) statefulremat's
and raw JAX's gradient functions are made afresh and lowered moments apart, each first
in turn, with raw JAX lowered from a roomy frame as well (what it costs without the
chunk toll); the figure is the median of the paired ratios, against the target of 1.1x.
sr.jit traces from a frame with room of its own (``statefulremat/transforms/_jit.py``),
so its figures should not move with the caller's depth; raw JAX's do.

Seconds on a shared machine are noisy, so each (construction, N) also counts the Python
function calls one lowering makes (``cProfile``: the same count on every run and every
machine, for one jax): statefulremat's over raw JAX's is its own trace work, whatever
the load.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

from .compiling import measure as lower_and_compile
from .compiling import paired_ratio, stats
from .roomy_stack import in_roomy_stack

CONSTRUCTIONS = ("scan", "scan_remat", "remat_scan_d2", "remat_scan_d3")
TARGET = 1.1
FULL = {"depths": (64, 256), "callers": (0, 8, 16, 32, 61), "reps": 9, "width": 256, "batch": 4096}
QUICK = {"depths": (4,), "callers": (0, 8), "reps": 2, "width": 8, "batch": 2}


# What is lowered: each library from the plain caller, and raw JAX from a roomy frame
# too, where no chunk boundary is crossed (statefulremat's own work against raw JAX's).
_RUNS = {"raw": ("raw", False), "sr": ("sr", False), "raw_roomy": ("raw", True)}
_ORDER = list(_RUNS)


def at_depth(extra: int, fn):
  """``fn()`` called ``extra`` plain Python frames below the caller.

  >>> at_depth(3, lambda: len(__import__("inspect").stack()) > 3)
  True
  """
  if extra == 0:
    return fn()
  return at_depth(extra - 1, fn)


def _lower_s(case) -> float:
  fn = case.new()  # fresh closures and transform wrappers: no cache to hit
  return lower_and_compile(fn, case.args, compile=False)[0]


def python_calls(case) -> int:
  """The Python function calls one lowering of ``case`` makes (after a first one has
  filled the caches): a count, not a time, so it repeats exactly."""
  _lower_s(case)
  profile = cProfile.Profile()
  profile.enable()
  _lower_s(case)
  profile.disable()
  return pstats.Stats(profile).total_calls  # pyright: ignore[reportAttributeAccessIssue]


def measure(quick: bool = False, log=None) -> dict:
  """Paired trace+lower seconds of statefulremat and raw JAX at every caller depth.

  Returns ``{"config", "target", "entries", "met", "worst"}``: one entry per
  (construction, N, caller depth) with ``sr``, ``raw`` and ``raw_roomy`` seconds
  (min/median/max and samples), ``ratio`` (sr / raw, median of the paired ratios),
  ``ratio_min``/``ratio_max``, ``met`` (ratio <= target) and ``ratio_to_roomy_raw``
  (sr / raw lowered where it crosses no chunk boundary: statefulremat's own cost).
  """
  from .models import builders

  config = QUICK if quick else FULL
  build = builders()
  entries = []
  for construction in CONSTRUCTIONS:
    for n in config["depths"]:
      cases = {
        lib: build[lib](construction, n, config["width"], config["batch"]) for lib in ("raw", "sr")
      }
      for case in cases.values():  # imports and first-use caches out of the way
        _lower_s(case)
      calls = {lib: python_calls(case) for lib, case in cases.items()}
      for caller in config["callers"]:
        samples = {name: [] for name in _RUNS}
        for rep in range(config["reps"]):
          shift = rep % len(_RUNS)  # each goes first in turn
          for name in _ORDER[shift:] + _ORDER[:shift]:
            lib, room = _RUNS[name]
            call = (
              (lambda: in_roomy_stack(lambda: _lower_s(cases[lib])))
              if room
              else (lambda: _lower_s(cases[lib]))
            )
            samples[name].append(at_depth(caller, call))
        ratios = [a / b for a, b in zip(samples["sr"], samples["raw"])]
        entry = {
          "construction": construction,
          "n": n,
          "caller_depth": caller,
          **{name: stats(samples[name]) for name in _RUNS},
          "ratio": paired_ratio(samples["sr"], samples["raw"]),
          "ratio_min": min(ratios),
          "ratio_max": max(ratios),
          "ratio_to_roomy_raw": paired_ratio(samples["sr"], samples["raw_roomy"]),
          "python_calls": calls,
          "calls_ratio": calls["sr"] / calls["raw"],
        }
        entry["met"] = entry["ratio"] <= TARGET
        entries.append(entry)
        if log is not None:
          log(_row(entry))
  worst = max(entries, key=lambda e: e["ratio"])
  return {
    "config": dict(config),
    "target": TARGET,
    "entries": entries,
    "met": all(e["met"] for e in entries),
    "worst": {k: worst[k] for k in ("construction", "n", "caller_depth", "ratio")},
  }


_NAMES = {
  "scan": "scan",
  "scan_remat": "scan(remat)",
  "remat_scan_d2": "remat_scan d=2",
  "remat_scan_d3": "remat_scan d=3",
}


def _row(e: dict) -> str:
  ms = lambda s: f"{s['min'] * 1e3:.1f} / {s['median'] * 1e3:.1f} / {s['max'] * 1e3:.1f}"
  return (
    f"| {_NAMES[e['construction']]} | {e['n']} | {e['caller_depth']} | "
    f"{ms(e['sr'])} | {ms(e['raw'])} | {e['ratio_min']:.3f} / {e['ratio']:.3f} / "
    f"{e['ratio_max']:.3f} | {'yes' if e['met'] else 'no'} | "
    f"{ms(e['raw_roomy'])} | {e['ratio_to_roomy_raw']:.3f} | "
    f"{e['python_calls']['sr']} / {e['python_calls']['raw']} = {e['calls_ratio']:.3f} |"
  )


def markdown(result: dict) -> str:
  """The entries as a table, with the target and whether every entry meets it."""
  c = result["config"]
  met = sum(e["met"] for e in result["entries"])
  w = result["worst"]
  lines = [
    f"Trace+lower from a plain caller, {c['reps']} paired lowerings per row "
    f"(W={c['width']}, B={c['batch']}); ms min / median / max; ratio = "
    f"statefulremat / raw JAX, min / median of the paired ratios / max. Target "
    f"<= {result['target']}x: met in {met} of {len(result['entries'])} rows (worst "
    f"{w['ratio']:.3f}x, {_NAMES[w['construction']]} N={w['n']} at caller depth "
    f"{w['caller_depth']}). The last two columns: raw JAX lowered from a roomy frame "
    "(benchmarks/roomy_stack.py, no frame-stack chunk mapped), and statefulremat's "
    "paired ratio to it. The last: the Python function calls of one lowering, "
    "statefulremat / raw JAX (a count: the same on every run, whatever the load).",
    "",
    "| construction | N | caller depth | sr ms | raw ms | ratio | <= target | "
    "raw, roomy ms | sr / roomy raw | Python calls, sr / raw |",
    "|---|---:|---:|---|---|---|---|---|---:|---:|",
  ]
  lines += [_row(e) for e in result["entries"]]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  print(
    markdown(
      measure(
        quick="--quick" in sys.argv[1:], log=lambda line: print(line, file=sys.stderr, flush=True)
      )
    )
  )
