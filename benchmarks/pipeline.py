"""sr.pipeline on 8 CPU devices (issue 26): ``python -m benchmarks --part pipeline``.

    python -m benchmarks.pipeline [--quick] [--out DIR]

The process forces 8 host CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
set before jax is imported; ``--part pipeline`` runs this module in its own process for
that reason). The model: a stack of N residual blocks ``x + 0.5·tanh(linear(x))`` (width
D) with a per-layer ``calls`` counter (a ``BatchStat`` the block adds 1 to when it runs),
batch B; the step is ``sr.jit`` of ``sr.value_and_grad`` of ``mean(y ** 2)``.

For every mesh ((stage=4, data=2), the batch sharded over ``data``; (stage=8)), schedule
(``gpipe``; ``circular`` with R=2) and k microbatches, in one process:

* parameter bytes per device: the stack's ``Param`` arrays' ``addressable_shards`` on
  one device, against the same stack on one device (target: 1/S);
* the compiled step's ``memory_analysis()``, which is per device for an SPMD program
  (checked: its argument bytes equal the arguments' shard bytes on one device), against
  the unpipelined stack (``stack(x)``, the whole batch) on one device. The schedule's
  prediction for temp: what the backward keeps of T steps × C layers of a microbatch's
  rows on the device (B / (k·data)), at the unpipelined run's temp bytes per layer and
  row, plus the stage's gradient accumulator (its parameter bytes);
* the bubble fraction measured from the schedule that ran: T, the time steps, is the
  trip count XLA gives the program's outer loop (``known_trip_count``); the work done
  is read from the counters after one step (bubble steps never write state, so
  ``sum(calls) / C`` is the stage-steps that worked, C = N / (S·R) layers each); bubble =
  1 − work / (S·T), against (S−1)/(R·k+S−1);
* step time (reported, not a target: the 8 CPU devices share the machine's cores): the
  pipelined step against the sequential run on one device (``sr.remat_scan`` over the N
  layers on each microbatch in turn, what the pipeline equals), interleaved calls.

Writes ``pipeline.json`` and ``pipeline.md`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import os
import sys

FLAG = "--xla_force_host_platform_device_count=8"
DEVICES = 8
if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

if __package__ in (None, ""):  # run as `python benchmarks/pipeline.py`
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import statefulremat as sr  # noqa: E402
from benchmarks.compiling import paired_ratio, stats  # noqa: E402
from benchmarks.provenance import machine, provenance  # noqa: E402
from benchmarks.timing import interleaved  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MESHES = {"stage=4, data=2": ((4, 2), ("stage", "data")), "stage=8": ((8,), ("stage",))}
SCHEDULES = (("gpipe", 1), ("circular", 2))
# N = 16 layers: divisible by S·R for every mesh and schedule, so each stage-step runs
# C = N / (S·R) whole layers and the bubble count is exact.
FULL = {"width": 256, "batch": 512, "layers": 16, "microbatches": (4, 8, 16), "calls": 10}
# Tiny sizes: the test suite runs this (only the structure is checked).
QUICK = {"width": 16, "batch": 32, "layers": 16, "microbatches": (4,), "calls": 2}


class Block(sr.Module):
  """``x + 0.5·tanh(linear(x))``, counting its runs in ``calls``."""

  def __init__(self, d: int, *, rngs: sr.Rngs):
    self.linear = sr.nn.Linear(
      d,
      d,
      kernel_metadata={"sharding": (None, None)},
      bias_metadata={"sharding": (None,)},
      rngs=rngs,
    )
    self.calls = sr.BatchStat(jnp.zeros((), jnp.int32), sharding=())

  def __call__(self, x):
    self.calls.value = self.calls.value + 1
    return x + 0.5 * jnp.tanh(self.linear(x))


def apply(layer, x):
  return layer(x)


def build(cfg: dict, mesh=None):
  """The stack, its layer axis sharded over ``stage`` when ``mesh`` is given (else on
  one device)."""
  stack = sr.remat_scan(
    Block, lengths=(cfg["layers"],), metadata_params={"partition_name": "layers"}
  )(cfg["width"], rngs=sr.Rngs(0))
  if mesh is not None:
    sr.shard(stack, mesh, [("layers", "stage")])
  return stack


def inputs(cfg: dict, mesh=None):
  x = jnp.linspace(-1.0, 1.0, cfg["batch"] * cfg["width"]).reshape(cfg["batch"], cfg["width"])
  if mesh is not None and "data" in mesh.axis_names:
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
  return x


def train_step(forward):
  @sr.jit
  def step(model, x):
    return sr.value_and_grad(lambda m: jnp.mean(forward(m, x) ** 2))(model)

  return step


def sequential(k: int, n: int):
  """The oracle the pipeline equals: the N layers on each microbatch in turn."""
  scan = sr.remat_scan(apply, lengths=(n,))
  return lambda m, x: jnp.concatenate([scan(m, mb) for mb in jnp.split(x, k)])


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  return {
    "temp": int(m.temp_size_in_bytes),
    "arguments": int(m.argument_size_in_bytes),
    "outputs": int(m.output_size_in_bytes),
  }


def shard_bytes(tree) -> int:
  """Bytes of ``tree``'s arrays held by one device (the first)."""
  return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))


