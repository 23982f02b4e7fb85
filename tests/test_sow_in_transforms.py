"""`self.sow` inside transforms: the first sow creates a Variable, a change of the
graph's structure that sr.jit, sr.remat and sr.scan carry out to the caller's objects
(for sr.scan, stacked per layer along the layer axis); sr.pop then takes the values out.
Each result equals the same calls made eagerly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_sow_under_a_checked_named_policy_comes_out_as_arrays():
  """A named policy is checked on a jaxpr of the loop before it runs: the sown values
  and the written state come out of that run, never as its tracers."""

  class Named(Block):
    def __call__(self, x):
      h = jax.ad_checkpoint.checkpoint_name(self.linear(x), "proj")
      self.sow(sr.Intermediate, "features", h)
      return jnp.tanh(h)

  policy = jax.checkpoint_policies.save_only_these_names("proj")
  stack = sr.remat_scan(Named, lengths=(2, 2), policy=policy)(rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  x = jax.random.normal(jax.random.key(1), (2, D))
  h = x
  for layer in layers:
    h = layer(h)
  close(stack(x), h)
  (sown,) = stack.features.value
  assert isinstance(sown, jax.Array) and not isinstance(sown, jax.core.Tracer)
  close(sown, jnp.stack([layer.features.value[0] for layer in layers]))


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
