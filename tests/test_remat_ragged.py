"""remat_scan over any depth: ``length=N`` with ``prod(lengths) >= N`` (a short last
segment), checked against the Python loop, the flat scan and the exact nesting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr


class Block(sr.Module):
  def __init__(self, width=4, *, rngs):
    self.linear = sr.nn.Linear(width, width, rngs=rngs)
    self.norm = sr.nn.BatchNorm(width, rngs=rngs)
    self.drop = sr.nn.Dropout(0.25, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.norm(jnp.tanh(self.linear(x))))


X = jnp.linspace(-1.0, 1.0, 24).reshape(6, 4)


def _arrays(model):
  """The model's state as plain arrays (RNG keys as their key data)."""
  return [
    jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    for x in jax.tree.leaves(sr.state(model))
  ]


def _assert_same_state(a, b, rtol=0.0):
  for x, y in zip(_arrays(a), _arrays(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=rtol)


def _loss(model, x):
  return jnp.mean(model(x) ** 2)


# A stack's call compiled as one program: eagerly, its ops compile one by one.
_call = sr.jit(lambda model, x: model(x))


@pytest.mark.parametrize(
  "n, lengths", [(7, (3, 3)), (13, (4, 4)), (13, (2, 2, 4)), (11, (2, 2, 3))]
)
def test_a_prime_depth_equals_the_python_loop_and_the_flat_scan(n, lengths):
  ragged = sr.remat_scan(Block, lengths=lengths, length=n)(rngs=sr.Rngs(0))
  flat = sr.remat_scan(Block, lengths=(n,))(rngs=sr.Rngs(0))
  assert len(ragged) == n
  _assert_same_state(ragged, flat)

  loss_r, grads_r = sr.jit(sr.value_and_grad(_loss))(ragged, X)
  loss_f, grads_f = sr.jit(sr.value_and_grad(_loss))(flat, X)
  np.testing.assert_allclose(loss_r, loss_f, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads_r, grads_f
  )
  # Every per-layer write (batch statistics, RNG counts) lands on its own layer.
  _assert_same_state(ragged, flat, rtol=1e-6)

  # The Python loop over the unstacked layers, in eval mode (no dropout keys involved).
  ragged.eval()
  y = _call(ragged, X)
  h = X
  for layer in sr.unstack(ragged):
    h = layer(h)
  np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-6)


def test_the_function_form_takes_length():
  stack = sr.vmap(sr.nn.Linear, axis_size=10)(3, 3, rngs=sr.Rngs(0))
  run = sr.remat_scan(lambda layer, h: jnp.tanh(layer(h)), lengths=(4, 3), length=10)
  x = jnp.ones((2, 3))
  h = x
  for layer in sr.unstack(stack):
    h = jnp.tanh(layer(h))
  np.testing.assert_allclose(run(stack, x), h, rtol=1e-5)


class Counted(sr.Module):
  """A block whose every evaluation, recomputations included, ticks ``CALLS``: the
  callback's result scales the pre-activation, which the backward pass needs, so no
  recomputation can drop it."""

  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(2, 2, rngs=rngs)

  def __call__(self, h):
    one = jax.pure_callback(
      _tick, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.stop_gradient(h[0, 0])
    )
    return jnp.tanh(self.linear(h) * one)


CALLS = []


def _tick(_):
  CALLS.append(1)
  return np.ones((), np.float32)


def _evaluations(n, lengths):
  model = sr.remat_scan(Counted, lengths=lengths, length=n)(rngs=sr.Rngs(0))
  step = sr.jit(sr.grad(lambda m, x: jnp.sum(m(x))))
  x = jnp.ones((1, 2))
  jax.block_until_ready(step(model, x))
  CALLS.clear()
  jax.block_until_ready(step(model, x))
  return len(CALLS)


@pytest.mark.parametrize("lengths", [(12,), (3, 4), (2, 2, 3)])
def test_d_levels_cost_d_plus_one_evaluations_per_layer(lengths):
  assert _evaluations(12, lengths) == (len(lengths) + 1) * 12


@pytest.mark.parametrize("n, lengths", [(11, (3, 4)), (11, (2, 2, 3))])
def test_a_short_last_segment_costs_no_more(n, lengths):
  assert n < _evaluations(n, lengths) <= (len(lengths) + 1) * n


def _temp(n, lengths, width=64, batch=256):
  stack = sr.vmap(sr.nn.Linear, axis_size=n)(width, width, rngs=sr.Rngs(0))
  run = sr.remat_scan(lambda layer, h: jnp.tanh(layer(h)), lengths=lengths, length=n)
  step = sr.jit(sr.grad(lambda m, x: jnp.mean(run(m, x) ** 2)))
  memory = step.lower(stack, jnp.ones((batch, width))).compile().memory_analysis()
  return memory.temp_size_in_bytes


def test_a_short_segment_needs_no_padding_nor_copies_of_the_parameters():
  # 23 layers in (5, 5) take no more memory than 25 would: no copy of the first 20
  # layers' parameters, no padded layers.
  assert _temp(23, (5, 5)) <= _temp(25, (5, 5))


def test_a_checkpoint_moves_between_nestings(tmp_path):
  saved = sr.remat_scan(Block, lengths=(3, 3), length=7)(rngs=sr.Rngs(0))
  sr.jit(sr.grad(_loss))(saved, X)  # batch statistics moved
  sr.save(tmp_path / "ckpt", saved)
  for lengths in [(7,), (2, 4), (2, 2, 2)]:
    other = sr.remat_scan(Block, lengths=lengths, length=7)(rngs=sr.Rngs(1))
    sr.restore(tmp_path / "ckpt", other)
    _assert_same_state(other, saved)
    other.eval(), saved.eval()
    np.testing.assert_allclose(_call(other, X), _call(saved, X), rtol=1e-5, atol=1e-6)


def test_lengths_that_do_not_cover_length_raise():
  with pytest.raises(
    sr.TransformError,
    match=r"lengths=\(3, 3\) cover 9 layers, fewer than length=10\. "
    r"Fix: lengths whose product is at least 10, e\.g\. "
    r"lengths=\(4, 3\)",
  ):
    sr.remat_scan(Block, lengths=(3, 3), length=10)


def test_a_whole_empty_outer_step_raises():
  with pytest.raises(
    sr.TransformError,
    match=r"at least one whole outer step \(4 "
    r"layers\) would run nothing",
  ):
    sr.remat_scan(Block, lengths=(4, 4), length=12)


def test_bad_length_and_lengths_raise():
  with pytest.raises(sr.TransformError, match=r"length=0 must be a positive int"):
    sr.remat_scan(Block, lengths=(4, 4), length=0)
  with pytest.raises(sr.TransformError, match=r"lengths=\(\) must be a non-empty tuple"):
    sr.remat_scan(Block, lengths=())


def test_a_stack_of_another_depth_names_length():
  stack = sr.vmap(sr.nn.Linear, axis_size=10)(3, 3, rngs=sr.Rngs(0))
  run = sr.remat_scan(lambda layer, h: layer(h), lengths=(4, 3))
  with pytest.raises(
    sr.TransformError,
    match=r"lengths=\(4, 3\) \(product\) says 12 "
    r"iterations but .* has 10",
  ):
    run(stack, jnp.ones((2, 3)))
