"""State: a pytree of arrays keyed by path, that remembers kinds and metadata."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import statefulremat as sr


class Inner(sr.Module):
  def __init__(self, n):
    self.kernel = sr.Param(jnp.arange(n, dtype=jnp.float32), sharding=("embed",))
    self.mean = sr.BatchStat(jnp.zeros(n))


class Outer(sr.Module):
  def __init__(self):
    self.a = Inner(2)
    self.layers = [Inner(3), Inner(4)]
    self.extra = {"c": sr.Cache(jnp.ones(1))}


def assert_states_equal(s1, s2):
  assert jax.tree.structure(s1) == jax.tree.structure(s2)
  assert s1.flat().keys() == s2.flat().keys()
  for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(x, y)


# -- pytree ------------------------------------------------------------------------


def test_leaves_are_the_arrays():
  model = Outer()
  state = sr.state(model)
  leaves = jax.tree.leaves(state)
  assert len(leaves) == 7
  assert all(isinstance(x, jax.Array) for x in leaves)
  assert any(x is model.a.kernel.value for x in leaves)


def test_tree_map_keeps_paths_and_kinds():
  state = sr.state(Outer())
  doubled = jax.tree.map(lambda x: 2 * x, state)
  assert isinstance(doubled, sr.State)
  assert doubled.flat().keys() == state.flat().keys()
  np.testing.assert_array_equal(doubled["a"]["kernel"], [0.0, 2.0])
  params = doubled.filter(sr.Param)
  assert set(params.flat()) == {("a", "kernel"), ("layers", 0, "kernel"), ("layers", 1, "kernel")}


def test_paths_are_readable_keys():
  state = sr.state(Outer())
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert ".a.kernel" in paths
  assert ".layers[1].mean" in paths
  assert ".extra.c" in paths
  assert len(paths) == 7


def test_equal_structures_have_equal_specs():
  s1, s2 = sr.state(Outer()), sr.state(Outer())
  assert jax.tree.structure(s1) == jax.tree.structure(s2)
  assert hash(jax.tree.structure(s1)) == hash(jax.tree.structure(s2))


def test_different_kinds_or_metadata_give_different_specs():
  m1, m2, m3 = Inner(2), Inner(2), Inner(2)
  m2.mean = sr.Cache(jnp.zeros(2))
  m3.kernel.set_metadata(sharding=("mlp",))
  t1, t2, t3 = (jax.tree.structure(sr.state(m)) for m in (m1, m2, m3))
  assert t1 != t2 and t1 != t3


def test_jit_takes_a_state():
  state = sr.state(Outer())
  out = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))(state)
  assert isinstance(out, sr.State)
  np.testing.assert_array_equal(out["a"]["kernel"], [1.0, 2.0])


def test_optax_adam_updates_a_state():
  params = sr.state(Outer(), sr.Param)
  as_dict = {p: v for p, v in params.flat().items()}
  tx = optax.adam(0.1)

  def loss(tree):
    return sum(jnp.sum(x**2) for x in jax.tree.leaves(tree))

  opt_state = tx.init(params)
  grads = jax.grad(loss)(params)
  assert isinstance(grads, sr.State)
  updates, opt_state = tx.update(grads, opt_state, params)
  new = optax.apply_updates(params, updates)
  assert isinstance(new, sr.State)

  ref_state = tx.init(as_dict)
  ref_updates, _ = tx.update(jax.grad(loss)(as_dict), ref_state, as_dict)
  ref = optax.apply_updates(as_dict, ref_updates)
  for path, value in new.flat().items():
    np.testing.assert_allclose(value, ref[path])
  # A second step goes through the optimizer state made from a State, too.
  updates, _ = tx.update(jax.grad(loss)(new), opt_state, new)
  assert isinstance(optax.apply_updates(new, updates), sr.State)


# -- reading -----------------------------------------------------------------------


def test_indexing_walks_paths():
  model = Outer()
  state = sr.state(model)
  assert state["a"]["kernel"] is model.a.kernel.value
  assert state["layers"][1]["mean"] is model.layers[1].mean.value
  assert state["extra"]["c"] is model.extra["c"].value
  sub = state["layers"]
  assert isinstance(sub, sr.State)
  assert set(sub.flat()) == {(0, "kernel"), (0, "mean"), (1, "kernel"), (1, "mean")}


def test_mapping_protocol():
  state = sr.state(Outer())
  assert list(state) == ["a", "extra", "layers"]
  assert len(state) == 3
  assert "a" in state and "kernel" not in state
  assert state.get("missing") is None
  assert set(state.keys()) == {"a", "extra", "layers"}


def test_flat():
  model = Outer()
  flat = sr.state(model).flat()
  assert set(flat) == {
    ("a", "kernel"),
    ("a", "mean"),
    ("layers", 0, "kernel"),
    ("layers", 0, "mean"),
    ("layers", 1, "kernel"),
    ("layers", 1, "mean"),
    ("extra", "c"),
  }
  assert flat[("layers", 1, "kernel")] is model.layers[1].kernel.value


def test_missing_key_error_lists_the_keys():
  state = sr.state(Outer())
  with pytest.raises(
    KeyError,
    match=r"'b' is not in this State; its top-level keys are "
    r"\['a', 'extra', 'layers'\]",
  ):
    state["b"]
  with pytest.raises(
    KeyError,
    match=r"2 is not in this State; its top-level keys are "
    r"\[0, 1\]",
  ):
    state["layers"][2]


def test_repr_lists_paths_and_kinds():
  text = repr(sr.state(Inner(2)))
  assert (
    text
    == """\
