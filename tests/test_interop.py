"""sr.interop against flax.linen and flax.nnx: the same parameters give the same numbers
(outputs and updated batch statistics), round trips are exact, and every mapping that
does not fit names the path that failed and leaves the model (or nnx module) unchanged."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import statefulremat as sr

D = 4  # features: tiny, to keep compile times down
LAYERS = (2, 3)
X = jax.random.normal(jax.random.key(1), (5, D))
IDS = jnp.array([[1, 2, 3], [4, 5, 9]])


def close(a, b):
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def assert_trees_equal(a, b, check=np.testing.assert_array_equal):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(check, a, b)


def snapshot(model) -> dict:
  return {p: np.array(v) for p, v in sr.state(model, (sr.Param, sr.BatchStat)).flat().items()}


def assert_unchanged(model, before: dict):
  assert_trees_equal(snapshot(model), before)


# -- models: ours, linen's and nnx's with the same names ----------------------------


class MLP(sr.Module):
  def __init__(self, rngs):
    self.embed = sr.nn.Embed(10, D, rngs=rngs)
    self.layers = [sr.nn.Linear(D, 2 * D, rngs=rngs), sr.nn.Linear(2 * D, D, rngs=rngs)]
    self.norm = sr.nn.LayerNorm(D, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    for layer in self.layers:
      x = jax.nn.relu(layer(x))
    return self.norm(x)


class LinenMLP(nn.Module):
  def setup(self):
    self.embed = nn.Embed(10, D)
    self.layers = [nn.Dense(2 * D), nn.Dense(D)]
    self.norm = nn.LayerNorm()

  def __call__(self, ids):
    x = self.embed(ids)
    for layer in self.layers:
      x = jax.nn.relu(layer(x))
    return self.norm(x)


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(10, D, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)])
    self.norm = nnx.LayerNorm(D, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    for layer in self.layers:
      x = jax.nn.relu(layer(x))
    return self.norm(x)


class BNNet(sr.Module):
  def __init__(self, rngs, **bn):
    self.linear = sr.nn.Linear(D, D, rngs=rngs)
    self.bn = sr.nn.BatchNorm(D, rngs=rngs, **bn)

  def __call__(self, x):
    return self.bn(self.linear(x))


class LinenBNNet(nn.Module):
  momentum: float = 0.99
  epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(D, name="linear")(x)
    return nn.BatchNorm(
      use_running_average=not train, momentum=self.momentum, epsilon=self.epsilon, name="bn"
    )(x)


class NnxBNNet(nnx.Module):
  def __init__(self, rngs, **bn):
    self.linear = nnx.Linear(D, D, rngs=rngs)
    self.bn = nnx.BatchNorm(D, rngs=rngs, **bn)

  def __call__(self, x):
    return self.bn(self.linear(x))


class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.bn = sr.nn.BatchNorm(dim, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.bn(self.linear(x)))


class ScanBlock(Block):
  """``sr.scan``'s body returns ``(carry, ys)``."""

  def __call__(self, x):
    return super().__call__(x), None


class Deep(sr.Module):
  """A stack of blocks under ``blocks``, then a head."""

  def __init__(self, stack, rngs):
    self.blocks = stack(D, rngs=rngs)
    self.head = sr.nn.Linear(D, 1, rngs=rngs)

  def __call__(self, x):
    x = self.blocks(x)
    return self.head(x[0] if isinstance(x, tuple) else x)


REMAT_SCAN = sr.remat_scan(Block, lengths=LAYERS)
SCAN = sr.scan(
  ScanBlock, length=6, variable_axes={sr.Param: 0, sr.BatchStat: 0}, split_rngs={"params": True}
)


@functools.cache
def _deep_model(stack):
  return Deep(stack, sr.Rngs(0))


def deep_model(stack):
  """A fresh ``Deep`` (a clone: building a stack compiles its vmapped init)."""
  return sr.clone(_deep_model(stack))


