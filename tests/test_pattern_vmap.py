"""sr.vmap over a pattern stack (an ensemble of P classes) does all that it does over a
plain stack: pytree ``out_axes``, writes to a shared Variable, changes of structure and
modules returned — each against the loop over the members, ``stack.layer(i)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr

D = 4
X = jax.random.normal(jax.random.key(1), (3, D))


class Count(sr.Variable):
  pass


class Counter(sr.Module):
  def __init__(self):
    self.n = Count(jnp.array(0))


class Scale(sr.Module):
  def __init__(self, counter, *, rngs):
    self.counter = counter
    self.w = sr.Param(jax.random.normal(rngs.params(), (D,)))

  def __call__(self, x):
    self.counter.n.value += 1
    return jnp.tanh(x * self.w.value[None])


class Shift(Scale):
  def __call__(self, x):
    self.counter.n.value += 1
    return x + self.w.value[None]


class Box(sr.Module):
  def __init__(self, value):
    self.v = sr.Intermediate(value)


def build(length: int, counter=None):
  Stack = sr.vmap((Scale, Shift), axis_size=length, in_axes=None, variable_broadcast=Count)
  return Stack(counter or Counter(), rngs=sr.Rngs(0))


def mapped(fn):
  return sr.vmap(fn, variable_broadcast=Count, variable_axes={sr.Param: 0})


def close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def xs_for(length: int):
  return jax.random.normal(jax.random.key(3), (length, 3, D))


@pytest.mark.parametrize("length", [4, 5])
def test_pytree_out_axes_put_the_members_where_each_leaf_asks(length):
  stack, xs = build(length), xs_for(length)

  def fn(m, x):
    y = m(x)
    return {"y": y, "norm": jnp.sum(y**2), "none": jnp.ones(2)}

  got = sr.vmap(fn, variable_broadcast=Count, out_axes={"y": 1, "norm": 0, "none": None})(stack, xs)
  want = [fn(stack.layer(i), xs[i]) for i in range(length)]
  close(got["y"], jnp.stack([w["y"] for w in want], axis=1))
  close(got["norm"], jnp.stack([w["norm"] for w in want]))
  close(got["none"], jnp.ones(2))


@pytest.mark.parametrize("length", [4, 5])
def test_a_shared_counter_is_written_once_as_over_a_plain_stack(length):
  counter = Counter()
  stack, xs = build(length, counter), xs_for(length)
  want = jnp.stack([stack.layer(i)(xs[i]) for i in range(length)])  # on copies
  assert int(counter.n.value) == 0
  close(mapped(lambda m, x: m(x))(stack, xs), want)
  assert int(counter.n.value) == 1  # every member wrote 0 + 1: kept, as one value


def test_a_shared_write_that_differs_between_positions_is_refused_and_nothing_written():
  counter = Counter()
  stack, xs = build(4, counter), xs_for(4)
  w0 = stack.pattern[0].w.value

  def by_position(m, x):
    m.counter.n.value += 1 + jnp.int32(isinstance(m, Shift))
    m.w.value = m.w.value * 2
    return x

  with pytest.raises(sr.TransformError, match=r"pattern\[0\]\.counter\.n.*not mapped.*Fix"):
    mapped(by_position)(stack, xs)
  assert int(counter.n.value) == 0
  assert stack.pattern[0].w.value is w0
  # Under an outer jit the values are known only when it runs: the same refusal.
  with pytest.raises(Exception, match=r"wrote to `[\w.\[\]]*n` \(Count.*not mapped"):
    jax.block_until_ready(sr.jit(lambda s, x: mapped(by_position)(s, x))(stack, xs))
  assert int(counter.n.value) == 0


def test_structure_changes_come_out_per_position():
  stack, xs = build(4), xs_for(4)

  def tag(m, x):
    y = m(x)
    m.seen = ("a", 2)  # a static attribute
    m.h = sr.Intermediate(y)  # a Variable made per member
    return y

  y = mapped(tag)(stack, xs)
  for k, position in enumerate(stack.pattern):
    assert position.seen == ("a", 2)
    assert position.h.value.shape == (2, 3, D)
    close(position.h.value, y[k::2])
  for i in range(4):
    close(stack.layer(i).h.value, y[i])


def test_a_variable_made_over_a_ragged_pattern_is_refused():
  stack = build(5)

  def sow(m, x):
    m.h = sr.Intermediate(m(x))
    return x

  with pytest.raises(sr.TransformError, match=r"not a multiple of its pattern of 2.*Fix"):
    mapped(sow)(stack, xs_for(5))
  assert not hasattr(stack.pattern[0], "h")


@pytest.mark.parametrize("length", [4, 5])
def test_modules_made_inside_come_out_as_a_stack_in_member_order(length):
  stack, xs = build(length), xs_for(length)
  boxes = mapped(lambda m, x: Box(m(x)))(stack, xs)
  assert len(boxes) == length and boxes.v.value.shape == (length, 3, D)
  for i in range(length):
    close(boxes.layer(i).v.value, stack.layer(i)(xs[i]))


def test_outputs_of_another_structure_per_position_are_refused():
  stack = build(4)
  with pytest.raises(sr.TransformError, match=r"outputs differ in structure.*Scale.*Shift"):
    mapped(lambda m, x: m(x) if isinstance(m, Scale) and not isinstance(m, Shift) else (x,))(
      stack, xs_for(4)
    )
