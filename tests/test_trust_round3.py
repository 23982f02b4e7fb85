"""Trust rules, round 3 (issue 22, items 4, 5, 6 and 10): sr.clone copies buffers, a
BatchNorm refuses to train on an empty batch, threads stepping one model lose no
update, and errors about deleted arrays, lists of layers and pre-split keys point the
way."""

import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr


class Net(sr.Module):
  def __init__(self, rngs):
    self.linear = sr.nn.Linear(4, 4, rngs=rngs)
    self.count = sr.BatchStat(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    return self.linear(x)


def values(module) -> dict:
  return {path: np.array(value) for path, value in sr.state(module).flat().items()}


def assert_same(before: dict, after: dict) -> None:
  assert before.keys() == after.keys()
  for path in before:
    np.testing.assert_array_equal(before[path], after[path], err_msg=str(path))


def pointer(array) -> int:
  return array.unsafe_buffer_pointer()


# -- 4. sr.clone copies buffers ------------------------------------------------------


def test_clone_survives_the_original_being_donated():
  model = Net(sr.Rngs(0))
  best = sr.clone(model)
  at_clone = values(model)
  assert pointer(best.linear.kernel.value) != pointer(model.linear.kernel.value)
  assert pointer(best.count.value) != pointer(model.count.value)

  @sr.jit(donate_state=True)
  def step(model, x):
    model.linear.kernel.value = model.linear.kernel.value - 0.1 * x.T @ model(x)
    model.count.value = model.count.value + 1

  for _ in range(3):
    step(model, jnp.ones((2, 4)))
  assert int(model.count.value) == 3
  assert_same(at_clone, values(best))  # readable, and the values of clone time
  assert not np.array_equal(at_clone[("linear", "kernel")], model.linear.kernel.value)


def test_clone_copies_keys_and_numpy_keeps_sharding_python_numbers_and_sharing():
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  sharded = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))

  class Holder(sr.Module):
    def __init__(self):
      self.rngs = sr.Rngs(0)
      self.table = sr.Variable(np.arange(3.0))
      self.steps = sr.Variable(7)
      self.w = sr.Param(sharded)
      self.tied = self.w

  model = Holder()
  copy = sr.clone(model)
  key, key_copy = model.rngs.default.key.value, copy.rngs.default.key.value
  assert key_copy.dtype == key.dtype
  assert pointer(jax.random.key_data(key_copy)) != pointer(jax.random.key_data(key))
  np.testing.assert_array_equal(jax.random.key_data(key_copy), jax.random.key_data(key))
  assert copy.table.value is not model.table.value
  assert not np.shares_memory(copy.table.value, model.table.value)
  copy.table.value[0] = 99.0  # numpy changes in place: the original must not see it
  assert model.table.value[0] == 0.0
  assert type(copy.steps.value) is int and copy.steps.value == 7
  assert copy.w.value.sharding == sharded.sharding
  assert all(
    pointer(a.data) != pointer(b.data)
    for a, b in zip(copy.w.value.addressable_shards, sharded.addressable_shards)
  )
  assert copy.tied is copy.w  # shared within the copy, as in the original


# -- 5. BatchNorm on an empty batch ----------------------------------------------------


class WithNorm(sr.Module):
  def __init__(self):
    self.norm = sr.nn.BatchNorm(3, rngs=sr.Rngs(0))

  def __call__(self, x):
    return self.norm(x)


EMPTY = "training on an empty batch.*skip the step.*use_running_average=True.*model.eval"


def test_batchnorm_refuses_to_train_on_an_empty_batch_eagerly():
  bn = sr.nn.BatchNorm(3, momentum=0.5, rngs=sr.Rngs(0))
  before = values(bn)
  with pytest.raises(ValueError, match=r"BatchNorm: " + EMPTY):
    bn(jnp.zeros((0, 3)))
  assert_same(before, values(bn))
  _ = bn(jnp.ones((2, 3)))  # a real batch still trains
  assert float(bn.mean.value[0]) == 0.5


