"""sr.pipeline on 8 CPU devices: GPipe and circular schedules over meshes (stage=4,
data=2) and (stage=8), equal to the sequential microbatch-by-microbatch run (value,
gradients, BatchNorm statistics, dropout keys, RNG counts), under sr.jit and
sr.Optimizer, with collective-permutes in the compiled program; and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr

D, B = 4, 16
META = {"partition_name": "layers"}


def named(*axes):
  return {"sharding": axes}


class Block(sr.Module):
  def __init__(self, d, *, rngs):
    self.linear = sr.nn.Linear(
      d, d, kernel_metadata=named(None, None), bias_metadata=named(None), rngs=rngs
    )

  def __call__(self, x):
    return x + 0.5 * jnp.tanh(self.linear(x))


class NormDropBlock(sr.Module):
  def __init__(self, d, *, rngs):
    self.linear = sr.nn.Linear(
      d, d, kernel_metadata=named(None, None), bias_metadata=named(None), rngs=rngs
    )
    self.norm = sr.nn.BatchNorm(
      d,
      momentum=0.5,
      scale_metadata=named(None),
      bias_metadata=named(None),
      mean_metadata=named(None),
      var_metadata=named(None),
      rngs=rngs,
    )
    self.drop = sr.nn.Dropout(0.3, rngs=rngs)

  def __call__(self, x):
    # A name policy="auto" can choose to keep (or recompute).
    return x + jnp.tanh(self.drop(checkpoint_name(self.norm(self.linear(x)), "normed")))


def apply(layer, x):
  return layer(x)


MESHES = {"stage4_data2": ((4, 2), ("stage", "data")), "stage8": ((8,), ("stage",))}
# (schedule, repeats): the circular one has one layer per chunk with 2 layers per stage.
SCHEDULES = {"gpipe": ("gpipe", 1), "circular": ("circular", 2)}
CASES = [pytest.param(m, s, id=f"{m}-{s}") for m in MESHES for s in SCHEDULES]


def make_mesh(name):
  assert len(jax.devices()) == 8, "tests/conftest.py should force 8 CPU devices"
  shape, names = MESHES[name]
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def build(cls, n, mesh=None, seed=0):
  stack = sr.remat_scan(cls, lengths=(n,), metadata_params=META)(
    D, rngs=sr.Rngs(params=seed, dropout=seed + 1)
  )
  if mesh is not None and n % mesh.shape["stage"] == 0:
    sr.shard(stack, mesh, [("layers", "stage")])
  return stack


def data(mesh=None):
  x = jnp.linspace(-1.0, 1.0, B * D).reshape(B, D)
  if mesh is not None and "data" in mesh.axis_names:
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
  return x


def sequential(stack, x, k, n):
  """The oracle: remat_scan over the N layers on each microbatch in turn (compiled once
  for the k microbatches, rather than traced and compiled k times eagerly)."""
  scan = sr.jit(sr.remat_scan(apply, lengths=(n,)))
  return jnp.concatenate([scan(stack, mb) for mb in jnp.split(x, k)])


def leaves(model):
  state = model if isinstance(model, sr.State) else sr.state(model)
  return {
    path: np.asarray(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)
    for path, v in state.flat().items()
  }


def assert_close(got, want, rtol=1e-5, atol=1e-6):
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)


def assert_same_state(a, b, rtol=1e-5, atol=1e-6):
  la, lb = leaves(a), leaves(b)
  assert sorted(la) == sorted(lb)
  for path in la:
    np.testing.assert_allclose(lb[path], la[path], rtol=rtol, atol=atol, err_msg=str(path))


def layers_for(mesh_name):
  return 2 * dict(zip(*reversed(MESHES[mesh_name])))["stage"]


# -- equal to the unpipelined run ----------------------------------------------------


@pytest.mark.parametrize("mesh_name,schedule", CASES)
def test_stateless_stack_equals_calling_it(mesh_name, schedule):
  mesh, n = make_mesh(mesh_name), layers_for(mesh_name)
  schedule, repeats = SCHEDULES[schedule]
  stack = build(Block, n, mesh)
  x = data(mesh)
  want = stack(x)
  piped = sr.pipeline(apply, microbatches=4, schedule=schedule, repeats=repeats)
  with jax.set_mesh(mesh):
    assert_close(piped(stack, x), want)
    assert_close(sr.jit(piped)(stack, x), want)


@pytest.mark.parametrize("mesh_name,schedule", CASES)
def test_state_and_dropout_equal_the_sequential_microbatch_run(mesh_name, schedule):
  mesh, n = make_mesh(mesh_name), layers_for(mesh_name)
  schedule, repeats = SCHEDULES[schedule]
  ref, stack = build(NormDropBlock, n), build(NormDropBlock, n, mesh)
  x = data(mesh)
  want = sequential(ref, x, 4, n)
  piped = sr.pipeline(apply, microbatches=4, schedule=schedule, repeats=repeats)
  with jax.set_mesh(mesh):
    got = piped(stack, x)
  assert_close(got, want)
  assert_same_state(ref, stack)
  # The statistics saw four microbatches, and the dropout stream advanced four times.
  assert int(stack.drop.rngs.dropout.count.value) == 4
  assert not np.allclose(np.asarray(build(NormDropBlock, n)(x)), np.asarray(got))


def test_fewer_layers_than_stages_leave_a_stage_without_layers():
  # Other uneven layer counts, on Auto and Explicit axes, with gradients:
  # tests/test_stack_schedules.py.
  n, schedule, repeats = 3, "gpipe", 1
  mesh = make_mesh("stage4_data2")
  ref, stack = build(NormDropBlock, n), build(NormDropBlock, n, mesh)
  x = data(mesh)
  want = sequential(ref, x, 2, n)
  with jax.set_mesh(mesh):
    got = sr.pipeline(apply, microbatches=2, schedule=schedule, repeats=repeats)(stack, x)
  assert_close(got, want)
  assert_same_state(ref, stack)


def train_step(forward):
  @sr.jit
  def step(model, opt, x):
    loss, grads = sr.value_and_grad(lambda m: jnp.mean(forward(m, x) ** 2))(model)
    opt.update(grads)
    return loss

  return step


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_optimizer_steps_equal_the_sequential_run(schedule):
  mesh = make_mesh("stage4_data2")
  schedule, repeats = SCHEDULES[schedule]
  ref, stack = build(NormDropBlock, 8), build(NormDropBlock, 8, mesh)
  ref_opt = sr.Optimizer(ref, optax.sgd(0.1))
  opt = sr.Optimizer(stack, optax.sgd(0.1))
  piped = sr.pipeline(apply, microbatches=4, schedule=schedule, repeats=repeats)
  x = data(mesh)
  ref_step = train_step(lambda m, x: sequential(m, x, 4, 8))
  step = train_step(piped)
  for _ in range(2):
    # The reference runs on one device: on the data-sharded batch its own reductions
    # round differently (3e-5 apart after two steps), while the pipeline matches this.
    want = ref_step(ref, ref_opt, data())
    with jax.set_mesh(mesh):
      got = step(stack, opt, x)
    assert_close(got, want)
  assert_same_state(ref, stack)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_compiled_program_moves_activations_with_collective_permutes(schedule):
  mesh = make_mesh("stage8")
  schedule, repeats = SCHEDULES[schedule]
  stack = build(Block, 16, mesh)
  piped = sr.pipeline(apply, microbatches=8, schedule=schedule, repeats=repeats)
  with jax.set_mesh(mesh):
    text = sr.jit(piped).lower(stack, data()).compile().as_text()
  assert "collective-permute" in text


# -- errors: nothing changed -----------------------------------------------------------


def test_errors_name_the_axis_and_the_fix_and_change_nothing():
  mesh = make_mesh("stage4_data2")
  stack = build(NormDropBlock, 8, mesh)
  before = leaves(stack)
  x = data()
  piped = sr.pipeline(apply, microbatches=4)
  with pytest.raises(
    sr.TransformError,
    match=r"no mesh: the stages are the mesh axis "
    r"'stage'.*jax.set_mesh\(mesh\)",
  ):
    piped(build(NormDropBlock, 8), x)
  with jax.set_mesh(mesh):
    with pytest.raises(
      sr.TransformError,
      match=(r"axis='pipe' is not an axis of the mesh, whose axes are \('stage', 'data'\)"),
    ):
      sr.pipeline(apply, axis="pipe", microbatches=4)(stack, x)
    with pytest.raises(
      sr.TransformError,
      match=(
        r"microbatches=3 must divide the batch, but the carry `x` \(shape \(16, 4\)\) "
        r"has batch axis 0 of size 16"
      ),
    ):
      sr.pipeline(apply, microbatches=3)(stack, x)
    unsharded = build(NormDropBlock, 8)
    with pytest.raises(
      sr.TransformError,
      match=(
        r"the layer axis \(axis 0, 8 layers\) of `linear.bias` is not sharded over the "
        r"mesh axis 'stage' .*sr.shard\(stack, mesh, \[\('layers', 'stage'\)"
      ),
    ):
      piped(unsharded, x)
  assert_same_state_dict(before, leaves(stack))
  with pytest.raises(sr.TransformError, match=r"repeats=2 is for schedule='circular'"):
    sr.pipeline(apply, microbatches=4, repeats=2)
  with pytest.raises(sr.TransformError, match=r"schedule='1f1b'; it is one of"):
    sr.pipeline(apply, microbatches=4, schedule="1f1b")


def assert_same_state_dict(a, b):
  assert sorted(a) == sorted(b)
  for path in a:
    np.testing.assert_array_equal(a[path], b[path])


def test_pipeline_spec_applies_and_reports_its_bubble():
  spec = sr.PipelineSpec(microbatches=4, schedule="circular", repeats=2)
  assert spec.bubble_fraction(stages=4) == pytest.approx(3 / 11)
  assert sr.PipelineSpec(microbatches=8).bubble_fraction(stages=8) == pytest.approx(7 / 15)
  mesh = make_mesh("stage8")
  stack = build(Block, 16, mesh)
  x = data()
  with jax.set_mesh(mesh):
    assert_close(spec.apply(apply)(stack, x), stack(x))


# -- the class form, extra arguments, remat per stage ----------------------------------


def build_class(cls, n, spec, mesh=None, seed=0, rules=(("layers", "stage"),), **kwargs):
  stack = sr.remat_scan(cls, lengths=(n,), metadata_params=META, pipeline=spec, **kwargs)(
    D, rngs=sr.Rngs(params=seed, dropout=seed + 1)
  )
  if mesh is not None:
    sr.shard(stack, mesh, list(rules))
  return stack


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_class_form_with_a_pipeline_spec_runs_pipelined(schedule):
  mesh = make_mesh("stage4_data2")
  schedule, repeats = SCHEDULES[schedule]
  spec = sr.PipelineSpec(microbatches=4, schedule=schedule, repeats=repeats)
  ref, stack = build(NormDropBlock, 8), build_class(NormDropBlock, 8, spec, mesh)
  assert_same_state(ref, stack)  # the same init as the class without a pipeline
  x = data(mesh)
  want = sequential(ref, x, 4, 8)
  with jax.set_mesh(mesh):
    got = stack(x)
    text = sr.jit(lambda m, x: m(x)).lower(stack, x).compile().as_text()
  assert_close(got, want)
  assert_same_state(ref, stack)
  assert "collective-permute" in text


def test_function_form_of_remat_scan_with_a_pipeline_spec():
  mesh = make_mesh("stage8")
  spec = sr.PipelineSpec(microbatches=8)
  ref, stack = build(NormDropBlock, 8), build(NormDropBlock, 8, mesh)
  x = data()
  want = sequential(ref, x, 8, 8)
  with jax.set_mesh(mesh):
    got = sr.remat_scan(apply, lengths=(2, 4), pipeline=spec)(stack, x)
    before = leaves(stack)
    with pytest.raises(
      sr.TransformError,
      match=(
        r"lengths/length say 6 layers, but the stack has 8\. Fix: lengths whose product "
        r"is 8"
      ),
    ):
      sr.remat_scan(apply, lengths=(6,), pipeline=spec)(stack, x)
  assert_close(got, want)
  assert_same_state(ref, stack)
  assert_same_state_dict(before, leaves(stack))


class ArgsBlock(sr.Module):
  def __init__(self, d, *, rngs):
    self.linear = sr.nn.Linear(
      d, d, kernel_metadata=named(None, None), bias_metadata=named(None), rngs=rngs
    )

  def __call__(self, x, scale, *, shift=0.0, flip=False):
    y = x + scale * jnp.tanh(self.linear(x)) + shift
    return -y if flip else y


def test_extra_arguments_are_broadcast_to_every_layer_and_microbatch():
  mesh = make_mesh("stage4_data2")
  spec = sr.PipelineSpec(microbatches=4, schedule="circular", repeats=2)
  ref = sr.remat_scan(ArgsBlock, lengths=(8,), metadata_params=META)(D, rngs=sr.Rngs(0))
  stack = build_class(ArgsBlock, 8, spec, mesh)
  x, scale, shift = data(mesh), jnp.linspace(0.0, 1.0, D)[None], jnp.float32(0.25)
  want = ref(x, scale, shift=shift, flip=True)
  with jax.set_mesh(mesh):
    got = stack(x, scale, shift=shift, flip=True)  # keyword arguments: run eagerly
    jitted = sr.jit(lambda m, x, s: m(x, s, shift=shift, flip=True))(stack, x, scale)
    fn = sr.pipeline(lambda layer, h, s: layer(h, s), microbatches=4)(stack, x, scale)
  assert_close(got, want)
  assert_close(jitted, want)
  assert_close(fn, ref(x, scale))


def loss_and_grads(forward, model, x):
  return sr.value_and_grad(lambda m: jnp.mean(forward(m, x) ** 2))(model)


def test_remat_inside_each_stage_by_policy_or_planned_under_a_budget():
  mesh = make_mesh("stage4_data2")
  ref = build(NormDropBlock, 8)
  x = data(mesh)
  want_loss, want_grads = sr.jit(
    lambda m, x: loss_and_grads(lambda m, x: sequential(m, x, 4, 8), m, x)
  )(ref, x)
  for options in (
    {"policy": jax.checkpoint_policies.dots_saveable},
    {"lengths": "auto", "memory_budget": "64KiB"},
    # planned for the policy given
    {"lengths": "auto", "memory_budget": "64KiB", "policy": jax.checkpoint_policies.dots_saveable},
    # what to keep by name, for each stage's one level, under a budget
    {"policy": "auto", "memory_budget": "64KiB"},
  ):
    stack = build(NormDropBlock, 8, mesh)
    piped = sr.pipeline(apply, microbatches=4, **options)
    with jax.set_mesh(mesh):
      loss, grads = sr.jit(lambda m, x: loss_and_grads(piped, m, x))(stack, x)
    assert_close(loss, want_loss)
    # The Linear's bias, before a BatchNorm, has gradient 0: what is left is rounding
    # (1e-6 apart), so the absolute tolerance is 1e-5.
    assert_same_state(want_grads, grads, atol=1e-5)
    assert_same_state(ref, stack)


def test_circular_keeps_no_copy_of_the_weights_per_step():
  # Wide layers, so that weights dominate XLA's temp: the step scan keeps no chunk of
  # weights per step (it did: 1.5x the unpipelined stack's temp here) and the
  # gradient is not scattered into a whole stack on every device.
  mesh = make_mesh("stage4_data2")
  stack = sr.remat_scan(Block, lengths=(16,), metadata_params=META)(128, rngs=sr.Rngs(0))
  sr.shard(stack, mesh, [("layers", "stage")])
  x = jax.device_put(jnp.ones((32, 128)), NamedSharding(mesh, P("data")))
  piped = sr.pipeline(apply, microbatches=4, schedule="circular", repeats=2)

  def temp(forward):
    step = sr.jit(sr.grad(lambda m, x: jnp.sum(forward(m, x))))
    with jax.set_mesh(mesh):
      return step.lower(stack, x).compile().memory_analysis().temp_size_in_bytes

  assert temp(piped) < temp(lambda m, x: m(x))


def test_auto_lengths_plan_one_stage_under_the_per_device_budget():
  mesh = make_mesh("stage4_data2")
  stack = build(Block, 8, mesh)
  before = leaves(stack)
  piped = sr.pipeline(apply, microbatches=4, lengths="auto", memory_budget=1)
  with jax.set_mesh(mesh):
    # A stage holds 2 of the 8 layers: the plan is for those.
    with pytest.raises(
      sr.TransformError,
      match=r"no remat plan for 2 layers fits "
      r"memory_budget=1 B",
    ):
      piped(stack, data(mesh))
  assert_same_state_dict(before, leaves(stack))


# -- composition: a tensor-parallel axis, Explicit axes ----------------------------------


class TensorParallelBlock(sr.Module):
  def __init__(self, d, *, rngs):
    self.up = sr.nn.Linear(
      d, 2 * d, kernel_metadata=named("embed", "mlp"), bias_metadata=named("mlp"), rngs=rngs
    )
    self.down = sr.nn.Linear(
      2 * d, d, kernel_metadata=named("mlp", "embed"), bias_metadata=named("embed"), rngs=rngs
    )
    self.norm = sr.nn.BatchNorm(d, momentum=0.5, rngs=rngs)  # no sharding metadata
    self.drop = sr.nn.Dropout(0.3, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(self.norm(self.down(jnp.tanh(self.up(x)))))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_tensor_and_data_axes_on_the_same_mesh(axis_type):
  mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"), axis_types=(axis_type,) * 3)
  rules = [("layers", "stage"), ("mlp", "model"), ("embed", None)]
  spec = sr.PipelineSpec(microbatches=2)
  ref = sr.remat_scan(TensorParallelBlock, lengths=(4,), metadata_params=META)(
    D, rngs=sr.Rngs(params=0, dropout=1)
  )
  stack = build_class(TensorParallelBlock, 4, spec, mesh, rules=rules)
  assert stack.up.kernel.value.sharding.spec == P("stage", None, "model")
  # The BatchNorm has no sharding metadata: its named layer axis still goes on "stage".
  assert stack.norm.mean.value.sharding.spec == P("stage", None)
  ref_opt, opt = sr.Optimizer(ref, optax.sgd(0.1)), sr.Optimizer(stack, optax.sgd(0.1))
  x = jax.device_put(data(), NamedSharding(mesh, P("data")))
  want = train_step(lambda m, x: sequential(m, x, 2, 4))(ref, ref_opt, data())
  with jax.set_mesh(mesh):
    got = train_step(lambda m, x: m(x))(stack, opt, x)
  assert_close(got, want)
  assert_same_state(ref, stack)
  assert stack.up.kernel.value.sharding.spec == P("stage", None, "model")


# -- more errors ----------------------------------------------------------------------


def test_class_form_and_option_errors():
  spec = sr.PipelineSpec(microbatches=2, policy=jax.checkpoint_policies.dots_saveable)
  with pytest.raises(
    sr.TransformError, match=(r"pipeline=4; it takes sr.PipelineSpec\(axis=..., microbatches=...")
  ):
    sr.remat_scan(Block, lengths=(4,), pipeline=4)
  with pytest.raises(
    sr.TransformError,
    match=r"the policy is given twice, as policy= "
    r"and in the PipelineSpec\. Fix: give it once",
  ):
    sr.remat_scan(
      apply, lengths=(4,), pipeline=spec, policy=jax.checkpoint_policies.nothing_saveable
    )
  with pytest.raises(
    sr.TransformError,
    match=(
      r"lengths=\(2, 2\); each stage runs its own N/S layers.*Fix: lengths='auto' with "
      r"memory_budget="
    ),
  ):
    sr.pipeline(apply, microbatches=2, lengths=(2, 2))


def test_a_named_layer_axis_is_in_the_partition_spec_without_sharding_metadata():
  stack = sr.remat_scan(sr.nn.BatchNorm, lengths=(8,), metadata_params=META)(D, rngs=sr.Rngs(0))
  specs = sr.get_partition_spec(stack)
  assert specs["mean"] == P("layers", None) and specs["scale"] == P("layers", None)
  unnamed = sr.remat_scan(sr.nn.BatchNorm, lengths=(4,))(D, rngs=sr.Rngs(0))
  assert sr.get_partition_spec(unnamed)["mean"] == P()
  mesh = make_mesh("stage8")
  assert sr.shard(stack, mesh, [("layers", "stage")]) is stack
  assert stack.var.value.sharding.spec == P("stage", None)


# -- a pattern stack, pipelined by whole cycles ---------------------------------------


def build_pattern(cycles, mesh=None, seed=0):
  stack = sr.remat_scan(
    (NormDropBlock, Block), lengths=(cycles,), length=2 * cycles, **{"metadata_params": META}
  )(D, rngs=sr.Rngs(params=seed, dropout=seed + 1))
  if mesh is not None:
    sr.shard(stack, mesh, [("layers", "stage")])
  return stack


def test_a_pattern_stack_of_part_cycles_or_uneven_chunks_is_refused_with_the_fix():
  mesh = make_mesh("stage4_data2")
  piped = sr.pipeline(apply, microbatches=4)
  odd = sr.remat_scan((NormDropBlock, Block), lengths=(4,), length=7, metadata_params=META)(
    D, rngs=sr.Rngs(0)
  )
  before = leaves(odd)
  with jax.set_mesh(mesh), pytest.raises(sr.TransformError, match=r"7 layers, not a whole"):
    piped(odd, data(mesh))
  uneven = build_pattern(6)
  with jax.set_mesh(mesh), pytest.raises(sr.TransformError, match=r"6 cycles .* 4 equal"):
    piped(uneven, data(mesh))
  after = leaves(odd)
  assert all(np.array_equal(after[k], v) for k, v in before.items())


def test_the_class_form_of_a_pattern_stack_with_a_pipeline_spec():
  mesh = make_mesh("stage4_data2")
  spec = sr.PipelineSpec(axis="stage", microbatches=4)
  Piped = sr.remat_scan(
    (NormDropBlock, Block), lengths=(4,), length=8, metadata_params=META, pipeline=spec
  )
  stack = Piped(D, rngs=sr.Rngs(params=0, dropout=1))
  sr.shard(stack, mesh, [("layers", "stage")])
  ref = build_pattern(4)
  x = data(mesh)
  scan = sr.remat_scan(apply, lengths=(4,))
  want = jnp.concatenate([scan(ref, mb) for mb in jnp.split(x, 4)])
  with jax.set_mesh(mesh):
    got = stack(x)
  assert_close(got, want, rtol=1e-4, atol=1e-5)
  assert_same_state(ref, stack, rtol=1e-4, atol=1e-5)


def test_a_layer_that_sows_is_refused_by_name_and_changes_nothing():
  # A stage cannot carry new Variables out of the pipeline: the kernel refuses the
  # change of structure rather than drop the sown values.
  mesh = make_mesh("stage8")
  stack = build(Block, 8, mesh)
  before = leaves(stack)

  def sowing(layer, x):
    y = layer(x)
    layer.sow(sr.Intermediate, "h", y)
    return y

  with (
    jax.set_mesh(mesh),
    pytest.raises(sr.GraphError, match=r"sr.pipeline.*changed the structure of its modules"),
  ):
    sr.pipeline(sowing, microbatches=4)(stack, data())
  assert_same_state_dict(before, leaves(stack))


# XLA compiles in this process, counted through jax.monitoring (a listener stays for
# the process; it only counts).
_COMPILES = [0]


def _count_compile(event: str, duration: float, **kwargs) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def test_an_eager_call_compiles_its_stage_program_as_one():
  # Called eagerly, a pipeline compiles its stage program once per call, as one program,
  # not the shard_map's body one primitive at a time (about 70 programs per call).
  mesh = make_mesh("stage4_data2")
  stack, x = build(Block, 8, mesh), data(mesh)
  piped = sr.pipeline(apply, microbatches=4)
  with jax.set_mesh(mesh):
    piped(stack, x)  # the eager ops around the program compile once per shape
    before = _COMPILES[0]
    piped(stack, x)
  assert _COMPILES[0] - before <= 3, f"{_COMPILES[0] - before} compiles for one call"
