"""Both mesh axis types on 8 CPU devices: every ``sr.nn`` layer, ``sr.shard`` (eager and
inside ``sr.jit``) and a ``remat_scan`` training step under ``jax.make_mesh``'s default
``AxisType.Explicit`` axes and under ``AxisType.Auto``, each equal to the one-device
result, outputs sharded as the logical rules say."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr

D = 16
RULES = [
  ("batch", "data"),
  ("mlp", "model"),
  ("heads", "model"),
  ("vocab", "model"),
  ("embed", None),
  ("layers", None),
]
AXIS_TYPES = pytest.mark.parametrize(
  "axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"]
)


def make_mesh(axis_type):
  assert len(jax.devices()) == 8, "tests/conftest.py should force 8 CPU devices"
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


def named(*axes):
  return {"sharding": axes}


def leaves(model):
  return {
    k: np.asarray(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)
    for k, v in sr.state(model).flat().items()
  }


# numpy's draws: the tables below are built at import, in every pytest worker, and a JAX
# draw compiles once per shape.
def normal(shape, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def ids(shape):
  return jnp.asarray(np.random.default_rng(3).integers(0, 32, shape, np.int32))


def mha(**kwargs):
  kwargs = {"dropout_rate": 0.5, "deterministic": False, **kwargs}
  return lambda: sr.nn.MultiHeadAttention(
    4,
    D,
    rngs=sr.Rngs(0),
    kernel_metadata=named("embed", "heads", None),
    bias_metadata=named("heads", None),
    out_kernel_metadata=named("heads", None, "embed"),
    out_bias_metadata=named("embed"),
    **kwargs,
  )


def call(m, x):
  return m(x)


# name: (build, input, the input's spec, call, the output's spec by the rules)
LAYERS = {
  "Linear": (
    lambda: sr.nn.Linear(
      D, 2 * D, kernel_metadata=named("embed", "mlp"), bias_metadata=named("mlp"), rngs=sr.Rngs(0)
    ),
    normal((8, D)),
    P("data"),
    call,
    P("data", "model"),
  ),
  "Linear contracting a sharded axis": (
    lambda: sr.nn.Linear(
      2 * D, D, kernel_metadata=named("mlp", "embed"), bias_metadata=named("embed"), rngs=sr.Rngs(0)
    ),
    normal((8, 2 * D)),
    P("data", "model"),
    call,
    P("data", None),
  ),
  "MLP (its Dropout too)": (
    lambda: sr.nn.MLP(
      D,
      2 * D,
      dropout_rate=0.5,
      rngs=sr.Rngs(0),
      kernel_metadata=named("embed", "mlp"),
      bias_metadata=named("mlp"),
      out_kernel_metadata=named("mlp", "embed"),
      out_bias_metadata=named("embed"),
    ),
    normal((8, D)),
    P("data"),
    call,
    P("data", None),
  ),
  "LinearGeneral": (
    lambda: sr.nn.LinearGeneral(
      D,
      (4, 8),
      rngs=sr.Rngs(0),
      kernel_metadata=named("embed", "heads", None),
      bias_metadata=named("heads", None),
    ),
    normal((8, 4, D)),
    P("data"),
    call,
    P("data", None, "model", None),
  ),
  "Conv": (
    lambda: sr.nn.Conv(
      D,
      2 * D,
      (3, 3),
      rngs=sr.Rngs(0),
      kernel_metadata=named(None, None, "embed", "mlp"),
      bias_metadata=named("mlp"),
    ),
    normal((8, 6, 6, D)),
    P("data"),
    call,
    P("data", None, None, "model"),
  ),
  "Embed sharded over the vocabulary": (
    lambda: sr.nn.Embed(32, D, embedding_metadata=named("vocab", "embed"), rngs=sr.Rngs(0)),
    ids((8, 4)),
    P("data"),
    call,
    P("data", None, None),
  ),
  "Embed sharded over features": (
    lambda: sr.nn.Embed(32, D, embedding_metadata=named(None, "mlp"), rngs=sr.Rngs(0)),
    ids((8, 4)),
    P("data"),
    call,
    P("data", None, "model"),
  ),
  "Embed.attend": (
    lambda: sr.nn.Embed(32, D, embedding_metadata=named("vocab", "embed"), rngs=sr.Rngs(0)),
    normal((8, D)),
    P("data"),
    lambda m, x: m.attend(x),
    P("data", "model"),
  ),
  "LayerNorm": (
    lambda: sr.nn.LayerNorm(
      2 * D, scale_metadata=named("mlp"), bias_metadata=named("mlp"), rngs=sr.Rngs(0)
    ),
    normal((8, 2 * D)),
    P("data", "model"),
    call,
    P("data", "model"),
  ),
  "RMSNorm": (
    lambda: sr.nn.RMSNorm(2 * D, scale_metadata=named("mlp"), rngs=sr.Rngs(0)),
    normal((8, 2 * D)),
    P("data", "model"),
    call,
    P("data", "model"),
  ),
  "BatchNorm": (
    lambda: sr.nn.BatchNorm(
      2 * D,
      momentum=0.5,
      rngs=sr.Rngs(0),
      **{f"{v}_metadata": named("mlp") for v in ("scale", "bias", "mean", "var")},
    ),
    normal((8, 2 * D)),
    P("data", "model"),
    call,
    P("data", "model"),
  ),
  "Dropout broadcast over the batch": (
    lambda: sr.nn.Dropout(0.5, broadcast_dims=(0,), rngs=sr.Rngs(0)),
    normal((8, 2 * D)),
    P("data", "model"),
    call,
    P("data", "model"),
  ),
  # Without broadcast_dropout the attention-dropout mask is drawn sharded too.
  "MultiHeadAttention": (
    mha(broadcast_dropout=False),
    normal((8, 4, D)),
    P("data"),
    call,
    P("data", None, None),
  ),
}


# Eager calls compile each op for the mesh: a few layers only, to keep this file quick.
EAGER = {"Linear", "Embed sharded over the vocabulary"}


@AXIS_TYPES
@pytest.mark.parametrize("name", LAYERS)
def test_layer_sharded_equals_unsharded_and_follows_the_rules(name, axis_type):
  build, x, in_spec, fn, out_spec = LAYERS[name]
  mesh = make_mesh(axis_type)
  reference, layer = build(), build()
  calls = [sr.jit(fn)] + ([fn] if name in EAGER else [])
  expected = [call(reference, x) for call in calls]  # new masks, statistics each call
  with jax.set_mesh(mesh):
    sr.shard(layer, mesh, RULES)
    xs = jax.device_put(x, NamedSharding(mesh, in_spec))
    got = [call(layer, xs) for call in calls]
  for y, want in zip(got, expected):
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), y.ndim), y.sharding
    if axis_type == AxisType.Explicit:  # the sharding is in the type, as the rules say
      assert jax.typeof(y).sharding.spec == out_spec
  for path, value in leaves(reference).items():  # batch statistics, RNG counters
    np.testing.assert_allclose(leaves(layer)[path], value, rtol=1e-5, atol=1e-6)


def test_explicit_decode_writes_the_step_where_the_cache_lives():
  mesh = make_mesh(AxisType.Explicit)
  build = mha(decode=True, dropout_rate=0.0)
  reference, layer = build(), build()
  x = normal((8, 1, D))
  for m in (reference, layer):
    m.init_cache((8, 4, D))  # replicated: Cache variables carry no sharding metadata
  step = sr.jit(lambda m, x: m(x))
  expected = step(reference, x)
  with jax.set_mesh(mesh):
    sr.shard(layer, mesh, RULES)
    y = step(layer, jax.device_put(x, NamedSharding(mesh, P("data"))))
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    layer.cached_key.value, reference.cached_key.value, rtol=1e-5, atol=1e-6
  )
  assert int(layer.cache_index.value) == 1


def dot_general_out_shardings(fn, *args):
  """The ``out_sharding`` of every ``dot_general`` the program runs, in the bodies of
  its calls too: jax 0.12 keeps an ``inline=True`` jit (``Linear``'s ``_dense``) as a
  ``jit`` equation in the jaxpr, where jax 0.10 inlined it."""

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        yield eqn.params["out_sharding"]
      for sub in jaxprs_in_params(eqn.params):
        yield from walk(sub)

  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_auto_axes_and_no_mesh_take_the_plain_path():
  # Only explicit axes need out_sharding; elsewhere the layers' programs are unchanged.
  layer = LAYERS["Linear contracting a sharded axis"][0]()
  x = normal((8, 2 * D))
  assert dot_general_out_shardings(layer, x) == [None]
  for axis_type, want in ((AxisType.Auto, None), (AxisType.Explicit, P("data", None))):
    mesh = make_mesh(axis_type)
    with jax.set_mesh(mesh):
      sharded = LAYERS["Linear contracting a sharded axis"][0]()
      sr.shard(sharded, mesh, RULES)
      xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
      (got,) = dot_general_out_shardings(sharded, xs)
    assert (got if got is None else got.spec) == want


# -- sr.shard ------------------------------------------------------------------------


class Block(sr.Module):
  def __init__(self, d, *, rngs):
    self.norm = sr.nn.BatchNorm(
      d,
      momentum=0.5,
      scale_metadata=named("embed"),
      bias_metadata=named("embed"),
      mean_metadata=named("embed"),
      var_metadata=named("embed"),
      rngs=rngs,
    )
    self.up = sr.nn.Linear(
      d, 2 * d, kernel_metadata=named("embed", "mlp"), bias_metadata=named("mlp"), rngs=rngs
    )
    self.drop = sr.nn.Dropout(0.25, rngs=rngs)
    self.ln = sr.nn.LayerNorm(
      2 * d, scale_metadata=named("mlp"), bias_metadata=named("mlp"), rngs=rngs
    )
    self.down = sr.nn.Linear(
      2 * d, d, kernel_metadata=named("mlp", "embed"), bias_metadata=named("embed"), rngs=rngs
    )

  def __call__(self, x):
    return x + self.down(self.ln(self.drop(jax.nn.relu(self.up(self.norm(x))))))


Stack = sr.remat_scan(
  Block,
  lengths=(2,),
  split_rngs={"params": True, "dropout": True},
  metadata_params={"partition_name": "layers"},
)


def build_stack():
  return Stack(D, rngs=sr.Rngs(params=0, dropout=1))


@AXIS_TYPES
def test_shard_eagerly_and_inside_jit(axis_type):
  mesh = make_mesh(axis_type)
  eager, traced = build_stack(), build_stack()

  @sr.jit
  def constrain(model):
    sr.shard(model, mesh, RULES)
    return model.up.kernel.value * 1

  with jax.set_mesh(mesh):
    sr.shard(eager, mesh, RULES)
    shardings = {path: v.sharding for path, v in sr.state(eager).flat().items()}
    out = constrain(traced)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "model")), 3)
  for model in (eager, traced):
    for path, value in sr.state(model).flat().items():
      assert value.sharding.is_equivalent_to(shardings[path], value.ndim), path
  assert eager.up.kernel.value.sharding.spec == P(None, None, "model")


# -- the training step ---------------------------------------------------------------


@sr.jit
def train_step(model, opt, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = sr.value_and_grad(loss_fn)(model)
  opt.update(grads)
  return loss


def train(model, x, y, steps=2):
  opt = sr.Optimizer(model, optax.adam(1e-2))
  return [train_step(model, opt, x, y) for _ in range(steps)], opt


@AXIS_TYPES
def test_remat_scan_train_step_equals_one_device(axis_type):
  x, y = normal((8, D), seed=1), normal((8, D), seed=2)
  single = build_stack()
  losses1, _ = train(single, x, y)

  mesh = make_mesh(axis_type)
  parallel = build_stack()
  with jax.set_mesh(mesh):
    sr.shard(parallel, mesh, RULES)
    shardings = {path: v.sharding for path, v in sr.state(parallel).flat().items()}
    batch = NamedSharding(mesh, P("data"))
    losses2, opt = train(parallel, jax.device_put(x, batch), jax.device_put(y, batch))

  np.testing.assert_allclose(losses2, losses1, rtol=1e-5)
  new1, new2 = leaves(single), leaves(parallel)  # params, statistics, RNG counters
  for path in new1:
    np.testing.assert_allclose(new2[path], new1[path], rtol=1e-4, atol=1e-5, err_msg=path)
  # The step kept every variable where its spec says, and adam's moments follow.
  for path, sharding in shardings.items():
    value = sr.state(parallel).flat()[path]
    assert value.sharding.is_equivalent_to(sharding, value.ndim), (path, value.sharding)
  adam, _ = jax.tree.unflatten(opt.opt_state_def, [v.value for v in opt.opt_state])
  for moments in (adam.mu, adam.nu):
    for path, value in moments.flat().items():
      assert value.sharding.is_equivalent_to(shardings[path], value.ndim), path


# -- misuse ----------------------------------------------------------------------------


@AXIS_TYPES
def test_a_mesh_axis_the_mesh_lacks_raises_in_both_modes(axis_type):
  with pytest.raises(
    sr.StateMismatchError,
    match=(
      r"`bias`: its spec .* names mesh axis 'tensor', but the mesh has "
      r"\('data', 'model'\). Fix: map the logical name"
    ),
  ):
    sr.shard(LAYERS["Linear"][0](), make_mesh(axis_type), [("mlp", "tensor")])


def test_explicit_shard_inside_jit_needs_the_mesh_set():
  mesh = make_mesh(AxisType.Explicit)

  @sr.jit
  def constrain(model):
    sr.shard(model, mesh, RULES)
    return model.kernel.value * 1

  message = (
    r"sr.shard inside a traced function .* on mesh \{'data': 2 Explicit, "
    r"'model': 4 Explicit\}, whose Explicit axes .* \(`[\w.]+` first\), but the "
    r"trace runs under WHERE. Fix: call the jitted function inside `with "
    r"jax.set_mesh\(mesh\):`"
  )
  with pytest.raises(sr.StateMismatchError, match=message.replace("WHERE", "no mesh")):
    constrain(LAYERS["Linear"][0]())
  with jax.set_mesh(make_mesh(AxisType.Auto)):
    with pytest.raises(
      sr.StateMismatchError,
      match=message.replace("WHERE", r"mesh \{'data': 2 Auto, 'model': 4 Auto\}"),
    ):
      constrain(LAYERS["Linear"][0]())


def test_explicit_input_and_a_model_on_another_mesh_names_the_variable():
  mesh = make_mesh(AxisType.Explicit)
  other = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  layer = LAYERS["Linear"][0]()
  sr.shard(layer, other, RULES)
  x = jax.device_put(normal((8, D)), NamedSharding(mesh, P("data")))
  with pytest.raises(
    sr.StateMismatchError,
    match=(
      r"Linear: `kernel` lives on mesh \{'data': 4 Explicit, 'model': 2 Explicit\} but "
      r"`inputs` on \{'data': 2 Explicit, 'model': 4 Explicit\}.* Fix: shard the model on "
      r"the mesh its inputs use"
    ),
  ):
    layer(x)
