"""Issue 24, layers A: GroupNorm, InstanceNorm, ConvTranspose, Einsum, LoRA, PReLU,
pooling, activations and initializers against flax.nnx with the same weights, under a
stack, and the bad-input messages of every layer (new and existing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import pooling as linen_pooling

import statefulremat as sr

# -- helpers ----------------------------------------------------------------------------


def _randomize(theirs, seed=1):
  """Every nnx Param (LoRAParam too) set to random values, so zero-initialised
  adapters and ones-initialised scales test something."""
  state = nnx.state(theirs, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  nnx.update(theirs, jax.tree.map(lambda v: jax.random.normal(next(keys), v.shape, v.dtype), state))


def _flat(tree):
  if isinstance(tree, sr.State):
    return {k: np.asarray(v, np.float32) for k, v in tree.flat().items()}
  return {p: np.asarray(v[...], np.float32) for p, v in nnx.to_flat_state(tree)}


def _same(ours, theirs, *xs, call=lambda m, *xs: m(*xs), tol=1e-5):
  """Outputs, parameter gradients and input gradients of ``ours`` (weights copied
  from ``theirs``) equal nnx's. Each is compiled once: eagerly, every op of a gradient
  compiles on its own, which was half this file's time."""
  _randomize(theirs)
  sr.interop.from_nnx(ours, theirs)

  def loss_ours(m, *xs):
    return jnp.sum(jnp.sin(call(m, *xs).astype(jnp.float32)))

  def loss_theirs(m, *xs):
    return jnp.sum(jnp.sin(call(m, *xs).astype(jnp.float32)))

  y_ours, y_theirs = sr.jit(call)(ours, *xs), nnx.jit(call)(theirs, *xs)
  assert y_ours.shape == y_theirs.shape and y_ours.dtype == y_theirs.dtype
  np.testing.assert_allclose(
    np.asarray(y_ours, np.float32), np.asarray(y_theirs, np.float32), rtol=tol, atol=tol
  )
  g_ours = sr.jit(sr.grad(loss_ours))(ours, *xs)
  g_theirs = nnx.jit(nnx.grad(loss_theirs))(theirs, *xs)
  flat_ours, flat_theirs = _flat(g_ours), _flat(g_theirs)
  assert flat_ours.keys() == flat_theirs.keys()
  for k in flat_ours:
    np.testing.assert_allclose(flat_ours[k], flat_theirs[k], rtol=tol, atol=tol, err_msg=str(k))
  if jnp.issubdtype(xs[0].dtype, jnp.floating):
    gx_ours = jax.jit(jax.grad(lambda x: loss_ours(ours, x, *xs[1:])))(xs[0])
    gx_theirs = jax.jit(jax.grad(lambda x: loss_theirs(theirs, x, *xs[1:])))(xs[0])
    np.testing.assert_allclose(
      np.asarray(gx_ours, np.float32), np.asarray(gx_theirs, np.float32), rtol=tol, atol=tol
    )


def _x(*shape, dtype=jnp.float32, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


BF16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


class Holder(sr.Module):
  """Puts a layer at the path ``blocks[0]``."""

  def __init__(self, layer):
    self.blocks = [layer]


def _at(layer):
  return Holder(layer).blocks[0]


# -- GroupNorm / InstanceNorm -------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(num_groups=3),
    dict(num_groups=None, group_size=3),
    dict(num_groups=2, use_fast_variance=False),
    dict(num_groups=3, use_bias=False, epsilon=1e-3),
  ],
)
def test_group_norm_matches_nnx(kwargs):
  _same(
    sr.nn.GroupNorm(6, **kwargs, rngs=sr.Rngs(0)),
    nnx.GroupNorm(6, **kwargs, rngs=nnx.Rngs(0)),
    _x(2, 5, 6),
  )


