"""split / merge / update / state / graphdef / clone, with property-based round trips."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import statefulremat as sr


class Node(sr.Module):
  """A bare module the random graphs are made of."""


class Custom(sr.Variable):
  pass


class Weight(sr.Param):
  pass


Pair = collections.namedtuple("Pair", "left right")

KINDS = [sr.Param, sr.BatchStat, sr.Cache, sr.Intermediate, sr.Variable, Custom, Weight]
METADATA = [
  {},
  {"sharding": ("embed", None)},
  {"tag": 3},
  {"init": {"scale": [1, 2]}},
  {"a": 1, "b": "x"},
]
STATICS = st.one_of(
  st.integers(-3, 3),
  st.booleans(),
  st.none(),
  st.text(max_size=2),
  st.floats(-2, 2, allow_nan=False, width=32),
  st.tuples(st.integers(0, 2)),
  st.frozensets(st.integers(0, 2), max_size=2),
  st.just(jnp.float32),
)
DICT_KEYS = ["x", "y", 0, 7, "not-an-identifier"]


def random_graph(data, budget=40):
  """Draws a module graph: nesting, containers, kinds, sharing and cycles."""
  modules, variables = [], []
  left = [budget]

  def new_variable():
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    shape = data.draw(st.sampled_from([(), (1,), (2,), (2, 3)]), label="shape")
    metadata = data.draw(st.sampled_from(METADATA), label="metadata")
    # Every variable gets distinct numbers, so a swapped value cannot go unnoticed.
    start = 10.0 * len(variables)
    value = jnp.arange(start, start + int(np.prod(shape)), dtype=jnp.float32)
    var = kind(value.reshape(shape), **metadata)
    variables.append(var)
    return var

  def new_value(depth):
    left[0] -= 1
    choices = ["variable", "static"]
    if depth < 4 and left[0] > 0:
      choices = ["module", "list", "variable", "dict", "tuple", "namedtuple", "static"]
    if variables:
      choices.append("shared variable")
    if modules:
      choices.append("shared module")
    choice = data.draw(st.sampled_from(choices), label="choice")
    if choice == "static":
      return data.draw(STATICS, label="static")
    if choice == "variable":
      return new_variable()
    if choice == "shared variable":
      return data.draw(st.sampled_from(variables), label="shared variable")
    if choice == "shared module":  # may be an ancestor: a reference cycle
      return data.draw(st.sampled_from(modules), label="shared module")
    if choice == "module":
      return new_module(depth + 1)
    if choice == "namedtuple":
      return Pair(new_value(depth + 1), new_value(depth + 1))
    if choice == "dict":
      keys = data.draw(st.lists(st.sampled_from(DICT_KEYS), unique=True, max_size=3))
      return {k: new_value(depth + 1) for k in keys}
    n = data.draw(st.integers(0, 3), label="length")
    items = [new_value(depth + 1) for _ in range(n)]
    return items if choice == "list" else tuple(items)

  def new_module(depth):
    module = Node()
    modules.append(module)
    for i in range(data.draw(st.integers(1, 4), label="attributes")):
      setattr(module, f"attr{i}", new_value(depth))
    return module

  return new_module(0)


def assert_same_graph(a, b, *, fresh=True):
  """a and b have the same structure, values and sharing (one-to-one object map)."""
  forward, backward = {}, {}

  def walk(x, y, path):
    if isinstance(x, (sr.Module, sr.Variable)):
      assert type(x) is type(y), path
      if fresh:
        assert x is not y, path
      if id(x) in forward:
        assert forward[id(x)] is y, f"sharing differs at {path}"
        return
      assert id(y) not in backward, f"extra sharing at {path}"
      forward[id(x)], backward[id(y)] = y, x
      if isinstance(x, sr.Variable):
        assert x.metadata == y.metadata, path
        assert jnp.shape(x.value) == jnp.shape(y.value), path
        np.testing.assert_array_equal(x.value, y.value, err_msg=str(path))
        return
      xa = {k: v for k, v in vars(x).items() if not k.startswith("_sr_")}
      ya = {k: v for k, v in vars(y).items() if not k.startswith("_sr_")}
      assert sorted(xa) == sorted(ya), path
      for k in xa:
        walk(xa[k], ya[k], path + (k,))
    elif isinstance(x, (list, tuple)):
      assert type(x) is type(y) and len(x) == len(y), path
      for i, (xi, yi) in enumerate(zip(x, y)):
        walk(xi, yi, path + (i,))
    elif isinstance(x, dict):
      assert type(x) is type(y) and list(x) == list(y), path
      for k in x:
        walk(x[k], y[k], path + (k,))
    else:
      assert type(x) is type(y) and x == y, path

  walk(a, b, ())
  return forward


def assert_states_equal(s1, s2):
  assert jax.tree.structure(s1) == jax.tree.structure(s2)
  assert list(s1.flat()) == list(s2.flat())
  for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(x, y)


def distinct_variables(root):
  seen = {}

  def walk(x):
    if isinstance(x, sr.Variable):
      seen[id(x)] = x
    elif isinstance(x, sr.Module):
      if id(x) in seen:
        return
      seen[id(x)] = x
      for k, v in vars(x).items():
        if not k.startswith("_sr_"):
          walk(v)
    elif isinstance(x, (list, tuple)):
      for v in x:
        walk(v)
    elif isinstance(x, dict):
      for v in x.values():
        walk(v)

  walk(root)
  return [v for v in seen.values() if isinstance(v, sr.Variable)]


GRAPH_SETTINGS = settings(
  max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- property-based round trips ----------------------------------------------------


@GRAPH_SETTINGS
@given(st.data())
def test_split_merge_round_trip(data):
  model = random_graph(data)
  graphdef, state = sr.split(model)
  rebuilt = sr.merge(graphdef, state)
  assert_same_graph(model, rebuilt)
  assert len(graphdef.var_paths) == len(distinct_variables(model))
  assert len(jax.tree.leaves(state)) == len(distinct_variables(model))

  graphdef2, state2 = sr.split(rebuilt)
  assert graphdef2 == graphdef and hash(graphdef2) == hash(graphdef)
  assert_states_equal(state, state2)
  assert sr.graphdef(model) == graphdef
  assert_states_equal(sr.state(model), state)


@GRAPH_SETTINGS
@given(st.data())
def test_graphdef_typed_view_matches_the_graph(data):
  """``GraphDef.nodes`` reads back every module, Variable, container and static value
  at its place; ``GraphDef.variables`` gives each Variable's path, kind and metadata."""
  model = random_graph(data)
  graphdef, state = sr.split(model)
  seen: list = []

  def check(node, obj, path):
    if node.kind == "ref":
      assert seen[node.value] is obj
      return
    if node.kind in ("module", "variable"):
      seen.append(obj)
    assert node.type is type(obj) or node.kind == "static"
    if node.kind == "variable":
      return
    if node.kind == "static":
      assert node.value == obj and node.type is type(obj)
      return
    if node.kind == "module":
      children = {k: v for k, v in vars(obj).items() if not k.startswith("_sr_")}
      assert [k for k, _ in node.items] == sorted(children)
    elif node.kind == "dict":
      children = obj
      assert [k for k, _ in node.items] == list(obj)
    else:
      assert node.kind == ("list" if isinstance(obj, list) else "tuple")
      children = dict(enumerate(obj))
    for key, sub in node.items:
      check(sub, children[key], path + (key,))

  (root,) = graphdef.nodes
  check(root, model, ())
  entries = graphdef.variables
  assert [e.path for e in entries] == list(graphdef.var_paths) == list(state.flat())
  variables = [v for v in seen if isinstance(v, sr.Variable)]
  assert [e.kind for e in entries] == [type(v) for v in variables]
  rebuilt = sr.State.from_parts(
    [e.path for e in entries],
    [e.kind for e in entries],
    [e.metadata for e in entries],
    jax.tree.leaves(state),
  )
  assert_states_equal(rebuilt, state)
  assert_same_graph(sr.merge(graphdef, rebuilt), model)


