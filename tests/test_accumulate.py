"""sr.accumulate: equal to the Python loop over the microbatches, then averaging."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr

K = 4


class Net(sr.Module):
  def __init__(self, rngs, features=8):
    # No bias before BatchNorm: its gradient is 0 up to rounding, which Adam would
    # turn into steps of ±lr that differ between any two summation orders.
    self.lin = sr.nn.Linear(
      4, features, use_bias=False, rngs=rngs, kernel_metadata={"sharding": (None, "mlp")}
    )
    self.bn = sr.nn.BatchNorm(features, rngs=rngs)
    self.drop = sr.nn.Dropout(0.5, rngs=rngs)
    self.out = sr.nn.Linear(features, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(jax.nn.relu(self.bn(self.lin(x)))))


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def aux_loss_fn(model, x, y):
  pred = model(x)
  return jnp.mean((pred - y) ** 2), {"pred_mean": pred.mean(), "rows": x[:, 0]}


def batch(rows=16):
  x = jax.random.normal(jax.random.key(1), (rows, 4))
  return x, jnp.sin(x[:, :1])


def loop(fn, model, x, y, k=K):
  """The reference: the Python loop over contiguous microbatches, then averaging."""
  n = x.shape[0] // k
  outs = [fn(model, x[m * n : (m + 1) * n], y[m * n : (m + 1) * n]) for m in range(k)]
  first, grads = zip(*outs)
  mean = lambda *a: sum(a) / k  # noqa: E731
  return first, jax.tree.map(mean, *grads)


def leaves(tree):
  return [
    np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
    for a in jax.tree.leaves(tree)
  ]


def assert_close(a, b, tol=1e-6):
  la, lb = leaves(a), leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for p, q in zip(la, lb):
    np.testing.assert_allclose(p, q, rtol=tol, atol=tol)


def snapshot(model):
  return leaves(sr.state(model))


def assert_unchanged(model, before):
  for p, q in zip(snapshot(model), before):
    np.testing.assert_array_equal(p, q)


def test_batchnorm_dropout_equals_loop():
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(0))
  x, y = batch()
  vg = sr.value_and_grad(loss_fn)
  count = int(a.drop.rngs.default.count.value)
  loss, grads = sr.accumulate(vg, microbatches=K)(a, x, y)
  losses, want = loop(vg, b, x, y)
  np.testing.assert_allclose(loss, sum(losses) / K, rtol=1e-6)
  assert isinstance(grads, sr.State)
  assert_close(grads, want)
  # Batch statistics updated K times, the dropout stream advanced once per microbatch.
  assert_close(sr.state(a), sr.state(b))
  assert int(a.drop.rngs.default.count.value) == count + K
  # Params were read, not carried: the same arrays are still there.
  assert not np.array_equal(a.bn.mean.value, np.zeros(8))


def test_params_not_written_back():
  model = Net(sr.Rngs(0))
  kernel = model.lin.kernel.value
  sr.accumulate(sr.value_and_grad(loss_fn), microbatches=2)(model, *batch())
  assert model.lin.kernel.value is kernel


def test_inside_jit_equals_loop():
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(0))
  x, y = batch()
  vg = sr.value_and_grad(loss_fn)
  step = sr.jit(lambda m, x, y: sr.accumulate(vg, microbatches=K)(m, x, y))
  loss, grads = step(a, x, y)
  losses, want = loop(vg, b, x, y)
  np.testing.assert_allclose(loss, sum(losses) / K, rtol=1e-6)
  assert_close(grads, want)
  assert_close(sr.state(a), sr.state(b))


def test_optimizer_two_steps_equal_loop():
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(0))
  opt_a, opt_b = sr.Optimizer(a, optax.adam(1e-2)), sr.Optimizer(b, optax.adam(1e-2))
  vg = sr.value_and_grad(loss_fn)
  acc = sr.accumulate(vg, microbatches=K)

  @sr.jit
  def step(model, opt, x, y):
    loss, grads = acc(model, x, y)
    opt.update(grads)
    return loss

  for seed in (1, 2):
    x = jax.random.normal(jax.random.key(seed), (16, 4))
    y = jnp.cos(x[:, :1])
    loss = step(a, opt_a, x, y)
    losses, grads = loop(vg, b, x, y)
    opt_b.update(grads)
    np.testing.assert_allclose(loss, sum(losses) / K, rtol=1e-6)
  assert_close(sr.state(a), sr.state(b), tol=1e-5)
  assert_close(sr.state(opt_a), sr.state(opt_b), tol=1e-5)


def test_has_aux_stacked_per_microbatch():
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(0))
  x, y = batch()
  vg = sr.value_and_grad(aux_loss_fn, has_aux=True)
  (loss, aux), grads = sr.accumulate(vg, microbatches=K)(a, x, y)
  firsts, want = loop(vg, b, x, y)
  np.testing.assert_allclose(loss, sum(l for l, _ in firsts) / K, rtol=1e-6)
  assert aux["pred_mean"].shape == (K,) and aux["rows"].shape == (K, 16 // K)
  np.testing.assert_allclose(aux["rows"], x[:, 0].reshape(K, -1))  # contiguous split
  assert_close(aux, jax.tree.map(lambda *a: jnp.stack(a), *[a for _, a in firsts]))
  assert_close(grads, want)
  assert_close(sr.state(a), sr.state(b))


def test_one_microbatch_is_the_whole_batch():
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(0))
  x, y = batch()
  vg = sr.value_and_grad(loss_fn)
  loss, grads = sr.accumulate(vg, microbatches=1)(a, x, y)
  want_loss, want = vg(b, x, y)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  assert_close(grads, want)


def test_pytree_batch_and_keyword_arguments():
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(0))
  x, y = batch()

  def dict_loss(model, data, *, scale):
    return scale * jnp.mean((model(data["x"]) - data["y"]) ** 2)

  vg = sr.value_and_grad(dict_loss)
  loss, grads = sr.accumulate(vg, microbatches=2)(a, {"x": x, "y": y}, scale=2.0)
  outs = [
    vg(b, {"x": x[i * 8 : (i + 1) * 8], "y": y[i * 8 : (i + 1) * 8]}, scale=2.0) for i in range(2)
  ]
  np.testing.assert_allclose(loss, (outs[0][0] + outs[1][0]) / 2, rtol=1e-6)
  assert_close(grads, jax.tree.map(lambda p, q: (p + q) / 2, outs[0][1], outs[1][1]))


def _hlo_collectives(text):
  return {op: len(re.findall(rf"\b{op}\(", text)) for op in ("all-gather", "all-to-all")}


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_batch_on_data_mesh(axis_type):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(0))
  x, y = batch(64)
  vg = sr.value_and_grad(loss_fn)
  losses, want = loop(vg, b, x, y)
  with jax.set_mesh(mesh):
    xs, ys = (jax.device_put(v, NamedSharding(mesh, P("data"))) for v in (x, y))
    step = sr.jit(lambda m, x, y: sr.accumulate(vg, microbatches=K)(m, x, y))
    text = step.lower(a, xs, ys).compile().as_text()
    loss, grads = step(a, xs, ys)
  np.testing.assert_allclose(loss, sum(losses) / K, rtol=1e-5)
  assert_close(grads, want, tol=1e-5)
  assert_close(sr.state(a), sr.state(b), tol=1e-5)
  found = _hlo_collectives(text)
  if axis_type == AxisType.Explicit:
    # One all-to-all spreads each microbatch over the 8 devices; nothing gathered.
    assert found["all-to-all"] >= 1 and found["all-gather"] == 0, found
  else:
    # Auto axes: XLA's partitioner gathers the microbatches (documented cost).
    assert found["all-gather"] >= 1, found


def test_sharded_params_explicit_mesh():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(0))
  x, y = batch(32)
  vg = sr.value_and_grad(loss_fn)
  losses, want = loop(vg, b, x, y)
  with jax.set_mesh(mesh):
    sr.shard(a, mesh, rules=[("mlp", "model")])
    xs, ys = (jax.device_put(v, NamedSharding(mesh, P("data"))) for v in (x, y))
    loss, grads = sr.jit(lambda m, x, y: sr.accumulate(vg, microbatches=K)(m, x, y))(a, xs, ys)
  assert grads["lin"]["kernel"].sharding.spec == P(None, "model")
  np.testing.assert_allclose(loss, sum(losses) / K, rtol=1e-5)
  assert_close(grads, want, tol=1e-5)


# -- misuse ------------------------------------------------------------------------------


def test_batch_not_divisible_names_argument_shape_and_fix():
  model = Net(sr.Rngs(0))
  before = snapshot(model)
  x, y = batch(10)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr.accumulate\(loss_fn\): argument 1 has shape \(10, 4\), which does not split "
      r"along axis 0 into microbatches=4 .*Fix: pass a batch whose size is a multiple "
      r"of 4 \(e.g. 8 rows\)"
    ),
  ):
    sr.accumulate(sr.value_and_grad(loss_fn), microbatches=K)(model, x, y)
  with pytest.raises(sr.TransformError, match=r"argument 1 at `\['x'\]` has shape \(6, 4\)"):
    sr.accumulate(lambda m, d: (0.0, {}), microbatches=4)(
      model, {"x": jnp.ones((6, 4)), "y": jnp.ones((6, 1))}
    )
  assert_unchanged(model, before)


def test_batch_arrays_of_different_lengths_are_refused_not_broadcast():
  # x of 8 rows and y of 4 split into 4 microbatches each would pair x's rows 0-1 with
  # y's row 0: a loss of the wrong examples. Both arrays are named, nothing changes.
  model = Net(sr.Rngs(0))
  before = snapshot(model)
  x, y = batch(8)
  step = sr.accumulate(sr.value_and_grad(loss_fn), microbatches=K)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr.accumulate\(loss_fn\): argument 1 has 8 rows but argument 2 has 4; every "
      r"array of the batch is split along axis 0 into the same microbatches.*Nothing "
      r"was run\. Fix: pass arrays of one batch size"
    ),
  ):
    step(model, x, y[:4])
  with pytest.raises(sr.TransformError, match=r"argument 1 at `\['x'\]` has 8 rows but"):
    sr.accumulate(lambda m, d: (0.0, {}), microbatches=2)(
      model, {"x": jnp.ones((8, 4)), "y": jnp.ones((6, 1))}
    )
  assert_unchanged(model, before)


@pytest.mark.parametrize("k", [0, -1, 2.0, True])
def test_microbatches_must_be_positive_int(k):
  with pytest.raises(
    sr.TransformError,
    match=(rf"microbatches={k!r}, but it is the number of microbatches.*an int >= 1. Fix"),
  ):
    sr.accumulate(sr.value_and_grad(loss_fn), microbatches=k)


def test_fn_not_returning_loss_and_grads():
  model = Net(sr.Rngs(0))
  before = snapshot(model)
  with pytest.raises(
    sr.TransformError,
    match=(
      r"sr.accumulate\(loss_fn\): fn must return a pair \(loss, grads\).*returned a single "
      r"array. Fix: wrap the loss function, `sr.accumulate\(sr.value_and_grad\(loss_fn\)"
    ),
  ):
    sr.accumulate(loss_fn, microbatches=2)(model, *batch())
  with pytest.raises(sr.TransformError, match=r"returned a tuple of length 3"):
    sr.accumulate(lambda m, x: (1.0, 2.0, 3.0), microbatches=2)(model, jnp.ones((4, 4)))
  with pytest.raises(sr.TransformError, match=r"int32\[\] as the loss.*Fix: return the loss"):
    sr.accumulate(lambda m, x: (jnp.int32(1), {}), microbatches=2)(model, jnp.ones((4, 4)))
  assert_unchanged(model, before)


def test_non_module_first_argument():
  x, y = batch()
  with pytest.raises(
    sr.TransformError,
    match=(
      r"argument 0 must be the model \(a module, or a tuple/dict of modules\), got "
      r"ArrayImpl.*Fix: `sr.accumulate\(fn, microbatches=k\)\(model, x, y\)`"
    ),
  ):
    sr.accumulate(sr.value_and_grad(loss_fn), microbatches=2)(x, y)


def test_module_in_batch_refused():
  model, other = Net(sr.Rngs(0)), Net(sr.Rngs(1))
  with pytest.raises(
    sr.GraphError,
    match=r"argument 2 is a Net\. Modules go in "
    r"argument 0 only.*Fix",
  ):
    sr.accumulate(lambda m, x, o: (0.0, {}), microbatches=2)(model, jnp.ones((4, 4)), other)


def test_error_in_fn_leaves_model_unchanged():
  model = Net(sr.Rngs(0))
  before = snapshot(model)

  def interrupted(m, x, y):
    loss, grads = sr.value_and_grad(loss_fn)(m, x, y)  # BatchNorm and dropout written
    raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    sr.accumulate(interrupted, microbatches=2)(model, *batch())
  with pytest.raises(KeyboardInterrupt):
    sr.jit(lambda m, x, y: sr.accumulate(interrupted, microbatches=2)(m, x, y))(model, *batch())
  assert_unchanged(model, before)
  # And it still runs afterwards.
  count = int(model.drop.rngs.default.count.value)
  sr.accumulate(sr.value_and_grad(loss_fn), microbatches=2)(model, *batch())
  assert int(model.drop.rngs.default.count.value) == count + 2


def test_carried_value_changing_shape_is_refused():
  model = Net(sr.Rngs(0))
  before = snapshot(model)

  def grow(m, x):
    out = sr.value_and_grad(lambda m: m(x).mean())(m)
    m.bn.mean.value = jnp.concatenate([m.bn.mean.value, m.bn.mean.value])
    return out

  with pytest.raises(
    sr.TransformError,
    match=(
      r"fn changed `bn.mean` from float32\[8\] to float32\[16\].*keeps its shape. "
      r"Fix"
    ),
  ):
    sr.accumulate(grow, microbatches=2)(model, jnp.ones((4, 4)))
  assert_unchanged(model, before)


def test_raw_jax_value_and_grad_under_accumulate_points_to_sr_value_and_grad():
  """Raw ``jax.value_and_grad`` over a module returns the gradients as a module; the
  message names that and the fix, and the model is left as it was."""
  model = sr.nn.Linear(3, 2, rngs=sr.Rngs(0))
  before = snapshot(model)

  def step(m, x, y):
    return jax.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)

  with pytest.raises(
    sr.TransformError,
    match=r"gradients as a module \(Linear\): raw `jax\.grad` / `jax\.value_and_grad`.*"
    r"Fix: .*sr\.accumulate\(sr\.value_and_grad\(loss_fn\), microbatches=k\)",
  ):
    sr.accumulate(step, microbatches=2)(model, jnp.ones((4, 3)), jnp.ones((4, 2)))
  assert_unchanged(model, before)
