"""sr.grad / sr.value_and_grad against jax.grad of the same function written purely."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr


class Temperature(sr.Variable):
  """A custom kind: its own collection, ``"temperature"``."""


class MLP(sr.Module):
  def __init__(self, *, rngs):
    self.l1 = sr.nn.Linear(3, 4, rngs=rngs)
    self.l2 = sr.nn.Linear(4, 2, rngs=rngs)
    self.mean = sr.BatchStat(jnp.zeros(4))
    self.temperature = Temperature(jnp.array(2.0))

  def __call__(self, x):
    h = jnp.tanh(self.l1(x))
    self.mean.value = 0.9 * self.mean.value + 0.1 * h.mean(0)
    h = h - self.mean.value[None]
    return self.l2(h) * self.temperature.value


class Holder(sr.Module):
  def __init__(self, sub):
    self.sub = sub
    self.calls = sr.BatchStat(jnp.zeros((), jnp.int32))


def loss_fn(model, x, y):
  return ((model(x) - y) ** 2).mean()


def pure_loss(params, mean, temperature, x, y):
  """``loss_fn`` written by hand on arrays; returns (loss, new running mean)."""
  h = jnp.tanh(x @ params["l1"]["kernel"] + params["l1"]["bias"][None])
  mean = 0.9 * mean + 0.1 * h.mean(0)
  h = h - mean[None]
  out = (h @ params["l2"]["kernel"] + params["l2"]["bias"][None]) * temperature
  return ((out - y) ** 2).mean(), mean


def arrays_of(model):
  params = {
    name: {"kernel": getattr(model, name).kernel.value, "bias": getattr(model, name).bias.value}
    for name in ("l1", "l2")
  }
  return params, model.mean.value, model.temperature.value


def data():
  x = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
  y = jnp.linspace(0.0, 1.0, 10).reshape(5, 2)
  return x, y


def assert_close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_value_and_grad_equals_jax_grad_of_the_pure_function():
  model = MLP(rngs=sr.Rngs(0))
  x, y = data()
  params, mean, temperature = arrays_of(model)
  (ref_loss, ref_mean), ref_grads = jax.value_and_grad(pure_loss, has_aux=True)(
    params, mean, temperature, x, y
  )

  loss, grads = sr.value_and_grad(loss_fn)(model, x, y)

  assert_close(loss, ref_loss)
  assert isinstance(grads, sr.State)
  for name in ("l1", "l2"):
    for leaf in ("kernel", "bias"):
      assert_close(grads[name][leaf], ref_grads[name][leaf])
  # The running mean the loss updated is written back; params are left alone.
  assert_close(model.mean.value, ref_mean)
  assert model.l1.kernel.value is params["l1"]["kernel"]


def test_grad_state_has_the_paths_of_sr_state_and_maps_with_jax_tree():
  model = MLP(rngs=sr.Rngs(0))
  x, y = data()
  grads = sr.grad(loss_fn)(model, x, y)
  params = sr.state(model, sr.Param)
  assert list(grads.flat()) == list(params.flat())
  assert list(grads.flat()) == [("l1", "bias"), ("l1", "kernel"), ("l2", "bias"), ("l2", "kernel")]
  for path, g in grads.flat().items():
    assert g.shape == params.flat()[path].shape

  stepped = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  assert isinstance(stepped, sr.State)
  assert list(stepped.flat()) == list(params.flat())
  sr.update(model, stepped)
  assert_close(model.l2.kernel.value, params["l2"]["kernel"] - 0.1 * grads["l2"]["kernel"])


@pytest.mark.parametrize(
  "wrt, paths",
  [
    (sr.Param, [("l1", "bias"), ("l1", "kernel"), ("l2", "bias"), ("l2", "kernel")]),
    ("batch_stats", [("mean",)]),
    ("temperature", [("temperature",)]),
    (sr.PathContains("l2"), [("l2", "bias"), ("l2", "kernel")]),
    ((sr.BatchStat, Temperature), [("mean",), ("temperature",)]),
  ],
)
def test_wrt_filters(wrt, paths):
  model = MLP(rngs=sr.Rngs(0))
  x, y = data()
  params, mean, temperature = arrays_of(model)
  ref = jax.grad(lambda *a: pure_loss(*a)[0], argnums=(0, 1, 2))(params, mean, temperature, x, y)
  ref_flat = {
    ("l1", "bias"): ref[0]["l1"]["bias"],
    ("l1", "kernel"): ref[0]["l1"]["kernel"],
    ("l2", "bias"): ref[0]["l2"]["bias"],
    ("l2", "kernel"): ref[0]["l2"]["kernel"],
    ("mean",): ref[1],
    ("temperature",): ref[2],
  }

  grads = sr.grad(loss_fn, wrt=wrt)(model, x, y)

  assert list(grads.flat()) == paths
  assert list(grads.flat()) == list(sr.state(model, wrt).flat())
  for path, g in grads.flat().items():
    assert_close(g, ref_flat[path])


def test_has_aux():
  model = MLP(rngs=sr.Rngs(0))
  x, y = data()
  params, mean, temperature = arrays_of(model)
  ref_grads = jax.grad(lambda *a: pure_loss(*a)[0])(params, mean, temperature, x, y)

  def with_aux(model, x, y):
    out = model(x)
    return ((out - y) ** 2).mean(), {"out": out, "n": 3}

  (loss, aux), grads = sr.value_and_grad(with_aux, has_aux=True)(model, x, y)
  assert aux["out"].shape == (5, 2) and aux["n"] == 3
  assert_close(grads["l1"]["kernel"], ref_grads["l1"]["kernel"])

  model.mean.value = mean
  grads2, aux2 = sr.grad(with_aux, has_aux=True)(model, x, y)
  assert_close(grads2["l2"]["bias"], ref_grads["l2"]["bias"])
  assert_close(aux2["out"], aux["out"])


def test_argnums_mixing_a_module_and_an_array():
  model = MLP(rngs=sr.Rngs(0))
  x, y = data()
  params, mean, temperature = arrays_of(model)
  ref_p, ref_x = jax.grad(lambda p, x: pure_loss(p, mean, temperature, x, y)[0], argnums=(0, 1))(
    params, x
  )

  g_model, g_x = sr.grad(loss_fn, argnums=(0, 1))(model, x, y)
  assert isinstance(g_model, sr.State) and isinstance(g_x, jax.Array)
  assert_close(g_x, ref_x)
  assert_close(g_model["l1"]["kernel"], ref_p["l1"]["kernel"])

  model.mean.value = mean
  value, (g_x2, g_model2) = sr.value_and_grad(loss_fn, argnums=(1, 0))(model, x, y)
  assert_close(g_x2, ref_x)
  assert_close(g_model2["l2"]["kernel"], ref_p["l2"]["kernel"])
  assert list(g_model2.flat()) == list(sr.state(model, sr.Param).flat())


def test_module_also_reachable_through_an_earlier_argument():
  model = MLP(rngs=sr.Rngs(0))
  holder = Holder(model)
  x, y = data()
  params, mean, temperature = arrays_of(model)
  ref = jax.grad(lambda *a: pure_loss(*a)[0])(params, mean, temperature, x, y)

  def loss(holder, model, x, y):
    holder.calls.value = holder.calls.value + 1
    return loss_fn(model, x, y)

  grads = sr.grad(loss, argnums=1)(holder, model, x, y)
  assert list(grads.flat()) == list(sr.state(model, sr.Param).flat())
  assert_close(grads["l2"]["kernel"], ref["l2"]["kernel"])
  assert int(holder.calls.value) == 1  # the other module's mutation is written back
  assert holder.sub is model


def test_rng_counts_advance_through_grad():

  class Noisy(sr.Module):
    def __init__(self):
      self.w = sr.Param(jnp.ones(3))
      self.rngs = sr.Rngs(0)

    def __call__(self):
      return (self.w.value * jax.random.normal(self.rngs.noise(), (3,))).sum()

  model = Noisy()
  count = model.rngs.default.count.value
  key = jax.random.fold_in(model.rngs.default.key.value, count)
  grads = sr.grad(lambda m: m())(model)
  assert_close(grads["w"], jax.random.normal(key, (3,)))
  assert int(model.rngs.default.count.value) == int(count) + 1
  grads2 = sr.grad(lambda m: m())(model)
  assert not np.allclose(grads2["w"], grads["w"])


def test_under_jit_equals_eager():
  eager, jitted = MLP(rngs=sr.Rngs(0)), MLP(rngs=sr.Rngs(0))
  x, y = data()

  def step(model, x, y):
    loss, grads = sr.value_and_grad(loss_fn)(model, x, y)
    sr.update(model, jax.tree.map(lambda p, g: p - 0.5 * g, sr.state(model, sr.Param), grads))
    return loss, grads

  jit_step = sr.jit(step)
  for _ in range(3):
    loss_e, grads_e = step(eager, x, y)
    loss_j, grads_j = jit_step(jitted, x, y)
    assert_close(loss_j, loss_e)
    assert isinstance(grads_j, sr.State)
    assert list(grads_j.flat()) == list(grads_e.flat())
    for path, g in grads_e.flat().items():
      assert_close(grads_j.flat()[path], g)
  for path, value in sr.state(eager).flat().items():
    assert_close(sr.state(jitted).flat()[path], value)


def test_has_aux_with_a_non_pair_return_is_an_error():
  model = MLP(rngs=sr.Rngs(0))
  x, y = data()
  mean = model.mean.value
  with pytest.raises(
    TypeError,
    match=r"has_aux=True needs the function to return a pair "
    r"\(loss, aux\), got a single array",
  ):
    sr.grad(loss_fn, has_aux=True)(model, x, y)
  with pytest.raises(TypeError, match=r"return a pair \(loss, aux\), got a tuple of length 3"):
    sr.value_and_grad(lambda m: (loss_fn(m, x, y), 1, 2), has_aux=True)(model)
  assert model.mean.value is mean


def test_argnums_out_of_range_is_an_error():
  model = MLP(rngs=sr.Rngs(0))
  with pytest.raises(TypeError, match=r"argnums=\(0, 2\) but only 2 positional"):
    sr.grad(lambda m, x: loss_fn(m, x, x), argnums=(0, 2))(model, jnp.ones((1, 3)))


def test_wrt_matching_a_non_float_variable_is_an_error():

  class WithRngs(sr.Module):
    def __init__(self):
      self.w = sr.Param(jnp.ones(2))
      self.rngs = sr.Rngs(0)

  model = WithRngs()
  with pytest.raises(
    TypeError,
    match=r"the `wrt` filter matches `rngs\.default\.count` "
    r"\(RngCount, uint32\), which is not a float array.*`wrt=sr\.Param`",
  ):
    sr.grad(lambda m: m.w.value.sum(), wrt=...)(model)
  grads = sr.grad(lambda m: m.w.value.sum(), wrt=sr.Not("rngs"))(model)
  assert list(grads.flat()) == [("w",)]


def test_grad_of_a_list_of_modules_is_a_list_of_states():
  # nnx.grad takes a list of layers (how most public nnx code holds them); dropout's
  # RNG state in the layers is not differentiated.
  class Block(sr.Module):
    def __init__(self, seed):
      self.linear = sr.nn.Linear(2, 2, rngs=sr.Rngs(seed))
      self.drop = sr.nn.Dropout(0.5, rngs=sr.Rngs(seed))

    def __call__(self, x):
      return self.drop(self.linear(x))

  class Holder(sr.Module):
    def __init__(self, layers):
      self.layers = layers

  def run(layers, x):
    for layer in layers:
      x = layer(x)
    return jnp.sum(x**2)

  layers = [Block(0), Block(1)]
  twins = sr.clone(Holder(layers))
  x = jnp.ones((3, 2))
  value, grads = sr.value_and_grad(run)(layers, x)
  expected = sr.grad(lambda h, x: run(h.layers, x))(twins, x).flat()
  assert isinstance(grads, list) and len(grads) == 2
  for i, g in enumerate(grads):
    assert sorted(g.flat()) == [("linear", "bias"), ("linear", "kernel")]
    for path, value in g.flat().items():
      np.testing.assert_allclose(value, expected[("layers", i) + path], rtol=1e-6)
  # the RNG counts advanced once, as for a single module
  assert int(layers[0].drop.rngs.default.count.value) == int(
    twins.layers[0].drop.rngs.default.count.value
  )
