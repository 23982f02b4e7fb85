"""`self.sow` inside transforms: the first sow creates a Variable, a change of the
graph's structure that sr.jit, sr.remat and sr.scan carry out to the caller's objects
(for sr.scan, stacked per layer along the layer axis); sr.pop then takes the values out.
Each result equals the same calls made eagerly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import statefulremat as sr

L, D = 3, 4


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


class Block(sr.Module):
  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.linear(x))
    self.sow(sr.Intermediate, "features", h)
    return h


def test_sow_inside_jit_creates_the_variable_in_the_callers_model():
  model, twin = Block(rngs=sr.Rngs(0)), Block(rngs=sr.Rngs(0))
  step = sr.jit(lambda m, x: m(x))
  x = jnp.ones((2, D))
  for _ in range(2):
    close(step(model, x), twin(x))
  assert type(model.features) is sr.Intermediate and len(model.features.value) == 2
  for a, b in zip(model.features.value, twin.features.value):
    close(a, b)
  popped = sr.pop(model, sr.Intermediate)
  assert len(popped["features"]) == 2 and not hasattr(model, "features")
  close(step(model, x), twin(x))  # the structure is back: the next call sows afresh
  assert len(model.features.value) == 1


def test_sow_inside_remat_creates_the_variable():
  model, twin = Block(rngs=sr.Rngs(0)), Block(rngs=sr.Rngs(0))
  x = jnp.ones((2, D))
  close(sr.remat(lambda m, x: m(x))(model, x), twin(x))
  assert len(model.features.value) == 1
  close(model.features.value[0], twin.features.value[0])


def test_sow_inside_scan_is_stacked_per_layer():
  stack = sr.scan(Block, length=L, variable_axes={sr.Param: 0}, split_rngs={"params": True})(
    rngs=sr.Rngs(0)
  )
  layers = sr.unstack(stack)
  h0 = jnp.ones((2, D))
  out, _ = sr.scan(
    lambda block, h: (block(h), None), variable_axes={sr.Param: 0, sr.Intermediate: 0}
  )(stack, h0)
  h, want = h0, []
  for layer in layers:
    h = layer(h)
    want.append(layer.features.value[0])
  close(out, h)
  (features,) = stack.features.value
  assert features.shape == (L, 2, D)
  close(features, jnp.stack(want))
  popped = sr.pop(stack, sr.Intermediate)
  assert popped["features"][0].shape == (L, 2, D) and not hasattr(stack, "features")


def test_a_failing_jit_call_after_a_sow_leaves_the_model_as_it_was():
  model = Block(rngs=sr.Rngs(0))
  before = sr.graphdef(model)

  def step(m, x):
    m(x)
    raise ValueError("boom")

  with pytest.raises(ValueError, match="boom"):
    sr.jit(step)(model, jnp.ones((2, D)))
  assert not hasattr(model, "features") and sr.graphdef(model) == before
  assert jax.tree.structure(sr.state(model)) == jax.tree.structure(sr.state(Block(rngs=sr.Rngs(1))))


@pytest.mark.parametrize(
  "lengths, n", [((4,), 4), ((2, 2), 4), ((2, 2, 2), 8), ((3, 3), 7), ((2, 2, 2), 7)]
)
def test_sow_at_any_remat_scan_depth_equals_the_loop(lengths, n):
  """A sown tuple is a pytree value: every level folds and unfolds each of its leaves
  along the layer axis, full levels and short last segments alike."""
  stack = sr.remat_scan(Block, lengths=lengths, length=n)(rngs=sr.Rngs(0))
  layers = [stack.layer(i) for i in range(n)]
  x = jax.random.normal(jax.random.key(1), (2, D))
  for call in range(1, 3):
    h = x
    for layer in layers:
      h = layer(h)
    close(stack(x), h)
    assert len(stack.features.value) == call
    for k in range(call):
      expected = jnp.stack([layer.features.value[k] for layer in layers])
      close(stack.features.value[k], expected)
  sown = sr.pop(stack, sr.Intermediate)
  assert not hasattr(stack, "features") and len(sown["features"]) == 2


def test_a_sown_tuple_is_sliced_per_layer_by_stack_layer():
  stack = sr.remat_scan(Block, lengths=(2, 2))(rngs=sr.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, D))
  stack(x)
  stack(x)
  for i in (0, 3, -1):
    layer = stack.layer(i)
    assert len(layer.features.value) == 2
    for k in range(2):
      close(layer.features.value[k], stack.features.value[k][i])
  assert [len(layer.features.value) for layer in sr.unstack(stack)] == [2] * 4


# -- sr.stack / sr.unstack / stack.layer(i) of layers holding sown tuples -----------------


class ScanBlock(Block):
  def __call__(self, x):
    return super().__call__(x), None


def output(out):
  """A stack's or a layer's output: sr.scan's body returns ``(carry, ys)``."""
  return out[0] if isinstance(out, tuple) else out


