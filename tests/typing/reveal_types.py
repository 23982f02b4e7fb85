"""The types pyright gives the main names: tests/test_types.py reads each `reveal_type`
line's revealed type from pyright's report and compares it with the line's `# -> ` comment
(as pyright prints it: `1.0` as `1`). Never run (tests/typing/conftest.py)."""

from __future__ import annotations

from typing import reveal_type

import jax
import jax.numpy as jnp

import statefulremat as sr


class Block(sr.Module):
  def __init__(self, dim: int, *, rngs: sr.Rngs) -> None:
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.linear(x)


def step(model: Block, x: jax.Array, *, scale: float = 1.0) -> jax.Array:
  return model(x) * scale


def loss(model: Block, x: jax.Array) -> jax.Array:
  return jnp.sum(model(x))


def loss_aux(model: Block, x: jax.Array) -> tuple[jax.Array, int]:
  return jnp.sum(model(x)), 1


def square(x: jax.Array) -> jax.Array:
  return x**2


stack = sr.remat_scan(Block, lengths=(2,))(4, rngs=sr.Rngs(0))
param = sr.Param(jax.random.normal(jax.random.key(0), (2,)))
x = jax.random.normal(jax.random.key(0), (2, 4))

reveal_type(sr.remat_scan(Block, lengths=(2,)))  # -> type[Block]
reveal_type(sr.remat_scan(Block, (2, 2), policy=None))  # -> type[Block]
reveal_type(sr.scan(Block, length=3))  # -> type[Block]
reveal_type(sr.vmap(Block, axis_size=3))  # -> type[Block]
reveal_type(sr.remat(Block))  # -> type[Block]
reveal_type(sr.remat(policy=None)(Block))  # -> type[Block]
reveal_type(sr.remat(step))  # -> (model: Block, x: Array, *, scale: float = 1) -> Array
reveal_type(sr.remat_scan(step, (2,)))  # -> (model: Block, x: Array, *, scale: float = 1) -> Array
reveal_type(sr.vmap(step))  # -> (model: Block, x: Array, *, scale: float = 1) -> Array
reveal_type(sr.scan(in_axes=0)(step))  # -> (model: Block, x: Array, *, scale: float = 1) -> Array
reveal_type(stack)  # -> Block
reveal_type(stack.layer(0))  # -> Block
reveal_type(stack.layer(0).linear.kernel)  # -> Param[Array]
reveal_type(len(stack))  # -> int
reveal_type(sr.jit(step))  # -> Jitted[(model: Block, x: Array, *, scale: float = 1), Array]
reveal_type(
  sr.jit(static_argnames="scale")(step)
)  # -> Jitted[(model: Block, x: Array, *, scale: float = 1), Array]
reveal_type(sr.jit(step)(stack, x))  # -> Array
reveal_type(sr.grad(loss))  # -> (Block, x: Array) -> State
reveal_type(sr.grad(loss)(stack, x))  # -> State
reveal_type(sr.grad(loss_aux, has_aux=True)(stack, x))  # -> tuple[State, int]
reveal_type(sr.value_and_grad(loss)(stack, x))  # -> tuple[Array, State]
reveal_type(
  sr.value_and_grad(loss_aux, has_aux=True)(stack, x)
)  # -> tuple[tuple[Array, int], State]
reveal_type(sr.grad(square))  # -> (x: Array) -> Any
reveal_type(param)  # -> Param[Array]
reveal_type(param.value)  # -> Array
reveal_type(param.get_value())  # -> Array
reveal_type(param.set_value(param.value))  # -> None
reveal_type(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)).kernel.value)  # -> Array
reveal_type(sr.split(stack))  # -> tuple[GraphDef, State]
reveal_type(sr.state(stack, sr.Param))  # -> State
reveal_type(sr.clone(stack))  # -> Block