def test_group_norm_bf16_and_mask_match_nnx():
  _same(
    sr.nn.GroupNorm(6, num_groups=3, **BF16, rngs=sr.Rngs(0)),
    nnx.GroupNorm(6, num_groups=3, **BF16, rngs=nnx.Rngs(0)),
    _x(2, 5, 6, dtype=jnp.bfloat16),
    tol=2e-2,
  )
  mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 5, 6))
  _same(
    sr.nn.GroupNorm(6, num_groups=3, rngs=sr.Rngs(0)),
    nnx.GroupNorm(6, num_groups=3, rngs=nnx.Rngs(0)),
    _x(2, 5, 6),
    call=lambda m, x: m(x, mask=mask),
  )


def test_group_norm_reduction_axes_per_position():
  # Statistics over the channels only: each (example, position) normalised per group.
  norm = sr.nn.GroupNorm(
    6, num_groups=3, reduction_axes=-1, use_scale=False, use_bias=False, rngs=sr.Rngs(0)
  )
  x = _x(2, 5, 6)
  groups = x.reshape(2, 5, 3, 2)
  want = (groups - groups.mean(-1, keepdims=True)) / jnp.sqrt(groups.var(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(norm(x), want.reshape(2, 5, 6), rtol=1e-4, atol=1e-4)


def test_group_norm_construction_errors():
  with pytest.raises(
    ValueError,
    match=r"num_groups=4 does not divide num_features=6\. "
    r"Fix: a num_groups among the divisors of 6",
  ):
    sr.nn.GroupNorm(6, num_groups=4, rngs=sr.Rngs(0))
  with pytest.raises(
    ValueError,
    match=r"exactly one of num_groups and group_size.*"
    r"`num_groups=None, group_size=\.\.\.`",
  ):
    sr.nn.GroupNorm(6, group_size=2, rngs=sr.Rngs(0))
  with pytest.raises(ValueError, match=r"group_size=4 does not divide num_features=6"):
    sr.nn.GroupNorm(6, num_groups=None, group_size=4, rngs=sr.Rngs(0))


@pytest.mark.parametrize(
  "kwargs", [{}, dict(feature_axes=(1, -1)), dict(use_fast_variance=False, use_scale=False)]
)
def test_instance_norm_matches_nnx(kwargs):
  n = 12 if "feature_axes" in kwargs else 4
  _same(
    sr.nn.InstanceNorm(n, **kwargs, rngs=sr.Rngs(0)),
    nnx.InstanceNorm(n, **kwargs, rngs=nnx.Rngs(0)),
    _x(2, 3, 5, 4),
  )


def test_instance_norm_bf16_matches_nnx():
  _same(
    sr.nn.InstanceNorm(4, **BF16, rngs=sr.Rngs(0)),
    nnx.InstanceNorm(4, **BF16, rngs=nnx.Rngs(0)),
    _x(2, 5, 4, dtype=jnp.bfloat16),
    tol=2e-2,
  )


# -- ConvTranspose ------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(kernel_size=(3, 3), strides=2),
    dict(kernel_size=(3, 3), strides=2, padding="VALID"),
    dict(kernel_size=(3, 3), strides=(2, 1), padding="CIRCULAR"),
    dict(kernel_size=(2, 3), strides=2, padding="CIRCULAR", transpose_kernel=True),
    dict(kernel_size=(3, 3), padding=((1, 2), (0, 1)), kernel_dilation=2),
    dict(kernel_size=(3, 3), strides=2, transpose_kernel=True, use_bias=False),
  ],
)
def test_conv_transpose_matches_nnx(kwargs):
  _same(
    sr.nn.ConvTranspose(3, 4, **kwargs, rngs=sr.Rngs(0)),
    nnx.ConvTranspose(3, 4, **kwargs, rngs=nnx.Rngs(0)),
    _x(2, 5, 4, 3),
  )


