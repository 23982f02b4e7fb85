"""Dispatch overhead of one jitted training step: statefulremat against raw JAX,
flax.linen, flax.nnx, equinox and SpectraX.

One step is forward + gradient + optimizer update, compiled once, on models whose
arrays are tiny, so what differs between the variants is the work around the
compiled computation (flattening, checks, write-back):

* ``tiny``: 4 x (Linear 8->8, tanh), batch 2;
* ``wide``: 48 unstacked residual blocks (Linear, LayerNorm, tanh, Linear, LayerNorm:
  8 variables each, 384 in all), width 8, batch 2. On CPU its thousands of small
  XLA operations take milliseconds, so the ratios there are closer to 1 than the
  Python costs alone would be; ``overhead_us`` gives the difference in µs.

Each library runs the step with a hand-written SGD update (``sgd``) and with an optax
transformation (``optax``: ``optax.adam``; for statefulremat that is ``sr.Optimizer``),
as built in ``benchmarks/dispatch_variants.py``; SpectraX (``spx.jit``) runs where
``spectrax-lib`` is installed and is listed as skipped where it is not. The variants are
timed interleaved:
in every batch each variant makes as many calls as fill a fixed time budget (at most
``calls``), each one blocked with ``jax.block_until_ready``, in an order that rotates
from batch to batch; the garbage collector runs before each batch and is off during
it. A variant's min/median/max are over its per-batch means; its ratio is its median
over raw ``jax.jit``'s with the same optimizer kind.

    python -m benchmarks.dispatch            # 30 batches of <= 50 calls
    python -m benchmarks.dispatch --quick    # seconds: smaller graphs, a check only
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .dispatch_variants import KINDS, SR_VARIANT, VARIANTS, models, n_variables, unavailable

TARGETS = {"tiny": 1.3, "wide": 1.5}  # sr.jit's median / raw jax.jit's median, at most
LIBRARIES = ("jax", "flax", "equinox", "optax", "spectrax-lib")  # versions recorded


def _versions() -> dict:
  found = {"python": platform.python_version()}
  for dist in LIBRARIES:
    try:
      found[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      found[dist] = None
  return found


# -- timing ---------------------------------------------------------------------------


def _calls_for(call: Callable, budget_us: float, most: int) -> int:
  """How many calls of ``call`` fill one batch's time budget (1 to ``most``)."""
  start = time.perf_counter()
  for _ in range(3):
    jax.block_until_ready(call())
  per_call = (time.perf_counter() - start) / 3 * 1e6
  return max(1, min(most, int(budget_us / per_call)))


def _time(steps: dict, calls: dict, batches: int) -> dict:
  """Per-call µs of each batch, the variants interleaved in a rotating order."""
  names = list(steps)
  samples = {name: [] for name in names}
  for b in range(batches):
    shift = b % len(names)
    for name in names[shift:] + names[:shift]:
      call, n = steps[name], calls[name]
      # A collection triggered by the garbage of the variant before (nnx.jit makes
      # thousands of objects a step) would be charged to whichever runs next.
      gc.collect()
      gc.disable()
      try:
        start = time.perf_counter()
        for _ in range(n):
          jax.block_until_ready(call())
        samples[name].append((time.perf_counter() - start) / n * 1e6)
      finally:
        gc.enable()
  return samples


def _stats(us: list[float]) -> dict:
  return {"min_us": min(us), "median_us": statistics.median(us), "max_us": max(us)}


def run(quick: bool = False, *, batches: int | None = None, calls: int | None = None) -> dict:
  """Times every variant on both models; returns a JSON-serialisable dict.

  ``result["models"][model]["variants"][variant][kind]`` (``kind`` is ``"sgd"`` or
  ``"optax"``) holds ``min_us``, ``median_us``, ``max_us``, ``calls`` (per batch),
  ``ratio`` (median over raw ``jax.jit``'s with the same kind) and ``overhead_us``
  (median minus raw's); ``result["targets"]`` lists sr.jit's ratios against their
  targets. Each variant makes as many calls per batch (at most ``calls``) as fill
  a fixed time budget, so slow variants on the wide graph do not dominate the run.

  ``result["skipped"]`` maps each variant whose library is not installed (SpectraX
  is optional) to a note saying so; it has no entry under ``variants``.

  ``quick=True`` runs in seconds: smaller graphs, 3 short batches, XLA's
  optimisations off. Its times are no measurement, only a check that everything runs.
  """
  # The models broadcast biases implicitly, as users write them (the test suite raises
  # on implicit rank promotion).
  with jax.numpy_rank_promotion("allow"):
    if not quick:
      return _run(quick, batches, calls)
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
      return _run(quick, batches, calls)
    finally:
      jax.config.update("jax_disable_most_optimizations", before)


