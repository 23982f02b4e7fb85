"""Sharded init: per-device bytes of building a model inside ``sr.jit`` with ``sr.shard``.

    python -m benchmarks.sharded_init [--layers 16] [--width 1024] [--out DIR]

On 8 host devices (a 2 x 4 mesh, ``data`` x ``model``), a stack of ``--layers`` MLP
blocks (``width -> 4 width -> width``, kernels sharded ``("embed", "mlp")`` and back,
the layer axis replicated) is built three ways and compiled:

* ``sr.jit(create)`` where ``create`` builds the stack (vmapped init) and ``sr.shard``s
  it: every array is drawn directly in its sharding;
* raw JAX: the same arrays drawn by ``jax.random`` in one ``jax.jit`` with
  ``out_shardings``, the reference;
* raw JAX drawing each array with its ``out_sharding`` (under Explicit axes the only
  partitionable draw: ``out_shardings`` there re-types a replicated draw);
* for contrast, the whole model on one device, as an eager build followed by
  ``sr.shard`` would hold it before moving it.

Under Explicit axes an array's sharding is its type, and a draw whose type is
replicated is computed whole on every device before ``sr.shard`` (or raw
``out_shardings``) re-types it: build under an Auto-axes mesh (partitionable, as the
Auto row shows), then ``sr.shard`` the result onto the Explicit mesh (no data moves).

XLA's ``memory_analysis()`` is per device and exact. Writes ``sharded_init.json`` and
``sharded_init.md`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import statefulremat as sr  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RULES = [("embed", "data"), ("mlp", "model"), ("layers", None)]


class Block(sr.Module):
  def __init__(self, width: int, *, rngs: sr.Rngs):
    self.up = sr.nn.Linear(
      width,
      4 * width,
      kernel_metadata={"sharding": ("embed", "mlp")},
      bias_metadata={"sharding": ("mlp",)},
      rngs=rngs,
    )
    self.down = sr.nn.Linear(
      4 * width,
      width,
      kernel_metadata={"sharding": ("mlp", "embed")},
      bias_metadata={"sharding": ("embed",)},
      rngs=rngs,
    )


def _bytes(compiled) -> dict:
  m = compiled.memory_analysis()
  return {"temp": int(m.temp_size_in_bytes), "outputs": int(m.output_size_in_bytes)}


def measure(layers: int, width: int, axis_type=AxisType.Auto) -> dict:
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  Stack = sr.vmap(Block, axis_size=layers, metadata_params={"partition_name": "layers"})

  def create():
    stack = Stack(width, rngs=sr.Rngs(0))
    sr.shard(stack, mesh, RULES)
    return stack

  with jax.set_mesh(mesh):  # Explicit axes are part of the types: trace under the mesh
    ours = _bytes(sr.jit(create).lower().compile())

  shapes = [
    (layers, width, 4 * width),
    (layers, 4 * width),
    (layers, 4 * width, width),
    (layers, width),
  ]
  specs = [P(None, "data", "model"), P(None, "model"), P(None, "model", "data"), P(None, "data")]

  def raw(key):
    keys = jax.random.split(key, 2)
    init = jax.nn.initializers.lecun_normal()
    return (
      init(keys[0], shapes[0]),
      jnp.zeros(shapes[1]),
      init(keys[1], shapes[2]),
      jnp.zeros(shapes[3]),
    )

  with jax.set_mesh(mesh):
    theirs = _bytes(
      jax.jit(raw, out_shardings=tuple(NamedSharding(mesh, s) for s in specs))
      .lower(jax.random.key(0))
      .compile()
    )

  def drawn_sharded(key):  # each draw told its sharding: partitionable in both modes
    keys = jax.random.split(key, 2)
    init = jax.nn.initializers.lecun_normal()
    out = [NamedSharding(mesh, s) for s in specs]
    return (
      init(keys[0], shapes[0], out_sharding=out[0]),
      jnp.zeros(shapes[1], out_sharding=out[1]),
      init(keys[1], shapes[2], out_sharding=out[2]),
      jnp.zeros(shapes[3], out_sharding=out[3]),
    )

  drawn = theirs  # under Auto axes a draw takes no out_sharding: out_shardings is it
  if axis_type == AxisType.Explicit:
    with jax.set_mesh(mesh):
      drawn = _bytes(jax.jit(drawn_sharded).lower(jax.random.key(0)).compile())
  whole = sum(4 * int(jnp.prod(jnp.array(s))) for s in shapes)
  return {
    "layers": layers,
    "width": width,
    "axis_type": axis_type.name,
    "devices": len(jax.devices()),
    "sr": ours,
    "raw": theirs,
    "raw_drawn_sharded": drawn,
    "whole_model_bytes": whole,
    "outputs_ratio": ours["outputs"] / theirs["outputs"],
    "temp_ratio": ours["temp"] / max(theirs["temp"], 1),
  }


def table(rows: list[dict]) -> str:
  mib = lambda b: f"{b / 2**20:.2f}"
  lines = [
    "| mesh axes | layers x width | sr outputs MiB/device | raw outputs MiB/device | "
    "ratio | sr temp MiB | raw temp MiB | raw, each draw given out_sharding, temp "
    "MiB | whole model MiB (one device) |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['axis_type']} | {r['layers']} x {r['width']} | "
      f"{mib(r['sr']['outputs'])} | {mib(r['raw']['outputs'])} | "
      f"{r['outputs_ratio']:.4f} | {mib(r['sr']['temp'])} | "
      f"{mib(r['raw']['temp'])} | {mib(r['raw_drawn_sharded']['temp'])} | "
      f"{mib(r['whole_model_bytes'])} |"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--layers", type=int, default=16)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args(argv)
  rows = []
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    try:
      rows.append(measure(args.layers, args.width, axis_type))
    except Exception as e:  # noqa: BLE001 -- reported in the table, not hidden
      print(f"{axis_type.name}: {type(e).__name__}: {e}")
  text = table(rows)
  print(text)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "sharded_init.json").write_text(json.dumps(rows, indent=1))
  (out / "sharded_init.md").write_text(
    "# Sharded init, per device (XLA memory_analysis, 8 host devices)\n\n" + text + "\n"
  )


if __name__ == "__main__":
  main()
