"""Modules are pytrees: raw jax.jit / jax.grad / jax.vmap / jax.tree.map take them,
functionally (as in equinox and flax.nnx 0.12); the sr transforms still work in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import statefulremat as sr

X = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)


class MLP(sr.Module):
  """``depth`` Linear layers of ``width`` and a head; with ``tie``, the last layer is
  applied twice (a shared sub-module) and shares its kernel with the second."""

  def __init__(self, depth, width, *, tie=False, rngs):
    self.layers = [sr.nn.Linear(2 if i == 0 else width, width, rngs=rngs) for i in range(depth)]
    self.head = sr.nn.Linear(width, 1, rngs=rngs)
    self.again = self.layers[-1] if tie and depth > 1 else None
    if tie and depth > 2:
      self.layers[-1].kernel = self.layers[1].kernel

  def __call__(self, x):
    for layer in self.layers + ([self.again] if self.again is not None else []):
      x = jnp.tanh(layer(x))
    return self.head(x)


class Tied(sr.Module):
  """A Variable and a sub-module each reached twice."""

  def __init__(self, *, rngs):
    self.a = sr.nn.Linear(2, 2, rngs=rngs)
    self.b = sr.nn.Linear(2, 2, rngs=rngs)
    self.b.kernel = self.a.kernel
    self.again = self.a

  def __call__(self, x):
    return self.again(self.b(x))


class Net(sr.Module):
  """Attributes, a list, a dict and a BatchNorm: every kind of key."""

  def __init__(self, *, rngs):
    self.layers = [sr.nn.Linear(2, 2, rngs=rngs)]
    self.blocks = {"first": sr.nn.Linear(2, 2, use_bias=False, rngs=rngs)}
    self.norm = sr.nn.BatchNorm(2, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.blocks["first"](self.layers[0](x)))


class Noisy(sr.Module):
  """A Linear and a Dropout drawing from a stored Rngs (typed key and count leaves)."""

  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(2, 2, rngs=rngs)
    self.drop = sr.nn.Dropout(0.5, rngs=rngs)
    self.rngs = rngs

  def __call__(self, x):
    return self.drop(self.linear(x))


def values(module):
  def data(v):
    return jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v

  return {path: np.asarray(data(v)) for path, v in sr.state(module).flat().items()}


def assert_same_values(a, b):
  va, vb = values(a), values(b)
  assert list(va) == list(vb)
  for path in va:
    np.testing.assert_array_equal(va[path], vb[path], err_msg=str(path))


def variables(module):
  return [v for _, v in module.iter_variables()]


# -- structure: leaves, treedef, keys ------------------------------------------------


def test_leaves_are_the_state_leaves_in_split_order():
  model = Net(rngs=sr.Rngs(0))
  leaves = jax.tree.leaves(model)
  assert all(a is b for a, b in zip(leaves, jax.tree.leaves(sr.state(model))))
  assert len(leaves) == len(jax.tree.leaves(sr.state(model))) == 7
  assert all(a is v.value for a, v in zip(leaves, variables(model)))


def test_shared_objects_give_one_leaf_and_come_back_shared():
  model = Tied(rngs=sr.Rngs(0))
  leaves, treedef = jax.tree.flatten(model)
  assert len(leaves) == 3  # a.bias, a.kernel, b.bias
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert type(rebuilt) is Tied and rebuilt is not model
  assert rebuilt.again is rebuilt.a and rebuilt.b.kernel is rebuilt.a.kernel
  assert rebuilt.a.kernel is not model.a.kernel
  np.testing.assert_array_equal(rebuilt(X), model(X))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  depth=st.integers(1, 4), width=st.integers(1, 4), tie=st.booleans(), seed=st.integers(0, 2**16)
)
def test_flatten_unflatten_round_trip(depth, width, tie, seed):
  model = MLP(depth, width, tie=tie, rngs=sr.Rngs(seed))
  leaves, treedef = jax.tree.flatten(model)
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert type(rebuilt) is MLP and rebuilt is not model
  assert sr.graphdef(rebuilt) == sr.graphdef(model)
  assert jax.tree.structure(rebuilt) == treedef
  assert_same_values(rebuilt, model)
  # sharing survives exactly: as many distinct Variables as leaves, in both
  assert len(variables(rebuilt)) == len(variables(model)) == len(leaves)
  assert not {id(v) for v in variables(rebuilt)} & {id(v) for v in variables(model)}
  if tie and depth > 1:
    assert rebuilt.again is rebuilt.layers[-1]
  if tie and depth > 2:
    assert rebuilt.layers[-1].kernel is rebuilt.layers[1].kernel
  np.testing.assert_array_equal(rebuilt(X), model(X))


def test_treedef_is_the_graph_structure():
  a, b = Net(rngs=sr.Rngs(0)), Net(rngs=sr.Rngs(1))
  assert jax.tree.structure(a) == jax.tree.structure(b)
  b.eval()  # a static attribute changes the GraphDef, so the tree structure
  assert jax.tree.structure(a) != jax.tree.structure(b)


def test_key_paths_name_each_variable():
  model = Net(rngs=sr.Rngs(0))
  paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(model)]
  assert [jax.tree_util.keystr(p) for p in paths] == [
    ".blocks['first'].kernel",
    ".layers[0].bias",
    ".layers[0].kernel",
    ".norm.bias",
    ".norm.mean",
    ".norm.scale",
    ".norm.var",
  ]
  (key,) = paths[1]
  assert key.keys == (
    jax.tree_util.GetAttrKey("layers"),
    jax.tree_util.SequenceKey(0),
    jax.tree_util.GetAttrKey("bias"),
  )
  assert paths[0][0].keys[1] == jax.tree_util.DictKey("first")
  assert [p[0].name for p in paths[:3]] == ["kernel", "bias", "kernel"]
  # the same paths as the State's
  assert [jax.tree_util.keystr(p) for p in paths[1:]] == [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(sr.state(model))
  ][1:]


def test_unhashable_static_attribute_is_a_graph_error():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  model.bad = bytearray(b"x")
  with pytest.raises(sr.GraphError, match=r"`bad` holds a bytearray, which is not hash"):
    jax.tree.leaves(model)


# -- jax.tree.map and placeholder leaves ---------------------------------------------


def test_tree_map_returns_a_new_module():
  model = Net(rngs=sr.Rngs(0))
  before = values(model)
  zeros = jax.tree.map(lambda x: x * 0, model)
  assert type(zeros) is Net and zeros is not model
  assert all(not np.asarray(v).any() for v in values(zeros).values())
  assert_same_values(model, model)
  for path, v in values(model).items():
    np.testing.assert_array_equal(v, before[path])
  summed = jax.tree.map(lambda a, b: a + b, model, model)
  np.testing.assert_array_equal(summed.norm.scale.value, 2 * model.norm.scale.value)


def test_placeholder_leaves_round_trip():
  model = Tied(rngs=sr.Rngs(0))
  treedef = jax.tree.structure(model)
  marks = [object() for _ in range(treedef.num_leaves)]
  rebuilt = treedef.unflatten(marks)
  assert [v.value for v in variables(rebuilt)] == marks
  assert rebuilt.b.kernel is rebuilt.a.kernel
  nones = treedef.unflatten([None] * treedef.num_leaves)
  assert jax.tree.leaves(nones) == []
  assert jax.tree.leaves(nones, is_leaf=lambda x: x is None) == [None] * 3
  mapped = jax.tree.map(lambda x: x, nones, is_leaf=lambda x: x is None)
  assert type(mapped) is Tied


def test_eval_shape_and_partition_specs():
  model = Net(rngs=sr.Rngs(0))
  shapes = jax.eval_shape(lambda m: m, model)
  assert type(shapes) is Net
  kernel = shapes.layers[0].kernel.value
  assert isinstance(kernel, jax.ShapeDtypeStruct)
  assert (kernel.shape, kernel.dtype) == ((2, 2), jnp.float32)
  specs = jax.tree.map(lambda x: jax.sharding.PartitionSpec(*[None] * x.ndim), model)
  assert specs.norm.mean.value == jax.sharding.PartitionSpec(None)


# -- raw jax.jit, jax.grad, jax.vmap -------------------------------------------------


def test_raw_jit_calls_the_model():
  model = MLP(3, 4, tie=True, rngs=sr.Rngs(0))
  out = jax.jit(lambda m, x: m(x))(model, X)
  # Fused under jit, op by op eagerly: equal to float32 rounding (newer XLA differs in ulps).
  np.testing.assert_allclose(out, model(X), rtol=1e-5, atol=1e-7)


def test_raw_grad_is_a_module_of_gradients_equal_to_sr_grad():
  model = MLP(3, 4, tie=True, rngs=sr.Rngs(0))

  def loss(m, x):
    return jnp.sum(m(x) ** 2)

  raw = jax.grad(loss)(model, X)
  ours = sr.grad(loss)(model, X)
  assert type(raw) is MLP and isinstance(ours, sr.State)
  assert sr.graphdef(raw) == sr.graphdef(model)
  raw_leaves, our_leaves = jax.tree.leaves(raw), jax.tree.leaves(ours)
  assert len(raw_leaves) == len(our_leaves) == len(jax.tree.leaves(model))
  for a, b in zip(raw_leaves, our_leaves):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  assert list(sr.state(raw).flat()) == list(ours.flat())
  # a functional step, as in equinox: params - lr * grads
  stepped = jax.tree.map(lambda p, g: p - 0.1 * g, model, raw)
  assert type(stepped) is MLP and float(loss(stepped, X)) < float(loss(model, X))


def test_raw_jit_mutation_comes_back_only_through_the_return_value():
  model = Net(rngs=sr.Rngs(0))
  before = values(model)

  @jax.jit
  def step(m, x):
    y = m(x)  # train mode: BatchNorm moves its running statistics in m
    return m, y

  new, y = step(model, X)
  assert type(new) is Net and new is not model
  for path, v in values(model).items():  # the caller's model is untouched
    np.testing.assert_array_equal(v, before[path])
  assert not np.allclose(new.norm.mean.value, model.norm.mean.value)
  # ... and the returned module holds what sr.jit writes in place
  inplace = sr.clone(model)
  y_sr = sr.jit(lambda m, x: m(x))(inplace, X)
  np.testing.assert_allclose(y, y_sr, rtol=1e-6)
  np.testing.assert_allclose(new.norm.mean.value, inplace.norm.mean.value, rtol=1e-6)
  np.testing.assert_allclose(new.norm.var.value, inplace.norm.var.value, rtol=1e-6)
  # the returned module is an ordinary one: sr.jit takes it
  sr.jit(lambda m, x: m(x))(new, X)


def test_raw_jit_without_returning_the_module_drops_the_change():
  model = Net(rngs=sr.Rngs(0))
  mean = np.asarray(model.norm.mean.value)
  jax.jit(lambda m, x: m(x))(model, X)
  np.testing.assert_array_equal(model.norm.mean.value, mean)


def test_raw_vmap_over_a_stack_maps_its_layers():
  stack = sr.vmap(sr.nn.Linear, axis_size=3)(2, 2, rngs=sr.Rngs(0))
  xs = jnp.linspace(-1.0, 1.0, 3 * 4 * 2).reshape(3, 4, 2)
  out = jax.vmap(sr.nn.Linear.__call__)(stack, xs)
  assert out.shape == (3, 4, 2)
  np.testing.assert_allclose(out, stack(xs), rtol=1e-6)
  for i in range(3):
    np.testing.assert_allclose(out[i], stack.layer(i)(xs[i]), rtol=1e-6)
  kernels = jax.vmap(lambda m: m.kernel.value.sum())(stack)
  np.testing.assert_allclose(kernels, stack.kernel.value.sum((1, 2)), rtol=1e-6)
  doubled = jax.tree.map(lambda x: 2 * x, stack)
  assert type(doubled) is type(stack) and len(doubled) == 3


def test_models_with_rngs_round_trip():
  model = Noisy(rngs=sr.Rngs(0))
  leaves, treedef = jax.tree.flatten(model)
  assert any(jnp.issubdtype(x.dtype, jax.dtypes.prng_key) for x in leaves)
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert rebuilt.drop.rngs is rebuilt.rngs and rebuilt.rngs is not model.rngs
  assert_same_values(rebuilt, model)
  through_jit = jax.jit(lambda m: m)(model)
  assert_same_values(through_jit, model)
  count = int(model.rngs.default.count.value)
  # the copies draw the same masks as the original, and advance on their own
  np.testing.assert_array_equal(rebuilt(X), model(X))
  assert int(rebuilt.rngs.default.count.value) == count + 1
  assert int(through_jit.rngs.default.count.value) == count
  # a raw jax.jit step that draws a key returns the advanced stream
  new, _ = jax.jit(lambda m, x: (m, m(x)))(through_jit, X)
  assert int(new.rngs.default.count.value) == count + 1
  assert int(through_jit.rngs.default.count.value) == count


def test_scan_stack_round_trips_as_the_stacked_class():

  class Step(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(2, 2, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.linear(x)), None

  stack = sr.scan(Step, length=3, variable_axes={sr.Param: 0}, split_rngs={"params": True})(
    rngs=sr.Rngs(0)
  )
  leaves, treedef = jax.tree.flatten(stack)
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert type(rebuilt) is type(stack) and len(rebuilt) == 3
  assert type(rebuilt.layer(2)) is Step
  assert_same_values(rebuilt, stack)
  np.testing.assert_array_equal(rebuilt(X)[0], stack(X)[0])
  via_jit = jax.jit(lambda s, x: (s, s(x)[0]))(stack, X)
  assert type(via_jit[0]) is type(stack)
  np.testing.assert_allclose(via_jit[1], stack(X)[0], rtol=1e-6)


# -- the sr transforms are unchanged -------------------------------------------------


def test_sr_jit_still_updates_in_place():
  model = Net(rngs=sr.Rngs(0))
  mean = np.asarray(model.norm.mean.value)
  step = sr.jit(lambda m, x: m(x))
  np.testing.assert_allclose(step(model, X), Net(rngs=sr.Rngs(0))(X), rtol=1e-6)
  assert not np.allclose(model.norm.mean.value, mean)


def test_sr_grad_still_returns_a_state():
  model = Noisy(rngs=sr.Rngs(0))
  count = int(model.rngs.default.count.value)
  grads = sr.grad(lambda m, x: jnp.sum(m(x) ** 2))(model, X)
  assert isinstance(grads, sr.State)
  assert sorted(grads.flat()) == [("linear", "bias"), ("linear", "kernel")]
  assert int(model.rngs.default.count.value) == count + 1  # the draw was written back


def test_sr_scan_still_writes_back():

  class Cell(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(2, 2, rngs=rngs)
      self.calls = sr.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, c, x):
      self.calls.value = self.calls.value + 1
      return jnp.tanh(self.linear(c) + x), c

  cell = Cell(rngs=sr.Rngs(0))
  c, ys = sr.scan(lambda m, c, x: m(c, x), variable_carry="batch_stats")(
    cell, jnp.zeros((2,)), jnp.ones((4, 2))
  )
  assert ys.shape == (4, 2) and int(cell.calls.value) == 4


def test_flattening_a_closed_over_module_inside_sr_jit_raises():
  model, other = Net(rngs=sr.Rngs(0)), Net(rngs=sr.Rngs(1))

  @sr.jit
  def f(other, x):
    return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(model)) * x

  with pytest.raises(
    sr.TraceContextError,
    match=r"sr\.jit\(f\) read `blocks\.first\.kernel` \(Param\) of a "
    r"Net that it was not given as an argument",
  ):
    f(other, 2.0)
  # flattening the argument (and what is made from it inside) is fine
  total = sr.jit(
    lambda m: sum(jnp.sum(leaf) for leaf in jax.tree.leaves(jax.tree.map(lambda v: 2 * v, m)))
  )(model)
  np.testing.assert_allclose(
    total, 2 * sum(jnp.sum(leaf) for leaf in jax.tree.leaves(model)), rtol=1e-6
  )


def test_the_readme_raw_jax_block_runs():
  import re
  from pathlib import Path

  text = (Path(__file__).resolve().parent.parent / "README.md").read_text("utf-8")
  section = text.split("### Raw JAX on modules", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
  namespace = {"jax": jax, "jnp": jnp, "sr": sr, "x": jnp.ones((4, 16))}
  exec(compile(code, "README.md", "exec"), namespace)
  lin, lin2, grads = namespace["lin"], namespace["lin2"], namespace["grads"]
  assert type(grads) is type(lin2) is sr.nn.Linear
  np.testing.assert_allclose(
    lin2.kernel.value, lin.kernel.value - 0.1 * grads.kernel.value, rtol=1e-6
  )


# -- the flatten cache: a walk is kept per module while no structure changes ----------


def leaf_ids(module):
  return [id(x) for x in jax.tree.leaves(module)]


def test_cached_flatten_sees_a_new_attribute_and_a_replaced_sub_module():
  model = Net(rngs=sr.Rngs(0))
  treedef = jax.tree.structure(model)
  assert len(jax.tree.leaves(model)) == 7
  model.extra = sr.Param(jnp.full((3,), 5.0))
  leaves, new_treedef = jax.tree.flatten(model)
  assert new_treedef != treedef and len(leaves) == 8
  np.testing.assert_array_equal(leaves[1], jnp.full((3,), 5.0))  # after `blocks`
  model.norm = sr.nn.LayerNorm(2, rngs=sr.Rngs(1))  # BatchNorm (4) -> LayerNorm (2)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(model)]
  assert paths[-2:] == [".norm.bias", ".norm.scale"] and len(paths) == 6
  model.layers[0] = sr.nn.Linear(2, 5, rngs=sr.Rngs(2))  # an item of a tracked list
  assert model.layers[0].kernel.value is jax.tree.leaves(model)[3]
  assert jax.tree.leaves(model)[3].shape == (2, 5)
  rebuilt = jax.tree.map(lambda x: x, model)
  assert type(rebuilt.norm) is sr.nn.LayerNorm and rebuilt.layers[0].kernel.shape == (2, 5)


def test_cached_flatten_sees_eval_and_metadata_changes():
  model = Net(rngs=sr.Rngs(0))
  before = jax.tree.structure(model)
  model.eval()  # flips `use_running_average`, a static attribute
  after = jax.tree.structure(model)
  assert after != before
  assert jax.tree.unflatten(after, jax.tree.leaves(model)).norm.use_running_average
  model.norm.mean.set_metadata(sharding=("batch",))
  assert jax.tree.structure(model) != after
  assert jax.tree.map(lambda x: x, model).norm.mean.sharding == ("batch",)


def test_a_graphs_walk_holds_while_its_own_structure_does():
  """A graph's structure version is its own: a change to another graph costs it no walk,
  and a change anywhere inside it, however deep, is seen."""
  from statefulremat.core._graph_cache import walk_of

  class Deep(sr.Module):
    def __init__(self):
      self.heads = {"a": [sr.nn.Linear(2, 2, rngs=sr.Rngs(0))]}

  model, other = Deep(), Net(rngs=sr.Rngs(1))
  jax.tree.leaves(model)
  walk = walk_of((model,))
  assert walk is not None
  other.extra = 1.0  # another graph's structure
  sr.nn.Linear(2, 2, rngs=sr.Rngs(2))  # a new module, in no graph
  assert walk_of((model,)) is walk
  model.heads["a"][0].use_bias = False  # deep inside: a static attribute
  assert walk_of((model,)) is None
  assert (
    jax.tree.unflatten(jax.tree.structure(model), jax.tree.leaves(model)).heads["a"][0].use_bias
    is False
  )
  jax.tree.leaves(model)
  model.heads["b"] = sr.nn.Linear(2, 3, rngs=sr.Rngs(3))  # a tracked dict's new item
  assert len(jax.tree.leaves(model)) == 4
  model.heads["a"][0].kernel.set_metadata(sharding=("x", None))  # a Variable's metadata
  assert jax.tree.map(lambda x: x, model).heads["a"][0].kernel.sharding == ("x", None)


def test_sr_jit_walks_a_model_again_only_when_its_own_structure_changes(monkeypatch):
  from statefulremat.transforms import _lift

  walks = []
  real = _lift.flatten
  monkeypatch.setattr(_lift, "flatten", lambda *a, **k: walks.append(1) or real(*a, **k))
  model, other = Net(rngs=sr.Rngs(0)), Net(rngs=sr.Rngs(1))
  step = sr.jit(lambda m: m.layers[0].kernel.value.sum())
  step(model)
  first = len(walks)
  other.extra = 1.0
  step(model)
  assert len(walks) == first  # another graph changed: no walk
  model.layers[0].kernel.value = jnp.ones((2, 2))
  model.layers[0] = sr.nn.Linear(2, 2, rngs=sr.Rngs(2))
  assert float(step(model)) == float(model.layers[0].kernel.value.sum())
  assert len(walks) > first


def test_cached_flatten_sees_values_changed_in_place():
  model = Net(rngs=sr.Rngs(0))
  jax.tree.leaves(model)
  new = jnp.full((2, 2), 3.0)
  model.layers[0].kernel.value = new
  model.norm.mean[...] = jnp.ones(2)
  leaves = jax.tree.leaves(model)
  assert leaves[2] is new
  np.testing.assert_array_equal(leaves[4], jnp.ones(2))
  np.testing.assert_array_equal(jax.jit(lambda m: m.layers[0].kernel.value)(model), new)


def test_two_models_of_one_structure_do_not_share_leaves():
  a, b = Net(rngs=sr.Rngs(0)), Net(rngs=sr.Rngs(1))
  (la, ta), (lb, tb) = jax.tree.flatten(a), jax.tree.flatten(b)
  assert ta == tb
  assert all(x is v.value for x, v in zip(la, variables(a)))
  assert all(x is v.value for x, v in zip(lb, variables(b)))
  assert not set(map(id, la)) & set(map(id, lb))
  before = values(b)
  a2 = jax.tree.map(lambda x: x + 1, a)
  assert not set(leaf_ids(a2)) & set(leaf_ids(b))
  for path, v in values(b).items():
    np.testing.assert_array_equal(v, before[path])
  # a module rebuilt by an unflatten has a walk of its own, too
  a2.layers[0].kernel.value = jnp.zeros((2, 2))
  assert jax.tree.leaves(a2)[2] is a2.layers[0].kernel.value
  assert jax.tree.leaves(a)[2] is a.layers[0].kernel.value
  a2.extra = sr.BatchStat(jnp.zeros(()))
  assert len(jax.tree.leaves(a2)) == 8 and len(jax.tree.leaves(a)) == 7


def test_a_copy_flattens_to_its_own_leaves():
  import copy
  import pickle

  model = Net(rngs=sr.Rngs(0))
  jax.tree.leaves(model)
  for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
    assert leaf_ids(twin) == [id(v.value) for v in variables(twin)]
    assert not set(leaf_ids(twin)) & set(leaf_ids(model))
    assert jax.tree.structure(twin) == jax.tree.structure(model)


def test_a_bad_attribute_after_a_cached_flatten_still_raises():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  kernel = model.kernel.value
  jax.tree.leaves(model)
  model.bad = [np.zeros(2)]
  with pytest.raises(sr.GraphError, match=r"`bad\[0\]` holds an array .* Fix: wrap it"):
    jax.tree.leaves(model)
  with pytest.raises(sr.GraphError, match=r"`bad\[0\]` holds an array"):
    jax.jit(lambda m: m.kernel.value)(model)
  assert model.kernel.value is kernel  # nothing changed
  del model.bad
  assert jax.tree.leaves(model)[1] is kernel


def test_a_flattened_module_that_goes_releases_its_variables():
  import gc
  import weakref

  model = Net(rngs=sr.Rngs(0))
  jax.tree.leaves(model)
  rebuilt = jax.tree.map(lambda x: x, model)
  jax.tree.leaves(rebuilt)
  gone = [weakref.ref(model.norm.mean), weakref.ref(rebuilt.norm.mean)]
  del model, rebuilt
  gc.collect()
  assert [r() for r in gone] == [None, None]


def test_threads_flattening_different_models():
  import threading

  models = [MLP(3, 4, rngs=sr.Rngs(i)) for i in range(2)]
  errors, start = [], threading.Barrier(2)

  def work(model, i):
    try:
      start.wait()
      for step in range(200):
        if step % 10 == 0:  # structural changes, which bump the shared epoch
          model.tag = (i, step)
        leaves, treedef = jax.tree.flatten(model)
        assert [id(x) for x in leaves] == [id(v.value) for v in variables(model)]
        rebuilt = treedef.unflatten(leaves)
        assert rebuilt.tag == model.tag and type(rebuilt) is MLP
        assert [id(x) for x in jax.tree.leaves(rebuilt)] == [id(x) for x in leaves]
    except Exception as e:  # reported below, with the thread that raised it
      errors.append((i, e))

  threads = [threading.Thread(target=work, args=(m, i)) for i, m in enumerate(models)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == []
