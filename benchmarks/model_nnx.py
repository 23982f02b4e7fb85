"""flax.nnx: its documented scan-over-layers pattern.

Layers are stacked with ``nnx.split_rngs`` + ``nnx.vmap`` and applied with
``nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)``; ``nnx.remat`` wraps the body
for the checkpointed forms. nnx has no ``remat_scan``, so it is nested by hand: the
stacked state is folded to ``lengths`` inside the loss and each level is an
``nnx.scan`` of an ``nnx.remat`` body. The gradient is ``nnx.jit`` of ``nnx.grad``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .models import Case, host_init, inputs, strategy_lengths


class Block(nnx.Module):
  """``tanh(Linear(x))``: one layer, ``x -> x``."""

  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


class Unrolled(nnx.Module):
  def __init__(self, n: int, width: int, *, rngs: nnx.Rngs):
    self.blocks = nnx.List([Block(width, rngs=rngs) for _ in range(n)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def stacked(n: int, width: int, rngs: nnx.Rngs) -> Block:
  """N independently initialised layers whose variables carry a leading layer axis."""

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return Block(width, rngs=rngs)

  return create(rngs)


def scan_forward(blocks, x, remat: bool):
  def body(x, block):
    return block(x)

  if remat:
    body = nnx.remat(body, prevent_cse=False)
  return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, blocks)


def remat_scan_forward(blocks, x, lengths):
  """Nested ``nnx.scan(nnx.remat(...))``, one level per entry of ``lengths``."""
  graphdef, state = nnx.split(blocks)
  state = jax.tree.map(lambda a: a.reshape(tuple(lengths) + a.shape[1:]), state)
  blocks = nnx.merge(graphdef, state)

  def level(d, x, blocks):
    def body(x, block):
      return block(x) if d == len(lengths) - 1 else level(d + 1, x, block)

    body = nnx.remat(body, prevent_cse=False)
    return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, blocks)

  return level(0, x, blocks)


def build(strategy: str, n: int, width: int, batch: int) -> Case:
  lengths = strategy_lengths(strategy, n)
  if strategy == "unrolled":
    make = lambda: Unrolled(n, width, rngs=nnx.Rngs(0))
  else:
    make = lambda: stacked(n, width, nnx.Rngs(0))
  graphdef, state = nnx.split(nnx.eval_shape(make))
  model = nnx.merge(graphdef, host_init(state))
  x = inputs(batch, width)

  def forward(model, x):
    if strategy == "unrolled":
      return model(x)
    if strategy in ("scan", "scan_remat"):
      return scan_forward(model, x, remat=strategy == "scan_remat")
    return remat_scan_forward(model, x, lengths)

  def new(compiler_options=None):
    del compiler_options  # nnx.jit takes no compiler options: nnx compiles with defaults

    def loss(model, x):
      return jnp.mean(forward(model, x) ** 2)

    return nnx.jit(lambda model, x: nnx.grad(loss)(model, x))

  return Case(new, (model, x))
