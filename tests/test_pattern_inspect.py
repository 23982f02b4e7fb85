"""Looking at a stack of a repeating pattern as at a plain stack: ``sr.summary`` counts
its layers as the pattern does, treescope (``repr``, ``sr.display``, HTML) draws the
cycle once with each position labelled, ``sharding`` metadata gives every position the
layer axis name, and a checkpoint restores into another ``lengths``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import treescope
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import statefulremat as sr

D = 4
SCAN = dict(variable_axes={True: 0}, split_rngs={True: True})


def ones(key, shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


class Local(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, kernel_init=ones, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.linear(x))


class Global(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, kernel_init=ones, rngs=rngs)
    self.norm = sr.nn.LayerNorm(dim, rngs=rngs)

  def __call__(self, x):
    return self.norm(x - jnp.tanh(self.linear(x)))


def gemma_like(length=7):
  return sr.remat_scan((Local, Local, Global), length=length, lengths="auto")(D, rngs=sr.Rngs(0))


def values(module):
  return {
    path: np.asarray(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)
    for path, v in sr.state(module).flat().items()
  }


def assert_unchanged(module, before):
  after = values(module)
  assert after.keys() == before.keys()
  for path in before:
    np.testing.assert_array_equal(after[path], before[path])


# -- sr.summary -----------------------------------------------------------------------


def test_summary_counts_the_layers_as_the_pattern_does():
  stack = gemma_like()
  before = values(stack)
  table = sr.summary(stack, jnp.ones((2, D)))
  lines = str(table).splitlines()
  # Local: 20 params a layer, at layers 0, 3, 6 and 1, 4; Global: 28, at layers 2, 5.
  assert [(r.path_text, r.class_name, r.params_text()) for r in table.rows] == [
    ("(root)", "RematScan[Local, Local, Global]", "156 (7 layers)"),
    ("pattern[0]", "RematScan[Local]", "60 (3 × 20)"),
    ("pattern[0].linear", "Linear", "60 (3 × 20)"),
    ("pattern[1]", "RematScan[Local]", "40 (2 × 20)"),
    ("pattern[1].linear", "Linear", "40 (2 × 20)"),
    ("pattern[2]", "RematScan[Global]", "56 (2 × 28)"),
    ("pattern[2].linear", "Linear", "40 (2 × 20)"),
    ("pattern[2].norm", "LayerNorm", "16 (2 × 8)"),
  ]
  assert table.total_params == 156 and table.rows[0].outputs == ("float32[2,4]",)
  assert table.rows[0].layers == 7
  assert table.rows[0].pattern == "7 layers: (Local, Local, Global) × 2 + (Local)"
  # The cycle once: each position's stack with the layers of the whole it holds.
  start = lines.index(
    "(root): RematScan[Local, Local, Global], 7 layers: (Local, Local, Global) × 2 + (Local)"
  )
  assert lines[start : start + 4] == [
    "(root): RematScan[Local, Local, Global], 7 layers: (Local, Local, Global) × 2 + (Local)",
    "  pattern[0]  position 0 of 3: Local, 3 layers (0, 3, 6)",
    "  pattern[1]  position 1 of 3: Local, 2 layers (1, 4)",
    "  pattern[2]  position 2 of 3: Global, 2 layers (2, 5)",
  ]
  assert sum(line.startswith("  pattern[") for line in lines) == 3
  assert_unchanged(stack, before)


def test_summary_norms_number_each_positions_layers_as_the_stack_does():
  stack = gemma_like(length=26)
  table = sr.summary(stack)
  assert str(table).count("26 layers: (Local, Local, Global) × 8 + (Local, Local)") == 1
  by_path = {n.path_text: n for n in table.layer_norms}
  assert list(by_path) == ["pattern[0]", "pattern[1]", "pattern[2]"]
  norms = by_path["pattern[2]"]
  assert list(norms.stack_layers) == [2, 5, 8, 11, 14, 17, 20, 23]
  lines = norms.lines()
  assert lines[0] == (
    "pattern[2]: RematScan[Global], 8 layers (2, 5, …, 23 of the pattern "
    "stack), L2 norm of each layer's Params"
  )
  assert [line.split()[0] for line in lines[2:]] == [str(i) for i in range(2, 26, 3)]
  # Layer 5 of the stack is layer 1 of position 2: its norm, and its key, say so.
  layer = stack.layer(5)
  want = np.sqrt(
    sum(float(jnp.sum(jnp.square(v))) for v in jax.tree.leaves(sr.state(layer, sr.Param)))
  )
  np.testing.assert_allclose(norms.params[1], want, rtol=1e-5)
  np.testing.assert_allclose(
    table.norms()["params/norm/pattern.2.1.linear.kernel"], np.sqrt(16.0), rtol=1e-6
  )


# -- treescope, repr, sr.display --------------------------------------------------------


def test_repr_draws_the_cycle_once_with_each_position_labelled():
  stack = gemma_like()
  before = values(stack)
  text = repr(stack)
  lines = text.splitlines()
  assert lines[0] == (
    "RematScan[Local, Local, Global](  # 7 layers: (Local, Local, Global) × 2 + (Local)"
  )
  assert lines[1] == "  pattern=("
  labels = [line.strip() for line in lines if "# position" in line]
  assert labels == [
    "RematScan[Local] × 3(  # position 0 of 3: Local, 3 layers (0, 3, 6)",
    "RematScan[Local] × 2(  # position 1 of 3: Local, 2 layers (1, 4)",
    "RematScan[Global] × 2(  # position 2 of 3: Global, 2 layers (2, 5)",
  ]
  # Each position's arrays once, with its own layer count on the layer axis.
  assert text.count("kernel=Param(") == 3
  assert "float32(layers:3, 4, 4)" in text and "float32(layers:2, 4, 4)" in text
  # A position drawn alone keeps its label; an ordinary stack has none.
  assert repr(stack.pattern[2]).splitlines()[0] == (
    "RematScan[Global] × 2(  # position 2 of 3: Global, 2 layers (2, 5)"
  )
  plain = sr.remat_scan(Local, length=3, lengths=(3,))(D, rngs=sr.Rngs(0))
  assert "#" not in repr(plain).splitlines()[0]
  assert_unchanged(stack, before)


def test_display_and_html_label_the_positions(capsys):
  stack = gemma_like()
  sr.display(stack)
  shown = capsys.readouterr().out
  assert shown.startswith(
    "RematScan[Local, Local, Global](  # 7 layers: (Local, Local, Global) × 2 + (Local)\n"
  )
  assert shown.count("# position") == 3
  with treescope.active_autovisualizer.set_scoped(treescope.ArrayAutovisualizer()):
    html = treescope.render_to_html(stack, compressed=False)
  for label in [
    "7 layers: (Local, Local, Global) × 2 + (Local)",
    "position 0 of 3: Local, 3 layers (0, 3, 6)",
    "position 2 of 3: Global, 2 layers (2, 5)",
    '"label": "layers (axis 0): 3"',
    '"label": "layers (axis 0): 2"',
  ]:
    assert label in html, label


def test_an_edited_pattern_stack_says_what_it_holds():
  stack = gemma_like()
  stack.pattern = (stack.pattern[2], stack.pattern[0], stack.pattern[2])  # 2, 3, 2
  assert repr(stack).splitlines()[0] == (
    "RematScan[Local, Local, Global](  # 7 layers, not one pattern: its positions hold [2, 3, 2]"
  )


# -- sharding -------------------------------------------------------------------------


def named(*axes):
  return {"sharding": axes}


class Up(sr.Module):
  def __init__(self, d, *, rngs):
    self.up = sr.nn.Linear(
      d, 2 * d, kernel_metadata=named("embed", "mlp"), bias_metadata=named("mlp"), rngs=rngs
    )
    self.down = sr.nn.Linear(
      2 * d, d, kernel_metadata=named("mlp", "embed"), bias_metadata=named("embed"), rngs=rngs
    )

  def __call__(self, x):
    return x + self.down(jax.nn.relu(self.up(x)))


class Norm(sr.Module):
  def __init__(self, d, *, rngs):
    self.norm = sr.nn.LayerNorm(
      d, scale_metadata=named("embed"), bias_metadata=named("embed"), rngs=rngs
    )

  def __call__(self, x):
    return self.norm(x)


def test_every_position_gets_the_layer_axis_name_and_shards_as_a_plain_stack():
  Stack = sr.remat_scan(
    (Up, Up, Norm), length=8, lengths=(3,), metadata_params={"partition_name": "layers"}
  )
  stack = Stack(8, rngs=sr.Rngs(0))
  specs = sr.get_partition_spec(sr.split(stack)[1])
  assert specs.flat() == sr.get_partition_spec(stack).flat()
  for k in (0, 1):
    assert specs["pattern"][k]["up"]["kernel"] == P("layers", "embed", "mlp")
    assert specs["pattern"][k]["down"]["bias"] == P("layers", "embed")
  assert specs["pattern"][2]["norm"]["scale"] == P("layers", "embed")
  x = jnp.linspace(-1.0, 1.0, 4 * 8).reshape(4, 8)
  want = stack(x)
  # The layers are called with the name removed, as in a plain stack.
  assert stack.layer(4).up.kernel.sharding == ("embed", "mlp")

  assert len(jax.devices()) == 8, "tests/conftest.py should force 8 CPU devices"
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  rules = [("mlp", "model"), ("embed", None), ("layers", None)]
  assert sr.shard(stack, mesh, rules) is stack
  kernel = stack.pattern[1].up.kernel.value
  assert kernel.shape == (3, 8, 16)  # layers 1, 4, 7
  assert kernel.sharding == NamedSharding(mesh, P(None, None, "model"))
  np.testing.assert_allclose(sr.jit(lambda m, x: m(x))(stack, x), want, rtol=1e-5, atol=1e-6)


# -- checkpoints ----------------------------------------------------------------------


class Drop(sr.Module):
  """Keeps the Rngs: each layer's dropout key is part of what a checkpoint holds."""

  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.drop = sr.nn.Dropout(0.2, rngs=rngs)

  def __call__(self, x):
    return x + 0.5 * self.drop(jnp.tanh(self.linear(x)))