def test_conv_transpose_1d_batchless_multibatch_and_bf16():
  for x in (_x(7, 3), _x(2, 3, 7, 3)):
    _same(
      sr.nn.ConvTranspose(3, 2, 4, strides=3, rngs=sr.Rngs(0)),
      nnx.ConvTranspose(3, 2, 4, strides=3, rngs=nnx.Rngs(0)),
      x,
    )
  _same(
    sr.nn.ConvTranspose(3, 4, (3, 3), strides=2, **BF16, rngs=sr.Rngs(0)),
    nnx.ConvTranspose(3, 4, (3, 3), strides=2, **BF16, rngs=nnx.Rngs(0)),
    _x(2, 5, 4, 3, dtype=jnp.bfloat16),
    tol=5e-2,
  )


def test_conv_transpose_kernel_shapes_and_bad_padding():
  assert sr.nn.ConvTranspose(3, 4, (2, 5), rngs=sr.Rngs(0)).kernel.shape == (2, 5, 3, 4)
  assert sr.nn.ConvTranspose(3, 4, (2, 5), transpose_kernel=True, rngs=sr.Rngs(0)).kernel.shape == (
    2,
    5,
    4,
    3,
  )
  with pytest.raises(ValueError, match=r"padding='REFLECT' is not supported; use 'SAME'"):
    sr.nn.ConvTranspose(3, 4, 3, padding="REFLECT", rngs=sr.Rngs(0))


# -- Einsum -------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "args,shape",
  [
    (("btd,dnh->btnh", (8, 2, 4), (2, 4)), (3, 5, 8)),
    (("...d,dh->...h", (8, 4), (4,)), (2, 3, 5, 8)),
    (("bd,d...->b...", (8, 2, 3), (2, 3)), (4, 8)),
    (("btnh,nhd->btd", (2, 4, 8), None), (3, 5, 2, 4)),
  ],
)
def test_einsum_matches_nnx(args, shape):
  _same(sr.nn.Einsum(*args, rngs=sr.Rngs(0)), nnx.Einsum(*args, rngs=nnx.Rngs(0)), _x(*shape))


def test_einsum_call_string_and_bf16_match_nnx():
  args = ("btd,dnh->btnh", (8, 2, 4), (2, 4))
  _same(
    sr.nn.Einsum(*args, **BF16, rngs=sr.Rngs(0)),
    nnx.Einsum(*args, **BF16, rngs=nnx.Rngs(0)),
    _x(3, 5, 8, dtype=jnp.bfloat16),
    tol=5e-2,
  )
  _same(
    sr.nn.Einsum(*args, rngs=sr.Rngs(0)),
    nnx.Einsum(*args, rngs=nnx.Rngs(0)),
    _x(3, 5, 8),
    call=lambda m, x: m(x, "btd,dnh->btnh"),
  )


def test_einsum_str_errors():
  with pytest.raises(ValueError, match=r"must be explicit, with '->'"):
    sr.nn.Einsum("bd,dh", (8, 4), rngs=sr.Rngs(0))
  with pytest.raises(ValueError, match=r"exactly two operands, the input and the kernel"):
    sr.nn.Einsum("bd,dh,h->bh", (8, 4), rngs=sr.Rngs(0))
  with pytest.raises(
    ValueError,
    match=r"names 3 kernel axes \('dnh'\) but "
    r"kernel_shape=\(8, 4\) has 2\. Fix: one kernel_shape entry",
  ):
    sr.nn.Einsum("btd,dnh->btnh", (8, 4), rngs=sr.Rngs(0))


# -- LoRA ---------------------------------------------------------------------------------


def test_lora_matches_nnx():
  _same(sr.nn.LoRA(3, 2, 4, rngs=sr.Rngs(0)), nnx.LoRA(3, 2, 4, rngs=nnx.Rngs(0)), _x(5, 3))
  _same(
    sr.nn.LoRA(3, 2, 4, base_module=sr.nn.Linear(3, 4, rngs=sr.Rngs(1)), rngs=sr.Rngs(0)),
    nnx.LoRA(3, 2, 4, base_module=nnx.Linear(3, 4, rngs=nnx.Rngs(1)), rngs=nnx.Rngs(0)),
    _x(5, 3),
  )
  _same(
    sr.nn.LoRA(3, 2, 4, **BF16, rngs=sr.Rngs(0)),
    nnx.LoRA(3, 2, 4, **BF16, rngs=nnx.Rngs(0)),
    _x(5, 3, dtype=jnp.bfloat16),
    tol=5e-2,
  )


