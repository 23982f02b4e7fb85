"""sr.interop by name: ``rename=``, a list of layers <-> our stack (nnx, linen, state
dicts), PyTorch-layout state dicts through safetensors files, and every mismatch named
(with the nearest names) before anything is written."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import statefulremat as sr

D, N = 4, 3  # features and layers: tiny, to keep compile times down
X = np.asarray(jax.random.normal(jax.random.key(1), (2, D)))


def snapshot(model) -> dict:
  state = sr.state(model, (sr.Param, sr.BatchStat))
  return {p: np.array(v) for p, v in state.flat().items()}


def assert_unchanged(model, before: dict):
  after = snapshot(model)
  assert after.keys() == before.keys()
  for path, value in before.items():
    np.testing.assert_array_equal(after[path], value)


def close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# -- ours: a scanned stack of blocks at `layers`, then a head -------------------------


class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.LayerNorm(dim, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.norm(self.linear(x))), None


STACK = sr.scan(Block, length=N, variable_axes={sr.Param: 0}, split_rngs={"params": True})


class Deep(sr.Module):
  def __init__(self, rngs):
    self.layers = STACK(D, rngs=rngs)
    self.head = sr.nn.Linear(D, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(self.layers(x)[0])


@functools.cache
def _deep():
  return Deep(sr.Rngs(0))


def deep():
  return sr.clone(_deep())  # building the stack compiles its vmapped init once


class NnxBlock(nnx.Module):
  def __init__(self, dim, rngs):
    self.linear = nnx.Linear(dim, dim, rngs=rngs)
    self.norm = nnx.LayerNorm(dim, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.norm(self.linear(x)))


class NnxDeep(nnx.Module):
  """nnx's usual storage: a list of layers (nnx.List)."""

  def __init__(self, rngs, n=N):
    self.layers = nnx.List([NnxBlock(D, rngs) for _ in range(n)])
    self.head = nnx.Linear(D, 1, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.head(x)


class NnxPlainList(NnxDeep, pytree=False):
  """The same, in a plain Python list."""

  def __init__(self, rngs, n=N):
    self.layers = [NnxBlock(D, rngs) for _ in range(n)]
    self.head = nnx.Linear(D, 1, rngs=rngs)


def nnx_arrays(module) -> dict:
  return {p: np.array(v) for p, v in nnx.to_flat_state(nnx.state(module))}


# -- nnx: a list of layers <-> our stack ----------------------------------------------


@pytest.mark.parametrize("cls", [NnxDeep, NnxPlainList])
def test_nnx_list_of_layers_round_trips_through_our_scanned_stack(cls):
  theirs = cls(nnx.Rngs(3))
  ours = sr.interop.from_nnx(deep(), theirs)
  for i in range(N):
    np.testing.assert_array_equal(
      ours.layers.linear.kernel.value[i], theirs.layers[i].linear.kernel[...]
    )
    np.testing.assert_array_equal(
      ours.layers.layer(i).norm.scale.value, theirs.layers[i].norm.scale[...]
    )
  close(ours(X), theirs(X))
  # and back: to_nnx writes each layer of our stack into the list
  fresh = cls(nnx.Rngs(9))
  sr.interop.to_nnx(ours, fresh)
  expected = nnx_arrays(theirs)
  got = nnx_arrays(fresh)
  assert got.keys() == expected.keys()
  for path in expected:
    np.testing.assert_array_equal(got[path], expected[path])
  close(fresh(X), ours(X))


def test_to_nnx_into_a_state_and_rename_both_ways():

  class Renamed(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([NnxBlock(D, rngs) for _ in range(N)])
      self.out = nnx.Linear(D, 1, rngs=rngs)

  rename = {r"^blocks\.": "layers.", r"^out\.": "head."}
  theirs = Renamed(nnx.Rngs(4))
  ours = sr.interop.from_nnx(deep(), theirs, rename=rename)
  np.testing.assert_array_equal(ours.layers.linear.bias.value[2], theirs.blocks[2].linear.bias[...])
  np.testing.assert_array_equal(ours.head.kernel.value, theirs.out.kernel[...])
  state = nnx.state(Renamed(nnx.Rngs(5)))
  written = sr.interop.to_nnx(ours, state, rename=rename)
  got = {p: np.array(v) for p, v in nnx.to_flat_state(written)}
  for path, value in nnx_arrays(theirs).items():
    np.testing.assert_array_equal(got[path], value)


def test_a_stack_under_vmap_takes_a_list_too():
  stack = sr.vmap(sr.nn.Linear, axis_size=N)(D, 2, rngs=sr.Rngs(0))
  theirs = nnx.List([nnx.Linear(D, 2, rngs=nnx.Rngs(i)) for i in range(N)])
  sr.interop.from_nnx(stack, nnx.state(theirs))
  for i in range(N):
    close(stack.layer(i)(X), theirs[i](X))


# -- linen: `layers_i` lists and `Dense_i` automatic names -----------------------------


class LinenSetupList(nn.Module):
  """linen's setup names a list of submodules `layers_0` … `layers_{N-1}`."""

  def setup(self):
    self.layers = [LinenBlock() for _ in range(N)]
    self.head = nn.Dense(1)

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.head(x)


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm")(nn.Dense(D, name="linear")(x))
    return x + jnp.tanh(h)


class LinenCompact(nn.Module):
  """Automatic names: LinenBlock_0 … LinenBlock_{N-1}, Dense_0."""

  @nn.compact
  def __call__(self, x):
    for _ in range(N):
      x = LinenBlock()(x)
    return nn.Dense(1)(x)


def test_linen_setup_list_loads_into_our_stack_and_back():
  variables = LinenSetupList().init(jax.random.key(2), X)
  assert set(variables["params"]) == {f"layers_{i}" for i in range(N)} | {"head"}
  ours = sr.interop.from_linen(deep(), variables)
  close(ours(X), LinenSetupList().apply(variables, X))
  back = sr.interop.to_linen(ours, unstack=True)
  jax.tree.map(np.testing.assert_array_equal, back, variables)


def test_linen_automatic_names_by_rename():
  variables = LinenCompact().init(jax.random.key(3), X)
  rename = {r"^LinenBlock_(\d+)\.": r"layers.\1.", r"^Dense_0\.": "head."}
  ours = sr.interop.from_linen(deep(), variables, rename=rename)
  close(ours(X), LinenCompact().apply(variables, X))
  back = sr.interop.to_linen(
    ours, unstack=True, rename={r"^layers\.(\d+)\.": r"LinenBlock_\1.", r"^head\.": "Dense_0."}
  )
  jax.tree.map(np.testing.assert_array_equal, back, variables)
  close(LinenCompact().apply(back, X), ours(X))


def test_linen_rename_takes_a_callable():
  variables = LinenCompact().init(jax.random.key(3), X)

  def rename(name):
    scope, _, rest = name.partition(".")
    if scope == "Dense_0":
      return "head." + rest
    return f"layers_{scope.rpartition('_')[2]}.{rest}"  # linen's own list name works too

  ours = sr.interop.from_linen(deep(), variables, rename=rename)
  close(ours(X), LinenCompact().apply(variables, X))


# -- state dicts: safetensors files in PyTorch's layout -------------------------------

V, C = 7, 3  # vocabulary, classes


class TorchLike(sr.Module):
  """Embedding -> Conv1d -> N x (Linear, LayerNorm) -> BatchNorm -> Linear."""

  def __init__(self, rngs):
    self.embed = sr.nn.Embed(V, D, rngs=rngs)
    self.conv = sr.nn.Conv(D, D, kernel_size=(3,), rngs=rngs)
    self.layers = STACK(D, rngs=rngs)
    self.bn = sr.nn.BatchNorm(D, use_running_average=True, rngs=rngs)
    self.head = sr.nn.Linear(D, C, rngs=rngs)

  def __call__(self, ids):
    x = self.conv(self.embed(ids))
    x, _ = self.layers(x)
    return self.head(self.bn(x))


def torch_state_dict(seed=0) -> dict:
  """What `torch.save(model.state_dict())` holds for TorchLike, prefixed `model.`."""
  rng = np.random.default_rng(seed)

  def a(*shape):
    return rng.standard_normal(shape).astype(np.float32)

  flat = {
    "model.embed.weight": a(V, D),
    "model.conv.weight": a(D, D, 3),
    "model.conv.bias": a(D),
    "model.bn.weight": a(D),
    "model.bn.bias": a(D),
    "model.bn.running_mean": a(D),
    "model.bn.running_var": np.abs(a(D)) + 0.5,
    "model.bn.num_batches_tracked": np.array(10, np.int64),
    "model.head.weight": a(C, D),
    "model.head.bias": a(C),
  }
  for i in range(N):
    flat |= {
      f"model.layers.{i}.linear.weight": a(D, D),
      f"model.layers.{i}.linear.bias": a(D),
      f"model.layers.{i}.norm.weight": a(D),
      f"model.layers.{i}.norm.bias": a(D),
    }
  return flat


def torch_reference(flat: dict, ids: np.ndarray) -> np.ndarray:
  """TorchLike's forward pass computed in numpy from PyTorch-layout weights."""
  w = {k.removeprefix("model."): v.astype(np.float64) for k, v in flat.items()}
  x = w["embed.weight"][ids]  # (B, T, D)
  padded = np.pad(x, ((0, 0), (1, 1), (0, 0)))  # 'SAME' for a window of 3
  x = (
    sum(
      np.einsum("bti,oi->bto", padded[:, k : k + x.shape[1]], w["conv.weight"][:, :, k])
      for k in range(3)
    )
    + w["conv.bias"]
  )

  def layer_norm(x, weight, bias, eps=1e-6):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias

  for i in range(N):
    h = x @ w[f"layers.{i}.linear.weight"].T + w[f"layers.{i}.linear.bias"]
    x = x + np.tanh(layer_norm(h, w[f"layers.{i}.norm.weight"], w[f"layers.{i}.norm.bias"]))
  x = (x - w["bn.running_mean"]) / np.sqrt(w["bn.running_var"] + 1e-5) * w["bn.weight"] + w[
    "bn.bias"
  ]
  return x @ w["head.weight"].T + w["head.bias"]


@functools.cache
def _torch_like():
  return TorchLike(sr.Rngs(0))


def torch_like():
  return sr.clone(_torch_like())


def drop_counter(name):
  """`model.x` -> `x`; PyTorch's BatchNorm step counter has no place in ours."""
  return None if name.endswith("num_batches_tracked") else name.removeprefix("model.")


def test_safetensors_file_in_torch_layout_gives_torch_outputs(tmp_path):
  flat = torch_state_dict()
  path = str(tmp_path / "model.safetensors")
  safetensors.numpy.save_file(flat, path)
  ours = sr.interop.from_state_dict(
    torch_like(), safetensors.numpy.load_file(path), rename=drop_counter, layout="torch"
  )
  ids = np.array([[1, 2, 3, 4, 5], [6, 0, 1, 2, 3]])
  close(ours(ids), torch_reference(flat, ids))
  np.testing.assert_array_equal(ours.head.kernel.value, flat["model.head.weight"].T)
  np.testing.assert_array_equal(
    ours.conv.kernel.value, flat["model.conv.weight"].transpose(2, 1, 0)
  )
  np.testing.assert_array_equal(
    ours.layers.linear.kernel.value[1], flat["model.layers.1.linear.weight"].T
  )
  # and back: the same names and layouts, a file safetensors writes
  back = sr.interop.to_state_dict(ours, layout="torch", rename={r"^": "model."})
  expected = {k: v for k, v in flat.items() if not k.endswith("num_batches_tracked")}
  assert back.keys() == expected.keys()
  for name, value in expected.items():
    np.testing.assert_array_equal(back[name], value)
  safetensors.numpy.save_file(back, str(tmp_path / "back.safetensors"))
  again = safetensors.numpy.load_file(str(tmp_path / "back.safetensors"))
  np.testing.assert_array_equal(again["model.conv.weight"], flat["model.conv.weight"])


def test_jax_layout_round_trips_stacked_or_unstacked(tmp_path):
  ours = torch_like()
  stacked = sr.interop.to_state_dict(ours)
  assert stacked["layers.linear.kernel"].shape == (N, D, D)
  assert "embed.embedding" in stacked and "bn.mean" in stacked
  listed = sr.interop.to_state_dict(ours, unstack=True)
  np.testing.assert_array_equal(listed["layers.2.norm.scale"], stacked["layers.norm.scale"][2])
  path = str(tmp_path / "jax.safetensors")
  safetensors.numpy.save_file(listed, path)
  other = TorchLike(sr.Rngs(1))
  sr.interop.from_state_dict(other, safetensors.numpy.load_file(path))
  assert_trees = snapshot(other)
  for p, value in snapshot(ours).items():
    np.testing.assert_array_equal(assert_trees[p], value)
  # a torch-layout stacked array (layer axis first) loads too
  torch_stacked = sr.interop.to_state_dict(ours, layout="torch", unstack=False)
  assert torch_stacked["layers.linear.weight"].shape == (N, D, D)
  np.testing.assert_array_equal(
    torch_stacked["layers.linear.weight"][1], stacked["layers.linear.kernel"][1].T
  )
  sr.interop.from_state_dict(other, torch_stacked, layout="torch")
  np.testing.assert_array_equal(other.layers.linear.kernel.value, ours.layers.linear.kernel.value)


# -- errors: every failing path named with the nearest names, nothing written ---------


def test_missing_and_unused_names_the_nearest():
  ours = torch_like()
  flat = {drop_counter(k): v for k, v in torch_state_dict().items() if drop_counter(k)}
  flat["head.wieght"] = flat.pop("head.weight")
  before = snapshot(ours)
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_state_dict(ours, flat, layout="torch")
  message = str(info.value)
  assert message.startswith("sr.interop.from_state_dict: 2 variables do not map:\n")
  assert (
    "`head.kernel` (Param): the state dict has no `head.kernel` or `head.weight`. "
    "Nearest unused: state dict `head.wieght`."
  ) in message
  assert (
    "state dict `head.wieght` (float32[3, 4]) matches no variable of ours. "
    "Nearest of ours still unfilled: `head.weight`"
  ) in message
  assert "Fix: name the state dict's entries after our paths" in message
  assert "Nothing was written: the model is unchanged." in message
  assert_unchanged(ours, before)


def test_rename_mapping_two_names_onto_one_is_listed():
  ours = torch_like()
  flat = {drop_counter(k): v for k, v in torch_state_dict().items() if drop_counter(k)}
  flat["ema.head.bias"] = flat["head.bias"]
  before = snapshot(ours)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`head\.bias` \(Param\): 2 state dict entries map onto it: "
    r"state dict `head\.bias`, state dict `ema\.head\.bias` "
    r"\(renamed `head\.bias`\)\.\nFix: make `rename` map each "
    r"source name",
  ):
    sr.interop.from_state_dict(ours, flat, layout="torch", rename={r"^ema\.": ""})
  assert_unchanged(ours, before)


def test_list_of_layers_with_a_gap():
  ours = deep()
  state = {
    k: v
    for k, v in sr.interop.to_state_dict(ours, unstack=True).items()
    if not k.startswith("layers.1.")
  }
  before = snapshot(ours)
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_state_dict(ours, state)
  message = str(info.value)
  assert (
    "`layers.linear.kernel` (Param) (3 layers on axis 0) is given as a list of "
    "layers with gaps: layer(s) 0, 2 given, not 1 (layer 0: state dict "
    "`layers.0.linear.kernel`)."
  ) in message
  assert "Fix: a list of layers fills a stack only completely" in message
  assert_unchanged(ours, before)


def test_more_nnx_layers_than_ours_and_to_nnx_leaves_the_target_unchanged():
  ours = deep()
  theirs = NnxDeep(nnx.Rngs(0), n=N + 1)
  before, theirs_before = snapshot(ours), nnx_arrays(theirs)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"nnx `layers\[3\]\.linear\.kernel` \(Param, float32\[4, 4\]\) "
    r"matches no variable of ours\.",
  ):
    sr.interop.from_nnx(ours, theirs)
  assert_unchanged(ours, before)
  fewer = NnxDeep(nnx.Rngs(0), n=N - 1)
  fewer_before = nnx_arrays(fewer)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"layer\(s\) 0-1 given, not 2 .*\n(.|\n)*the nnx target is "
    r"unchanged",
  ):
    sr.interop.to_nnx(ours, fewer)
  for path, value in fewer_before.items():
    np.testing.assert_array_equal(nnx_arrays(fewer)[path], value)
  assert nnx_arrays(theirs).keys() == theirs_before.keys()


