"""Every pattern of flax's NNX transforms guide, written in nnx and in statefulremat.

The guide is flax's "Transformations" (docs_nnx/guides/transforms.md, patterns 1-13 in
the order of its code cells) with its companion "Flax NNX vs JAX transformations"
(docs_nnx/guides/jax_and_nnx_transforms.rst, patterns 14-15). Each test writes the
pattern as the guide does in nnx and as a user translates it to statefulremat, builds
the same parameters and checks the same numbers. Tests of tests/test_nnx_guide.py are
named where they cover a pattern (or its variations) too.

Guide pattern -> tests

 1. Basic example: nnx.vmap of vector_dot over a Weights module, out_axes=1
    -> test_01_vmap_applies_a_function_to_a_module_and_data
 2. Basic example: nnx.vmap of create_weights returns a stack of Weights
    -> test_02_vmap_of_a_constructor_function_returns_a_stack
       test_02_the_guides_spelling_with_in_axes_and_out_axes_equals_the_loop
       test_02_a_class_form_maps_its_seeds_with_init_in_axes
       test_02_a_class_form_refuses_seeds_broadcast_to_every_layer
       test_02_a_constructor_failing_for_another_reason_keeps_its_own_error
       test_vmap_returning_a_module_is_a_stack
 3. Transforming methods: @nnx.vmap on __init__ and on __call__
    -> test_03_vmap_decorates_init_and_call
       test_vmap_decorating_init_builds_a_stack_as_nnx
       test_class_form_maps_a_constructor_argument_with_init_in_axes
       test_remat_scan_broadcasts_extra_call_arguments
       test_scan_class_form_broadcasts_with_in_axes_none
       test_vmap_class_form_maps_extra_call_arguments_by_in_axes
 4. State propagation: a per-member count incremented inside nnx.vmap
    -> test_04_vmap_propagates_a_per_member_count
 5. Graph updates propagation: add, delete and share attributes inside nnx.vmap
    -> test_05_vmap_propagates_graph_updates
       test_jit_adds_a_variable_and_a_sub_module_as_nnx_does
       test_a_structure_change_then_an_error_changes_nothing
       test_remat_adds_a_variable
       test_scan_stacks_a_variable_made_per_iteration
       test_vmap_stacks_a_variable_made_per_member
 6. Lift types: nnx.StateAxes({nnx.Param: 0, Count: None}) broadcasts the count
    -> test_06_state_axes_broadcast_a_count
       test_broadcast_counter_incremented_inside_vmap
 7. Random state: Rngs of pre-split seeds, StateAxes({nnx.RngState: 0, ...: None})
    -> test_07_vmap_maps_the_rng_state_of_presplit_seeds
       test_rngs_of_split_keys_through_vmap
 8. Random state: nnx.split_rngs(splits=10) around nnx.vmap
    -> test_08_split_rngs_splits_an_unsplit_stream_per_call
 9. Rules: a mutable module passed by closure is an error
    -> test_09_a_module_reached_by_closure_raises
10. Consistent aliasing: one module under two in_axes is an error
    -> test_10_a_module_in_two_arguments_raises
       test_a_module_outside_argument_0_is_named_by_argument_and_path
11. Consistent aliasing between inputs and outputs: returning the module argument with
    out_axes=1 is an error, with out_axes=0 it comes back as the same objects
    -> test_11_returning_the_module_argument_under_other_out_axes_raises
       test_11_returning_the_module_argument_keeps_its_aliases
       test_returning_the_module_argument_under_its_own_axis_is_allowed
12. Axis metadata: transform_metadata={nnx.PARTITION_NAME: 'b'} over axis 1
    -> test_12_partition_name_is_removed_inside_and_back_outside
13. Axis metadata: a module made inside a zero-argument nnx.vmap(out_axes=1,
    axis_size=4) gets the partition name at axis 1
    -> test_13_modules_made_inside_vmap_get_the_partition_name
       test_vmap_of_a_function_with_no_arguments_builds_a_stack
       test_out_axes_places_the_layer_axis_of_modules_made_inside
14. NNX vs JAX transforms: a train step with nnx.jit + nnx.grad, and with jax.jit +
    jax.grad over (graphdef, state)
    -> test_14_train_step_with_jit_and_grad_and_with_raw_jax
       test_a_graphdef_is_a_pytree_without_leaves
15. Mixing NNX and JAX transforms: nnx.jit + jax.grad, jax.jit + nnx.grad
    -> test_15_mixing_sr_and_jax_transforms
"""

from __future__ import annotations

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors as flax_errors
from flax import nnx
from jax import random

import statefulremat as sr

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def val(v):
  """The array of an nnx or an sr Variable."""
  return v[...] if isinstance(v, nnx.Variable) else v.value


class Count(sr.Variable):
  pass


class NnxCount(nnx.Variable):
  pass


