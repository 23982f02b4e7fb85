"""Rngs: named PRNG streams whose counters live in State."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr


def data(key):
  return np.asarray(jax.random.key_data(key))


def same(k1, k2):
  return np.array_equal(data(k1), data(k2))


# -- construction ------------------------------------------------------------------


def test_single_seed_makes_a_default_stream():
  rngs = sr.Rngs(0)
  assert rngs.stream_names() == ["default"]
  assert "default" in rngs and "params" not in rngs
  assert isinstance(rngs.default, sr.RngStream)


def test_named_seeds():
  rngs = sr.Rngs(params=0, dropout=1)
  assert sorted(rngs.stream_names()) == ["dropout", "params"]
  assert not same(rngs.params(), rngs.dropout())


def test_default_and_named_seeds():
  rngs = sr.Rngs(0, dropout=1)
  assert sorted(rngs.stream_names()) == ["default", "dropout"]
  assert same(rngs.dropout(), sr.Rngs(dropout=1).dropout())
  assert same(rngs.params(), sr.Rngs(0).default())


def test_default_keyword_is_the_same_as_positional():
  assert same(sr.Rngs(default=3).params(), sr.Rngs(3).params())


def test_keys_are_typed_keys():
  key = sr.Rngs(0).params()
  assert key.shape == ()
  assert jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  jax.random.normal(key, (2,))


# -- drawing -----------------------------------------------------------------------


def test_draws_are_fresh_and_advance_the_counter():
  rngs = sr.Rngs(params=0, dropout=1)
  k1 = rngs.dropout()
  k2 = rngs["dropout"]()
  k3 = rngs.dropout()
  assert not same(k1, k2) and not same(k2, k3) and not same(k1, k3)
  assert int(rngs.dropout.count.value) == 3
  assert int(rngs.params.count.value) == 0


def test_draw_is_the_base_key_folded_with_the_count():
  rngs = sr.Rngs(5)
  base = jax.random.key(5)
  for i in range(3):
    assert same(rngs.default(), jax.random.fold_in(base, i))


def test_equal_seeds_draw_equal_keys():
  a, b = sr.Rngs(params=7), sr.Rngs(params=7)
  for _ in range(3):
    assert same(a.params(), b.params())


def test_default_stream_serves_absent_names():
  rngs = sr.Rngs(0, dropout=1)
  k_params = rngs.params()
  k_other = rngs["anything"]()
  assert not same(k_params, k_other)
  assert int(rngs.default.count.value) == 2
  assert int(rngs.dropout.count.value) == 0
  assert rngs.params is rngs.default


def test_absent_stream_without_default_attribute():
  rngs = sr.Rngs(params=0)
  with pytest.raises(
    AttributeError,
    match=r"this Rngs has no 'dropout' stream and no "
    r"default stream \(it has \['params'\]\)\. Fix: add one, e\.g\. "
    r"sr\.Rngs\(dropout=0, \.\.\.\), or give a default seed: "
    r"sr\.Rngs\(0\)",
  ):
    rngs.dropout()


def test_absent_stream_without_default_item():
  rngs = sr.Rngs(params=0)
  with pytest.raises(AttributeError, match=r"no 'dropout' stream and no default stream"):
    rngs["dropout"]
  assert not hasattr(rngs, "dropout")


def test_private_names_are_not_served_by_the_default_stream():
  rngs = sr.Rngs(0)
  for name in ["_repr_html_", "_ipython_display_", "__deepcopy__", "_sr_anything"]:
    assert not hasattr(rngs, name)
  assert int(rngs.default.count.value) == 0


# -- errors at construction --------------------------------------------------------


def test_needs_a_seed():
  with pytest.raises(
    ValueError,
    match=r"Rngs needs a seed: sr\.Rngs\(0\) or "
    r"sr\.Rngs\(params=0, dropout=1\)",
  ):
    sr.Rngs()


@pytest.mark.parametrize(
  "name",
  [
    "fork",
    "stream_names",
    "default_stream",
    "train",
    "eval",
    "set_attributes",
    "iter_modules",
    "iter_variables",
  ],
)
def test_reserved_names(name):
  with pytest.raises(
    ValueError,
    match=rf"'{name}' cannot name an RNG stream: it is an "
    rf"Rngs method \(`rngs\.{name}`\)",
  ):
    sr.Rngs(**{name: 0})


def test_private_stream_names_are_refused():
  with pytest.raises(
    ValueError,
    match=r"'_hidden' cannot name an RNG stream: names "
    r"starting with '_' are reserved",
  ):
    sr.Rngs(_hidden=0)


def test_two_default_seeds_are_refused():
  with pytest.raises(ValueError, match=r"Rngs got two default seeds"):
    sr.Rngs(0, default=1)


@pytest.mark.parametrize(
  "seed, shown",
  [
    (1.5, r"float32\[\]"),
    (jnp.zeros(3, jnp.uint32), r"uint32\[3\]"),
    (jnp.zeros((2,), jnp.float32), r"float32\[2\]"),
  ],
)
def test_bad_seed(seed, shown):
  with pytest.raises(
    TypeError,
    match=r"an RNG seed must be an int, a typed key "
    rf"\(jax\.random\.key\) or a raw uint32 key, got {shown}",
  ):
    sr.Rngs(seed)


@pytest.mark.parametrize("seed", [None, "zero", object()])
def test_seed_that_is_not_an_array(seed):
  with pytest.raises(
    TypeError,
    match=r"an RNG seed must be an int, a typed key "
    r"\(jax\.random\.key\) or a raw uint32 key, got",
  ):
    sr.Rngs(params=seed)


# -- seeds -------------------------------------------------------------------------


def test_int_typed_key_and_raw_key_seeds_agree():
  from_int = sr.Rngs(params=3)
  from_typed = sr.Rngs(params=jax.random.key(3))
  from_raw = sr.Rngs(params=jax.random.PRNGKey(3))
  from_numpy = sr.Rngs(params=np.int64(3))
  from_array = sr.Rngs(params=jnp.array(3))
  want = from_int.params()
  for rngs in (from_typed, from_raw, from_numpy, from_array):
    assert same(rngs.params(), want)


def test_typed_key_stored_as_is():
  key = jax.random.key(11)
  rngs = sr.Rngs(key)
  assert rngs.default.key.value is key


# -- fork --------------------------------------------------------------------------


def test_fork_gives_independent_streams():
  rngs = sr.Rngs(0, dropout=1)
  child = rngs.fork()
  assert isinstance(child, sr.Rngs) and child is not rngs
  assert sorted(child.stream_names()) == ["default", "dropout"]
  # Forking drew one key from each parent stream.
  assert int(rngs.default.count.value) == 1 and int(rngs.dropout.count.value) == 1
  parent_keys = [rngs.dropout() for _ in range(3)]
  child_keys = [child.dropout() for _ in range(3)]
  for p in parent_keys:
    for c in child_keys:
      assert not same(p, c)
  assert int(rngs.dropout.count.value) == 4 and int(child.dropout.count.value) == 3


def test_forks_differ_from_each_other_and_are_reproducible():
  a, b = sr.Rngs(0).fork(), sr.Rngs(0).fork()
  assert same(a.params(), b.params())
  rngs = sr.Rngs(0)
  f1, f2 = rngs.fork(), rngs.fork()
  assert not same(f1.params(), f2.params())


# -- state -------------------------------------------------------------------------


def test_rngs_state_has_key_and_count_in_collection_rngs():
  rngs = sr.Rngs(0, dropout=1)
  state = sr.state(rngs)
  assert set(state.flat()) == {
    ("default", "key"),
    ("default", "count"),
    ("dropout", "key"),
    ("dropout", "count"),
  }
  assert set(sr.state(rngs, "rngs").flat()) == set(state.flat())
  assert set(sr.state(rngs, sr.RngCount).flat()) == {("default", "count"), ("dropout", "count")}
  assert set(sr.state(rngs, sr.RngKey).flat()) == {("default", "key"), ("dropout", "key")}
  rngs.dropout()
  assert int(sr.state(rngs)["dropout"]["count"]) == 1
  assert rngs.dropout.count.tag == "dropout"


def test_restoring_the_counter_replays_keys():
  rngs = sr.Rngs(0)
  saved = sr.state(rngs)
  first = rngs.params()
  sr.update(rngs, saved)
  assert same(rngs.params(), first)


def test_counter_advances_through_a_pure_function():
  rngs = sr.Rngs(0)
  graphdef, state = sr.split(rngs)

  @jax.jit
  def draw(state):
    inner = sr.merge(graphdef, state)
    key = inner.dropout()
    return jax.random.key_data(key), sr.state(inner)

  k1, state = draw(state)
  k2, state = draw(state)
  assert not np.array_equal(k1, k2)
  assert int(state["default"]["count"]) == 2
  sr.update(rngs, state)
  assert not same(rngs.default(), jax.random.wrap_key_data(k1))
  assert int(rngs.default.count.value) == 3


class Model(sr.Module):
  def __init__(self, rngs):
    self.w = sr.Param(jax.random.normal(rngs.params(), (2,)))
    self.rngs = rngs

  def __call__(self, x):
    return x + jax.random.normal(self.rngs.dropout(), x.shape)


def test_rngs_on_a_module_is_part_of_its_state():
  model = Model(sr.Rngs(0, dropout=1))
  state = sr.state(model)
  assert ("rngs", "dropout", "count") in state.flat()
  assert ("rngs", "default", "key") in state.flat()
  assert set(sr.state(model, "rngs").flat()) == {
    ("rngs", "default", "key"),
    ("rngs", "default", "count"),
    ("rngs", "dropout", "key"),
    ("rngs", "dropout", "count"),
  }
  params, rng_state = sr.state(model, sr.Param, sr.RngState)
  assert set(params.flat()) == {("w",)}
  assert len(rng_state.flat()) == 4
  model(jnp.zeros(2))
  assert int(sr.state(model)["rngs"]["dropout"]["count"]) == 1


def test_rngs_on_a_module_round_trips():
  model = Model(sr.Rngs(0, dropout=1))
  model(jnp.zeros(2))
  copy = sr.clone(model)
  assert isinstance(copy.rngs, sr.Rngs)
  assert int(copy.rngs.dropout.count.value) == 1
  np.testing.assert_array_equal(copy(jnp.zeros(2)), model(jnp.zeros(2)))
  assert sr.graphdef(copy) == sr.graphdef(model)


def test_shared_rngs_is_one_object_after_merge():
  class Pair(sr.Module):
    def __init__(self, rngs):
      self.a = Model(rngs)
      self.b = Model(rngs)

  pair = sr.clone(Pair(sr.Rngs(0)))
  assert pair.a.rngs is pair.b.rngs
  pair.a.rngs.dropout()
  assert int(pair.b.rngs.default.count.value) == 3  # two inits + this draw


def test_rng_stream_directly():
  stream = sr.RngStream(0, tag="noise")
  assert stream.tag == "noise" and stream.key.tag == "noise"
  k1, k2 = stream(), stream()
  assert not same(k1, k2)
  assert int(stream.count.value) == 2
  assert stream.count.value.dtype == jnp.uint32


def test_repr_has_no_addresses():
  text = repr(sr.Rngs(0, dropout=1))
  assert " at 0x" not in text
  assert "key=RngKey(value=<jax.Array key<fry>()>, tag='dropout')" in text