def test_lora_linear_matches_nnx_and_filters_pick_adapters():
  ours = sr.nn.LoRALinear(3, 4, lora_rank=2, rngs=sr.Rngs(0))
  theirs = nnx.LoRALinear(3, 4, lora_rank=2, rngs=nnx.Rngs(0))
  _same(ours, theirs, _x(5, 3))
  assert isinstance(ours.lora.lora_a, sr.nn.LoRAParam)
  assert isinstance(ours.lora.lora_a, sr.Param)
  assert sorted(sr.state(ours, sr.nn.LoRAParam).flat()) == [("lora", "lora_a"), ("lora", "lora_b")]
  grads = sr.grad(lambda m, x: m(x).sum(), wrt=sr.nn.LoRAParam)(ours, _x(5, 3))
  assert sorted(grads.flat()) == [("lora", "lora_a"), ("lora", "lora_b")]
  # Same initial values as nnx, key for key: b is zero, a is he_uniform.
  fresh = sr.nn.LoRALinear(3, 4, lora_rank=2, rngs=sr.Rngs(0))
  assert not fresh.lora.lora_b.value.any()
  assert fresh.lora.lora_a.shape == (3, 2)


def test_lora_bad_base_module():
  with pytest.raises(
    TypeError,
    match=r"base_module must be callable.*got a int.*"
    r"base_module=None",
  ):
    sr.nn.LoRA(3, 2, 4, base_module=3, rngs=sr.Rngs(0))


# -- PReLU, activations, initializers -----------------------------------------------------


def test_prelu_matches_nnx():
  _same(sr.nn.PReLU(), nnx.PReLU(), _x(4, 3))
  _same(
    sr.nn.PReLU(0.2, dtype=jnp.bfloat16), nnx.PReLU(0.2, dtype=jnp.bfloat16), _x(4, 3), tol=2e-2
  )


def test_activations_are_nnx_functions():
  from flax.nnx.nn import activations

  names = [n for n in activations.__all__ if n != "PReLU"]
  assert len(names) >= 25
  for name in names:
    assert getattr(sr.nn, name) is getattr(nnx, name), name


def test_initializers_are_nnx_set():
  # Lowercase: the initialisers, not the type aliases (Initializer, DtypeLikeInexact).
  public = [
    n for n in dir(nnx.initializers) if n[0].islower() and callable(getattr(nnx.initializers, n))
  ]
  assert {"zeros_init", "ones_init", "lecun_normal", "normal", "he_uniform"} <= set(public)
  for name in public:
    ours, theirs = getattr(sr.nn.initializers, name), getattr(nnx.initializers, name)
    if name.endswith("_init"):
      key = jax.random.key(0)
      np.testing.assert_array_equal(
        ours()(key, (2, 3), jnp.float32), theirs()(key, (2, 3), jnp.float32)
      )
    else:
      assert ours is theirs, name


# -- pooling ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["avg_pool", "max_pool", "min_pool"])
@pytest.mark.parametrize(
  "shape,window,kwargs",
  [
    ((2, 6, 6, 3), (2, 2), dict(strides=(2, 2))),
    ((2, 7, 5, 3), (3, 2), dict(strides=(2, 1), padding="SAME")),
    ((7, 3), (3,), dict(padding=((1, 2),))),
    ((2, 2, 6, 3), (2,), dict(padding="SAME")),
  ],
)
def test_pooling_matches_flax(name, shape, window, kwargs):
  x = _x(*shape)
  ours, theirs = getattr(sr.nn, name), getattr(linen_pooling, name)
  np.testing.assert_allclose(ours(x, window, **kwargs), theirs(x, window, **kwargs), rtol=1e-6)
  g = jax.grad(lambda x, f: jnp.sum(jnp.sin(f(x, window, **kwargs))), argnums=0)
  np.testing.assert_allclose(g(x, ours), g(x, theirs), rtol=1e-6)