def _run(quick: bool, batches: int | None, calls: int | None) -> dict:
  """The body of ``run``."""
  batches = batches or (3 if quick else 30)
  calls = calls or (3 if quick else 50)
  budget_us = 2_000 if quick else 30_000
  x = jnp.ones((2, 8))
  result = {
    "config": {
      "quick": quick,
      "batches": batches,
      "max_calls_per_batch": calls,
      "batch_budget_us": budget_us,
      "batch_size": 2,
      "optax": "adam(1e-3)",
      "xla_optimizations": not quick,
      "backend": jax.default_backend(),
      "device": str(jax.devices()[0]),
      "versions": _versions(),
    },
    "models": {},
    "targets": [],
    "skipped": unavailable(),
  }
  for model, cfg in models(quick).items():
    steps, counts = {}, {}
    for name, build in VARIANTS.items():
      if name in result["skipped"]:
        continue
      for kind in KINDS:
        call = build(cfg, kind, x)
        jax.block_until_ready(call())  # compiles
        steps[name, kind] = call
        counts[name, kind] = _calls_for(call, budget_us, calls)
    samples = _time(steps, counts, batches)
    variants: dict = {}
    for name, kind in steps:
      variants.setdefault(name, {})[kind] = {
        **_stats(samples[name, kind]),
        "calls": counts[name, kind],
      }
    for name in variants:
      for kind in KINDS:
        base = variants["raw jax.jit"][kind]
        entry = variants[name][kind]
        entry["ratio"] = entry["median_us"] / base["median_us"]
        entry["min_ratio"] = entry["min_us"] / base["min_us"]
        # Each batch's mean over raw's in the same batch: a load spike that slows
        # neighbouring batches alike cancels out.
        entry["paired_ratio"] = statistics.median(
          s / r for s, r in zip(samples[name, kind], samples["raw jax.jit", kind])
        )
        entry["overhead_us"] = entry["median_us"] - base["median_us"]
    result["models"][model] = {**cfg, "variables": n_variables(cfg), "variants": variants}
    for kind in KINDS:
      entry = variants[SR_VARIANT][kind]
      result["targets"].append(
        {
          "model": model,
          "variant": SR_VARIANT,
          "optimizer": kind,
          "ratio": entry["ratio"],
          "paired_ratio": entry["paired_ratio"],
          "min_ratio": entry["min_ratio"],
          "target": TARGETS[model],
          "met": entry["ratio"] <= TARGETS[model],
        }
      )
  return result


def table(result: dict) -> str:
  """A markdown table of ``run``'s result: µs per step and ratio to raw jax.jit."""
  lines = []
  c = result["config"]
  if "date" in c:  # stamped by benchmarks/run.py
    versions = ", ".join(f"{k} {v}" for k, v in c.get("versions", {}).items() if v is not None)
    lines.append(
      f"Measured {c['date']} on {c['machine']} (`{c['command']}`, "
      f"{c['seconds']:.0f} s; {versions}): {c['batches']} interleaved "
      f"batches of up to {c['max_calls_per_batch']} calls per variant."
    )
  for model, entry in result["models"].items():
    lines += [
      f"\n**{model}**: {entry['blocks']} blocks, {entry['variables']} variables "
      f"(target for {SR_VARIANT}: <= {TARGETS[model]}x raw)\n",
      "| variant | optimizer | min µs | median µs | max µs | ratio | paired | min ratio | +µs |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, kinds in entry["variants"].items():
      for kind, s in kinds.items():
        lines.append(
          f"| {name} | {kind} | {s['min_us']:.1f} | {s['median_us']:.1f} | "
          f"{s['max_us']:.1f} | {s['ratio']:.2f}x | {s['paired_ratio']:.2f}x | "
          f"{s['min_ratio']:.2f}x | {s['overhead_us']:+.0f} |"
        )
  for name, note in result.get("skipped", {}).items():
    lines.append(f"\n{name}: {note}.")
  lines += [
    "",
    "ratio: median over raw jax.jit's median; paired: the median of each "
    "batch's mean over raw's in the same batch; min ratio: min over raw's min.",
    "",
  ]
  for t in result["targets"]:
    lines.append(
      f"- {t['model']}, {t['optimizer']}: {t['ratio']:.2f}x (paired "
      f"{t['paired_ratio']:.2f}x, min {t['min_ratio']:.2f}x; target <= "
      f"{t['target']}x) {'met' if t['met'] else 'NOT met'}"
    )
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--batches", type=int)
  parser.add_argument("--calls", type=int)
  parser.add_argument("--json", help="also write the result to this file")
  args = parser.parse_args(argv)
  result = run(args.quick, batches=args.batches, calls=args.calls)
  print(table(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