State({
  'kernel': Param(
    value=<jax.Array([0., 1.], dtype=float32)>,
    sharding=('embed',),
  ),
  'mean': BatchStat(value=<jax.Array([0., 0.], dtype=float32)>),
})"""
  )
  assert repr(sr.State()) == "State({})"


# -- filter, split, merge ----------------------------------------------------------


def test_filter_one():
  params = sr.state(Outer()).filter(sr.Param)
  assert isinstance(params, sr.State)
  assert set(params.flat()) == {("a", "kernel"), ("layers", 0, "kernel"), ("layers", 1, "kernel")}


def test_filter_several_gives_a_tuple_and_may_overlap():
  params, everything = sr.state(Outer()).filter(sr.Param, ...)
  assert len(params.flat()) == 3 and len(everything.flat()) == 7


def test_filter_sees_full_paths():
  state = sr.state(Outer())["layers"]
  got = state.filter(sr.PathContains(1))
  assert set(got.flat()) == {(1, "kernel"), (1, "mean")}


def test_filter_needs_a_filter():
  with pytest.raises(TypeError, match=r"State\.filter needs at least one filter"):
    sr.state(Outer()).filter()


def test_split_partitions():
  params, stats, rest = sr.state(Outer()).split(sr.Param, sr.BatchStat, ...)
  assert len(params.flat()) == 3 and len(stats.flat()) == 3
  assert set(rest.flat()) == {("extra", "c")}


def test_split_first_match_wins():
  first, second = sr.state(Outer()).split(sr.Param, ...)
  assert len(first.flat()) == 3 and len(second.flat()) == 4


def test_split_leftover_names_the_path():
  with pytest.raises(
    sr.StateMismatchError,
    match=r"the variable `extra\.c` \(Cache, collection 'cache'\) "
    r"matches none of the filters.*end the filters with `\.\.\.`",
  ):
    sr.state(Outer()).split(sr.Param, sr.BatchStat)


def test_merge_combines_and_later_wins():
  state = sr.state(Outer())
  params, rest = state.split(sr.Param, ...)
  merged = sr.State.merge(params, rest)
  assert_states_equal(sr.State.merge(*state.split(sr.Param, ...)), merged)
  assert set(merged.flat()) == set(state.flat())
  zeros = jax.tree.map(jnp.zeros_like, params)
  overwritten = sr.State.merge(state, zeros)
  np.testing.assert_array_equal(overwritten["a"]["kernel"], [0.0, 0.0])
  np.testing.assert_array_equal(overwritten["extra"]["c"], [1.0])
  kept = sr.State.merge(zeros, state)
  np.testing.assert_array_equal(kept["a"]["kernel"], [0.0, 1.0])


def test_merge_takes_only_states():
  with pytest.raises(TypeError, match=r"State\.merge takes States, got dict"):
    sr.State.merge(sr.state(Outer()), {"a": 1})


def test_merge_remembers_kinds():
  params, rest = sr.state(Outer()).split(sr.Param, ...)
  merged = sr.State.merge(params, rest)
  assert set(merged.filter(sr.Param).flat()) == set(params.flat())
  assert set(merged.filter(sr.Cache).flat()) == {("extra", "c")}


# -- construction ------------------------------------------------------------------


def test_from_nested_dict():
  state = sr.State({"a": {"kernel": jnp.ones(2)}, "b": jnp.zeros(1)})
  assert set(state.flat()) == {("a", "kernel"), ("b",)}
  np.testing.assert_array_equal(state["a"]["kernel"], [1.0, 1.0])
  assert len(jax.tree.leaves(state)) == 2


def test_from_flat_tuple_dict_with_kinds():
  state = sr.State({("a", 0): jnp.ones(2), ("b",): jnp.zeros(1)}, kinds={("a", 0): sr.Param})
  assert set(state.flat()) == {("a", 0), ("b",)}
  assert set(state.filter(sr.Param).flat()) == {("a", 0)}
  assert set(state.filter(sr.Not(sr.Param)).flat()) == {("b",)}
  np.testing.assert_array_equal(state["a"][0], [1.0, 1.0])


def test_empty_state():
  state = sr.State()
  assert len(state) == 0 and state.flat() == {}
  assert jax.tree.leaves(state) == []


def test_hand_built_state_merges_into_graph_kinds():
  model = Inner(2)
  graphdef, _ = sr.split(model)
  state = sr.State({"kernel": jnp.full(2, 7.0), "mean": jnp.ones(2)})
  rebuilt = sr.merge(graphdef, state)
  assert type(rebuilt.kernel) is sr.Param and type(rebuilt.mean) is sr.BatchStat
  assert rebuilt.kernel.sharding == ("embed",)
  np.testing.assert_array_equal(rebuilt.kernel.value, [7.0, 7.0])


def test_state_is_not_hashable():
  with pytest.raises(TypeError):
    hash(sr.state(Inner(2)))