@pytest.mark.parametrize("padding", ["SAME", ((1, 1), (0, 2))])
def test_avg_pool_count_include_pad_matches_flax(padding):
  x = _x(2, 5, 4, 3).astype(jnp.bfloat16)
  for include in (True, False):
    ours = sr.nn.avg_pool(x, (3, 3), (2, 1), padding, count_include_pad=include)
    theirs = linen_pooling.avg_pool(x, (3, 3), (2, 1), padding, count_include_pad=include)
    assert ours.dtype == theirs.dtype
    np.testing.assert_allclose(
      np.asarray(ours, np.float32), np.asarray(theirs, np.float32), rtol=1e-2
    )


def test_pooling_errors():
  x = _x(2, 6, 6, 3)
  with pytest.raises(
    TypeError,
    match=r"max_pool: window_shape must be a tuple of ints.*"
    r"`window_shape=\(2, 2\)`",
  ):
    sr.nn.max_pool(x, 2)
  with pytest.raises(
    ValueError,
    match=r"avg_pool: strides=\(2,\) has 1 entries but "
    r"window_shape=\(2, 2\) has 2",
  ):
    sr.nn.avg_pool(x, (2, 2), strides=(2,))
  with pytest.raises(
    ValueError,
    match=r"min_pool: window_shape=\(2, 2\) pools 2 axes, so "
    r"inputs must be \(\*batch, s0, s1, features\), of rank at least 3, but "
    r"got an input of shape \(6, 6\)",
  ):
    sr.nn.min_pool(x[0, :, :, 0], (2, 2))
  with pytest.raises(ValueError, match=r"padding=\(\(1, 1\),\) must be 'SAME', 'VALID' or 2"):
    sr.nn.max_pool(x, (2, 2), padding=((1, 1),))
  with pytest.raises(
    TypeError,
    match=r"max_pool: inputs must be floating point .* dtype "
    r"int32 and shape \(2, 6, 6, 3\)\. Fix: `x.astype\(jnp.float32\)`",
  ):
    sr.nn.max_pool(x.astype(jnp.int32), (2, 2))


# -- under a stack ------------------------------------------------------------------------


@pytest.mark.parametrize(
  "make,shape",
  [
    (
      lambda: sr.vmap(sr.nn.GroupNorm, axis_size=3, in_axes=None)(6, num_groups=2, rngs=sr.Rngs(0)),
      (2, 5, 6),
    ),
    (
      lambda: sr.vmap(sr.nn.InstanceNorm, axis_size=3, in_axes=None)(4, rngs=sr.Rngs(0)),
      (2, 5, 4),
    ),
    (
      lambda: sr.vmap(sr.nn.ConvTranspose, axis_size=3, in_axes=None)(
        3, 4, (3, 3), strides=2, padding="CIRCULAR", rngs=sr.Rngs(0)
      ),
      (2, 4, 4, 3),
    ),
    (
      lambda: sr.vmap(sr.nn.Einsum, axis_size=3, in_axes=None)(
        "btd,dnh->btnh", (8, 2, 4), (2, 4), rngs=sr.Rngs(0)
      ),
      (2, 5, 8),
    ),
    (
      lambda: sr.vmap(sr.nn.LoRALinear, axis_size=3, in_axes=None)(
        3, 4, lora_rank=2, rngs=sr.Rngs(0)
      ),
      (5, 3),
    ),
  ],
)
def test_stacked_layers_compute_each_layer(make, shape):
  stack, x = make(), _x(*shape)
  params = sr.state(stack, sr.Param)
  # Random values: zero adapters and unit scales would hide a mix-up of layers.
  keys = iter(jax.random.split(jax.random.key(7), 16))
  sr.update(stack, jax.tree.map(lambda v: jax.random.normal(next(keys), v.shape), params))
  y = stack(x)
  assert y.shape[0] == 3
  for i in range(3):
    np.testing.assert_allclose(y[i], stack.layer(i)(x), rtol=1e-5, atol=1e-5)
  grads = sr.grad(lambda m, x: jnp.sum(jnp.sin(m(x))))(stack, x)
  assert all(np.isfinite(v).all() and v.shape[0] == 3 for v in grads.flat().values())


