"""The stack is data: each stacked Variable's metadata records its layer axis, so a
State, a checkpoint, a rendering or a PartitionSpec knows it without the stack's class."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import statefulremat as sr


class Block(sr.Module):
  def __init__(self, *, rngs):
    self.w = sr.Param(jnp.zeros((2, 3)), sharding=("embed", "mlp"))
    self.b = sr.Param(jnp.zeros((3,)))

  def __call__(self, x):
    return jnp.tanh(x @ self.w.value[:, :2] + self.b.value[:2]), None


def named_stack():
  return sr.vmap(Block, axis_size=4, metadata_params={"partition_name": "layers"})(rngs=sr.Rngs(0))


def test_class_forms_record_the_layer_axis_in_metadata():
  stack = named_stack()
  assert stack.w.metadata == {
    "sharding": ("layers", "embed", "mlp"),
    "layer_axis": ((0, "layers"),),
  }
  assert stack.b.metadata == {"layer_axis": ((0, "layers"),)}
  unnamed = sr.scan(Block, length=2, variable_axes={sr.Param: 1})(rngs=sr.Rngs(0))
  assert unnamed.w.metadata == {"sharding": ("embed", "mlp"), "layer_axis": ((1, None),)}
  for remat_stack in [sr.remat_scan(Block, lengths=(2, 3))(rngs=sr.Rngs(0))]:
    assert remat_stack.w.layer_axis == ((0, None),) and remat_stack.w.shape == (6, 2, 3)


def test_a_layer_has_no_layer_axis_and_stacking_puts_it_back():
  stack = named_stack()
  layer = stack.layer(2)
  assert layer.w.metadata == {"sharding": ("embed", "mlp")}
  again = sr.stack(sr.unstack(stack))
  assert again.w.metadata == stack.w.metadata
  from_class = sr.stack([layer, layer], like=type(stack))
  assert from_class.w.metadata == stack.w.metadata and len(from_class) == 2


def test_repr_of_a_state_split_off_a_stack_names_the_layer_axis():
  assert (
    repr(sr.state(named_stack()))
    == """\
State({
  'b': Param(
    value=<jax.Array float32(layers:4, 3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:12>,
  ),
  'w': Param(
    value=<jax.Array float32(layers:4, embed:2, mlp:3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:24>,
    sharding=('layers', 'embed', 'mlp'),
  ),
})"""
  )
  # A layer axis that is not first, without a partition name.
  state = sr.state(sr.scan(Block, length=2, variable_axes={sr.Param: 1})(rngs=sr.Rngs(0)))
  assert "float32(embed:2, layers:2, mlp:3)" in repr(state)


def test_partition_specs_from_a_bare_state_include_the_layer_axis():
  specs = sr.get_partition_spec(sr.state(named_stack()))
  # `b` has no sharding metadata: its named layer axis is in the spec all the same
  # (so sr.shard places it with the rule for "layers"), its other axis replicated.
  assert specs["w"] == P("layers", "embed", "mlp") and specs["b"] == P("layers", None)
  unnamed = sr.state(sr.scan(Block, length=2, variable_axes={sr.Param: 1})(rngs=sr.Rngs(0)))
  assert sr.get_partition_spec(unnamed)["w"] == P("embed", None, "mlp")


def test_an_ensemble_of_stacks_has_two_layer_axes():
  Inner = sr.scan(Block, length=3, variable_axes={sr.Param: 0})
  ensemble = sr.vmap(Inner, axis_size=2)(rngs=sr.Rngs(0))
  assert ensemble.w.shape == (2, 3, 2, 3)
  assert ensemble.w.layer_axis == ((0, None), (1, None))
  member = ensemble.layer(1)
  assert type(member) is Inner and member.w.layer_axis == ((0, None),)
  assert len(member) == 3 and member.layer(0).w.metadata == {"sharding": ("embed", "mlp")}
  assert sr.stack(sr.unstack(ensemble)).w.layer_axis == ensemble.w.layer_axis


def test_a_checkpoint_records_the_layer_axis_and_refuses_a_moved_one(tmp_path):
  axis0 = sr.vmap(sr.nn.Linear, axis_size=4)
  axis1 = sr.vmap(sr.nn.Linear, axis_size=4, variable_axes={True: 1})
  sr.save(tmp_path, axis0(4, 4, rngs=sr.Rngs(0)))
  target = axis1(4, 4, rngs=sr.Rngs(1))  # kernel (4, 4, 4) either way
  before = np.asarray(target.kernel.value)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"`bias`: the checkpoint stacks its layers along axis 0, the "
    r"model along axis 1.*\n  also `kernel`",
  ):
    sr.restore(tmp_path, target)
  np.testing.assert_array_equal(target.kernel.value, before)
  fresh = axis0(4, 4, rngs=sr.Rngs(1))
  sr.restore(tmp_path, fresh)
  assert fresh.kernel.layer_axis == ((0, None),)
  assert "float32(layers:4, 4, 4)" in repr(sr.state(fresh))


def test_layer_axis_survives_split_merge_and_pytree_round_trips():
  stack = named_stack()
  merged = sr.merge(*sr.split(stack))
  assert merged.w.metadata == stack.w.metadata
  mapped = jax.tree.map(lambda x: x + 1, sr.state(stack))
  assert "layers:4" in repr(mapped)


def test_a_state_of_partition_specs_prints_without_addresses():
  text = repr(sr.get_partition_spec(named_stack()))
  assert "value=P('layers', 'embed', 'mlp')" in text and "0x" not in text
