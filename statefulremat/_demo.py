"""The demo: a stack of residual blocks learns a synthetic regression task."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

import statefulremat as sr


class Block(sr.Module):
  """x + W2 gelu(W1 x): one residual block."""

  def __init__(self, width: int, *, rngs: sr.Rngs):
    self.fc1 = sr.nn.Linear(width, width, rngs=rngs)
    self.fc2 = sr.nn.Linear(width, width, rngs=rngs,
                            kernel_init=jax.nn.initializers.zeros)

  def __call__(self, x):
    return x + self.fc2(jax.nn.gelu(self.fc1(x)))


class Stack(sr.Module):
  """``depth`` residual blocks between an input and an output projection."""

  def __init__(self, depth: int, width: int, *, rngs: sr.Rngs):
    self.embed = sr.nn.Linear(1, width, rngs=rngs)
    self.blocks = [Block(width, rngs=rngs) for _ in range(depth)]
    self.head = sr.nn.Linear(width, 1, rngs=rngs)

  def __call__(self, x):
    x = self.embed(x)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def make_batch(key, batch: int):
  x = jax.random.uniform(key, (batch, 1), minval=-3.0, maxval=3.0)
  return x, jnp.sin(2.0 * x) + 0.5 * x


@sr.jit
def train_step(model, opt, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = sr.value_and_grad(loss_fn)(model)
  opt.update(grads)
  return loss


def run(*, depth: int, width: int, steps: int, batch: int, seed: int) -> float:
  """Trains the stack and prints the loss; returns the final loss."""
  rngs = sr.Rngs(params=seed, data=seed + 1)
  model = Stack(depth, width, rngs=rngs)
  opt = sr.Optimizer(model, optax.adam(3e-3))
  params = sum(x.size for x in jax.tree.leaves(sr.state(model, sr.Param)))
  print(f"statefulremat demo: {depth} residual blocks of width {width} "
        f"({params:,} parameters), {steps} steps of batch {batch}")
  start = time.perf_counter()
  loss = first = None
  for step in range(1, steps + 1):
    x, y = make_batch(rngs.data(), batch)
    loss = float(train_step(model, opt, x, y))
    first = loss if first is None else first
    if step == 1 or step % max(1, steps // 5) == 0 or step == steps:
      print(f"  step {step:5d}  loss {loss:.4f}")
  elapsed = time.perf_counter() - start
  print(f"loss {first:.4f} -> {loss:.4f} in {elapsed:.1f} s")
  return loss