def param_bytes(stack) -> int:
  return shard_bytes(sr.state(stack, sr.Param))


def trip_count(compiled) -> int:
  """The schedule's time steps: the largest trip count XLA found for a loop (the outer
  scan over steps; a stage's scan over its layers is shorter)."""
  counts = [int(n) for n in re.findall(r"known_trip_count[^0-9]*(\d+)", compiled.as_text())]
  if not counts:
    raise AssertionError("no while loop with a known trip count in the compiled step")
  return max(counts)


def measure(
  cfg: dict, mesh_name: str, schedule: str, repeats: int, k: int, baseline: dict
) -> tuple[dict, tuple]:
  """One configuration's entry, and its ``(step, args)`` for the timing."""
  shape, names = MESHES[mesh_name]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  stages, data = shape[0], (shape[1] if len(shape) > 1 else 1)
  n, batch = cfg["layers"], cfg["batch"]
  stack, x = build(cfg, mesh), inputs(cfg, mesh)
  step = train_step(sr.pipeline(apply, microbatches=k, schedule=schedule, repeats=repeats))
  with jax.set_mesh(mesh):
    start = time.perf_counter()
    compiled = step.lower(stack, x).compile()
    compile_s = time.perf_counter() - start
    nbytes = _memory(compiled)
    shards = shard_bytes(sr.state(stack)) + shard_bytes(x)
    before = np.asarray(stack.calls.value).sum()
    jax.block_until_ready(step(stack, x))  # one step: each layer counts its runs
  calls = int(np.asarray(stack.calls.value).sum() - before)
  chunk = n // (stages * repeats)
  steps = trip_count(compiled)
  work = calls // chunk
  measured = 1 - work / (stages * steps)
  formula = (stages - 1) / (repeats * k + stages - 1)
  rows = batch // (k * data)  # a microbatch's rows on one device
  per_row = baseline["bytes"]["temp"] / (n * batch)
  params = param_bytes(stack)
  predicted = steps * chunk * rows * per_row + params
  entry = {
    "mesh": mesh_name,
    "stages": stages,
    "data": data,
    "schedule": schedule,
    "repeats": repeats,
    "microbatches": k,
    "layers_per_stage_step": chunk,
    "compile_s": compile_s,
    "param_bytes_per_device": params,
    "param_ratio": params / baseline["param_bytes"],
    "param_target": 1 / stages,
    "bytes": nbytes,
    "argument_shard_bytes": shards,
    "per_device_checked": nbytes["arguments"] == shards,
    "temp_ratio": nbytes["temp"] / baseline["bytes"]["temp"],
    "temp_predicted": predicted,
    "temp_vs_predicted": nbytes["temp"] / predicted,
    "bubble": {
      "steps": steps,
      "stage_steps": stages * steps,
      "work": work,
      "work_expected": k * repeats * stages,
      "calls": calls,
      "measured": measured,
      "formula": formula,
      "spec": sr.PipelineSpec(microbatches=k, schedule=schedule, repeats=repeats).bubble_fraction(
        stages
      ),
    },
  }
  return entry, (step, (stack, x), mesh)