class Weights(sr.Module):
  def __init__(self, kernel, bias, count=None, seed=None):
    self.kernel, self.bias = sr.Param(kernel), sr.Param(bias)
    if count is not None:
      self.count = Count(count)
    if seed is not None:
      self.rngs = sr.Rngs(noise=seed)


class NnxWeights(nnx.Module):
  def __init__(self, kernel, bias, count=None, seed=None):
    self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias)
    if count is not None:
      self.count = NnxCount(count)
    if seed is not None:
      self.rngs = nnx.Rngs(noise=seed)


def batched(count=None):
  return dict(
    kernel=random.uniform(random.key(0), (10, 2, 3)), bias=jnp.zeros((10, 3)), count=count
  )


X = random.normal(random.key(1), (10, 2))


def vector_dot(weights, x):
  assert weights.kernel.ndim == 2, "Batch dimensions not allowed"
  assert x.ndim == 1, "Batch dimensions not allowed"
  return x @ weights.kernel + weights.bias


def stateful_vector_dot(weights, x):  # the guide's `weights.count += 1`, as sr takes it
  assert weights.kernel.ndim == 2 and x.ndim == 1
  weights.count += 1
  return x @ weights.kernel + weights.bias


def nnx_stateful_vector_dot(weights, x):  # nnx 0.12 spells the in-place add `[...] +=`
  assert weights.kernel.ndim == 2 and x.ndim == 1
  weights.count[...] += 1
  return x @ weights.kernel + weights.bias


# -- 1-3. basic example, transforming methods --------------------------------------------


def test_01_vmap_applies_a_function_to_a_module_and_data():
  theirs, ours = NnxWeights(**batched()), Weights(**batched())
  expected = nnx.vmap(vector_dot, in_axes=0, out_axes=1)(theirs, X)
  # as written: an explicit in_axes covers the module argument, as nnx's does
  y = sr.vmap(vector_dot, in_axes=0, out_axes=1)(ours, X)
  assert y.shape == expected.shape == (3, 10)
  close(y, expected)
  close(ours.kernel.value, val(theirs.kernel))
  # the same with the rule spelt out, and with nnx's tuple (the module's entry first)
  close(sr.vmap(vector_dot, out_axes=1, variable_axes={sr.Param: 0})(ours, X), expected)
  close(sr.vmap(vector_dot, in_axes=(0, 0), out_axes=1)(ours, X), expected)


def test_02_vmap_of_a_constructor_function_returns_a_stack():
  def create_weights(cls):
    return lambda seed: cls(kernel=random.uniform(random.key(seed), (2, 3)), bias=jnp.zeros((3,)))

  seeds = jnp.arange(10)
  theirs = nnx.vmap(create_weights(NnxWeights))(seeds)
  ours = sr.vmap(create_weights(Weights))(seeds)
  assert isinstance(ours, Weights) and len(ours) == 10
  assert ours.kernel.shape == val(theirs.kernel).shape == (10, 2, 3)
  close(ours.kernel.value, val(theirs.kernel))
  close(ours.layer(4).kernel.value, random.uniform(random.key(4), (2, 3)))
  # a stack maps by default
  close(
    sr.vmap(vector_dot, out_axes=1)(ours, X), nnx.vmap(vector_dot, in_axes=0, out_axes=1)(theirs, X)
  )


def test_02_the_guides_spelling_with_in_axes_and_out_axes_equals_the_loop():
  """nnx.vmap(create_weights, in_axes=0, out_axes=1)(seeds) as written: one seed per
  layer, the layer axis of every Variable at 1."""

  def create_weights(cls):
    return lambda seed: cls(kernel=random.uniform(random.key(seed), (2, 3)), bias=jnp.zeros((3,)))

  seeds = jnp.arange(10)
  theirs = nnx.vmap(create_weights(NnxWeights), in_axes=0, out_axes=1)(seeds)
  ours = sr.vmap(create_weights(Weights), in_axes=0, out_axes=1)(seeds)
  loop = [create_weights(Weights)(seed) for seed in range(10)]
  assert ours.kernel.shape == val(theirs.kernel).shape == (2, 10, 3) and len(ours) == 10
  close(ours.kernel.value, jnp.stack([w.kernel.value for w in loop], axis=1))
  close(ours.kernel.value, val(theirs.kernel))
  for i in (0, 7):
    close(ours.layer(i).kernel.value, loop[i].kernel.value)


class SeedWeights(sr.Module):
  """The guide's Weights built from a seed in the constructor, as a class form's layer."""

  def __init__(self, seed):
    self.kernel = sr.Param(random.uniform(random.key(seed), (2, 3)))
    self.bias = sr.Param(jnp.zeros((3,)))

  def __call__(self, x):
    return x @ self.kernel + self.bias


def test_02_a_class_form_maps_its_seeds_with_init_in_axes():
  seeds = jnp.arange(10)
  ours = sr.vmap(SeedWeights, in_axes=0, out_axes=1, init_in_axes=0)(seeds)
  loop = [SeedWeights(seed) for seed in range(10)]
  assert len(ours) == 10 and ours.kernel.shape == (10, 2, 3)  # axis_size read off seeds
  close(ours.kernel.value, jnp.stack([w.kernel.value for w in loop]))
  close(ours(X), jnp.stack([w(x) for w, x in zip(loop, X)], axis=1))  # the call's axes


