"""sr.scan: lax.scan over modules == the Python loop over the layers; collection rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr

L, D = 3, 4
X = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)


class Block(sr.Module):
  """Linear + BatchNorm (training mode) with a residual; ys are the row sums."""

  def __init__(self, d, *, rngs, kernel_metadata=None):
    self.linear = sr.nn.Linear(d, d, kernel_metadata=kernel_metadata or {}, rngs=rngs)
    self.bn = sr.nn.BatchNorm(d, momentum=0.5, rngs=rngs)

  def __call__(self, x):
    x = x + jnp.tanh(self.bn(self.linear(x)))
    return x, x.sum(-1)


class Cell(sr.Module):
  """An RNN cell, linen's LSTM style: broadcast params, one BatchNorm over time steps."""

  def __init__(self, d, *, rngs):
    self.bn = sr.nn.BatchNorm(d, momentum=0.5, rngs=rngs)
    self.w = sr.Param(jax.nn.initializers.lecun_normal()(rngs.params(), (d, d)))

  def __call__(self, h, x):
    h = jnp.tanh(self.bn(x) @ self.w.value + h)
    return h, 2 * h


class Dense(sr.Module):
  """One weight, possibly carrying a layer axis, and a per-call counter."""

  def __init__(self, w, calls=None):
    self.w = sr.Param(w)
    if calls is not None:
      self.calls = sr.BatchStat(calls)

  def __call__(self, h, x=None):
    h = jnp.tanh(h @ self.w.value)
    return h, h.sum(-1)


class Noise(sr.Module):
  """Draws one dropout mask per call from a stored Rngs."""

  def __init__(self, rngs):
    self.rngs = rngs

  def __call__(self, carry, *xs):
    return carry, jax.random.bernoulli(self.rngs.dropout(), 0.5, (32,))


class Layers(sr.Module):
  def __init__(self, layers):
    self.layers = layers


def stack_cls(**options):
  return sr.scan(
    Block,
    length=L,
    variable_axes={sr.Param: 0, sr.BatchStat: 0},
    split_rngs={"params": True, "dropout": True},
    **options,
  )


def values(module):
  out = {}
  for path, v in sr.state(module).flat().items():
    if jnp.issubdtype(jnp.result_type(v), jax.dtypes.prng_key):
      v = jax.random.key_data(v)
    out[path] = np.asarray(v)
  return out


def assert_unchanged(module, before):
  after = values(module)
  assert after.keys() == before.keys()
  for path in before:
    np.testing.assert_array_equal(after[path], before[path], err_msg=str(path))


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def weights(n=L, d=D, seed=0):
  # NumPy draws: nothing to compile.
  return jnp.asarray(np.random.default_rng(seed).standard_normal((n, d, d)) / d, jnp.float32)


def loop(layers, carry, xs=None):
  ys = []
  for i, layer in enumerate(layers):
    carry, y = layer(carry) if xs is None else layer(carry, xs[i])
    ys.append(y)
  return carry, jnp.stack(ys)


# -- class form: vmapped init, equivalence with the Python loop -----------------------


def test_class_form_builds_distinct_layers_in_one_traced_init():
  inits = []

  class Counted(Block):
    def __init__(self, d, *, rngs):
      inits.append(d)
      super().__init__(d, rngs=rngs)

  rngs = sr.Rngs(0)
  stack = sr.scan(
    Counted,
    length=L,
    variable_axes={sr.Param: 0, sr.BatchStat: 0},
    split_rngs={"params": True, "dropout": True},
  )(D, rngs=rngs)
  assert isinstance(stack, Counted) and type(stack).__name__ == "ScanCounted"
  assert len(stack) == L
  assert stack.linear.kernel.shape == (L, D, D)
  assert stack.bn.mean.shape == (L, D)
  kernels = np.asarray(stack.linear.kernel.value)
  for i in range(L):
    for j in range(i):
      assert not np.allclose(kernels[i], kernels[j])
  # One traced init (shapes, then the vmapped init), not one Python init per layer;
  # the params stream advanced once.
  assert len(inits) <= 2 < L
  assert int(rngs.default.count.value) == 1
  layers = sr.unstack(stack)
  assert [type(layer) for layer in layers] == [Counted] * L
  close(layers[1].linear.kernel.value, kernels[1], 0)


def test_class_form_layers_are_initialised_like_single_layers():
  # Layer i draws its keys from the params stream folded with i.
  stack = stack_cls()(D, rngs=sr.Rngs(0))
  key = jax.random.fold_in(jax.random.key(0), 0)
  for i, layer in enumerate(sr.unstack(stack)):
    single = Block(D, rngs=sr.Rngs(jax.random.fold_in(key, i)))
    close(layer.linear.kernel.value, single.linear.kernel.value, 1e-6)