@pytest.mark.parametrize("shape", [(0, 3), (2, 0, 3)])
def test_batchnorm_empty_batch_inside_jit_names_its_path(shape):
  model = WithNorm()
  before = values(model)
  with pytest.raises(ValueError, match=r"BatchNorm at `norm`: " + EMPTY):
    sr.jit(lambda m, x: m(x))(model, jnp.zeros(shape))
  assert_same(before, values(model))
  assert not np.isnan(model.norm.mean.value).any()


def test_batchnorm_evaluates_an_empty_batch():
  model = WithNorm()
  before = values(model)
  model.eval()
  assert model(jnp.zeros((0, 3))).shape == (0, 3)
  assert sr.jit(lambda m, x: m(x))(model, jnp.zeros((0, 3))).shape == (0, 3)
  assert model.norm(jnp.zeros((0, 3)), use_running_average=True).shape == (0, 3)
  assert_same(before, values(model))


# -- 6. two threads on one model -------------------------------------------------------


@pytest.fixture
def switch_often():
  """Thread switches every few microseconds, so a race shows within a few steps."""
  old = sys.getswitchinterval()
  sys.setswitchinterval(1e-5)
  yield
  sys.setswitchinterval(old)


def run_threads(targets, timeout=60.0) -> None:
  errors = []

  def guarded(target):
    try:
      target()
    except BaseException as e:  # noqa: BLE001 - reported below
      errors.append(e)

  threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
  for t in threads:
    t.start()
  deadline = time.monotonic() + timeout
  for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
  assert not any(t.is_alive() for t in threads), "threads still running: a deadlock"
  if errors:
    raise errors[0]


def repeat(fn, n):
  return lambda: [fn() for _ in range(n)]


@pytest.mark.parametrize("donate", [False, True])
def test_threads_stepping_one_model_with_sr_jit_lose_no_step(switch_often, donate):
  model = Net(sr.Rngs(0))

  @sr.jit(donate_state=donate)
  def step(model, x):
    model.count.value = model.count.value + 1
    model.linear.bias.value = model.linear.bias.value + 1.0
    return model(x).sum()

  x = jnp.ones((1, 4))
  step(model, x)
  run_threads([repeat(lambda: step(model, x), 40) for _ in range(4)])
  assert int(model.count.value) == 1 + 4 * 40
  np.testing.assert_allclose(model.linear.bias.value, 1.0 + 4 * 40)


def test_threads_grad_and_optimizer_updates_lose_nothing(switch_often):
  model = Net(sr.Rngs(0))
  opt = sr.Optimizer(model, optax.sgd(1.0))
  bias = np.array(model.linear.bias.value)
  ones = jax.tree.map(jnp.ones_like, sr.state(model, sr.Param))

  def loss(model, x):
    model.count.value = model.count.value + 1  # written back by sr.grad
    return model(x).sum()

  def train():
    for _ in range(10):
      sr.grad(loss)(model, jnp.ones((1, 4)))
      opt.update(ones)  # eager: reads, computes and writes like a transform

  run_threads([train for _ in range(3)])
  assert int(model.count.value) == 30
  assert int(opt.step.value) == 30
  np.testing.assert_allclose(model.linear.bias.value, bias - 30.0, rtol=1e-6)


def test_threads_on_a_model_and_its_optimizer_share_one_lock(switch_often):
  # The model alone, then the Optimizer holding it: their groups are merged.
  model = Net(sr.Rngs(0))
  opt = sr.Optimizer(model, optax.sgd(1.0))
  bias = np.array(model.linear.bias.value)
  ones = jax.tree.map(jnp.ones_like, sr.state(model, sr.Param))

  @sr.jit
  def up(model):
    model.linear.bias.value = model.linear.bias.value + 1.0

  @sr.jit
  def down(opt):
    opt.update(ones)

  up(model)
  down(opt)
  run_threads(
    [
      repeat(lambda: up(model), 30),
      repeat(lambda: down(opt), 30),
      repeat(lambda: opt.update(ones), 10),
    ]
  )
  np.testing.assert_allclose(model.linear.bias.value, bias + 31 - 31 - 10, rtol=1e-6)
  assert int(opt.step.value) == 41