def on_mesh(fn, mesh):
  def call(*args):
    with jax.set_mesh(mesh):
      return fn(*args)

  return call


def run(
  quick: bool = False,
  out: str | Path = RESULTS,
  *,
  machine: str = "",
  command: str = "python -m benchmarks --part pipeline",
  log=print,
) -> dict:
  """Measures every mesh × schedule × k, writes ``pipeline.json`` / ``pipeline.md``."""
  if len(jax.devices()) < DEVICES:
    raise RuntimeError(
      f"benchmarks.pipeline needs {DEVICES} devices, jax has {len(jax.devices())}: jax "
      f"was imported before XLA_FLAGS={FLAG} was set. Run it in its own process "
      "(python -m benchmarks --part pipeline)."
    )
  from benchmarks.run import _fast_compiles

  cfg = QUICK if quick else FULL
  start = time.perf_counter()
  n = cfg["layers"]
  with _fast_compiles(quick):
    stack, x = build(cfg), inputs(cfg)
    unpiped = train_step(lambda m, x: m(x))
    baseline = {
      "param_bytes": param_bytes(stack),
      "bytes": _memory(unpiped.lower(stack, x).compile()),
    }
    log(
      f"unpipelined on one device: params {baseline['param_bytes']} B, temp "
      f"{baseline['bytes']['temp']} B"
    )
    entries = []
    for mesh_name in MESHES:
      for schedule, repeats in SCHEDULES:
        for k in cfg["microbatches"]:
          entry, (step, args, mesh) = measure(cfg, mesh_name, schedule, repeats, k, baseline)
          seq = train_step(sequential(k, n))
          fns = {
            "pipeline": (on_mesh(step, mesh), args),
            "sequential": (seq, (build(cfg), inputs(cfg))),
          }
          for fn, fn_args in fns.values():
            for _ in range(2):  # the second call may see the first's output shardings
              jax.block_until_ready(fn(*fn_args))
          ms, _ = interleaved(fns, cfg["calls"])
          entry["step_ms"] = {name: stats(v) for name, v in ms.items()}
          entry["step_ratio"] = paired_ratio(ms["pipeline"], ms["sequential"])
          entries.append(entry)
          b = entry["bubble"]
          log(
            f"{mesh_name} {schedule} k={k}: params/device {entry['param_ratio']:.4f} "
            f"of one device, temp {entry['bytes']['temp']} B "
            f"({entry['temp_vs_predicted']:.2f}x predicted), bubble "
            f"{b['measured']:.4f} (formula {b['formula']:.4f}), step "
            f"{entry['step_ratio']:.2f}x sequential ({time.strftime('%H:%M:%S')})"
          )
  result = {
    "config": {
      **{key: (list(v) if isinstance(v, tuple) else v) for key, v in cfg.items()},
      **provenance(quick, machine, command),
      "devices": len(jax.devices()),
      "seconds": time.perf_counter() - start,
    },
    "baseline": baseline,
    "entries": entries,
  }
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  with open(out / "pipeline.json", "w") as f:
    json.dump(result, f, indent=1)
  (out / "pipeline.md").write_text(markdown(result))
  return result


def _mmm(s: dict) -> str:
  return " / ".join(f"{s[k]:.1f}" for k in ("min", "median", "max"))


