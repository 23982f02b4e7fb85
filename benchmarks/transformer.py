"""The transformer family: a stack of pre-LN GPT blocks, in every library.

    python -m benchmarks.transformer [--quick] [--out DIR]

N in {16, 64} blocks of d=256 (4 heads, MLP 4d, dropout 0.1), seq 256, batch 8; the
gradient of ``mean(stack(x) ** 2)`` over the params (see
``benchmarks/transformer_models.py``), built as ``scan_remat``, ``remat_scan`` (2
levels) and ``remat_scan_auto`` (statefulremat's ``lengths="auto"``; raw JAX runs its
pick by hand). For every library x construction x N, in one run:

* temp memory: ``memory_analysis()`` of the compiled gradient (exact);
* first call: trace + lower + compile of a freshly made function (min / median / max
  of ``reps`` sweeps; every sweep takes all variants of a depth in turn, in reversed
  order every other sweep);
* step time: ``calls`` synchronised calls per variant, the libraries of a construction
  interleaved (one call each per round, the order rotating); min / median / max;
* dispatch: from the same calls, the time until the call returns (before
  ``block_until_ready``): the host-side cost of a step.

Targets, statefulremat against raw JAX with the same construction: temp <= 1.01x,
step (median) <= 1.05x, first call (median) <= 1.2x; linen and nnx are reported
beside them. Writes ``transformer.json`` and ``transformer.md`` to ``--out`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/transformer.py`
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax  # noqa: E402
import jax  # noqa: E402

from benchmarks.compiling import measure as measure_compile  # noqa: E402
from benchmarks.compiling import stats  # noqa: E402
from benchmarks.timing import interleaved  # noqa: E402
from benchmarks.transformer_models import (  # noqa: E402
  CONSTRUCTIONS,
  LIBRARIES,
  Config,
  NotApplicable,
  build,
  sr_plan,
)

RESULTS = Path(__file__).resolve().parent / "results"
TEMP_RATIO, STEP_RATIO, FIRST_CALL_RATIO = 1.01, 1.05, 1.2
NAMES = {"raw": "raw JAX", "linen": "flax.linen", "nnx": "flax.nnx", "sr": "statefulremat"}

# A step is ~4 s at N=16 and ~20 s at N=64 on the 2-core CPU: few calls, no untimed
# warm-up call (the compile before them is not timed with them), to stay near 15 min.
FULL = {
  "sizes": dict(d=256, heads=4, seq=256, batch=8),
  "depths": (16, 64),
  "reps": 2,
  "calls": {16: 5, 64: 3},
  "warmup": 0,
}
# Tiny sizes: the test suite runs this; the times are mostly dispatch and compile.
QUICK = {
  "sizes": dict(d=16, heads=2, seq=8, batch=2),
  "depths": (4,),
  "reps": 1,
  "calls": {4: 5},
  "warmup": 1,
}


def measure(cfg: Config, reps: int, calls: int, warmup: int = 1, log=print) -> list[dict]:
  """One entry per library x construction at this depth."""
  plan = sr_plan(cfg)
  log(f"  N={cfg.n}: lengths='auto' plans {plan.lengths} ({plan.policy_name})")
  entries, cases = {}, {}
  for c in CONSTRUCTIONS:
    for lib in LIBRARIES:
      e = entries[(c, lib)] = {
        "library": lib,
        "construction": c,
        "n": cfg.n,
        "lengths": list(plan.lengths if c == "remat_scan_auto" else cfg.lengths)
        if c != "scan_remat"
        else None,
      }
      if c == "remat_scan_auto":
        e["policy"] = plan.policy_name
      try:
        cases[(c, lib)] = build(lib, c, cfg, plan)
        e["status"] = "ok"
      except NotApplicable as err:
        e.update(status="n/a", reason=str(err))
  first = {key: ([], [], []) for key in cases}
  fns = {}
  for rep in range(reps):
    order = list(cases) if rep % 2 == 0 else list(reversed(cases))
    for key in order:
      # A first call less its step: lower(...).compile() fills the cache fn's calls
      # use, so the calls after it run the step only.
      fn = cases[key].new()
      lower_s, compile_s, nbytes = measure_compile(fn, cases[key].args)
      seconds = lower_s + compile_s
      for samples, value in zip(first[key], (seconds, lower_s, compile_s)):
        samples.append(value)
      previous = entries[key].setdefault("bytes", nbytes)
      if previous != nbytes:
        raise AssertionError(f"{key}: bytes changed between repetitions")
      fns[key] = (fn, cases[key].args)
    log(f"  N={cfg.n}: first-call sweep {rep + 1} of {reps} done ({time.strftime('%H:%M:%S')})")
  for key, (seconds, lower_s, compile_s) in first.items():
    entries[key].update(
      first_call_s=stats(seconds), trace_lower_s=stats(lower_s), compile_s=stats(compile_s)
    )
  for c in CONSTRUCTIONS:
    group = {lib: fns[(c, lib)] for lib in LIBRARIES if (c, lib) in fns}
    for _ in range(warmup):
      for fn, args in group.values():
        jax.block_until_ready(fn(*args))
    steps, dispatch = interleaved(group, calls)
    for lib in group:
      entries[(c, lib)]["step_ms"] = stats(steps[lib])
      entries[(c, lib)]["dispatch_us"] = stats(dispatch[lib])
    _add_ratios({lib: entries[(c, lib)] for lib in LIBRARIES})
    log(
      f"  N={cfg.n} {c:16s} "
      + " | ".join(
        f"{lib} {e['bytes']['temp'] / 2**20:.1f} MiB {e['step_ms']['median']:.0f} ms "
        f"{e['first_call_s']['median']:.1f} s"
        for lib in LIBRARIES
        if (e := entries[(c, lib)])["status"] == "ok"
      )
    )
  return list(entries.values())


def _add_ratios(group: dict) -> None:
  raw = group["raw"]
  for e in group.values():
    if e["status"] != "ok" or raw["status"] != "ok":
      continue
    e["ratio"] = {
      "temp": e["bytes"]["temp"] / raw["bytes"]["temp"],
      "step": e["step_ms"]["median"] / raw["step_ms"]["median"],
      "first_call": (e["first_call_s"]["median"] / raw["first_call_s"]["median"]),
      "dispatch": (e["dispatch_us"]["median"] / raw["dispatch_us"]["median"]),
    }


def targets(entries: list[dict]) -> list[dict]:
  """statefulremat's ratios against their targets."""
  rows = []
  for e in entries:
    if e["library"] != "sr" or "ratio" not in e:
      continue
    for what, limit in (
      ("temp", TEMP_RATIO),
      ("step", STEP_RATIO),
      ("first_call", FIRST_CALL_RATIO),
    ):
      value = e["ratio"][what]
      rows.append(
        {
          "n": e["n"],
          "construction": e["construction"],
          "what": what,
          "value": value,
          "target": limit,
          "met": value <= limit,
        }
      )
  return rows


