"""Habits of flax.nnx code that port as they are: `self.sow` / `sr.pop`, `rngs()`,
`sr.iter_graph`, `sr.Sequential`, and an AttributeError that names our spelling of a
name nnx has (`sr.tabulate` -> sr.summary). Each compared with nnx itself where nnx has
the same thing."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import statefulremat as sr


def close(a, b, tol=1e-6):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def nnx_quietly(fn, *args):
  # nnx 0.12.8 deprecates sow outside nnx.capture, but it is the habit being ported.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return fn(*args)


# -- sow / pop -----------------------------------------------------------------------------


class SrNet(sr.Module):
  def __init__(self, rngs):
    self.linear1 = sr.nn.Linear(2, 3, rngs=rngs)
    self.linear2 = sr.nn.Linear(3, 4, rngs=rngs)

  def __call__(self, x):
    h = self.linear1(x)
    self.sow(sr.Intermediate, "features", h)
    self.sow(
      sr.Intermediate, "total", h.sum(), init_fn=lambda: 0.0, reduce_fn=lambda old, new: old + new
    )
    return self.linear2(h)


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.linear1 = nnx.Linear(2, 3, rngs=rngs)
    self.linear2 = nnx.Linear(3, 4, rngs=rngs)

  def __call__(self, x):
    h = self.linear1(x)
    self.sow(nnx.Intermediate, "features", h)
    self.sow(
      nnx.Intermediate, "total", h.sum(), init_fn=lambda: 0.0, reduce_fn=lambda old, new: old + new
    )
    return self.linear2(h)


def twins():
  theirs = NnxNet(nnx.Rngs(0))
  ours = SrNet(sr.Rngs(1))
  sr.interop.from_nnx(ours, theirs)
  return ours, theirs


def test_sow_then_pop_gives_nnx_values_and_restores_the_structure():
  ours, theirs = twins()
  before = sr.graphdef(ours)
  x1, x2 = jnp.ones((1, 2)), jnp.arange(2.0).reshape(1, 2)
  for x in (x1, x2):
    close(ours(x), nnx_quietly(theirs, x))
  assert type(ours.features) is sr.Intermediate and len(ours.features.value) == 2
  got = sr.pop(ours, sr.Intermediate)
  want = nnx.pop(theirs, nnx.Intermediate)
  assert sorted(got.flat()) == [(k,) for k in sorted(want.keys())] == [("features",), ("total",)]
  assert len(got["features"]) == len(want["features"].get_value()) == 2
  for a, b in zip(got["features"], want["features"].get_value()):
    close(a, b)
  close(got["total"], want["total"].get_value())
  assert not hasattr(ours, "features") and not hasattr(ours, "total")
  assert sr.graphdef(ours) == before
  assert len(sr.pop(ours, sr.Intermediate)) == 0  # nothing sown since


def test_sow_takes_a_collection_name_and_pop_takes_several_filters():
  class Two(sr.Module):
    def __init__(self):
      self.w = sr.Param(jnp.ones(2))

    def __call__(self, x):
      assert self.sow("intermediates", "h", x * self.w) is True
      self.sow(sr.Cache, "seen", x)
      return x

  model = Two()
  model(jnp.ones(2))
  assert type(model.h) is sr.Intermediate
  inter, cache = sr.pop(model, sr.Intermediate, sr.Cache)
  assert list(inter.flat()) == [("h",)] and list(cache.flat()) == [("seen",)]
  assert list(sr.state(model).flat()) == [("w",)]


def test_sow_over_another_kind_names_the_path_and_changes_nothing():
  class Bad(sr.Module):
    def __init__(self):
      self.inner = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))

    def __call__(self, x):
      self.inner.sow(sr.Intermediate, "kernel", x)

  model = Bad()
  kernel = model.inner.kernel
  value = kernel.value
  with pytest.raises(
    sr.GraphError,
    match=r"sow\(Intermediate, 'kernel', \.\.\.\): "
    r"`inner\.kernel` is a Param, not of kind Intermediate.*nothing was "
    r"changed.*Fix: sow under another name, or with the kind it holds: "
    r"`self\.sow\(Param, 'kernel', value\)`",
  ):
    model(jnp.ones(2))
  assert model.inner.kernel is kernel and model.inner.kernel.value is value

  with pytest.raises(
    sr.GraphError,
    match=r"`inner\.in_features` is a plain int attribute"
    r".*Fix: sow under another name",
  ):
    model.inner.sow(sr.Intermediate, "in_features", 1.0)
  assert model.inner.in_features == 2
  with pytest.raises(
    sr.GraphError,
    match=r"sow: `inner\.train` names a function of the "
    r"class Linear; a sown value needs a name of its own",
  ):
    model.inner.sow(sr.Intermediate, "train", 1.0)
  assert "train" not in vars(model.inner)


def test_sow_with_an_unknown_collection_name_says_how_to_make_one():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  with pytest.raises(
    sr.GraphError,
    match=r"no Variable kind has the collection 'probes'\. "
    r"Fix: pass the kind itself.*class MyKind\(sr\.Variable\): "
    r"collection = 'probes'",
  ):
    model.sow("probes", "x", jnp.ones(2))
  assert not hasattr(model, "x")


def test_pop_takes_a_shared_variable_out_of_every_path():
  class Net(sr.Module):
    def __init__(self):
      self.a = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
      self.b = sr.nn.Linear(2, 2, rngs=sr.Rngs(1))
      self.a.sow(sr.Intermediate, "h", jnp.ones(2))
      self.b.h = self.a.h
      self.heads = {"x": sr.Intermediate(jnp.zeros(1))}

  net = Net()
  popped = sr.pop(net, sr.Intermediate)
  assert sorted(popped.flat()) == [("a", "h"), ("heads", "x")]
  assert not hasattr(net.a, "h") and not hasattr(net.b, "h") and net.heads == {}


def test_pop_refuses_a_variable_in_a_list_and_removes_nothing():
  class Net(sr.Module):
    def __init__(self):
      self.probes = [sr.Intermediate(jnp.zeros(1))]
      self.h = sr.Intermediate(jnp.ones(1))

  net = Net()
  with pytest.raises(
    sr.GraphError,
    match=r"sr\.pop: `probes\[0\]` \(Intermediate\) sits "
    r"in a ModuleList.*nothing was removed.*Fix: keep such Variables as "
    r"module attributes or in a dict",
  ):
    sr.pop(net, sr.Intermediate)
  assert len(net.probes) == 1 and type(net.h) is sr.Intermediate
  with pytest.raises(TypeError, match=r"sr\.pop takes at least one filter"):
    sr.pop(net)


# -- rngs() --------------------------------------------------------------------------------


def test_calling_rngs_draws_from_the_default_stream_as_nnx():
  ours, theirs = sr.Rngs(0, dropout=1), nnx.Rngs(0, dropout=1)
  for _ in range(3):
    np.testing.assert_array_equal(jax.random.key_data(ours()), jax.random.key_data(theirs()))
  assert int(ours.default.count.value) == 3 and int(ours.dropout.count.value) == 0


def test_calling_rngs_without_a_default_stream_says_which_exist():
  rngs = sr.Rngs(params=0, dropout=1)
  with pytest.raises(
    AttributeError,
    match=r"rngs\(\) draws from the default stream, but "
    r"this Rngs has none \(it has \['params', 'dropout'\]\)\. Fix: draw "
    r"from a named stream, e\.g\. `rngs\.params\(\)`, or give a default "
    r"seed: `sr\.Rngs\(0, params=\.\.\.\)`",
  ):
    rngs()
  assert int(rngs.params.count.value) == 0


# -- iter_graph ----------------------------------------------------------------------------


class SrLeaf(sr.Module):
  def __init__(self, v):
    self.w = sr.Param(jnp.full((2,), v))
    self.size = 2
    self.name = "leaf"


class NnxLeaf(nnx.Module, pytree=False):
  def __init__(self, v):
    self.w = nnx.Param(jnp.full((2,), v))
    self.size = 2
    self.name = "leaf"


def build(module, leaf, param, batchstat):
  root = module()
  first = leaf(0.0)
  root.layers = [first, leaf(1.0)]
  root.heads = {"b": leaf(2.0), "a": first}  # shared module, dict keys unsorted
  root.stat = batchstat(jnp.zeros(3))
  root.tied = root.stat  # shared Variable
  root.config = (4, None)
  root.act = "relu"
  return root


def kind(value):
  if isinstance(value, (sr.Variable, nnx.Variable)):
    return type(value).__name__
  if isinstance(value, (sr.Module, nnx.Module)):
    return type(value).__name__.removeprefix("Sr").removeprefix("Nnx")
  for container in (dict, list, tuple):
    if isinstance(value, container):
      return container.__name__
  return repr(value)


def test_iter_graph_matches_nnx_paths_order_and_kinds():
  class SrRoot(sr.Module):
    pass

  class NnxRoot(nnx.Module, pytree=False):
    pass

  ours = build(SrRoot, SrLeaf, sr.Param, sr.BatchStat)
  theirs = build(NnxRoot, NnxLeaf, nnx.Param, nnx.BatchStat)
  got = [(path, kind(v)) for path, v in sr.iter_graph(ours)]
  want = [
    (path, kind(v))
    for path, v in nnx.iter_graph(theirs)
    if not any(isinstance(k, str) and k.startswith("_pytree__") for k in path)
  ]
  assert got == want
  # The shared module first comes at heads.a (sorted), and not again at layers[0].
  assert got[-1] == ((), "Root") and ((("layers", 0), "Leaf") not in got)


def test_iter_graph_yields_the_same_modules_and_variables_as_nnx_for_layers():
  ours = sr.Sequential(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)), sr.nn.Linear(3, 1, rngs=sr.Rngs(1)))
  theirs = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 1, rngs=nnx.Rngs(1)))

  def nodes(pairs):
    return [
      (path, type(v).__name__)
      for path, v in pairs
      if isinstance(v, (sr.Module, sr.Variable, nnx.Module, nnx.Variable))
      and type(v).__name__ != "List"
    ]

  assert nodes(sr.iter_graph(ours)) == nodes(nnx.iter_graph(theirs))


# -- Sequential ----------------------------------------------------------------------------


def sequential_twins():
  theirs = nnx.Sequential(
    nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(1))
  )
  ours = sr.Sequential(
    sr.nn.Linear(3, 8, rngs=sr.Rngs(5)), jax.nn.relu, sr.nn.Linear(8, 2, rngs=sr.Rngs(6))
  )
  sr.interop.from_nnx(ours, theirs)
  return ours, theirs


def test_sequential_matches_nnx_outputs_and_gradients():
  ours, theirs = sequential_twins()
  assert sorted(sr.state(ours).flat()) == [
    ("layers", 0, "bias"),
    ("layers", 0, "kernel"),
    ("layers", 2, "bias"),
    ("layers", 2, "kernel"),
  ]
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)
  # Compiled, one program each: eagerly every op of a gradient compiles on its own.
  close(sr.jit(lambda m, x: m(x))(ours, x), nnx.jit(lambda m, x: m(x))(theirs, x))

  loss = lambda m, x: (m(x) ** 2).sum()  # noqa: E731
  grads = sr.jit(sr.grad(loss))(ours, x)
  want = nnx.jit(nnx.grad(loss))(theirs, x)
  for i in (0, 2):
    for name in ("kernel", "bias"):
      close(grads["layers"][i][name], want["layers"][i][name][...], tol=1e-5)


def test_sequential_threads_tuples_dicts_and_rngs_as_nnx():
  def split(x):
    return x, 2 * x

  def as_dict(a, b):
    return {"a": a, "b": b}

  def add(*, a, b):
    return a + b

  x = jnp.arange(4.0)
  assert (
    float(sr.Sequential(split, as_dict, add)(x).sum())
    == float(nnx.Sequential(split, as_dict, add)(x).sum())
    == 18.0
  )
  assert sr.Sequential()(x) is x and sr.Sequential()() is None
  assert sr.Sequential()(1, 2) == (1, 2) and sr.Sequential()(a=1) == {"a": 1}

  ours = sr.Sequential(sr.nn.Dropout(0.5), jax.nn.relu)
  theirs = nnx.Sequential(nnx.Dropout(0.5), nnx.relu)
  y = ours(jnp.ones(64), rngs=sr.Rngs(dropout=3))
  np.testing.assert_array_equal(y, theirs(jnp.ones(64), rngs=nnx.Rngs(dropout=3)))
  assert 0 < int((y == 0).sum()) < 64


def test_sequential_refuses_what_cannot_be_called_and_names_the_bad_layer():
  with pytest.raises(
    TypeError,
    match=r"Sequential: layer 1 is a int \(3\), which cannot "
    r"be called\. Fix: pass modules or functions",
  ):
    sr.Sequential(jax.nn.relu, 3)
  ours, _ = sequential_twins()
  before = {k: np.asarray(v) for k, v in sr.state(ours).flat().items()}
  with pytest.raises(
    ValueError,
    match=r"At `layers\[0\]`: Linear was built with "
    r"in_features=3 .*expected shape \(4, 3\)",
  ):
    ours(jnp.ones((4, 5)))
  for k, v in sr.state(ours).flat().items():
    np.testing.assert_array_equal(v, before[k])


def test_sequential_is_a_module_under_jit_and_a_scanned_stack():
  ours, theirs = sequential_twins()
  x = jnp.ones((2, 3))
  close(sr.jit(lambda m, x: m(x))(ours, x), theirs(x))

  class Block(sr.Module):
    def __init__(self, *, rngs):
      self.seq = sr.Sequential(sr.nn.Linear(4, 4, rngs=rngs), jax.nn.tanh)

    def __call__(self, h):
      return self.seq(h)

  stack = sr.scan(Block, length=3, variable_axes={sr.Param: 0}, split_rngs={"params": True})(
    rngs=sr.Rngs(0)
  )
  h0 = jnp.ones((2, 4))
  out, _ = sr.scan(lambda block, h: (block(h), None), variable_axes={sr.Param: 0})(stack, h0)
  h = h0
  call = sr.jit(lambda m, h: m(h))  # compiled once for the three layers
  for layer in sr.unstack(stack):
    h = call(layer, h)
  close(out, h, tol=1e-5)
  assert stack.seq.layers[0].kernel.value.shape == (3, 4, 4)


def test_sequential_is_exported_from_sr_and_sr_nn():
  assert sr.Sequential is sr.nn.Sequential


# -- names nnx has that we spell differently ---------------------------------------------


@pytest.mark.parametrize(
  "name, fix",
  [
    ("tabulate", r"use sr\.summary"),
    ("StateAxes", r"variable_axes="),
    ("Carry", r"variable_carry="),
    ("split_rngs", r"split_rngs= on the transform"),
    ("Dict", r"sr\.ModuleDict"),
    ("List", r"sr\.ModuleList"),
    ("graph", r"sr\.split, sr\.merge"),
    ("TrainState", r"sr\.Optimizer"),
    ("Everything", r"use \.\.\."),
    ("capture", r"sr\.pop\(model, sr\.Intermediate\)"),
  ],
)
def test_an_nnx_name_spelled_differently_names_ours(name, fix):
  with pytest.raises(
    AttributeError,
    match=rf"module 'statefulremat' has no attribute "
    rf"'{name}' \(nnx\.{name}\): .*{fix}",
  ):
    getattr(sr, name)


@pytest.mark.parametrize("name", ["Linear", "BatchNorm", "Dropout"])
def test_an_nnx_layer_at_the_top_points_to_sr_nn(name):
  with pytest.raises(
    AttributeError,
    match=rf"'{name}': layers, activations and "
    rf"initializers live in sr\.nn, use sr\.nn\.{name}",
  ):
    getattr(sr, name)


@pytest.mark.parametrize(
  "name, fix",
  [
    ("Module", r"use sr\.Module"),
    ("Param", r"use sr\.Param"),
    ("tabulate", r"use sr\.summary"),
    ("Dense", r"use sr\.nn\.Linear"),
  ],
)
def test_a_top_level_name_under_sr_nn_points_to_it(name, fix):
  with pytest.raises(
    AttributeError,
    match=rf"module 'statefulremat\.nn' has no attribute "
    rf"'{name}': {fix}",
  ):
    getattr(sr.nn, name)


def test_names_we_share_with_nnx_are_ours_and_unknown_names_stay_plain():
  for name in (
    "Param",
    "Variable",
    "state",
    "display",
    "Optimizer",
    "BatchStat",
    "pop",
    "iter_graph",
    "Sequential",
    "Rngs",
    "split",
    "merge",
  ):
    assert getattr(sr, name) is not None
  for module, label in ((sr, "statefulremat"), (sr.nn, "statefulremat.nn")):
    for name in ("no_such_name", "__wrapped__", "_pytestfixturefunction", "__test__", "_private"):
      with pytest.raises(AttributeError) as info:
        getattr(module, name)
      assert str(info.value) == f"module {label!r} has no attribute {name!r}"
  assert hasattr(sr, "__version__") and not hasattr(sr, "__wrapped__")
  assert not hasattr(sr.nn, "__wrapped__")


# nnx's type variables, the submodules of its implementation and its internal contexts:
# ported model code does not name them, and they keep the plain AttributeError.
NNX_INTERNALS = {
  "A",
  "M",
  "OptArray",
  "OptVariable",
  "MergeContext",
  "SplitContext",
  "UpdateContext",
  "deprecations",
  "extract",
  "filterlib",
  "graphlib",
  "helpers",
  "module",
  "object",
  "prefix",
  "proxy_caller",
  "pytreelib",
  "reprlib",
  "rnglib",
  "statelib",
  "tracers",
  "traversals",
  "variablelib",
  "variables",
  "wrappers",
}


NNX_LAYERS = {
  "Bidirectional",
  "ConvTranspose",
  "Einsum",
  "GRUCell",
  "GroupNorm",
  "InstanceNorm",
  "LSTMCell",
  "LoRA",
  "LoRALinear",
  "LoRAParam",
  "OptimizedLSTMCell",
  "PReLU",
  "RNN",
  "RNNCellBase",
  "SimpleCell",
  "avg_pool",
  "max_pool",
  "min_pool",
  "pool",
  "initializers",
}


def test_every_public_nnx_name_is_ours_or_answered_or_internal():
  from statefulremat.nn._nnx_names import SPELLED_DIFFERENTLY

  unanswered = []
  for name in dir(nnx):
    if name.startswith("_") or hasattr(sr, name) or name in NNX_INTERNALS:
      continue
    with pytest.raises(AttributeError) as info:
      getattr(sr, name)
    if str(info.value) == f"module 'statefulremat' has no attribute {name!r}":
      unanswered.append(name)
  # nnx's layers answer through sr.nn; one that sr.nn lacks keeps the plain error.
  assert set(unanswered) <= NNX_LAYERS - set(vars(sr.nn)), unanswered
  assert not set(SPELLED_DIFFERENTLY) & set(dir(sr))  # the table names nothing we have


# -- rotary embeddings as nnx spells them (flax >= 0.12.10: nnx.RoPE) -------------------

ROPE_X = np.random.default_rng(0).standard_normal((2, 5, 3, 8), np.float32)  # [b, t, h, d]


@pytest.mark.parametrize(
  "options", [{}, {"embedding_size": 8, "max_seq_len": 16}, {"theta": 500000.0}]
)
def test_rope_module_is_sr_nn_rope_per_head_and_nnxs_where_nnx_has_it(options):
  ours = sr.nn.RoPE(**options)
  per_head = jax.vmap(ours, in_axes=-2, out_axes=-2)(ROPE_X)
  close(per_head, sr.nn.rope(ROPE_X, jnp.arange(5), base=ours.theta), 1e-5)
  positions = jnp.arange(5.0) + 3
  if hasattr(nnx, "RoPE"):  # flax 0.12.10 and later
    theirs = nnx.RoPE(**options)
    close(ours(ROPE_X[:, :, 0]), theirs(ROPE_X[:, :, 0]))
    close(ours(ROPE_X[:, :, 0], positions), theirs(ROPE_X[:, :, 0], positions))
  by_rope = sr.nn.rope(ROPE_X[:, :, :1], positions, base=ours.theta)[:, :, 0]
  close(ours(ROPE_X[:, :, 0], positions), by_rope, 1e-5)


def test_attention_with_rope_rotates_queries_and_keys_and_ports_from_nnx():
  import functools

  rope = sr.nn.RoPE(embedding_size=8, max_seq_len=16)
  out = sr.nn.dot_product_attention_with_rope(ROPE_X, ROPE_X, ROPE_X, rope=rope)
  rotated = sr.nn.rope(ROPE_X, jnp.arange(5))
  close(out, sr.nn.dot_product_attention(rotated, rotated, ROPE_X), 1e-5)
  ours = sr.nn.MultiHeadAttention(
    num_heads=3,
    in_features=24,
    decode=False,
    rngs=sr.Rngs(0),
    attention_fn=functools.partial(sr.nn.dot_product_attention_with_rope, rope=rope),
  )
  q = jax.random.normal(jax.random.key(1), (2, 5, 24))
  if hasattr(nnx, "dot_product_attention_with_rope"):  # flax 0.12.10 and later
    their_rope = nnx.RoPE(embedding_size=8, max_seq_len=16)
    theirs = nnx.MultiHeadAttention(
      num_heads=3,
      in_features=24,
      decode=False,
      rngs=nnx.Rngs(0),
      attention_fn=functools.partial(nnx.dot_product_attention_with_rope, rope=their_rope),
    )
    close(sr.interop.from_nnx(ours, theirs)(q), theirs(q), 1e-5)


@pytest.mark.parametrize(
  "options, match",
  [
    ({"embedding_size": 8}, r"embedding_size=8 and max_seq_len=None.*Fix: give both"),
    ({"embedding_size": 7, "max_seq_len": 4}, r"embedding_size=7.*positive and even"),
  ],
)
def test_rope_module_misuse_names_the_argument_and_the_fix(options, match):
  with pytest.raises(ValueError, match=match):
    sr.nn.RoPE(**options)
  with pytest.raises(ValueError, match=r"input_positions has 4 positions .* for a sequence of 5"):
    sr.nn.RoPE()(ROPE_X[:, :, 0], jnp.arange(4.0))
