"""SPMD on 8 CPU devices (tests/conftest.py forces them): partition specs from
``sharding`` metadata, flax-style logical-to-mesh rules, placing a model on a Mesh, and
a data- and model-parallel remat_scan training step equal to the one-device step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr

D, LENGTHS = 8, (2, 2)
RULES = [("batch", "data"), ("mlp", "model"), ("embed", None), ("layers", None)]


def mesh_2x4():
  assert len(jax.devices()) == 8, "tests/conftest.py should force 8 CPU devices"
  return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def named(*axes):
  return {"sharding": axes}


class Block(sr.Module):
  def __init__(self, d, *, rngs):
    self.norm = sr.nn.BatchNorm(
      d,
      scale_metadata=named("embed"),
      bias_metadata=named("embed"),
      mean_metadata=named("embed"),
      var_metadata=named("embed"),
      rngs=rngs,
    )
    self.up = sr.nn.Linear(
      d, 2 * d, kernel_metadata=named("embed", "mlp"), bias_metadata=named("mlp"), rngs=rngs
    )
    self.down = sr.nn.Linear(
      2 * d, d, kernel_metadata=named("mlp", "embed"), bias_metadata=named("embed"), rngs=rngs
    )

  def __call__(self, x):
    return x + self.down(jax.nn.relu(self.up(self.norm(x))))


class CarryBlock(Block):
  def __call__(self, x):
    return super().__call__(x), None


Stack = sr.remat_scan(Block, lengths=LENGTHS, metadata_params={"partition_name": "layers"})


def leaves(model, kind=...):
  return {k: np.asarray(v) for k, v in sr.state(model, kind).flat().items()}


# -- specs and rules ------------------------------------------------------------------


def test_stacked_variables_carry_the_layer_axis_name_and_lose_it_inside_the_body():
  stack = Stack(D, rngs=sr.Rngs(0))
  specs = sr.get_partition_spec(stack)
  assert specs["up"]["kernel"] == P("layers", "embed", "mlp")
  assert specs["norm"]["mean"] == P("layers", "embed")
  seen = []

  class Peek(Block):
    def __call__(self, x):
      seen.append(self.up.kernel.sharding)
      return super().__call__(x)

  sr.remat_scan(Peek, lengths=LENGTHS, metadata_params={"partition_name": "layers"})(
    D, rngs=sr.Rngs(0)
  )(jnp.ones((4, D)))
  assert set(seen) == {("embed", "mlp")}


def test_specs_of_a_module_and_of_its_state_agree_and_unannotated_is_replicated():
  layer = sr.nn.Linear(2, 4, kernel_metadata=named(None, "mlp"), rngs=sr.Rngs(0))
  assert (
    sr.get_partition_spec(layer).flat()
    == sr.get_partition_spec(sr.state(layer)).flat()
    == {("kernel",): P(None, "mlp"), ("bias",): P()}
  )


def test_logical_to_mesh_follows_flax_rules():
  rules = [("batch", ("data", "model")), ("mlp", "model"), ("heads", "model"), ("embed", None)]
  assert sr.logical_to_mesh(P("batch", "embed"), rules) == P(("data", "model"), None)
  # A mesh axis serves one dimension of a spec: the later name falls back to None.
  assert sr.logical_to_mesh(P("mlp", "heads"), rules) == P("model", None)
  assert sr.logical_to_mesh(P("unknown", None), rules) == P(None, None)
  specs = sr.logical_to_mesh(sr.get_partition_spec(Stack(D, rngs=sr.Rngs(0))), RULES)
  assert specs["up"]["kernel"] == P(None, None, "model")
  assert specs["down"]["bias"] == P(None, None)


def test_a_stack_without_a_partition_name_replicates_its_layer_axis():
  # The layer axis is recorded in each stacked Variable's metadata, so an unnamed one
  # is known and replicated (None) instead of leaving the spec one entry short.
  stack = sr.remat_scan(Block, lengths=LENGTHS)(D, rngs=sr.Rngs(0))
  specs = sr.get_partition_spec(stack)
  assert specs["down"]["bias"] == P(None, "embed")
  assert sr.get_partition_spec(sr.state(stack))["down"]["bias"] == P(None, "embed")
  # A hand-made array that is one short is still an error, with the hint.
  layer = stack.layer(0)
  layer.down.bias = sr.Param(jnp.zeros((4, D)), sharding=("embed",))
  with pytest.raises(
    sr.StateMismatchError,
    match=(
      r"`down.bias` has sharding=\('embed',\) for an array of shape \(4, 8\): give one "
      r"axis name .* one short: .* metadata_params=\{'partition_name': 'layers'\}"
    ),
  ):
    sr.get_partition_spec(layer)


def test_bad_rules_and_bad_arguments():
  with pytest.raises(
    sr.TransformError,
    match=r"each rule is a \(logical name, mesh axis\) "
    r"pair, got 'mlp'",
  ):
    sr.logical_to_mesh(P("mlp"), ["mlp"])
  with pytest.raises(TypeError, match="takes a State or a module, got dict"):
    sr.get_partition_spec({"w": 1})
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, got tuple"):
    sr.shard(Stack(D, rngs=sr.Rngs(0)), (2, 4), RULES)
  with pytest.raises(TypeError, match="places a module's arrays; got State"):
    sr.shard(sr.state(Stack(D, rngs=sr.Rngs(0))), mesh_2x4(), RULES)


# -- placing ---------------------------------------------------------------------------


def test_shard_places_every_array_as_its_spec_says():
  mesh = mesh_2x4()
  stack = Stack(D, rngs=sr.Rngs(0))
  before = leaves(stack)
  assert sr.shard(stack, mesh, RULES) is stack  # the model, as DESIGN says
  kernel = stack.up.kernel.value
  assert kernel.sharding == NamedSharding(mesh, P(None, None, "model"))
  assert {s.data.shape for s in kernel.addressable_shards} == {(4, D, 2 * D // 4)}
  after = leaves(stack)
  for path in before:
    np.testing.assert_array_equal(after[path], before[path])


def test_shard_that_does_not_fit_names_the_path_and_moves_nothing():
  stack = Stack(D, rngs=sr.Rngs(0))
  wrong_axis = [("mlp", "tensor")]
  with pytest.raises(
    sr.StateMismatchError,
    match=(
      r"`down.kernel`: its spec .* names mesh axis 'tensor', but the mesh has "
      r"\('data', 'model'\). Fix: map the logical name"
    ),
  ):
    sr.shard(stack, mesh_2x4(), wrong_axis)
  assert stack.up.kernel.value.sharding.num_devices == 1
  odd = sr.nn.Linear(2, 3, kernel_metadata=named(None, "mlp"), rngs=sr.Rngs(0))
  with pytest.raises(
    sr.StateMismatchError,
    match=(
      r"`kernel`: dimension 1 \(size 3\) does not divide over mesh axes \('model',\) "
      r"\(4 devices\)"
    ),
  ):
    sr.shard(odd, mesh_2x4(), RULES)
  assert odd.kernel.value.sharding.num_devices == 1


def test_shard_inside_jit_constrains():
  mesh = mesh_2x4()

  @sr.jit
  def constrain(model):
    sr.shard(model, mesh, RULES)
    return model.up.kernel.value * 1

  stack = Stack(D, rngs=sr.Rngs(0))
  text = (
    jax.jit(lambda s: constrain(sr.merge(sr.graphdef(stack), s))).lower(sr.state(stack)).as_text()
  )
  # The kernel's (None, None, "model") constraint, in Shardy's notation.
  assert "sharding_constraint %arg" in text and '[{}, {}, {"model"}]' in text
  out = constrain(stack)
  assert out.sharding.spec == P(None, None, "model")
  assert stack.up.kernel.value.sharding.spec == P(None, None, "model")


# -- the training step ------------------------------------------------------------------


@sr.jit
def train_step(model, opt, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = sr.value_and_grad(loss_fn)(model)
  opt.update(grads)
  return loss, grads


def test_data_and_model_parallel_step_equals_one_device():
  mesh = mesh_2x4()
  x = jax.random.normal(jax.random.key(1), (8, D))
  y = jax.random.normal(jax.random.key(2), (8, D))

  single = Stack(D, rngs=sr.Rngs(0))
  single_opt = sr.Optimizer(single, optax.sgd(0.1))
  loss1, grads1 = train_step(single, single_opt, x, y)

  parallel = Stack(D, rngs=sr.Rngs(0))
  sr.shard(parallel, mesh, RULES)
  shardings = {path: v.sharding for path, v in sr.state(parallel).flat().items()}
  opt = sr.Optimizer(parallel, optax.sgd(0.1))
  batch = NamedSharding(mesh, P("data"))
  loss2, grads2 = train_step(parallel, opt, jax.device_put(x, batch), jax.device_put(y, batch))

  np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
  for path, g in grads1.flat().items():
    np.testing.assert_allclose(grads2.flat()[path], g, rtol=1e-4, atol=1e-6)
  new1, new2 = leaves(single), leaves(parallel)  # params and batch statistics
  for path in new1:
    np.testing.assert_allclose(new2[path], new1[path], rtol=1e-5, atol=1e-6)
  # The step kept every variable where its spec says.
  for path, sharding in shardings.items():
    value = sr.state(parallel).flat()[path]
    assert value.sharding.is_equivalent_to(sharding, value.ndim), (path, value.sharding)
  assert parallel.up.kernel.value.sharding.spec == P(None, None, "model")


@pytest.mark.parametrize("transform", ["scan", "remat_scan"])
def test_data_transform_constrains_each_iteration(transform):
  mesh = mesh_2x4()
  specs = []

  def constrain(state):
    specs.append(sr.logical_to_mesh(sr.get_partition_spec(state), RULES))
    return jax.tree.map(
      lambda v, s: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, s)),
      state,
      specs[-1],
      is_leaf=lambda s: isinstance(s, P),
    )

  options = dict(data_transform=constrain, metadata_params={"partition_name": "layers"})
  if transform == "scan":
    Scanned = sr.scan(
      CarryBlock,
      length=4,
      variable_axes={sr.Param: 0, sr.BatchStat: 0},
      split_rngs={"params": True},
      **options,
    )
  else:
    Scanned = sr.remat_scan(Block, lengths=LENGTHS, **options)
  model = Scanned(D, rngs=sr.Rngs(0))
  plain = sr.clone(model)
  x = jnp.ones((8, D))

  def call(m, x):
    return m(x)[0] if transform == "scan" else m(x)

  text = (
    jax.jit(lambda s, x: call(sr.merge(sr.graphdef(model), s), x))
    .lower(sr.state(model), x)
    .as_text()
  )
  assert "sharding_constraint" in text
  # Inside the body the layer axis is gone: the specs are per layer.
  assert specs[0]["up"]["kernel"] == P(None, "model")
  np.testing.assert_allclose(call(model, x), call(plain, x), rtol=1e-6)
