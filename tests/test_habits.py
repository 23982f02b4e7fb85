"""Habits from PyTorch and flax.nnx get an error that shows the fix (or just work):
channels-first images, a key or seed as `rngs`, `opt.step()`, `opt.zero_grad()` and
nnx's `opt.update(model, grads)`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import statefulremat as sr

# -- Conv takes channels-last inputs ----------------------------------------------------


@pytest.mark.parametrize(
  "shape, kernel, channel, transpose, layout",
  [
    (
      (8, 3, 32, 32),
      (3, 3),
      1,
      r"x\.transpose\(0, 2, 3, 1\)",
      r"NHWC, as flax; not "
      r"PyTorch's NCHW",
    ),
    ((3, 32, 32), (3, 3), 0, r"x\.transpose\(1, 2, 0\)", "NHWC, as flax; not PyTorch's NCHW"),
    ((8, 3, 16), (3,), 1, r"x\.transpose\(0, 2, 1\)", "NWC, as flax; not PyTorch's NCW"),
  ],
  ids=["NCHW", "CHW", "NCW"],
)
def test_conv_channels_first_input_says_move_the_axis(shape, kernel, channel, transpose, layout):
  conv = sr.nn.Conv(3, 16, kernel, rngs=sr.Rngs(0))
  x = jnp.ones(shape)
  with pytest.raises(
    ValueError,
    match=rf"Conv takes channels-last inputs \({layout}\).*axis "
    rf"{channel} has the 3 channels \(channels-first\)\. Fix: move the "
    rf"channel axis last, `jnp\.moveaxis\(x, {channel}, -1\)` \(the same "
    rf"as `{transpose}`\)",
  ) as info:
    conv(x)
  assert "in_features=32" not in str(info.value)
  y = conv(jnp.moveaxis(x, channel, -1))  # the layer is unchanged and the fix works
  assert y.shape == jnp.moveaxis(x, channel, -1).shape[:-1] + (16,)


def test_conv_other_channel_mismatch_names_the_last_axis():
  conv = sr.nn.Conv(3, 16, (3, 3), rngs=sr.Rngs(0))
  with pytest.raises(
    ValueError,
    match=r"Conv was built with in_features=3 but got an input of shape "
    r"\(8, 5, 32, 32\): inputs are channels-last, \(\*batch, \*spatial, "
    r"channels\), so the last axis must have size 3\.",
  ):
    conv(jnp.ones((8, 5, 32, 32)))
  assert conv(jnp.ones((8, 32, 32, 3))).shape == (8, 32, 32, 16)


# -- rngs must be an sr.Rngs --------------------------------------------------------------


LAYERS = {
  "Linear": lambda rngs: sr.nn.Linear(2, 3, rngs=rngs),
  "LinearGeneral": lambda rngs: sr.nn.LinearGeneral(2, 3, rngs=rngs),
  "Conv": lambda rngs: sr.nn.Conv(2, 3, 3, rngs=rngs),
  "Embed": lambda rngs: sr.nn.Embed(4, 3, rngs=rngs),
  "BatchNorm": lambda rngs: sr.nn.BatchNorm(3, rngs=rngs),
  "LayerNorm": lambda rngs: sr.nn.LayerNorm(3, rngs=rngs),
  "RMSNorm": lambda rngs: sr.nn.RMSNorm(3, rngs=rngs),
  "MLP": lambda rngs: sr.nn.MLP(2, 4, rngs=rngs),
  "MultiHeadAttention": lambda rngs: sr.nn.MultiHeadAttention(2, 4, rngs=rngs),
  "Dropout": lambda rngs: sr.nn.Dropout(0.5, rngs=rngs),
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize(
  "bad, got, fix",
  [
    (lambda: jax.random.key(0), r"a JAX key \(key<fry>\[\]\)", r"sr\.Rngs\(key\)"),
    (lambda: jax.random.PRNGKey(0), r"a JAX key \(uint32\[2\]\)", r"sr\.Rngs\(key\)"),
    (lambda: 0, "the int 0", r"sr\.Rngs\(0\)"),
    (lambda: 7, "the int 7", r"sr\.Rngs\(7\)"),
  ],
  ids=["typed-key", "raw-key", "seed-0", "seed-7"],
)
def test_rngs_must_be_an_sr_rngs(layer, bad, got, fix):
  wanted = "an sr.Rngs, an sr.RngStream or None" if layer == "Dropout" else "an sr.Rngs"
  with pytest.raises(
    TypeError,
    match=rf"^{layer}: rngs must be {wanted}, got {got}\. "
    rf".*Fix: `rngs={fix}`\.$",
  ):
    LAYERS[layer](bad())
  LAYERS[layer](sr.Rngs(bad()))  # the fix works


@pytest.mark.parametrize("layer", sorted(set(LAYERS) - {"Dropout"}))
def test_rngs_none_or_another_object(layer):
  with pytest.raises(
    TypeError,
    match=rf"{layer}: rngs must be an sr.Rngs, got None\..*"
    r"Fix: `rngs=sr\.Rngs\(0\)`",
  ):
    LAYERS[layer](None)
  with pytest.raises(TypeError, match=rf"{layer}: rngs must be an sr.Rngs, got a str\."):
    LAYERS[layer]("params")


def test_rngs_check_is_one_helper():
  # Every layer reports through the one shared check (a change there reaches them all).
  import inspect

  from statefulremat.nn import _rngs_arg

  for layer in LAYERS:
    source = inspect.getsource(getattr(sr.nn, layer).__init__)
    assert f'check_rngs("{layer}", rngs' in source, layer
    assert "rngs must be" not in source, layer
  assert "rngs must be" in inspect.getsource(_rngs_arg)


# -- Optimizer: PyTorch's step()/zero_grad(), nnx's update(model, grads) -----------------


class Net(sr.Module):
  def __init__(self, *, rngs):
    self.l1 = sr.nn.Linear(3, 4, rngs=rngs)
    self.l2 = sr.nn.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


X = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
Y = jnp.linspace(0.0, 1.0, 10).reshape(5, 2)


def loss_fn(model, x, y):
  return ((model(x) - y) ** 2).mean()


def fresh():
  model = Net(rngs=sr.Rngs(0))
  return model, sr.Optimizer(model, optax.adam(0.05))


def assert_same(a, b):
  sa, sb = sr.state(a).flat(), sr.state(b).flat()
  assert list(sa) == list(sb)
  for path in sa:
    np.testing.assert_array_equal(np.asarray(sa[path]), np.asarray(sb[path]), err_msg=str(path))


def test_nnx_update_model_grads_equals_update_grads_eagerly():
  model_a, opt_a = fresh()
  model_b, opt_b = fresh()
  for _ in range(3):
    opt_a.update(sr.grad(loss_fn)(model_a, X, Y))
    opt_b.update(model_b, sr.grad(loss_fn)(model_b, X, Y))
  assert_same(opt_a, opt_b)
  assert int(opt_b.step.value) == 3


def test_nnx_update_model_grads_equals_update_grads_under_jit():
  @sr.jit
  def ours(model, opt, x, y):
    opt.update(sr.grad(loss_fn)(model, x, y))

  @sr.jit
  def nnx_style(model, opt, x, y):
    opt.update(model, sr.grad(loss_fn)(model, x, y))

  model_a, opt_a = fresh()
  model_b, opt_b = fresh()
  for _ in range(3):
    ours(model_a, opt_a, X, Y)
    nnx_style(model_b, opt_b, X, Y)
  assert_same(opt_a, opt_b)


def test_update_with_another_model_is_refused():
  model, opt = fresh()
  other = Net(rngs=sr.Rngs(0))
  grads = sr.grad(loss_fn)(other, X, Y)
  before = sr.state(opt).flat()
  with pytest.raises(
    ValueError,
    match=r"Optimizer.update\(model, grads\) got a model \(a Net\) that "
    r"is not the one this Optimizer updates \(opt.model, a Net\).*Fix: "
    r"call `opt.update\(grads\)` to update opt.model, or make an "
    r"optimizer for that model: `sr.Optimizer\(model, tx\)`",
  ):
    opt.update(other, grads)
  with pytest.raises(
    TypeError,
    match=r"got \(grads, model\): the model goes first\. "
    r"Fix: `opt.update\(model, grads\)`",
  ):
    opt.update(grads, model)
  with pytest.raises(
    TypeError,
    match=r"takes the gradients, got 3 arguments\. Fix: "
    r"`opt.update\(grads\)`",
  ):
    opt.update(model, grads, grads)
  after = sr.state(opt).flat()
  assert all(after[p] is v for p, v in before.items())  # nothing was written
  opt.update(grads)  # and it still works
  assert int(opt.step.value) == 1


def test_pytorch_step_points_to_update():
  model, opt = fresh()
  with pytest.raises(
    AttributeError,
    match=r"`step` is optimizer state .*read as `opt.step.value`\), not a "
    r"method: sr.Optimizer has no PyTorch-style step\(\)\. Fix: take the "
    r"gradients with `grads = sr.grad\(loss_fn\)\(model, \.\.\.\)` and "
    r"apply them with `opt.update\(grads\)`",
  ):
    opt.step()
  assert int(opt.step.value) == 0
  opt.update(sr.grad(loss_fn)(model, X, Y))
  assert int(opt.step.value) == 1


def test_pytorch_zero_grad_says_there_is_nothing_to_zero():
  model, opt = fresh()
  with pytest.raises(
    AttributeError,
    match=r"sr.Optimizer has no zero_grad\(\): there is nothing to zero "
    r"in JAX\..*Fix: delete the call",
  ):
    opt.zero_grad()
  assert not hasattr(opt, "zero_grad")
  opt.update(sr.grad(loss_fn)(model, X, Y))
  assert int(opt.step.value) == 1