def assert_same_layer(a, b):
  """Same class, paths, kinds and values, sown tuples included."""
  assert type(a) is type(b)
  va, vb = sr.state(a).flat_variables(), sr.state(b).flat_variables()
  assert list(va) == list(vb)
  for path in va:
    assert type(va[path]) is type(vb[path]), path
    x, y = va[path].value, vb[path].value
    assert jax.tree.structure(x) == jax.tree.structure(y), path
    for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
      np.testing.assert_array_equal(np.asarray(p), np.asarray(q), err_msg=str(path))


@pytest.mark.parametrize(
  "make",
  [
    lambda: sr.remat_scan(Block, lengths=(2,), length=2),
    lambda: sr.scan(ScanBlock, length=2, variable_axes={True: 0}, split_rngs={True: True}),
  ],
  ids=["remat_scan", "scan"],
)
def test_stack_of_two_models_layers_holding_a_sown_tuple(make):
  """Issue 44 item 3: the sown tuple is stacked leaf by leaf, as the loop holds it."""
  Stack = make()
  a, b = Stack(rngs=sr.Rngs(0)), Stack(rngs=sr.Rngs(1))
  x = jax.random.normal(jax.random.key(1), (2, D))
  a(x)
  b(x)
  layers = [a.layer(0), b.layer(1)]
  mixed = sr.stack(layers)
  assert type(mixed) is Stack and len(mixed) == 2
  (features,) = mixed.features.value
  assert features.shape == (2, 2, D)
  for i, layer in enumerate(layers):
    assert_same_layer(mixed.layer(i), layer)
  for got, layer in zip(sr.unstack(mixed), layers):
    assert_same_layer(got, layer)
  # It runs as the loop over its layers, and sows its second entry as they do.
  h = x
  for layer in layers:
    h = output(layer(h))
  close(output(mixed(x)), h)
  assert len(mixed.features.value) == 2
  for i, layer in enumerate(layers):
    for k in range(2):
      close(mixed.layer(i).features.value[k], layer.features.value[k])


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 3), calls=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_sown_tuples_round_trip_through_stack_and_unstack(n, calls, seed):
  layers = [Block(rngs=sr.Rngs(seed + i)) for i in range(n)]
  x = jax.random.normal(jax.random.key(seed), (2, D))
  for layer in layers:
    for _ in range(calls):
      layer(x)
  stacked = sr.stack(layers, like=sr.vmap(Block, axis_size=n))
  assert len(stacked.features.value) == calls
  assert all(leaf.shape == (n, 2, D) for leaf in stacked.features.value)
  back = sr.unstack(stacked)
  for i, (layer, original) in enumerate(zip(back, layers)):
    assert_same_layer(layer, original)
    assert_same_layer(stacked.layer(i), original)
  again = sr.stack(back)
  assert_same_layer(again, stacked)


def test_stack_of_layers_sown_a_different_number_of_times_names_the_variable():
  stack = sr.remat_scan(Block, lengths=(2,))(rngs=sr.Rngs(0))
  x = jnp.ones((2, D))
  stack(x)
  first, second = sr.unstack(stack)
  second(x)
  with pytest.raises(
    sr.TransformError,
    match=r"`features` \(Intermediate\) holds a tuple of 1 value in layer 0 but of 2 "
    r"values in layer 1.*sr\.pop\(layer, sr\.Intermediate\)",
  ):
    sr.stack([first, second])
  assert [len(layer.features.value) for layer in (first, second)] == [1, 2]  # unchanged
  sr.pop(second, sr.Intermediate)
  with pytest.raises(
    sr.TransformError, match=r"attribute `features` was deleted.*sr\.pop\(layer, sr\.Intermediate\)"
  ):
    sr.stack([first, second])
  sr.pop(first, sr.Intermediate)
  assert not hasattr(sr.stack([first, second]), "features")
