"""Module: eager init, adopted containers, modes, iteration and repr."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr


class Dense(sr.Module):
  def __init__(self, n_in, n_out, *, rngs):
    self.kernel = sr.Param(jax.random.normal(rngs.params(), (n_in, n_out)))
    self.bias = sr.Param(jnp.zeros(n_out))

  def __call__(self, x):
    return x @ self.kernel.value + self.bias.value


class Drop(sr.Module):
  def __init__(self):
    self.deterministic = False


class Norm(sr.Module):
  def __init__(self, n):
    self.scale = sr.Param(jnp.ones(n))
    self.mean = sr.BatchStat(jnp.zeros(n))
    self.use_running_average = False


class Net(sr.Module):
  def __init__(self, *, rngs):
    self.layers = [Dense(2, 4, rngs=rngs), Dense(4, 4, rngs=rngs)]
    self.heads = {"a": Drop(), "b": (Norm(4), Drop())}
    self.norm = Norm(4)
    self.depth = 2

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


def modes(model):
  return {
    path: (getattr(m, "deterministic", None), getattr(m, "use_running_average", None))
    for path, m in model.iter_modules()
  }


# -- eager init and calls ----------------------------------------------------------


def test_eager_init_and_call():
  model = Net(rngs=sr.Rngs(0))
  assert model.layers[0].kernel.shape == (2, 4)
  assert model(jnp.ones(2)).shape == (4,)


def test_init_is_deterministic_per_seed():
  a, b, c = Net(rngs=sr.Rngs(0)), Net(rngs=sr.Rngs(0)), Net(rngs=sr.Rngs(1))
  np.testing.assert_array_equal(a.layers[0].kernel.value, b.layers[0].kernel.value)
  assert not np.array_equal(a.layers[0].kernel.value, c.layers[0].kernel.value)
  # Each layer drew its own key.
  assert not np.array_equal(a.layers[1].kernel.value[:2, :], a.layers[0].kernel.value)


def test_module_needs_no_super_init():
  class Bare(sr.Module):
    pass

  bare = Bare()
  assert list(bare.iter_variables()) == []
  assert sr.state(bare).flat() == {}


def test_works_with_sr_nn_linear():
  class Wrap(sr.Module):
    def __init__(self):
      self.inner = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))

  model = Wrap()
  assert model.inner(jnp.ones((1, 2))).shape == (1, 3)
  assert set(sr.state(model, sr.Param).flat()) == {("inner", "kernel"), ("inner", "bias")}


# -- adopted containers ------------------------------------------------------------


def test_lists_and_dicts_become_module_containers():
  model = Net(rngs=sr.Rngs(0))
  assert type(model.layers) is sr.ModuleList and isinstance(model.layers, list)
  assert type(model.heads) is sr.ModuleDict and isinstance(model.heads, dict)
  assert model.layers == list(model.layers)


def test_containers_inside_tuples_and_dicts_are_adopted():
  class Holder(sr.Module):
    pass

  holder = Holder()
  holder.t = ([Drop()], {"x": [1, 2]})
  assert type(holder.t) is tuple
  assert type(holder.t[0]) is sr.ModuleList
  assert type(holder.t[1]) is sr.ModuleDict
  assert type(holder.t[1]["x"]) is sr.ModuleList


def test_assignment_copies_the_list():
  class Holder(sr.Module):
    pass

  layers = [Drop()]
  holder = Holder()
  holder.layers = layers
  layers.append(Drop())
  assert len(holder.layers) == 1
  assert holder.layers[0] is layers[0]


def test_container_mutations_show_in_the_graph():
  model = Net(rngs=sr.Rngs(0))
  before = sr.graphdef(model)
  model.layers.append(Dense(4, 4, rngs=sr.Rngs(1)))
  assert ("layers", 2, "kernel") in sr.state(model).flat()
  assert sr.graphdef(model) != before
  model.layers.pop()
  assert sr.graphdef(model) == before
  model.heads["c"] = Drop()
  assert ("heads", "c") in dict(model.iter_modules())
  del model.heads["c"]
  model.layers += [Dense(4, 4, rngs=sr.Rngs(2))]
  assert type(model.layers) is sr.ModuleList and len(model.layers) == 3


def test_module_containers_are_pytrees():
  items = sr.ModuleList([1, 2])
  assert jax.tree.leaves(items) == [1, 2]
  assert type(jax.tree.map(lambda x: x + 1, items)) is sr.ModuleList
  named = sr.ModuleDict({"a": 1, "b": 2})
  assert jax.tree.map(lambda x: x * 10, named) == {"a": 10, "b": 20}


def test_delattr_removes_from_the_graph():
  model = Net(rngs=sr.Rngs(0))
  del model.norm
  assert not any(p[0] == "norm" for p in sr.state(model).flat())


# -- train / eval / set_attributes -------------------------------------------------


def test_train_and_eval_reach_nested_modules():
  model = Net(rngs=sr.Rngs(0))
  assert model.eval() is model
  got = modes(model)
  assert got[("heads", "a")] == (True, None)
  assert got[("heads", "b", 0)] == (None, True)
  assert got[("heads", "b", 1)] == (True, None)
  assert got[("norm",)] == (None, True)
  assert model.train() is model
  got = modes(model)
  assert got[("heads", "a")] == (False, None)
  assert got[("heads", "b", 0)] == (None, False)
  assert got[("norm",)] == (None, False)


def test_train_eval_do_not_add_attributes():
  model = Net(rngs=sr.Rngs(0))
  model.eval()
  assert "deterministic" not in vars(model.layers[0])
  assert "use_running_average" not in vars(model)


def test_eval_changes_the_graphdef():
  model = Net(rngs=sr.Rngs(0))
  train_def = sr.graphdef(model)
  model.eval()
  assert sr.graphdef(model) != train_def
  model.train()
  assert sr.graphdef(model) == train_def


def test_eval_reaches_shared_modules_and_cycles():
  model = Net(rngs=sr.Rngs(0))
  model.loop = model
  model.alias = model.heads["a"]
  model.eval()
  assert model.alias.deterministic is True


def test_set_attributes_only_where_present():
  model = Net(rngs=sr.Rngs(0))
  assert model.set_attributes(depth=5, deterministic=True, nonexistent=1) is model
  assert model.depth == 5
  assert model.heads["a"].deterministic is True
  assert not any("nonexistent" in vars(m) for _, m in model.iter_modules())


# -- iteration ---------------------------------------------------------------------


def test_iter_modules_paths():
  model = Net(rngs=sr.Rngs(0))
  paths = [p for p, _ in model.iter_modules()]
  assert paths[0] == ()
  assert set(paths) == {
    (),
    ("heads", "a"),
    ("heads", "b", 0),
    ("heads", "b", 1),
    ("layers", 0),
    ("layers", 1),
    ("norm",),
  }
  assert dict(model.iter_modules())[("layers", 1)] is model.layers[1]


def test_iter_variables_paths():
  model = Net(rngs=sr.Rngs(0))
  got = dict(model.iter_variables())
  assert set(got) == {
    ("layers", 0, "kernel"),
    ("layers", 0, "bias"),
    ("layers", 1, "kernel"),
    ("layers", 1, "bias"),
    ("heads", "b", 0, "scale"),
    ("heads", "b", 0, "mean"),
    ("norm", "scale"),
    ("norm", "mean"),
  }
  assert got[("norm", "mean")] is model.norm.mean
  # The same order and paths as the State.
  assert list(got) == list(sr.state(model).flat())


def test_iteration_yields_shared_objects_once():
  model = Net(rngs=sr.Rngs(0))
  model.again = model.layers[0]
  model.tied = model.layers[1].kernel
  modules = [m for _, m in model.iter_modules()]
  variables = [v for _, v in model.iter_variables()]
  assert len(modules) == len({id(m) for m in modules}) == 7
  assert len(variables) == len({id(v) for v in variables}) == 8
  assert dict((id(m), p) for p, m in model.iter_modules())[id(model.layers[0])] == ("again",)


def test_cycle_does_not_hang_iteration_or_repr():
  model = Net(rngs=sr.Rngs(0))
  model.layers[0].parent = model
  model.self_ref = model
  result = {}

  def run():
    result["modules"] = list(model.iter_modules())
    result["variables"] = list(model.iter_variables())
    result["repr"] = repr(model)
    result["state"] = sr.state(model)

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(timeout=20)
  assert not thread.is_alive(), "iteration or repr hung on a reference cycle"
  assert len(result["modules"]) == 7
  assert len(result["variables"]) == 8
  assert "self_ref=Net(<shared: drawn at the root>)" in result["repr"]
  assert "parent=Net(<shared: drawn at the root>)" in result["repr"]
  assert result["repr"].endswith("# shared: also at layers[0].parent, self_ref")


# -- repr --------------------------------------------------------------------------


def test_repr_is_readable():
  model = Net(rngs=sr.Rngs(0))
  text = repr(model)
  assert "object at 0x" not in text and " at 0x" not in text
  assert text.startswith(
    "Net(\n  layers=ModuleList([\n    Dense(\n      kernel=Param(\n"
    "        value=<jax.Array float32(2, 4) ≈"
  )
  assert "\n  depth=2,\n" in text
  assert "'a': Drop(deterministic=False)," in text
  assert "mean=BatchStat(\n      value=<jax.Array([0., 0., 0., 0.], dtype=float32)>,\n" in text
  assert max(map(len, text.splitlines())) <= 80


def test_repr_of_nested_module_is_indented():
  class Outer(sr.Module):
    def __init__(self):
      self.inner = Norm(2)

  assert repr(Outer()) == (
    "Outer(\n"
    "  inner=Norm(\n"
    "    scale=Param(value=<jax.Array([1., 1.], dtype=float32)>),\n"
    "    mean=BatchStat(value=<jax.Array([0., 0.], dtype=float32)>),\n"
    "    use_running_average=False,\n"
    "  ),\n"
    ")"
  )


def test_repr_of_empty_module_and_static_callables():
  class Empty(sr.Module):
    pass

  class WithFn(sr.Module):
    def __init__(self):
      self.act = jax.nn.relu
      self.dtype = jnp.float32
      self.thing = object()
      self.local = lambda x: x

  assert repr(Empty()) == "Empty()"
  assert (
    repr(WithFn())
    == """\
