"""sr.vmap: stacked (ensemble) init and vectorised application, against loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr

E, W = 3, 4  # ensemble size and features: tiny, to keep compile times down


class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


class NormBlock(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.BatchNorm(dim, momentum=0.5, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.linear(x))


class DropBlock(sr.Module):
  def __init__(self, *, rngs):
    self.drop = sr.nn.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(x)


class SharedScale(sr.Module):
  """Every member multiplies by the same ``shared`` Param (a constructor argument)."""

  def __init__(self, shared, *, rngs):
    self.shared = shared
    self.linear = sr.nn.Linear(W, W, rngs=rngs)

  def __call__(self, x):
    return self.linear(x) * self.shared.value[None]


def apply(member, x):
  return member(x)


def data(batch=2):
  return jnp.linspace(-1.0, 1.0, batch * W).reshape(batch, W)


def ensemble(cls=Block, *args, seed=0, **kw):
  kw.setdefault("in_axes", None)
  return sr.vmap(cls, axis_size=E, **kw)(*args, rngs=sr.Rngs(seed))


# -- stacked init ---------------------------------------------------------------------


def test_class_form_builds_distinct_members():
  ens = ensemble(Block, W)
  assert isinstance(ens, Block) and type(ens).__name__ == "VmapBlock"
  assert len(ens) == E
  assert ens.linear.kernel.shape == (E, W, W) and ens.linear.bias.shape == (E, W)
  kernels = np.asarray(ens.linear.kernel.value)
  assert all(not np.allclose(kernels[i], kernels[j]) for i in range(E) for j in range(i))
  # Deterministic in the seed; another seed gives other members.
  np.testing.assert_array_equal(ensemble(Block, W).linear.kernel.value, kernels)
  assert not np.allclose(ensemble(Block, W, seed=1).linear.kernel.value, kernels)


def test_class_form_call_matches_members():
  ens = ensemble(Block, W)
  x = data()
  y = ens(x)
  assert y.shape == (E, 2, W)
  for i, member in enumerate(sr.unstack(ens)):
    assert type(member) is Block
    np.testing.assert_allclose(y[i], member(x), rtol=1e-6, atol=1e-6)


def test_init_consumes_the_rng_stream_once():
  rngs = sr.Rngs(0)
  first = sr.vmap(Block, axis_size=E)(W, rngs=rngs)
  assert int(rngs.default.count.value) == 1
  second = sr.vmap(Block, axis_size=E)(W, rngs=rngs)
  assert int(rngs.default.count.value) == 2
  assert not np.allclose(first.linear.kernel.value, second.linear.kernel.value)


# -- function form, in_axes / out_axes ------------------------------------------------


def test_function_form_matches_stacking_over_members():
  ens = ensemble(Block, W)
  xs = jnp.linspace(-1.0, 1.0, E * 2 * W).reshape(E, 2, W)
  want = jnp.stack([member(xs[i]) for i, member in enumerate(sr.unstack(ens))])
  np.testing.assert_allclose(sr.vmap(apply)(ens, xs), want, rtol=1e-6, atol=1e-6)
  # in_axes=1 maps the middle axis; out_axes=1 puts the members there.
  got = sr.vmap(apply, in_axes=1, out_axes=1)(ens, jnp.swapaxes(xs, 0, 1))
  np.testing.assert_allclose(got, jnp.swapaxes(want, 0, 1), rtol=1e-6, atol=1e-6)
  # in_axes=-3 is the same axis as 0.
  np.testing.assert_allclose(sr.vmap(apply, in_axes=-3)(ens, xs), want, rtol=1e-6, atol=1e-6)
  # nnx's spelling: one entry more, the module's first (its layer axis)
  np.testing.assert_allclose(sr.vmap(apply, in_axes=(0, 0))(ens, xs), want, rtol=1e-6, atol=1e-6)


def test_in_axes_per_argument_and_broadcast():
  ens = ensemble(Block, W)
  x = data()
  shifts = jnp.arange(E, dtype=jnp.float32)

  def shifted(member, x, shift):
    return member(x) + shift

  got = sr.vmap(shifted, in_axes=(None, 0))(ens, x, shifts)
  for i, member in enumerate(sr.unstack(ens)):
    np.testing.assert_allclose(got[i], member(x) + shifts[i], rtol=1e-6, atol=1e-6)
  # A tuple of outputs with per-output out_axes.
  pair = sr.vmap(lambda m, x: (m(x), m(x).sum()), in_axes=None, out_axes=(1, 0))(ens, x)
  assert pair[0].shape == (2, E, W) and pair[1].shape == (E,)


def test_axis_name_collectives():
  ens = ensemble(Block, W)
  x = data()

  def centred(member, x):
    y = member(x)
    return y - jax.lax.psum(y, "members") / E

  got = sr.vmap(centred, in_axes=None, axis_name="members")(ens, x)
  ys = ens(x)
  np.testing.assert_allclose(got, ys - ys.mean(0)[None], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got.sum(0), 0.0, atol=1e-5)


def test_plain_module_with_axis_size_and_no_stacked_variables():
  layer = Block(W, rngs=sr.Rngs(0))
  x = data()
  got = sr.vmap(apply, in_axes=None, axis_size=E, variable_axes={})(layer, x)
  assert got.shape == (E, 2, W)
  for i in range(E):
    np.testing.assert_allclose(got[i], layer(x), rtol=1e-6)


def test_a_tuple_of_stacks_is_mapped_together():
  a, b = ensemble(Block, W), ensemble(Block, W, seed=1)
  x = data()
  seen = []

  def both(pair, x):
    seen.append(tuple(type(m) for m in pair))
    return pair[0](x) + pair[1](x)

  got = sr.vmap(both, in_axes=None)((a, b), x)
  assert seen == [(Block, Block)]  # each stack is one layer inside
  np.testing.assert_allclose(got, a(x) + b(x), rtol=1e-6, atol=1e-6)


# -- collections -----------------------------------------------------------------------


def test_variable_broadcast_shares_one_param():
  shared = sr.Param(jnp.arange(1.0, W + 1.0))
  ens = ensemble(SharedScale, shared, variable_broadcast=sr.PathContains("shared"))
  assert ens.shared is shared and ens.shared.shape == (W,)
  assert ens.linear.kernel.shape == (E, W, W)
  x = data()
  y = ens(x)
  members = sr.unstack(ens)
  for i, member in enumerate(members):
    np.testing.assert_allclose(member.shared.value, shared.value)
    np.testing.assert_allclose(y[i], member(x), rtol=1e-6, atol=1e-6)
  # The broadcast Param's gradient sums the members'.
  grads = sr.grad(lambda m, x: (m(x) ** 2).sum())(ens, x)
  assert grads["shared"].shape == (W,)
  want = sum(sr.grad(lambda m, x: (m(x) ** 2).sum())(m, x)["shared"] for m in members)
  np.testing.assert_allclose(grads["shared"], want, rtol=1e-5)


def test_split_rngs_gives_each_member_its_dropout_mask():
  x = jnp.ones((2, 8))
  split = sr.vmap(DropBlock, axis_size=E, in_axes=None)(rngs=sr.Rngs(0))
  masks = np.asarray(split(x))
  assert set(np.unique(masks)) <= {0.0, 2.0}
  assert len({m.tobytes() for m in masks}) == E
  again = np.asarray(split(x))
  assert not np.array_equal(again, masks)  # the stream advanced
  same = sr.vmap(DropBlock, axis_size=E, in_axes=None, split_rngs=False)(rngs=sr.Rngs(0))
  masks = np.asarray(same(x))
  assert not np.all(masks == masks[0, 0, 0])
  for m in masks[1:]:
    np.testing.assert_array_equal(m, masks[0])


def test_metadata_params_partition_name():

  class Sharded(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(W, W, kernel_metadata={"sharding": ("embed", "mlp")}, rngs=rngs)

    def __call__(self, x):
      return self.linear(x)

  ens = sr.vmap(Sharded, axis_size=E, in_axes=None, metadata_params={"partition_name": "ensemble"})(
    rngs=sr.Rngs(0)
  )
  assert ens.linear.kernel.sharding == ("ensemble", "embed", "mlp")
  assert not hasattr(ens.linear.bias, "sharding")
  assert ens.layer(0).linear.kernel.sharding == ("embed", "mlp")
  seen = []

  def look(member, x):
    seen.append(member.linear.kernel.sharding)
    return member(x)

  assert sr.vmap(look, in_axes=None)(ens, data()).shape == (E, 2, W)
  assert seen == [("embed", "mlp")]
  assert ens.linear.kernel.sharding == ("ensemble", "embed", "mlp")
  # Another axis: the name goes where the layer axis is.
  last = sr.vmap(
    Sharded,
    axis_size=E,
    in_axes=None,
    variable_axes={True: -1},
    metadata_params={"partition_name": "ensemble"},
  )(rngs=sr.Rngs(0))
  assert last.linear.kernel.shape == (W, W, E)
  assert last.linear.kernel.sharding == ("embed", "mlp", "ensemble")


def test_stacked_batch_stats_are_written_back():
  ens = ensemble(NormBlock, W, in_axes=0)
  xs = jnp.linspace(-2.0, 2.0, E * 3 * W).reshape(E, 3, W) ** 2
  members = sr.unstack(ens)
  y = ens(xs)
  assert ens.norm.mean.shape == (E, W)
  for i, member in enumerate(members):
    np.testing.assert_allclose(y[i], member(xs[i]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ens.norm.mean.value[i], member.norm.mean.value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ens.norm.var.value[i], member.norm.var.value, rtol=1e-5)
  assert not np.allclose(ens.norm.mean.value[0], ens.norm.mean.value[1])


# -- errors ----------------------------------------------------------------------------


def test_writing_a_broadcast_variable():
  ens = ensemble(NormBlock, W, variable_broadcast=sr.BatchStat)
  assert ens.norm.mean.shape == (W,)
  before = {k: np.asarray(v) for k, v in sr.state(ens).flat().items()}
  with pytest.raises(
    sr.TransformError,
    match=r"wrote to `norm\.mean` \(BatchStat, collection 'batch_stats'\)"
    r", which is not mapped.*variable_axes=\{'batch_stats': 0\}",
  ):
    ens(data())
  for k, v in sr.state(ens).flat().items():
    np.testing.assert_array_equal(v, before[k])


def test_axis_size_mismatch_names_the_variable():
  ens = ensemble(Block, W)
  with pytest.raises(
    sr.TransformError,
    match=r"axis_size=5 says 5 iterations but the stacked variable "
    r"`linear\.bias` \(axis 0\) has 3",
  ):
    sr.vmap(apply, in_axes=None, axis_size=5)(ens, data())
  with pytest.raises(
    sr.TransformError,
    match=r"the stacked variable `linear\.bias` \(axis 0\) says 3 "
    r"iterations but argument 1 \(axis 0\) has 2",
  ):
    sr.vmap(apply)(ens, data())


def test_no_size_at_all():
  with pytest.raises(
    sr.TransformError,
    match=r"cannot tell the size of the mapped axis.*"
    r"Pass `axis_size=`",
  ):
    sr.vmap(apply, in_axes=None, variable_axes={})(Block(W, rngs=sr.Rngs(0)), data())
  with pytest.raises(
    sr.TransformError,
    match=r"`linear\.bias` is stacked by variable_axes, so the number of "
    r"layers must be known at init",
  ):
    sr.vmap(Block)(W, rngs=sr.Rngs(0))


def test_in_axes_errors():
  ens = ensemble(Block, W)
  with pytest.raises(
    sr.TransformError,
    match=r"in_axes puts the mapped axis of argument 1 at 2, but a leaf "
    r"has shape \(2, 4\)",
  ):
    sr.vmap(apply, in_axes=2)(ens, data())
  # one entry more than the arguments is nnx's spelling (the module's first); two are not
  with pytest.raises(
    sr.TransformError, match=r"in_axes=\(0, 0, 0\) has 3 entries for 1 arguments.*as nnx"
  ):
    sr.vmap(apply, in_axes=(0, 0, 0))(ens, data())
  with pytest.raises(
    sr.TransformError, match=r"variable_axes puts the layer axis of `linear\.bias` at 5"
  ):
    sr.vmap(Block, axis_size=E, variable_axes={sr.Param: 5})(W, rngs=sr.Rngs(0))


def test_new_variable_inside_the_function():
  ens = ensemble(Block, W)

  def grow(member, x):
    member.extra = sr.Param(jnp.zeros(()))
    return member(x)

  # Carried out to the caller, one per member: stacked along the mapped axis.
  sr.vmap(grow, in_axes=None)(ens, data())
  assert ens.extra.shape == (E,) and len(sr.unstack(ens)) == E


def test_absent_rng_stream():
  rngs = sr.Rngs(params=0)
  ens = sr.vmap(DropBlock, axis_size=E, in_axes=None)(rngs=rngs)
  assert ens.drop.rngs is rngs and int(rngs.params.count.value) == 0
  with pytest.raises(
    AttributeError,
    match=r"this Rngs has no 'dropout' stream and no "
    r"default stream \(it has \['params'\]\)",
  ):
    ens(jnp.ones((2, W)))
  assert int(rngs.params.count.value) == 0


def test_module_in_args():
  ens = ensemble(Block, W)
  with pytest.raises(
    sr.GraphError,
    match=r"sr\.vmap\(apply\): argument 1 is a "
    r"VmapBlock\. Modules go in argument 0 only"
    r".*Nothing was run\. Fix: pass every module "
    r"in argument 0",
  ) as caught:
    sr.vmap(apply, in_axes=None)(ens, ens)
  assert isinstance(caught.value, TypeError)  # a GraphError is a TypeError
  # No module anywhere: jax.vmap over the arguments (modules made inside come out
  # stacked), which here maps nothing.
  with pytest.raises(
    sr.TransformError,
    match=r"No argument holds a module.*argument 0 "
    r"must be the module",
  ):
    sr.vmap(apply, in_axes=None)(data(), data())
  with pytest.raises(TypeError, match=r"methods=\.\.\.\) applies to a Module class"):
    sr.vmap(apply, methods=["__call__"])


# -- composition -------------------------------------------------------------------------


class ScanBlock(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.linear(x)), None


def test_vmap_of_scan_is_an_ensemble_of_stacks():
  Stack = sr.scan(ScanBlock, length=2, variable_axes={sr.Param: 0}, split_rngs={"params": True})
  ens = sr.vmap(Stack, axis_size=E, in_axes=None)(W, rngs=sr.Rngs(0))
  assert ens.linear.kernel.shape == (E, 2, W, W)
  kernels = np.asarray(ens.linear.kernel.value).reshape(E * 2, W, W)
  assert all(not np.allclose(kernels[i], kernels[j]) for i in range(E * 2) for j in range(i))
  x = data()
  y, _ = ens(x)
  members = sr.unstack(ens)
  assert [type(m) for m in members] == [type(ens).__mro__[1]] * E
  for i, member in enumerate(members):
    h = x
    for layer in sr.unstack(member):
      h, _ = layer(h)
    np.testing.assert_allclose(y[i], h, rtol=1e-6, atol=1e-6)

  def loss(ens, x):
    return (ens(x)[0] ** 2).mean()

  def loop_loss(ens, x):
    total = 0.0
    for member in sr.unstack(ens):
      h = x
      for layer in sr.unstack(member):
        h, _ = layer(h)
      total = total + (h**2).mean()
    return total / E

  value, grads = sr.jit(sr.value_and_grad(loss))(ens, x)
  want_value, want = sr.value_and_grad(loop_loss)(ens, x)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  assert grads["linear"]["kernel"].shape == (E, 2, W, W)
  for path, g in grads.flat().items():
    np.testing.assert_allclose(g, want.flat()[path], rtol=1e-5, atol=1e-7)


def test_jit_and_grad_of_vmap_write_back_batch_stats():
  ens = ensemble(NormBlock, W, in_axes=0)
  xs = jnp.linspace(-2.0, 2.0, E * 3 * W).reshape(E, 3, W)
  reference = sr.clone(ens)

  @sr.jit
  def step(ens, xs):
    return sr.value_and_grad(lambda m, xs: (m(xs) ** 2).mean())(ens, xs)

  value, grads = step(ens, xs)
  want_value, want = sr.value_and_grad(lambda m, xs: (m(xs) ** 2).mean())(reference, xs)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  # A BatchNorm over 3 rows magnifies rounding, and two compilations (jit, eager) round
  # apart: on jax 0.12 the bias before it (whose gradient is zero but for rounding)
  # differs by 1e-6 and one kernel column by 4e-4 relative; a wrong statistic or
  # mapping would be off by O(1).
  for path, g in grads.flat().items():
    np.testing.assert_allclose(g, want.flat()[path], rtol=1e-3, atol=1e-5)
  np.testing.assert_allclose(ens.norm.mean.value, reference.norm.mean.value, rtol=1e-6)
  assert not np.allclose(ens.norm.mean.value, 0.0)


def test_keyword_arguments_are_not_mapped():
  Ensemble = sr.vmap(sr.nn.Dropout, axis_size=2, in_axes=0)
  ensemble = Ensemble(0.5, rngs=sr.Rngs(0))
  x = jnp.ones((2, 8))
  assert np.array_equal(ensemble(x, deterministic=True), x)
  assert not np.array_equal(ensemble(x, deterministic=False), x)
