"""The patterns of flax's NNX transforms guide, written in nnx and in statefulremat.

Each pattern builds the same parameters in both (the same keys, or arrays copied) and
checks the same numbers; then the misuse messages, and that a failed call changes
nothing.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import statefulremat as sr

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEYS = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(jax.random.key(1), (2, 3))


def close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def nnx_value(v):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return v.value


# -- 4. adding and deleting attributes inside a transform -----------------------------


def test_jit_adds_a_variable_and_a_sub_module_as_nnx_does():
  ours = sr.nn.Linear(3, 3, rngs=sr.Rngs(0))
  theirs = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
  close(ours.kernel.value, nnx_value(theirs.kernel))

  @sr.jit
  def step(m, x):
    y = m(x)
    m.h = sr.Intermediate(y)
    m.head = sr.nn.Linear(3, 1, rngs=sr.Rngs(1))
    return m.head(y)

  @nnx.jit
  def nnx_step(m, x):
    y = m(x)
    m.h = nnx.Intermediate(y)
    m.head = nnx.Linear(3, 1, rngs=nnx.Rngs(1))
    return m.head(y)

  close(step(ours, X), nnx_step(theirs, X))
  close(ours.h.value, nnx_value(theirs.h))
  close(ours.head.kernel.value, nnx_value(theirs.head.kernel))
  assert ours.h.path_str() == "h" and ours.head.kernel.path_str() == "head.kernel"
  # the next call sees the new structure; deleting is carried out too
  sr.jit(lambda m: delattr(m, "h"))(ours)
  assert not hasattr(ours, "h") and hasattr(ours, "head")


def test_a_structure_change_then_an_error_changes_nothing():
  model = sr.nn.Linear(3, 3, rngs=sr.Rngs(0))
  kernel = model.kernel.value

  def grow_then_fail(m, x):
    m.h = sr.Intermediate(m(x))
    del m.bias
    raise ValueError("boom")

  for transform in (sr.jit, sr.remat):
    with pytest.raises(ValueError, match="boom"):
      transform(grow_then_fail)(model, X)
    assert not hasattr(model, "h") and model.kernel.value is kernel
    assert model.bias.path_str() == "bias"


def test_remat_adds_a_variable():
  model = sr.nn.Linear(3, 3, rngs=sr.Rngs(0))

  def f(m, x):
    y = m(x)
    m.h = sr.Intermediate(y)
    return y.sum()

  sr.remat(f)(model, X)
  close(model.h.value, model(X))


class Layer(sr.Module):
  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    y = jnp.tanh(self.linear(x))
    self.h = sr.Intermediate(y)  # made in the first call: once per layer
    return y, None


class NnxLayer(nnx.Module):
  def __init__(self, *, rngs):
    self.linear = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


def nnx_layers():
  return [NnxLayer(rngs=nnx.Rngs(k)) for k in KEYS]


def test_scan_stacks_a_variable_made_per_iteration():
  stack = sr.vmap(lambda k: Layer(rngs=sr.Rngs(k)))(KEYS)
  layers = nnx_layers()
  close(stack.linear.kernel.value[2], nnx_value(layers[2].linear.kernel))
  y, _ = sr.scan(lambda m, c: m(c), variable_axes={True: 0})(stack, X)
  x, hs = X, []
  for layer in layers:
    x = layer(x)
    hs.append(x)
  close(y, x)
  assert stack.h.shape == (4, 2, 3) and len(sr.unstack(stack)) == 4
  close(stack.h.value, jnp.stack(hs))
  close(stack.layer(1).h.value, hs[1])


def test_vmap_stacks_a_variable_made_per_member():
  stack = sr.vmap(lambda k: Layer(rngs=sr.Rngs(k)))(KEYS)
  ys, _ = sr.vmap(lambda m, x: m(x), in_axes=None)(stack, X)
  layers = nnx_layers()
  close(ys, jnp.stack([layer(X) for layer in layers]))
  close(stack.h.value, ys)


# -- 7. class forms pass extra call arguments to every layer --------------------------


class PosBlock(sr.Module):
  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(3, 3, rngs=rngs)

  def __call__(self, x, position_ids, scale=1.0):
    return jnp.tanh(self.linear(x) + position_ids) * scale


class NnxPosBlock(nnx.Module):
  def __init__(self, *, rngs):
    self.linear = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x, position_ids, scale=1.0):
    return jnp.tanh(self.linear(x) + position_ids) * scale


def nnx_pos_loop(x, pos, scale=1.0):
  for k in KEYS:
    x = NnxPosBlock(rngs=nnx.Rngs(k))(x, pos, scale)
  return x


def copy_stack(stack):
  """Copies the nnx layers' weights (built from KEYS) into our stack."""
  kernels = jnp.stack([nnx_value(NnxPosBlock(rngs=nnx.Rngs(k)).linear.kernel) for k in KEYS])
  stack.linear.kernel.value = kernels
  stack.linear.bias.value = jnp.zeros_like(stack.linear.bias.value)


