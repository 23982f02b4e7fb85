"""sr.jit: mutations are written back, arguments anywhere, caching and retracing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import statefulremat as sr


class Block(sr.Module):
  """Linear + a running mean (BatchStat) + dropout drawn from a stored Rngs."""

  def __init__(self, din, dout, *, rngs):
    self.linear = sr.nn.Linear(din, dout, rngs=rngs)
    self.mean = sr.BatchStat(jnp.zeros(dout))
    self.rngs = rngs
    self.deterministic = False

  def __call__(self, x):
    y = self.linear(x)
    if self.deterministic:
      return y - self.mean.value[None]
    self.mean.value = 0.9 * self.mean.value + 0.1 * y.mean(0)
    keep = jax.random.bernoulli(self.rngs.dropout(), 0.5, y.shape)
    return jnp.where(keep, 2 * y, 0.0)


class Scale(sr.Module):
  def __init__(self, n):
    self.w = sr.Param(jnp.ones(n))


class Holder(sr.Module):
  def __init__(self, sub):
    self.sub = sub
    self.own = sr.Param(jnp.zeros(()))


class Stack(sr.Module):
  def __init__(self, n, *, rngs):
    self.layers = [sr.nn.Linear(3, 3, rngs=rngs) for _ in range(n)]

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    return x


def train_step(model, x):
  y = model(x)
  bias = model.linear.bias
  bias.value = bias.value + 0.01 * y.sum(0)
  return y.sum()


def flat_values(module):
  out = {}
  for path, value in sr.state(module).flat().items():
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
      value = jax.random.key_data(value)
    out[path] = np.asarray(value)
  return out


def assert_same_state(a, b, exact=False):
  fa, fb = flat_values(a), flat_values(b)
  assert list(fa) == list(fb)
  for path in fa:
    if exact or not np.issubdtype(fa[path].dtype, np.floating):
      np.testing.assert_array_equal(fa[path], fb[path], err_msg=str(path))
    else:
      np.testing.assert_allclose(fa[path], fb[path], rtol=1e-6, atol=1e-6, err_msg=str(path))


def test_writes_back_every_mutation_and_matches_eager():
  x = jnp.arange(12.0).reshape(4, 3) / 10
  eager, jitted = Block(3, 5, rngs=sr.Rngs(0)), Block(3, 5, rngs=sr.Rngs(0))
  before = flat_values(jitted)
  step = sr.jit(train_step)
  for _ in range(3):
    np.testing.assert_allclose(step(jitted, x), train_step(eager, x), rtol=1e-6)
  assert_same_state(eager, jitted)
  after = flat_values(jitted)
  # params, the running mean and the RNG count all moved; the RNG key did not.
  assert not np.array_equal(before[("linear", "bias")], after[("linear", "bias")])
  assert not np.array_equal(before[("mean",)], after[("mean",)])
  count = ("rngs", "default", "count")
  assert int(after[count]) == int(before[count]) + 3
  np.testing.assert_array_equal(
    before[("rngs", "default", "key")], after[("rngs", "default", "key")]
  )
  for _, var in jitted.iter_variables():  # written back as concrete arrays
    assert isinstance(var.value, jax.Array)
    assert not isinstance(var.value, jax.core.Tracer)


def test_modules_in_kwargs_tuples_and_dicts():
  a, b, c = Scale(2), Scale(2), Scale(2)

  @sr.jit
  def f(x, pair, *, table):
    first, second = pair
    first.w.value = first.w.value + x
    second["m"].w.value = second["m"].w.value * 3
    table["c"].w.value = table["c"].w.value - 1
    return x * 2

  out = f(jnp.float32(1.0), (a, {"m": b}), table={"c": c})
  assert float(out) == 2.0
  np.testing.assert_array_equal(a.w.value, [2.0, 2.0])
  np.testing.assert_array_equal(b.w.value, [3.0, 3.0])
  np.testing.assert_array_equal(c.w.value, [0.0, 0.0])


def test_shared_submodule_is_written_once_and_stays_shared():
  shared = Scale(2)
  h1, h2 = Holder(shared), Holder(shared)
  w_before = shared.w

  @sr.jit
  def f(h1, h2):
    h1.sub.w.value = h1.sub.w.value + 1
    h2.sub.w.value = h2.sub.w.value + 1  # the same Variable: sees the first write
    h2.own.value = h2.own.value + 5
    return h1.sub.w.value.sum()

  assert float(f(h1, h2)) == 6.0
  assert h1.sub is h2.sub is shared and shared.w is w_before
  np.testing.assert_array_equal(shared.w.value, [3.0, 3.0])
  assert float(h1.own.value) == 0.0 and float(h2.own.value) == 5.0


def test_same_module_twice_and_a_variable_argument():
  m = Scale(2)
  var = sr.BatchStat(jnp.zeros(()))

  @sr.jit
  def f(a, b, v):
    a.w.value = a.w.value + 1
    v.value = v.value + b.w.value.sum()
    return None

  assert f(m, m, var) is None
  np.testing.assert_array_equal(m.w.value, [2.0, 2.0])
  assert float(var.value) == 4.0


def test_non_module_array_arguments_and_outputs():
  m = Scale(3)

  @sr.jit
  def f(m, x, extras):
    m.w.value = m.w.value * x
    return {"y": m.w.value + extras["b"], "n": extras["n"] * 2}

  out = f(m, jnp.full(3, 2.0), {"b": jnp.ones(3), "n": np.int32(4)})
  np.testing.assert_array_equal(out["y"], [3.0, 3.0, 3.0])
  assert int(out["n"]) == 8
  np.testing.assert_array_equal(m.w.value, [2.0, 2.0, 2.0])


def test_module_position_can_change_between_calls():
  m = Scale(2)

  @sr.jit
  def f(a, b):
    if isinstance(a, sr.Module):
      return a.w.value * b
    return a - b.w.value

  x = jnp.full(2, 3.0)
  np.testing.assert_array_equal(f(m, x), [3.0, 3.0])
  np.testing.assert_array_equal(f(x, m), [2.0, 2.0])


def test_static_argnums():
  m = Scale(2)
  traces = []

  @sr.jit(static_argnums=(3, 0))
  def f(op, m, x, power, y):
    traces.append((op, power))
    z = m.w.value * x**power
    return z + y if op == "add" else z - y

  one = jnp.ones(2)
  np.testing.assert_array_equal(f("add", m, 2.0, 3, one), [9.0, 9.0])
  np.testing.assert_array_equal(f("sub", m, 2.0, 3, one), [7.0, 7.0])
  np.testing.assert_array_equal(f("add", m, 2.0, 3, one), [9.0, 9.0])
  assert traces == [("add", 3), ("sub", 3)]

  g = sr.jit(lambda m, scale: m.w.value * scale, static_argnums=-1)
  np.testing.assert_array_equal(g(m, 4.0), [4.0, 4.0])


def test_static_argnums_errors():
  m = Scale(2)
  f = sr.jit(lambda m, x: m.w.value, static_argnums=2)
  with pytest.raises(TypeError, match=r"static_argnums=\(2,\) but only 2 positional"):
    f(m, 1.0)
  g = sr.jit(lambda m, x: m.w.value * x, static_argnums=0)
  with pytest.raises(TypeError, match=r"argument 0 is a Scale and is marked static"):
    g(m, 1.0)
  h = sr.jit(lambda m, x: m.w.value, static_argnums=1)
  with pytest.raises(TypeError, match=r"static argument 1 \(list\) is not hashable"):
    h(m, [1, 2])


def test_second_call_does_not_retrace():
  model = Block(3, 4, rngs=sr.Rngs(0))
  traces = []

  @sr.jit
  def step(model, x):
    traces.append(1)
    return train_step(model, x)

  x = jnp.ones((2, 3))
  for i in range(4):
    step(model, x + i)
  assert len(traces) == 1
  # A different model of the same structure reuses the compiled function too.
  step(Block(3, 4, rngs=sr.Rngs(1)), x)
  assert len(traces) == 1


def test_eval_retraces_and_is_correct():
  model = Block(3, 4, rngs=sr.Rngs(0))
  reference = Block(3, 4, rngs=sr.Rngs(0))
  traces = []

  @sr.jit
  def apply(model, x):
    traces.append(model.deterministic)
    return model(x)

  x = jnp.arange(6.0).reshape(2, 3)
  np.testing.assert_allclose(apply(model, x), reference(x), rtol=1e-6)
  model.eval()
  reference.eval()
  np.testing.assert_allclose(apply(model, x), reference(x), rtol=1e-6)
  assert traces == [False, True]
  count = model.rngs.default.count.value
  apply(model, x)  # eval mode: no RNG draw, no running-mean update
  assert model.rngs.default.count.value is count
  model.train()
  reference.train()
  np.testing.assert_allclose(apply(model, x), reference(x), rtol=1e-6)
  assert traces == [False, True]  # back to a structure already compiled
  assert int(model.rngs.default.count.value) == int(count) + 1
  assert_same_state(model, reference)


def test_appending_a_layer_retraces_and_is_correct():
  rngs = sr.Rngs(0)
  model = Stack(2, rngs=rngs)
  traces = []

  @sr.jit
  def apply(model, x):
    traces.append(len(model.layers))
    return model(x)

  x = jnp.ones((1, 3))
  np.testing.assert_allclose(apply(model, x), model(x), rtol=1e-6)
  model.layers.append(sr.nn.Linear(3, 3, rngs=rngs))
  out = apply(model, x)
  assert traces == [2, 3]
  np.testing.assert_allclose(out, model(x), rtol=1e-6)
  model.layers[0] = sr.nn.Linear(3, 3, rngs=rngs)  # same structure, new objects
  np.testing.assert_allclose(apply(model, x), model(x), rtol=1e-6)
  assert traces == [2, 3]


def test_nested_jit():
  shared = Scale(2)
  outer_model = Holder(shared)

  @sr.jit
  def inner(sub, x):
    sub.w.value = sub.w.value * x
    return sub.w.value.sum()

  @sr.jit
  def outer(h, x):
    total = inner(h.sub, x) + inner(h.sub, x)
    h.own.value = h.own.value + total
    return total

  assert float(outer(outer_model, 2.0)) == 4.0 + 8.0
  np.testing.assert_array_equal(shared.w.value, [4.0, 4.0])
  assert float(outer_model.own.value) == 12.0


def test_decorating_a_method():

  class Counter(sr.Module):
    def __init__(self):
      self.total = sr.BatchStat(jnp.zeros(()))

    @sr.jit
    def add(self, x):
      self.total.value = self.total.value + x
      return self.total.value

  c = Counter()
  c.add(2.0)
  assert float(c.add(3.0)) == 5.0 and float(c.total.value) == 5.0


def test_donate_state():
  eager, donated = Block(3, 4, rngs=sr.Rngs(0)), Block(3, 4, rngs=sr.Rngs(0))
  step = sr.jit(train_step, donate_state=True)
  x = jnp.ones((2, 3))
  for _ in range(2):
    np.testing.assert_allclose(step(donated, x), train_step(eager, x), rtol=1e-6)
  assert_same_state(eager, donated)


def test_donate_state_with_arrays_shared_between_variables_and_arguments():
  model = Block(3, 4, rngs=sr.Rngs(0))
  twin = sr.merge(*sr.split(model))  # holds the very same arrays as `model`
  assert twin.linear.kernel.value is model.linear.kernel.value
  kernel = np.asarray(model.linear.kernel.value)

  @sr.jit(donate_state=True)
  def f(model, twin, x, kernel):
    y = model(x) + twin(x)
    return y.sum() + kernel.sum()

  x = jnp.ones((2, 3))
  f(model, twin, x, model.linear.kernel.value)
  f(model, twin, x, model.linear.kernel.value)
  np.testing.assert_array_equal(model.linear.kernel.value, kernel)
  np.testing.assert_array_equal(twin.linear.kernel.value, kernel)
  assert int(model.rngs.default.count.value) == int(twin.rngs.default.count.value)


def test_lower():
  model = Block(3, 4, rngs=sr.Rngs(0))
  before = flat_values(model)
  step = sr.jit(train_step)
  lowered = step.lower(model, jnp.ones((2, 3)))
  assert "stablehlo" in lowered.as_text() or "func" in lowered.as_text()
  lowered.compile()
  after = flat_values(model)
  for path in before:
    np.testing.assert_array_equal(before[path], after[path])


def test_unknown_jit_kwargs_are_a_type_error():
  with pytest.raises(
    TypeError,
    match=r"sr.jit does not take \['donate_argnums'\].*"
    r"donate_state=True",
  ):
    sr.jit(train_step, donate_argnums=(0,))
  with pytest.raises(TypeError, match=r"does not take \['in_shardings'\]"):
    sr.jit(in_shardings=None)(train_step)
  with pytest.raises(
    TypeError,
    match=r"does not take \['static_argnum'\]; besides "
    r"static_argnums, static_argnames and donate_state it passes on "
    r"\['backend', 'compiler_options'",
  ):
    sr.jit(train_step, static_argnum=1)


def test_static_argnames():
  m = Scale(2)
  traces = []

  @sr.jit(static_argnames=("mode",))
  def f(m, x, *, mode="mul", bias=0.0):
    traces.append(mode)
    return m.w.value * x + bias if mode == "mul" else m.w.value + x + bias

  np.testing.assert_array_equal(f(m, 3.0, mode="mul"), [3.0, 3.0])
  np.testing.assert_array_equal(f(m, 3.0, mode="add", bias=1.0), [5.0, 5.0])
  np.testing.assert_array_equal(f(m, 3.0, mode="add", bias=2.0), [6.0, 6.0])
  np.testing.assert_array_equal(f(m, 3.0), [3.0, 3.0])  # default: not passed, not static
  assert traces == ["mul", "add", "mul"]
  g = sr.jit(lambda m, *, other: m.w.value, static_argnames="other")
  with pytest.raises(TypeError, match=r"argument 'other' is a Scale and is marked static"):
    g(m, other=Scale(2))


def test_repeated_calls_walk_no_graph_on_any_argument_form(monkeypatch):
  # Arguments that are only modules and arrays skip tree_flatten; kwargs, nested
  # containers and other leaves take the general path. Either way a repeated call
  # reuses the cached graph walk, and every mutation is written back.
  from statefulremat.transforms import _lift

  walks = []
  real = _lift.flatten
  monkeypatch.setattr(_lift, "flatten", lambda *a, **k: walks.append(1) or real(*a, **k))
  m = Scale(2)
  opt = sr.Optimizer(m, optax.sgd(1.0))

  @sr.jit
  def step(m, opt, x, extra=None, *, scale=1.0):
    loss, grads = sr.value_and_grad(lambda m: (m.w.value * x * scale).sum())(m)
    opt.update(grads)
    return loss if extra is None else loss + extra[0]

  forms = [
    ((jnp.ones(2),), {}),  # the fast path
    ((np.ones(2, np.float32),), {}),
    ((2.0,), {}),
    ((jnp.ones(2), [jnp.ones(())]), {}),  # nested: the general path
    ((jnp.ones(2),), {"scale": 2.0}),  # kwargs
    ((np.float32(1.0), None), {}),
  ]
  for args, kwargs in forms:
    step(m, opt, *args, **kwargs)  # traces (walks inside the trace) and caches
    before, w, count = len(walks), m.w.value, int(opt.step.value)
    for _ in range(3):
      step(m, opt, *args, **kwargs)
    assert len(walks) == before, (args, kwargs)
    assert int(opt.step.value) == count + 3
    assert bool((m.w.value < w).all())


def test_unrelated_structure_change_leaves_repeated_calls_without_graph_compares(monkeypatch):
  # Building another module starts new flatten-cache entries; their equal GraphDef is
  # the same object as before, so the compiled function is found by identity.
  from statefulremat.core import _graph

  compares = []
  real = _graph.GraphDef.__eq__
  monkeypatch.setattr(_graph.GraphDef, "__eq__", lambda a, b: compares.append(1) or real(a, b))
  m = Scale(2)
  traces = []
  f = _counting_add(traces)
  x = jnp.ones(2)
  f(m, x)
  Scale(3)  # an unrelated new module: a structure change
  f(m, x)
  before = len(compares)
  for _ in range(5):
    f(m, x)
  assert len(compares) == before and len(traces) == 1
  np.testing.assert_array_equal(m.w.value, [8.0, 8.0])


def _counting_add(traces: list):
  """``sr.jit`` of ``m.w += x``, appending to ``traces`` each time it is traced."""

  @sr.jit
  def f(m, x):
    traces.append(1)
    m.w.value = m.w.value + x
    return m.w.value.sum()

  return f


def test_flat_and_general_paths_share_one_compiled_function():
  m = Scale(2)
  traces = []
  f = _counting_add(traces)
  x = jnp.ones(2)
  f(m, x)  # modules and arrays only: no tree_flatten
  f(m, jax.device_put(x))
  f(m, x=x)  # kwargs: the general path, another treedef, traced once more
  assert len(traces) == 2
  np.testing.assert_array_equal(m.w.value, [4.0, 4.0])


def test_structure_change_between_flat_calls_retraces():
  m = Scale(2)
  traces = []

  @sr.jit
  def f(m, x):
    traces.append(hasattr(m, "offset"))
    return m.w.value * x + (m.offset.value if hasattr(m, "offset") else 0.0)

  x = jnp.ones(2)
  np.testing.assert_array_equal(f(m, x), [1.0, 1.0])
  m.offset = sr.Param(jnp.full(2, 5.0))
  np.testing.assert_array_equal(f(m, x), [6.0, 6.0])
  del m.offset
  np.testing.assert_array_equal(f(m, x), [1.0, 1.0])
  assert traces == [False, True]  # the first structure is back: compiled already


def test_alternating_modules_each_get_their_own_write_back():
  a, b, c = Scale(2), Scale(3), Scale(2)

  @sr.jit
  def f(m, x):
    m.w.value = m.w.value + x
    return m.w.value.sum()

  for _ in range(2):
    for m, x in ((a, 1.0), (b, 2.0), (a, 1.0), (c, 3.0)):
      f(m, x)
  np.testing.assert_array_equal(a.w.value, [5.0, 5.0])
  np.testing.assert_array_equal(b.w.value, [5.0, 5.0, 5.0])
  np.testing.assert_array_equal(c.w.value, [7.0, 7.0])
  a.w = sr.Param(jnp.zeros(2))  # a new Variable object at the same place
  f(a, 1.0)
  np.testing.assert_array_equal(a.w.value, [1.0, 1.0])


def test_traces_run_in_a_roomy_frame_at_any_caller_depth():
  # CPython 3.11/3.12 unmap a 16 KiB frame-stack chunk as soon as it empties, so a trace
  # would pay per chunk boundary crossed, set by the caller's depth; sr.jit traces and
  # lowers under a frame that reserves 512 KiB (transforms/_jit.py, `with_room`).
  import sys

  room = []

  def deepest_frame_slots():
    frame, most = sys._getframe(), 0
    while frame is not None:
      most, frame = max(most, frame.f_code.co_stacksize), frame.f_back
    return most

  def step(m, x):
    room.append(deepest_frame_slots())
    m.bias.value = m.bias.value + 1
    return m(x)

  def below(k, call):
    return call() if k == 0 else below(k - 1, call)

  for depth in (0, 40):
    model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
    f, x = sr.jit(step), jnp.ones((1, 2))
    below(depth, lambda: sr.jit(step).lower(model, x))
    below(depth, lambda: f(model, x))
    f(model, x)  # compiled: no trace
    np.testing.assert_array_equal(model.bias.value, [2.0, 2.0])

  def block(layer, h):
    room.append(deepest_frame_slots())
    return jnp.tanh(layer(h))

  stack = sr.vmap(sr.nn.Linear, axis_size=4)(2, 2, rngs=sr.Rngs(0))
  scanned = sr.jit(sr.remat_scan(block, lengths=(2, 2)))
  y = below(40, lambda: scanned(stack, jnp.ones((1, 2))))
  assert y.shape == (1, 2)
  assert len(room) == 2 * 2 + 1  # one trace per lower and per new function, no more
  if sys.implementation.name == "cpython" and sys.version_info >= (3, 11):
    assert min(room) >= 1 << 16