@GRAPH_SETTINGS
@given(st.data())
def test_split_with_filters_partitions_every_variable_once(data):
  model = random_graph(data)
  filters = (sr.Param, "batch_stats", sr.PathContains("attr0"), ...)
  graphdef, *states = sr.split(model, *filters)
  assert len(states) == len(filters)
  paths = [p for s in states for p in s.flat()]
  assert sorted(paths, key=repr) == sorted(graphdef.var_paths, key=repr)
  assert len(set(paths)) == len(paths)
  params, stats, under_attr0, _ = states
  assert all(issubclass(k, sr.Param) for k in params._spec.kinds)
  assert all(k.collection == "batch_stats" for k in stats._spec.kinds)
  assert all("attr0" in p for p in under_attr0.flat())
  assert_same_graph(model, sr.merge(graphdef, *states))
  assert_same_graph(model, sr.merge(graphdef, *reversed(states)))


@GRAPH_SETTINGS
@given(st.data())
def test_clone_and_update(data):
  model = random_graph(data)
  copy = sr.clone(model)
  assert_same_graph(model, copy)

  before = {id(v): v for v in distinct_variables(model)}
  old = {i: v.value for i, v in before.items()}
  sr.update(model, jax.tree.map(lambda x: x + 1, sr.state(model)))
  assert {id(v) for v in distinct_variables(model)} == set(before)
  for i, var in before.items():  # shared variables are written once, not twice
    np.testing.assert_array_equal(var.value, old[i] + 1)
  # The clone is independent of the model it was copied from.
  for var in distinct_variables(copy):
    assert id(var) not in before


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_static_attribute_change_changes_graphdef(data):
  model = random_graph(data)
  before = sr.graphdef(model)
  model.config = data.draw(STATICS)
  after = sr.graphdef(model)
  assert after != before
  again = sr.graphdef(model)
  assert again == after and hash(again) == hash(after)


