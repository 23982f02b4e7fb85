"""Trust round 3 (issue 22): names checked, stacks that mean what they say, never stale.

Items 2 (a misspelt stream or collection in a rule), 3 (``sr.vmap`` mapping a plain
module's parameters), 7 (``stack.layer(i)`` draws the keys layer ``i`` draws inside the
stack) and 8 (stale closures, a module as a static ``jax.jit`` argument). Each error
test checks the message (what, where, the fix) and that the objects are unchanged.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr


class Block(sr.Module):
  def __init__(self, *, rngs):
    self.lin = sr.nn.Linear(4, 4, rngs=rngs)
    self.drop = sr.nn.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.lin(x))


def snapshot(model):
  return [
    np.asarray(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)
    for v in jax.tree.leaves(sr.state(model))
  ]


def assert_unchanged(model, before):
  after = snapshot(model)
  assert len(after) == len(before)
  for a, b in zip(after, before):
    np.testing.assert_array_equal(a, b)


def scan_body(m, c):
  return m(c), None


# -- 2. names typed into a rule are checked --------------------------------------------


@pytest.mark.parametrize(
  "seeds", [dict(params=0, dropout=1), dict(default=0)], ids=["own-stream", "default-stream"]
)
def test_a_misspelt_split_rngs_stream_raises_with_the_name_meant(seeds):
  layer = Block(rngs=sr.Rngs(**seeds))
  before = snapshot(layer)
  run = sr.scan(scan_body, split_rngs={"dropuot": True}, length=3)
  with pytest.raises(
    sr.TransformError,
    match=r"(?s)split_rngs names the RNG stream "
    r"'dropuot'.*'dropout'.*same key.*Did you mean 'dropout'\?.*Fix: "
    r"spell the name.*split_rngs=\{'dropout': True\}",
  ):
    run(layer, jnp.ones(4))
  assert_unchanged(layer, before)


def test_a_misspelt_stream_in_the_class_form_builds_nothing():
  rngs = sr.Rngs(params=0, dropout=1)
  before = snapshot(rngs)
  with pytest.raises(sr.TransformError, match="'dropuot'.*Did you mean 'dropout'"):
    sr.scan(
      Block,
      length=3,
      variable_axes={True: 0},
      in_axes=(),
      split_rngs={"params": True, "dropuot": True},
    )(rngs=rngs)
  assert_unchanged(rngs, before)


@pytest.mark.parametrize("transform", ["vmap", "remat_scan"])
def test_every_transform_with_split_rngs_checks_the_names(transform):
  stack = sr.vmap(Block, axis_size=3, in_axes=None, split_rngs={"params": True})(
    rngs=sr.Rngs(params=0)
  )
  stack.drop.rngs = sr.Rngs(dropout=1)  # one stream the layers share
  if transform == "vmap":
    run = functools.partial(
      sr.vmap(lambda m, x: m(x), in_axes=None, split_rngs={"dropot": True}), stack
    )
  else:
    run = functools.partial(
      sr.remat_scan(lambda m, c: m(c), lengths=(3,), split_rngs={"dropot": True}), stack
    )
  before = snapshot(stack)
  with pytest.raises(sr.TransformError, match="'dropot'.*Did you mean 'dropout'"):
    run(jnp.ones(4))
  assert_unchanged(stack, before)


def test_names_that_match_nothing_while_every_stream_has_its_rule_pass():
  # linen's habit: split_rngs names params and dropout on any stack. In evaluation
  # mode nothing draws dropout; a stream not drawn at all changes nothing.
  layer = Block(rngs=sr.Rngs(0)).eval()
  run = sr.scan(scan_body, split_rngs={"params": True, "dropout": True}, length=2)
  out, _ = run(layer, jnp.ones(4))
  loop = layer(layer(jnp.ones(4)))
  np.testing.assert_allclose(out, loop, rtol=1e-6)
  layer.train()
  sr.scan(scan_body, split_rngs={"dropout": True, "noise": True}, length=2)(layer, jnp.ones(4))


def test_a_misspelt_collection_in_a_rule_raises_and_a_real_absent_one_passes():
  linear = sr.nn.Linear(4, 4, rngs=sr.Rngs(0))
  before = snapshot(linear)
  with pytest.raises(
    sr.TransformError,
    match=r"(?s)variable_broadcast names the "
    r"collection 'param'.*Did you mean 'params'\?.*\['params'\].*Fix",
  ):
    sr.vmap(lambda m, x: m(x), variable_broadcast="param")(linear, jnp.ones((3, 4)))
  assert_unchanged(linear, before)
  # 'batch_stats' is a real collection (sr.BatchStat): generic code may name it.
  out = sr.vmap(lambda m, x: m(x), variable_broadcast=("params", "batch_stats"))(
    linear, jnp.ones((3, 4))
  )
  assert out.shape == (3, 4)


# -- 3. sr.vmap maps only what carries a layer axis, unless told -----------------------


def test_vmap_over_a_plain_module_refuses_to_map_its_parameters():
  linear = sr.nn.Linear(4, 4, rngs=sr.Rngs(0))
  before = snapshot(linear)
  xs = jnp.arange(16.0).reshape(4, 4)
  with pytest.raises(
    sr.TransformError,
    match=r"(?s)`bias` \(Param, shape \(4,\)\) "
    r"belongs to a plain module and carries no layer axis.*"
    r"variable_broadcast=True.*class form.*variable_axes=\{sr.Param: 0\}",
  ):
    sr.vmap(lambda m, x: m(x))(linear, xs)
  assert_unchanged(linear, before)


def test_vmap_with_variable_broadcast_equals_the_per_example_loop():
  linear = sr.nn.Linear(4, 4, rngs=sr.Rngs(0))
  xs = jnp.arange(16.0).reshape(4, 4)
  out = sr.vmap(lambda m, x: m(x), variable_broadcast=True)(linear, xs)
  np.testing.assert_allclose(out, jnp.stack([linear(x) for x in xs]), rtol=1e-6)


def test_explicit_variable_axes_still_map_a_plain_module_on_purpose():
  linear = sr.nn.Linear(4, 4, rngs=sr.Rngs(0))
  xs = jnp.arange(16.0).reshape(4, 4)
  out = sr.vmap(lambda m, x: x @ m.kernel.value + m.bias.value, variable_axes={sr.Param: 0})(
    linear, xs
  )
  rows = [xs[i] @ linear.kernel.value[i] + linear.bias.value[i] for i in range(4)]
  np.testing.assert_allclose(out, jnp.stack(rows), rtol=1e-6)


def test_an_ensemble_built_by_the_class_form_maps_by_default():
  ensemble = sr.vmap(sr.nn.Linear, axis_size=3, in_axes=None)(4, 2, rngs=sr.Rngs(0))
  x = jnp.ones((5, 4))
  out = ensemble(x)
  np.testing.assert_allclose(out, jnp.stack([m(x) for m in sr.unstack(ensemble)]), rtol=1e-6)


def test_vmap_on_init_builds_a_stack():
  # nnx's guide decorates __init__; each member draws its own keys (split_rngs).
  class Ensemble(sr.Module):
    @sr.vmap(axis_size=4)
    def __init__(self, rngs):
      self.lin = sr.nn.Linear(2, 2, rngs=rngs)

  rngs = sr.Rngs(0)
  ens = Ensemble(rngs)
  assert ens.lin.kernel.shape == (4, 2, 2) and ens.lin.kernel.path_str() == "lin.kernel"
  assert not np.allclose(ens.lin.kernel.value[0], ens.lin.kernel.value[1])
  assert int(rngs.default.count.value) == 1


# -- 7. a layer taken out of a stack draws the keys it draws inside --------------------

SEEDS_AND_SPLITS = [
  (dict(params=0, dropout=1), {"params": True, "dropout": True}),
  (dict(default=0), {"params": True, "dropout": True}),
  (dict(default=0), {"params": True, "dropout": False}),
  (dict(params=0, dropout=1), {"params": True}),
]


@pytest.mark.parametrize("seeds,split", SEEDS_AND_SPLITS)
@pytest.mark.parametrize("form", ["remat_scan", "scan"])
def test_the_loop_over_unstack_computes_what_the_stack_computes(form, seeds, split):
  if form == "remat_scan":
    Stack = sr.remat_scan(Block, length=3, lengths=(3,), split_rngs=split)
  else:
    Stack = sr.scan(_ScanBlock, length=3, variable_axes={True: 0}, split_rngs=split)
  stack = Stack(rngs=sr.Rngs(**seeds))
  x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
  loop = x
  for layer in sr.unstack(stack):
    loop = layer(loop) if form == "remat_scan" else layer(loop)[0]  # (carry, ys)
  out = stack(x) if form == "remat_scan" else stack(x)[0]
  assert bool((loop == 0).any())  # dropout is live
  np.testing.assert_allclose(out, loop, rtol=1e-6)


class _ScanBlock(Block):
  def __call__(self, x):
    return super().__call__(x), None


@pytest.mark.parametrize("seeds,split", SEEDS_AND_SPLITS[:2])
def test_a_vmapped_ensemble_member_taken_out_computes_what_it_computes_inside(seeds, split):
  stack = sr.vmap(Block, axis_size=3, in_axes=None, split_rngs=split)(rngs=sr.Rngs(**seeds))
  x = jnp.ones((2, 4))
  members = [stack.layer(i)(x) for i in range(3)]
  np.testing.assert_allclose(stack(x), jnp.stack(members), rtol=1e-6)


def test_stack_of_unstack_gives_back_the_stacks_own_rng_streams():
  stack = sr.remat_scan(
    Block, length=3, lengths=(3,), split_rngs={"params": True, "dropout": True}
  )(rngs=sr.Rngs(params=0, dropout=1))
  before = snapshot(stack)
  layers = sr.unstack(stack)
  for layer in layers:  # drawing from the copies does not reach the stack
    layer(jnp.ones((1, 4)))
  again = sr.stack(layers)
  assert type(again) is type(stack)
  keys = [k for k, _ in jax.tree_util.tree_flatten_with_path(sr.state(again))[0]]
  assert len(keys) == len(before)
  for a, b, (path, _) in zip(
    snapshot(again), before, jax.tree_util.tree_flatten_with_path(sr.state(again))[0]
  ):
    if "rngs" in jax.tree_util.keystr(path):
      np.testing.assert_array_equal(a, b)


# -- 8. never stale ----------------------------------------------------------------------

scale = 1.0


def scaled_body(m, c):
  return c * scale, None


def test_an_eager_scan_rereads_a_changed_global():
  global scale
  layer = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  run = sr.scan(scaled_body, length=3, variable_broadcast=True)
  scale = 1.0
  first, _ = run(layer, jnp.ones(2))
  scale = 2.0
  try:
    second, _ = run(layer, jnp.ones(2))
  finally:
    scale = 1.0
  np.testing.assert_allclose(first, [1.0, 1.0])
  np.testing.assert_allclose(second, [8.0, 8.0])  # the loop: 1 * 2 * 2 * 2


def test_an_eager_transform_rereads_closures_helpers_and_containers_changed_in_place():
  layer = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  config = {"shift": 1.0}
  factor = 2.0

  def helper(c):
    return c + config["shift"]

  def body(m, c):
    return helper(c) * factor, None

  run = sr.scan(body, length=2, variable_broadcast=True)
  np.testing.assert_allclose(run(layer, jnp.zeros(2))[0], [6.0, 6.0])
  config["shift"] = 0.0  # changed in place, read by a helper
  np.testing.assert_allclose(run(layer, jnp.ones(2))[0], [4.0, 4.0])
  factor = 3.0  # a closure cell rebound
  np.testing.assert_allclose(run(layer, jnp.ones(2))[0], [9.0, 9.0])
  mapped = sr.vmap(lambda m, x: x * factor, variable_broadcast=True)
  np.testing.assert_allclose(mapped(layer, jnp.ones(2)), [3.0, 3.0])
  factor = 4.0
  np.testing.assert_allclose(mapped(layer, jnp.ones(2)), [4.0, 4.0])


def test_a_module_as_a_static_jax_jit_argument_is_refused_with_the_fix():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  f = jax.jit(lambda m, x: m(x), static_argnums=0)
  with pytest.raises(
    ValueError,
    match=r"(?s)unhashable type: 'Linear'.*static "
    r"argument.*Fix: pass it as an ordinary argument.*sr.jit.*id\(obj\)",
  ):
    f(model, jnp.ones((1, 2)))
  with pytest.raises(TypeError, match="unhashable type: 'Param'"):
    hash(model.kernel)
  # As an ordinary argument (a pytree) it is never stale.
  g = jax.jit(lambda m, x: m(x))
  before = g(model, jnp.ones((1, 2)))
  model.kernel.value = model.kernel.value * 0
  np.testing.assert_allclose(g(model, jnp.ones((1, 2))), model.bias.value[None])
  assert not np.allclose(before, model.bias.value[None])


def test_vmap_with_an_explicit_in_axes_maps_the_plain_module_as_nnx_does():
  """nnx's ``in_axes`` cover the module argument: ``in_axes=0`` (or a tuple whose first
  entry is the module's) is the user saying to map its Variables, so the nnx guide's
  first example runs as written; the default in_axes still refuses (above)."""
  kernel = jnp.arange(24.0).reshape(4, 2, 3)
  bias = jnp.arange(12.0).reshape(4, 3)

  class Weights(sr.Module):
    def __init__(self):
      self.kernel, self.bias = sr.Param(kernel), sr.Param(bias)

  def vector_dot(weights, x):
    assert weights.kernel.ndim == 2 and x.ndim == 1
    return x @ weights.kernel + weights.bias

  xs = jnp.arange(8.0).reshape(4, 2)
  loop = jnp.stack([xs[i] @ kernel[i] + bias[i] for i in range(4)])
  weights = Weights()
  before = snapshot(weights)
  np.testing.assert_allclose(sr.vmap(vector_dot, in_axes=0)(weights, xs), loop)
  np.testing.assert_allclose(sr.vmap(vector_dot, in_axes=(0, 0))(weights, xs), loop)
  decorated = sr.vmap(in_axes=0, out_axes=1)(vector_dot)
  np.testing.assert_allclose(decorated(weights, xs), loop.T)
  # the module's entry None broadcasts it: every example sees the whole module
  one = sr.vmap(lambda w, x: x @ w.kernel.value[0], in_axes=(None, 0))(weights, xs)
  np.testing.assert_allclose(one, xs @ kernel[0])
  # the default, undecorated or decorated, is not the user saying so
  for run in (sr.vmap(vector_dot), sr.vmap(out_axes=0)(vector_dot)):
    with pytest.raises(sr.TransformError, match=r"belongs to a plain module"):
      run(weights, xs)
  with pytest.raises(sr.TransformError, match=r"one more whose first entry maps the module"):
    sr.vmap(vector_dot, in_axes=(0, 0, 0))(weights, xs)
  assert_unchanged(weights, before)
