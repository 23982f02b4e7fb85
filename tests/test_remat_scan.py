"""sr.remat_scan against the Python loop over sr.unstack, flax.linen and raw JAX."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr

W = 4  # features: tiny, to keep compile times down


class Block(sr.Module):
  """A Linear + tanh residual block (scaled so that 100 of them stay well conditioned)."""

  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + 0.1 * jnp.tanh(self.linear(x))


class NormBlock(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.BatchNorm(dim, momentum=0.5, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.norm(self.linear(x)))


class DropBlock(sr.Module):
  """Records the dropout mask it drew (an Intermediate, stacked like everything)."""

  def __init__(self, dim, *, rngs):
    self.drop = sr.nn.Dropout(0.5, rngs=rngs)
    self.mask = sr.Intermediate(jnp.zeros((2, dim)))

  def __call__(self, x):
    mask = self.drop(jnp.ones_like(x))
    self.mask.value = mask
    return x + mask


def apply(layer, x):
  return layer(x)


def loop(stack, x):
  """The reference: the Python loop over the unstacked layers."""
  for layer in sr.unstack(stack):
    x = layer(x)
  return x


def loss_of(forward):
  return lambda stack, x: (forward(stack, x) ** 2).mean()


def data(batch=2, dim=W):
  return jnp.linspace(-1.0, 1.0, batch * dim).reshape(batch, dim)


@pytest.fixture(scope="module")
def deep100():
  """One stack of 100 layers, its loop output and loop gradients (computed once)."""
  stack = sr.remat_scan(Block, lengths=(100,))(W, rngs=sr.Rngs(0))
  x = data()
  return stack, loop(stack, x), sr.grad(loss_of(loop))(stack, x)


def assert_states_close(a, b, **kw):
  fa, fb = a.flat(), b.flat()
  assert sorted(fa) == sorted(fb)
  for path in fa:
    np.testing.assert_allclose(fa[path], fb[path], err_msg=str(path), **kw)


# -- equivalence with the loop ------------------------------------------------------


@pytest.mark.parametrize("lengths", [(100,), (10, 10), (4, 5, 5)])
def test_function_form_matches_loop(deep100, lengths):
  stack, want, want_grads = deep100
  x = data()
  scanned = sr.remat_scan(apply, lengths)
  np.testing.assert_allclose(scanned(stack, x), want, rtol=1e-5, atol=1e-5)
  grads = sr.grad(loss_of(scanned))(stack, x)
  assert grads["linear"]["kernel"].shape == (100, W, W)
  assert_states_close(grads, want_grads, rtol=1e-4, atol=1e-6)


def test_class_form_builds_flat_stack_and_matches_loop():
  Deep = sr.remat_scan(Block, lengths=(2, 3))
  deep = Deep(W, rngs=sr.Rngs(1))
  assert isinstance(deep, Block) and type(deep).__name__ == "RematScanBlock"
  assert len(deep) == 6
  assert deep.linear.kernel.shape == (6, W, W)
  assert deep.linear.bias.shape == (6, W)
  kernels = np.asarray(deep.linear.kernel.value)
  assert all(not np.allclose(kernels[i], kernels[j]) for i in range(6) for j in range(i))
  x = data()
  np.testing.assert_allclose(deep(x), loop(deep, x), rtol=1e-6, atol=1e-6)
  grads = sr.grad(lambda m, x: (m(x) ** 2).mean())(deep, x)
  assert_states_close(grads, sr.grad(loss_of(loop))(deep, x), rtol=1e-5, atol=1e-7)


def test_layer_axis_last():
  Deep = sr.remat_scan(Block, lengths=(2, 3), variable_axes={True: -1})
  deep = Deep(W, rngs=sr.Rngs(1))
  assert deep.linear.kernel.shape == (W, W, 6) and deep.linear.bias.shape == (W, 6)
  assert len(deep) == 6
  x = data()
  np.testing.assert_allclose(deep(x), loop(deep, x), rtol=1e-6, atol=1e-6)
  grads = sr.grad(lambda m, x: (m(x) ** 2).mean())(deep, x)
  assert grads["linear"]["kernel"].shape == (W, W, 6)
  assert_states_close(grads, sr.grad(loss_of(loop))(deep, x), rtol=1e-5, atol=1e-7)


def test_same_state_for_any_lengths(deep100):
  stack, want, _ = deep100
  x = data()
  for lengths in [(10, 10), (4, 5, 5)]:
    other = sr.remat_scan(Block, lengths=lengths)(W, rngs=sr.Rngs(7))
    assert other.linear.kernel.shape == (100, W, W)  # one flat layer axis
    assert not np.allclose(other(x), want)
    sr.update(other, sr.state(stack))
    np.testing.assert_allclose(other(x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
      sr.state(other).flat()[("linear", "kernel")], stack.linear.kernel.value
    )


def test_batchnorm_stats_per_layer_match_loop():
  deep = sr.remat_scan(NormBlock, lengths=(2, 2))(W, rngs=sr.Rngs(0))
  assert deep.norm.mean.shape == (4, W)
  layers = sr.unstack(deep)
  x = data(batch=3)
  want = x
  for layer in layers:
    want = layer(want)
  np.testing.assert_allclose(deep(x), want, rtol=1e-5, atol=1e-6)
  for i, layer in enumerate(layers):
    got = deep.layer(i)
    np.testing.assert_allclose(got.norm.mean.value, layer.norm.mean.value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.norm.var.value, layer.norm.var.value, rtol=1e-5)
  # Every layer's statistics moved, and differently.
  means = np.asarray(deep.norm.mean.value)
  assert not np.allclose(means, 0.0)
  assert not np.allclose(means[0], means[1])


def test_dropout_split_streams_give_a_mask_per_layer():
  deep = sr.remat_scan(DropBlock, lengths=(2, 3))(W, rngs=sr.Rngs(0))
  deep(jnp.zeros((2, W)))
  masks = np.asarray(deep.mask.value)
  assert masks.shape == (6, 2, W)
  assert set(np.unique(masks)) <= {0.0, 2.0}
  assert len({m.tobytes() for m in masks}) == 6
  # A second call draws new masks: the stream advanced.
  deep(jnp.zeros((2, W)))
  assert not np.array_equal(np.asarray(deep.mask.value), masks)


def test_dropout_unsplit_stream_gives_one_mask():
  Deep = sr.remat_scan(DropBlock, lengths=(2, 3), split_rngs={"dropout": False})
  deep = Deep(W, rngs=sr.Rngs(params=0, dropout=1))
  deep(jnp.zeros((2, W)))
  masks = np.asarray(deep.mask.value)
  assert not np.all(masks == masks[0, 0, 0])
  for m in masks[1:]:
    np.testing.assert_array_equal(m, masks[0])


def test_policy_gives_equal_gradients(deep100):
  stack, _, want_grads = deep100
  x = data()
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  scanned = sr.remat_scan(apply, (10, 10), policy=policy)
  assert_states_close(sr.grad(loss_of(scanned))(stack, x), want_grads, rtol=1e-4, atol=1e-6)
  Deep = sr.remat_scan(Block, lengths=(2, 3), policy=jax.checkpoint_policies.nothing_saveable)
  deep = Deep(W, rngs=sr.Rngs(3))
  assert_states_close(
    sr.grad(lambda m, x: (m(x) ** 2).mean())(deep, x),
    sr.grad(loss_of(loop))(deep, x),
    rtol=1e-5,
    atol=1e-7,
  )


class Counted(sr.Module):
  """Counts its calls in a BatchStat shared by every layer (a constructor argument)."""

  def __init__(self, counter, dim, *, rngs):
    self.counter = counter
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)

  def __call__(self, x):
    self.counter.value = self.counter.value + 1
    return x + 0.1 * jnp.tanh(self.linear(x))

  def twice(self, x):
    return self(self(x))


def test_variable_carry_threads_a_shared_variable():
  counter = sr.BatchStat(jnp.zeros((), jnp.int32))
  Deep = sr.remat_scan(Counted, lengths=(2, 3), variable_carry=sr.BatchStat)
  deep = Deep(counter, W, rngs=sr.Rngs(0))
  assert deep.counter is counter and deep.linear.kernel.shape == (6, W, W)
  x = data()
  y = deep(x)
  assert int(counter.value) == 6
  np.testing.assert_allclose(y, loop(deep, x), rtol=1e-6, atol=1e-6)
  sr.grad(lambda m, x: (m(x) ** 2).mean())(deep, x)
  # The loop ran on copies (sr.unstack), so only the two transformed calls counted.
  assert int(counter.value) == 12
  # Without a rule for it, the shared counter is read-only.
  ReadOnly = sr.remat_scan(Counted, lengths=(2, 3), variable_axes={sr.Param: 0})
  ro = ReadOnly(counter, W, rngs=sr.Rngs(0))
  with pytest.raises(
    sr.TransformError,
    match=r"wrote to `counter` \(BatchStat, collection 'batch_stats'\), "
    r"which is matched by no collection rule",
  ):
    ro(x)
  assert int(counter.value) == 12


def test_methods():
  counter = sr.BatchStat(jnp.zeros((), jnp.int32))
  Deep = sr.remat_scan(Counted, lengths=(2, 2), variable_carry=sr.BatchStat, methods=["twice"])
  deep = Deep(counter, W, rngs=sr.Rngs(0))
  x = data()
  want = x
  for layer in sr.unstack(deep):
    want = layer.twice(want)
  np.testing.assert_allclose(deep.twice(x), want, rtol=1e-6, atol=1e-6)
  assert int(counter.value) == 8  # the loop ran on copies
  with pytest.raises(
    AttributeError,
    match=r"sr\.remat_scan\(Counted, methods=\['nope'\]\)"
    r": Counted has no method 'nope'",
  ):
    sr.remat_scan(Counted, lengths=(2,), methods=["nope"])


def test_composes_with_jit():
  deep = sr.remat_scan(Block, lengths=(2, 2))(W, rngs=sr.Rngs(0))
  x = data()
  step = sr.jit(sr.value_and_grad(lambda m, x: (m(x) ** 2).mean()))
  value, grads = step(deep, x)
  np.testing.assert_allclose(value, (loop(deep, x) ** 2).mean(), rtol=1e-6)
  assert_states_close(grads, sr.grad(loss_of(loop))(deep, x), rtol=1e-5, atol=1e-7)


# -- parity with flax.linen.remat_scan ------------------------------------------------


class LinenBody(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + 0.1 * jnp.tanh(nn.Dense(W)(x))


def test_matches_flax_linen_remat_scan():
  deep = sr.remat_scan(Block, lengths=(2, 3))(W, rngs=sr.Rngs(0))
  x = data()
  linen = nn.remat_scan(LinenBody, lengths=(2, 3))()
  variables = linen.init(jax.random.key(0), x)
  assert variables["params"]["Dense_0"]["kernel"].shape == (2, 3, W, W)
  params = {
    "Dense_0": {
      "kernel": deep.linear.kernel.value.reshape(2, 3, W, W),
      "bias": deep.linear.bias.value.reshape(2, 3, W),
    }
  }
  np.testing.assert_allclose(deep(x), linen.apply({"params": params}, x), rtol=1e-6, atol=1e-6)
  ours = sr.grad(lambda m, x: (m(x) ** 2).mean())(deep, x)
  theirs = jax.grad(lambda p: (linen.apply({"params": p}, x) ** 2).mean())(params)
  np.testing.assert_allclose(
    ours["linear"]["kernel"], theirs["Dense_0"]["kernel"].reshape(6, W, W), rtol=1e-5, atol=1e-7
  )
  np.testing.assert_allclose(
    ours["linear"]["bias"], theirs["Dense_0"]["bias"].reshape(6, W), rtol=1e-5, atol=1e-7
  )


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [(), (0,), (2, -1), (2, 0, 3)])
def test_bad_lengths(lengths):
  with pytest.raises(sr.TransformError, match=r"must be a non-empty tuple of positive ints"):
    sr.remat_scan(apply, lengths)
  with pytest.raises(sr.TransformError, match=r"must be a non-empty tuple of positive ints"):
    sr.remat_scan(Block, lengths=lengths)


def test_lengths_not_matching_the_stacked_variable():
  deep = sr.remat_scan(Block, lengths=(2, 3))(W, rngs=sr.Rngs(0))
  before = sr.state(deep)
  with pytest.raises(
    sr.TransformError,
    match=r"lengths=\(3, 3\) \(product\) says 9 iterations but the "
    r"stacked variable `linear\.bias` \(axis 0\) has 6",
  ):
    sr.remat_scan(apply, (3, 3))(deep, data())
  np.testing.assert_array_equal(
    sr.state(deep).flat()[("linear", "kernel")], before.flat()[("linear", "kernel")]
  )


def test_writing_a_broadcast_variable():
  Deep = sr.remat_scan(NormBlock, lengths=(2, 2), variable_broadcast=sr.BatchStat)
  deep = Deep(W, rngs=sr.Rngs(0))
  assert deep.norm.mean.shape == (W,) and deep.linear.kernel.shape == (4, W, W)
  before = {k: np.asarray(v) for k, v in sr.state(deep).flat().items()}
  with pytest.raises(
    sr.TransformError,
    match=r"wrote to `norm\.mean` \(BatchStat, collection 'batch_stats'\)"
    r", which is broadcast \(variable_broadcast\).*variable_carry=",
  ):
    deep(data())
  for k, v in sr.state(deep).flat().items():
    np.testing.assert_array_equal(v, before[k])
  # In evaluation mode nothing is written, so a broadcast BatchStat is fine.
  deep.eval()
  assert deep(data()).shape == (2, W)


def test_carry_shape_change():
  deep = sr.remat_scan(Block, lengths=(2, 2))(W, rngs=sr.Rngs(0))

  def grow(layer, x):
    return jnp.concatenate([layer(x), x], axis=0)

  with pytest.raises(
    sr.TransformError,
    match=r"the carry leaf `<carry>` went in as float32\[2, 4\] and came "
    r"out as float32\[4, 4\]",
  ):
    sr.remat_scan(grow, (2, 2))(deep, data())


def test_carry_dtype_change():
  deep = sr.remat_scan(Block, lengths=(4,))(W, rngs=sr.Rngs(0))
  with pytest.raises(
    sr.TransformError,
    match=r"the carry leaf `\['h'\]` went in as float32\[2, 4\] and came "
    r"out as float16\[2, 4\].*astype",
  ):
    sr.remat_scan(lambda m, c: {"h": m(c["h"]).astype(jnp.float16)}, (4,))(deep, {"h": data()})


def test_module_in_carry_and_methods_on_function():
  deep = sr.remat_scan(Block, lengths=(2,))(W, rngs=sr.Rngs(0))
  with pytest.raises(TypeError, match=r"the carry `\[0\]` is a RematScanBlock"):
    sr.remat_scan(apply, (2,))(deep, (deep, data()))
  with pytest.raises(TypeError, match=r"methods=\.\.\.\) applies to a Module class"):
    sr.remat_scan(apply, (2,), methods=["__call__"])


# -- memory: the same compiled bytes as the hand-written construction ---------------


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_with_no_batch_dims_saveable])
def test_memory_matches_raw_jax(policy):
  """Temp bytes equal nested scans with jax.checkpoint at every level, the policy innermost.

  The config is small but tells the variants apart: with the dots policy, raw JAX
  needs 165,504 temp bytes; 292,672 with the policy at every level, 198,272 with
  the innermost level not rematerialised (flax.linen's construction).
  """
  width, batch, lengths = 32, 64, (4, 4)

  class Dense(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(width, width, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.linear(x))

  deep = sr.remat_scan(Dense, lengths=lengths, policy=policy)(rngs=sr.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (batch, width))
  graphdef, params, rest = sr.split(deep, sr.Param, ...)

  def grad_fn(params, rest, x):
    model = sr.merge(graphdef, params, rest)
    return sr.grad(lambda m, x: (m(x) ** 2).mean())(model, x)

  def raw_loss(params, x):
    kernel = params["kernel"].reshape(lengths + (width, width))
    bias = params["bias"].reshape(lengths + (width,))

    def level(depth, h, p):
      if depth == len(lengths):
        k, b = p
        return jnp.tanh(h @ k + b[None]), None
      step = jax.checkpoint(
        lambda h, p: level(depth + 1, h, p),
        prevent_cse=False,
        policy=policy if depth == len(lengths) - 1 else None,
      )
      return jax.lax.scan(step, h, p)

    out, _ = level(0, x, (kernel, bias))
    return (out**2).mean()

  raw_params = {"kernel": deep.linear.kernel.value, "bias": deep.linear.bias.value}
  ours_compiled = jax.jit(grad_fn).lower(params, rest, x).compile()
  raw_compiled = jax.jit(jax.grad(raw_loss)).lower(raw_params, x).compile()
  ours, raw = ours_compiled.memory_analysis(), raw_compiled.memory_analysis()
  assert raw.temp_size_in_bytes > 0
  assert abs(ours.temp_size_in_bytes - raw.temp_size_in_bytes) <= (0.01 * raw.temp_size_in_bytes)
  assert ours.output_size_in_bytes == raw.output_size_in_bytes
  # The two agree on the numbers too.
  grads = ours_compiled(params, rest, x)
  want = raw_compiled(raw_params, x)
  np.testing.assert_allclose(grads["linear"]["kernel"], want["kernel"], rtol=1e-4, atol=1e-7)


def test_a_block_returning_carry_and_more_says_what_remat_scan_takes():
  """A block written for sr.scan (or returning an auxiliary output) returns ``(x,
  aux)``: the message says remat_scan's body returns the carry alone, and the ways to
  keep ``aux``."""

  class Aux(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(W, W, rngs=rngs)

    def __call__(self, x):
      y = self.linear(x)
      return y, y.sum()

  stack = sr.remat_scan(Aux, lengths=(2,))(rngs=sr.Rngs(0))
  before = sr.state(stack)
  with pytest.raises(
    sr.TransformError,
    match=r"returned a pair \(carry, an array of shape \(\)\) where sr\.remat_scan's body "
    r"returns the carry alone.*self\.sow\(sr\.Intermediate.*use sr\.scan",
  ):
    stack(data())
  np.testing.assert_array_equal(
    sr.state(stack).flat()[("linear", "kernel")], before.flat()[("linear", "kernel")]
  )
