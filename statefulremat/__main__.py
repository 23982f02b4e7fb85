"""Command line: ``python -m statefulremat demo [--help]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m statefulremat",
    description="statefulremat: PyTorch-like modules with JAX's memory tools.",
  )
  commands = parser.add_subparsers(dest="command", required=True)
  demo = commands.add_parser(
    "demo",
    help="train a 100-layer residual MLP with remat_scan on a synthetic task",
    description="Trains a deep residual MLP (sr.remat_scan over BatchNorm + Dropout "
    "blocks, per-layer batch statistics, dropout keys split per layer) on y = sin(2x) "
    "+ x/2 with optax adam, after printing XLA's gradient memory without remat, with "
    "scan(remat) and with remat_scan. Writes a checkpoint (sr.save), a treescope page "
    "of the trained stacked state and a loss plot into --out.",
  )
  demo.add_argument(
    "--depth",
    type=int,
    default=100,
    help="residual blocks, stacked on one layer axis (default 100)",
  )
  demo.add_argument("--width", type=int, default=32, help="features per block (default 32)")
  demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
  demo.add_argument("--batch", type=int, default=128, help="examples per step (default 128)")
  demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
  demo.add_argument(
    "--out",
    default="demo_out",
    help="directory for the checkpoint, page and plot (default demo_out)",
  )
  demo.add_argument(
    "--no-memory", action="store_true", help="skip the memory comparison (three compilations)"
  )
  args = parser.parse_args(argv)
  if args.command == "demo":
    for name in ("depth", "width", "steps", "batch"):
      if getattr(args, name) < 1:
        parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    from ._demo import run

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