def table(result: dict) -> list[str]:
  """The per-configuration table (the README carries it)."""
  base = result["baseline"]
  lines = [
    "| mesh | schedule | k | params / device (of 1 device; target 1/S) | temp MiB / "
    "device (of unpipelined) | temp / predicted | T | bubble measured | "
    "(S−1)/(R·k+S−1) | step / sequential |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for e in result["entries"]:
    b = e["bubble"]
    sched = e["schedule"] + (f" R={e['repeats']}" if e["repeats"] > 1 else "")
    lines.append(
      f"| {e['mesh']} | {sched} | {e['microbatches']} | {e['param_ratio']:.4f} "
      f"(1/{e['stages']} = {e['param_target']:.4f}) | "
      f"{e['bytes']['temp'] / 2**20:.2f} ({e['temp_ratio']:.2f}x) | "
      f"{e['temp_vs_predicted']:.2f} | {b['steps']} | {b['measured']:.4f} | "
      f"{b['formula']:.4f} | {e['step_ratio']:.2f}x |"
    )
  lines += [
    "",
    f"Unpipelined on one device: parameters {base['param_bytes'] / 2**20:.2f} "
    f"MiB, temp {base['bytes']['temp'] / 2**20:.2f} MiB.",
  ]
  return lines


def markdown(result: dict) -> str:
  c = result["config"]
  lines = [
    "# sr.pipeline on 8 CPU devices (issue 26)",
    "",
    f"Measured {c['date']} on {c['machine'] or c['device']} (`{c['command']}`, JAX "
    f"{c['jax']}, {c['devices']} host CPU devices, {c['seconds']:.0f} s), every figure "
    "in one process.",
    "",
    f"A stack of N={c['layers']} blocks `x + 0.5·tanh(linear(x))`, width {c['width']}, "
    f"batch {c['batch']} (sharded over `data` where the mesh has it), each block "
    "counting its runs in a `BatchStat`; the step is `sr.jit` of `sr.value_and_grad` "
    "of `mean(y ** 2)`. Parameters per device: the `Param` arrays' shards on one "
    "device, as a share of the same stack on one device. Bytes: the compiled step's "
    "`memory_analysis()`, per device (its argument bytes equal the arguments' shards "
    "on one device: "
    + (
      "checked for every row"
      if all(e["per_device_checked"] for e in result["entries"])
      else "NOT so for some rows"
    )
    + "), temp against the unpipelined stack on one device; predicted temp = T steps "
    "× C layers × a microbatch's rows on the device at the unpipelined run's temp "
    "bytes per layer and row, + the stage's parameter bytes (its gradient "
    "accumulator). T: the trip count of the compiled program's outer loop; bubble "
    "measured = 1 − work / (S·T), work = the stage-steps that wrote state (the "
    "blocks' counters after one step, divided by C = N/(S·R)); expected work k·R·S: "
    + (
      "met in every row"
      if all(e["bubble"]["work"] == e["bubble"]["work_expected"] for e in result["entries"])
      else "NOT met in some rows"
    )
    + f". Step: {c['calls']} interleaved calls each of the pipelined step and of the "
    "sequential run on one device (the N layers on each microbatch in turn), ratio = "
    "median of the paired ratios; reported, not a target (the 8 devices share the "
    "machine's cores).",
    "",
  ]
  lines += table(result)
  lines += [
    "",
    "| mesh | schedule | k | arguments / outputs KiB per device | T | work "
    "(k·R·S) | step ms pipelined (min / median / max) | sequential |",
    "|---|---|---:|---|---:|---|---|---|",
  ]
  for e in result["entries"]:
    b, by = e["bubble"], e["bytes"]
    lines.append(
      f"| {e['mesh']} | {e['schedule']} | {e['microbatches']} | "
      f"{by['arguments'] / 1024:.0f} / {by['outputs'] / 1024:.0f} | {b['steps']} | "
      f"{b['work']} ({b['work_expected']}) | {_mmm(e['step_ms']['pipeline'])} | "
      f"{_mmm(e['step_ms']['sequential'])} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
  parser.add_argument("--out", default=RESULTS, help=f"output folder (default {RESULTS})")
  parser.add_argument(
    "--command",
    default="python -m benchmarks.pipeline",
    help="how the run was started (recorded in the results)",
  )
  args = parser.parse_args(argv)

  result = run(args.quick, args.out, machine=machine(), command=args.command)
  print(markdown(result))


if __name__ == "__main__":
  main()