def test_scan_equals_the_python_loop_over_unstacked_layers():
  stack = stack_cls()(D, rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  y, ys = stack(X)
  y0, ys0 = loop(layers, X)
  close(y, y0)
  close(ys, ys0)
  assert ys.shape == (L, 2)
  for i, layer in enumerate(layers):
    close(stack.bn.mean.value[i], layer.bn.mean.value)
    close(stack.bn.var.value[i], layer.bn.var.value)
  assert not np.allclose(stack.bn.mean.value, 0.0)
  # Parameters were only read: unchanged.
  for i, layer in enumerate(layers):
    close(stack.linear.kernel.value[i], layer.linear.kernel.value, 0)


def test_grad_through_scan_equals_grad_through_the_loop():
  stack = stack_cls()(D, rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  g = sr.grad(lambda s, x: jnp.sum(s(x)[0] ** 2))(stack, X)

  def loop_loss(model, x):
    return jnp.sum(loop(model.layers, x)[0] ** 2)

  g_loop = sr.grad(loop_loss)(Layers(layers), X)["layers"]
  assert g["linear"]["kernel"].shape == (L, D, D)
  for i in range(L):
    close(g["linear"]["kernel"][i], g_loop[i]["linear"]["kernel"])
    close(g["bn"]["scale"][i], g_loop[i]["bn"]["scale"])
  for i, layer in enumerate(layers):
    close(stack.bn.mean.value[i], layer.bn.mean.value)


def test_function_form_over_a_module_with_stacked_weights():
  w = weights()
  model = Dense(w)
  h, ys = sr.scan(Dense.__call__, variable_axes={sr.Param: 0})(model, X)
  h0, ys0 = loop([Dense(w[i]) for i in range(L)], X)
  close(h, h0)
  close(ys, ys0)


def test_modules_in_a_pytree_as_argument_0():
  w1, w2 = weights(seed=1), weights(seed=2)

  def body(pair, h):
    h, _ = pair["a"](h)
    h, _ = pair["b"](h)
    return h, None

  h, ys = sr.scan(body, variable_axes={sr.Param: 0})({"a": Dense(w1), "b": Dense(w2)}, X)
  assert ys is None
  h0 = X
  for i in range(L):
    h0 = jnp.tanh(jnp.tanh(h0 @ w1[i]) @ w2[i])
  close(h, h0)


def test_carried_batch_norm_over_time_steps_equals_stepping():
  Scanned = sr.scan(Cell, variable_carry="batch_stats", variable_broadcast=sr.Param)
  cell = Scanned(D, rngs=sr.Rngs(0))  # no length: it comes from xs at call time
  assert cell.w.shape == (D, D) and cell.bn.mean.shape == (D,)
  step = Cell(D, rngs=sr.Rngs(7))
  sr.update(step, sr.state(cell))
  xs = jnp.linspace(-2.0, 3.0, 5 * 2 * D).reshape(5, 2, D)
  h, hs = cell(jnp.zeros((2, D)), xs)
  h0, hs0 = jnp.zeros((2, D)), []
  for x in xs:
    h0, y = step(h0, x)
    hs0.append(y)
  close(h, h0)
  close(hs, jnp.stack(hs0))
  close(cell.bn.mean.value, step.bn.mean.value)
  close(cell.bn.var.value, step.bn.var.value)
  assert not np.allclose(cell.bn.mean.value, 0.0)
  close(cell.w.value, step.w.value, 0)


def test_carried_variable_function_form():
  model = Dense(jnp.eye(D), calls=jnp.zeros(()))

  def body(m, h, x):
    m.calls.value = m.calls.value + 1
    return h + x, m.calls.value

  h, ys = sr.scan(body, variable_carry=sr.BatchStat, variable_broadcast=sr.Param)(
    model, jnp.zeros(D), jnp.ones((4, D))
  )
  close(h, 4 * jnp.ones(D))
  close(ys, [1.0, 2.0, 3.0, 4.0])
  assert float(model.calls.value) == 4.0


# -- RNG streams ---------------------------------------------------------------------


@pytest.mark.parametrize(
  "rngs", [lambda: sr.Rngs(dropout=1), lambda: sr.Rngs(0)], ids=["own-stream", "default-stream"]
)
def test_dropout_masks_differ_per_iteration_iff_split(rngs):
  split, shared = Noise(rngs()), Noise(rngs())
  # Under sr.jit: the second call reuses the compiled scan, with the stream's count
  # as traced state.
  f_split = sr.jit(sr.scan(Noise.__call__, length=4, split_rngs={"dropout": True}))
  f_shared = sr.jit(sr.scan(Noise.__call__, length=4))
  _, masks = f_split(split, jnp.zeros(()))
  _, same = f_shared(shared, jnp.zeros(()))
  masks, same = np.asarray(masks), np.asarray(same)
  assert all(not np.array_equal(masks[i], masks[j]) for i in range(4) for j in range(i))
  assert all(np.array_equal(same[0], same[i]) for i in range(4))
  stream = lambda n: n.rngs.dropout if "dropout" in n.rngs else n.rngs.default
  assert int(stream(split).count.value) == 1
  assert int(stream(shared).count.value) == 1
  # A second call never replays masks: the stream advanced once per call.
  _, again = f_split(split, jnp.zeros(()))
  _, same_again = f_shared(shared, jnp.zeros(()))
  assert int(stream(split).count.value) == 2 and int(stream(shared).count.value) == 2
  assert not np.array_equal(np.asarray(again), masks)
  assert not np.array_equal(np.asarray(same_again)[0], same[0])


def test_split_streams_with_false_are_shared():
  noise = Noise(sr.Rngs(dropout=1))
  _, masks = sr.scan(Noise.__call__, length=3, split_rngs={"dropout": False})(noise, jnp.zeros(()))
  assert all(np.array_equal(masks[0], masks[i]) for i in range(3))


def test_dropout_inside_a_scanned_stack():

  class Drop(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(D, D, rngs=rngs)
      self.drop = sr.nn.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return x, self.drop(self.linear(jnp.ones((8, D))) + 1.0)

  rngs = sr.Rngs(params=0, dropout=1)
  Stack = sr.scan(
    Drop, length=L, variable_axes={sr.Param: 0}, split_rngs={"params": True, "dropout": True}
  )
  stack = Stack(rngs=rngs)
  assert stack.drop.rngs is rngs  # the constructor's Rngs is shared, not stacked
  _, ys = stack(X)
  kept = np.asarray(ys != 0)
  assert all(not np.array_equal(kept[i], kept[j]) for i in range(L) for j in range(i))
  assert int(rngs.dropout.count.value) == 1 and int(rngs.params.count.value) == 1


def test_rng_state_stacked_by_the_init_is_scanned_like_any_stacked_variable():

  class OwnRngs(sr.Module):
    def __init__(self, *, rngs):
      self.rngs = sr.Rngs(dropout=rngs.params())

    def __call__(self, carry):
      return carry, jax.random.bernoulli(self.rngs.dropout(), 0.5, (32,))

  stack = sr.scan(OwnRngs, length=L, variable_axes={...: 0}, split_rngs={"params": True})(
    rngs=sr.Rngs(0)
  )
  assert stack.rngs.dropout.count.shape == (L,)
  layer = stack.layer(1)
  _, first = stack(None)
  _, second = stack(None)
  np.testing.assert_array_equal(stack.rngs.dropout.count.value, [2] * L)
  assert all(not np.array_equal(first[i], first[j]) for i in range(L) for j in range(i))
  assert not np.array_equal(np.asarray(first), np.asarray(second))
  # Layer 1's own stream, taken before the calls, gives the stack's first masks.
  np.testing.assert_array_equal(layer(None)[1], first[1])
  np.testing.assert_array_equal(layer(None)[1], second[1])


def test_a_stream_asked_for_but_absent_raises():
  noise = Noise(sr.Rngs(params=0))
  before = values(noise)
  with pytest.raises(AttributeError, match=r"no 'dropout' stream and no default stream"):
    sr.scan(Noise.__call__, length=2, split_rngs={"dropout": True})(noise, None)
  assert_unchanged(noise, before)


# -- the scan options ----------------------------------------------------------------


def test_reverse_equals_the_reversed_loop():
  w = weights()
  xs = jnp.linspace(0.0, 1.0, L * D).reshape(L, D)

  def body(m, h, x):
    h = jnp.tanh(h @ m.w.value + x)
    return h, h

  h, hs = sr.scan(body, variable_axes={sr.Param: 0}, reverse=True)(Dense(w), X[0], xs)
  h0, hs0 = X[0], [None] * L
  for i in reversed(range(L)):
    h0 = jnp.tanh(h0 @ w[i] + xs[i])
    hs0[i] = h0
  close(h, h0)
  close(hs, jnp.stack(hs0))


def test_reverse_writes_each_layer_its_own_stats():
  stack = stack_cls(reverse=True)(D, rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  y, ys = stack(X)
  y0, ys0 = loop(layers[::-1], X)
  close(y, y0)
  close(ys, ys0[::-1])
  for i, layer in enumerate(layers):
    close(stack.bn.mean.value[i], layer.bn.mean.value)
    close(stack.bn.var.value[i], layer.bn.var.value)


def test_class_form_methods():

  class TwoWays(Block):
    def step(self, x, scale):
      return jnp.tanh(self.linear(x) * scale), None

  Stack = sr.scan(
    TwoWays,
    length=L,
    variable_axes={sr.Param: 0, sr.BatchStat: 0},
    split_rngs={"params": True},
    in_axes=None,
    methods=["step"],
  )
  stack = Stack(D, rngs=sr.Rngs(0))
  h, _ = stack.step(X, 0.5)
  h0 = X
  for layer in sr.unstack(stack):
    h0, _ = layer.step(h0, 0.5)
  close(h, h0)
  # __call__ is the layer's own, not scanned: it sees the stacked variables.
  with pytest.raises(ValueError, match=r"Linear was built with in_features=4"):
    stack(jnp.ones((2, L)))


def add_body(m, h, *xs):
  total = h
  for x in jax.tree.leaves(xs):
    total = total + x
  return jnp.tanh(total @ m.w.value), total


def test_in_axes_int_other_than_0():
  model = Dense(jnp.eye(D) / 2)
  xs = jnp.arange(2 * 5 * D, dtype=jnp.float32).reshape(2, 5, D) / 40
  h, ys = sr.scan(add_body, in_axes=1)(model, X, xs)
  h0, ys0 = X, []
  for t in range(5):
    h0, y = add_body(model, h0, xs[:, t])
    ys0.append(y)
  close(h, h0)
  close(ys, jnp.stack(ys0))


def test_in_axes_none_broadcasts_and_tuple_per_argument():
  model = Dense(jnp.eye(D) / 2)
  xs = jnp.arange(5 * 2 * D, dtype=jnp.float32).reshape(5, 2, D) / 40
  bias = jnp.full((2, D), 0.25)
  h, ys = sr.scan(add_body, in_axes=(0, None))(model, X, xs, bias)
  h0 = X
  for t in range(5):
    h0, _ = add_body(model, h0, xs[t], bias)
  close(h, h0)
  assert ys.shape == (5, 2, D)


def test_in_axes_pytree_prefix():
  model = Dense(jnp.eye(D) / 2)
  xs = {
    "a": jnp.ones((4, 2, D)),
    "b": (jnp.linspace(0.0, 1.0, 2 * 4 * D).reshape(2, 4, D), jnp.full((2, D), 0.1)),
  }
  h, ys = sr.scan(add_body, in_axes=({"a": 0, "b": (1, None)},))(model, X, xs)
  h0 = X
  for t in range(4):
    h0, _ = add_body(model, h0, xs["a"][t], xs["b"][0][:, t], xs["b"][1])
  close(h, h0)
  assert ys.shape == (4, 2, D)


def test_in_axes_that_do_not_fit():
  model = Dense(jnp.eye(D))
  before = values(model)
  with pytest.raises(sr.TransformError, match=r"in_axes=\(0, 0\) does not fit 1 xs"):
    sr.scan(add_body, in_axes=(0, 0))(model, X, jnp.ones((3, D)))
  with pytest.raises(sr.TransformError, match=r"in_axes entry \{'a': 0\} is not a prefix"):
    sr.scan(add_body, in_axes=({"a": 0},))(model, X, [jnp.ones((3, D))])
  assert_unchanged(model, before)


def test_out_axes():
  model = Dense(jnp.eye(D) / 2)
  xs = jnp.ones((5, 2, D))
  _, ys = sr.scan(add_body, out_axes=1)(model, X, xs)
  _, ys0 = sr.scan(add_body)(model, X, xs)
  assert ys.shape == (2, 5, D)
  close(ys, jnp.moveaxis(ys0, 0, 1), 1e-6)
  _, ys_last = sr.scan(add_body, out_axes=-1)(model, X, xs)
  assert ys_last.shape == (2, D, 5)
  with pytest.raises(sr.TransformError, match=r"out_axes.*None.*ys differ per iteration"):
    sr.scan(add_body, out_axes=None)


def test_length_without_xs():
  model = Dense(jnp.eye(D) / 2)
  h, ys = sr.scan(Dense.__call__, length=4)(model, X)
  h0, ys0 = loop([model] * 4, X)
  close(h, h0)
  close(ys, ys0)


def test_unroll_gives_the_same_result():
  w = weights()
  f = lambda unroll: sr.scan(Dense.__call__, variable_axes={sr.Param: 0}, unroll=unroll)
  h1, ys1 = f(1)(Dense(w), X)
  for unroll in (2, True):
    h, ys = f(unroll)(Dense(w), X)
    close(h, h1)
    close(ys, ys1)
  jaxpr = jax.make_jaxpr(lambda x: f(2)(Dense(w), x))(X)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert eqn.params["unroll"] == 2


def test_variable_axes_at_axis_1():
  w = weights()
  model = Dense(jnp.moveaxis(w, 0, 1), calls=jnp.zeros((2, L)))

  def body(m, h):
    m.calls.value = m.calls.value + jnp.arange(1.0, 3.0)
    return jnp.tanh(h @ m.w.value), None

  h, _ = sr.scan(body, variable_axes={sr.Param: 1, sr.BatchStat: -1})(model, X)
  h0, _ = loop([Dense(w[i]) for i in range(L)], X)
  close(h, h0)
  assert model.w.shape == (D, L, D) and model.calls.shape == (2, L)
  close(model.calls.value, [[1.0] * L, [2.0] * L])


def test_data_transform_gets_a_state_and_its_changes_apply():
  w = weights()
  seen = []

  def double(state):
    seen.append(state)
    return jax.tree.map(lambda v: 2 * v, state)

  h, _ = sr.scan(Dense.__call__, variable_axes={sr.Param: 0}, data_transform=double)(Dense(w), X)
  h0, _ = loop([Dense(2 * w[i]) for i in range(L)], X)
  close(h, h0)
  assert isinstance(seen[0], sr.State) and sorted(seen[0].flat()) == [("w",)]
  assert seen[0]["w"].shape == (D, D)  # one iteration's slice
  assert sorted(seen[0].filter(sr.Param).flat()) == [("w",)]  # kinds are kept
  model = Dense(w)
  with pytest.raises(sr.TransformError, match=r"data_transform must return a State"):
    sr.scan(Dense.__call__, variable_axes={sr.Param: 0}, data_transform=lambda s: s.flat())(
      model, X
    )
  close(model.w.value, w, 0)


def test_metadata_params_partition_name():
  seen, transformed = [], []

  def record(state):
    kernel = state.flat_variables()[("linear", "kernel")]
    stats = sorted(state.filter(sr.BatchStat).flat())
    transformed.append((type(kernel), kernel.sharding, stats))
    return state

  class Recording(Block):
    def __call__(self, x):
      seen.append(self.linear.kernel.sharding)
      return Block.__call__(self, x)

  Stack = sr.scan(
    Recording,
    length=L,
    variable_axes={sr.Param: 0, sr.BatchStat: 0},
    split_rngs={"params": True},
    metadata_params={"partition_name": "layers"},
    data_transform=record,
  )
  stack = Stack(D, kernel_metadata={"sharding": ("embed", "mlp")}, rngs=sr.Rngs(0))
  assert stack.linear.kernel.sharding == ("layers", "embed", "mlp")
  stack(X)
  assert seen == [("embed", "mlp")]
  # data_transform sees each entry's kind and the layer's metadata.
  assert transformed == [(sr.Param, ("embed", "mlp"), [("bn", "mean"), ("bn", "var")])]
  assert stack.linear.kernel.sharding == ("layers", "embed", "mlp")
  assert stack.layer(0).linear.kernel.sharding == ("embed", "mlp")


# -- errors (each leaves the module unchanged) --------------------------------------


def test_writing_to_a_broadcast_variable():
  model = Dense(jnp.eye(D))
  before = values(model)

  def body(m, h):
    m.w.value = m.w.value + 1
    return h, None

  with pytest.raises(
    sr.TransformError,
    match=r"wrote to `w` \(Param, collection 'params'\), which is "
    r"broadcast.*variable_carry='params'.*"
    r"variable_axes=\{'params': 0\}",
  ):
    sr.scan(body, length=2, variable_broadcast=sr.Param)(model, X)
  assert_unchanged(model, before)


def test_writing_to_an_unmatched_variable():
  model = Dense(jnp.eye(D), calls=jnp.zeros(()))
  before = values(model)

  def body(m, h):
    m.calls.value = m.calls.value + 1
    return h, None

  with pytest.raises(
    sr.TransformError,
    match=r"wrote to `calls` \(BatchStat, collection 'batch_stats'\), "
    r"which is matched by no collection rule.*"
    r"variable_carry='batch_stats'",
  ):
    sr.scan(body, length=2)(model, X)
  assert_unchanged(model, before)


def test_a_variable_both_broadcast_and_carried():
  model = Dense(jnp.eye(D))
  before = values(model)
  with pytest.raises(
    sr.TransformError,
    match=r"`w` \(Param\) is matched by both variable_broadcast and "
    r"variable_carry",
  ):
    sr.scan(Dense.__call__, length=2, variable_broadcast=sr.Param, variable_carry="params")(
      model, X
    )
  assert_unchanged(model, before)


def test_carry_that_changes_shape_or_dtype():
  model = Dense(jnp.eye(D))
  before = values(model)
  with pytest.raises(
    sr.TransformError,
    match=r"carry leaf `\['h'\]` went in as float32\[2, 4\] and "
    r"came out as float32\[2, 8\]",
  ):
    sr.scan(lambda m, c, x: ({"h": jnp.concatenate([c["h"], c["h"]], -1)}, None))(
      model, {"h": X}, jnp.ones((3,))
    )
  with pytest.raises(
    sr.TransformError,
    match=r"went in as float32\[2, 4\] and came out as int32\[2, 4\].*"
    r"astype\(jnp.float32\)",
  ):
    sr.scan(lambda m, c: (c.astype(jnp.int32), None), length=2)(model, X)
  with pytest.raises(sr.TransformError, match=r"carry changed structure"):
    sr.scan(lambda m, c: ((c, c), None), length=2)(model, X)
  assert_unchanged(model, before)


def test_carried_variable_that_changes_shape():
  model = Dense(jnp.eye(D), calls=jnp.zeros(()))
  before = values(model)

  def body(m, h):
    m.calls.value = jnp.zeros((2,))
    return h, None

  with pytest.raises(
    sr.TransformError,
    match=r"carried variable `calls`.*float32\[\].*"
    r"float32\[2\]",
  ):
    sr.scan(body, length=2, variable_carry=sr.BatchStat)(model, X)
  assert_unchanged(model, before)


def test_length_mismatch_between_xs():
  model = Dense(jnp.eye(D))
  with pytest.raises(
    sr.TransformError,
    match=r"xs leaf 0 \(axis 0\) says 3 iterations but xs leaf 1 "
    r"\(axis 0\) has 4",
  ):
    sr.scan(add_body)(model, X, jnp.ones((3, 2, D)), jnp.ones((4, 2, D)))


def test_length_mismatch_with_length_and_a_stacked_variable():
  model = Dense(weights())
  before = values(model)
  with pytest.raises(
    sr.TransformError, match=r"length says 5 iterations but xs leaf 0 \(axis 0\) has 3"
  ):
    sr.scan(add_body, length=5)(Dense(jnp.eye(D)), X, jnp.ones((3, 2, D)))
  with pytest.raises(
    sr.TransformError,
    match=r"length says 2 iterations but the stacked variable `w` "
    r"\(axis 0\) has 3",
  ):
    sr.scan(Dense.__call__, length=2, variable_axes={sr.Param: 0})(model, X)
  with pytest.raises(
    sr.TransformError,
    match=r"xs leaf 0 \(axis 0\) says 4 iterations but the stacked "
    r"variable `w` \(axis 0\) has 3",
  ):
    sr.scan(add_body, variable_axes={sr.Param: 0})(model, X, jnp.ones((4, 2, D)))
  assert_unchanged(model, before)


def test_nothing_tells_the_length():
  with pytest.raises(sr.TransformError, match=r"cannot tell how many iterations.*length="):
    sr.scan(Dense.__call__)(Dense(jnp.eye(D)), X)


def test_axis_out_of_range():
  model = Dense(weights())
  before = values(model)
  with pytest.raises(
    sr.TransformError,
    match=r"variable_axes puts the layer axis of `w` at 3, but its "
    r"value has shape \(3, 4, 4\) \(rank 3\).*\[-3, 3\)",
  ):
    sr.scan(Dense.__call__, variable_axes={sr.Param: 3})(model, X)
  with pytest.raises(
    sr.TransformError,
    match=r"in_axes puts the scanned axis of xs leaf 0 at 2, but it has "
    r"shape \(3, 4\).*None to broadcast",
  ):
    sr.scan(add_body, in_axes=2)(model, X, jnp.ones((3, D)))
  assert_unchanged(model, before)


def test_a_new_variable_inside_the_body():
  model = Dense(weights())

  def body(m, h):
    m.extra = sr.Intermediate(h)
    return h, None

  # Made once per iteration: comes out stacked along the layer axis.
  sr.scan(body, variable_axes={sr.Param: 0})(model, X)
  assert model.extra.value.shape == (model.w.shape[0],) + X.shape


def test_body_must_return_a_pair():
  model = Dense(weights())
  before = values(model)
  with pytest.raises(
    TypeError,
    match=r"must return a pair \(carry, ys\), got a single "
    r"array. Return `carry, None`",
  ):
    sr.scan(lambda m, h: h, variable_axes={sr.Param: 0})(model, X)
  with pytest.raises(TypeError, match=r"got a tuple of length 3"):
    sr.scan(lambda m, h: (h, h, h), variable_axes={sr.Param: 0})(model, X)
  assert_unchanged(model, before)


def test_a_module_in_the_carry_or_xs():
  model = Dense(weights())
  with pytest.raises(TypeError, match=r"the carry `\[1\]` is a Dense.*argument 0 only"):
    sr.scan(lambda m, c: (c, None), length=2)(model, (X, Dense(jnp.eye(D))))
  with pytest.raises(TypeError, match=r"the xs argument `\[0\]` is a Dense"):
    sr.scan(add_body)(model, X, Dense(jnp.eye(D)))
  with pytest.raises(TypeError, match=r"argument 0 must be the module.*got ArrayImpl"):
    sr.scan(add_body)(X, X, jnp.ones((3, D)))


def test_returning_a_module_from_the_body():
  model = Dense(weights())
  before = values(model)
  with pytest.raises(sr.GraphError, match=r"returned a module \(Dense\)"):
    sr.scan(lambda m, h: (h, m), variable_axes={sr.Param: 0})(model, X)
  assert_unchanged(model, before)


def test_class_form_with_stacked_variables_and_no_length():
  rngs = sr.Rngs(0)
  with pytest.raises(
    sr.TransformError, match=r"`bn\.bias` is stacked by variable_axes.*pass `length=`"
  ):
    sr.scan(Block, variable_axes={sr.Param: 0}, split_rngs={"params": True})(D, rngs=rngs)
  assert int(rngs.default.count.value) == 0


def test_exception_in_the_body_leaves_the_module_unchanged():
  stack = stack_cls()(D, rngs=sr.Rngs(0))
  before = values(stack)

  class Boom(Exception):
    pass

  def body(m, h):
    h, _ = m(h)
    raise Boom("inside")

  with pytest.raises(Boom, match="inside"):
    sr.scan(body, variable_axes={sr.Param: 0, sr.BatchStat: 0})(stack, X)
  assert_unchanged(stack, before)


# -- compositions --------------------------------------------------------------------


def test_scan_of_a_rematted_body():
  w = weights()
  rematted = sr.scan(sr.remat(Dense.__call__), variable_axes={sr.Param: 0})
  plain = sr.scan(Dense.__call__, variable_axes={sr.Param: 0})
  h, ys = rematted(Dense(w), X)
  h0, ys0 = plain(Dense(w), X)
  close(h, h0)
  close(ys, ys0)
  loss = lambda f: lambda m, x: jnp.sum(f(m, x)[0] ** 2)
  g = sr.grad(loss(rematted))(Dense(w), X)
  g0 = sr.grad(loss(plain))(Dense(w), X)
  close(g["w"], g0["w"])


def test_scan_of_a_rematted_class_with_mutations():
  RematBlock = sr.remat(Block)
  Stack = sr.scan(
    RematBlock, length=L, variable_axes={sr.Param: 0, sr.BatchStat: 0}, split_rngs={"params": True}
  )
  stack, plain = Stack(D, rngs=sr.Rngs(0)), stack_cls()(D, rngs=sr.Rngs(0))
  g = sr.grad(lambda s, x: jnp.sum(s(x)[0] ** 2))(stack, X)
  g0 = sr.grad(lambda s, x: jnp.sum(s(x)[0] ** 2))(plain, X)
  close(g["linear"]["kernel"], g0["linear"]["kernel"])
  close(stack.bn.mean.value, plain.bn.mean.value)
  close(stack.bn.var.value, plain.bn.var.value)


def test_jit_of_scan():
  stack = stack_cls()(D, rngs=sr.Rngs(0))
  eager = stack_cls()(D, rngs=sr.Rngs(0))
  step = sr.jit(lambda s, x: s(x))
  for _ in range(2):
    y, ys = step(stack, X)
    y0, ys0 = eager(X)
    close(y, y0)
    close(ys, ys0)
  close(stack.bn.mean.value, eager.bn.mean.value)
  close(stack.bn.var.value, eager.bn.var.value)


def test_grad_of_jit_of_scan_over_carried_state():
  Scanned = sr.scan(Cell, variable_carry="batch_stats", variable_broadcast=sr.Param)
  cell, plain = Scanned(D, rngs=sr.Rngs(0)), Scanned(D, rngs=sr.Rngs(0))
  xs = jnp.linspace(-1.0, 1.0, 4 * 2 * D).reshape(4, 2, D)
  loss = lambda c, xs: jnp.sum(c(jnp.zeros((2, D)), xs)[1] ** 2)
  g = sr.jit(sr.grad(loss))(cell, xs)
  step = Cell(D, rngs=sr.Rngs(0))
  sr.update(step, sr.state(plain))

  def loop_loss(c, xs):
    h, total = jnp.zeros((2, D)), 0.0
    for x in xs:
      h, y = c(h, x)
      total = total + jnp.sum(y**2)
    return total

  g0 = sr.grad(loop_loss)(step, xs)
  close(g["w"], g0["w"])
  close(g["bn"]["scale"], g0["bn"]["scale"])
  close(cell.bn.mean.value, step.bn.mean.value)


def test_remat_of_scan_under_grad_and_jit():
  stack, plain = stack_cls()(D, rngs=sr.Rngs(0)), stack_cls()(D, rngs=sr.Rngs(0))
  rematted = sr.remat(lambda s, x: s(x)[0])
  g = sr.jit(sr.grad(lambda s, x: jnp.sum(rematted(s, x) ** 2)))(stack, X)
  g0 = sr.grad(lambda s, x: jnp.sum(s(x)[0] ** 2))(plain, X)
  close(g["linear"]["kernel"], g0["linear"]["kernel"])
  close(g["bn"]["bias"], g0["bn"]["bias"])
  close(stack.bn.mean.value, plain.bn.mean.value)


def test_grad_of_scan_of_remat_takes_the_memory_of_raw_jax():
  # The hand-written construction: lax.scan of jax.checkpoint, parameters as xs.
  n, width, batch = 8, 32, 64
  w = weights(n, width)
  x = jnp.ones((batch, width))
  graphdef, params = sr.split(Dense(w))

  def ours(params, x):
    model = sr.merge(graphdef, params)
    h, _ = sr.scan(sr.remat(Dense.__call__), variable_axes={sr.Param: 0})(model, x)
    return jnp.sum(h**2)

  def step(h, w_i):
    h = jnp.tanh(h @ w_i)
    return h, h.sum(-1)

  def raw(w, x, remat=True):
    h, _ = jax.lax.scan(jax.checkpoint(step) if remat else step, x, w)
    return jnp.sum(h**2)

  def compiled(f, *args):
    return jax.jit(jax.grad(f)).lower(*args).compile()

  ours_c, raw_c = compiled(ours, params, x), compiled(raw, w, x)
  mem, raw_mem = ours_c.memory_analysis(), raw_c.memory_analysis()
  no_remat = compiled(lambda w, x: raw(w, x, remat=False), w, x).memory_analysis()
  assert no_remat.temp_size_in_bytes > 1.5 * raw_mem.temp_size_in_bytes
  assert abs(mem.temp_size_in_bytes - raw_mem.temp_size_in_bytes) <= (
    0.01 * raw_mem.temp_size_in_bytes
  )
  # The outputs are the gradient alone: no extra copy of the parameters.
  assert mem.output_size_in_bytes == raw_mem.output_size_in_bytes == w.nbytes
  close(ours_c(params, x)["w"], raw_c(w, x))


def test_keyword_arguments_pass_unchanged_to_every_layer():
  class Scaled(sr.Module):
    def __init__(self, *, rngs):
      self.w = sr.Param(jax.random.normal(rngs.params(), (3, 3)))

    def __call__(self, x, *, double=False):
      y = jnp.tanh(x @ self.w.value)
      return (2 * y if double else y), None

  Stack = sr.scan(Scaled, length=3, variable_axes={sr.Param: 0}, split_rngs={"params": True})
  stack = Stack(rngs=sr.Rngs(0))
  x = jnp.ones((2, 3))
  plain, _ = stack(x)
  doubled, _ = stack(x, double=True)
  expected = x
  for layer in sr.unstack(stack):
    expected, _ = layer(expected, double=True)
  np.testing.assert_allclose(doubled, expected, rtol=1e-6)
  assert not np.allclose(plain, doubled)
  with pytest.raises(TypeError, match=r"the keyword argument `\['extra'\]` is a Rngs"):
    stack(x, extra=sr.Rngs(0))


def test_class_form_errors_name_the_class_and_method():
  stack = sr.vmap(Dense, axis_size=3, in_axes=0)(jnp.ones((3, D, D)))
  with pytest.raises(
    sr.TransformError,
    match=r"^sr\.vmap\(Dense\.__call__\): the stacked "
    r"variable `w` \(axis 0\) says 3",
  ):
    stack(jnp.ones((4, D)), jnp.ones((4, D)))