def test_02_a_class_form_refuses_seeds_broadcast_to_every_layer():
  """Constructor arguments pass whole to every layer (DESIGN's class forms): a seed
  array that only a slice per layer suits is refused, naming it and init_in_axes."""
  with pytest.raises(sr.TransformError, match=r"`seed` \(int\d+\[10\]\) was broadcast") as e:
    sr.vmap(SeedWeights, in_axes=0, out_axes=1)(jnp.arange(10))
  assert "`init_in_axes=0`" in str(e.value) and "unmapped" in str(e.value)

  class Seeded(sr.Module):
    def __init__(self, scale, seed, *, rngs):
      self.linear = sr.nn.Linear(2, 3, rngs=rngs)
      self.kernel = sr.Param(scale * random.uniform(random.key(seed), (2, 3)))

  rngs = sr.Rngs(0)
  for make in (
    lambda: sr.vmap(Seeded, axis_size=4)(2.0, jnp.arange(4), rngs=rngs),
    lambda: sr.scan(Seeded, length=4, variable_axes={True: 0})(2.0, jnp.arange(4), rngs=rngs),
  ):
    with pytest.raises(
      sr.TransformError, match=r"`seed` .* every one of the 4 layers.*init_in_axes=\(None, 0\)"
    ):
      make()
  assert int(rngs.default.count.value) == 0  # nothing drawn: nothing half-made
  stack = sr.vmap(Seeded, axis_size=4, init_in_axes=(None, 0))(2.0, jnp.arange(4), rngs=rngs)
  close(stack.kernel.value[3], 2.0 * random.uniform(random.key(3), (2, 3)))


def test_02_a_constructor_failing_for_another_reason_keeps_its_own_error():
  """The argument is blamed only where one slice of it lets the layer build."""

  class Table(sr.Module):
    def __init__(self, table):
      self.w = sr.Param(table @ jnp.ones((5,)))  # (4, 3) whole or (3,) sliced: both fail

  with pytest.raises(TypeError, match=r"dot_general requires contracting dimensions"):
    sr.vmap(Table, axis_size=4)(jnp.ones((4, 3)))

  class Keyword(sr.Module):
    def __init__(self, *, seed):
      self.w = sr.Param(random.uniform(random.key(seed), (3,)))

  with pytest.raises(sr.TransformError, match=r"`seed`.*pass `seed` positionally"):
    sr.vmap(Keyword, axis_size=4)(seed=jnp.arange(4))


def test_03_vmap_decorates_init_and_call():

  class WeightStack(sr.Module):
    @sr.vmap
    def __init__(self, seed):
      self.kernel = sr.Param(random.uniform(random.key(seed), (2, 3)))
      self.bias = sr.Param(jnp.zeros((3,)))

    @sr.vmap(in_axes=0, out_axes=1)
    def __call__(self, x):
      assert self.kernel.ndim == 2, "Batch dimensions not allowed"
      assert x.ndim == 1, "Batch dimensions not allowed"
      return x @ self.kernel + self.bias

  class NnxWeightStack(nnx.Module):
    @nnx.vmap
    def __init__(self, seed):
      self.kernel = nnx.Param(random.uniform(random.key(seed), (2, 3)))
      self.bias = nnx.Param(jnp.zeros((3,)))

    @nnx.vmap(in_axes=0, out_axes=1)
    def __call__(self, x):
      return x @ self.kernel + self.bias

  ours, theirs = WeightStack(jnp.arange(10)), NnxWeightStack(jnp.arange(10))
  assert ours.kernel.shape == (10, 2, 3) and ours.kernel.path_str() == "kernel"
  close(ours.kernel.value, val(theirs.kernel))
  y = ours(X)
  assert y.shape == (3, 10)
  close(y, theirs(X))


# -- 4-5. state propagation, graph updates ---------------------------------------------


def test_04_vmap_propagates_a_per_member_count():
  theirs = NnxWeights(**batched(count=jnp.arange(10)))
  ours = Weights(**batched(count=jnp.arange(10)))
  expected = nnx.vmap(nnx_stateful_vector_dot, in_axes=0, out_axes=1)(theirs, X)
  y = sr.vmap(stateful_vector_dot, in_axes=0, out_axes=1, variable_axes={True: 0})(ours, X)
  close(y, expected)
  assert isinstance(ours.count, Count)
  np.testing.assert_array_equal(ours.count.value, val(theirs.count))
  np.testing.assert_array_equal(ours.count.value, jnp.arange(1, 11))


