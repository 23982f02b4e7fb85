"""The benchmark suite: statefulremat against raw JAX, flax.linen and flax.nnx.

    python -m benchmarks [--quick] [--out DIR] [--no-dispatch] [--no-transformer]
    python benchmarks/run.py [--quick] [--out DIR] [--no-dispatch] [--no-transformer]
    python -m benchmarks --part dispatch [--quick] [--out DIR]
    python -m benchmarks --part hotpaths [--quick] [--out DIR]
    python -m benchmarks --part pattern [--quick] [--out DIR]
    python -m benchmarks --part pipeline [--quick] [--out DIR]
    python -m benchmarks --part planner [--quick] [--out DIR]

Runs every part in one process, on the deep-stack model (N x Linear W->W + tanh, loss
mean(out**2), gradient over the params; see ``benchmarks/models.py``):

1. XLA compiled memory (temp, argument, output bytes) for N in {16, 64, 100, 256},
   W=256, B=4096: unrolled, scan, scan(remat), remat_scan d=2 and d=3, in each library;
2. trace+lower and compile seconds against N (min / median / max of fresh functions);
3. step time of the jitted gradient as a ratio to raw JAX (interleaved calls);
4. dispatch overhead of one training step (``benchmarks/dispatch.py``);
5. remat planning: ``lengths="auto"``'s pick against an exhaustive compile, for N in
   {61, 97, 127, 256, 1000} and three memory budgets (``benchmarks/remat_plan.py``);
6. the transformer family: pre-LN GPT blocks, N in {16, 64}, d=256, seq 256, batch 8
   (``benchmarks/transformer.py``; its own ``transformer.json`` / ``.md``).

Writes ``results.json``, ``results.md`` (every figure with its target, met or not) and
``memory.png``, ``compile.png`` (and ``dispatch.png``) to ``--out`` (default
``benchmarks/results``). ``--quick`` uses tiny sizes and finishes in seconds.
``--part dispatch`` re-runs part 4 alone (9 to 14 minutes on a busy 2-core VM): it
replaces the dispatch section of the ``results.json`` already in ``--out``, recomputes
the targets and rewrites ``results.md`` and ``dispatch.png``, leaving the other parts'
figures as they were. ``--part hotpaths`` runs issue 23's hot paths in one process
(``benchmarks/hotpaths.py``: raw JAX on modules, trace+lower at several caller depths,
and the dispatch part as ``--part dispatch`` does) into ``hotpaths.json`` / ``.md``.
``--part pattern`` runs issue 25's stacks of a repeating pattern (``benchmarks/pattern.py``:
statefulremat's pattern stacks against the raw JAX cycle scan and the unrolled loop) into
``pattern.json`` / ``.md``; it needs no ``results.json``. ``--part pipeline`` runs issue
26's ``sr.pipeline`` benchmark (``benchmarks/pipeline.py``) in a process of its own, with 8
host CPU devices forced, into ``pipeline.json`` / ``.md``; it needs no ``results.json``.
``--part planner`` runs issue 36's planner benchmark (``benchmarks/planner.py``: the
remat planner's predictions against XLA's temp bytes on attention, MLP, conv and
pattern blocks) into ``planner.json`` / ``.md``; it needs no ``results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/run.py`
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import (  # noqa: E402
  compiling,
  dispatch,
  hotpaths,
  pattern,
  planner,
  plots,
  remat_plan,
  report,
  timing,
  transformer,
)
from benchmarks.models import lengths_for  # noqa: E402
from benchmarks.provenance import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("dispatch", "hotpaths", "pattern", "pipeline", "planner")  # the parts --part can run alone

FULL = {
  "width": 256,
  "batch": 4096,
  "depths": (16, 64, 100, 256),
  "reps": 3,
  "trace_reps": 15,
  "plan_depths": (61, 97, 127, 256, 1000),
  "plan_size": (256, 4096),
  "step": {
    "width": 256,
    "batch": 256,
    "depths": (16, 64),
    "calls": 40,
    "note": "Step time runs at B=256 and N in {16, 64} (not B=4096 and "
    "every N) to keep the suite to minutes on a 2-core CPU; the "
    "ratio compares the same computation in every library, and "
    "at 10+ ms a step dispatch is well under 1% of it.",
  },
}
# One depth: every compile costs ~0.1 s here, and the test suite runs quick mode.
# Planning at W=16, B=8 would measure XLA's small constant buffers, not the model.
QUICK = {
  "width": 16,
  "batch": 8,
  "depths": (8,),
  "reps": 1,
  "trace_reps": 1,
  "plan_depths": (13,),
  "plan_size": (64, 256),
  "step": {
    "width": 16,
    "batch": 8,
    "depths": (8,),
    "calls": 20,
    "note": "Quick mode: tiny sizes, so the times are mostly dispatch.",
  },
}
# Quick mode compiles 3-4x faster with LLVM optimisation and the fusion emitters off
# (jax_disable_most_optimizations for everything, the options where a jit takes them):
# only its bytes and shapes matter, and buffer assignment (hence memory_analysis) comes
# before code generation, so the byte counts are the same.
# An option this XLA does not know is an error (xla_cpu_use_fusion_emitters is gone from
# jax 0.11's), so each is kept only where a tiny compile accepts it.
QUICK_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


@functools.cache
def quick_compiler_options() -> dict:
  """QUICK_COMPILER_OPTIONS, less those the installed XLA refuses."""
  lowered = jax.jit(lambda x: x + 1).lower(jnp.zeros(()))
  kept = {}
  for name, value in QUICK_COMPILER_OPTIONS.items():
    try:
      lowered.compile(compiler_options={name: value})
    except Exception:  # XLA's own error for an unknown option (its type varies)
      continue
    kept[name] = value
  return kept


@contextlib.contextmanager
def _fast_compiles(enabled: bool):
  if not enabled:
    yield
    return
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


def run(
  quick: bool = False,
  out: str | Path = RESULTS,
  *,
  with_dispatch: bool = True,
  with_transformer: bool = True,
  log=print,
) -> dict:
  """Runs the suite, writes the result files to ``out`` and returns the results dict."""
  cfg = QUICK if quick else FULL
  step = cfg["step"]
  start = time.perf_counter()
  options = quick_compiler_options() if quick else None
  same = (step["width"], step["batch"]) == (cfg["width"], cfg["batch"])
  log(
    f"parts 1-2: memory, trace+lower and compile (W={cfg['width']}, B={cfg['batch']}, "
    f"N in {list(cfg['depths'])}, {cfg['reps']} compiles, "
    f"{cfg['trace_reps']} lowerings)"
  )
  with _fast_compiles(quick):
    entries, kept = compiling.run(
      cfg["depths"],
      cfg["width"],
      cfg["batch"],
      cfg["reps"],
      cfg["trace_reps"],
      compiler_options=options,
      keep_depths=step["depths"] if same else (),
      log=log,
    )
    log(
      f"part 3: step time (W={step['width']}, B={step['batch']}, "
      f"N in {list(step['depths'])}, {step['calls']} calls)"
    )
    steps = timing.run(
      step["depths"], step["width"], step["batch"], step["calls"], compiled=kept, log=log
    )
  del kept
  log(
    f"part 5: remat planning against an exhaustive compile (N in "
    f"{list(cfg['plan_depths'])}, three budgets each)"
  )
  with _fast_compiles(quick):
    planning = remat_plan.run(cfg["plan_depths"], *cfg["plan_size"], log=log)
  dispatch_result = None
  if with_dispatch:
    log("part 4: dispatch overhead")
    dispatch_result = _dispatch(quick, "python -m benchmarks")
  transformer_targets = None
  if with_transformer:
    log("part 6: the transformer family")
    transformer_targets = transformer.run(quick, out, log=log)["targets"]
  results = {
    "config": {
      "quick": quick,
      "width": cfg["width"],
      "batch": cfg["batch"],
      "depths": list(cfg["depths"]),
      "reps": cfg["reps"],
      "trace_reps": cfg["trace_reps"],
      "lengths": {n: [lengths_for(n, 2), lengths_for(n, 3)] for n in cfg["depths"]},
      "compiler_options": options,
      "step": {**step, "depths": list(step["depths"])},
      "machine": machine(),
      "device": str(jax.devices()[0]),
      "versions": {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
      },
    },
    "deep_stack": entries,
    "step": steps,
    "dispatch": dispatch_result,
    "remat_plan": planning,
    "transformer_targets": transformer_targets,
  }
  results["targets"] = report.targets(results)
  results["config"]["seconds"] = time.perf_counter() - start
  write(results, Path(out))
  return results


def _dispatch(quick: bool, command: str) -> dict:
  """Part 4, its result stamped with when, where and how it ran."""
  start = time.perf_counter()
  result = dispatch.run(quick)
  result["config"].update(
    date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    machine=machine(),
    command=command,
    seconds=time.perf_counter() - start,
  )
  return result


def run_part(part: str, quick: bool = False, out: str | Path = RESULTS, *, log=print) -> dict:
  """Re-runs one part (``PARTS``) into the results already in ``out``; returns them.

  The part's section of ``results.json`` is replaced, the targets recomputed, and
  ``results.md`` and the part's plot rewritten; the other parts' figures stay as
  they were measured. ``pattern`` and ``planner`` write only their own ``.json`` / ``.md``.
  """
  if part not in PARTS:
    raise ValueError(f"--part {part!r}: the parts that run alone are {list(PARTS)}")
  out = Path(out)
  if part == "pattern":  # its own files only
    command = "python -m benchmarks --part pattern" + (" --quick" if quick else "")
    return pattern.run(quick, out, machine=machine(), command=command, log=log)
  if part == "planner":  # its own files only
    command = "python -m benchmarks --part planner" + (" --quick" if quick else "")
    return planner.run(quick, out, machine=machine(), command=command, log=log)
  if part == "pipeline":  # its own files, from its own process: it needs 8 devices
    return _pipeline(quick, out)
  path = out / "results.json"
  if not path.exists():
    raise FileNotFoundError(
      f"--part {part} updates {path}, which does not exist: run the whole suite "
      f"first (python -m benchmarks --out {out})."
    )
  if part == "hotpaths":
    return hotpaths.run(
      quick,
      out,
      machine=machine(),
      log=log,
      dispatch_part=lambda: run_part("dispatch", quick, out, log=log),
    )
  results = json.loads(path.read_text())
  log("part 4: dispatch overhead")
  command = "python -m benchmarks --part dispatch" + (" --quick" if quick else "")
  results["dispatch"] = _dispatch(quick, command)  # stamped with this command
  results["targets"] = report.targets(results)
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  (out / "results.md").write_text(report.markdown(results, dispatch.table(results["dispatch"])))
  plots.dispatch(results["dispatch"], out / "dispatch.png")
  return results


def _pipeline(quick: bool, out: Path) -> dict:
  """``benchmarks/pipeline.py`` in a subprocess: XLA's device count is fixed when jax is
  first imported, and this process has imported it."""
  command = "python -m benchmarks --part pipeline" + (" --quick" if quick else "")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    flags = (flags + " --xla_force_host_platform_device_count=8").strip()
  root = Path(__file__).resolve().parents[1]
  subprocess.run(
    [sys.executable, "-m", "benchmarks.pipeline", "--out", str(out), "--command", command]
    + (["--quick"] if quick else []),
    cwd=root,
    env={**os.environ, "XLA_FLAGS": flags},
    check=True,
  )
  return json.loads((out / "pipeline.json").read_text())


def write(results: dict, out: Path) -> None:
  """``results.json``, ``results.md`` and the PNG plots, into ``out``."""
  out.mkdir(parents=True, exist_ok=True)
  with open(out / "results.json", "w") as f:
    json.dump(results, f, indent=1)
  table = None
  if results.get("dispatch") is not None:
    table = dispatch.table(results["dispatch"])
    plots.dispatch(results["dispatch"], out / "dispatch.png")
  (out / "results.md").write_text(report.markdown(results, table))
  plots.memory(results["deep_stack"], out / "memory.png")
  plots.compile_time(results["deep_stack"], out / "compile.png")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
  parser.add_argument("--out", default=RESULTS, help=f"output folder (default {RESULTS})")
  parser.add_argument("--no-dispatch", action="store_true", help="skip part 4")
  parser.add_argument("--no-transformer", action="store_true", help="skip part 6")
  parser.add_argument(
    "--part", choices=PARTS, help="re-run this part alone into the results.json in --out"
  )
  args = parser.parse_args(argv)
  if args.part is not None:
    if args.no_dispatch or args.no_transformer:
      parser.error("--part runs one part alone: drop --no-dispatch / --no-transformer")
    try:
      results = run_part(args.part, args.quick, args.out)
    except FileNotFoundError as e:
      parser.error(str(e))
    print()
    print(
      hotpaths.markdown(results)
      if args.part == "hotpaths"
      else pattern.markdown(results)
      if args.part == "pattern"
      else planner.markdown(results)
      if args.part == "planner"
      else "(its table is above)"
      if args.part == "pipeline"
      else dispatch.table(results["dispatch"])
    )
    print(f"\nwritten to {args.out}")
    return
  results = run(
    args.quick,
    args.out,
    with_dispatch=not args.no_dispatch,
    with_transformer=not args.no_transformer,
  )
  print()
  print("\n".join(report.summary(results)))
  if results["transformer_targets"] is not None:
    print("\n".join(transformer.summary({"targets": results["transformer_targets"]})))
  print(f"\nwritten to {args.out}")


if __name__ == "__main__":
  main()