def run(quick: bool = False, out: str | Path = RESULTS, log=print) -> dict:
  """Runs the family, writes ``transformer.json`` / ``.md`` to ``out``, returns them."""
  from benchmarks.provenance import machine
  from benchmarks.run import _fast_compiles

  cfg = QUICK if quick else FULL
  start = time.perf_counter()
  entries = []
  with _fast_compiles(quick):
    for n in cfg["depths"]:
      log(
        f"transformer: N={n}, {cfg['sizes']}, {cfg['reps']} first calls, "
        f"{cfg['calls'][n]} timed calls"
      )
      entries += measure(
        Config(n=n, **cfg["sizes"]), cfg["reps"], cfg["calls"][n], cfg["warmup"], log
      )
  results = {
    "config": {
      "quick": quick,
      **cfg["sizes"],
      "mlp_hidden": 4 * cfg["sizes"]["d"],
      "dropout": Config(n=1).dropout,
      "depths": list(cfg["depths"]),
      "reps": cfg["reps"],
      "warmup": cfg["warmup"],
      "calls": {str(k): v for k, v in cfg["calls"].items()},
      "machine": machine(),
      "device": str(jax.devices()[0]),
      "versions": {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
      },
    },
    "entries": entries,
  }
  results["targets"] = targets(entries)
  results["config"]["seconds"] = time.perf_counter() - start
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "transformer.json").write_text(json.dumps(results, indent=1))
  (out / "transformer.md").write_text(markdown(results))
  from benchmarks import plots

  plots.transformer(results, out / "transformer.png")
  return results