def test_a_call_on_two_models_merges_their_locks(switch_often):
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(1))

  @sr.jit
  def one(model):
    model.count.value = model.count.value + 1

  @sr.jit
  def both(first, second):
    first.count.value = first.count.value + 1
    second.count.value = second.count.value + 1

  one(a)
  one(b)  # two graphs, two locks; `both` makes them one while the others run
  run_threads(
    [
      repeat(lambda: one(a), 30),
      repeat(lambda: one(b), 30),
      repeat(lambda: both(a, b), 15),
      repeat(lambda: both(b, a), 15),
    ]
  )
  assert int(a.count.value) == int(b.count.value) == 1 + 30 + 30


def test_nested_transforms_on_two_threads_do_not_deadlock(switch_often):
  model = Net(sr.Rngs(0))

  @sr.jit
  def step(model, x):
    inner = sr.jit(lambda m, x: m(x).sum())
    grads = sr.grad(lambda m, x: inner(m, x))(model, x)
    c, _ = sr.scan(lambda m, c: (c + 1, None), length=3)(model, 0)
    model.linear.kernel.value = model.linear.kernel.value - 0.0 * grads["linear"]["kernel"]
    model.count.value = model.count.value + c
    return c

  x = jnp.ones((1, 4))
  run_threads([repeat(lambda: step(model, x), 10) for _ in range(2)])
  assert int(model.count.value) == 2 * 10 * 3


def test_eager_scan_with_keywords_and_remat_take_turns(switch_often):
  stack = sr.vmap(sr.nn.Linear, axis_size=2, in_axes=None)(2, 2, rngs=sr.Rngs(0))
  stack.count = sr.BatchStat(jnp.zeros((2,), jnp.int32))

  def body(layer, c, *, scale):
    layer.count.value = layer.count.value + 1
    return c * scale, None

  scan = sr.scan(body, variable_axes={True: 0})
  counter = Net(sr.Rngs(1))

  def bump(m):
    m.count.value = m.count.value + 1

  remat = sr.remat(bump)
  run_threads(
    [repeat(lambda: scan(stack, 1.0, scale=2.0), 10) for _ in range(2)]
    + [repeat(lambda: remat(counter), 20) for _ in range(2)]
  )
  np.testing.assert_array_equal(stack.count.value, [20, 20])
  assert int(counter.count.value) == 40


def test_two_models_on_two_threads_do_not_wait_for_each_other():
  a, b = Net(sr.Rngs(0)), Net(sr.Rngs(1))
  inside, go = threading.Event(), threading.Event()

  @sr.jit
  def slow(model):  # holds a's lock while its trace waits
    inside.set()
    assert go.wait(30)
    model.count.value = model.count.value + 1

  @sr.jit
  def fast(model):
    model.count.value = model.count.value + 1

  first = threading.Thread(target=slow, args=(a,), daemon=True)
  first.start()
  try:
    assert inside.wait(30)
    second = threading.Thread(target=fast, args=(a,), daemon=True)
    second.start()
    fast(b)  # another model: runs now, and reads its values while a is traced
    assert int(b.count.value) == 1
    time.sleep(0.1)
    assert second.is_alive()  # a's second call waits for the first
    assert int(a.count.value) == 0
  finally:
    go.set()
  first.join(30)
  second.join(30)
  assert not first.is_alive() and not second.is_alive()
  assert int(a.count.value) == 2


def test_a_failed_call_releases_the_lock():
  model = Net(sr.Rngs(0))
  before = values(model)

  @sr.jit
  def bad(model):
    model.count.value = model.count.value + 1
    raise ValueError("boom")

  for _ in range(2):
    with pytest.raises(ValueError, match="boom"):
      run_threads([lambda: bad(model)], timeout=30)
  assert_same(before, values(model))
  run_threads([lambda: sr.jit(lambda m: m.count.__iadd__(1))(model)], timeout=30)
  assert int(model.count.value) == 1


# -- 10a. a deleted or donated array is named by its path ------------------------------


FIX = r"donated.*Fix: use the model that donating call updated.*sr\.clone\(model\)"


def stack_of_linears():
  return sr.vmap(sr.nn.Linear, axis_size=4, in_axes=None)(4, 4, rngs=sr.Rngs(0))


