"""Command line: ``python -m statefulremat demo [--help]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m statefulremat",
      description="statefulremat: PyTorch-like modules with JAX's memory tools.")
  commands = parser.add_subparsers(dest="command", required=True)
  demo = commands.add_parser(
      "demo", help="train a small stacked residual MLP on a synthetic task",
      description="Trains a stack of residual MLP blocks on a synthetic regression "
      "task with sr.jit and sr.Optimizer (optax adam) and prints the loss.")
  demo.add_argument("--depth", type=int, default=8, help="number of residual blocks")
  demo.add_argument("--width", type=int, default=64, help="features per block")
  demo.add_argument("--steps", type=int, default=200, help="training steps")
  demo.add_argument("--batch", type=int, default=128, help="examples per step")
  demo.add_argument("--seed", type=int, default=0, help="random seed")
  args = parser.parse_args(argv)
  if args.command == "demo":
    from ._demo import run

    run(depth=args.depth, width=args.width, steps=args.steps, batch=args.batch,
        seed=args.seed)
  return 0


if __name__ == "__main__":
  sys.exit(main())