def test_05_vmap_propagates_graph_updates():
  def crazy_vector_dot(weights, x):
    assert weights.kernel.ndim == 2 and x.ndim == 1
    if isinstance(weights, nnx.Module):
      weights.count[...] += 1
    else:
      weights.count += 1
    y = x @ weights.kernel + weights.bias
    weights.some_property = ["a", 2, False]  # add attribute
    del weights.bias  # delete attribute
    weights.new_param = weights.kernel  # share reference
    return y

  theirs = NnxWeights(**batched(count=jnp.arange(10)))
  ours = Weights(**batched(count=jnp.arange(10)))
  kernel = ours.kernel
  expected = nnx.vmap(crazy_vector_dot, in_axes=0, out_axes=1)(theirs, X)
  y = sr.vmap(crazy_vector_dot, in_axes=0, out_axes=1, variable_axes={True: 0})(ours, X)
  close(y, expected)
  assert not hasattr(ours, "bias") and not hasattr(theirs, "bias")
  assert ours.some_property == theirs.some_property == ["a", 2, False]
  assert ours.new_param is ours.kernel is kernel and theirs.new_param is theirs.kernel
  np.testing.assert_array_equal(ours.count.value, val(theirs.count))
  assert sorted(sr.state(ours).flat()) == [("count",), ("kernel",)]  # shared: one entry
  close(ours.kernel.value, val(theirs.kernel))


# -- 6-8. lift types and random state --------------------------------------------------


def test_06_state_axes_broadcast_a_count():
  theirs = NnxWeights(**batched(count=jnp.array(0)))
  ours = Weights(**batched(count=jnp.array(0)))
  state_axes = nnx.StateAxes({nnx.Param: 0, NnxCount: None})  # broadcast Count
  expected = nnx.vmap(nnx_stateful_vector_dot, in_axes=(state_axes, 0), out_axes=1)(theirs, X)
  # what StateAxes says per collection, sr's rules say: Param mapped, Count broadcast
  y = sr.vmap(
    stateful_vector_dot,
    in_axes=0,
    out_axes=1,
    variable_axes={sr.Param: 0},
    variable_broadcast=Count,
  )(ours, X)
  close(y, expected)
  assert ours.count.value.shape == () and int(ours.count.value) == int(val(theirs.count))
  assert int(ours.count.value) == 1


def noisy_vector_dot(weights, x):
  assert weights.kernel.ndim == 2 and x.ndim == 1
  weights.count += 1
  y = x @ weights.kernel + weights.bias
  return y + random.normal(weights.rngs.noise(), y.shape)


def nnx_noisy_vector_dot(weights, x):
  assert weights.kernel.ndim == 2 and x.ndim == 1
  weights.count[...] += 1
  y = x @ weights.kernel + weights.bias
  return y + random.normal(weights.rngs.noise(), y.shape)


def unbatched(seed):
  return dict(
    kernel=random.uniform(random.key(0), (2, 3)),
    bias=jnp.zeros((3,)),
    count=jnp.array(0),
    seed=seed,
  )


def test_07_vmap_maps_the_rng_state_of_presplit_seeds():
  seeds = random.split(random.key(0), num=10)
  theirs, ours = NnxWeights(**unbatched(seeds)), Weights(**unbatched(seeds))
  state_axes = nnx.StateAxes({nnx.RngState: 0, (nnx.Param, NnxCount): None})
  step = sr.vmap(
    noisy_vector_dot, variable_axes={sr.RngState: 0}, variable_broadcast=(sr.Param, Count)
  )
  for _ in range(2):
    expected = nnx.vmap(nnx_noisy_vector_dot, in_axes=(state_axes, 0))(theirs, X)
    close(step(ours, X), expected)
  assert not jnp.allclose(step(ours, X), step(ours, X))  # the keys move on per call
  np.testing.assert_array_equal(ours.rngs.noise.count.value, jnp.full(10, 4))
  np.testing.assert_array_equal(val(theirs.rngs.noise.count), jnp.full(10, 2))
  assert int(ours.count.value) == 4 and int(val(theirs.count)) == 2


def test_08_split_rngs_splits_an_unsplit_stream_per_call():
  theirs, ours = NnxWeights(**unbatched(0)), Weights(**unbatched(0))
  state_axes = nnx.StateAxes({nnx.RngState: 0, (nnx.Param, NnxCount): None})
  nnx_step = nnx.split_rngs(splits=10)(nnx.vmap(nnx_noisy_vector_dot, in_axes=(state_axes, 0)))
  # sr splits a stream by split_rngs at each call and leaves it unsplit outside
  step = sr.vmap(noisy_vector_dot, variable_broadcast=(sr.Param, Count), split_rngs={"noise": True})
  y1, y2 = step(ours, X), step(ours, X)
  close(y1, nnx_step(theirs, X))
  close(y2, nnx_step(theirs, X))
  assert not jnp.allclose(y1, y2)
  assert ours.rngs.noise.key.shape == () == val(theirs.rngs.noise.key).shape
  assert int(ours.rngs.noise.count.value) == int(val(theirs.rngs.noise.count)) == 2
  assert int(ours.count.value) == int(val(theirs.count)) == 2
  assert jnp.array_equal(
    random.key_data(ours.rngs.noise()), random.key_data(theirs.rngs.noise())
  )  # usable outside


