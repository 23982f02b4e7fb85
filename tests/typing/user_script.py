# pyright: strict
"""What a user writes, type-checked in pyright's strict mode by tests/test_types.py.

A custom module of sr.nn layers, stacked by sr.remat_scan, a jitted train step with
sr.value_and_grad and optax, split / merge / state, and nnx 0.12's get_value / set_value.
The two `pyright: ignore` comments are for jax and optax, not for statefulremat: optax
ships no type information, and jax's stubs leave `device` in `jnp.ones` & co. unknown.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax  # pyright: ignore[reportMissingTypeStubs]

import statefulremat as sr


class Block(sr.Module):
  def __init__(self, dim: int, *, rngs: sr.Rngs) -> None:
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.LayerNorm(dim, rngs=rngs)
    self.scale = sr.Param(jnp.ones((dim,)))  # pyright: ignore[reportUnknownMemberType]

  def __call__(self, x: jax.Array) -> jax.Array:
    return x + self.scale.value * jax.nn.gelu(self.norm(self.linear(x)))


Stack = sr.remat_scan(Block, lengths=(2, 2))  # 4 layers: a type[Block]
model = Stack(8, rngs=sr.Rngs(0))
first: Block = model.layer(0)
kernel: jax.Array = first.linear.kernel.value
model.scale.set_value(model.scale.get_value() * 2)
opt = sr.Optimizer(model, optax.adam(1e-3))


@sr.jit
def train_step(model: Block, opt: sr.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
  def loss_fn(m: Block) -> jax.Array:
    return jnp.mean((m(x) - y) ** 2)

  loss, grads = sr.value_and_grad(loss_fn)(model)
  opt.update(grads)
  return loss


x = jax.random.normal(jax.random.key(1), (4, 8))
losses = [float(train_step(model, opt, x, jnp.sin(x))) for _ in range(3)]
graphdef, params, rest = sr.split(model, sr.Param, ...)
again = sr.merge(graphdef, params, rest)
n_params = sum(v.size for v in sr.state(model, sr.Param).flat().values())
print(losses, kernel.shape, n_params, len(model), sr.clone(model).layer(1).scale.get_value())
