"""Stacked modules: stack.layer(i), len, sr.unstack / sr.stack, and the graph functions."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import statefulremat as sr

W = 4


class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.BatchNorm(dim, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.norm(self.linear(x)))


class Pair(sr.Module):
  """Two Params of given values (for cheap stacks of any shape)."""

  def __init__(self, a, b):
    self.a = sr.Param(jnp.asarray(a))
    self.inner = sr.ModuleList([sr.BatchStat(jnp.asarray(b))])


Stack = sr.vmap(Block, axis_size=3, in_axes=None)


@pytest.fixture
def stack():
  return Stack(W, rngs=sr.Rngs(0))


def flat_values(module):
  return {path: np.asarray(v) for path, v in sr.state(module).flat().items()}


def assert_same_state(a, b):
  fa, fb = flat_values(a), flat_values(b)
  assert sorted(fa) == sorted(fb)
  for path in fa:
    np.testing.assert_array_equal(fa[path], fb[path], err_msg=str(path))


# -- layer and len --------------------------------------------------------------------


def test_len_and_layer(stack):
  assert len(stack) == 3
  for i in range(3):
    layer = stack.layer(i)
    assert type(layer) is Block
    assert layer.linear.kernel.shape == (W, W) and layer.norm.mean.shape == (W,)
    np.testing.assert_array_equal(layer.linear.kernel.value, stack.linear.kernel.value[i])
  assert_same_state(stack.layer(-1), stack.layer(2))
  assert_same_state(stack.layer(-3), stack.layer(0))


def test_layer_is_a_copy(stack):
  layer = stack.layer(1)
  before = np.asarray(stack.linear.kernel.value)
  layer.linear.kernel.value = jnp.zeros((W, W))
  np.testing.assert_array_equal(stack.linear.kernel.value, before)


@pytest.mark.parametrize("i", [3, -4, 10])
def test_layer_out_of_range(stack, i):
  with pytest.raises(
    IndexError, match=rf"layer {i} of a stack of 3 layers: use 0\.\.2 \(or -3\.\.-1\)"
  ):
    stack.layer(i)


def test_layer_of_scan_and_remat_scan_stacks():

  class Step(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(W, W, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.linear(x)), None

  scanned = sr.scan(Step, length=2, variable_axes={sr.Param: 0}, split_rngs={"params": True})(
    rngs=sr.Rngs(0)
  )
  assert len(scanned) == 2 and type(scanned.layer(1)) is Step
  deep = sr.remat_scan(Block, lengths=(2, 2))(W, rngs=sr.Rngs(0))
  assert len(deep) == 4 and type(deep.layer(3)) is Block
  np.testing.assert_array_equal(deep.layer(3).norm.var.value, deep.norm.var.value[3])


# -- unstack / stack ---------------------------------------------------------------------


def test_round_trip_is_exact(stack):
  stack(jnp.ones((2, W)))  # batch stats move, so every collection is exercised
  layers = sr.unstack(stack)
  assert len(layers) == 3 and all(type(layer) is Block for layer in layers)
  again = sr.stack(layers)
  assert type(again) is Stack and len(again) == 3
  assert_same_state(again, stack)
  assert sr.graphdef(again) == sr.graphdef(stack)
  for i, layer in enumerate(sr.unstack(again)):
    assert_same_state(layer, layers[i])


def test_restacked_module_computes_the_same(stack):
  x = jnp.linspace(-1.0, 1.0, 2 * W).reshape(2, W)
  again = sr.stack(sr.unstack(stack))
  y = again(x)
  assert y.shape == (3, 2, W)
  np.testing.assert_array_equal(y, stack(x))
  assert_same_state(again, stack)  # both moved their batch stats the same way


def test_stack_like(stack):
  plain = [Block(W, rngs=sr.Rngs(i)) for i in range(2)]
  for like in (stack, Stack):
    built = sr.stack(plain, like=like)
    assert type(built) is Stack and len(built) == 2
    assert built.linear.kernel.shape == (2, W, W)
    for i, layer in enumerate(sr.unstack(built)):
      assert_same_state(layer, plain[i])


def test_stack_keeps_the_axis_of_the_class():
  Last = sr.vmap(Block, axis_size=2, in_axes=None, variable_axes={True: -1})
  last = Last(W, rngs=sr.Rngs(0))
  assert last.linear.kernel.shape == (W, W, 2) and last.norm.mean.shape == (W, 2)
  assert len(last) == 2
  np.testing.assert_array_equal(last.layer(1).linear.kernel.value, last.linear.kernel.value[..., 1])
  again = sr.stack(sr.unstack(last))
  assert type(again) is Last
  assert_same_state(again, last)
  plain = [Block(W, rngs=sr.Rngs(i)) for i in range(3)]
  assert sr.stack(plain, like=Last).linear.kernel.shape == (W, W, 3)


@settings(max_examples=12, deadline=None)
@given(
  n=st.integers(1, 4),
  shape=st.lists(st.integers(1, 3), max_size=2),
  axis=st.sampled_from([0, -1]),
  seed=st.integers(0, 2**16),
)
def test_round_trip_property(n, shape, axis, seed):
  rng = np.random.default_rng(seed)
  cls = sr.vmap(Pair, axis_size=n, variable_axes={True: axis})
  layers = [
    Pair(
      rng.normal(size=shape).astype(np.float32),
      rng.integers(0, 100, size=shape[:1]).astype(np.int32),
    )
    for _ in range(n)
  ]
  stacked = sr.stack(layers, like=cls)
  assert type(stacked) is cls and len(stacked) == n
  assert stacked.a.shape == (tuple(shape) + (n,) if axis == -1 and shape else (n,) + tuple(shape))
  back = sr.unstack(stacked)
  for layer, original in zip(back, layers):
    assert type(layer) is Pair
    assert_same_state(layer, original)
  assert_same_state(sr.stack(back), stacked)


# -- errors ------------------------------------------------------------------------------


def test_unstack_of_a_plain_module():
  with pytest.raises(
    TypeError,
    match=r"sr\.unstack takes a stacked module \(built by the "
    r"class form of sr\.scan, sr\.remat_scan or sr\.vmap\)"
    r", got Block",
  ):
    sr.unstack(Block(W, rngs=sr.Rngs(0)))


def test_stack_errors(stack):
  plain = Block(W, rngs=sr.Rngs(0))
  with pytest.raises(
    TypeError,
    match=r"sr\.stack cannot tell which stacked class to build"
    r".*sr\.stack\(layers, like=StackedClass\)",
  ):
    sr.stack([plain, plain])
  # Layers of two different stacked classes.
  other = sr.vmap(Block, axis_size=2, in_axes=None)(W, rngs=sr.Rngs(0))
  with pytest.raises(TypeError, match=r"did not all come from the same stack"):
    sr.stack([stack.layer(0), other.layer(0)])
  with pytest.raises(
    sr.TransformError,
    match=r"sr\.stack: layer 1 is not structured like "
    r"layer 0",
  ):
    sr.stack([plain, Block(W + 1, rngs=sr.Rngs(0))], like=Stack)
  evaluating = stack.layer(1).eval()
  with pytest.raises(sr.TransformError, match=r"layer 1 is not structured like layer 0"):
    sr.stack([stack.layer(0), evaluating])
  with pytest.raises(ValueError, match=r"sr\.stack needs at least one layer"):
    sr.stack([])
  with pytest.raises(
    TypeError,
    match=r"sr\.stack\(like=\.\.\.\) takes a stacked module or "
    r"class, got <class '.*Block'>",
  ):
    sr.stack([plain], like=Block)
  with pytest.raises(TypeError, match=r"takes a stacked module or class"):
    sr.stack([plain], like=plain)


# -- the graph functions ----------------------------------------------------------------


def test_split_merge_update_clone(stack):
  graphdef, params, rest = sr.split(stack, sr.Param, ...)
  assert params["linear"]["kernel"].shape == (3, W, W)
  assert rest["norm"]["mean"].shape == (3, W)
  merged = sr.merge(graphdef, params, rest)
  assert type(merged) is Stack and len(merged) == 3
  assert_same_state(merged, stack)
  copy = sr.clone(stack)
  assert type(copy) is Stack and copy is not stack
  assert copy.linear.kernel is not stack.linear.kernel
  assert_same_state(copy, stack)
  x = jnp.ones((2, W))
  np.testing.assert_array_equal(copy(x), stack(x))
  # Update a stack from another stack's state.
  other = Stack(W, rngs=sr.Rngs(9))
  assert not np.allclose(other.linear.kernel.value, stack.linear.kernel.value)
  sr.update(other, sr.state(stack))
  assert_same_state(other, stack)


def test_update_moves_state_between_a_layer_and_a_plain_module(stack):
  plain = Block(W, rngs=sr.Rngs(5))
  sr.update(plain, sr.state(stack.layer(1)))
  assert_same_state(plain, stack.layer(1))
  x = jnp.linspace(-1.0, 1.0, 2 * W).reshape(2, W)
  np.testing.assert_allclose(plain(x), stack.layer(1)(x), rtol=1e-6)
  # And back: a plain module's state into one layer of a new stack.
  fresh = Block(W, rngs=sr.Rngs(6))
  layers = sr.unstack(stack)
  sr.update(layers[2], sr.state(fresh))
  rebuilt = sr.stack(layers)
  assert_same_state(rebuilt.layer(2), fresh)
  assert_same_state(rebuilt.layer(0), stack.layer(0))


def test_a_restacked_subset_of_layers_runs_with_its_own_count():
  Stack = sr.vmap(sr.nn.Linear, axis_size=4, in_axes=None)
  stack = Stack(2, 3, rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  smaller = sr.stack(layers[:2])
  x = jnp.ones((5, 2))
  assert len(smaller) == 2
  out = smaller(x)
  assert out.shape == (2, 5, 3)
  np.testing.assert_allclose(out[1], layers[1](x), rtol=1e-6)


def test_a_partial_of_a_class_is_a_class_form_in_every_single_class_form():
  """``sr.vmap(partial(Block, ...))`` (and scan, remat_scan) build a stack of ``Block``
  layers made by the partial, its arguments first, as a pattern's positions take one;
  the class is made once, and the plain class form of ``Block`` is another."""

  class Scaled(sr.Module):
    def __init__(self, width, *, scale=1.0, rngs):
      self.linear = sr.nn.Linear(width, width, rngs=rngs)
      self.scale = scale

    def __call__(self, x):
      return jnp.tanh(self.linear(x)) * self.scale

  made = functools.partial(Scaled, 3, scale=2.0)
  x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
  deep = sr.remat_scan(made, lengths=(2, 2))(rngs=sr.Rngs(0))
  assert sr.remat_scan(made, lengths=(2, 2)) is type(deep)
  assert sr.remat_scan(Scaled, lengths=(2, 2)) is not type(deep)
  layers = sr.unstack(deep)
  assert [type(layer).__name__ for layer in layers] == ["Scaled"] * 4
  assert {layer.scale for layer in layers} == {2.0}
  h = x
  for layer in layers:
    h = layer(h)
  np.testing.assert_allclose(deep(x), h, rtol=1e-6, atol=1e-6)
  ensemble = sr.vmap(made, axis_size=3, in_axes=None)(rngs=sr.Rngs(1))
  want = jnp.stack([member(x) for member in sr.unstack(ensemble)])
  np.testing.assert_allclose(ensemble(x), want, rtol=1e-6, atol=1e-6)
  scanned = sr.scan(
    functools.partial(Scaled, 3, scale=0.5),
    length=2,
    variable_axes={sr.Param: 0},
    split_rngs={"params": True},
    methods="__call__",
  )(rngs=sr.Rngs(2))
  assert sr.unstack(scanned)[1].scale == 0.5
