"""Per-layer Variables on stacks: ``sr.stack`` never drops a layer's value, and
``sr.per_layer`` makes a user's own per-layer state (e.g. a cache) on a stack."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import statefulremat as sr

N, D = 3, 2


class Block(sr.Module):
  """A layer that keeps its own per-layer state, made by ``init_cache``."""

  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(D, D, rngs=rngs)
    self.norm = sr.nn.BatchNorm(D, rngs=rngs)
    self.calls = None

  def init_cache(self, batch):
    self.calls = sr.per_layer(self, sr.Cache(jnp.zeros((batch,), jnp.int32), sharding=("batch",)))

  def __call__(self, x):
    if self.calls is not None:
      self.calls.value = self.calls.value + 1
    return jnp.tanh(self.linear(x))


def leaves(module):
  return {p: np.array(v) for p, v in sr.state(module).flat().items()}


def unchanged(module, before):
  now = leaves(module)
  return sorted(now) == sorted(before) and all(np.array_equal(now[p], before[p]) for p in now)


# -- sr.stack: a Variable the origin does not cover is decided, never dropped ----------


def test_a_variable_added_to_each_layer_is_stacked_by_the_rules():
  """The tutorial author's case: layers 1 and 2's values used to be lost."""
  layers = sr.unstack(sr.remat_scan(sr.nn.Linear, lengths=(N,))(D, D, rngs=sr.Rngs(0)))
  for i, layer in enumerate(layers):
    layer.extra = sr.Cache(jnp.full((D,), float(i)))
  stack = sr.stack(layers)
  np.testing.assert_array_equal(stack.extra.value, [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]])
  assert stack.extra.metadata["layer_axis"] == ((0, None),)
  for i in range(N):
    np.testing.assert_array_equal(stack.layer(i).extra.value, [float(i)] * D)
  # As at init, the rules decide, not the values: equal values are stacked too.
  for layer in layers:
    layer.extra.value = jnp.zeros((D,))
  assert sr.stack(layers).extra.shape == (N, D)


def test_a_new_variable_the_rules_do_not_stack_must_be_equal_in_every_layer():
  Stack = sr.scan(sr.nn.Linear, length=N, variable_axes={sr.Param: 0}, split_rngs={"params": True})
  layers = sr.unstack(Stack(D, D, rngs=sr.Rngs(0)))
  for layer in layers:
    layer.extra = sr.Cache(jnp.ones((D,)))
  assert sr.stack(layers).extra.shape == (D,)  # equal: held once
  layers[2].extra.value = jnp.full((D,), 5.0)
  before = [leaves(layer) for layer in layers]
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr\.stack: `extra` \(Cache\) is not stacked \(the rules of ScanLinear do not "
      r"stack it\), so the stack holds one value of it for every layer, but layer 2's "
      r"differs from layer 0's; keeping layer 0's would lose the others'\. Fix: give "
      r"every layer the same value, or stack it: .*`NewClass = sr\.scan\(Linear, \.\.\., "
      r"variable_axes=\{sr\.Cache: 0\}\)`, and pass it: `sr\.stack\(layers, "
      r"like=NewClass\)`"
    ),
  ):
    sr.stack(layers)
  assert all(unchanged(layer, b) for layer, b in zip(layers, before))
  # The fix the message gives.
  Fixed = sr.scan(
    sr.nn.Linear, length=N, variable_axes={sr.Param: 0, sr.Cache: 0}, split_rngs={"params": True}
  )
  fixed = sr.stack(layers, like=Fixed)
  np.testing.assert_array_equal(fixed.extra.value[:, 0], [1.0, 1.0, 5.0])


def test_a_shared_variable_changed_in_one_layer_raises_instead_of_keeping_layer_0():
  """BatchStats a scan over Params only does not stack: held once by the stack."""
  Stack = sr.scan(Block, length=N, variable_axes={sr.Param: 0}, split_rngs={"params": True})
  stack = Stack(rngs=sr.Rngs(0))
  assert stack.norm.mean.shape == (D,)
  layers = sr.unstack(stack)
  again = sr.stack(layers)  # untouched: the round trip is exact
  np.testing.assert_array_equal(again.norm.mean.value, stack.norm.mean.value)
  assert again.linear.kernel.shape == (N, D, D) and again.norm.mean.shape == (D,)
  layers[1].norm.mean.value = layers[1].norm.mean.value + 1.0
  before = [leaves(layer) for layer in layers]
  with pytest.raises(
    sr.TransformError,
    match=(
      r"`norm\.mean` \(BatchStat\) is not stacked \(the rules of ScanBlock do not stack "
      r"it\).*layer 1's differs from layer 0's.*variable_axes=\{sr\.BatchStat: 0\}"
    ),
  ):
    sr.stack(layers)
  assert all(unchanged(layer, b) for layer, b in zip(layers, before))


def test_like_a_module_that_holds_the_variable_once():
  Stack = sr.scan(Block, length=N, variable_axes={sr.Param: 0}, split_rngs={"params": True})
  like = Stack(rngs=sr.Rngs(0))
  plain = [Block(rngs=sr.Rngs(i)) for i in range(N)]
  plain[2].norm.var.value = plain[2].norm.var.value * 2.0
  before = [leaves(layer) for layer in plain]
  with pytest.raises(
    sr.TransformError,
    match=(
      r"`norm\.var` \(BatchStat\) is not stacked \(`like` holds it without a layer "
      r"axis\).*layer 2's differs from layer 0's"
    ),
  ):
    sr.stack(plain, like=like)
  assert all(unchanged(layer, b) for layer, b in zip(plain, before))
  plain[2].norm.var.value = plain[0].norm.var.value
  built = sr.stack(plain, like=like)
  assert built.linear.kernel.shape == (N, D, D) and built.norm.var.shape == (D,)


def test_a_traced_shared_variable_that_may_differ_raises():
  Stack = sr.remat_scan(sr.nn.Linear, lengths=(N,), variable_axes={sr.Param: 0})

  @sr.jit
  def restack(stack):
    layers = sr.unstack(stack)
    for i, layer in enumerate(layers):
      layer.extra = sr.Cache(stack.kernel.value.sum() * i * jnp.ones((D,)))
    return sr.stack(layers)

  stack = Stack(D, D, rngs=sr.Rngs(0))
  before = leaves(stack)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"`extra` \(Cache\) is not stacked.*layer 1's may differ from layer 0's: it is "
      r"traced, so sr\.stack cannot compare them"
    ),
  ):
    restack(stack)
  assert unchanged(stack, before)


# -- sr.per_layer ------------------------------------------------------------------------


def test_per_layer_on_a_plain_module_returns_the_variable():
  block = Block(rngs=sr.Rngs(0))
  var = sr.Cache(jnp.zeros((4,)))
  assert sr.per_layer(block, var) is var
  block.init_cache(5)
  assert block.calls.shape == (5,) and "layer_axis" not in block.calls.metadata
  block(jnp.ones((5, D)))
  assert block.calls.value.tolist() == [1] * 5


def test_per_layer_on_a_stack_gives_each_layer_its_own_slice():
  stack = sr.remat_scan(Block, lengths=(N,))(rngs=sr.Rngs(0))
  stack.init_cache(5)
  assert stack.calls.shape == (N, 5)
  assert stack.calls.metadata == {"sharding": ("batch",), "layer_axis": ((0, None),)}
  x = jnp.ones((5, D))
  expected = x
  for layer in sr.unstack(stack):
    assert layer.calls.shape == (5,) and "layer_axis" not in layer.calls.metadata
    expected = layer(expected)
  np.testing.assert_allclose(stack(x), expected, rtol=1e-6, atol=1e-6)
  assert stack.calls.value.tolist() == [[1] * 5] * N
  again = sr.stack(sr.unstack(stack))
  np.testing.assert_array_equal(again.calls.value, stack.calls.value)
  assert again.calls.metadata == stack.calls.metadata


def test_per_layer_on_a_sub_module_of_a_stack_with_a_named_axis():
  class Outer(sr.Module):
    def __init__(self, *, rngs):
      self.block = Block(rngs=rngs)

    def __call__(self, x):
      return self.block(x)

  Stack = sr.remat_scan(Outer, lengths=(N,), metadata_params={"partition_name": "layers"})
  stack = Stack(rngs=sr.Rngs(0))
  stack.block.init_cache(5)
  assert stack.block.calls.shape == (N, 5)
  assert stack.block.calls.metadata == {
    "sharding": ("layers", "batch"),
    "layer_axis": ((0, "layers"),),
  }
  assert sr.get_partition_spec(sr.state(stack, sr.Cache))["block"]["calls"] == (
    PartitionSpec("layers", "batch")
  )
  stack(jnp.ones((5, D)))
  assert stack.block.calls.value.tolist() == [[1] * 5] * N


def test_per_layer_on_a_stack_of_stacks():
  ensemble = sr.vmap(sr.remat_scan(Block, lengths=(N,)), axis_size=2)(rngs=sr.Rngs(0))
  ensemble.init_cache(5)
  assert ensemble.calls.shape == (2, N, 5)
  assert ensemble.calls.metadata["layer_axis"] == (ensemble.linear.kernel.metadata["layer_axis"])
  ensemble(jnp.ones((2, 5, D)))
  assert ensemble.calls.value.tolist() == [[[1] * 5] * N] * 2
  member = ensemble.layer(1)
  assert member.calls.shape == (N, 5) and member.layer(0).calls.shape == (5,)


def test_per_layer_errors_name_the_module_and_the_fix():
  class Odd(sr.Module):
    def __init__(self):
      self.a = sr.Param(jnp.zeros((3, 2)), layer_axis=((0, None),))
      self.b = sr.Param(jnp.zeros((4, 2)), layer_axis=((0, None),))

  class Holder(sr.Module):
    def __init__(self):
      self.odd = Odd()

  holder = Holder()
  before = leaves(holder)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr\.per_layer on `odd`: `a` and `b` carry different layer axes \(3 layers vs "
      r"4 layers\).*Fix:"
    ),
  ):
    holder.odd.c = sr.per_layer(holder.odd, sr.Cache(jnp.zeros(2)))
  assert unchanged(holder, before) and not hasattr(holder.odd, "c")

  stack = sr.remat_scan(Block, lengths=(N,))(rngs=sr.Rngs(0))
  before = leaves(stack)
  stacked = sr.Cache(jnp.zeros((N, 5)), layer_axis=((0, None),))
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr\.per_layer on a RematScanBlock: the Variable given already carries a layer "
      r"axis.*Fix: pass one layer's Variable"
    ),
  ):
    sr.per_layer(stack, stacked)
  with pytest.raises(
    TypeError,
    match=r"sr\.per_layer\(module, variable\) takes a module "
    r"and one layer's Variable, got RematScanBlock and ArrayImpl",
  ):
    sr.per_layer(stack, jnp.zeros(2))
  assert unchanged(stack, before)

  cell = sr.scan(Block, variable_broadcast=True)(rngs=sr.Rngs(0))  # nothing stacked
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr\.per_layer on a ScanBlock: it is a stack, but none of its Variables carries the "
      r"layer axis.*Fix:"
    ),
  ):
    sr.per_layer(cell, sr.Cache(jnp.zeros(2)))
