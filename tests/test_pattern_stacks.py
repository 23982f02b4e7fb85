"""Stacks of a repeating pattern (issue 25): a tuple of classes as one cycle.

Each form (scan, remat_scan, vmap) over patterns of 2 and 3 blocks, lengths that are
and are not multiples of the pattern, against the Python loop over ``stack.layer(i)``:
outputs, gradients and state (batch statistics, RNG streams, dropout masks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr
from tests._pattern_blocks import D, Gate, Mix, Norm

X = jax.random.normal(jax.random.key(1), (3, D))

PATTERNS = {
  "2": (Mix, Norm),
  "3": (Mix, functools.partial(Mix, scale=0.5), Gate),
  "3bn": (Norm, Gate, Mix),
}


class Holder(sr.Module):
  def __init__(self, layers):
    self.layers = layers


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def loop(layers, x):
  for layer in layers:
    x = layer(x)
  return x


def loss_of(y):
  return jnp.sum(y**2)


def build(form: str, pattern, length: int):
  if form == "remat_scan":
    return sr.remat_scan(pattern, length=length, lengths="auto")(rngs=sr.Rngs(0))
  if form == "remat_scan_nested":
    cycles = -(-length // len(pattern))
    return sr.remat_scan(pattern, length=length, lengths=(2, -(-cycles // 2)))(rngs=sr.Rngs(0))
  raise ValueError(form)


def states_equal(stack, layers):
  """The stack's state is the loop's layers' state, position by position."""
  p = len(stack.pattern)
  for k, position in enumerate(stack.pattern):
    _, ours = sr.split(position)
    theirs = [sr.split(layer)[1] for layer in layers[k::p]]
    for path, value in ours.flat().items():
      if "rngs" in str(path) or "default" in str(path):
        continue
      expected = jnp.stack([dict(t.flat().items())[path] for t in theirs])
      close(value, expected, 1e-5)


@pytest.mark.parametrize("form", ["remat_scan", "remat_scan_nested"])
@pytest.mark.parametrize("name,length", [("2", 6), ("2", 7), ("3", 9), ("3", 8), ("3bn", 7)])
def test_remat_scan_pattern_equals_the_loop(form, name, length):
  stack = build(form, PATTERNS[name], length)
  assert len(stack) == length
  assert [type(stack.layer(i)) for i in range(length)] == [
    getattr(
      PATTERNS[name][i % len(PATTERNS[name])], "func", PATTERNS[name][i % len(PATTERNS[name])]
    )
    for i in range(length)
  ]
  layers = sr.unstack(stack)
  grads = sr.grad(lambda m, x: loss_of(m(x)))(stack, X)
  held = Holder(layers)
  layer_grads = dict(sr.grad(lambda h, x: loss_of(loop(h.layers, x)))(held, X).flat().items())
  states_equal(stack, layers)  # batch statistics after the step
  p = len(stack.pattern)
  for path, g in grads.flat().items():
    k, rest = path[1], path[2:]
    theirs = [layer_grads[("layers", i) + rest] for i in range(k, length, p)]
    close(g, jnp.stack(theirs), 1e-4)
  # the next call, dropout included
  layers = sr.unstack(stack)
  close(stack(X), loop(layers, X))
  states_equal(stack, layers)


@pytest.mark.parametrize("length", [4, 5])
def test_scan_pattern_equals_the_loop_with_ys_and_xs(length):
  class Step(sr.Module):
    def __init__(self, *, rngs):
      self.lin = sr.nn.Linear(D, D, rngs=rngs)
      self.drop = sr.nn.Dropout(0.5, rngs=rngs)

    def __call__(self, c, x):
      c = self.drop(jnp.tanh(self.lin(c) + x))
      return c, c.sum(-1)

  class Other(sr.Module):
    def __init__(self, *, rngs):
      self.bn = sr.nn.BatchNorm(D, rngs=rngs)

    def __call__(self, c, x):
      c = self.bn(c) * x
      return c, c.mean(-1)

  Stack = sr.scan((Step, Other), length=length, variable_axes={True: 0}, split_rngs={True: True})
  stack = Stack(rngs=sr.Rngs(0))
  xs = jax.random.normal(jax.random.key(2), (length, 3, D))
  layers = sr.unstack(stack)
  c, ys = stack(X, xs)
  ref, ref_ys = X, []
  for layer, x in zip(layers, xs):
    ref, y = layer(ref, x)
    ref_ys.append(y)
  close(c, ref)
  close(ys, jnp.stack(ref_ys))
  states_equal(stack, layers)
  # reverse: the layers run last to first
  back = sr.scan(
    lambda m, c, x: m(c, x), variable_axes={True: 0}, split_rngs={True: True}, reverse=True
  )
  layers = sr.unstack(stack)
  c, ys = back(stack, X, xs)
  ref, ref_ys = X, [None] * length
  for i in reversed(range(length)):
    ref, ref_ys[i] = layers[i](ref, xs[i])
  close(c, ref)
  close(ys, jnp.stack(ref_ys))


