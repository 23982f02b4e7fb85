"""sr.nn's recurrent cells, RNN and Bidirectional against flax.nnx's.

The cells' parameters map one to one by path (``sr.interop.from_nnx`` with no rename),
initialise equally from equal seeds, and give the same values, carries and gradients;
RNN scans them as nnx does (seq_lengths, reverse, keep_order, return_carry,
time_major) through sr.scan, also under sr.jit / sr.grad and inside a stack of layers.
Bad inputs get errors naming the layer's path and the fix, with the model unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import statefulremat as sr

CELLS = ["SimpleCell", "LSTMCell", "OptimizedLSTMCell", "GRUCell"]


def _nnx_flat(state):
  return {p: v[...] for p, v in nnx.to_flat_state(state)}


def _close(a, b, atol=1e-5):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5), a, b)


def _pair(name, in_features=3, hidden=4, **kwargs):
  """Our cell and nnx's, ours loaded from nnx's with no rename."""
  theirs = getattr(nnx, name)(in_features, hidden, rngs=nnx.Rngs(1), **kwargs)
  ours = getattr(sr.nn, name)(in_features, hidden, rngs=sr.Rngs(0), **kwargs)
  sr.interop.from_nnx(ours, theirs)
  return ours, theirs


def _params(module):
  return jax.tree.map(np.asarray, sr.state(module, sr.Param).flat())


@pytest.mark.parametrize("name", CELLS)
def test_cell_init_names_and_values_match_nnx(name):
  theirs = getattr(nnx, name)(3, 4, rngs=nnx.Rngs(0))
  ours = getattr(sr.nn, name)(3, 4, rngs=sr.Rngs(0))
  mine, their = sr.state(ours, sr.Param).flat(), _nnx_flat(nnx.state(theirs, nnx.Param))
  assert mine.keys() == their.keys()
  _close(mine, their, atol=0)
  assert ours.num_feature_axes == theirs.num_feature_axes == 1


@pytest.mark.parametrize("name", CELLS)
def test_cell_step_values_and_grads_match_nnx(name):
  ours, theirs = _pair(name)
  x = jax.random.normal(jax.random.key(0), (2, 3))
  carry = jax.tree.map(lambda c: c + 0.3, theirs.initialize_carry((2, 3), nnx.Rngs(0)))
  _close(ours.initialize_carry((2, 3)), theirs.initialize_carry((2, 3), nnx.Rngs(0)), atol=0)
  # Compiled, one program each: eagerly every op of a gradient compiles on its own.
  step = lambda m, carry, x: m(carry, x)  # noqa: E731
  _close(sr.jit(step)(ours, carry, x), nnx.jit(step)(theirs, carry, x))

  def loss(cell, carry, x):
    new, y = cell(carry, x)
    return (y**2).sum() + sum(jnp.sin(c).sum() for c in jax.tree.leaves(new))

  grads = sr.jit(sr.grad(loss))(ours, carry, x)
  their_grads = nnx.jit(nnx.grad(loss))(theirs, carry, x)
  _close(grads.flat(), _nnx_flat(their_grads))
  _close(
    jax.jit(jax.grad(lambda x: loss(ours, carry, x)))(x),
    jax.jit(jax.grad(lambda x: loss(theirs, carry, x)))(x),
  )


RAGGED = {"return_carry": True, "reverse": True, "keep_order": True, "seq_lengths": True}


# Every cell plain and with everything at once; each option alone with one cell.
@pytest.mark.parametrize(
  "name, options",
  [(name, {}) for name in CELLS]
  + [(name, RAGGED) for name in CELLS]
  + [
    ("LSTMCell", {"return_carry": True, "time_major": True}),
    ("GRUCell", {"return_carry": True, "seq_lengths": True}),
    ("SimpleCell", {"return_carry": True, "reverse": True}),
    ("OptimizedLSTMCell", {"reverse": True, "keep_order": True}),
    ("GRUCell", {"return_carry": True, "time_major": True, "reverse": True, "seq_lengths": True}),
  ],
  ids=[f"plain-{n}" for n in CELLS]
  + [f"ragged_reverse_keep_order-{n}" for n in CELLS]
  + ["time_major", "ragged", "reverse", "reverse_keep_order", "time_major_ragged"],
)
def test_rnn_values_carries_and_grads_match_nnx(name, options):
  ours, theirs = _pair(name)
  options = dict(options)
  time_major = options.get("time_major", False)
  x = jax.random.normal(jax.random.key(1), (6, 2, 3) if time_major else (2, 6, 3))
  if options.pop("seq_lengths", False):
    options["seq_lengths"] = jnp.array([6, 3])
  rnn, their_rnn = sr.nn.RNN(ours), nnx.RNN(theirs)
  # Compiled, one program each: eagerly every op of the scan and its gradient compiles.
  call = lambda m, x: m(x, **options)  # noqa: E731
  _close(sr.jit(call)(rnn, x), nnx.jit(call)(their_rnn, x))

  def loss(model, x):
    out = model(x, **{**options, "return_carry": True})
    return sum(jnp.sum(jnp.tanh(a) * (i + 1)) for i, a in enumerate(jax.tree.leaves(out)))

  _close(sr.jit(sr.grad(loss))(rnn, x).flat(), _nnx_flat(nnx.jit(nnx.grad(loss))(their_rnn, x)))


def test_rnn_initial_carry_unroll_and_dtypes_match_nnx():
  ours, theirs = _pair("LSTMCell", dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(2), (2, 5, 3))
  carry = (jnp.full((2, 4), 0.5, jnp.float32), jnp.full((2, 4), -0.5, jnp.float32))
  call = lambda m, x, carry: m(x, initial_carry=carry, return_carry=True)  # noqa: E731
  got = sr.jit(call)(sr.nn.RNN(ours, unroll=2), x, carry)
  want = nnx.jit(call)(nnx.RNN(theirs, unroll=2), x, carry)
  assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(lambda a: a.dtype, want)
  _close(got, want, atol=1e-2)
  assert ours.ii.kernel.dtype == jnp.float32


def test_bidirectional_matches_nnx():
  f_ours, f_theirs = _pair("GRUCell")
  b_ours, b_theirs = _pair("OptimizedLSTMCell")
  ours = sr.nn.Bidirectional(sr.nn.RNN(f_ours), sr.nn.RNN(b_ours), return_carry=True)
  theirs = nnx.Bidirectional(nnx.RNN(f_theirs), nnx.RNN(b_theirs), return_carry=True)
  x = jax.random.normal(jax.random.key(3), (2, 5, 3))
  lengths = jnp.array([5, 2])
  call = lambda m, x, n: m(x, seq_lengths=n)  # noqa: E731
  got, want = sr.jit(call)(ours, x, lengths), nnx.jit(call)(theirs, x, lengths)
  assert got[1].shape == (2, 5, 8)
  _close(got, want)


def test_rnn_under_jit_and_grad_equals_eager():
  rnn = sr.nn.RNN(sr.nn.LSTMCell(3, 4, rngs=sr.Rngs(0)), return_carry=True)
  x = jax.random.normal(jax.random.key(4), (2, 5, 3))
  lengths = jnp.array([5, 1])
  eager = rnn(x, seq_lengths=lengths)
  _close(sr.jit(lambda m, x, n: m(x, seq_lengths=n))(rnn, x, lengths), eager)

  def loss(m, x):
    return jnp.sum(m(x, seq_lengths=lengths)[1] ** 2)

  grads = sr.grad(loss)(rnn, x)

  # The RNN is the Python loop over time; its gradient is the loop's.
  def loop_loss(params, x):
    cell = sr.merge(sr.graphdef(rnn.cell), params)
    carry, ys = cell.initialize_carry((2, 3)), []
    for t in range(5):
      carry, y = cell(carry, x[:, t])
      ys.append(y)
    return jnp.sum(jnp.stack(ys, 1) ** 2)

  want = jax.jit(jax.grad(loop_loss))(sr.state(rnn.cell, sr.Param), x)
  _close(grads["cell"].flat(), want.flat())
  assert float(loss(rnn, x)) == pytest.approx(
    float(jax.jit(loop_loss)(sr.state(rnn.cell), x)), rel=1e-5
  )


def test_carry_after_each_sequence_end_is_frozen():
  rnn = sr.nn.RNN(sr.nn.GRUCell(3, 4, rngs=sr.Rngs(0)), return_carry=True)
  x = jax.random.normal(jax.random.key(5), (3, 6, 3))
  run = sr.jit(lambda m, x, n=None: m(x, seq_lengths=n))
  carry, _ = run(rnn, x, jnp.array([6, 2, 0]))
  _close(carry[0], run(rnn, x[:1])[1][0, -1])
  _close(carry[1], run(rnn, x[1:2, :2])[1][0, -1])
  np.testing.assert_array_equal(carry[2], jnp.zeros(4))  # no step: the initial carry


class Block(sr.Module):
  """One recurrent layer of a stack: an LSTM over time with a residual."""

  def __init__(self, d, *, rngs):
    self.rnn = sr.nn.RNN(sr.nn.OptimizedLSTMCell(d, d, rngs=rngs))

  def __call__(self, x):
    return x + self.rnn(x), None


def test_a_scanned_stack_of_rnn_layers_equals_the_loop():
  Stack = sr.scan(Block, length=3, variable_axes={True: 0}, split_rngs={"params": True})
  stack = Stack(4, rngs=sr.Rngs(0))
  assert stack.rnn.cell.dense_h.kernel.shape == (3, 4, 16)
  x = jax.random.normal(jax.random.key(6), (2, 5, 4))
  call = sr.jit(lambda m, x: m(x))  # compiled once for the three layers
  y, _ = call(stack, x)
  want = x
  for layer in sr.unstack(stack):
    want, _ = call(layer, want)
  _close(y, want)
  layers = sr.unstack(stack)
  assert not np.allclose(
    layers[0].rnn.cell.dense_i.kernel.value, layers[1].rnn.cell.dense_i.kernel.value
  )


class NoisyCell(sr.nn.RNNCellBase):
  """A cell of one's own: dropout drawn from a stored Rngs, a step counter carried."""

  def __init__(self, *, rngs):
    self.rngs = rngs
    self.steps = sr.BatchStat(jnp.zeros((), jnp.int32))
    self.hidden_features = 8

  def __call__(self, carry, x):
    self.steps.value += 1
    mask = jax.random.bernoulli(self.rngs.dropout(), 0.5, x.shape)
    return carry, mask.astype(jnp.float32) * x

  def initialize_carry(self, input_shape, rngs=None, carry_init=None):
    return jnp.zeros(input_shape[:-1])


