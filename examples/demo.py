"""The statefulremat demo: a deep residual MLP trained with ``sr.remat_scan`` on the CPU.

A 100-layer residual MLP (``sr.remat_scan`` over pre-norm blocks with BatchNorm, whose
statistics are kept per layer, and Dropout, whose keys are split per layer) learns the
synthetic regression task y = sin(2x) + x/2 with optax's adam. Before training the script
prints what XLA's memory analysis says one gradient needs without remat, with
``scan(remat)`` and with ``remat_scan``; it trains with a progress bar, prints the training
and held-out loss, and writes a checkpoint (``sr.save``), a treescope page of the trained
stacked state and a loss plot into ``--out`` (``./demo_out`` by default).

Run it from a clone of the repository, with the demo's extra (tqdm and matplotlib)::

  pip install -e ".[demo]"
  python examples/demo.py            # about a minute on a CPU
  python examples/demo.py --help     # the options: depth, width, steps, batch, seed, out

It is a script, not part of the installed package; the tests load it by its path.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import cast

import jax
import jax.numpy as jnp
import optax

import statefulremat as sr


class Block(sr.Module):
  """x + W2 dropout(gelu(W1 batchnorm(x))): one pre-norm residual block."""

  def __init__(self, width: int, *, rngs: sr.Rngs, dropout: float = 0.1):
    self.norm = sr.nn.BatchNorm(width, momentum=0.9, rngs=rngs)
    self.fc1 = sr.nn.Linear(width, width, rngs=rngs)
    self.drop = sr.nn.Dropout(dropout, rngs=rngs)
    self.fc2 = sr.nn.Linear(width, width, kernel_init=jax.nn.initializers.zeros, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(self.drop(jax.nn.gelu(self.fc1(self.norm(x)))))


class ScanBlock(Block):
  """The block as a scan body: ``carry -> (carry, nothing)``."""

  def __call__(self, x):
    return super().__call__(x), None


class ResidualMLP(sr.Module):
  """1 -> width, ``depth`` blocks stacked by ``stack_cls``, width -> 1."""

  def __init__(self, depth: int, width: int, *, rngs: sr.Rngs, stack: str = "remat_scan"):
    self.embed = sr.nn.Linear(1, width, rngs=rngs)
    self.blocks = stacked_blocks(stack, depth)(width, rngs=rngs)
    self.head = sr.nn.Linear(width, 1, rngs=rngs)
    self.stack = stack

  def __call__(self, x):
    h = self.blocks(self.embed(x))
    return self.head(h if self.stack == "remat_scan" else h[0])


def stacked_blocks(kind: str, depth: int) -> type:
  """The stack class: every variable gets one layer axis; params and dropout split."""
  streams = {"params": True, "dropout": True}
  if kind == "remat_scan":
    stack = sr.remat_scan(
      Block,
      lengths=lengths_for(depth),
      split_rngs=streams,
      metadata_params={"partition_name": "layers"},
    )
  else:
    body = {"scan": ScanBlock, "scan(remat)": sr.remat(ScanBlock, prevent_cse=False)}[kind]
    stack = sr.scan(
      body, length=depth, variable_axes={sr.Param: 0, sr.BatchStat: 0}, split_rngs=streams
    )
  # Given a Module class the transforms return a class; their return type is the
  # union over all the targets they take.
  return cast(type, stack)


def lengths_for(depth: int) -> tuple[int, ...]:
  """Two nested levels as even as ``depth`` allows: 100 -> (10, 10), 96 -> (8, 12)."""
  outer = max(d for d in range(1, math.isqrt(depth) + 1) if depth % d == 0)
  return (outer, depth // outer) if outer > 1 else (depth,)


def make_batch(key, batch: int):
  """``batch`` points x uniform in [-3, 3] and their targets sin(2x) + x/2."""
  x = jax.random.uniform(key, (batch, 1), minval=-3.0, maxval=3.0)
  return x, jnp.sin(2.0 * x) + 0.5 * x


def loss_fn(model, x, y):
  """The mean squared error of the model's predictions."""
  return jnp.mean((model(x) - y) ** 2)


@sr.jit
def train_step(model, opt, x, y):
  """One adam step on a batch, in place; returns the batch's loss before the step."""
  loss, grads = sr.value_and_grad(loss_fn)(model, x, y)
  opt.update(grads)
  return loss


@sr.jit
def eval_loss(model, x, y):
  """The loss on ``(x, y)``, in whichever mode (train or eval) the model is."""
  return loss_fn(model, x, y)


def gradient_memory(kind: str, depth: int, width: int, batch: int) -> int:
  """XLA's temp bytes for one training gradient of the ``kind`` stack (compiled only)."""
  model = ResidualMLP(depth, width, rngs=sr.Rngs(params=0, dropout=1), stack=kind)
  graphdef, state = sr.split(model)
  x = y = jax.ShapeDtypeStruct((batch, 1), jnp.float32)

  def gradient(state, x, y):
    return sr.grad(loss_fn)(sr.merge(graphdef, state), x, y)

  compiled = jax.jit(gradient).lower(state, x, y).compile()
  analysis = compiled.memory_analysis()
  if analysis is None:
    raise RuntimeError(
      f"gradient_memory: the {jax.default_backend()} backend gives no memory analysis "
      "of compiled code. Fix: run the demo with --no-memory (compare_memory=False)."
    )
  return analysis.temp_size_in_bytes