def _fmt(s: dict, scale: float = 1.0, digits: int = 0) -> str:
  return " / ".join(f"{s[k] * scale:.{digits}f}" for k in ("min", "median", "max"))


def _mark(value: float, limit: float | None) -> str:
  if limit is None:
    return f"{value:.3f}"
  return f"{value:.3f} {'✓' if value <= limit else '✗'}"


def markdown(results: dict) -> str:
  c = results["config"]
  met = [t for t in results["targets"] if t["met"]]
  lines = [
    "# Transformer benchmark: pre-LN GPT blocks",
    "",
    f"{c['depths']} blocks of d={c['d']} ({c['heads']} heads, MLP {c['mlp_hidden']}, "
    f"dropout {c['dropout']}), seq {c['seq']}, batch {c['batch']}; gradient of "
    "mean(stack(x)^2) over the params, dropout on. Machine: "
    f"{c['machine']}; {c['device']}; JAX {c['versions']['jax']}, flax "
    f"{c['versions']['flax']}, Python {c['versions']['python']}. The run took "
    f"{c['seconds'] / 60:.1f} min"
    + (
      " (quick mode: tiny sizes, optimisations off; the times say little)." if c["quick"] else "."
    ),
    "",
    f"First call: trace + lower + compile of a fresh function (its step not included), "
    f"min / median / max of {c['reps']} sweeps. Step: min / median / max of "
    + ", ".join(f"{v} calls at N={k}" for k, v in c["calls"].items())
    + f", the libraries of a construction interleaved, after {c['warmup']} untimed "
    "call(s) each (few calls, few sweeps: a step takes seconds on a 2-core CPU, and "
    "the run is kept near 15 minutes). Dispatch: time until "
    "the call returned, before blocking on its result. Ratios are medians over raw "
    "JAX's with the same construction; remat_scan_auto in raw JAX runs the lengths and "
    "policy statefulremat's planner picks.",
    "",
    f"Targets (statefulremat / raw JAX): temp <= {TEMP_RATIO}x, step <= {STEP_RATIO}x, "
    f"first call <= {FIRST_CALL_RATIO}x; met: **{len(met)} of "
    f"{len(results['targets'])}**. ✓/✗ mark statefulremat's rows; flax.linen and "
    "flax.nnx are reported beside them.",
    "",
    "| N | construction | library | temp MiB | temp ratio | step ms | step ratio | "
    "first call s | first-call ratio | dispatch µs |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for e in results["entries"]:
    construction = e["construction"]
    if e.get("lengths"):
      construction += f" {tuple(e['lengths'])}"
    if e.get("policy"):
      construction += f" {e['policy']}"
    head = f"| {e['n']} | {construction} | {NAMES[e['library']]} |"
    if e["status"] != "ok":
      lines.append(f"{head} n/a: {e['reason']} |||||||")
      continue
    r = e.get("ratio", {})
    target = e["library"] == "sr"
    cell = lambda k, lim: _mark(r[k], lim if target else None) if k in r else "-"
    lines.append(
      f"{head} {e['bytes']['temp'] / 2**20:.2f} | {cell('temp', TEMP_RATIO)} | "
      f"{_fmt(e['step_ms'], digits=1)} | {cell('step', STEP_RATIO)} | "
      f"{_fmt(e['first_call_s'], digits=2)} | {cell('first_call', FIRST_CALL_RATIO)} | "
      f"{e['dispatch_us']['median']:.0f} |"
    )
  return "\n".join(lines) + "\n"


def summary(results: dict) -> list[str]:
  rows = results["targets"]
  lines = [f"transformer: {sum(t['met'] for t in rows)} of {len(rows)} targets met"]
  for t in rows:
    lines.append(
      f"  N={t['n']:<3d} {t['construction']:16s} {t['what']:10s} "
      f"{t['value']:.3f} (<= {t['target']}) {'met' if t['met'] else 'NOT met'}"
    )
  return lines


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--quick", action="store_true", help="tiny sizes, under a minute")
  parser.add_argument("--out", default=RESULTS, help=f"output folder (default {RESULTS})")
  args = parser.parse_args(argv)
  results = run(args.quick, args.out)
  print("\n".join(summary(results)))
  print(f"written to {args.out}")


if __name__ == "__main__":
  main()