# -- GraphDef ----------------------------------------------------------------------


class Block(sr.Module):
  def __init__(self, n, scale=1):
    self.scale = scale
    self.kernel = sr.Param(jnp.ones((n, n)))
    self.mean = sr.BatchStat(jnp.zeros(n))


def test_graphdef_equal_for_equal_structure():
  g1, g2 = sr.graphdef(Block(2)), sr.graphdef(Block(2))
  assert g1 == g2 and hash(g1) == hash(g2)
  assert len({g1, g2}) == 1
  assert g1.var_paths == (("kernel",), ("mean",))


def test_graphdef_ignores_values_but_not_shapes_kinds_or_statics():
  base = sr.graphdef(Block(2))
  other = Block(2)
  other.kernel.value = other.kernel.value * 5
  assert sr.graphdef(other) == base
  assert sr.graphdef(Block(2, scale=3)) != base
  kind = Block(2)
  kind.mean = sr.Cache(jnp.zeros(2))
  assert sr.graphdef(kind) != base
  meta = Block(2)
  meta.kernel.set_metadata(sharding=("a", "b"))
  assert sr.graphdef(meta) != base


@pytest.mark.parametrize("a, b", [(1, 1.0), (1, True), (0, False), (2.0, np.float32(2))])
def test_graphdef_tells_equal_statics_of_other_types_apart(a, b):
  assert a == b
  assert sr.graphdef(Block(2, scale=a)) != sr.graphdef(Block(2, scale=b))
  rebuilt = sr.merge(*sr.split(Block(2, scale=b)))
  assert type(rebuilt.scale) is type(b)


def test_graphdef_is_a_jit_static_argument():
  traces = []

  @functools.partial(jax.jit, static_argnums=0)
  def apply(graphdef, state, x):
    traces.append(None)
    model = sr.merge(graphdef, state)
    return x @ model.kernel.value * model.scale

  g1, s1 = sr.split(Block(2, scale=2))
  np.testing.assert_allclose(apply(g1, s1, jnp.ones((1, 2))), [[4.0, 4.0]])
  g2, s2 = sr.split(Block(2, scale=2))
  apply(g2, s2, jnp.ones((1, 2)))
  assert len(traces) == 1  # an equal GraphDef hits the cache
  g3, s3 = sr.split(Block(2, scale=3))
  np.testing.assert_allclose(apply(g3, s3, jnp.ones((1, 2))), [[6.0, 6.0]])
  assert len(traces) == 2


def test_graphdef_repr():
  assert repr(sr.graphdef(Block(2))) == (
    "GraphDef(Block(kernel=Param(), mean=BatchStat(), scale=1))"
  )


# -- split / merge / state ---------------------------------------------------------


def test_split_default_is_one_state():
  graphdef, state = sr.split(Block(2))
  assert isinstance(graphdef, sr.GraphDef) and isinstance(state, sr.State)
  assert set(state.flat()) == {("kernel",), ("mean",)}


def test_shared_variable_appears_once_under_its_first_path():
  class Two(sr.Module):
    def __init__(self):
      self.a = Block(2)
      self.b = Block(2)
      self.b.kernel = self.a.kernel

  model = Two()
  graphdef, state = sr.split(model)
  assert ("a", "kernel") in state.flat() and ("b", "kernel") not in state.flat()
  rebuilt = sr.merge(graphdef, state)
  assert rebuilt.a.kernel is rebuilt.b.kernel


def test_cycle_round_trips():
  a, b = Node(), Node()
  a.child, b.parent = b, a
  a.w = sr.Param(jnp.ones(1))
  b.ws = [a.w, sr.Param(jnp.zeros(1))]
  rebuilt = sr.merge(*sr.split(a))
  assert rebuilt.child.parent is rebuilt
  assert rebuilt.child.ws[0] is rebuilt.w


