"""One process of a multi-process run (tests/test_multiprocess.py starts several).

Every process runs this same program, as on a cluster: it joins the others through
``jax.distributed.initialize`` on 127.0.0.1, builds the model from the same seed,
shards it over every process's devices (``jax.make_mesh``'s default Explicit axes),
feeds its own rows of the batch with ``jax.make_array_from_process_local_data``, and
trains, saves and restores with ``sr.save`` / ``sr.restore``. It writes its losses as
JSON to ``--out`` and ends by itself (a timeout guards every wait).

    python tests/multiprocess_worker.py --port P --process-id I --num-processes N \\
        --out FILE --steps 3 --save DIR --save-in-background DIR2 --resume 2 DIR [DIR ...]

It trains ``--steps`` steps and saves twice; then, for each checkpoint named after
``--resume`` (its own two included), it builds the model afresh, restores the checkpoint
and trains ``--resume``'s count of steps more. One start of the processes serves both:
their start and the step's compile were most of the test's time.

The model, batch and step live in ``build`` / ``batch`` / ``train_step``, which the
test also imports to compute the one-process reference.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr

D, BATCH = 16, 8
RULES = [("batch", "data"), ("mlp", "model"), ("embed", None), ("layers", None)]


class Block(sr.Module):
  def __init__(self, d, *, rngs):
    meta = lambda *axes: {"sharding": axes}
    self.up = sr.nn.Linear(
      d, 2 * d, kernel_metadata=meta("embed", "mlp"), bias_metadata=meta("mlp"), rngs=rngs
    )
    self.drop = sr.nn.Dropout(0.25, rngs=rngs)
    self.down = sr.nn.Linear(
      2 * d, d, kernel_metadata=meta("mlp", "embed"), bias_metadata=meta("embed"), rngs=rngs
    )

  def __call__(self, x):
    return x + self.down(self.drop(jax.nn.gelu(self.up(x))))


Stack = sr.remat_scan(
  Block,
  lengths=(2, 2),
  split_rngs={"params": True, "dropout": True},
  metadata_params={"partition_name": "layers"},
)


def mesh():
  return jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes, JAX's default


def build(mesh):
  """The model and its optimizer, sharded over ``mesh``; the same in every process."""
  model = Stack(D, rngs=sr.Rngs(params=0, dropout=1))
  sr.shard(model, mesh, RULES)
  return model, sr.Optimizer(model, optax.adam(1e-2))


def global_batch(step: int):
  rng = np.random.default_rng(step)
  return (rng.standard_normal((BATCH, D), np.float32), rng.standard_normal((BATCH, D), np.float32))


def batch(mesh, step: int):
  """Step ``step``'s batch, sharded over 'data'; each process passes only its rows."""
  sharding = NamedSharding(mesh, P("data"))
  rows = sorted(
    {
      index[0].indices(BATCH)[:2]
      for index in sharding.addressable_devices_indices_map((BATCH, D)).values()
    }
  )
  start, stop = rows[0][0], rows[-1][1]
  return tuple(
    jax.make_array_from_process_local_data(sharding, a[start:stop], (BATCH, D))
    for a in global_batch(step)
  )


@sr.jit
def train_step(model, opt, x, y):
  loss, grads = sr.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  opt.update(grads)
  return loss


def run_steps(model, opt, mesh, first: int, count: int) -> list[float]:
  losses = []
  for step in range(first, first + count):
    losses.append(float(train_step(model, opt, *batch(mesh, step))))
  return losses


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--save", required=True)
  parser.add_argument("--save-in-background", required=True)
  parser.add_argument("--resume", nargs="+", required=True, metavar=("STEPS", "DIR"))
  args = parser.parse_args()

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{args.port}",
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=60,
  )
  result = {
    "process": jax.process_index(),
    "devices": jax.device_count(),
    "local_devices": jax.local_device_count(),
  }
  m = mesh()
  resume_steps, checkpoints = int(args.resume[0]), args.resume[1:]
  with jax.set_mesh(m):
    model, opt = build(m)
    result["losses"] = run_steps(model, opt, m, 0, args.steps)
    sr.save(args.save, opt)  # the optimizer holds the model: one checkpoint of both
    handle = sr.save(args.save_in_background, opt, blocking=False)
    handle.wait()
    result["resumed"] = {}
    for path in checkpoints:
      model, opt = build(m)
      sr.restore(path, opt)
      result["resumed"][path] = run_steps(model, opt, m, args.steps, resume_steps)
  with open(args.out, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