def test_remat_scan_broadcasts_extra_call_arguments():
  stack = sr.remat_scan(PosBlock, lengths=(2, 2))(rngs=sr.Rngs(0))
  copy_stack(stack)
  pos = jnp.arange(3.0)[None]
  close(stack(X, pos, scale=2.0), nnx_pos_loop(X, pos, 2.0))
  grad = sr.grad(lambda m: m(X, pos).sum())(stack)
  assert grad["linear"]["kernel"].shape == (4, 3, 3)


def test_scan_class_form_broadcasts_with_in_axes_none():
  def body(self, x, pos):
    return PosBlock.__call__(self, x, pos), None

  Cell = type("Cell", (PosBlock,), {"__call__": body})
  stack = sr.scan(
    Cell, length=4, variable_axes={True: 0}, split_rngs={"params": True}, in_axes=sr.broadcast
  )(rngs=sr.Rngs(0))
  copy_stack(stack)
  pos = jnp.arange(3.0)[None]
  y, _ = stack(X, pos)
  close(y, nnx_pos_loop(X, pos))


def test_vmap_class_form_maps_extra_call_arguments_by_in_axes():
  ens = sr.vmap(PosBlock, axis_size=4, in_axes=(None, 0))(rngs=sr.Rngs(0))
  copy_stack(ens)
  pos = jnp.arange(12.0).reshape(4, 1, 3)
  ys = ens(X, pos)
  expected = [NnxPosBlock(rngs=nnx.Rngs(k))(X, pos[i]) for i, k in enumerate(KEYS)]
  close(ys, jnp.stack(expected))


# -- 1. a vmapped function returning a module ----------------------------------------


def test_vmap_returning_a_module_is_a_stack():
  ours = sr.vmap(lambda key: sr.nn.Linear(3, 2, rngs=sr.Rngs(key)))(KEYS)
  theirs = nnx.vmap(lambda key: nnx.Linear(3, 2, rngs=nnx.Rngs(key)))(KEYS)
  assert ours.kernel.shape == (4, 3, 2) and len(ours) == 4
  close(ours.kernel.value, nnx_value(theirs.kernel))
  close(ours.layer(3).kernel.value, nnx_value(theirs.kernel)[3])
  ys = sr.vmap(lambda m, x: m(x), in_axes=None)(ours, X)
  close(ys, nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(theirs, X))
  # with in_axes and a broadcast argument
  made = sr.vmap(lambda d, key: sr.nn.Linear(3, d, rngs=sr.Rngs(key)), in_axes=(None, 0))(5, KEYS)
  assert made.kernel.shape == (4, 3, 5)


# -- 5. a write to a broadcast variable that does not depend on the mapped axis --------


class Count(sr.Variable):
  pass


class NnxCount(nnx.Variable):
  pass


def test_broadcast_counter_incremented_inside_vmap():
  kernel = jax.random.uniform(jax.random.key(0), (10, 2, 3))
  x = jax.random.normal(jax.random.key(1), (10, 2))

  class Weights(sr.Module):
    def __init__(self, kernel, bias, count):
      self.kernel, self.bias, self.count = sr.Param(kernel), sr.Param(bias), Count(count)

  class NnxWeights(nnx.Module):
    def __init__(self, kernel, bias, count):
      self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias)
      self.count = NnxCount(count)

  ours = Weights(kernel, jnp.zeros((10, 3)), jnp.array(0))
  theirs = NnxWeights(kernel, jnp.zeros((10, 3)), jnp.array(0))

  def dot(w, x):
    w.count.value += 1
    return x @ w.kernel.value + w.bias.value

  state_axes = nnx.StateAxes({nnx.Param: 0, NnxCount: None})
  expected = nnx.vmap(dot, in_axes=(state_axes, 0))(theirs, x)
  y = sr.vmap(dot, variable_axes={sr.Param: 0})(ours, x)
  close(y, expected)
  assert int(ours.count.value) == int(nnx_value(theirs.count)) == 1

  def varies(w, x):
    w.count.value += x.sum().astype(jnp.int32)
    return x

  with pytest.raises(
    sr.TransformError,
    match=r"sr\.vmap\(varies\): the function wrote to `count` \(Count, "
    r"collection 'count'\), which is not mapped.*depends on the "
    r"mapped axis.*Nothing was written.*Fix: map it with "
    r"`variable_axes=\{'count': 0\}`",
  ):
    sr.vmap(varies, variable_axes={sr.Param: 0})(ours, x)
  assert int(ours.count.value) == 1