def test_split_of_a_list_of_modules_and_of_a_variable():
  m1, m2 = Block(2), Block(3)
  graphdef, state = sr.split([m1, m2])
  assert set(state.flat()) == {(0, "kernel"), (0, "mean"), (1, "kernel"), (1, "mean")}
  r1, r2 = sr.merge(graphdef, state)
  assert r1.kernel.shape == (2, 2) and r2.kernel.shape == (3, 3)
  var = sr.Param(jnp.ones(2))
  g, s = sr.split(var)
  assert s.flat().keys() == {()}
  assert type(sr.merge(g, s)) is sr.Param


def test_state_with_several_filters_is_a_tuple():
  params, stats = sr.state(Block(2), sr.Param, sr.BatchStat)
  assert set(params.flat()) == {("kernel",)} and set(stats.flat()) == {("mean",)}
  assert set(sr.state(Block(2), "params").flat()) == {("kernel",)}


def test_split_leftover_variable_error():
  with pytest.raises(
    sr.StateMismatchError,
    match=r"the variable `mean` \(BatchStat, "
    r"collection 'batch_stats'\) matches none of the filters",
  ):
    sr.split(Block(2), sr.Param)


def test_merge_keeps_metadata_and_kinds():
  model = Block(2)
  model.kernel.set_metadata(sharding=("in", "out"), init={"scale": [1.0, 2.0]})
  rebuilt = sr.clone(model)
  assert type(rebuilt.kernel) is sr.Param
  assert rebuilt.kernel.metadata == {"sharding": ("in", "out"), "init": {"scale": [1.0, 2.0]}}


def test_merged_objects_know_their_paths():
  class Outer(sr.Module):
    def __init__(self):
      self.layers = [Block(2)]

  rebuilt = sr.clone(Outer())
  assert rebuilt.layers[0].kernel.path_str() == "layers[0].kernel"


def test_merged_lists_are_tracked_containers():
  class Outer(sr.Module):
    def __init__(self):
      self.layers = [Block(2)]
      self.named = {"x": Block(2)}

  rebuilt = sr.clone(Outer())
  assert type(rebuilt.layers) is sr.ModuleList
  assert type(rebuilt.named) is sr.ModuleDict


@pytest.mark.parametrize("fn", [sr.split, sr.state, sr.graphdef, sr.update, sr.clone])
def test_non_graph_argument_is_refused(fn):
  name = fn.__name__
  with pytest.raises(
    TypeError,
    match=rf"sr\.{name} takes a Module \(or a list/tuple/"
    r"dict of them\), got int",
  ):
    fn(3)


# -- errors on unhashable or array static attributes --------------------------------


@pytest.mark.parametrize(
  "value, what",
  [
    ({1, 2}, "holds a set, which is not hashable"),
    (bytearray(b"x"), "holds a bytearray, which is not hashable"),
  ],
)
def test_unhashable_static_attribute(value, what):
  model = Block(2)
  model.bad = value
  with pytest.raises(
    sr.GraphError,
    match=rf"attribute `bad` {what}.*Fix: use a tuple "
    r"or a frozen dataclass",
  ):
    sr.split(model)


@pytest.mark.parametrize("value", [np.zeros(3, np.float32), jnp.zeros(3)])
def test_array_as_plain_attribute(value):
  model = Block(2)
  model.table = value
  with pytest.raises(
    sr.GraphError,
    match=r"attribute `table` holds an array "
    r"\(float32\[3\]\) that is not in a Variable.*Fix: wrap it, e\.g\. "
    r"`self\.w = sr\.Param\(w\)`",
  ):
    sr.graphdef(model)


def test_nested_bad_attribute_path():
  class Outer(sr.Module):
    def __init__(self):
      self.layers = [Block(2), Block(2)]

  model = Outer()
  model.layers[1].opts = {"keep": {3}}
  with pytest.raises(
    sr.GraphError,
    match=r"attribute `layers\[1\]\.opts\.keep` holds "
    r"a set",
  ):
    sr.split(model)
  model.layers[1].opts = ({3},)
  with pytest.raises(sr.GraphError, match=r"attribute `layers\[1\]\.opts\[0\]` holds"):
    sr.state(model)


def test_graph_error_is_a_type_error_and_a_library_error():
  model = Block(2)
  model.bad = {1}
  with pytest.raises(TypeError):
    sr.split(model)
  with pytest.raises(sr.StatefulRematError):
    sr.split(model)


def test_unhashable_metadata():
  model = Block(2)
  model.kernel.set_metadata(axes={"a"})
  with pytest.raises(
    sr.GraphError,
    match=r"the metadata of `kernel` is not hashable.*"
    r"Use tuples, strings and numbers in metadata",
  ):
    sr.split(model)