def test_whole_and_per_layer_at_once():
  ours = deep()
  flat = sr.interop.to_state_dict(ours, unstack=True)
  flat["layers.linear.bias"] = np.zeros((N, D), np.float32)
  before = snapshot(ours)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`layers\.linear\.bias` \(Param\): given both whole "
    r"\(state dict `layers\.linear\.bias`\) and as a list of layers "
    r"\(state dict `layers\.0\.linear\.bias`, …\)\.\nFix: give a "
    r"stacked variable either whole or as a list of layers",
  ):
    sr.interop.from_state_dict(ours, flat)
  assert_unchanged(ours, before)


def test_torch_shapes_are_checked_after_the_transposition():
  ours = torch_like()
  flat = {drop_counter(k): v for k, v in torch_state_dict().items() if drop_counter(k)}
  flat["head.weight"] = flat["head.weight"].T  # given in our layout by mistake
  flat["layers.1.linear.bias"] = flat["layers.1.linear.bias"].astype(np.float16)
  before = snapshot(ours)
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_state_dict(ours, flat, layout="torch")
  message = str(info.value)
  assert (
    "`head.kernel` (Param): shape mismatch: ours is (4, 3), in PyTorch's layout "
    "(3, 4), state dict `head.weight` is (4, 3)."
  ) in message
  assert (
    "`layers.linear.bias` (Param) layer 1: dtype mismatch: ours is float32, state "
    "dict `layers.1.linear.bias` is float16."
  ) in message
  assert "pass layout='torch'" in message and "no silent casts" in message
  assert_unchanged(ours, before)


