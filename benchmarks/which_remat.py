"""Which remat? Depth x strategy: gradient temp memory, first call and step time.

    python -m benchmarks.which_remat [--depths 61 97 256] [--batch 1024] [--out DIR]

The block is Dense W->W + tanh (W=256). For each depth N, on a stack built once:

* ``scan``: no remat (every layer's residuals kept);
* ``scan(remat)``: one level, each layer recomputed (N carries kept);
* ``remat_scan auto``: ``lengths="auto"`` without a budget (least memory at <= 3N);
* ``remat_scan auto, tight``: ``lengths="auto"`` with a budget just above the least
  memory any plan has (the planner goes deeper, 4N or 5N evaluations).

Temp bytes are XLA's ``memory_analysis`` (exact). First call is trace + compile + one
step; step time is the median (min / max) of ``--calls`` calls after it, each
synchronised, all strategies of a depth interleaved. Writes ``which_remat.json`` /
``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import statefulremat as sr
from statefulremat.transforms.memory._remat_plan import HEADROOM, format_bytes

RESULTS = Path(__file__).resolve().parent / "results"
W = 256


class Block(sr.Module):
  def __init__(self, width, *, rngs):
    self.linear = sr.nn.Linear(width, width, rngs=rngs)

  def __call__(self, h):
    return jnp.tanh(self.linear(h))


def strategies(n: int, carry) -> dict:
  body = lambda layer, h: layer(h)
  stack = sr.eval_shape(lambda: sr.vmap(Block, axis_size=n)(W, rngs=sr.Rngs(0)))
  least = sr.plan_remat(stack, carry, fn=body)
  smallest = min(c.temp_bytes for c in least.candidates)
  tight = int(smallest / HEADROOM * 1.01)
  scan_body = lambda m, h: (m(h), None)
  return {
    "scan": lambda m, h: sr.scan(scan_body, variable_axes={True: 0})(m, h)[0],
    "scan(remat)": lambda m, h: sr.scan(
      sr.remat(scan_body, prevent_cse=False), variable_axes={True: 0}
    )(m, h)[0],
    "remat_scan auto": sr.remat_scan(body, lengths="auto"),
    f"remat_scan auto, budget {format_bytes(tight)}": sr.remat_scan(
      body, lengths="auto", memory_budget=tight
    ),
  }, {
    "remat_scan auto": least.lengths,
    f"remat_scan auto, budget {format_bytes(tight)}": sr.plan_remat(
      stack, carry, fn=body, memory_budget=tight
    ).lengths,
  }


def measure(n: int, batch: int, calls: int, log=print) -> list[dict]:
  carry = jax.ShapeDtypeStruct((batch, W), jnp.float32)
  runs, lengths = strategies(n, carry)
  model = sr.vmap(Block, axis_size=n)(W, rngs=sr.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (batch, W))
  rows, steps = {}, {}
  for name, run in runs.items():
    step = sr.jit(sr.grad(lambda m, x, run=run: jnp.mean(run(m, x) ** 2)))
    start = time.perf_counter()
    compiled = step.lower(model, x).compile()
    jax.block_until_ready(step(model, x))
    first = time.perf_counter() - start
    rows[name] = {
      "n": n,
      "batch": batch,
      "strategy": name,
      "lengths": list(lengths.get(name, ())),
      "temp": int(compiled.memory_analysis().temp_size_in_bytes),
      "first_call_s": first,
      "step_s": [],
    }
    steps[name] = step
  for _ in range(calls):  # interleaved, so the machine's load spreads over all
    for name, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step(model, x))
      rows[name]["step_s"].append(time.perf_counter() - start)
  for row in rows.values():
    s = row.pop("step_s")
    row["step"] = {"min": min(s), "median": statistics.median(s), "max": max(s)}
    log(
      f"  N={n:<4d} {row['strategy']:34s} {str(tuple(row['lengths'])):12s} "
      f"temp {format_bytes(row['temp']):>11s} first {row['first_call_s']:6.2f}s "
      f"step {row['step']['median']:.3f}s"
    )
  return list(rows.values())


def table(rows: list[dict]) -> str:
  lines = [
    "| N | strategy | lengths | temp | first call s | step s (min / median / max) |",
    "|---:|---|---|---:|---:|---:|",
  ]
  for r in rows:
    s = r["step"]
    lines.append(
      f"| {r['n']} | {r['strategy']} | {tuple(r['lengths']) or '-'} | "
      f"{format_bytes(r['temp'])} | {r['first_call_s']:.2f} | "
      f"{s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--depths", type=int, nargs="+", default=[61, 97, 256])
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--calls", type=int, default=5)
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args(argv)
  rows = [row for n in args.depths for row in measure(n, args.batch, args.calls)]
  text = table(rows)
  print(text)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "which_remat.json").write_text(json.dumps(rows, indent=1))
  (out / "which_remat.md").write_text(
    f"# Which remat? (W={W}, B={args.batch}, CPU)\n\n" + text + "\n"
  )


if __name__ == "__main__":
  main()