def run(
  *,
  depth: int = 100,
  width: int = 32,
  steps: int = 300,
  batch: int = 128,
  seed: int = 0,
  out: str | Path = "demo_out",
  compare_memory: bool = True,
  progress: bool = True,
) -> dict:
  """Runs the demo; returns the losses and where the files went."""
  _require("tqdm", "matplotlib")
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  model = ResidualMLP(depth, width, rngs=sr.Rngs(params=seed, dropout=seed + 1))
  data = sr.Rngs(data=seed + 2)  # the batches' stream, not part of the model
  params = sum(x.size for x in jax.tree.leaves(sr.state(model, sr.Param)))
  print(
    f"statefulremat demo: {depth} residual blocks (BatchNorm, Dropout) of width "
    f"{width} under remat_scan lengths={lengths_for(depth)}, {params:,} parameters"
  )

  if compare_memory:
    print(f"\nGradient memory for a batch of {batch} (XLA memory analysis, temp bytes):")
    base = None
    for kind in ("scan", "scan(remat)", "remat_scan"):
      temp = gradient_memory(kind, depth, width, batch)
      base = base or temp
      print(f"  {kind:<12} {temp / 2**20:9.2f} MiB  ({temp / base:.3f}x no remat)")

  opt = sr.Optimizer(model, optax.adam(1e-3))
  test_x, test_y = make_batch(jax.random.key(seed + 3), 1024)
  losses = []
  start = time.perf_counter()
  bar = _progress(steps, progress)
  for _ in bar:
    x, y = make_batch(data.data(), batch)
    losses.append(float(train_step(model, opt, x, y)))
    if not isinstance(bar, range):  # a tqdm bar
      bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
  seconds = time.perf_counter() - start
  model.eval()  # running BatchNorm averages, no dropout
  test = float(eval_loss(model, test_x, test_y))
  model.train()
  print(
    f"\nTrained {steps} steps in {seconds:.1f} s: training loss {losses[0]:.4f} -> "
    f"{losses[-1]:.4f}; held-out loss (eval mode) {test:.4f}"
  )

  files = _write_outputs(model, losses, out)
  print("\nWrote:")
  for what, path in files.items():
    print(f"  {what:<10} {path}")
  return {"losses": losses, "test_loss": test, "seconds": seconds, "files": files}


def _require(*modules: str) -> None:
  import importlib.util

  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  if missing:
    raise SystemExit(
      f"the demo needs {' and '.join(missing)}: pip install -e '.[demo]' (from a "
      "clone) or pip install 'statefulremat[demo]'."
    )


def _progress(steps: int, show: bool):
  if not show:
    return range(steps)
  from tqdm import tqdm

  return tqdm(range(steps), desc="training", unit="step", dynamic_ncols=True)


def _write_outputs(model, losses: list[float], out: Path) -> dict[str, Path]:
  import matplotlib

  matplotlib.use("Agg")  # files only: no window, on any machine
  import matplotlib.pyplot as plt

  checkpoint = out / "checkpoint"
  sr.save(checkpoint, model)

  page = out / "stacked_state.html"
  layers = len(model.blocks)
  sr.display(  # draws as it loads; its text where no script runs
    model.blocks,
    path=page,
    title=f"The {layers} residual blocks of the demo, after {len(losses)} training steps",
    description=(
      "The trained state of the remat_scan stack that examples/demo.py builds. Each "
      f"Variable holds all {layers} layers along its layer axis: a bias or a BatchNorm "
      "statistic is drawn as one layers × features image, a kernel one layer at a time "
      "(the slider picks which) beside the norm of each layer."
    ),
  )

  plot = out / "loss.png"
  fig, ax = plt.subplots(figsize=(6, 3.5))
  steps = range(1, len(losses) + 1)
  ax.plot(steps, losses, linewidth=0.8, alpha=0.35, label="per step")
  window = max(1, len(losses) // 15)
  ax.plot(steps, _running_mean(losses, window), linewidth=1.6, label=f"mean of the last {window}")
  ax.legend()
  ax.set(
    xlabel="step",
    ylabel="training loss (MSE)",
    yscale="log",
    title=f"{len(model.blocks)}-layer residual MLP, remat_scan",
  )
  ax.grid(True, alpha=0.3)
  fig.tight_layout()
  fig.savefig(plot, dpi=120)
  plt.close(fig)
  return {"checkpoint": checkpoint, "treescope": page, "plot": plot}


def _running_mean(values: list[float], window: int) -> list[float]:
  """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
  out, total = [], 0.0
  for i, v in enumerate(values):
    total += v - (values[i - window] if i >= window else 0.0)
    out.append(total / min(i + 1, window))
  return out


def main(argv: list[str] | None = None) -> int:
  """The command line: parses ``argv`` (``sys.argv[1:]`` when None), runs the demo."""
  parser = argparse.ArgumentParser(
    description="Trains a deep residual MLP (sr.remat_scan over BatchNorm + Dropout "
    "blocks, per-layer batch statistics, dropout keys split per layer) on y = sin(2x) "
    "+ x/2 with optax adam, after printing XLA's gradient memory without remat, with "
    "scan(remat) and with remat_scan. Writes a checkpoint (sr.save), a treescope page "
    "of the trained stacked state and a loss plot into --out.",
  )
  parser.add_argument(
    "--depth",
    type=int,
    default=100,
    help="residual blocks, stacked on one layer axis (default 100)",
  )
  parser.add_argument("--width", type=int, default=32, help="features per block (default 32)")
  parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
  parser.add_argument("--batch", type=int, default=128, help="examples per step (default 128)")
  parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
  parser.add_argument(
    "--out",
    default="demo_out",
    help="directory for the checkpoint, page and plot (default demo_out)",
  )
  parser.add_argument(
    "--no-memory", action="store_true", help="skip the memory comparison (three compilations)"
  )
  args = parser.parse_args(argv)
  for name in ("depth", "width", "steps", "batch"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
  run(
    depth=args.depth,
    width=args.width,
    steps=args.steps,
    batch=args.batch,
    seed=args.seed,
    out=args.out,
    compare_memory=not args.no_memory,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
