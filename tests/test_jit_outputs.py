"""sr.jit returning modules, sr.jit(...).lower, sr.eval_shape, and sharded init."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr


class Wrapper(sr.Module):
  def __init__(self, inner):
    self.inner = inner
    self.scale = sr.Param(jnp.ones(2))


def test_a_module_passed_in_and_returned_is_the_same_object_updated():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))

  @sr.jit
  def bump(model):
    model.bias.value = model.bias.value + 1
    return model

  for expected in (1.0, 2.0):  # the second call runs the cached executable
    out = bump(model)
    assert out is model
    np.testing.assert_array_equal(model.bias.value, [expected, expected])


def test_a_module_created_inside_equals_the_eager_one():
  make = lambda: sr.nn.Linear(3, 4, rngs=sr.Rngs(7))
  made = sr.jit(make)()
  eager = make()
  assert type(made) is sr.nn.Linear
  assert isinstance(made.kernel.value, jax.Array)
  for a, b in zip(jax.tree.leaves(sr.state(made)), jax.tree.leaves(sr.state(eager))):
    np.testing.assert_array_equal(a, b)
  assert made is not sr.jit(make)()  # every call returns new objects


def test_new_modules_referring_into_inputs_keep_the_callers_objects():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))

  @sr.jit
  def wrap(model, x):
    return Wrapper(model), model.kernel, sr.Param(x * 2), x + 1

  wrapper, kernel, fresh, y = wrap(model, jnp.ones(2))
  assert wrapper.inner is model and kernel is model.kernel
  assert type(fresh) is sr.Param and fresh is not model.kernel
  np.testing.assert_array_equal(fresh.value, [2.0, 2.0])
  np.testing.assert_array_equal(y, [2.0, 2.0])
  np.testing.assert_array_equal(wrapper.scale.value, [1.0, 1.0])


def test_a_stack_created_inside_stays_a_stack():
  class Block(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(2, 2, rngs=rngs)

  Stack = sr.vmap(Block, axis_size=3)
  stack = sr.jit(lambda: Stack(rngs=sr.Rngs(0)))()
  assert isinstance(stack, Block) and len(stack) == 3
  eager = Stack(rngs=sr.Rngs(0))
  np.testing.assert_array_equal(
    stack.layer(2).linear.kernel.value, eager.layer(2).linear.kernel.value
  )


def test_returning_a_module_reached_by_closure_raises():
  outside = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  with pytest.raises(sr.TraceContextError, match="not given as an argument"):
    sr.jit(lambda: outside)()


def test_an_error_after_creating_modules_changes_nothing():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  before = jax.tree.map(np.asarray, sr.state(model))

  @sr.jit
  def broken(model):
    model.bias.value = model.bias.value + 1
    Wrapper(model)
    raise KeyboardInterrupt  # even this one

  with pytest.raises(KeyboardInterrupt):
    broken(model)
  jax.tree.map(np.testing.assert_array_equal, sr.state(model), before)


def test_lower_returns_jaxs_lowered():
  model = sr.nn.Linear(4, 4, rngs=sr.Rngs(0))
  step = sr.jit(lambda model, x: model(x))
  lowered = step.lower(model, jnp.ones((2, 4)))
  assert isinstance(lowered, jax.stages.Lowered)
  assert "dot_general" in lowered.as_text()
  memory = lowered.compile().memory_analysis()
  assert memory.output_size_in_bytes == 2 * 4 * 4
  np.testing.assert_array_equal(model.bias.value, np.zeros(4))  # nothing ran


def test_lower_of_a_function_creating_modules():
  create = sr.jit(lambda: sr.nn.Linear(8, 16, rngs=sr.Rngs(0)))
  memory = create.lower().compile().memory_analysis()
  params = (8 * 16 + 16) * 4
  assert params <= memory.output_size_in_bytes < params + 64  # + the RNG key and count


# -- sr.eval_shape --------------------------------------------------------------------


def test_eval_shape_gives_abstract_modules_and_computes_nothing():
  calls = []

  def create():
    calls.append(1)
    return sr.nn.Linear(3, 5, rngs=sr.Rngs(0))

  abstract = sr.eval_shape(create)
  assert type(abstract) is sr.nn.Linear
  assert abstract.kernel.value == jax.ShapeDtypeStruct((3, 5), jnp.float32)
  assert abstract.bias.value == jax.ShapeDtypeStruct((5,), jnp.float32)
  assert calls == [1]  # traced once, nothing compiled or run


def test_eval_shape_leaves_its_arguments_as_they_were():
  model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  before = jax.tree.map(np.asarray, sr.state(model))

  def mutate(model, x):
    model.bias.value = model.bias.value + 1
    return model, model(x)

  copy, y = sr.eval_shape(mutate, model, jnp.ones((4, 2)))
  assert copy is not model and copy.bias.value == jax.ShapeDtypeStruct((3,), jnp.float32)
  assert y == jax.ShapeDtypeStruct((4, 3), jnp.float32)
  jax.tree.map(np.testing.assert_array_equal, sr.state(model), before)


def test_eval_shape_of_a_module_call():
  model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  assert sr.eval_shape(model, jnp.ones((4, 2))) == jax.ShapeDtypeStruct((4, 3), jnp.float32)


def test_eval_shape_keeps_the_layer_axis_in_partition_specs():
  class Block(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(4, 8, kernel_metadata={"sharding": ("embed", "mlp")}, rngs=rngs)

  Stack = sr.vmap(Block, axis_size=6, metadata_params={"partition_name": "layers"})
  abstract = sr.eval_shape(lambda: Stack(rngs=sr.Rngs(0)))
  specs = sr.get_partition_spec(sr.state(abstract))
  assert specs["linear"]["kernel"] == P("layers", "embed", "mlp")
  assert abstract.linear.kernel.value.shape == (6, 4, 8)
  assert "layers:6" in repr(sr.state(abstract, sr.Param))


def test_eval_shape_misuse_names_the_fix():
  with pytest.raises(TypeError, match="sr.eval_shape takes a function"):
    sr.eval_shape(jnp.ones(3))


# -- sharded init ---------------------------------------------------------------------

RULES = [("embed", "data"), ("mlp", "model")]


def _mesh():
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


class Big(sr.Module):
  def __init__(self, *, rngs):
    self.up = sr.nn.Linear(
      64,
      256,
      kernel_metadata={"sharding": ("embed", "mlp")},
      bias_metadata={"sharding": ("mlp",)},
      rngs=rngs,
    )
    self.down = sr.nn.Linear(
      256,
      64,
      kernel_metadata={"sharding": ("mlp", "embed")},
      bias_metadata={"sharding": ("embed",)},
      rngs=rngs,
    )


def test_sharded_init_creates_every_variable_in_its_sharding():
  mesh = _mesh()

  def create():
    model = Big(rngs=sr.Rngs(0))
    sr.shard(model, mesh, RULES)
    return model

  model = sr.jit(create)()
  assert model.up.kernel.value.sharding == NamedSharding(mesh, P("data", "model"))
  assert model.down.kernel.value.sharding == NamedSharding(mesh, P("model", "data"))
  eager = Big(rngs=sr.Rngs(0))  # the same numbers as an unsharded eager build
  jax.tree.map(np.testing.assert_array_equal, sr.state(model), sr.state(eager))

  # Per device, the outputs are the shards: as raw JAX drawing the same arrays with
  # out_shardings, not the whole arrays.
  ours = sr.jit(create).lower().compile().memory_analysis()
  spec = lambda *names: NamedSharding(mesh, P(*names))

  def raw(key):
    k1, k2 = jax.random.split(key)
    init = jax.nn.initializers.lecun_normal()
    return (init(k1, (64, 256)), jnp.zeros(256), init(k2, (256, 64)), jnp.zeros(64))

  theirs = (
    jax.jit(
      raw, out_shardings=(spec("data", "model"), spec("model"), spec("model", "data"), spec("data"))
    )
    .lower(jax.random.key(0))
    .compile()
    .memory_analysis()
  )
  params = theirs.output_size_in_bytes
  shards = (64 * 256 // 8 + 256 // 4 + 256 * 64 // 8 + 64 // 2) * 4
  assert shards <= params <= shards + 64  # + XLA's tuple of output pointers
  # The RNG streams' key and count are outputs too (a few bytes, replicated).
  assert params <= ours.output_size_in_bytes <= params * 1.05
  assert ours.temp_size_in_bytes <= max(1.5 * theirs.temp_size_in_bytes, 1024)


def test_explicit_meshes_build_under_auto_axes_then_place_without_moving():
  # Under Explicit axes a draw's sharding is its type: built under an Auto-axes mesh
  # (partitionable) and then placed on the Explicit mesh of the same devices, every
  # array keeps its layout and takes the Explicit type.
  auto = _mesh()
  explicit = jax.make_mesh((2, 4), ("data", "model"))

  def create():
    model = Big(rngs=sr.Rngs(0))
    sr.shard(model, auto, RULES)
    return model

  model = sr.jit(create)()
  shards = {
    path: [s.data for s in v.addressable_shards] for path, v in sr.state(model).flat().items()
  }
  sr.shard(model, explicit, RULES)
  assert jax.typeof(model.up.kernel.value).sharding.spec == P("data", "model")
  assert jax.typeof(model.up.kernel.value).sharding.mesh == explicit.abstract_mesh
  for path, value in sr.state(model).flat().items():
    for before, after in zip(shards[path], value.addressable_shards):
      np.testing.assert_array_equal(after.data, before)
  eager = Big(rngs=sr.Rngs(0))
  jax.tree.map(np.testing.assert_array_equal, sr.state(model), sr.state(eager))