@pytest.mark.parametrize("broadcast", [False, True])
def test_rng_streams_split_per_step_unless_broadcast_and_variables_carried(broadcast):
  cell = NoisyCell(rngs=sr.Rngs(dropout=0))
  rnn = sr.nn.RNN(cell, broadcast_rngs="dropout" if broadcast else None)
  x = jnp.ones((1, 4, 8))
  y = rnn(x)
  same = [bool((y[0, 0] == y[0, t]).all()) for t in range(1, 4)]
  assert same == ([True] * 3 if broadcast else [False] * 3)
  assert int(cell.steps.value) == 4
  assert not bool((rnn(x) == y).all())  # the stream advanced: a new call, new masks


def test_metadata_reaches_the_sublayers_and_carry_init_draws_from_rngs():
  cell = sr.nn.LSTMCell(
    3,
    4,
    kernel_metadata={"sharding": ("embed", "mlp")},
    recurrent_kernel_metadata={"sharding": (None, "mlp")},
    bias_metadata={"sharding": ("mlp",)},
    rngs=sr.Rngs(0),
  )
  assert cell.if_.kernel.sharding == ("embed", "mlp")
  assert cell.ho.kernel.sharding == (None, "mlp") and cell.ho.bias.sharding == ("mlp",)
  rngs = sr.Rngs(carry=0)
  c, h = cell.initialize_carry((2, 3), rngs, carry_init=jax.nn.initializers.normal())
  assert c.shape == (2, 4) and not bool((c == h).all())
  assert int(rngs.carry.count.value) == 2
  with pytest.warns(DeprecationWarning, match="keep_rngs"):
    kept = sr.nn.GRUCell(3, 4, keep_rngs=True, rngs=sr.Rngs(0))
  assert kept.initialize_carry((3,), carry_init=jax.nn.initializers.ones).shape == (4,)
  with pytest.warns(UserWarning, match=r"initialize_carry\(input_shape, rngs, carry_init"):
    sr.nn.SimpleCell(3, 4, carry_init=jax.nn.initializers.ones, rngs=sr.Rngs(0))