# -- 9-11. rules and limitations ----------------------------------------------------


def test_09_a_module_reached_by_closure_raises():

  class Counter(sr.Module):
    def __init__(self):
      self.count = sr.Param(jnp.array(0))

    def increment(self):
      self.count += jnp.array(1)

  class NnxCounter(nnx.Module):
    def __init__(self):
      self.count = nnx.Param(jnp.array(0))

    def increment(self):
      self.count[...] += jnp.array(1)

  counter, nnx_counter = Counter(), NnxCounter()

  @nnx.jit
  def nnx_f(x):
    nnx_counter.increment()
    return 2 * x

  @sr.jit
  def f(x):
    counter.increment()
    return 2 * x

  with pytest.raises(flax_errors.TraceContextError):
    nnx_f(3)
  with pytest.raises(
    sr.TraceContextError,
    match=r"sr\.jit\(f\) read `count` \(Param\) of a Counter that it was "
    r"not given as an argument: a module reached by closure.*Fix: "
    r"pass the module as an argument",
  ):
    f(3)
  assert int(counter.count.value) == 0 == int(val(nnx_counter.count))
  # the fix the guide gives: pass the module
  assert sr.jit(lambda c, x: (c.increment(), 2 * x)[1])(counter, 3) == 6
  assert int(counter.count.value) == 1


class Holder(sr.Module):
  def __init__(self, array):
    self.param = sr.Param(array)


class NnxHolder(nnx.Module):
  def __init__(self, array):
    self.param = nnx.Param(array)


def test_10_a_module_in_two_arguments_raises():
  def f(arg1, arg2):
    return None

  theirs = NnxHolder(jnp.arange(10))
  with pytest.raises(ValueError, match="Inconsistent aliasing"):
    nnx.vmap(f, in_axes=(0, 1))({"a": {"b": theirs}, "c": theirs}, [(theirs, theirs), theirs])
  # sr: modules go in argument 0 only, so one module cannot be given two in_axes
  m = Holder(jnp.arange(10))
  arg1, arg2 = {"a": {"b": m}, "c": m}, [(m, m), m]
  with pytest.raises(
    sr.GraphError,
    match=r"sr\.vmap\(f\): argument 1 at `\[0\]\[0\]` "
    r"is a Holder\. Modules go in argument 0 only"
    r".*Fix: pass every module in argument 0",
  ):
    sr.vmap(f, in_axes=(0, 1))(arg1, arg2)
  np.testing.assert_array_equal(m.param.value, jnp.arange(10))


def test_a_module_outside_argument_0_is_named_by_argument_and_path():
  m = Holder(jnp.arange(10))
  f = sr.vmap(lambda *args, **kwargs: None, in_axes=(0, 1, 0), variable_axes={sr.Param: 0})
  # the error counts arguments as the user does: argument 0 is the module argument
  with pytest.raises(sr.GraphError, match=r"argument 1 at `\[0\]\[0\]` is a Holder") as e:
    f({"c": m}, [(m, m), m], jnp.ones(10))
  assert isinstance(e.value, TypeError)  # still caught by `except TypeError`
  with pytest.raises(sr.GraphError, match=r"argument 2 is a Param\. .*Nothing was run"):
    f({"c": m}, jnp.ones(10), m.param)
  with pytest.raises(
    sr.GraphError,
    match=r"the keyword argument `\['k'\]\[1\]` is a "
    r"Holder",
  ):
    f({"c": m}, jnp.ones(10), jnp.ones(10), k=(1, m))
  np.testing.assert_array_equal(m.param.value, jnp.arange(10))


def test_11_returning_the_module_argument_under_other_out_axes_raises():
  theirs = NnxHolder(jnp.arange(10))
  nnx_arg1 = {"a": {"b": theirs}, "c": theirs}

  @nnx.vmap(in_axes=0, out_axes=1)
  def nnx_f(arg1):
    return arg1

  with pytest.raises(ValueError, match="Inconsistent aliasing"):
    nnx_f(nnx_arg1)

  # sr: the module argument's in_axes are its variable_axes (explicit for a plain module)
  m = Holder(jnp.arange(10))
  arg1 = {"a": {"b": m}, "c": m}

  @sr.vmap(out_axes=1, variable_axes={sr.Param: 0})
  def f(arg1):
    arg1["c"].param.value += 1  # a write before the error is not kept either
    return arg1

  with pytest.raises(
    sr.TransformError,
    match=r"sr\.vmap\(f\): the function returns `\['a'\]\['b'\]\.param` "
    r"\(Param, shape \(10,\)\) of its module argument, where out_axes "
    r"puts the mapped axis at 1, but variable_axes maps that Variable "
    r"along axis 0\..*inconsistent aliasing\). Nothing was changed\. "
    r"Fix: give the output `\['a'\]\['b'\]` `out_axes=0`",
  ):
    f(arg1)
  np.testing.assert_array_equal(m.param.value, jnp.arange(10))
  assert arg1["c"] is m and arg1["a"]["b"] is m