def test_linen_per_layer_shape_and_renamed_missing():
  ours = deep()
  variables = LinenCompact().init(jax.random.key(3), X)
  variables["params"]["LinenBlock_2"]["linear"]["bias"] = jnp.zeros((D + 1,))
  before = snapshot(ours)
  with pytest.raises(sr.StateMismatchError) as info:
    sr.interop.from_linen(
      ours, variables, rename={r"^LinenBlock_(\d+)\.": r"layers.\1.", r"^Dense_0\.": "hed."}
    )
  message = str(info.value)
  assert (
    "`layers.linear.bias` (Param) layer 2: shape mismatch: ours is (4,) per layer, "
    "linen `params/LinenBlock_2/linear/bias` (renamed `layers.2.linear.bias`) is "
    "(5,)."
  ) in message
  assert (
    "`head.bias` (Param): no linen `params` entry is renamed to `head.bias`. "
    "Nearest unused: linen `params/Dense_0/bias` (renamed `hed.bias`)."
  ) in message
  assert (
    "linen `params/Dense_0/kernel` (float32[4, 1]), renamed `hed.kernel`, matches "
    "no variable of ours. Nearest of ours still unfilled: `head.kernel`"
  ) in message
  assert_unchanged(ours, before)


def test_made_names_that_collide():
  ours = deep()
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`layers\.linear\.bias` \(Param\) and `layers\.linear\.kernel` "
    r"\(Param\) both become state dict entry `layers\.linear\.w`\."
    r"(.|\n)*no state dict was returned",
  ):
    sr.interop.to_state_dict(ours, rename={r"\.(kernel|bias)$": ".w"})
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`head\.kernel` \(Param\) becomes linen `head\.kernel`, below "
    r"`layers\.linear\.kernel` \(Param\), which becomes `head`",
  ):
    sr.interop.to_linen(ours, rename=lambda n: "head" if n == "layers.linear.kernel" else n)