def test_scan_stack_of_lora_linear():
  class Block(sr.Module):
    def __init__(self, rngs):
      self.lin = sr.nn.LoRALinear(4, 4, lora_rank=2, rngs=rngs)
      self.norm = sr.nn.GroupNorm(4, num_groups=2, rngs=rngs)

    def __call__(self, x):
      return self.norm(jnp.tanh(self.lin(x)))

  stack = sr.vmap(Block, axis_size=3, in_axes=None)(rngs=sr.Rngs(0))
  x = _x(2, 4)

  @sr.scan(variable_axes={sr.Param: 0})
  def run(layer, x):
    return layer(x), None

  y, _ = run(stack, x)
  want = x
  for i in range(3):
    want = stack.layer(i)(want)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


# -- bad inputs: path and expected shape --------------------------------------------------


def _raises(layer, x, pattern, exc=ValueError):
  """Raises with ``pattern`` (after the path) at ``blocks[0]``; under sr.jit too, the
  layer's state unchanged."""
  holder = Holder(layer)
  before = {k: np.asarray(v) for k, v in sr.state(holder).flat().items()}
  full = r"^At `blocks\[0\]`: " + pattern
  with pytest.raises(exc, match=full):
    holder.blocks[0](x)
  with pytest.raises(exc, match=full):
    sr.jit(lambda m, x: m.blocks[0](x))(holder, x)
  after = sr.state(holder).flat()
  assert before.keys() == after.keys()
  for k in before:
    np.testing.assert_array_equal(before[k], after[k])


def test_linear_bad_input_names_path_and_shape():
  _raises(
    sr.nn.Linear(4, 2, rngs=sr.Rngs(0)),
    jnp.ones((3, 5)),
    r"Linear was built with in_features=4 but got an input of shape \(3, 5\); "
    r"expected shape \(3, 4\) \(axis -1 must have size 4\)\. Fix the input, or "
    r"build the layer with in_features=5\.",
  )
  _raises(
    sr.nn.LoRALinear(4, 2, lora_rank=1, rngs=sr.Rngs(0)),
    jnp.ones((5,)),
    r"LoRALinear was built with in_features=4 .* expected shape \(4,\)",
  )
  _raises(
    sr.nn.LoRA(4, 1, 2, rngs=sr.Rngs(0)),
    jnp.ones((2, 3)),
    r"LoRA was built with in_features=4 .* expected shape \(2, 4\)",
  )


def test_conv_bad_input_names_path_and_shape():
  conv = sr.nn.Conv(3, 4, (3, 3), rngs=sr.Rngs(0))
  _raises(
    conv,
    jnp.ones((2, 8, 8, 5)),
    r"Conv was built with in_features=3 but got an input of shape \(2, 8, 8, 5\).*"
    r"Expected shape: \(2, 8, 8, 3\)\. Fix the input, or build the layer with "
    r"in_features=5\.",
  )
  _raises(
    conv,
    jnp.ones((8, 3)),
    r"Conv with kernel_size=\(3, 3\) needs inputs of shape \(\*batch, s0, s1, 3\), "
    r"channels-last, of rank at least 3, but got one of shape \(8, 3\)\. Fix: add",
  )
  _raises(conv, jnp.ones((2, 3, 8, 8)), r"Conv takes channels-last inputs \(NHWC")
  _raises(
    sr.nn.ConvTranspose(3, 4, (3, 3), rngs=sr.Rngs(0)),
    jnp.ones((2, 8, 8, 5)),
    r"ConvTranspose was built with in_features=3 .* Expected shape: \(2, 8, 8, 3\)",
  )