class Model(sr.Module):
  def __init__(self):
    self.encoder = sr.nn.RNN(sr.nn.LSTMCell(3, 4, rngs=sr.Rngs(0)))


def test_wrong_feature_size_names_the_cell_path_and_changes_nothing():
  model = Model()
  before = _params(model)
  with pytest.raises(
    ValueError,
    match=r"LSTMCell at `encoder\.cell` was built with "
    r"in_features=3 but got an input of shape \(2, 5\) \(expected "
    r"\(\*batch, 3\)\)\. Fix the input, or build the cell with "
    r"in_features=5",
  ):
    model.encoder(jnp.ones((2, 7, 5)))
  with pytest.raises(
    ValueError,
    match=r"LSTMCell at `encoder\.cell` was built with "
    r"in_features=3",
  ):
    sr.jit(lambda m, x: m.encoder(x))(model, jnp.ones((2, 7, 5)))
  with pytest.raises(ValueError, match=r"LSTMCell at `encoder\.cell` was built with"):
    model.encoder.cell(model.encoder.cell.initialize_carry((2, 2)), jnp.ones((2, 2)))
  _close(_params(model), before, atol=0)


def test_wrong_carry_shape_names_the_cell_and_the_expected_shape():
  model = Model()
  before = _params(model)
  bad = (jnp.zeros((2, 5)), jnp.zeros((2, 5)))
  with pytest.raises(
    ValueError,
    match=r"LSTMCell at `encoder\.cell`: the carry has "
    r"shapes \(\(2, 5\), \(2, 5\)\), but for inputs of shape \(2, 3\) it "
    r"must be a pair \(c, h\) of arrays of shape \(2, 4\).*Fix: start "
    r"from `cell\.initialize_carry\(\(2, 3\)\)`",
  ):
    model.encoder(jnp.ones((2, 7, 3)), initial_carry=bad)
  with pytest.raises(ValueError, match=r"must be a pair \(c, h\)"):
    model.encoder(jnp.ones((2, 7, 3)), initial_carry=jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match=r"of shape \(2, 4\)"):  # batch differs: no scan
    model.encoder(jnp.ones((2, 7, 3)), initial_carry=(jnp.zeros((1, 4)),) * 2)
  with pytest.raises(
    ValueError,
    match=r"GRUCell: the carry has shapes \(2, 5\), but for "
    r"inputs of shape \(2, 3\) it must be one array of shape \(2, 4\)",
  ):
    sr.nn.GRUCell(3, 4, rngs=sr.Rngs(0))(jnp.zeros((2, 5)), jnp.ones((2, 3)))
  _close(_params(model), before, atol=0)


