"""flax.linen: ``nn.scan``, ``nn.remat`` and ``nn.remat_scan`` as its docs use them.

The gradient is ``jax.jit(jax.grad(...))`` of ``model.apply({"params": params}, x)``,
the way linen is trained.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .models import Case, host_init, inputs, jit_options, strategy_lengths


class Block(nn.Module):
  """``tanh(Dense(x))``: one layer, ``x -> x``."""

  width: int

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(self.width)(x))


class ScanBlock(nn.Module):
  """The layer as an ``nn.scan`` body: ``(x, _) -> (x, None)``."""

  width: int

  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(self.width)(x)), None


class Deep(nn.Module):
  """N layers with the given construction."""

  n: int
  width: int
  strategy: str
  lengths: tuple | None = None

  @nn.compact
  def __call__(self, x):
    if self.strategy == "unrolled":
      for _ in range(self.n):
        x = Block(self.width)(x)
      return x
    if self.strategy in ("scan", "scan_remat"):
      body = ScanBlock
      if self.strategy == "scan_remat":
        body = nn.remat(ScanBlock, prevent_cse=False)
      stack = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.n)
      return stack(self.width, name="stack")(x, None)[0]
    stack = nn.remat_scan(Block, lengths=self.lengths)
    return stack(self.width, name="stack")(x)


def build(strategy: str, n: int, width: int, batch: int) -> Case:
  lengths = strategy_lengths(strategy, n)
  x = inputs(batch, width)
  init = Deep(n, width, strategy, lengths).init
  params = host_init(jax.eval_shape(init, jax.random.key(0), x)["params"])

  def new(compiler_options=None):
    model = Deep(n, width, strategy, lengths)

    def loss(params, x):
      return jnp.mean(model.apply({"params": params}, x) ** 2)

    return jax.jit(jax.grad(loss), **jit_options(compiler_options))

  return Case(new, (params, x))
