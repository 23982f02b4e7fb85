"""Filters: every form, combinators, hashability, and the error for a non-filter."""

import jax.numpy as jnp
import pytest

import statefulremat as sr


class Block(sr.Module):
  def __init__(self):
    self.w = sr.Param(jnp.zeros(2))
    self.mean = sr.BatchStat(jnp.zeros(2))
    self.cache = sr.Cache(jnp.zeros(1))
    self.norm = Norm()


class Norm(sr.Module):
  def __init__(self):
    self.scale = sr.Param(jnp.ones(2))
    self.h = sr.Intermediate(jnp.zeros(2))


ALL = {("w",), ("mean",), ("cache",), ("norm", "scale"), ("norm", "h")}


def selected(filter):
  return set(sr.state(Block(), filter).flat())


def test_variable_type():
  assert selected(sr.Param) == {("w",), ("norm", "scale")}
  assert selected(sr.BatchStat) == {("mean",)}
  assert selected(sr.Variable) == ALL


def test_variable_subclass_matches_its_subclasses():
  class Weight(sr.Param):
    pass

  m = Block()
  m.extra = Weight(jnp.zeros(1))
  assert set(sr.state(m, sr.Param).flat()) == {("w",), ("norm", "scale"), ("extra",)}
  assert set(sr.state(m, Weight).flat()) == {("extra",)}


def test_collection_name():
  assert selected("params") == {("w",), ("norm", "scale")}
  assert selected("batch_stats") == {("mean",)}
  assert selected("intermediates") == {("norm", "h")}
  assert selected("no_such_collection") == set()


@pytest.mark.parametrize("everything", [..., True])
def test_everything(everything):
  assert selected(everything) == ALL


@pytest.mark.parametrize("nothing", [False, None])
def test_nothing(nothing):
  assert selected(nothing) == set()


def test_callable_gets_path_and_variable():
  seen = []

  def pred(path, var):
    seen.append((path, type(var)))
    return var.collection == "params" and "norm" not in path

  assert selected(pred) == {("w",)}
  assert (("norm", "scale"), sr.Param) in seen
  assert len(seen) == len(ALL)


def test_path_contains():
  assert selected(sr.PathContains("norm")) == {("norm", "scale"), ("norm", "h")}
  assert selected(sr.PathContains("w")) == {("w",)}
  assert selected(sr.PathContains("absent")) == set()


def test_path_contains_int_key():
  m = Block()
  m.layers = [Norm(), Norm()]
  got = set(sr.state(m, sr.PathContains(1)).flat())
  assert got == {("layers", 1, "scale"), ("layers", 1, "h")}


def test_not():
  assert selected(sr.Not(sr.Param)) == ALL - {("w",), ("norm", "scale")}
  assert selected(sr.Not(...)) == set()
  assert selected(sr.Not(sr.Not(sr.Param))) == {("w",), ("norm", "scale")}


def test_any_and_all():
  assert selected(sr.Any(sr.Param, "batch_stats")) == {("w",), ("norm", "scale"), ("mean",)}
  assert selected(sr.All(sr.Param, sr.PathContains("norm"))) == {("norm", "scale")}
  assert selected(sr.Any()) == set()
  assert selected(sr.All()) == ALL


def test_tuple_and_list_mean_any():
  want = {("w",), ("norm", "scale"), ("cache",)}
  assert selected((sr.Param, "cache")) == want
  assert selected([sr.Param, sr.Cache]) == want
  assert selected(((sr.Param,), [sr.Cache])) == want
  assert selected(()) == set()


def test_combinators_nest_any_form():
  f = sr.All(
    (sr.Param, sr.BatchStat), sr.Not(sr.PathContains("norm")), lambda path, v: v.shape == (2,)
  )
  assert selected(f) == {("w",), ("mean",)}


def test_predicates_are_callable_directly():
  var = sr.Param(jnp.zeros(1))
  assert sr.PathContains("a")(("a", "b"), var)
  assert not sr.Not(sr.Param)((), var)
  assert sr.Any(sr.BatchStat, sr.Param)((), var)
  assert not sr.All(sr.BatchStat, sr.Param)((), var)


def test_predicates_hash_and_compare_by_value():
  def fn(path, var):
    return True

  pairs = [
    (sr.PathContains("a"), sr.PathContains("a")),
    (sr.Not(sr.Param), sr.Not(sr.Param)),
    (sr.Any(sr.Param, "cache"), sr.Any(sr.Param, "cache")),
    (sr.All(sr.Param, sr.PathContains(0)), sr.All(sr.Param, sr.PathContains(0))),
    (sr.Not((sr.Param, ...)), sr.Not([sr.Param, True])),
    (sr.Any(fn), sr.Any(fn)),
    (sr.Not(None), sr.Not(False)),
  ]
  for a, b in pairs:
    assert a == b and hash(a) == hash(b)
  assert len({a for a, _ in pairs} | {b for _, b in pairs}) == len(pairs)


def test_different_predicates_differ():
  assert sr.PathContains("a") != sr.PathContains("b")
  assert sr.Not(sr.Param) != sr.Not(sr.BatchStat)
  assert sr.Any(sr.Param) != sr.All(sr.Param)
  assert sr.Any(sr.Param, "cache") != sr.Any("cache", sr.Param)
  assert sr.Not(lambda p, v: True) != sr.Not(lambda p, v: True)
  assert sr.PathContains("a") != "a"


def test_predicate_repr():
  assert repr(sr.PathContains("norm")) == "PathContains('norm')"
  assert "PathContains('norm')" in repr(sr.Not(sr.PathContains("norm")))


@pytest.mark.parametrize("bad", [3, 2.5, object(), b"params", {"a": 1}])
def test_non_filter_is_a_clear_type_error(bad):
  with pytest.raises(
    TypeError,
    match=r"is not a filter\. A filter is a Variable "
    r"subclass \(sr\.Param\), a collection name",
  ):
    sr.state(Block(), bad)


@pytest.mark.parametrize("bad", [int, sr.Module, Block])
def test_class_that_is_not_a_variable_kind_is_refused(bad):
  with pytest.raises(
    TypeError,
    match=rf"{bad.__name__} is a class but not a Variable "
    r"kind, so it is not a filter",
  ):
    sr.state(Block(), bad)


def test_non_filter_inside_a_combinator_is_refused():
  with pytest.raises(TypeError, match=r"3 is not a filter"):
    sr.Not(3)
  with pytest.raises(TypeError, match=r"is not a filter"):
    sr.Any(sr.Param, 3.0)
  with pytest.raises(TypeError, match=r"int is a class but not a Variable kind"):
    sr.split(Block(), (sr.Param, int), ...)