def test_bad_rename_layout_and_state_dict():
  ours = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  flat = sr.interop.to_state_dict(ours)
  before = snapshot(ours)
  with pytest.raises(
    ValueError,
    match=r"rename= pattern '\(' is not a valid regular "
    r"expression",
  ):
    sr.interop.from_state_dict(ours, flat, rename={"(": ""})
  with pytest.raises(
    TypeError,
    match=r"rename\('kernel'\) returned 3; it must return our "
    r"name as a dot-joined string",
  ):
    sr.interop.from_state_dict(ours, flat, rename=lambda n: 3 if n == "kernel" else n)
  with pytest.raises(TypeError, match=r"rename= takes a callable .* got list"):
    sr.interop.from_nnx(ours, nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0))), rename=[])
  with pytest.raises(ValueError, match=r"layout= is 'jax' .* or 'torch' .*, got 'pt'"):
    sr.interop.from_state_dict(ours, flat, layout="pt")
  with pytest.raises(
    TypeError,
    match=r"takes a flat mapping of dot-joined names to "
    r"arrays.*got dict with keys that are not strings",
  ):
    sr.interop.from_state_dict(ours, {("kernel",): flat["kernel"]})
  assert_unchanged(ours, before)


def test_one_layer_in_another_collection():
  ours = deep()
  theirs = NnxDeep(nnx.Rngs(0))
  theirs.layers[1].linear.bias = nnx.BatchStat(theirs.layers[1].linear.bias[...])
  before = snapshot(ours)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"^sr\.interop\.from_nnx: `layers\.linear\.bias` \(Param\) "
    r"belongs to collection `params`, but nnx has a BatchStat there "
    r"\(collection `batch_stats`\)\.\nFix: use the same variable "
    r"kinds on both sides",
  ):
    sr.interop.from_nnx(ours, theirs)
  assert_unchanged(ours, before)
