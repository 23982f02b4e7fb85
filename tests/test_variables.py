"""Variables: values, metadata, array-like use, kinds and collections."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr

# -- value -------------------------------------------------------------------------


def test_value_get_and_set():
  w = sr.Param(jnp.zeros(3))
  np.testing.assert_array_equal(w.value, np.zeros(3))
  w.value = jnp.ones(3)
  np.testing.assert_array_equal(w.value, np.ones(3))


def test_get_value_and_set_value_are_value_as_nnx_spells_it():
  w = sr.Param(jnp.zeros(3))
  assert w.get_value() is w.value
  w.set_value(jnp.ones(3))
  np.testing.assert_array_equal(w.value, np.ones(3))


def test_set_value_checks_what_assigning_value_checks():
  w = sr.Param(jnp.zeros(2))
  with pytest.raises(TypeError, match=r"cannot assign a Param to `.*\.value`"):
    w.set_value(sr.Param(jnp.ones(2)))

  @jax.jit
  def bump(v):
    v.set_value(v.get_value() + 1)

  with pytest.raises(sr.TraceContextError, match=r"traced value was assigned.*sr\.jit"):
    bump(w)
  np.testing.assert_array_equal(w.value, np.zeros(2))


def test_get_value_inside_a_trace_reads_as_value_does():
  # A module reached by closure inside sr.jit: get_value refuses as .value does.
  model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  other = sr.nn.Linear(2, 2, rngs=sr.Rngs(1))

  @sr.jit
  def step(m):
    return m.kernel.get_value() + other.kernel.get_value()

  with pytest.raises(sr.TraceContextError, match="closure"):
    step(model)


def test_value_can_be_a_python_scalar_or_pytree():
  count = sr.Variable(0)
  count.value += 1
  assert count.value == 1
  nested = sr.Variable({"a": jnp.ones(2), "b": (jnp.zeros(1),)})
  assert jax.tree.structure(nested.value) == jax.tree.structure({"a": 0, "b": (0,)})


def test_variable_of_variable_is_refused():
  with pytest.raises(
    TypeError,
    match=r"Param\(\.\.\.\) got a BatchStat as its value.*"
    r"Pass `other\.value` instead",
  ):
    sr.Param(sr.BatchStat(jnp.zeros(1)))


def test_assigning_a_variable_as_value_is_refused():
  w = sr.Param(jnp.zeros(1))
  with pytest.raises(
    TypeError,
    match=r"cannot assign a Param to `.*\.value`.*"
    r"`var\.value = other\.value`",
  ):
    w.value = sr.Param(jnp.ones(1))
  np.testing.assert_array_equal(w.value, np.zeros(1))


def test_replace_keeps_kind_and_metadata():
  w = sr.Param(jnp.zeros(2), sharding=("embed",))
  w2 = w.replace(jnp.ones(2))
  assert type(w2) is sr.Param and w2 is not w
  assert w2.sharding == ("embed",)
  np.testing.assert_array_equal(w.value, np.zeros(2))
  np.testing.assert_array_equal(w2.value, np.ones(2))


# -- metadata ----------------------------------------------------------------------


def test_metadata_from_constructor_reads_as_attributes():
  w = sr.Param(jnp.zeros((2, 3)), sharding=("embed", "mlp"), note="hi")
  assert w.sharding == ("embed", "mlp")
  assert w.note == "hi"
  assert w.metadata == {"sharding": ("embed", "mlp"), "note": "hi"}


def test_metadata_property_is_a_copy():
  w = sr.Param(jnp.zeros(1), a=1)
  w.metadata["a"] = 2
  assert w.a == 1


def test_set_metadata_adds_and_replaces():
  w = sr.Param(jnp.zeros(1), a=1)
  w.set_metadata(a=2, b=3)
  assert w.metadata == {"a": 2, "b": 3}
  assert w.b == 3


def test_missing_attribute_error_names_it():
  w = sr.Param(jnp.zeros(1))
  with pytest.raises(AttributeError, match=r"Param has no attribute or metadata entry 'sharding'"):
    w.sharding
  assert not hasattr(w, "nope")


# -- array-like use ----------------------------------------------------------------


def test_shape_dtype_ndim_size():
  w = sr.Param(jnp.zeros((2, 3), jnp.float32))
  assert w.shape == (2, 3)
  assert w.dtype == jnp.float32
  assert w.ndim == 2
  assert w.size == 6
  assert len(w) == 2


def test_shape_of_a_python_scalar():
  count = sr.Variable(3)
  assert count.shape == () and count.ndim == 0 and count.size == 1
  assert jnp.issubdtype(count.dtype, jnp.integer)


@pytest.mark.parametrize(
  "fn",
  [
    jnp.sum,
    jnp.exp,
    jnp.tanh,
    jnp.mean,
    jax.nn.relu,
    jax.nn.gelu,
    lambda a: jnp.dot(a, a),
    lambda a: jnp.add(a, 1.0),
    lambda a: jnp.reshape(a, (3, 1)),
    lambda a: jnp.where(a > 1.0, a, 0.0),
    lambda a: jnp.concatenate([a, a]),
    jnp.asarray,
    jnp.zeros_like,
  ],
  ids=[
    "sum",
    "exp",
    "tanh",
    "mean",
    "relu",
    "gelu",
    "dot",
    "add",
    "reshape",
    "where",
    "concatenate",
    "asarray",
    "zeros_like",
  ],
)
def test_jnp_functions_take_a_variable(fn):
  x = jnp.arange(3.0)
  np.testing.assert_allclose(fn(sr.Param(x)), fn(x))


def test_plain_jax_transforms_read_a_variable():
  w = sr.Param(jnp.arange(3.0))
  np.testing.assert_allclose(jax.jit(lambda a: a * 2)(w), [0.0, 2.0, 4.0])
  grad = jax.grad(lambda a: jnp.sum(a**2))(w)
  assert isinstance(grad, sr.Param)
  np.testing.assert_allclose(grad.value, [0.0, 2.0, 4.0])


def test_variable_is_a_pytree_of_its_value():
  w = sr.Param(jnp.arange(3.0), sharding=("x",))
  assert len(jax.tree.leaves(w)) == 1
  doubled = jax.tree.map(lambda x: 2 * x, w)
  assert type(doubled) is sr.Param and doubled is not w
  assert doubled.sharding == ("x",)
  np.testing.assert_allclose(doubled.value, [0.0, 2.0, 4.0])
  [(path, _)] = jax.tree_util.tree_flatten_with_path(w)[0]
  assert jax.tree_util.keystr(path) == ".value"


def test_writing_a_tracer_into_a_variable_passed_to_plain_jit_raises():
  w = sr.Param(jnp.zeros(2))

  @jax.jit
  def bump(v):
    v.value = v.value + 1

  with pytest.raises(sr.TraceContextError, match=r"traced value was assigned.*sr\.jit"):
    bump(w)
  np.testing.assert_array_equal(w.value, np.zeros(2))


def test_tracer_leaking_from_plain_jit_closure_raises_and_keeps_value():
  class Box(sr.Module):
    def __init__(self):
      self.w = sr.Param(jnp.zeros(2))

  box = Box()

  @jax.jit
  def leak(x):
    box.w.value = x
    return x

  with pytest.raises(sr.TraceContextError, match=r"`w` \(Param\).*closes over"):
    leak(jnp.ones(2))
  np.testing.assert_array_equal(box.w.value, np.zeros(2))


def test_indexing_and_iteration():
  w = sr.Param(jnp.arange(6.0).reshape(2, 3))
  np.testing.assert_array_equal(w[1], [3.0, 4.0, 5.0])
  assert float(w[0, 2]) == 2.0
  rows = list(w)
  assert len(rows) == 2
  np.testing.assert_array_equal(rows[0], [0.0, 1.0, 2.0])


def test_arithmetic_both_sides():
  x = jnp.array([1.0, 2.0, 4.0])
  w = sr.Param(x)
  cases = [
    (w + 1, x + 1),
    (1 + w, 1 + x),
    (w - 1, x - 1),
    (1 - w, 1 - x),
    (w * 2, x * 2),
    (2 * w, 2 * x),
    (w / 2, x / 2),
    (2 / w, 2 / x),
    (w // 2, x // 2),
    (9 // w, 9 // x),
    (w % 3, x % 3),
    (7 % w, 7 % x),
    (w**2, x**2),
    (2**w, 2**x),
    (w @ x, x @ x),
    (x @ w, x @ x),
    (-w, -x),
    (+w, +x),
    (abs(-w), x),
    (w + w, x + x),
    (w < 2, x < 2),
    (w <= 2, x <= 2),
    (w > 2, x > 2),
    (w >= 2, x >= 2),
    (x + w, x + x),
    (x * w, x * x),
  ]
  for got, want in cases:
    np.testing.assert_allclose(got, want)


def test_bitwise_operators():
  a = jnp.array([1, 2, 3])
  w = sr.Variable(a)
  np.testing.assert_array_equal(w & 1, a & 1)
  np.testing.assert_array_equal(1 | w, 1 | a)
  np.testing.assert_array_equal(w ^ w, a ^ a)


def test_scalar_conversions():
  assert float(sr.Param(jnp.array(2.5))) == 2.5
  assert int(sr.Variable(jnp.array(3))) == 3
  assert bool(sr.Variable(jnp.array(True)))
  assert not bool(sr.Variable(0))


def test_numpy_conversion():
  w = sr.Param(jnp.arange(3.0))
  arr = np.asarray(w)
  assert isinstance(arr, np.ndarray)
  np.testing.assert_array_equal(arr, [0.0, 1.0, 2.0])
  assert np.asarray(w, dtype=np.int32).dtype == np.int32


def test_repr_is_readable():
  w = sr.Param(jnp.zeros((2, 3)), sharding=("a", "b"))
  assert (
    repr(w)
    == """\