forward = sr.jit(lambda model, x: model(x))


def test_a_checkpoint_restores_into_other_lengths(tmp_path):
  x = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)
  stack = sr.remat_scan((Drop, Global), length=8, lengths=(2, 2))(D, rngs=sr.Rngs(0))
  forward(stack, x)  # move the RNG counts away from their start
  sr.save(tmp_path, stack)
  saved = values(stack)
  want = forward(stack, x)
  for lengths in [(4,), "auto"]:
    other = sr.remat_scan((Drop, Global), length=8, lengths=lengths)(D, rngs=sr.Rngs(7))
    assert not np.array_equal(
      other.pattern[0].linear.kernel.value, stack.pattern[0].linear.kernel.value
    )
    sr.restore(tmp_path, other)
    assert_unchanged(other, saved)
    np.testing.assert_array_equal(forward(other, x), want)
  # Another length is another set of arrays: refused, naming what differs.
  longer = sr.remat_scan((Drop, Global), length=10, lengths=(5,))(D, rngs=sr.Rngs(7))
  before = values(longer)
  with pytest.raises(
    sr.StateMismatchError,
    match=(
      r"`pattern\[0\]\.linear\.bias`: the checkpoint has a Param float32\[4,4\], the model "
      r"a Param float32\[5,4\]"
    ),
  ):
    sr.restore(tmp_path, longer)
  assert_unchanged(longer, before)
