"""Stacks of stacks where one of them is a pattern stack (issue 33): an ensemble of
pattern stacks (``sr.vmap(PatternClass, axis_size=E)``) and a stack of pattern stacks
(``sr.remat_scan(PatternClass, ...)``, ``sr.scan``) each equal the Python loop over
their layers — outputs, gradients and state (batch statistics, dropout masks) — as
the plain nesting of one block class does. A class's stack record is its own, so the
outer transform's unit is one whole pattern stack.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr
from tests._pattern_blocks import D, Gate, Mix, Norm

INNER = {
  "plain": lambda: sr.remat_scan(Gate, lengths=(3,)),
  "pattern": lambda: sr.remat_scan((Mix, Norm, Gate), lengths=(2,), length=5),
  "pattern-2": lambda: sr.remat_scan((Gate, Norm), lengths=(2,), length=4),
}
X = jax.random.normal(jax.random.key(1), (6, D))


def close(a, b, tol=1e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def values(module):
  """The module's values but its RNG streams' (a copy of a layer draws the keys the
  stack's next call draws, so only one call of each is compared)."""
  return {k: np.asarray(v) for k, v in sr.state(module).flat().items() if "rngs" not in k}


def loop(stack, x):
  for i in range(len(stack)):
    x = stack.layer(i)(x)
  return x


# The comparisons run compiled, one program each: eagerly, every op compiles on its own.
call = sr.jit(lambda m, x: m(x))


@pytest.mark.parametrize("inner", sorted(INNER))
def test_an_ensemble_of_stacks_equals_each_member_run_alone(inner):
  ensemble = sr.vmap(INNER[inner](), axis_size=3)(rngs=sr.Rngs(0))
  assert len(ensemble) == 3
  xs = jnp.stack([X, X + 1.0, X - 1.0])
  members = [ensemble.layer(i) for i in range(3)]
  assert type(members[0]) is sr.unstack(ensemble)[0].__class__
  expected = [call(members[i], xs[i]) for i in range(3)]
  got = call(ensemble, xs)
  assert got.shape == (3,) + X.shape
  close(got, jnp.stack(expected))
  # The state the members wrote (batch statistics) is the ensemble's.
  for i, member in enumerate(members):
    close({k: v[i] for k, v in values(ensemble).items()}, values(member))


@pytest.mark.parametrize("inner", sorted(INNER))
def test_the_gradient_of_an_ensemble_is_each_members(inner):
  ensemble = sr.vmap(INNER[inner](), axis_size=2)(rngs=sr.Rngs(0))
  ensemble.eval()
  xs = jnp.stack([X, 2.0 * X])

  def loss(m, xs):
    return jnp.sum(m(xs) ** 2)

  grads = sr.jit(sr.grad(loss))(ensemble, xs)
  member_grad = sr.jit(sr.grad(lambda m, x: jnp.sum(m(x) ** 2)))
  for i in range(2):
    member = ensemble.layer(i)
    one = member_grad(member, xs[i])
    close(
      {k: v[i] for k, v in grads.flat().items()},
      one.flat(),
    )


@pytest.mark.parametrize("inner", sorted(INNER))
def test_a_stack_of_stacks_equals_the_loop_over_its_layers(inner):
  stack = sr.remat_scan(INNER[inner](), lengths=(3,))(rngs=sr.Rngs(0))
  assert len(stack) == 3
  expected = sr.jit(loop)(stack, X)  # copies of the layers: the stack is as it was
  close(call(stack, X), expected)


@pytest.mark.parametrize("inner", sorted(INNER))
def test_a_stack_of_stacks_trains_as_the_loop(inner):
  """Two training steps, each against the loop over the stack's layers as they are:
  gradients, then the batch statistics both wrote."""
  stack = sr.remat_scan(INNER[inner](), lengths=(3,))(rngs=sr.Rngs(0))

  def loss(m, x):
    return jnp.sum(m(x) ** 2)

  def loop_loss(layers, x):
    for layer in layers:
      x = layer(x)
    return jnp.sum(x**2)

  loop_step, step = sr.jit(sr.grad(loop_loss)), sr.jit(sr.grad(loss))
  for _ in range(2):
    layers = sr.unstack(stack)
    g_loop = loop_step(layers, X)
    g = step(stack, X)
    for i in range(3):
      close({k: v[i] for k, v in g.flat().items()}, g_loop[i].flat(), tol=1e-4)
      close({k: v[i] for k, v in values(stack).items()}, values(layers[i]), tol=1e-5)


# -- class forms are made once per equal arguments ----------------------------------------


def test_a_class_form_is_made_once_for_equal_arguments():
  assert sr.remat(Gate) is sr.remat(Gate)
  assert sr.remat_scan(Gate, lengths=(2, 3)) is sr.remat_scan(Gate, lengths=(2, 3))
  assert sr.vmap(Gate, axis_size=3) is sr.vmap(Gate, axis_size=3)
  scanned = dict(length=3, variable_axes={sr.Param: 0}, split_rngs={"params": True})
  assert sr.scan(Gate, **scanned) is sr.scan(Gate, **dict(scanned))
  assert sr.scan((Gate, Norm), **scanned) is sr.scan((Gate, Norm), **scanned)
  # Different arguments, different classes; a pattern's positions are its own.
  assert sr.vmap(Gate, axis_size=3) is not sr.vmap(Gate, axis_size=4)
  assert sr.remat_scan(Gate, lengths=(2, 3)) is not sr.remat_scan(Gate, lengths=(3, 2))
  pattern = sr.scan((Gate, Gate), **scanned)(rngs=sr.Rngs(0))
  assert type(pattern.pattern[0]) is not type(pattern.pattern[1])
  assert type(pattern.pattern[0]) is not sr.scan(Gate, **{**scanned, "length": 2})


def test_an_argument_without_value_equality_makes_a_new_class():
  @dataclasses.dataclass  # eq=True and not frozen: unhashable, no value to compare by
  class Constrain:
    scale: float = 1.0

    def __call__(self, state):
      return state

  a = sr.remat_scan(Gate, lengths=(2,), data_transform=Constrain())
  b = sr.remat_scan(Gate, lengths=(2,), data_transform=Constrain())
  assert a is not b
  stack = a(rngs=sr.Rngs(0))
  close(stack(X), loop(stack, X))


class Tower(sr.Module):
  """A model that builds its stack in __init__, as big_vision's ViT does."""

  def __init__(self, depth, *, rngs):
    self.blocks = sr.remat_scan(Gate, lengths=(depth,))(rngs=rngs)

  def __call__(self, x):
    return self.blocks(x)


def test_models_building_their_stack_in_init_share_its_class_and_compile_once():
  a, b = Tower(3, rngs=sr.Rngs(0)), Tower(3, rngs=sr.Rngs(1))
  assert type(a.blocks) is type(b.blocks)
  traces = []

  @sr.jit
  def forward(model, x):
    traces.append(1)
    return model(x)

  forward(a, X)
  forward(b, X)
  assert len(traces) == 1
  mixed = sr.stack([a.blocks.layer(0), b.blocks.layer(1), a.blocks.layer(2)])
  close(mixed.layer(1).w.value, b.blocks.layer(1).w.value)