def test_11_returning_the_module_argument_keeps_its_aliases():
  def nnx_f(arg1):
    arg1["c"].param[...] += 1
    return arg1

  def f(arg1):
    arg1["c"].param.value += 1
    return arg1

  theirs = NnxHolder(jnp.arange(10))
  out = nnx.vmap(nnx_f, in_axes=0, out_axes=0)({"a": {"b": theirs}, "c": theirs})
  assert out["c"] is theirs and out["a"]["b"] is theirs
  m = Holder(jnp.arange(10))
  out = sr.vmap(f, variable_axes={sr.Param: 0})({"a": {"b": m}, "c": m})
  assert out["c"] is m and out["a"]["b"] is m
  np.testing.assert_array_equal(m.param.value, val(theirs.param))
  np.testing.assert_array_equal(m.param.value, jnp.arange(1, 11))
  # the plain module's variables map only by an explicit rule
  with pytest.raises(
    sr.TransformError,
    match=r"`\[0\]\.param` \(Param, shape \(10,\)\) "
    r"belongs to a plain module.*Fix",
  ):
    sr.vmap(f)({"a": {"b": m}, "c": m})
  np.testing.assert_array_equal(m.param.value, jnp.arange(1, 11))


def test_returning_the_module_argument_under_its_own_axis_is_allowed():
  m = Holder(jnp.arange(12).reshape(3, 4))

  # mapped along axis 1 in and out: consistent, the same object comes back, updated
  def double(h):
    h.param.value = h.param.value * 2
    return h

  assert sr.vmap(double, out_axes=1, variable_axes={sr.Param: 1})(m) is m
  np.testing.assert_array_equal(m.param.value, jnp.arange(12).reshape(3, 4) * 2)
  # the default out_axes=0 then disagrees with variable_axes's axis 1: refused
  with pytest.raises(
    sr.TransformError,
    match=r"returns `param` .* out_axes puts the mapped "
    r"axis at 0, but variable_axes maps that "
    r"Variable along axis 1.*`out_axes=1`",
  ):
    sr.vmap(lambda h: h, variable_axes={sr.Param: 1})(m)
  # a Variable returned by itself is checked as well
  with pytest.raises(sr.TransformError, match=r"returns `\[0\]` \(Param"):
    sr.vmap(lambda h: (h.param,), out_axes=1, variable_axes={sr.Param: 0})(m)
  np.testing.assert_array_equal(m.param.value, jnp.arange(12).reshape(3, 4) * 2)


# -- 12-13. axis metadata ------------------------------------------------------------


class Sharded(sr.Module):
  def __init__(self, array, sharding):
    self.param = sr.Param(array, sharding=sharding)


class NnxSharded(nnx.Module):
  def __init__(self, array, out_sharding):
    self.param = nnx.Param(array, out_sharding=out_sharding)


MESH = jax.make_mesh((1, 1), ("a", "b"))


def test_12_partition_name_is_removed_inside_and_back_outside():
  seen = {}

  @nnx.vmap(in_axes=1, transform_metadata={nnx.PARTITION_NAME: "b"})
  def nnx_f(m):
    seen["nnx"] = (m.param.shape, m.param.out_sharding)

  @sr.vmap(variable_axes={sr.Param: 1}, metadata_params={"partition_name": "b"})
  def f(m):
    seen["sr"] = (m.param.shape, m.param.sharding)

  with jax.set_mesh(MESH):
    theirs = NnxSharded(jnp.ones((3, 4, 5)), out_sharding=("a", "b", None))
    ours = Sharded(jnp.ones((3, 4, 5)), sharding=("a", "b", None))
    nnx_f(theirs)
    f(ours)
  assert seen["sr"] == seen["nnx"] == ((3, 5), ("a", None))
  assert ours.param.shape == theirs.param.shape == (3, 4, 5)
  assert ours.param.sharding == theirs.param.out_sharding == ("a", "b", None)
  assert sr.get_partition_spec(ours)["param"] == jax.P("a", "b", None)


def test_13_modules_made_inside_vmap_get_the_partition_name():
  @nnx.vmap(out_axes=1, axis_size=4, transform_metadata={nnx.PARTITION_NAME: "b"})
  def nnx_init_vmap():
    return NnxSharded(jnp.ones((3, 5)), out_sharding=("a", None))

  @sr.vmap(out_axes=1, axis_size=4, metadata_params={"partition_name": "b"})
  def init_vmap():
    return Sharded(jnp.ones((3, 5)), sharding=("a", None))

  with jax.set_mesh(MESH):
    theirs, ours = nnx_init_vmap(), init_vmap()
  assert ours.param.shape == theirs.param.shape == (3, 4, 5)
  assert ours.param.sharding == theirs.param.out_sharding == ("a", "b", None)
  close(ours.param.value, val(theirs.param))
  assert len(ours) == 4 and sr.get_partition_spec(ours)["param"] == jax.P("a", "b", None)
  assert ours.layer(2).param.shape == (3, 5) and ours.layer(2).param.sharding == ("a", None)