# -- 3. a per-layer constructor argument in the class form -----------------------------


class Scaled(sr.Module):
  def __init__(self, scale, *, rngs):
    self.linear = sr.nn.Linear(3, 3, rngs=rngs)
    self.scale = sr.Param(scale * jnp.ones(3))

  def __call__(self, x):
    return jnp.tanh(self.linear(x) * self.scale.value[None]), None


def test_class_form_maps_a_constructor_argument_with_init_in_axes():
  scales = jnp.arange(1.0, 5.0)
  stack = sr.scan(
    Scaled, length=4, variable_axes={True: 0}, split_rngs={"params": True}, init_in_axes=(0,)
  )(scales, rngs=sr.Rngs(0))
  close(stack.scale.value[:, 0], scales)

  class NnxScaled(nnx.Module):
    def __init__(self, scale, rngs):
      self.linear = nnx.Linear(3, 3, rngs=rngs)
      self.scale = nnx.Param(scale * jnp.ones(3))

  theirs = nnx.vmap(lambda s, k: NnxScaled(s, nnx.Rngs(k)), in_axes=(0, 0))(scales, KEYS)
  stack.linear.kernel.value = nnx_value(theirs.linear.kernel)
  y, _ = stack(X)
  x = X
  for i in range(4):
    x = jnp.tanh((x @ nnx_value(theirs.linear.kernel)[i]) * scales[i])
  close(y, x)
  with pytest.raises(
    sr.TransformError,
    match=r"init_in_axes maps constructor argument 0 along axis 0, one "
    r"slice per layer, so it needs 4 entries there; it has shape "
    r"\(5,\)\. Fix",
  ):
    sr.scan(Scaled, length=4, variable_axes={True: 0}, init_in_axes=(0,))(
      jnp.ones(5), rngs=sr.Rngs(0)
    )
  with pytest.raises(
    TypeError,
    match=r"init_in_axes=\.\.\.\) maps the constructor "
    r"arguments of a Module class",
  ):
    sr.vmap(lambda m: m, init_in_axes=0)


# -- 2. sr.vmap on __init__ --------------------------------------------------------


def test_vmap_decorating_init_builds_a_stack_as_nnx():

  class MLP(sr.Module):
    @sr.vmap(in_axes=(0, 0))
    def __init__(self, rngs):
      self.linear = sr.nn.Linear(3, 3, rngs=rngs)
      self.bn = sr.nn.BatchNorm(3, rngs=rngs)

  class NnxMLP(nnx.Module):
    @nnx.vmap(in_axes=(0, 0))
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 3, rngs=rngs)
      self.bn = nnx.BatchNorm(3, rngs=rngs)

  ours, theirs = MLP(sr.Rngs(KEYS)), NnxMLP(nnx.Rngs(KEYS))
  assert ours.linear.kernel.shape == (4, 3, 3) and ours.bn.mean.shape == (4, 3)
  close(ours.linear.kernel.value, nnx_value(theirs.linear.kernel))
  assert ours.linear.kernel.path_str() == "linear.kernel"

  class Weights(sr.Module):
    @sr.vmap(in_axes=(None, 0, None))
    def __init__(self, seed, d):
      self.w = sr.Param(jax.random.uniform(jax.random.key(seed), (d,)))

  w = Weights(jnp.arange(3), 2)
  close(w.w.value[1], jax.random.uniform(jax.random.key(1), (2,)))


# -- 6. sr.Rngs from pre-split keys ----------------------------------------------


def test_rngs_of_split_keys_through_vmap():
  rngs = sr.Rngs(jax.random.split(jax.random.key(0), 4))

  class Block(sr.Module):
    def __init__(self, rngs):
      self.linear = sr.nn.Linear(3, 3, rngs=rngs)
      self.drop = sr.nn.Dropout(0.5, rngs=rngs)

  stack = sr.vmap(lambda r: Block(r))(rngs)
  theirs = nnx.vmap(lambda r: nnx.Linear(3, 3, rngs=r))(
    nnx.Rngs(jax.random.split(jax.random.key(0), 4))
  )
  close(stack.linear.kernel.value, nnx_value(theirs.kernel))
  assert stack.drop.rngs is rngs and rngs.default.count.shape == (4,)
  assert stack.linear.kernel.path_str() == "linear.kernel"
  counts = rngs.default.count.value
  with pytest.raises(
    ValueError,
    match=r"sr\.Rngs: the stream 'default' holds a key array "
    r"of shape \(4,\).*inside an sr\.vmap that maps it",
  ):
    rngs.params()
  assert rngs.default.count.value is counts