# -- merge errors ------------------------------------------------------------------


def test_merge_missing_state_entry():
  graphdef, params, stats = sr.split(Block(2), sr.Param, ...)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"sr\.merge: no value for the "
    r"variable `mean`\. Pass every State that sr\.split returned",
  ):
    sr.merge(graphdef, params)
  with pytest.raises(
    sr.StateMismatchError,
    match=r"no value for the variable `kernel` "
    r"\(and 1 more\)",
  ):
    sr.merge(graphdef)


def test_merge_extra_state_entry():
  graphdef, state = sr.split(Block(2))
  extra = sr.State.merge(state, sr.state(Node.__new__(Node)), sr.state(_with_extra()))
  with pytest.raises(
    sr.StateMismatchError,
    match=r"sr\.merge: the State has an entry "
    r"`extra` that the GraphDef has no variable for",
  ):
    sr.merge(graphdef, extra)


def _with_extra():
  model = Block(2)
  model.extra = sr.Param(jnp.ones(1))
  return model


def test_merge_needs_a_graphdef():
  _, state = sr.split(Block(2))
  with pytest.raises(
    TypeError,
    match=r"sr\.merge takes a GraphDef first \(from "
    r"sr\.split\), got State",
  ):
    sr.merge(state)


def test_state_mismatch_error_is_a_value_error():
  graphdef, params, _ = sr.split(Block(2), sr.Param, ...)
  with pytest.raises(ValueError):
    sr.merge(graphdef, params)


# -- update ------------------------------------------------------------------------


def test_update_writes_in_place():
  model = Block(2)
  kernel = model.kernel
  sr.update(model, jax.tree.map(jnp.zeros_like, sr.state(model, sr.Param)))
  assert model.kernel is kernel
  np.testing.assert_array_equal(model.kernel.value, np.zeros((2, 2)))
  np.testing.assert_array_equal(model.mean.value, np.zeros(2))


def test_update_with_several_states_and_none():
  model = Block(2)
  params, stats = sr.state(model, sr.Param, sr.BatchStat)
  sr.update(model, jax.tree.map(lambda x: x + 1, params), jax.tree.map(lambda x: x + 2, stats))
  np.testing.assert_array_equal(model.kernel.value, np.full((2, 2), 2.0))
  np.testing.assert_array_equal(model.mean.value, np.full(2, 2.0))
  sr.update(model)
  np.testing.assert_array_equal(model.mean.value, np.full(2, 2.0))


def test_update_from_an_equally_structured_module():
  src, dst = Block(2), Block(2)
  src.kernel.value = src.kernel.value * 3
  sr.update(dst, sr.state(src))
  np.testing.assert_array_equal(dst.kernel.value, np.full((2, 2), 3.0))


def test_update_unknown_path_errors_and_writes_nothing():
  model = Block(2)
  state = jax.tree.map(jnp.zeros_like, sr.state(_with_extra()))
  with pytest.raises(
    sr.StateMismatchError,
    match=r"sr\.update: the State has an entry "
    r"`extra` but the module has no variable at that path \(nothing "
    r"was written\)",
  ):
    sr.update(model, state)
  np.testing.assert_array_equal(model.kernel.value, np.ones((2, 2)))


def test_update_takes_states():
  with pytest.raises(
    TypeError,
    match=r"sr\.update takes States after the module, got "
    r"dict",
  ):
    sr.update(Block(2), {"kernel": jnp.zeros((2, 2))})


def test_update_rolls_back_when_a_write_fails():
  model = Block(2)

  @jax.jit
  def leak(x):
    # The kernel's value is concrete (written), the mean's a tracer (refused).
    state = sr.State({("kernel",): np.zeros((2, 2), np.float32), ("mean",): x})
    sr.update(model, state)
    return x

  with pytest.raises(sr.TraceContextError, match=r"`mean` \(BatchStat\)"):
    leak(jnp.ones(2))
  np.testing.assert_array_equal(model.kernel.value, np.ones((2, 2)))
  np.testing.assert_array_equal(model.mean.value, np.zeros(2))


# -- clone -------------------------------------------------------------------------


def test_clone_gives_new_objects_with_equal_values():
  model = Block(2)
  copy = sr.clone(model)
  assert copy is not model and copy.kernel is not model.kernel
  np.testing.assert_array_equal(copy.kernel.value, model.kernel.value)
  copy.kernel.value = copy.kernel.value * 0
  np.testing.assert_array_equal(model.kernel.value, np.ones((2, 2)))
  assert sr.graphdef(copy) == sr.graphdef(model)