def test_vmap_of_a_function_with_no_arguments_builds_a_stack():
  theirs = nnx.vmap(lambda: NnxHolder(jnp.ones((3, 5))), axis_size=4)()
  ours = sr.vmap(lambda: Holder(jnp.ones((3, 5))), axis_size=4)()
  assert isinstance(ours, Holder) and len(ours) == 4
  assert ours.param.shape == theirs.param.shape == (4, 3, 5)
  close(ours.param.value, val(theirs.param))
  close(sr.stack(sr.unstack(ours)).param.value, ours.param.value)
  # keyword arguments pass to every call, unmapped
  twos = sr.vmap(lambda scale=1.0: Holder(jnp.ones(2) * scale), axis_size=3)(scale=2.0)
  np.testing.assert_array_equal(twos.param.value, jnp.full((3, 2), 2.0))
  # with nothing mapped, the size must be given
  with pytest.raises(
    sr.TransformError,
    match=r"axis_size must be specified.*No argument "
    r"holds a module.*pass `axis_size=`",
  ):
    sr.vmap(lambda: Holder(jnp.ones(2)))()

  class Ensemble(sr.Module):  # a decorated __init__ with no argument to map
    @sr.vmap(axis_size=3)
    def __init__(self):
      self.param = sr.Param(jnp.zeros(2))

  assert Ensemble().param.shape == (3, 2)


def test_out_axes_places_the_layer_axis_of_modules_made_inside():
  def make(i):
    return Holder(jnp.ones((3, 5)) * i)

  def nnx_make(i):
    return NnxHolder(jnp.ones((3, 5)) * i)

  xs = jnp.arange(4.0)
  ours = sr.vmap(make, out_axes=1)(xs)
  theirs = nnx.vmap(nnx_make, out_axes=1)(xs)
  assert ours.param.shape == theirs.param.shape == (3, 4, 5)
  close(ours.param.value, val(theirs.param))
  assert len(ours) == 4
  close(ours.layer(2).param.value, jnp.full((3, 5), 2.0))  # the layer axis is axis 1
  # a tuple out_axes: each output where its entry says, as jax.vmap
  (stack, doubled) = sr.vmap(lambda i: (make(i), i * 2), out_axes=(-1, 0))(xs)
  (nnx_stack, nnx_doubled) = nnx.vmap(lambda i: (nnx_make(i), i * 2), out_axes=(-1, 0))(xs)
  assert stack.param.shape == nnx_stack.param.shape == (3, 5, 4)
  close(stack.param.value, val(nnx_stack.param))
  close(doubled, nnx_doubled)
  close(stack.layer(3).param.value, jnp.full((3, 5), 3.0))
  # a module made inside cannot come out unmapped (nnx: "got axis spec None")
  with pytest.raises(
    sr.TransformError,
    match=r"the output `\[0\]` is a module made inside "
    r"the function, and out_axes gives it None.*"
    r"Fix: give it an axis",
  ):
    sr.vmap(lambda i: (make(i), i), out_axes=(None, 0))(xs)
  with pytest.raises(
    sr.TransformError,
    match=r"out_axes puts the mapped axis of the output "
    r"at 3, but its Variable `param` has 3 axes",
  ):
    sr.vmap(make, out_axes=3)(xs)
  # with a module argument, a module made inside and returned is stacked at out_axes too
  stack4 = sr.vmap(lambda: Holder(jnp.zeros(())), axis_size=4)()
  made = sr.vmap(lambda h, i: make(i), out_axes=1)(stack4, xs)
  assert made.param.shape == (3, 4, 5) and len(made) == 4
  close(made.layer(1).param.value, jnp.ones((3, 5)))


# -- 14-15. NNX vs JAX transforms (jax_and_nnx_transforms.rst) -------------------------


XS = random.normal(random.key(0), (1, 2))
YS = random.normal(random.key(1), (1, 3))


def loss_fn(model):
  return ((model(XS) - YS) ** 2).mean()


def nnx_trained():
  @nnx.jit
  def train_step(model, x, y):
    def loss_fn(model):
      return ((model(x) - y) ** 2).mean()

    grads = nnx.grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    nnx.update(model, params)

  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  train_step(model, XS, YS)
  return model


def assert_trained_like_nnx(kernel, bias, theirs):
  close(kernel, val(theirs.kernel))
  close(bias, val(theirs.bias))
  assert not np.allclose(kernel, val(nnx.Linear(2, 3, rngs=nnx.Rngs(0)).kernel))