@pytest.mark.parametrize("length", [4, 5])
def test_vmap_pattern_maps_member_i_to_slice_i(length):
  class Twice(sr.Module):
    def __init__(self, *, rngs):
      self.w = sr.Param(jax.random.normal(rngs.params(), (D,)))
      self.drop = sr.nn.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(x * self.w.value[None] * 2)

  Stack = sr.vmap((Mix, Twice), axis_size=length)
  stack = Stack(rngs=sr.Rngs(0))
  xs = jax.random.normal(jax.random.key(3), (length, 3, D))
  layers = sr.unstack(stack)
  close(stack(xs), jnp.stack([layer(x) for layer, x in zip(layers, xs)]))
  grads = sr.grad(lambda m, x: loss_of(m(x)))(stack, xs)
  assert grads.flat()[("pattern", 1, "w")].shape == (length // 2, D)
  # in_axes=None: every member sees the whole input
  shared = sr.vmap((Mix, Twice), axis_size=length, in_axes=None)(rngs=sr.Rngs(0))
  assert shared(X).shape == (length, 3, D)


def test_dropout_masks_differ_across_positions_and_cycles():
  stack = sr.remat_scan((Mix, Mix), length=4, lengths=(2,))(rngs=sr.Rngs(0))
  masks = []
  for layer in sr.unstack(stack):
    layer.lin.kernel.value = jnp.eye(D) * 10.0
    layer.lin.bias.value = jnp.ones(D) * 10.0
    masks.append(layer(jnp.ones((8, D))) == 0)
  for i in range(4):
    for j in range(i):
      assert not bool(jnp.all(masks[i] == masks[j])), (i, j)


def test_the_stream_advances_once_per_call():
  rngs = sr.Rngs(0)
  stack = sr.remat_scan((Mix, Gate), length=4, lengths=(2,))(rngs=rngs)
  before = int(stack.pattern[0].drop.rngs.dropout.count.value)
  first = stack(X)
  assert int(stack.pattern[0].drop.rngs.dropout.count.value) == before + 1
  assert not bool(jnp.allclose(first, stack(X)))  # a second call: new masks


def test_unstack_stack_round_trip():
  stack = sr.remat_scan(PATTERNS["3"], length=8, lengths=(3,))(rngs=sr.Rngs(0))
  again = sr.stack(sr.unstack(stack))
  assert type(again) is type(stack) and len(again) == 8
  # A stream the positions shared comes back as one copy per position, with the
  # same key and count: the same draws.
  ours, theirs = sr.split(stack)[1].flat(), sr.split(again)[1].flat()
  for path, value in ours.items():
    assert jnp.shape(value) == jnp.shape(theirs[path])
    assert bool(
      jnp.all(jax.random.key_data(value) == jax.random.key_data(theirs[path]))
      if jnp.issubdtype(value.dtype, jax.dtypes.prng_key)
      else jnp.all(value == theirs[path])
    ), path
  close(again(X), loop(sr.unstack(stack), X))


def test_a_checkpoint_of_the_state_fits_another_lengths():
  a = sr.remat_scan(PATTERNS["2"], length=7, lengths=(2, 2))(rngs=sr.Rngs(0))
  b = sr.remat_scan(PATTERNS["2"], length=7, lengths=(4,))(rngs=sr.Rngs(1))
  sr.update(b, sr.split(a)[1])
  close(a(X), b(X))


def test_lowered_program_size_does_not_grow_with_length():
  def size(length):
    stack = sr.remat_scan(PATTERNS["3"], length=length, lengths=(length // 3,))(rngs=sr.Rngs(0))
    step = sr.jit(sr.grad(lambda m, x: loss_of(m(x))))
    return len(step.lower(stack, X).as_text())

  small, large = size(24), size(96)
  assert abs(large - small) / small < 0.10, (small, large)


def test_sow_inside_a_pattern_is_stacked_per_position():
  class Sowing(sr.Module):
    def __init__(self, *, rngs):
      self.lin = sr.nn.Linear(D, D, rngs=rngs)

    def __call__(self, x):
      y = self.lin(x)
      self.sow(sr.Intermediate, "out", y)
      return y

  stack = sr.remat_scan((Sowing, Gate), length=6, lengths=(3,))(rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  stack(X)
  ref = X
  outs = []
  for i, layer in enumerate(layers):
    ref = layer(ref)
    if i % 2 == 0:
      outs.append(layer.out.value[0])
  (sown,) = stack.pattern[0].out.value
  assert sown.shape == (3, 3, D)
  close(sown, jnp.stack(outs))


def test_an_error_inside_changes_nothing():
  stack = sr.remat_scan((Norm, Mix), length=5, lengths=(3,))(rngs=sr.Rngs(0))
  state = jax.tree.map(lambda v: v, sr.split(stack)[1])

  def fail(layer, x):
    y = layer(x)
    if isinstance(layer, Mix):
      raise KeyboardInterrupt
    return y

  with pytest.raises(KeyboardInterrupt):
    sr.remat_scan(fail, lengths=(3,))(stack, X)
  for a, b in zip(jax.tree.leaves(sr.split(stack)[1]), jax.tree.leaves(state)):
    assert a is b


def test_scan_pattern_carries_batch_statistics_through_every_layer():
  # variable_carry: one BatchNorm's statistics threaded through the layers of one
  # position (linen's carried batch stats), the params stacked per layer.
  class Scale(sr.Module):
    def __init__(self, *, rngs):
      self.w = sr.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (D,)))

    def __call__(self, c, _):
      return c * self.w.value[None], None

  class Stats(sr.Module):
    def __init__(self, *, rngs):
      self.bn = sr.nn.BatchNorm(D, rngs=rngs)

    def __call__(self, c, _):
      return self.bn(c), None

  Stack = sr.scan(
    (Scale, Stats),
    length=5,
    variable_axes={sr.Param: 0},
    variable_carry=sr.BatchStat,
    split_rngs={"params": True},
  )
  stack = Stack(rngs=sr.Rngs(0))
  assert stack.pattern[1].bn.mean.shape == (D,)  # one value, carried
  xs = jnp.zeros((5, 1))
  layers = sr.unstack(stack)
  c, _ = stack(X, xs)
  ref = X
  mean, var = layers[1].bn.mean.value, layers[1].bn.var.value
  for layer in layers:
    if isinstance(layer, Stats):  # the running statistics go on to the next one
      layer.bn.mean.value, layer.bn.var.value = mean, var
    ref, _ = layer(ref, None)
    if isinstance(layer, Stats):
      mean, var = layer.bn.mean.value, layer.bn.var.value
  close(c, ref)
  close(stack.pattern[1].bn.mean.value, mean)
  close(stack.pattern[1].bn.var.value, var)


def test_a_reverse_scan_gives_each_layer_of_a_cycle_its_own_keys():
  stack = sr.scan((Mix, Mix), length=4, variable_axes={True: 0}, split_rngs={True: True})(
    rngs=sr.Rngs(0)
  )
  for position in stack.pattern:  # large activations: dropout's zeros show the mask
    position.lin.kernel.value = jnp.broadcast_to(jnp.eye(D) * 10.0, (2, D, D))
  back = sr.scan(
    lambda m, c: (m(c), None), variable_axes={True: 0}, split_rngs={True: True}, reverse=True
  )
  layers = sr.unstack(stack)
  got, _ = back(stack, jnp.ones((8, D)))
  want = jnp.ones((8, D))
  for i in reversed(range(4)):
    want = layers[i](want)
  close(got, want)