Param(
  value=<jax.Array float32(2, 3) ≈0.0 ±0.0 [≥0.0, ≤0.0] zero:6>,
  sharding=('a', 'b'),
)"""
  )
  assert repr(sr.Variable(7)) == "Variable(value=7)"
  assert repr(sr.Variable(object(), note=print)) == (
    "Variable(value=<object>, note=builtins.print)"
  )


def test_variables_compare_by_identity_and_refuse_to_hash():
  # A hash would let jax.jit(static_argnums=...) serve a stale output (issue 22).
  a, b = sr.Param(jnp.zeros(1)), sr.Param(jnp.zeros(1))
  assert a is not b and len({id(a), id(b), id(a)}) == 2
  with pytest.raises(TypeError, match="unhashable type: 'Param'.*sr.jit"):
    hash(a)


# -- kinds and collections ---------------------------------------------------------


@pytest.mark.parametrize(
  "kind, collection",
  [
    (sr.Variable, "variables"),
    (sr.Param, "params"),
    (sr.BatchStat, "batch_stats"),
    (sr.Cache, "cache"),
    (sr.Intermediate, "intermediates"),
    (sr.RngKey, "rngs"),
    (sr.RngCount, "rngs"),
    (sr.RngState, "rngs"),
  ],
)
def test_kind_collections(kind, collection):
  assert kind.collection == collection
  assert kind(jnp.zeros(1)).collection == collection


def test_rng_kinds_share_a_base():
  assert issubclass(sr.RngKey, sr.RngState) and issubclass(sr.RngCount, sr.RngState)


def test_direct_subclass_gets_snake_case_collection():
  class RunningMean(sr.Variable):
    pass

  class Counter(sr.Variable):
    pass

  assert RunningMean.collection == "running_mean"
  assert Counter(0).collection == "counter"


def test_direct_subclass_may_name_its_collection():
  class Ema(sr.Variable):
    collection = "ema_stats"

  assert Ema(jnp.zeros(1)).collection == "ema_stats"


def test_subclass_of_a_kind_inherits_its_collection():
  class Weight(sr.Param):
    pass

  class Deeper(Weight):
    pass

  class Custom(sr.Variable):
    collection = "custom"

  class SubCustom(Custom):
    pass

  assert Weight.collection == "params"
  assert Deeper(jnp.zeros(1)).collection == "params"
  assert SubCustom.collection == "custom"
  assert isinstance(Weight(jnp.zeros(1)), sr.Param)


def test_user_subclass_is_array_like_and_a_pytree():
  class Stat(sr.Variable):
    pass

  s = Stat(jnp.ones(3), tag="t")
  assert float(jnp.sum(s)) == 3.0
  mapped = jax.tree.map(lambda x: x + 1, s)
  assert type(mapped) is Stat and mapped.tag == "t"