WithFn(
  act=jax.nn.relu,
  dtype=jax.numpy.float32,
  thing=<object>,
  local=test_repr_of_empty_module_and_static_callables.<locals>.WithFn.__init__.<locals>.<lambda>,
)"""
  )


def test_repr_of_linear_has_no_addresses():
  assert " at 0x" not in repr(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)))


# -- misc --------------------------------------------------------------------------


def test_modules_compare_by_identity_and_refuse_to_hash():
  # A hash would let jax.jit(static_argnums=...) serve a stale output (issue 22).
  a, b = Drop(), Drop()
  assert a != b and a == a
  with pytest.raises(TypeError, match="unhashable type: 'Drop'.*use `id\\(obj\\)`"):
    {a, b}
  assert len({id(a), id(b)}) == 2


def test_private_sr_attributes_are_not_part_of_the_graph():
  model = Net(rngs=sr.Rngs(0))
  before = sr.graphdef(model)
  model._sr_note = {1, 2}  # unhashable, yet not walked
  assert sr.graphdef(model) == before


@pytest.mark.parametrize("value", [[1, 2], {"k": 1}])
def test_static_containers_round_trip(value):
  class Holder(sr.Module):
    pass

  holder = Holder()
  holder.value = value
  assert sr.clone(holder).value == value