def test_embed_bad_input_names_path_and_dtype():
  embed = sr.nn.Embed(10, 4, rngs=sr.Rngs(0))
  _raises(
    embed,
    jnp.ones((2, 3)),
    r"Embed takes integer ids, got an input of dtype float32 and shape \(2, 3\); "
    r"expected an integer array .* \+ \(4,\)\)\. Fix: cast the ids",
  )
  with pytest.raises(
    ValueError,
    match=r"^At `blocks\[0\]`: Embed.attend was built with "
    r"features=4 .* expected shape \(2, 4\)",
  ):
    _at(embed).attend(jnp.ones((2, 5)))


@pytest.mark.parametrize(
  "make,name",
  [
    (lambda: sr.nn.LayerNorm(4, rngs=sr.Rngs(0)), "LayerNorm"),
    (lambda: sr.nn.RMSNorm(4, rngs=sr.Rngs(0)), "RMSNorm"),
    (lambda: sr.nn.BatchNorm(4, rngs=sr.Rngs(0)), "BatchNorm"),
    (lambda: sr.nn.GroupNorm(4, num_groups=2, rngs=sr.Rngs(0)), "GroupNorm"),
    (lambda: sr.nn.InstanceNorm(4, rngs=sr.Rngs(0)), "InstanceNorm"),
  ],
)
def test_norm_bad_feature_size_names_path_and_shape(make, name):
  # BatchNorm in training mode: its running averages must be left as they were.
  axes = "axis" if name == "BatchNorm" else "feature_axes"
  _raises(
    make(),
    jnp.ones((2, 3, 5)),
    rf"{name} was built with num_features=4 but the input of shape \(2, 3, 5\) has "
    rf"5 features on {axes}=-1; expected shape \(2, 3, 4\)\. Fix the input, or "
    r"build the layer with num_features=5\.",
  )


def test_norm_other_bad_inputs():
  _raises(
    sr.nn.LayerNorm(4, feature_axes=-3, rngs=sr.Rngs(0)),
    jnp.ones((2, 4)),
    r"LayerNorm: feature_axes=-3 is out of range for an input of shape \(2, 4\) "
    r"\(rank 2\)",
  )
  _raises(
    sr.nn.GroupNorm(4, num_groups=2, rngs=sr.Rngs(0)),
    jnp.ones((4,)),
    r"GroupNorm takes inputs of shape \(batch, \.\.\., 4\), rank at least 2 .*"
    r"Fix: add the batch axis",
  )
  _raises(
    sr.nn.InstanceNorm(4, feature_axes=0, rngs=sr.Rngs(0)),
    jnp.ones((4, 3)),
    r"InstanceNorm: feature_axes=0 includes axis 0 .* Fix: add a batch axis",
  )


def test_einsum_bad_input_names_path_and_shape():
  layer = sr.nn.Einsum("btd,dnh->btnh", (8, 2, 4), (2, 4), rngs=sr.Rngs(0))
  _raises(
    layer,
    jnp.ones((3, 5, 7)),
    r"Einsum 'btd,dnh->btnh' with a kernel of shape \(8, 2, 4\) got an input of "
    r"shape \(3, 5, 7\); expected shape \(3, 5, 8\)",
  )
  _raises(layer, jnp.ones((5, 8)), r"Einsum .* expected shape \(b, t, 8\)")


def test_layer_without_path_has_plain_message():
  with pytest.raises(ValueError, match=r"^Linear was built with in_features=4"):
    sr.nn.Linear(4, 2, rngs=sr.Rngs(0))(jnp.ones((3, 5)))