CALLS = {
  "jit": lambda m, x: sr.jit(lambda m, x: m(x))(m, x),
  "grad": lambda m, x: sr.grad(lambda m, x: m(x).sum())(m, x),
  "remat": lambda m, x: sr.remat(lambda m, x: m(x))(m, x),
  "jit(remat)": lambda m, x: sr.jit(sr.remat(lambda m, x: m(x)))(m, x),
}
STACK_CALLS = {
  "scan": lambda s, x: sr.scan(lambda l, c: (l(c), None), variable_axes={True: 0})(s, x),
  "scan, keyword": lambda s, x: sr.scan(lambda l, c, k: (l(c) * k, None), variable_axes={True: 0})(
    s, x, k=1.0
  ),
  "remat_scan": lambda s, x: sr.remat_scan(lambda l, c: l(c), lengths=(2, 2))(s, x),
  "vmap": lambda s, x: sr.vmap(lambda l, x: l(x), in_axes=None)(s, x),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_deleted_array_is_named_by_its_path(call):
  model = Net(sr.Rngs(0))
  model.linear.kernel.value.delete()
  before = {k: v for k, v in sr.state(model).flat().items() if k != ("linear", "kernel")}
  with pytest.raises(
    sr.TransformError,
    match=r"`linear\.kernel` \(Param, float32\[4,4\]\) holds an array "
    r"that has been deleted.*" + FIX,
  ):
    CALLS[call](model, jnp.ones((1, 4)))
  for path, value in before.items():  # nothing written
    assert sr.state(model).flat()[path] is value


@pytest.mark.parametrize("call", list(STACK_CALLS))
def test_a_deleted_array_in_a_stack_is_named_by_its_path(call):
  stack = stack_of_linears()
  stack.kernel.value.delete()
  with pytest.raises(
    sr.TransformError,
    match=r"`kernel` \(Param, float32\[4,4,4\]\) holds an array that has "
    r"been deleted.*" + FIX,
  ):
    STACK_CALLS[call](stack, jnp.ones((1, 4)))


def test_arrays_donated_by_a_plain_jax_jit_are_named():
  model = Net(sr.Rngs(0))
  _, state = sr.split(model)
  jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)
  with pytest.raises(
    sr.TransformError,
    match=r"`count` \(BatchStat, int32\[\]\) \(and 2 more Variable\(s\)\) "
    r"holds an array that has been deleted.*jax\.jit\(\.\.\., "
    r"donate_argnums=\.\.\.\).*sr\.update\(model, new_state\)",
  ):
    sr.jit(lambda m, x: m(x))(model, jnp.ones((1, 4)))


def test_save_and_clone_name_a_deleted_array(tmp_path):
  model = Net(sr.Rngs(0))
  model.linear.kernel.value.delete()
  with pytest.raises(
    sr.CheckpointError,
    match=r"sr\.save: `linear\.kernel` \(Param, float32\[4,4\]\) holds an "
    r"array that has been deleted.*donated.*Nothing was written\. "
    r"Fix: use the model that donating call updated.*sr\.clone",
  ):
    sr.save(tmp_path / "ckpt", model)
  assert not os.listdir(tmp_path) or not os.listdir(tmp_path / "ckpt")
  with pytest.raises(sr.TransformError, match=r"sr\.clone: `linear\.kernel` .*" + FIX):
    sr.clone(model)


def test_a_deleted_plain_argument_keeps_jaxs_error():
  model = Net(sr.Rngs(0))
  x = jnp.ones((1, 4))
  x.delete()
  with pytest.raises(RuntimeError, match="deleted"):
    sr.jit(lambda m, x: m(x))(model, x)


# -- 10b. a Python list of layers points at sr.stack -----------------------------------


LIST = (
  r"argument 0 is a {kind} of 4 Linear modules, but {name} runs over one stacked "
  r"module.*Fix: stack them first, `stack = sr\.stack\(layers, like=sr\.vmap\("
  r"Linear, axis_size=4\)\)`.*then pass the stack"
)


