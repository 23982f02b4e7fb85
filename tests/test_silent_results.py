"""Never a silent wrong or stale result: each misuse raises (naming the path and the
fix) or does the one right thing, and leaves the user's objects unchanged and usable."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import statefulremat as sr


class Block(sr.Module):
  def __init__(self, dim=4, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.BatchNorm(dim, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.norm(self.linear(x)))


def snapshot(model):
  return [
    np.asarray(
      jax.random.key_data(x) if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key) else x
    )
    for x in jax.tree.leaves(sr.state(model))
  ]


def assert_unchanged(model, snap):
  now = snapshot(model)
  assert len(now) == len(snap)
  for a, b in zip(now, snap):
    np.testing.assert_array_equal(a, b)


X = jnp.arange(8.0).reshape(2, 4) / 8


# -- 1. a stack scanned with rules that do not slice it --------------------------------


def test_scanning_a_stack_without_slicing_its_layer_axis_raises():
  stack = sr.vmap(Block, axis_size=3)(rngs=sr.Rngs(0))
  snap = snapshot(stack)
  body = lambda layer, x: (layer(x), None)
  with pytest.raises(
    sr.TransformError,
    match=r"`linear\.bias` \(Param\) of the stacked VmapBlock carries the "
    r"layer axis \(axis 0, 3 layers\).*whole stack where one layer was "
    r"meant. Fix: slice it per layer, e.g. `variable_axes=\{sr\.Param: 0\}`",
  ):
    sr.scan(body, length=3)(stack, X)
  assert_unchanged(stack, snap)
  # BatchStats too: slicing params only still leaves the statistics whole.
  with pytest.raises(
    sr.TransformError,
    match=r"`norm\.mean` \(BatchStat\).*"
    r"`variable_axes=\{sr\.BatchStat: 0\}`",
  ):
    sr.scan(body, variable_axes={sr.Param: 0})(stack, X)
  assert_unchanged(stack, snap)


def test_scanning_a_stack_with_slicing_rules_equals_the_python_loop():
  stack = sr.vmap(Block, axis_size=3)(rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  y, _ = sr.scan(lambda layer, x: (layer(x), None), variable_axes={sr.Param: 0, sr.BatchStat: 0})(
    stack, X
  )
  expected = X
  for layer in layers:
    expected = layer(expected)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
  for i, layer in enumerate(layers):  # the statistics came back per layer
    np.testing.assert_allclose(stack.norm.mean.value[i], layer.norm.mean.value, atol=1e-6)


# -- 2. a module reached by closure ------------------------------------------------------


def test_sr_jit_closing_over_a_module_raises_instead_of_going_stale():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))

  @sr.jit
  def predict(x):
    return model(x)

  with pytest.raises(
    sr.TraceContextError,
    match=r"sr\.jit\(predict\) read `(kernel|bias)` \(Param\) of a Linear that it "
    r"was not given as an argument.*go stale.*Fix: pass the module as an "
    r"argument",
  ):
    predict(jnp.ones((1, 2)))

  # As an argument it follows every update.
  @sr.jit
  def predict2(model, x):
    return model(x)

  opt = sr.Optimizer(model, optax.sgd(0.1))
  before = predict2(model, jnp.ones((1, 2)))
  opt.update(jax.tree.map(jnp.ones_like, sr.state(model, sr.Param)))
  after = predict2(model, jnp.ones((1, 2)))
  np.testing.assert_allclose(after, model(jnp.ones((1, 2))), rtol=1e-6)
  assert not np.allclose(before, after)


@pytest.mark.parametrize("transform", ["grad", "value_and_grad", "remat", "scan", "vmap"])
def test_every_transform_refuses_a_closure_captured_module(transform):
  captured = Block(rngs=sr.Rngs(1))
  snap = snapshot(captured)
  arg = Block(rngs=sr.Rngs(2))
  stack = sr.vmap(Block, axis_size=2)(rngs=sr.Rngs(3))
  calls = {
    "grad": lambda: sr.grad(lambda m: jnp.sum(captured(X)) + jnp.sum(m(X)))(arg),
    "value_and_grad": lambda: sr.value_and_grad(lambda m: jnp.sum(captured(X) * m(X)))(arg),
    "remat": lambda: sr.remat(lambda m, x: captured(m(x)))(arg, X),
    "scan": lambda: sr.scan(lambda m, x: (captured(m(x)), None), variable_axes={True: 0})(stack, X),
    "vmap": lambda: sr.vmap(lambda m, x: captured(m(x)), in_axes=None)(stack, X),
  }
  with pytest.raises(
    sr.TraceContextError,
    match=r"read `linear\.(kernel|bias)` \(Param\) of a "
    r"Block that it was not given as an argument",
  ):
    calls[transform]()
  assert_unchanged(captured, snap)
  captured(X)  # still usable


def test_a_closure_captured_rngs_is_refused_it_would_replay_one_key():
  rngs = sr.Rngs(0)

  @sr.jit
  def noise(x):
    return x + jax.random.normal(rngs.dropout(), x.shape)

  with pytest.raises(sr.TraceContextError, match=r"`default\.count` \(RngCount\) of a Rngs"):
    noise(jnp.zeros(3))
  assert int(rngs.default.count.value) == 0


def test_modules_made_inside_the_trace_and_outer_tracers_are_fine():
  @sr.jit
  def make_and_use(x):
    layer = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))  # created in the trace: a constant
    return layer(x)

  assert make_and_use(jnp.ones((1, 2))).shape == (1, 2)

  model = Block(rngs=sr.Rngs(0))
  stack = sr.vmap(Block, axis_size=2)(rngs=sr.Rngs(1))

  @sr.jit
  def outer(model, stack, x):
    # The scan body closes over `model`, an argument of the enclosing sr.jit: its
    # values are that trace's tracers, current on every call.
    return sr.scan(lambda layer, h: (layer(h) + model.linear(h), None), variable_axes={True: 0})(
      stack, x
    )[0]

  assert outer(model, stack, X).shape == X.shape


# -- 3. assigning over a Variable -----------------------------------------------------


def test_augmented_assignment_updates_the_variable_in_place():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  kernel = model.kernel
  before = np.asarray(kernel.value)
  model.kernel += 1
  model.kernel *= 2
  assert model.kernel is kernel and isinstance(model.kernel, sr.Param)
  np.testing.assert_allclose(model.kernel.value, (before + 1) * 2)
  assert ("kernel",) in sr.state(model).flat()

  @sr.jit
  def step(model):
    model.bias += 1  # in place inside a transform too: written back

  step(model)
  np.testing.assert_allclose(model.bias.value, [1.0, 1.0])


@pytest.mark.parametrize(
  "value", [lambda m: m.kernel * 2, lambda m: np.zeros((2, 2)), lambda m: 3.0]
)
def test_assigning_an_array_over_a_variable_raises(value):
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  snap = snapshot(model)
  kernel = model.kernel
  with pytest.raises(
    sr.GraphError,
    match=r"`kernel` holds a Param; assigning .* over it "
    r"would replace the Variable.*Fix: write the Variable's value, "
    r"`kernel\.value = \.\.\.`",
  ):
    model.kernel = value(model)
  assert model.kernel is kernel
  assert_unchanged(model, snap)
  model.kernel = sr.Param(jnp.zeros((2, 2)))  # a Variable replaces a Variable
  del model.bias
  model.bias = 0.0  # once deleted, the name is free
  assert model.bias == 0.0


def test_nested_path_is_named():
  model = Block(rngs=sr.Rngs(0))
  with pytest.raises(sr.GraphError, match=r"`linear\.kernel` holds a Param"):
    model.linear.kernel = model.linear.kernel * 2


def test_variable_item_assignment_works_as_in_flax_nnx():
  w = sr.Param(jnp.zeros((2, 3)))
  w[0, 1] = 5.0
  w[1] = jnp.arange(3.0)
  assert w[...].shape == (2, 3)
  w[...] = w[...] * 2
  np.testing.assert_allclose(w.value, [[0, 10, 0], [0, 2, 4]])
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))

  @sr.jit
  def zero_first_row(model):
    model.kernel[0] = 0.0

  zero_first_row(model)
  np.testing.assert_array_equal(model.kernel.value[0], [0.0, 0.0])


# -- 4. a wrt filter that matches nothing ------------------------------------------------


def test_grad_with_a_filter_that_matches_nothing_raises():
  model = Block(rngs=sr.Rngs(0))
  snap = snapshot(model)
  with pytest.raises(
    sr.TransformError,
    match=r"wrt='param' matches no variable of argument 0 \(a Block\).*"
    r"collections: 'params' \(4\), 'batch_stats' \(2\)\. Did you mean "
    r"`wrt='params'`\?",
  ):
    sr.grad(lambda m: jnp.sum(m(X)), wrt="param")(model)
  with pytest.raises(sr.TransformError, match=r"wrt=sr\.Cache matches no variable"):
    sr.value_and_grad(lambda m: jnp.sum(m(X)), wrt=sr.Cache)(model)
  assert_unchanged(model, snap)
  assert set(sr.grad(lambda m: jnp.sum(m(X)), wrt="params")(model).flat()) == {
    ("linear", "bias"),
    ("linear", "kernel"),
    ("norm", "bias"),
    ("norm", "scale"),
  }


def test_a_loss_returning_a_pair_without_has_aux_says_so():
  model = Block(rngs=sr.Rngs(0))
  with pytest.raises(
    TypeError,
    match=r"returned a tuple of length 2, not a scalar loss.*"
    r"pass `has_aux=True`",
  ):
    sr.grad(lambda m: (jnp.sum(m(X)), {"acc": 1.0}))(model)
  (loss, aux), _ = sr.value_and_grad(lambda m: (jnp.sum(m(X)), 1.0), has_aux=True)(model)
  assert aux == 1.0


# -- 5. sr.update with other shapes or dtypes ------------------------------------------


def test_update_with_other_shapes_or_dtypes_raises_and_writes_nothing():
  model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  snap = snapshot(model)
  state = sr.state(model)
  bad = sr.State({"bias": jnp.zeros(4), "kernel": jnp.zeros((2, 3), jnp.int32)})
  with pytest.raises(
    sr.StateMismatchError,
    match=r"(?s)2 value\(s\) do not have the shape and dtype.*nothing was "
    r"written.*`bias`: float32\[3\] -> float32\[4\].*`kernel`: "
    r"float32\[2, 3\] -> int32\[2, 3\]",
  ):
    sr.update(model, bad)
  assert_unchanged(model, snap)
  # One good entry and one bad: still nothing written.
  half = sr.State({"bias": jnp.ones(3), "kernel": jnp.zeros((3, 2))})
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`kernel`: float32\[2, 3\] -> "
    r"float32\[3, 2\]",
  ):
    sr.update(model, half)
  assert_unchanged(model, snap)
  sr.update(model, jax.tree.map(lambda x: x + 1, state))  # same shapes: fine


def test_update_moves_state_between_a_stack_layer_and_a_plain_module():
  stack = sr.vmap(Block, axis_size=3)(rngs=sr.Rngs(0))
  plain = Block(rngs=sr.Rngs(5))
  sr.update(plain, sr.state(stack.layer(1)))
  np.testing.assert_array_equal(plain.linear.kernel.value, stack.linear.kernel.value[1])
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`linear\.kernel`: float32\[4, 4\] -> "
    r"float32\[3, 4, 4\]",
  ):
    sr.update(plain, sr.state(stack))


# -- 6. a variable named by both variable_axes and variable_broadcast / carry ------------


def test_explicit_axes_and_broadcast_on_one_variable_raise():
  stack = sr.vmap(Block, axis_size=2)(rngs=sr.Rngs(0))
  snap = snapshot(stack)
  body = lambda layer, x: (layer(x), None)
  with pytest.raises(
    sr.TransformError,
    match=r"`linear\.bias` \(Param\) is matched by both variable_axes "
    r"\(sr\.Param: sliced per iteration\) and variable_broadcast",
  ):
    sr.scan(body, variable_axes={sr.Param: 0, sr.BatchStat: 0}, variable_broadcast=sr.Param)(
      stack, X
    )
  with pytest.raises(
    sr.TransformError,
    match=r"`norm\.mean` \(BatchStat\) is matched by both variable_axes "
    r"\('batch_stats': sliced per iteration\) and variable_carry",
  ):
    sr.scan(body, variable_axes={sr.Param: 0, "batch_stats": 0}, variable_carry="batch_stats")(
      stack, X
    )
  assert_unchanged(stack, snap)


def test_the_all_variables_default_yields_to_broadcast_and_carry():
  class Shared(sr.Module):
    def __init__(self, *, rngs):
      self.w = sr.Param(jax.random.normal(rngs.params(), (4, 4)) * 0.3)
      self.scale = sr.Variable(jnp.float32(0.5))

    def __call__(self, x):
      return jnp.tanh(x @ self.w.value) * self.scale.value

  stack = sr.vmap(Shared, axis_size=4, variable_broadcast="variables")(rngs=sr.Rngs(0))
  assert stack.w.shape == (4, 4, 4) and stack.scale.shape == ()
  y = sr.remat_scan(lambda m, c: m(c), lengths=(2, 2), variable_broadcast="variables")(stack, X)
  expected = X
  for layer in sr.unstack(stack):
    expected = layer(expected)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


# -- 7. remat's static_argnums out of range ---------------------------------------------


def test_remat_static_argnums_outside_the_call_raises():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  f = sr.remat(lambda m, x: m(x), static_argnums=(3,))
  with pytest.raises(
    TypeError,
    match=r"static_argnums=\(3,\) names position 3, but the "
    r"call has 2 positional argument\(s\)",
  ):
    f(model, jnp.ones((1, 2)))
  with pytest.raises(TypeError, match=r"names position -3"):
    sr.remat(lambda m, x: m(x), static_argnums=-3)(model, jnp.ones((1, 2)))


# -- 8. RNG splitting ---------------------------------------------------------------


class Noisy(sr.Module):
  def __init__(self, *, rngs):
    self.w = sr.Param(jax.random.normal(rngs.params(), (3,)))
    self.rngs = rngs

  def __call__(self, x):
    return x, jax.random.uniform(self.rngs.dropout(), ())


def test_class_form_scan_splits_params_at_init_by_default():
  stack = sr.scan(Noisy, length=4, variable_axes={sr.Param: 0})(rngs=sr.Rngs(0))
  w = np.asarray(stack.w.value)
  assert len({tuple(row) for row in w}) == 4  # four different layers
  same = sr.scan(Noisy, length=4, variable_axes={sr.Param: 0}, split_rngs={"params": False})(
    rngs=sr.Rngs(0)
  )
  assert len({tuple(row) for row in np.asarray(same.w.value)}) == 1  # asked for


@pytest.mark.parametrize("rngs", [lambda: sr.Rngs(0), lambda: sr.Rngs(params=0, dropout=1)])
def test_split_rules_hold_for_each_name_whatever_stream_serves_it(rngs):
  shared = sr.scan(
    Noisy, length=3, variable_axes={sr.Param: 0}, split_rngs={"params": True, "dropout": False}
  )(rngs=rngs())
  _, draws = shared(jnp.zeros(()))
  assert len(set(np.asarray(draws).tolist())) == 1  # dropout not split: one key
  assert len({tuple(r) for r in np.asarray(shared.w.value)}) == 3  # params were
  split = sr.scan(
    Noisy, length=3, variable_axes={sr.Param: 0}, split_rngs={"params": True, "dropout": True}
  )(rngs=rngs())
  _, draws = split(jnp.zeros(()))
  assert len(set(np.asarray(draws).tolist())) == 3
  _, again = split(jnp.zeros(()))  # the stream advanced: no replay
  assert not set(np.asarray(again).tolist()) & set(np.asarray(draws).tolist())


def test_vmap_split_rules_per_name_on_a_default_stream():
  model = sr.nn.Dropout(0.5, rngs=sr.Rngs(0))
  body = lambda m, x: m(x)
  x = jnp.ones((4, 16))
  same = sr.vmap(body, split_rngs={"dropout": False, "params": True})(model, x)
  assert all((np.asarray(same[0]) == np.asarray(row)).all() for row in same)
  apart = sr.vmap(body, split_rngs={"dropout": True})(model, x)
  assert not all((np.asarray(apart[0]) == np.asarray(row)).all() for row in apart)


# -- errors that teach ---------------------------------------------------------------


def test_a_carry_that_changes_structure_names_the_python_types():
  stack = sr.vmap(sr.nn.Linear, axis_size=4)(2, 2, rngs=sr.Rngs(0))
  with pytest.raises(
    sr.TransformError,
    match=r"`<carry>` went in as a tuple of 2 and "
    r"came out as a list of 2",
  ):
    sr.remat_scan(lambda m, c: [m(c[0]), c[1]], lengths=(2, 2))(
      stack, (jnp.ones((1, 2)), jnp.ones(2))
    )
  with pytest.raises(
    sr.TransformError,
    match=r"`\['b'\]` went in as an array of shape "
    r"\(2,\) and came out as a tuple of 1",
  ):
    sr.remat_scan(lambda m, c: {"a": m(c["a"]), "b": (c["b"],)}, lengths=(4,))(
      stack, {"a": jnp.ones((1, 2)), "b": jnp.ones(2)}
    )


def test_stack_of_differing_layers_names_the_first_difference():
  Stack = sr.vmap(Block, axis_size=2)
  a, b = Block(4, rngs=sr.Rngs(0)), Block(5, rngs=sr.Rngs(1))
  with pytest.raises(
    sr.TransformError,
    match=r"layer 1 is not structured like layer 0: "
    r"`linear\.in_features` is 4 in layer 0 but 5 here",
  ):
    sr.stack([a, b], like=Stack)
  b = Block(4, rngs=sr.Rngs(1)).eval()
  with pytest.raises(
    sr.TransformError,
    match=r"`norm\.use_running_average` is False in "
    r"layer 0 but True here.*same mode",
  ):
    sr.stack([a, b], like=Stack)
  # Without like=: layers from sr.unstack, one of them resized by hand.
  layers = sr.unstack(Stack(rngs=sr.Rngs(0)))
  layers[1].linear.kernel.value = jnp.zeros((4, 5))
  with pytest.raises(
    sr.TransformError,
    match=r"`linear\.kernel` of layer 1 does not have "
    r"the shape and dtype of layer 0's: float32\[4, 4\] \(layer 0\) vs "
    r"float32\[4, 5\] \(layer 1\)",
  ):
    sr.stack(layers)


def test_a_variable_made_on_one_layers_path_of_a_stack_says_it_is_not_stacked():
  class Attn(sr.Module):
    def __init__(self, *, rngs):
      self.attn = sr.nn.MultiHeadAttention(2, 4, decode=True, rngs=rngs)

    def __call__(self, x):
      return self.attn(x)

  stack = sr.vmap(Attn, axis_size=2)(rngs=sr.Rngs(0))
  stack.attn.init_cache((1, 6, 4))  # stacked: one cache per layer (tests/test_stack_decode)
  stack.attn.cache_index = sr.Cache(jnp.array(0))  # one layer's counter, by hand
  with pytest.raises(
    sr.TransformError,
    match=r"`attn\.cache_index` \(Cache\) along axis 0 per layer, but it "
    r"is a scalar.*not stacked.*assigned on a stack's path.*Fix: make "
    r"it per layer",
  ):
    sr.scan(lambda m, x: (m(x), None), variable_axes={True: 0})(stack, jnp.ones((1, 1, 4)))


def test_train_false_is_eval_as_in_pytorch():
  model = Block(rngs=sr.Rngs(0))
  assert model.train(False).norm.use_running_average is True
  assert model.train().norm.use_running_average is False
  with pytest.raises(TypeError, match=r"train\(mode\) takes True or False"):
    model.train("eval")


def test_pickle_round_trips_a_module_and_a_stack():
  model = Block(rngs=sr.Rngs(0))
  model(X)
  again = pickle.loads(pickle.dumps(model))
  assert type(again) is Block
  for a, b in zip(snapshot(again), snapshot(model)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(again(X), model(X), rtol=1e-6)
  assert again.linear.kernel.path_str() == "linear.kernel"
  state = pickle.loads(pickle.dumps(sr.state(model)))
  sr.update(Block(rngs=sr.Rngs(9)), state)
  # A stack's class, made by sr.vmap, pickles as that call (tests/test_pickle_stacks.py).
  stack = sr.vmap(Block, axis_size=2)(rngs=sr.Rngs(0))
  again = pickle.loads(pickle.dumps(stack))
  assert type(again) is type(stack)
  for a, b in zip(snapshot(again), snapshot(stack)):
    np.testing.assert_array_equal(a, b)
