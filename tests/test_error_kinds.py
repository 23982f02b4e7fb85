"""One base and five kinds: every error statefulremat raises on purpose is one of them.

The folded classes (sr.RematPlanError, sr.ShardingError, sr.interop.InteropError) still
resolve, with a DeprecationWarning naming the kind they became, for one release.
"""

import os
import types

import jax
import jax.numpy as jnp
import pytest

import statefulremat as sr

KINDS = {
  sr.TraceContextError: (),
  sr.GraphError: (TypeError,),
  sr.StateMismatchError: (ValueError,),
  sr.TransformError: (ValueError,),
  sr.CheckpointError: (),
}


def _public_exceptions(module, prefix: str, seen: set) -> dict[str, type]:
  """Every exception class a public name of ``module`` (and its public submodules) is."""
  found = {}
  if module.__name__ in seen:
    return found
  seen.add(module.__name__)
  for name, value in vars(module).items():
    if name.startswith("_"):
      continue
    if isinstance(value, types.ModuleType):
      parts = value.__name__.split(".")
      if parts[0] == "statefulremat" and not any(p.startswith("_") for p in parts):
        found.update(_public_exceptions(value, f"{prefix}.{name}", seen))
    elif isinstance(value, type) and issubclass(value, BaseException):
      found[f"{prefix}.{name}"] = value
  return found


def test_the_public_exceptions_are_the_base_and_five_kinds():
  found = _public_exceptions(sr, "sr", set())
  assert set(found.values()) == {sr.StatefulRematError, *KINDS}, sorted(found)
  for kind, builtins in KINDS.items():
    assert kind.__bases__ == (sr.StatefulRematError, *builtins)
  assert not set(sr.interop.__all__) & {"InteropError"}
  assert not {"RematPlanError", "ShardingError"} & set(dir(sr))
  assert "InteropError" not in dir(sr.interop)


def test_a_missing_checkpoint_is_a_checkpoint_error_and_file_not_found(tmp_path):
  # The one detail under a kind: `except FileNotFoundError: start fresh` resumes.
  with pytest.raises(sr.CheckpointError) as info:
    sr.restore(os.fspath(tmp_path / "none"), sr.nn.Linear(2, 2, rngs=sr.Rngs(0)))
  assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize(
  "old, kind",
  [
    ("RematPlanError", sr.TransformError),
    ("ShardingError", sr.StateMismatchError),
    ("interop.InteropError", sr.StateMismatchError),
  ],
)
def test_a_folded_name_resolves_to_its_kind_with_a_warning(old, kind):
  module = sr.interop if old.startswith("interop.") else sr
  with pytest.warns(DeprecationWarning, match=rf"sr\.{old} is folded into sr\.{kind.__name__}"):
    assert getattr(module, old.rpartition(".")[2]) is kind


# -- one real misuse per kind -----------------------------------------------------------


def test_a_traced_value_leaking_into_a_variable_is_a_trace_context_error():
  w = sr.Param(jnp.zeros(2))

  def leak(x):
    w.value = x
    return x

  with pytest.raises(sr.TraceContextError):
    jax.jit(leak)(jnp.ones(2))


def test_a_module_outside_argument_0_is_a_graph_error_and_a_type_error():
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  scan = sr.scan(lambda m, c, x: (c, x), length=2)
  with pytest.raises(sr.GraphError, match=r"the carry `\[1\]` is a Linear") as info:
    scan(model, (jnp.ones(2), model), None)
  assert isinstance(info.value, TypeError)


def test_an_array_outside_a_variable_is_a_graph_error():
  class Bad(sr.Module):
    def __init__(self):
      self.w = jnp.zeros(2)

  with pytest.raises(sr.GraphError, match="attribute `w` holds an array"):
    sr.split(Bad())


def test_variables_that_do_not_map_are_a_state_mismatch_error():
  model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  with pytest.raises(sr.StateMismatchError, match=r"linen has no `params/bias`"):
    sr.interop.from_linen(model, {"params": {"kernel": jnp.zeros((2, 3))}})
  with pytest.raises(sr.StateMismatchError, match="has an entry `weight` but the module has no"):
    sr.update(model, sr.State({"weight": jnp.zeros((2, 3))}))


def test_a_sharding_that_does_not_fit_the_array_is_a_state_mismatch_error():
  layer = sr.nn.Linear(2, 4, kernel_metadata={"sharding": ("embed",)}, rngs=sr.Rngs(0))
  with pytest.raises(sr.StateMismatchError, match=r"`kernel` has sharding=\('embed',\)"):
    sr.get_partition_spec(layer)


def test_a_transform_or_plan_asked_the_impossible_is_a_transform_error():
  with pytest.raises(sr.TransformError, match=r"lengths=\(\) must be a non-empty"):
    sr.remat_scan(lambda m, c: c, lengths=())
  stack = sr.vmap(sr.nn.Linear, axis_size=5)(4, 4, rngs=sr.Rngs(0))
  carry = jax.ShapeDtypeStruct((2, 4), jnp.float32)
  with pytest.raises(sr.TransformError, match="is not an amount of memory"):
    sr.plan_remat(stack, carry, memory_budget="lots")
  with pytest.raises(sr.TransformError, match=r"each rule is a \(logical name, mesh axis\)"):
    sr.logical_to_mesh(jax.sharding.PartitionSpec("mlp"), ["mlp"])


def test_a_directory_that_is_not_a_checkpoint_is_a_checkpoint_error(tmp_path):
  (tmp_path / "notes.txt").write_text("")
  with pytest.raises(sr.CheckpointError) as info:
    sr.restore(os.fspath(tmp_path), sr.nn.Linear(2, 2, rngs=sr.Rngs(0)))
  assert not isinstance(info.value, OSError)