def test_14_train_step_with_jit_and_grad_and_with_raw_jax():
  theirs = nnx_trained()

  @sr.jit
  def train_step(model, x, y):
    def loss_fn(model):
      return ((model(x) - y) ** 2).mean()

    grads = sr.grad(loss_fn)(model)
    params = sr.state(model, sr.Param)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    sr.update(model, params)

  model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  close(model.kernel.value, val(nnx.Linear(2, 3, rngs=nnx.Rngs(0)).kernel))
  assert train_step(model, XS, YS) is None
  assert_trained_like_nnx(model.kernel.value, model.bias.value, theirs)

  # The guide's JAX form: jax.jit and jax.grad over (graphdef, state).
  @jax.jit
  def jax_train_step(graphdef, state, x, y):
    def loss_fn(graphdef, state):
      model = sr.merge(graphdef, state)
      return ((model(x) - y) ** 2).mean()

    grads = jax.grad(loss_fn, argnums=1)(graphdef, state)

    model = sr.merge(graphdef, state)
    params = sr.state(model, sr.Param)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    sr.update(model, params)
    return sr.split(model)

  graphdef, state = sr.split(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)))
  graphdef, state = jax_train_step(graphdef, state, XS, YS)
  new = sr.merge(graphdef, state)
  assert type(new) is sr.nn.Linear
  assert_trained_like_nnx(new.kernel.value, new.bias.value, theirs)


def test_15_mixing_sr_and_jax_transforms():
  theirs = nnx_trained()

  @sr.jit
  def train_step(model, x, y):
    def loss_fn(graphdef, state):
      model = sr.merge(graphdef, state)
      return ((model(x) - y) ** 2).mean()

    grads = jax.grad(loss_fn, 1)(*sr.split(model))
    params = sr.state(model, sr.Param)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    sr.update(model, params)

  model = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  train_step(model, XS, YS)
  assert_trained_like_nnx(model.kernel.value, model.bias.value, theirs)

  @jax.jit
  def jax_train_step(graphdef, state, x, y):
    model = sr.merge(graphdef, state)

    def loss_fn(model):
      return ((model(x) - y) ** 2).mean()

    grads = sr.grad(loss_fn)(model)
    params = sr.state(model, sr.Param)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    sr.update(model, params)
    return sr.split(model)

  start = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
  kernel = start.kernel.value
  graphdef, state = sr.split(start)
  graphdef, state = jax_train_step(graphdef, state, XS, YS)
  assert start.kernel.value is kernel  # the caller's module is not touched
  new = sr.merge(graphdef, state)
  assert_trained_like_nnx(new.kernel.value, new.bias.value, theirs)


def test_a_graphdef_is_a_pytree_without_leaves():
  graphdef, state = sr.split(sr.nn.Linear(2, 3, rngs=sr.Rngs(0)))
  assert jax.tree.leaves(graphdef) == [] and jax.tree.map(lambda x: x, graphdef) is graphdef
  assert jax.tree.leaves((graphdef, state)) == jax.tree.leaves(state)
  again = sr.graphdef(sr.nn.Linear(2, 3, rngs=sr.Rngs(1)))
  assert again == graphdef and hash(again) == hash(graphdef)  # hashable as before
  traces = []

  @jax.jit
  def step(graphdef, state):
    traces.append(graphdef)
    model = sr.merge(graphdef, state)
    return sr.split(model)

  g2, s2 = step(graphdef, state)
  assert g2 == graphdef and type(sr.merge(g2, s2)) is sr.nn.Linear
  step(again, state)  # an equal GraphDef is the same static structure: no new trace
  assert len(traces) == 1
  step(
    sr.graphdef(sr.nn.Linear(2, 4, rngs=sr.Rngs(0))), sr.state(sr.nn.Linear(2, 4, rngs=sr.Rngs(0)))
  )
  assert len(traces) == 2  # another structure traces again
  # under sr.jit too
  g3, _ = sr.jit(lambda g, s: sr.split(sr.merge(g, s)))(graphdef, state)
  assert g3 == graphdef


# -- the table ------------------------------------------------------------------------


def test_the_table_counts_15_guide_patterns_each_with_existing_tests():
  here = pathlib.Path(__file__)
  rows = re.findall(
    r"^ ?(\d+)\. (.+?)\n((?:(?!^ ?\d+\. ).*\n)*?)(?=^ ?\d+\. |\"\"\"|\Z)", __doc__ + '"""', re.M
  )
  assert [int(n) for n, _, _ in rows] == list(range(1, 16))
  defined = set()
  for path in (here, here.with_name("test_nnx_guide.py")):
    defined |= {
      node.name
      for node in ast.parse(path.read_text()).body
      if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }
  named = []
  for n, title, body in rows:
    tests = re.findall(r"\btest_\w+", body)
    assert tests, f"pattern {n} ({title}) names no test"
    named += tests
  assert set(named) <= defined, sorted(set(named) - defined)
  # every test of both files that writes a guide pattern is counted in the table
  guide_tests = {
    t for t in defined if t != "test_the_table_counts_15_guide_patterns_each_with_existing_tests"
  }
  assert guide_tests <= set(named), (
    f"tests not in the table of {here.name}: {sorted(guide_tests - set(named))}"
  )