@pytest.mark.parametrize("kind", [list, tuple])
def test_remat_scan_over_a_list_of_layers_points_at_sr_stack(kind):
  layers = kind(sr.nn.Linear(4, 4, rngs=sr.Rngs(i)) for i in range(4))
  before = [values(layer) for layer in layers]
  with pytest.raises(
    sr.TransformError,
    match=r"sr\.remat_scan\(<lambda>\): " + LIST.format(kind=kind.__name__, name=r"sr\.remat_scan"),
  ):
    sr.remat_scan(lambda layer, c: layer(c), lengths=(2, 2))(layers, jnp.ones((1, 4)))
  for layer, old in zip(layers, before):
    assert_same(old, values(layer))


def test_scan_over_a_list_of_layers_points_at_sr_stack():
  layers = [sr.nn.Linear(4, 4, rngs=sr.Rngs(i)) for i in range(4)]
  with pytest.raises(
    sr.TransformError,
    match=r"sr\.scan\(<lambda>\): "
    + LIST.format(kind="list", name=r"sr\.scan")
    + r".*sr\.scan\(f, variable_axes=",
  ):
    sr.scan(lambda layer, c: (layer(c), None), variable_axes={sr.Param: 0})(
      layers, jnp.ones((1, 4))
    )


def test_the_fix_the_list_error_gives_works():
  stack = stack_of_linears()
  layers = sr.unstack(stack)
  f = sr.remat_scan(lambda layer, c: layer(c), lengths=(2, 2))
  with pytest.raises(
    sr.TransformError,
    match=r"layers that came out of `sr\.unstack` "
    r"need none",
  ):
    f(layers, jnp.ones((1, 4)))
  expected = f(stack, jnp.ones((1, 4)))
  np.testing.assert_allclose(f(sr.stack(layers), jnp.ones((1, 4))), expected)
  like = sr.stack(layers, like=sr.vmap(sr.nn.Linear, axis_size=4))
  np.testing.assert_allclose(f(like, jnp.ones((1, 4))), expected)


def test_a_list_of_stacks_is_still_a_module_argument():
  stacks = [stack_of_linears(), stack_of_linears()]

  def body(pair, c):
    return pair[1](pair[0](c))

  out = sr.remat_scan(body, lengths=(2, 2))(stacks, jnp.ones((1, 4)))
  assert out.shape == (1, 4)


# -- 10c. pre-split keys in sr.Rngs ----------------------------------------------------


# Pre-split keys make a per-layer Rngs (nnx's guide vmaps over one: tests/test_nnx_guide.py);
# drawing from it outside a vmap that maps it says what it is.
SPLIT = (
  r"sr\.Rngs: the stream '{tag}' holds a key array of shape \(4,\) \(4 keys.*only be "
  r"drawn from inside an sr\.vmap that maps it.*Fix: pass the Rngs through sr\.vmap.*"
  r"or draw from one key, `{fix}`.*sr\.vmap\(Block, axis_size=4\)"
)


@pytest.mark.parametrize(
  "make, tag, fix",
  [
    (lambda keys: sr.Rngs(keys), "default", r"sr\.Rngs\(key\)"),
    (lambda keys: sr.Rngs(params=keys), "params", r"sr\.Rngs\(params=key\)"),
    (
      lambda keys: sr.Rngs(0, dropout=jax.random.key_data(keys)),
      "dropout",
      r"sr\.Rngs\(dropout=key\)",
    ),
  ],
)
def test_rngs_from_pre_split_keys_says_what_they_are(make, tag, fix):
  keys = jax.random.split(jax.random.key(0), 4)
  rngs = make(keys)
  with pytest.raises(ValueError, match=SPLIT.format(tag=tag, fix=fix)):
    rngs[tag]()
  assert int(rngs[tag].count.value[0]) == 0


def test_rngs_takes_one_key_and_the_class_form_splits_it():
  key = jax.random.key(0)
  rngs = sr.Rngs(key, params=jax.random.key_data(key))
  assert rngs.params().shape == ()
  stack = sr.vmap(sr.nn.Linear, axis_size=4)(2, 2, rngs=sr.Rngs(key))
  assert stack.kernel.shape == (4, 2, 2)
  assert not np.allclose(stack.kernel.value[0], stack.kernel.value[1])
