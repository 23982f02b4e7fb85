"""sr.Optimizer against a hand-written optax loop over a plain params pytree."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import statefulremat as sr


class MLP(sr.Module):
  def __init__(self, *, rngs):
    self.l1 = sr.nn.Linear(3, 4, rngs=rngs)
    self.l2 = sr.nn.Linear(4, 2, rngs=rngs)
    self.mean = sr.BatchStat(jnp.zeros(2))

  def __call__(self, x):
    out = self.l2(jnp.tanh(self.l1(x)))
    self.mean.value = 0.9 * self.mean.value + 0.1 * out.mean(0)
    return out


def loss_fn(model, x, y):
  return ((model(x) - y) ** 2).mean()


def pure_loss(params, x, y):
  h = jnp.tanh(x @ params["l1"]["kernel"] + params["l1"]["bias"][None])
  out = h @ params["l2"]["kernel"] + params["l2"]["bias"][None]
  return ((out - y) ** 2).mean()


def params_of(model):
  return {
    name: {"kernel": getattr(model, name).kernel.value, "bias": getattr(model, name).bias.value}
    for name in ("l1", "l2")
  }


def batches(n):
  return [
    (jnp.sin(jnp.arange(15.0) + i).reshape(5, 3), jnp.cos(jnp.arange(10.0) * (i + 1)).reshape(5, 2))
    for i in range(n)
  ]


def hand_loop(params, tx, data):
  opt_state = tx.init(params)
  for x, y in data:
    grads = jax.grad(pure_loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def assert_params_equal(model, params, exact):
  for name in ("l1", "l2"):
    for leaf in ("kernel", "bias"):
      got = np.asarray(getattr(getattr(model, name), leaf).value)
      want = np.asarray(params[name][leaf])
      if exact:
        np.testing.assert_array_equal(got, want, err_msg=f"{name}.{leaf}")
      else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name}.{leaf}")


TXS = {
  "sgd": lambda: optax.sgd(0.1),
  "adam": lambda: optax.adam(0.05),
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(TXS))
def test_eager_steps_equal_a_hand_written_optax_loop(name):
  model = MLP(rngs=sr.Rngs(0))
  data = batches(4)
  expected = hand_loop(params_of(model), TXS[name](), data)

  opt = sr.Optimizer(model, TXS[name](), wrt=sr.Param)
  for x, y in data:
    opt.update(sr.grad(loss_fn)(model, x, y))

  assert_params_equal(model, expected, exact=True)
  assert int(opt.step.value) == len(data)
  assert opt.model is model


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_jitted_steps_with_model_and_optimizer_passed_together(name):
  model = MLP(rngs=sr.Rngs(0))
  data = batches(4)
  expected = hand_loop(params_of(model), TXS[name](), data)
  opt = sr.Optimizer(model, TXS[name]())
  traces = []

  @sr.jit
  def train_step(model, opt, x, y):
    traces.append(1)
    loss, grads = sr.value_and_grad(loss_fn)(model, x, y)
    opt.update(grads)
    return loss

  kernel_var = model.l1.kernel
  losses = [float(train_step(model, opt, x, y)) for x, y in data]

  assert_params_equal(model, expected, exact=False)
  assert len(traces) == 1
  assert int(opt.step.value) == 4
  assert opt.model is model and model.l1.kernel is kernel_var  # still shared
  assert losses[-1] < losses[0]
  # the running mean the loss updates is written back as well
  assert float(jnp.abs(model.mean.value).sum()) > 0


def test_step_counter_and_opt_state_are_variables():
  model = MLP(rngs=sr.Rngs(0))
  opt = sr.Optimizer(model, optax.adam(1e-3))
  assert int(opt.step.value) == 0
  x, y = batches(1)[0]
  for i in range(3):
    opt.update(sr.grad(loss_fn)(model, x, y))
    assert int(opt.step.value) == i + 1
  opt_state = sr.state(opt, sr.OptState)
  assert ("step",) in opt_state.flat()
  # adam's count and both moments for all four params, plus the step counter
  assert len(opt_state.flat()) == 1 + 1 + 2 * 4
  assert all(
    isinstance(v, sr.OptState) for _, v in opt.iter_variables() if v.collection == "opt_state"
  )


def test_wrt_filter_leaves_other_variables_alone():
  model = MLP(rngs=sr.Rngs(0))
  x, y = batches(1)[0]
  untouched = {path: v.value for path, v in model.iter_variables() if "l1" not in path}
  only_l1 = sr.PathContains("l1")
  opt = sr.Optimizer(model, optax.sgd(0.1), wrt=only_l1)

  grads = sr.grad(loss_fn, wrt=only_l1)(model, x, y)
  assert list(grads.flat()) == [("l1", "bias"), ("l1", "kernel")]
  mean_after_grad = model.mean.value
  kernel_before = model.l1.kernel.value
  opt.update(grads)

  for path, var in model.iter_variables():
    if path == ("mean",):
      assert var.value is mean_after_grad  # the loss updated it; the optimizer did not
    elif "l1" not in path:
      assert var.value is untouched[path]
  np.testing.assert_allclose(
    model.l1.kernel.value, kernel_before - 0.1 * grads["l1"]["kernel"], rtol=1e-6
  )


def test_grads_that_do_not_match_name_the_path():
  model = MLP(rngs=sr.Rngs(0))
  x, y = batches(1)[0]
  before = {path: v.value for path, v in model.iter_variables()}

  opt = sr.Optimizer(model, optax.sgd(0.1), wrt=sr.PathContains("l1"))
  all_params = sr.grad(loss_fn)(model, x, y)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"a gradient for `l2.bias`, which is "
    r"not optimized.*Take the gradients with the same filter",
  ):
    opt.update(all_params)

  opt = sr.Optimizer(model, optax.sgd(0.1))
  only_l2 = sr.grad(loss_fn, wrt=sr.PathContains("l2"))(model, x, y)
  with pytest.raises(sr.StateMismatchError, match=r"no gradient for `l1.bias`"):
    opt.update(only_l2)

  with pytest.raises(TypeError, match=r"takes the State of gradients from sr.grad, got dict"):
    opt.update({"l1": {}})

  for path, var in model.iter_variables():
    if path != ("mean",):  # sr.grad's loss updated the running mean
      assert var.value is before[path]
  assert int(opt.step.value) == 0


def test_a_model_changed_after_the_optimizer_was_made_is_an_error():
  model = MLP(rngs=sr.Rngs(0))
  opt = sr.Optimizer(model, optax.adam(0.1))
  model.extra = sr.Param(jnp.ones(3))
  grads = sr.grad(lambda m: m.extra.value.sum() + m.l1.bias.value.sum())(model)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"changed since the Optimizer was made "
    r"\(a new variable at `extra`\).*Make a new `sr.Optimizer\(model, tx\)`",
  ):
    opt.update(grads)
  np.testing.assert_array_equal(model.extra.value, jnp.ones(3))


def test_mismatch_message_spells_the_filter_as_typed():
  model = MLP(rngs=sr.Rngs(0))
  opt = sr.Optimizer(model, optax.sgd(0.1))
  grads = sr.grad(lambda m: m.l1.bias.value.sum(), wrt=sr.PathContains("l1"))(model)
  with pytest.raises(sr.StateMismatchError, match=r"`sr.grad\(loss_fn, wrt=sr.Param\)"):
    opt.update(grads)


def test_a_sharded_model_s_optimizer_compiles_its_step_once():
  # The step count and optax's counters are made on the parameters' mesh, replicated,
  # as the jitted step gives them back: the second step finds its inputs' shardings
  # unchanged and does not compile again.
  import optax

  mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  model = sr.nn.Linear(4, 4, kernel_metadata={"sharding": (None, "mlp")}, rngs=sr.Rngs(0))
  sr.shard(model, mesh, [("mlp", "model")])
  opt = sr.Optimizer(model, optax.adam(0.1))
  assert opt.step.value.sharding == jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  traces = []

  @sr.jit
  def step(model, opt, x):
    traces.append(1)
    loss, grads = sr.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(grads)
    return loss

  for _ in range(3):
    step(model, opt, jnp.ones((2, 4)))
  assert len(traces) == 1 and int(opt.step.value) == 3
