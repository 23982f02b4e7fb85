"""Stack-level offload of the saved carries, measured: ``python -m benchmarks.offload``.

    python -m benchmarks.offload [--quick] [--out DIR]

For a GPU (or TPU) session: on a backend that moves offloaded values to host memory,
``carries="offload"`` should take the carries a stack saves for the backward pass off
the device. The block is a residual MLP (width d, hidden 4d, tanh-GELU), N=32 layers,
8 x 1024 tokens, d=1024 (``--quick``: N=8, 64 tokens, d=32, for a CPU check that it
runs). Per construction, ``carries="device"`` against ``"offload"`` in one process:

* ``remat_scan (8, 4)``: the outer level's 8 carries offloaded;
* ``remat_scan (32,)``: one level, each layer's input offloaded;
* ``scan(remat)``: ``sr.scan(sr.remat(Block))``, each layer's input offloaded.

Reported: device temp and host temp bytes (``memory_analysis()`` of the compiled
gradient; host figures where XLA gives them), the carries' bytes the offload should
move (``offloaded``: one carry per saved step), the device drop against them, and the
largest relative difference of the gradients. Then ``sr.plan_remat`` under a budget 10 %
below the smallest plan keeping the carries on the device: on a backend that offloads,
a plan with ``carries="offload"`` and its reason; on one that does not (CPU), the error
that says so. Writes ``offload.json`` / ``offload.md`` to ``--out`` (default
``benchmarks/results``; not committed until a GPU run fills it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/offload.py`
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import statefulremat as sr  # noqa: E402
from statefulremat.transforms.memory._carries import moves_to_host  # noqa: E402
from statefulremat.transforms.memory._remat_plan import format_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FULL = {"layers": 32, "batch": 8, "seq": 1024, "width": 1024}
QUICK = {"layers": 8, "batch": 2, "seq": 32, "width": 32}


class MLPBlock(sr.Module):
  def __init__(self, width, *, rngs):
    self.up = sr.nn.Linear(width, 4 * width, rngs=rngs)
    self.down = sr.nn.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(x)))


class ScanBlock(MLPBlock):
  def __call__(self, x):
    return super().__call__(x), None


def constructions(cfg: dict):
  """``(name, make(carries) -> (model, loss), saved steps)``: the steps whose carries
  the offload moves."""
  n, w = cfg["layers"], cfg["width"]
  outer = max(2, n // 4)

  def stacked(lengths):
    def make(carries):
      model = sr.remat_scan(MLPBlock, lengths=lengths, carries=carries)(w, rngs=sr.Rngs(0))
      return model, lambda m, x: jnp.mean(m(x) ** 2)

    return make

  def scanned(carries):
    model = sr.scan(
      sr.remat(ScanBlock),
      length=n,
      variable_axes={sr.Param: 0},
      split_rngs={"params": True},
      carries=carries,
    )(w, rngs=sr.Rngs(0))
    return model, lambda m, x: jnp.mean(m(x)[0] ** 2)

  yield f"remat_scan {(outer, n // outer)}", stacked((outer, n // outer)), outer
  yield f"remat_scan {(n,)}", stacked((n,)), n
  yield "scan(remat)", scanned, n


def _memory(compiled) -> dict:
  stats = compiled.memory_analysis()
  return {
    "temp": int(stats.temp_size_in_bytes),
    "host_temp": int(getattr(stats, "host_temp_size_in_bytes", 0) or 0),
  }


def measure(cfg: dict, *, log=print) -> tuple[list[dict], dict]:
  x = jax.random.normal(jax.random.key(0), (cfg["batch"], cfg["seq"], cfg["width"]))
  carry_bytes = x.size * x.dtype.itemsize
  rows = []
  for name, make, steps in constructions(cfg):
    figures, grads = {}, {}
    for carries in ("device", "offload"):
      model, loss = make(carries)
      step = sr.jit(sr.grad(loss))
      figures[carries] = _memory(step.lower(model, x).compile())
      grads[carries] = jax.tree.leaves(step(model, x))
    difference = max(
      float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) or 1.0))
      for a, b in zip(grads["offload"], grads["device"], strict=True)
    )
    row = {
      "construction": name,
      "device": figures["device"],
      "offload": figures["offload"],
      "offloaded": steps * carry_bytes,
      "drop": figures["device"]["temp"] - figures["offload"]["temp"],
      "grad_difference": difference,
    }
    log(
      f"{name}: device temp {format_bytes(row['device']['temp'])} -> "
      f"{format_bytes(row['offload']['temp'])} offloaded (host "
      f"{format_bytes(row['offload']['host_temp'])}); carries "
      f"{format_bytes(row['offloaded'])}; gradients differ by {difference:.1e}"
    )
    rows.append(row)
  return rows, _planning(cfg, x)


def _planning(cfg: dict, x) -> dict:
  """The planner under a budget 10 % below the smallest plan on the device."""
  stack = sr.eval_shape(
    lambda: sr.remat_scan(MLPBlock, lengths=(cfg["layers"],))(cfg["width"], rngs=sr.Rngs(0))
  )
  carry = jax.ShapeDtypeStruct(x.shape, x.dtype)
  device = sr.plan_remat(stack, carry, carries="device")
  smallest = min(device.candidates, key=lambda c: c.temp_bytes)
  budget = int(0.9 * smallest.temp_bytes)
  try:
    plan = sr.plan_remat(stack, carry, memory_budget=budget)
  except sr.TransformError as error:
    return {"budget": budget, "error": str(error)}
  return {
    "budget": budget,
    "lengths": list(plan.lengths),
    "carries": plan.carries,
    "measured": plan.measured_bytes,
    "reason": plan.reason,
  }


def markdown(result: dict) -> str:
  cfg = result["config"]
  lines = [
    "# Stack-level offload of the saved carries",
    "",
    f"`{cfg['command']}` on {cfg['device']} (jax {cfg['jax']}), {cfg['date']}; the "
    f"backend {'moves' if cfg['moves'] else 'does not move'} offloaded values to host "
    f"memory. N={cfg['layers']} residual MLP blocks, {cfg['batch']} x {cfg['seq']} "
    f"tokens, d={cfg['width']}.",
    "",
    "| construction | device temp, device | device temp, offload | host temp, offload "
    "| carries offloaded | device drop | gradients differ |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in result["rows"]:
    lines.append(
      f"| {r['construction']} | {format_bytes(r['device']['temp'])} | "
      f"{format_bytes(r['offload']['temp'])} | {format_bytes(r['offload']['host_temp'])} | "
      f"{format_bytes(r['offloaded'])} | {format_bytes(max(r['drop'], 0))} | "
      f"{r['grad_difference']:.1e} |"
    )
  plan = result["planning"]
  lines += ["", f"`sr.plan_remat` under memory_budget={format_bytes(plan['budget'])}:", ""]
  lines.append(
    f"    {plan['error']}"
    if "error" in plan
    else f"    lengths={tuple(plan['lengths'])}, carries={plan['carries']!r}: {plan['reason']}"
  )
  return "\n".join(lines) + "\n"


def run(quick: bool = False, out: str | Path = RESULTS, *, command: str = "", log=print) -> dict:
  """Measures every construction; writes ``offload.json`` / ``offload.md`` to ``out``."""
  cfg = QUICK if quick else FULL
  rows, planning = measure(cfg, log=log)
  result = {
    "config": {
      **cfg,
      "quick": quick,
      "command": command or "python -m benchmarks.offload" + (" --quick" if quick else ""),
      "device": str(jax.devices()[0]),
      "moves": moves_to_host(),
      "jax": jax.__version__,
      "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    },
    "rows": rows,
    "planning": planning,
  }
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "offload.json").write_text(json.dumps(result, indent=1))
  (out / "offload.md").write_text(markdown(result))
  return result


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small shapes: a CPU check")
  parser.add_argument("--out", default=str(RESULTS))
  args = parser.parse_args(argv)
  result = run(args.quick, args.out)
  print(markdown(result))


if __name__ == "__main__":
  main()