def _linen_block(x):
  h = nn.Dense(D, name="linear")(x)
  return x + jnp.tanh(nn.BatchNorm(use_running_average=False, name="bn")(h))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _linen_block(x)


class LinenScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return _linen_block(x), None


class LinenDeep(nn.Module):
  scan: bool  # nn.scan over 6 layers, else nn.remat_scan with lengths (2, 3)

  @nn.compact
  def __call__(self, x):
    if self.scan:
      x = nn.scan(
        LinenScanBlock,
        variable_axes={"params": 0, "batch_stats": 0},
        split_rngs={"params": True},
        length=6,
      )(name="blocks")(x, None)[0]
    else:
      x = nn.remat_scan(LinenBlock, lengths=LAYERS)(name="blocks")(x)
    return nn.Dense(1, name="head")(x)


class NnxBlock(nnx.Module):
  def __init__(self, dim, rngs):
    self.linear = nnx.Linear(dim, dim, rngs=rngs)
    self.bn = nnx.BatchNorm(dim, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.bn(self.linear(x)))


class NnxDeep(nnx.Module):
  """nnx's scan over layers: Blocks built under nnx.vmap, applied under nnx.scan."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=6)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return NnxBlock(D, rngs)

    self.blocks = create(rngs)
    self.head = nnx.Linear(D, 1, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def forward(block, x):
      return block(x)

    return self.head(forward(self.blocks, x))


@functools.cache
def _jitted_apply(linen_model):
  return jax.jit(
    functools.partial(linen_model.apply, mutable=["batch_stats"]), static_argnames="train"
  )


def linen_train_step(linen_model, variables, *args, **kwargs):
  """One training-mode call: ``(y, variables with the updated batch statistics)``."""
  y, updated = _jitted_apply(linen_model)(variables, *args, **kwargs)
  return y, {**variables, **updated}


# -- round trips and parity -----------------------------------------------------------


def test_mlp_names_parity_and_round_trips_with_linen():
  ours = MLP(sr.Rngs(0))
  variables = sr.interop.to_linen(ours)
  assert set(variables) == {"params"}
  assert set(variables["params"]) == {"embed", "layers_0", "layers_1", "norm"}
  close(LinenMLP().apply(variables, IDS), ours(IDS))
  # ours -> linen -> ours
  again = sr.interop.from_linen(MLP(sr.Rngs(1)), variables)
  assert_trees_equal(snapshot(again), snapshot(ours))
  # linen -> ours -> linen
  theirs = LinenMLP().init(jax.random.key(2), IDS)
  loaded = sr.interop.from_linen(MLP(sr.Rngs(3)), theirs)
  assert_trees_equal(sr.interop.to_linen(loaded), theirs)
  close(loaded(IDS), LinenMLP().apply(theirs, IDS))


def test_mlp_parity_and_round_trips_with_nnx():
  ours = MLP(sr.Rngs(0))
  theirs = NnxMLP(nnx.Rngs(7))
  state = sr.interop.to_nnx(ours, theirs)
  assert isinstance(state, nnx.State)
  close(theirs(IDS), ours(IDS))
  # ours -> nnx -> ours, from the module and from its State
  assert_trees_equal(snapshot(sr.interop.from_nnx(MLP(sr.Rngs(1)), theirs)), snapshot(ours))
  assert_trees_equal(
    snapshot(sr.interop.from_nnx(MLP(sr.Rngs(1)), nnx.state(theirs))), snapshot(ours)
  )
  # nnx -> ours -> nnx State: a new State; the one given is unchanged
  fresh = NnxMLP(nnx.Rngs(8))
  given_state = nnx.state(fresh, nnx.Param)
  before = jax.tree.map(np.array, nnx.to_pure_dict(given_state))
  out = sr.interop.to_nnx(ours, given_state)
  assert_trees_equal(nnx.to_pure_dict(out), nnx.to_pure_dict(nnx.state(theirs, nnx.Param)))
  assert_trees_equal(nnx.to_pure_dict(given_state), before)
  nnx.update(fresh, out)
  close(fresh(IDS), ours(IDS))


def test_batchnorm_defaults_match_linen_and_nnx():
  ours = sr.nn.BatchNorm(D, rngs=sr.Rngs(0))
  linen = nn.BatchNorm()
  theirs = nnx.BatchNorm(D, rngs=nnx.Rngs(0))
  assert ours.momentum == linen.momentum == theirs.momentum == 0.99
  assert ours.epsilon == linen.epsilon == theirs.epsilon == 1e-5
  assert ours.use_fast_variance == linen.use_fast_variance == theirs.use_fast_variance


def test_batchnorm_training_step_matches_linen():
  bn = {"momentum": 0.9, "epsilon": 1e-3}  # not the defaults: the settings pass through
  theirs = LinenBNNet(**bn).init(jax.random.key(0), X, train=False)
  # Running statistics that differ from the initial ones, so loading them matters.
  k1, k2 = jax.random.split(jax.random.key(3))
  theirs["batch_stats"] = {
    "bn": {"mean": jax.random.normal(k1, (D,)), "var": 1 + jax.random.uniform(k2, (D,))}
  }
  ours = sr.interop.from_linen(BNNet(sr.Rngs(1), **bn), theirs)
  assert_trees_equal(sr.interop.to_linen(ours), theirs)
  for _ in range(2):  # training mode: batch statistics used and running averages updated
    y, theirs = linen_train_step(LinenBNNet(**bn), theirs, X, train=True)
    close(y, ours(X))
    assert_trees_equal(sr.interop.to_linen(ours)["batch_stats"], theirs["batch_stats"], close)
  close(ours.eval()(X), LinenBNNet(**bn).apply(theirs, X, train=False))


def test_batchnorm_training_step_matches_nnx():
  bn = {"momentum": 0.9, "epsilon": 1e-3}
  ours = BNNet(sr.Rngs(0), **bn)
  ours(X)  # non-trivial running statistics
  theirs = NnxBNNet(nnx.Rngs(5), **bn)
  sr.interop.to_nnx(ours, theirs)
  close(theirs(X), ours(X))
  back = sr.interop.from_nnx(BNNet(sr.Rngs(1), **bn), theirs)
  assert_trees_equal(snapshot(back), snapshot(ours), close)


def test_remat_scan_stack_matches_linen_remat_scan():
  ours = deep_model(REMAT_SCAN)
  variables = sr.interop.to_linen(ours)
  blocks = variables["params"]["blocks"]
  assert blocks["linear"]["kernel"].shape == LAYERS + (D, D)
  assert variables["batch_stats"]["blocks"]["bn"]["mean"].shape == LAYERS + (D,)
  for _ in range(2):
    y, variables = linen_train_step(LinenDeep(scan=False), variables, X)
    close(y, ours(X))
    assert_trees_equal(sr.interop.to_linen(ours), variables, close)
  # linen -> ours -> linen
  theirs = LinenDeep(scan=False).init(jax.random.key(0), X)
  assert jax.tree.map(jnp.shape, theirs) == jax.tree.map(jnp.shape, variables)
  loaded = sr.interop.from_linen(deep_model(REMAT_SCAN), theirs)
  assert_trees_equal(sr.interop.to_linen(loaded), theirs)


def test_remat_scan_stack_matches_linen_scan():
  theirs = LinenDeep(scan=True).init(jax.random.key(0), X)
  assert theirs["params"]["blocks"]["linear"]["kernel"].shape == (6, D, D)
  ours = sr.interop.from_linen(deep_model(REMAT_SCAN), theirs)
  assert_trees_equal(sr.interop.to_linen(ours, flat_stacks=True), theirs)
  y, theirs = linen_train_step(LinenDeep(scan=True), theirs, X)
  close(y, ours(X))
  assert_trees_equal(sr.interop.to_linen(ours, flat_stacks=True), theirs, close)


def test_scan_stack_matches_linen_scan_and_takes_the_nested_layout():
  ours = deep_model(SCAN)
  variables = sr.interop.to_linen(ours)
  assert variables["params"]["blocks"]["linear"]["kernel"].shape == (6, D, D)
  y, variables = linen_train_step(LinenDeep(scan=True), variables, X)
  close(y, ours(X))
  assert_trees_equal(sr.interop.to_linen(ours), variables, close)
  nested = sr.interop.to_linen(deep_model(REMAT_SCAN))  # nn.remat_scan's layout
  loaded = sr.interop.from_linen(deep_model(SCAN), nested)
  np.testing.assert_array_equal(
    loaded.blocks.linear.kernel.value,
    nested["params"]["blocks"]["linear"]["kernel"].reshape(6, D, D),
  )


def test_vmap_stack_matches_linen_vmap():
  ours = sr.vmap(sr.nn.Linear, axis_size=3, in_axes=None)(D, 2, rngs=sr.Rngs(0))
  variables = sr.interop.to_linen(ours)
  assert variables["params"]["kernel"].shape == (3, D, 2)
  linen = nn.vmap(
    nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, axis_size=3
  )(2)
  close(linen.apply(variables, X), ours(X))


def test_remat_scan_stack_matches_nnx_scan_over_layers():
  ours = deep_model(REMAT_SCAN)
  ours(X)  # non-trivial running statistics
  theirs = NnxDeep(nnx.Rngs(3))
  assert theirs.blocks.linear.kernel[...].shape == (6, D, D)
  sr.interop.to_nnx(ours, theirs)
  close(theirs(X), ours(X))  # a training step on both sides
  back = sr.interop.from_nnx(deep_model(REMAT_SCAN), theirs)
  assert_trees_equal(snapshot(back), snapshot(ours), close)
  # nnx -> ours -> nnx
  fresh = NnxDeep(nnx.Rngs(4))
  loaded = sr.interop.from_nnx(deep_model(REMAT_SCAN), fresh)
  target = NnxDeep(nnx.Rngs(5))
  sr.interop.to_nnx(loaded, target)
  assert_trees_equal(
    nnx.to_pure_dict(nnx.state(target, (nnx.Param, nnx.BatchStat))),
    nnx.to_pure_dict(nnx.state(fresh, (nnx.Param, nnx.BatchStat))),
  )


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([(6,), (2, 3), (3, 2), (1, 6), (2, 1, 3)]), st.integers(0, 2**31))
def test_any_nested_layout_loads_in_layer_order(lengths, seed):
  deep = deep_model(REMAT_SCAN)
  template = sr.interop.to_linen(deep, flat_stacks=True)

  def nested(x):
    return np.random.default_rng(seed).standard_normal(lengths + x.shape[1:], x.dtype)

  variables = {
    c: {**tree, "blocks": jax.tree.map(nested, tree["blocks"])} for c, tree in template.items()
  }
  sr.interop.from_linen(deep, variables)
  flat = sr.interop.to_linen(deep, flat_stacks=True)
  for c in variables:
    assert_trees_equal(
      flat[c]["blocks"],
      jax.tree.map(lambda x: x.reshape((6,) + x.shape[len(lengths) :]), variables[c]["blocks"]),
    )
  # and back in the class's own layout, lengths (2, 3)
  kernel = sr.interop.to_linen(deep)["params"]["blocks"]["linear"]["kernel"]
  assert kernel.shape == LAYERS + (D, D)
  np.testing.assert_array_equal(
    kernel.reshape(6, D, D), flat["params"]["blocks"]["linear"]["kernel"]
  )


def test_dicts_and_nested_lists_follow_linen_setup_names():

  class Nested(sr.Module):
    def __init__(self, rngs):
      self.heads = {"a": sr.nn.Linear(2, 2, rngs=rngs)}
      self.grid = [[sr.nn.Linear(2, 2, rngs=rngs)], [sr.nn.Linear(2, 2, rngs=rngs)]]

  class LinenNested(nn.Module):
    def setup(self):
      self.heads = {"a": nn.Dense(2)}
      self.grid = [[nn.Dense(2)], [nn.Dense(2)]]

    def __call__(self, x):
      return self.heads["a"](x) + self.grid[0][0](x) + self.grid[1][0](x)

  theirs = LinenNested().init(jax.random.key(0), jnp.ones((1, 2)))
  assert set(theirs["params"]) == {"heads_a", "grid_0_0", "grid_1_0"}
  ours = sr.interop.from_linen(Nested(sr.Rngs(0)), theirs)
  assert_trees_equal(sr.interop.to_linen(ours), theirs)


def test_collections_selects_what_is_transferred():
  theirs = sr.interop.to_linen(BNNet(sr.Rngs(2)))
  ours = BNNet(sr.Rngs(1))
  ours(X)
  stats = snapshot(ours)
  sr.interop.from_linen(ours, {"params": theirs["params"]}, collections=(sr.Param,))
  assert_trees_equal(sr.interop.to_linen(ours, collections="params"), {"params": theirs["params"]})
  now = snapshot(ours)
  for path in [("bn", "mean"), ("bn", "var")]:
    np.testing.assert_array_equal(now[path], stats[path])


def test_rng_state_is_left_alone():

  class Drop(sr.Module):
    def __init__(self, rngs):
      self.linear = sr.nn.Linear(D, D, rngs=rngs)
      self.drop = sr.nn.Dropout(0.5, rngs=rngs)

  class NnxDrop(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(D, D, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

  ours = Drop(sr.Rngs(0))
  rng_state = {p: v for p, v in sr.state(ours, sr.RngState).flat().items()}
  assert set(sr.interop.to_linen(ours)) == {"params"}
  with pytest.raises(ValueError, match=r"RNG state is not part of linen variables"):
    sr.interop.to_linen(ours, collections=("params", "rngs"))
  theirs = NnxDrop(nnx.Rngs(3))
  theirs.drop.rngs.count.set_value(jnp.uint32(5))  # a stream that has been drawn from
  sr.interop.from_nnx(ours, theirs)
  np.testing.assert_array_equal(ours.linear.kernel.value, theirs.linear.kernel[...])
  after = sr.state(ours, sr.RngState).flat()
  assert after.keys() == rng_state.keys()
  for path, value in after.items():
    assert value is rng_state[path]


def test_interop_imports_flax_only_when_called(monkeypatch):
  """Re-imports sr.interop with flax hidden: importing statefulremat must not need it."""

  class NoFlax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
      if name == "flax" or name.startswith("flax."):
        raise ImportError(f"statefulremat.interop imported {name} at import time")
      return None

  old = sr.interop
  monkeypatch.setattr(sr, "interop", old)
  for name in list(sys.modules):
    if name.startswith(("statefulremat.interop", "flax")):
      monkeypatch.delitem(sys.modules, name)
  monkeypatch.setattr(sys, "meta_path", [NoFlax()] + sys.meta_path)
  fresh = importlib.import_module("statefulremat.interop")
  assert fresh is not old and not any(name.startswith("flax") for name in sys.modules)


# -- errors: each names the path, the model is unchanged ------------------------------


def test_missing_and_unused_linen_entries():
  ours = deep_model(REMAT_SCAN)
  variables = sr.interop.to_linen(ours)
  linear = variables["params"]["blocks"]["linear"]
  linear["kernel_0"] = linear.pop("kernel") * 2
  before = snapshot(ours)
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_linen(ours, variables)
  message = str(info.value)
  assert (
    "`blocks.linear.kernel` (Param): linen has no `params/blocks/linear/kernel` "
    "(`params/blocks/linear` has: bias, kernel_0)"
  ) in message
  assert (
    "linen `params/blocks/linear/kernel_0` (float32[2, 3, 4, 4]) matches no variable of ours"
  ) in message
  assert "2 variables do not map" in message and "the model is unchanged" in message
  assert_unchanged(ours, before)


def test_extra_linen_entry():
  ours = BNNet(sr.Rngs(0))
  variables = sr.interop.to_linen(ours)
  variables["params"]["extra"] = {"kernel": jnp.zeros((2, 2))}
  variables["params"]["bn"]["scale"] = variables["params"]["bn"]["scale"] + 1
  before = snapshot(ours)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"^sr\.interop\.from_linen: linen `params/extra/kernel` "
    r"\(float32\[2, 2\]\) matches no variable of ours\.\nFix: every "
    r"linen entry needs a variable of ours",
  ):
    sr.interop.from_linen(ours, variables)
  assert_unchanged(ours, before)  # bn.scale, which did fit, was not written either


def test_shape_mismatch_names_both_shapes():
  ours = BNNet(sr.Rngs(0))
  variables = sr.interop.to_linen(ours)
  variables["params"]["linear"]["kernel"] = jnp.zeros((D, D + 1))
  before = snapshot(ours)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`linear\.kernel` \(Param\): shape mismatch: ours is \(4, 4\), "
    r"linen `params/linear/kernel` is \(4, 5\)\.",
  ):
    sr.interop.from_linen(ours, variables)
  assert_unchanged(ours, before)


def test_stacked_shape_mismatch_names_the_layer_axis():
  ours = deep_model(REMAT_SCAN)
  variables = sr.interop.to_linen(ours)
  variables["params"]["blocks"]["linear"]["kernel"] = jnp.zeros((2, 2, D, D))
  before = snapshot(ours)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`blocks\.linear\.kernel` \(Param\): shape mismatch: ours is "
    r"\(6, 4, 4\) \(6 layers on axis 0\), linen "
    r"`params/blocks/linear/kernel` is \(2, 2, 4, 4\)\.\nFix: a "
    r"stacked variable takes linen's nn\.scan layout",
  ):
    sr.interop.from_linen(ours, variables)
  assert_unchanged(ours, before)


def test_dtype_mismatch_is_not_cast():
  ours = BNNet(sr.Rngs(0))
  variables = sr.interop.to_linen(ours)
  variables["params"]["linear"]["bias"] = jnp.zeros((D,), jnp.bfloat16)
  before = snapshot(ours)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`linear\.bias` \(Param\): dtype mismatch: ours is float32, "
    r"linen `params/linear/bias` is bfloat16\.\nFix: dtypes must "
    r"match exactly \(no silent casts\)",
  ):
    sr.interop.from_linen(ours, variables)
  assert_unchanged(ours, before)


def test_wrong_collection():
  ours = BNNet(sr.Rngs(0))
  variables = sr.interop.to_linen(ours)
  variables["params"]["bn"].update(variables.pop("batch_stats")["bn"])
  variables["batch_stats"] = {}
  before = snapshot(ours)
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_linen(ours, variables)
  message = str(info.value)
  assert message.startswith("sr.interop.from_linen: 2 variables do not map:\n")
  assert (
    "`bn.mean` (BatchStat) belongs to collection `batch_stats`, but linen has it "
    "as `params/bn/mean` (collection `params`)"
  ) in message
  assert "`bn.var` (BatchStat)" in message and "matches no variable" not in message
  assert_unchanged(ours, before)


def test_missing_collection():
  ours = BNNet(sr.Rngs(0))
  variables = sr.interop.to_linen(ours)
  before = snapshot(ours)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"linen variables have no `batch_stats` collection \(they have: "
    r"params\), but ours has 2 variable\(s\) in it: `bn\.mean` "
    r"\(BatchStat\), `bn\.var` \(BatchStat\)\.\nFix: .* "
    r"collections=\('params',\)",
  ):
    sr.interop.from_linen(ours, {"params": variables["params"]})
  assert_unchanged(ours, before)


@pytest.mark.parametrize("bad", [{"kernel": jnp.zeros((2, 2))}, [1], None])
def test_not_linen_variables(bad):
  with pytest.raises(TypeError, match=r"takes linen variables: a dict of collections"):
    sr.interop.from_linen(sr.nn.Linear(2, 2, rngs=sr.Rngs(0)), bad)


def test_bad_arguments():
  with pytest.raises(TypeError, match=r"takes one of our modules \(an sr\.Module\) first"):
    sr.interop.to_linen({"params": {}})
  with pytest.raises(
    TypeError,
    match=r"collections= takes collection names or Variable "
    r"kinds",
  ):
    sr.interop.to_linen(sr.nn.Linear(2, 2, rngs=sr.Rngs(0)), collections=(1,))
  with pytest.raises(TypeError, match=r"takes an nnx Module or an nnx State"):
    sr.interop.from_nnx(sr.nn.Linear(2, 2, rngs=sr.Rngs(0)), object())


def test_name_collision():

  class Clash(sr.Module):
    def __init__(self, rngs):
      self.layers = [sr.nn.Linear(2, 2, rngs=rngs)]
      self.layers_0 = sr.nn.Linear(2, 2, rngs=rngs)

  with pytest.raises(
    sr.StateMismatchError,
    match=r"`layers_0\.bias` \(Param\) and `layers\[0\]\.bias` \(Param\) "
    r"both map to linen `params/layers_0/bias`",
  ):
    sr.interop.to_linen(Clash(sr.Rngs(0)))


def test_nnx_missing_unused_and_shape():
  ours = BNNet(sr.Rngs(0))

  class Other(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(D, D, rngs=rngs)
      self.bn = nnx.BatchNorm(D + 1, rngs=rngs)

  theirs = Other(nnx.Rngs(0))
  before, theirs_before = snapshot(ours), nnx.to_pure_dict(nnx.state(theirs))
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_nnx(ours, theirs)
  message = str(info.value)
  assert "`linear.kernel` (Param): nnx has no `linear.kernel` (`<root>` has: bn, dense)" in message
  assert "`bn.scale` (Param): shape mismatch: ours is (4,), nnx `bn.scale` is (5,)" in message
  assert "nnx `dense.kernel` (Param, float32[4, 4]) matches no variable of ours" in message
  assert_unchanged(ours, before)
  with pytest.raises(sr.StateMismatchError, match=r"the nnx target is unchanged"):
    sr.interop.to_nnx(ours, theirs)
  assert_trees_equal(nnx.to_pure_dict(nnx.state(theirs)), theirs_before)


def test_nnx_wrong_collection_and_dtype():
  ours = BNNet(sr.Rngs(0))
  theirs = NnxBNNet(nnx.Rngs(0), param_dtype=jnp.bfloat16)
  theirs.bn.mean = nnx.Param(theirs.bn.mean[...])
  before = snapshot(ours)
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_nnx(ours, theirs)
  message = str(info.value)
  assert (
    "`bn.mean` (BatchStat) belongs to collection `batch_stats`, but nnx has a "
    "Param there (collection `params`)"
  ) in message
  assert (
    "`bn.scale` (Param): dtype mismatch: ours is float32, nnx `bn.scale` is bfloat16"
  ) in message
  assert_unchanged(ours, before)


def test_nnx_missing_collection():
  ours = BNNet(sr.Rngs(0))
  theirs = NnxBNNet(nnx.Rngs(0))
  before = snapshot(ours)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"the nnx side has no variables of collection `batch_stats`, "
    r"but ours has 2: `bn\.mean` \(BatchStat\), `bn\.var`",
  ):
    sr.interop.from_nnx(ours, nnx.state(theirs, nnx.Param))
  assert_unchanged(ours, before)
  sr.interop.from_nnx(ours, nnx.state(theirs, nnx.Param), collections="params")
  np.testing.assert_array_equal(ours.linear.kernel.value, theirs.linear.kernel[...])