def test_rank_seq_lengths_and_argument_errors():
  model = Model()
  with pytest.raises(
    ValueError,
    match=r"RNN at `encoder`: inputs of shape \(3,\) have no "
    r"time axis.*\(\*batch, time, \*features\)\. Fix: add the time axis",
  ):
    model.encoder(jnp.ones(3))
  with pytest.raises(
    ValueError,
    match=r"RNN at `encoder`: seq_lengths has shape \(3,\), "
    r"but inputs of shape \(2, 7, 3\) have batch shape \(2,\).*Fix: pass "
    r"an int array of shape \(2,\)",
  ):
    model.encoder(jnp.ones((2, 7, 3)), seq_lengths=jnp.array([1, 2, 3]))
  with pytest.raises(TypeError, match=r"variable_broadcast=<filter>"):
    sr.nn.RNN(model.encoder.cell, state_axes={...: None})
  with pytest.raises(TypeError, match=r"RNN: rngs must be True.*Fix: `rngs=sr.Rngs\(0\)`"):
    sr.nn.RNN(model.encoder.cell, rngs=0)
  with pytest.raises(TypeError, match=r"GRUCell: rngs must be an sr.Rngs.*sr.Rngs\(0\)"):
    sr.nn.GRUCell(3, 4, rngs=0)
  with pytest.raises(
    ValueError,
    match=r"LSTMCell at `encoder\.cell`: initialize_carry "
    r"with carry_init=.* draws keys.*Fix: pass them",
  ):
    model.encoder.cell.initialize_carry((2, 3), carry_init=jax.nn.initializers.ones)
