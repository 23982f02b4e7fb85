"""Issue 24: sr.nn.SpectralNorm and sr.nn.WeightNorm against flax.nnx 0.12 with the same
weights (outputs, gradients, power-iteration state), their modes, under sr.jit and in
stacks, sr.interop both ways, and the bad inputs.

nnx 0.12 writes the normalised weights back into the wrapped layer's Params (flax
issue #5576); ours keep the weights being trained. Where a comparison spans several
calls, nnx's kernel is put back after each call so both normalise the same weights.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import statefulremat as sr

TOL = dict(rtol=1e-5, atol=1e-5)


# -- helpers ---------------------------------------------------------------------------


def _x(*shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _randomize(theirs, seed=1):
  """nnx's Params and WeightNorm's scales (plain arrays in nnx) set to random values."""
  keys = iter(jax.random.split(jax.random.key(seed), 32))
  state = nnx.state(theirs, nnx.Param)
  nnx.update(theirs, jax.tree.map(lambda v: jax.random.normal(next(keys), v.shape, v.dtype), state))
  if getattr(theirs, "scales", None):
    for path in list(theirs.scales):
      theirs.scales[path] = 1.0 + 0.3 * jax.random.normal(next(keys), theirs.scales[path].shape)


def _nnx_value_and_grads(theirs, x, **kwargs):
  """nnx's output and the gradients of every array of its state (its scales too, which
  nnx keeps outside Params), computed on a merged copy so ``theirs`` is untouched."""
  graphdef, state = nnx.split(theirs)

  def loss(state, x):
    y = nnx.merge(graphdef, state)(x, **kwargs)
    return jnp.sum(jnp.sin(y)), y

  # Compiled, one program: eagerly every op of a gradient compiles on its own.
  (_, y), (grads, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)
  flat = {
    p: np.asarray(v[...] if isinstance(v, nnx.Variable) else v) for p, v in nnx.to_flat_state(grads)
  }
  return y, flat, gx


def _our_value_and_grads(ours, x, **kwargs):
  """Ours, the same way: gradients of the Params (sr.grad on a clone) and of ``x``."""
  model = sr.clone(ours)

  def loss(m, x):
    return jnp.sum(jnp.sin(m(x, **kwargs)))

  grads = sr.jit(sr.grad(loss))(sr.clone(ours), x)
  graphdef, state = sr.split(model)
  gx = jax.jit(jax.grad(lambda x: loss(sr.merge(graphdef, state), x)))(x)
  y = sr.jit(lambda m, x: m(x, **kwargs))(model, x)
  return y, {k: np.asarray(v) for k, v in grads.flat().items()}, gx


def _same(ours, theirs, x, **kwargs):
  """Weights copied from ``theirs``: outputs, parameter and input gradients equal."""
  _randomize(theirs)
  sr.interop.from_nnx(ours, theirs)
  y_t, g_t, gx_t = _nnx_value_and_grads(theirs, x, **kwargs)
  y_o, g_o, gx_o = _our_value_and_grads(ours, x, **kwargs)
  assert y_o.shape == y_t.shape and y_o.dtype == y_t.dtype
  np.testing.assert_allclose(y_o, y_t, **TOL)
  np.testing.assert_allclose(gx_o, gx_t, **TOL)
  params = {p for p in g_o}
  assert params and params <= set(g_t), (params, set(g_t))
  for p in params:
    np.testing.assert_allclose(g_o[p], g_t[p], err_msg=str(p), **TOL)
  assert any(np.abs(g).max() > 0 for g in g_o.values())
  return params


def _state(model):
  return {k: np.asarray(v) for k, v in sr.state(model).flat().items()}


def _assert_state(model, before):
  after = _state(model)
  assert after.keys() == before.keys()
  for k in before:
    np.testing.assert_array_equal(after[k], before[k], err_msg=str(k))


class Holder(sr.Module):
  """Puts a layer at the path ``blocks[0]``."""

  def __init__(self, layer):
    self.blocks = [layer]

  def __call__(self, x, **kwargs):
    return self.blocks[0](x, **kwargs)


# -- against nnx: outputs and gradients ------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"n_steps": 3}, {"update_stats": False}])
def test_spectral_norm_linear_matches_nnx(kwargs):
  theirs = nnx.SpectralNorm(nnx.Linear(4, 5, rngs=nnx.Rngs(0)), **kwargs, rngs=nnx.Rngs(1))
  ours = sr.nn.SpectralNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), **kwargs, rngs=sr.Rngs(1))
  params = _same(ours, theirs, _x(3, 4))
  assert params == {("layer_instance", "kernel"), ("layer_instance", "bias")}


def test_spectral_norm_conv_matches_nnx():
  # A (3, 3, 2, 4) kernel is normalised as the (18, 4) matrix, as nnx does.
  theirs = nnx.SpectralNorm(nnx.Conv(2, 4, (3, 3), rngs=nnx.Rngs(0)), n_steps=2, rngs=nnx.Rngs(1))
  ours = sr.nn.SpectralNorm(sr.nn.Conv(2, 4, (3, 3), rngs=sr.Rngs(0)), n_steps=2, rngs=sr.Rngs(1))
  assert ours.batch_stats["kernel", "u"].shape == (1, 4)
  _same(ours, theirs, _x(2, 6, 6, 2))


def test_spectral_norm_dtype_matches_nnx():
  make = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
  theirs = nnx.SpectralNorm(nnx.Linear(4, 5, rngs=nnx.Rngs(0)), **make, rngs=nnx.Rngs(1))
  ours = sr.nn.SpectralNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), **make, rngs=sr.Rngs(1))
  _randomize(theirs)
  sr.interop.from_nnx(ours, theirs)
  call = lambda m, x: m(x)  # noqa: E731
  y_o, y_t = sr.jit(call)(ours, _x(3, 4)), nnx.jit(call)(theirs, _x(3, 4))
  assert y_o.dtype == y_t.dtype == jnp.float32  # bf16 kernel, promoted by Linear
  np.testing.assert_allclose(y_o, y_t, **TOL)
  np.testing.assert_allclose(
    ours.batch_stats["kernel", "sigma"].value, theirs.batch_stats["kernel", "sigma"][...], **TOL
  )


@pytest.mark.parametrize("feature_axes", [-1, None, (0, -1)])
def test_weight_norm_conv_matches_nnx(feature_axes):
  theirs = nnx.WeightNorm(
    nnx.Conv(2, 4, (3, 3), rngs=nnx.Rngs(0)), feature_axes=feature_axes, rngs=nnx.Rngs(1)
  )
  ours = sr.nn.WeightNorm(
    sr.nn.Conv(2, 4, (3, 3), rngs=sr.Rngs(0)), feature_axes=feature_axes, rngs=sr.Rngs(1)
  )
  params = _same(ours, theirs, _x(2, 6, 6, 2))
  # The scales are trained here (nnx keeps them as plain arrays, flax issue #5577).
  assert ("scales", ("kernel",)) in params


def test_weight_norm_linear_matches_nnx():
  theirs = nnx.WeightNorm(nnx.Linear(4, 5, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
  ours = sr.nn.WeightNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), rngs=sr.Rngs(1))
  assert _same(ours, theirs, _x(3, 4)) == {
    ("layer_instance", "kernel"),
    ("layer_instance", "bias"),
    ("scales", ("kernel",)),
  }


def test_weight_norm_without_scale_and_with_a_filter_matches_nnx():
  class Pair(sr.Module):
    def __init__(self, rngs):
      self.a = sr.nn.Linear(4, 4, rngs=rngs)
      self.b = sr.nn.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  class TheirPair(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(4, 4, rngs=rngs)
      self.b = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  only_b = lambda path, v: path[0] == "b" and path[-1] == "kernel"  # noqa: E731
  theirs = nnx.WeightNorm(
    TheirPair(nnx.Rngs(0)), use_scale=False, variable_filter=only_b, rngs=nnx.Rngs(1)
  )
  ours = sr.nn.WeightNorm(
    Pair(sr.Rngs(0)), use_scale=False, variable_filter=only_b, rngs=sr.Rngs(1)
  )
  assert ours.scales is None
  _same(ours, theirs, _x(3, 4))


# -- the power-iteration state and the modes -------------------------------------------


def test_spectral_norm_state_over_calls_matches_nnx():
  theirs = nnx.SpectralNorm(nnx.Linear(6, 5, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
  plain = nnx.SpectralNorm(nnx.Linear(6, 5, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
  ours = sr.nn.SpectralNorm(sr.nn.Linear(6, 5, rngs=sr.Rngs(0)), rngs=sr.Rngs(1))
  _randomize(theirs)
  nnx.update(plain, nnx.state(theirs))
  sr.interop.from_nnx(ours, theirs)
  kernel = ours.layer_instance.kernel.value
  # Each side compiled once, outside the loops: one program instead of op by op.
  call, their_call = sr.jit(lambda m, x: m(x)), nnx.jit(lambda m, x: m(x))
  for step in range(4):
    x = _x(3, 6, seed=step)
    y_o, y_t = call(ours, x), their_call(theirs, x)
    their_call(plain, x)
    theirs.layer_instance.kernel[...] = kernel  # undo nnx's write-back (#5576)
    np.testing.assert_allclose(y_o, y_t, **TOL)
    for name in ("u", "sigma"):
      np.testing.assert_allclose(
        ours.batch_stats["kernel", name].value, theirs.batch_stats["kernel", name][...], **TOL
      )
    # u is a direction, so even nnx's rescaled kernel gives the same one.
    np.testing.assert_allclose(
      ours.batch_stats["kernel", "u"].value, plain.batch_stats["kernel", "u"][...], **TOL
    )
  assert ours.layer_instance.kernel.value is kernel  # the trained weight stays
  # The estimate converges to the largest singular value of the stored kernel.
  for _ in range(30):
    call(ours, x)
  np.testing.assert_allclose(
    ours.batch_stats["kernel", "sigma"].value, np.linalg.norm(np.asarray(kernel), 2), rtol=1e-4
  )


def test_spectral_norm_modes():
  ours = sr.nn.SpectralNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), rngs=sr.Rngs(1))
  x = _x(2, 4)
  model = Holder(ours)
  assert ours.use_running_average is False
  model.eval()
  assert ours.use_running_average is True
  before = _state(model)
  y = model(x)
  _assert_state(model, before)  # eval: nothing updated
  np.testing.assert_allclose(model(x), y, **TOL)  # ... so calls repeat exactly
  model(x, update_stats=True)  # the call argument wins over the mode
  assert not np.array_equal(
    _state(model)[("blocks", 0, "batch_stats", ("kernel", "u"))],
    before[("blocks", 0, "batch_stats", ("kernel", "u"))],
  )
  model.train()
  before = _state(model)
  model(x, update_stats=False)
  _assert_state(model, before)
  model(x)
  assert not np.array_equal(
    _state(model)[("blocks", 0, "batch_stats", ("kernel", "u"))],
    before[("blocks", 0, "batch_stats", ("kernel", "u"))],
  )
  frozen = sr.nn.SpectralNorm(
    sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), update_stats=False, rngs=sr.Rngs(1)
  )
  assert frozen.use_running_average is True
  theirs = nnx.SpectralNorm(
    nnx.Linear(4, 5, rngs=nnx.Rngs(0)), update_stats=False, rngs=nnx.Rngs(1)
  )
  assert theirs.use_running_average is True  # nnx's attribute, the same way round


def test_spectral_norm_without_steps_does_nothing_as_nnx():
  theirs = nnx.SpectralNorm(nnx.Linear(4, 5, rngs=nnx.Rngs(0)), n_steps=0, rngs=nnx.Rngs(1))
  ours = sr.nn.SpectralNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), n_steps=0, rngs=sr.Rngs(1))
  assert dict(ours.batch_stats) == {} and dict(theirs.batch_stats) == {}
  sr.interop.from_nnx(ours, theirs)
  np.testing.assert_allclose(ours(_x(2, 4)), ours.layer_instance(_x(2, 4)), **TOL)


# -- transforms and stacks -------------------------------------------------------------


def test_inside_jit_and_grad_equals_eager():
  def make():
    return Holder(
      sr.nn.SpectralNorm(
        sr.nn.WeightNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), rngs=sr.Rngs(1)), rngs=sr.Rngs(2)
      )
    )

  eager, jitted = make(), make()
  x = _x(3, 4)

  @sr.jit
  def step(model, x):
    loss, grads = sr.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(model, x)
    return loss, grads

  for _ in range(3):
    loss_j, grads_j = step(jitted, x)
    loss_e, grads_e = sr.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(eager, x)
    np.testing.assert_allclose(loss_j, loss_e, **TOL)
    for k, v in grads_e.flat().items():
      np.testing.assert_allclose(grads_j.flat()[k], v, err_msg=str(k), **TOL)
  state_e, state_j = _state(eager), _state(jitted)
  for k in state_e:
    np.testing.assert_allclose(state_j[k], state_e[k], err_msg=str(k), **TOL)
  # Three updates of u and sigma came back out of the jitted step.
  assert not np.array_equal(
    state_j[("blocks", 0, "batch_stats", ("layer_instance", "kernel", "sigma"))], 1.0
  )


class Block(sr.Module):
  def __init__(self, rngs):
    self.spectral = sr.nn.SpectralNorm(sr.nn.Linear(4, 4, rngs=rngs), rngs=rngs)
    self.weight = sr.nn.WeightNorm(sr.nn.Conv(4, 4, (3,), rngs=rngs), rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.weight(self.spectral(x)))


def _randomize_ours(model, seed=3):
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  params = sr.state(model, sr.Param)
  sr.update(model, jax.tree.map(lambda v: jax.random.normal(next(keys), v.shape), params))


def test_scan_over_a_stack_equals_the_loop():
  stack = sr.vmap(Block, axis_size=3, in_axes=None)(rngs=sr.Rngs(0))
  _randomize_ours(stack)
  layers = sr.unstack(stack)
  x = _x(2, 5, 4)

  @sr.scan(variable_axes={sr.Param: 0, sr.BatchStat: 0})
  def run(layer, x):
    return layer(x), None

  y, _ = sr.jit(run)(stack, x)
  call = sr.jit(lambda m, x: m(x))  # compiled once for the three layers
  want = x
  for layer in layers:
    want = call(layer, want)
  np.testing.assert_allclose(y, want, **TOL)
  # Each layer's u and sigma were updated in its own slice of the stack.
  expected = _state(sr.stack(layers))
  got = _state(stack)
  for k in expected:
    np.testing.assert_allclose(got[k], expected[k], err_msg=str(k), **TOL)
  sigma = got[("spectral", "batch_stats", ("kernel", "sigma"))]
  assert sigma.shape == (3,) and len(set(sigma.tolist())) == 3


def test_vmap_stack_computes_each_layer():
  stack = sr.vmap(Block, axis_size=3, in_axes=None)(rngs=sr.Rngs(0))
  _randomize_ours(stack)
  layers = sr.unstack(stack)
  x = _x(2, 5, 4)
  call = sr.jit(lambda m, x: m(x))  # one program for the stack, one for all three layers
  y = call(stack, x)
  for i, layer in enumerate(layers):
    np.testing.assert_allclose(y[i], call(layer, x), **TOL)
  expected, got = _state(sr.stack(layers)), _state(stack)
  for k in expected:
    np.testing.assert_allclose(got[k], expected[k], err_msg=str(k), **TOL)


# -- interop ---------------------------------------------------------------------------


def test_from_nnx_and_back_without_rename():
  class Theirs(nnx.Module):
    def __init__(self, rngs):
      self.sn = nnx.SpectralNorm(nnx.Conv(2, 3, (3, 3), rngs=rngs), rngs=rngs)
      self.wn = nnx.WeightNorm(nnx.Linear(3, 4, rngs=rngs), rngs=rngs)

  class Ours(sr.Module):
    def __init__(self, rngs):
      self.sn = sr.nn.SpectralNorm(sr.nn.Conv(2, 3, (3, 3), rngs=rngs), rngs=rngs)
      self.wn = sr.nn.WeightNorm(sr.nn.Linear(3, 4, rngs=rngs), rngs=rngs)

  theirs = Theirs(nnx.Rngs(0))
  _randomize(theirs.sn)
  _randomize(theirs.wn)
  # u and sigma away from their initial values
  nnx.jit(lambda m, x: m(x))(theirs.sn, _x(1, 5, 5, 2))
  ours = sr.interop.from_nnx(Ours(sr.Rngs(1)), theirs)
  flat_t = {
    p: np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
    for p, v in nnx.to_flat_state(nnx.state(theirs))
  }
  flat_o = _state(ours)
  assert flat_o.keys() == flat_t.keys()
  for k in flat_o:
    np.testing.assert_array_equal(flat_o[k], flat_t[k], err_msg=str(k))
  back = sr.interop.to_nnx(ours, Theirs(nnx.Rngs(5)))
  for p, v in nnx.to_flat_state(nnx.state(back)):
    np.testing.assert_array_equal(
      v[...] if isinstance(v, nnx.Variable) else v, flat_o[p], err_msg=str(p)
    )


def test_checkpoint_round_trip(tmp_path):
  model = Holder(sr.nn.SpectralNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), rngs=sr.Rngs(1)))
  model(_x(2, 4))
  sr.save(tmp_path / "ck", model)
  fresh = Holder(sr.nn.SpectralNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(7)), rngs=sr.Rngs(8)))
  assert not np.array_equal(
    fresh.blocks[0].batch_stats["kernel", "u"].value,
    model.blocks[0].batch_stats["kernel", "u"].value,
  )
  sr.restore(tmp_path / "ck", fresh)
  _assert_state(fresh, _state(model))


# -- bad inputs ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [sr.nn.SpectralNorm, sr.nn.WeightNorm])
@pytest.mark.parametrize(
  "layer, got",
  [
    (lambda x: x, "got a function"),
    (sr.nn.Linear, "got the class Linear"),
    (jnp.ones((2, 2)), "got a "),
  ],
)
def test_wrapping_what_is_not_a_layer(cls, layer, got):
  name = cls.__name__
  with pytest.raises(
    sr.GraphError,
    match=rf"^{name} wraps a layer .*{got}.*Fix: pass "
    rf"a layer instance, e\.g\. sr\.nn\.{name}\(sr\.nn\.Linear",
  ):
    cls(layer, rngs=sr.Rngs(0))


def test_wrapping_an_nnx_layer_points_at_ours():
  with pytest.raises(
    TypeError,
    match=r"got a flax Linear\. Fix: build the layer with "
    r"sr\.nn .*sr\.interop\.from_nnx",
  ):
    sr.nn.SpectralNorm(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), rngs=sr.Rngs(0))


def test_wrapping_a_layer_without_a_kernel():
  norm = Holder(sr.nn.LayerNorm(4, rngs=sr.Rngs(0))).blocks[0]
  with pytest.raises(
    ValueError,
    match=re.escape(
      "SpectralNorm around the LayerNorm at `blocks[0]`: the wrapped LayerNorm has no "
      "Param of two or more dimensions to normalise (its Params: `bias` (4,), "
      "`scale` (4,))"
    )
    + ".*Fix: wrap the layer whose kernel",
  ):
    sr.nn.SpectralNorm(norm, rngs=sr.Rngs(0))
  with pytest.raises(
    ValueError,
    match=re.escape(
      "WeightNorm around the LayerNorm at `blocks[0]`: variable_filter="
      "PathContains('kernel') matches none of "
      "the wrapped LayerNorm's Params"
    )
    + ".*Fix: pass a variable_filter",
  ):
    sr.nn.WeightNorm(norm, rngs=sr.Rngs(0))


def test_non_matrix_kernel_with_error_on_non_matrix():
  with pytest.raises(
    ValueError,
    match=re.escape(
      "SpectralNorm: `layer_instance.kernel` has shape (3, 3, 2, 4) (4-D), but "
      "error_on_non_matrix=True allows only matrices. Fix: pass "
      "error_on_non_matrix=False to normalise it as the (18, 4) matrix"
    ),
  ):
    sr.nn.SpectralNorm(
      sr.nn.Conv(2, 4, (3, 3), rngs=sr.Rngs(0)), error_on_non_matrix=True, rngs=sr.Rngs(0)
    )
  # Switched on after construction, at call time: the path of the wrapper, nothing
  # changed, eagerly and under sr.jit.
  model = Holder(sr.nn.SpectralNorm(sr.nn.Conv(2, 4, (3, 3), rngs=sr.Rngs(0)), rngs=sr.Rngs(0)))
  model.blocks[0].error_on_non_matrix = True
  before = _state(model)
  for call in (lambda m, x: m(x), sr.jit(lambda m, x: m(x))):
    with pytest.raises(
      ValueError,
      match=r"^SpectralNorm at `blocks\[0\]`: "
      r"`layer_instance\.kernel` has shape \(3, 3, 2, 4\)",
    ):
      call(model, _x(1, 4, 4, 2))
    _assert_state(model, before)


@pytest.mark.parametrize(
  "make",
  [
    lambda: sr.nn.SpectralNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), rngs=sr.Rngs(1)),
    lambda: sr.nn.WeightNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), rngs=sr.Rngs(1)),
  ],
)
def test_a_failing_wrapped_call_leaves_everything_as_it_was(make):
  model = Holder(make())
  kernel = model.blocks[0].layer_instance.kernel
  original = kernel.value
  before = _state(model)
  for call in (lambda m, x: m(x), sr.jit(lambda m, x: m(x)), sr.grad(lambda m, x: jnp.sum(m(x)))):
    with pytest.raises(
      ValueError,
      match=re.escape(
        "At `blocks[0].layer_instance`: Linear was built with in_features=4 but got an "
        "input of shape (2, 3)"
      ),
    ):
      call(model, _x(2, 3))
    assert kernel.value is original  # the very same array, not a normalised one
    _assert_state(model, before)


def test_weight_norm_feature_axes_out_of_range():
  with pytest.raises(
    ValueError,
    match=re.escape(
      "WeightNorm: feature_axes=5 is out of range for `layer_instance.kernel`, which "
      "has 2 dimensions. Fix: pass axes in [-2, 1]"
    ),
  ):
    sr.nn.WeightNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), feature_axes=5, rngs=sr.Rngs(0))


def test_params_added_after_wrapping():
  model = Holder(sr.nn.SpectralNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), rngs=sr.Rngs(1)))
  model.blocks[0].layer_instance.extra = sr.Param(jnp.ones((5, 5)))
  before = _state(model)
  with pytest.raises(
    sr.StateMismatchError,
    match=re.escape(
      "SpectralNorm at `blocks[0]`: `layer_instance.extra` (5, 5) has no `u` / `sigma` "
      "in `batch_stats`"
    )
    + ".*Fix: wrap the layer after its Params are all in place",
  ):
    model(_x(2, 4))
  _assert_state(model, before)
  wn = Holder(sr.nn.WeightNorm(sr.nn.Linear(4, 5, rngs=sr.Rngs(0)), rngs=sr.Rngs(1)))
  wn.blocks[0].layer_instance.kernel.value = jnp.ones((4, 6))
  with pytest.raises(
    sr.StateMismatchError,
    match=re.escape(
      "WeightNorm at `blocks[0]`: `layer_instance.kernel` (4, 6) needs a scale of shape "
      "(6,), but `scales[('kernel',)]` has shape (5,)"
    ),
  ):
    wn(_x(2, 4))


def test_rngs_and_nnx_names():
  with pytest.raises(
    TypeError,
    match=r"SpectralNorm: rngs must be an sr\.Rngs, got the "
    r"int 0.*Fix: `rngs=sr\.Rngs\(0\)`",
  ):
    sr.nn.SpectralNorm(sr.nn.Linear(2, 2, rngs=sr.Rngs(0)), rngs=0)
  with pytest.raises(AttributeError, match=r"use sr\.nn\.WeightNorm"):
    sr.WeightNorm  # noqa: B018
