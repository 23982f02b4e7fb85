"""sr.scan's in_axes / out_axes prefix trees == the Python loop with jnp.moveaxis."""

from typing import NamedTuple

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import statefulremat as sr

broadcast = sr.broadcast

N, D = 4, 3
C0 = jnp.linspace(-0.5, 0.5, D)


class Layer(sr.Module):
  def __init__(self, *, rngs):
    self.w = sr.Param(jax.random.normal(rngs.params(), (D, D)) / 2)


class Counted(sr.Module):
  """A layer whose every call bumps a stacked counter: something to write back."""

  def __init__(self, *, rngs):
    self.w = sr.Param(jax.random.normal(rngs.params(), (D, D)) / 2)
    self.calls = sr.BatchStat(jnp.zeros(()))


class Pair(NamedTuple):
  left: jax.Array
  right: jax.Array


def vmapped(cls=Layer):
  return sr.vmap(cls, axis_size=N)(rngs=sr.Rngs(0))


def scanned(cls=Layer):
  return sr.scan(cls, length=N, variable_axes={sr.Param: 0}, split_rngs={"params": True})(
    rngs=sr.Rngs(1)
  )


def mix(c, xs):
  """Every element of every xs leaf counts, each with its own weight."""
  s = 0.0
  for x in jax.tree.leaves(xs):
    s = s + jnp.sum(x * jnp.linspace(0.1, 1.0, x.size).reshape(x.shape))
  return s


def ys_of(c, kind):
  outer = jnp.outer(c, 2 * c + 1)  # not symmetric: a swapped axis shows
  return {"pair": (c, outer), "dict": {"h": c, "o": outer}, "single": outer, "none": None}[kind]


def make_body(kind):

  def body(m, c, *xs):
    if hasattr(m, "calls"):
      m.calls.value += 1
    c = jnp.tanh(c @ m.w.value + mix(c, xs))
    return c, ys_of(c, kind)

  return body


def data(shapes):
  """Distinct values for each leaf of a tree of shapes (tuples of ints)."""
  leaves, tree = jax.tree.flatten(
    shapes, is_leaf=lambda s: isinstance(s, tuple) and all(isinstance(d, int) for d in s)
  )
  arrays = [
    jnp.sin(jnp.arange(np.prod(s), dtype=jnp.float32) + 10 * k).reshape(s)
    for k, s in enumerate(leaves)
  ]
  return jax.tree.unflatten(tree, arrays)


def loop(stack, body, c, xs, leaf_in, leaf_out):
  """The reference: slice i of each leaf with moveaxis, stack ys with moveaxis."""
  ys = []
  for i, layer in enumerate(sr.unstack(stack)):
    x_i = jax.tree.map(lambda x, a: x if a is None else jnp.moveaxis(x, a, 0)[i], xs, leaf_in)
    c, y = body(layer, c, *x_i)
    ys.append(y)
  if ys[0] is None:
    return c, None
  stacked = jax.tree.map(lambda *y: jnp.stack(y), *ys)
  return c, jax.tree.map(lambda y, a: jnp.moveaxis(y, 0, a), stacked, leaf_out)


def close(a, b, tol=1e-5):
  jax.tree.map(
    lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol), a, b
  )
  assert jax.tree.structure(a) == jax.tree.structure(b)


def values(module):
  return {p: np.asarray(v) for p, v in sr.state(module).flat().items()}


def assert_unchanged(module, before):
  after = values(module)
  assert after.keys() == before.keys()
  for p in before:
    np.testing.assert_array_equal(after[p], before[p], err_msg=str(p))


# (id, in_axes, xs shapes, in_axes per xs leaf, ys kind, out_axes, out_axes per ys leaf)
CASES = [
  ("int", 0, ((N, D),), (0,), "pair", 0, (0, 0)),
  ("int-1", 1, ((2, N),), (1,), "single", 1, 1),
  ("negative", -1, ((2, D, N), (N,)), (-1, -1), "pair", -1, (-1, -1)),
  (
    "tuple-per-arg",
    (0, None, 2),
    ((N, 2), (2, 2), (2, D, N)),
    (0, None, 2),
    "pair",
    (1, 2),
    (1, 2),
  ),
  (
    "list-per-arg",
    [broadcast, 0],
    ((D,), (N, D)),
    (None, 0),
    "dict",
    {"h": 1, "o": 0},
    {"h": 1, "o": 0},
  ),
  (
    "nested-dict-tuple",
    ({"a": 1, "b": (0, broadcast)}, -2),
    ({"a": (2, N, D), "b": ((N,), (5,))}, (N, D)),
    ({"a": 1, "b": (0, None)}, -2),
    "dict",
    {"h": -1, "o": -2},
    {"h": -1, "o": -2},
  ),
  (
    "dict-covers-subtree",
    ({"a": 0, "b": 1},),
    ({"a": (N,), "b": ((2, N), [(D, N, 2)])},),
    ({"a": 0, "b": (1, [1])},),
    "pair",
    (0, -3),
    (0, -3),
  ),
  ("list-for-tuple", ([0, None],), (((N, 2), (D,)),), ((0, None),), "pair", [-1, 1], (-1, 1)),
  ("broadcast-top", broadcast, ((D,),), (None,), "single", -1, -1),
  ("no-ys", (0,), ((N, D),), (0,), "none", (0, 5), None),
]


def case_args(case):
  _, in_axes, shapes, leaf_in, kind, out_axes, leaf_out = case
  xs = data(shapes)
  return in_axes, xs, leaf_in, make_body(kind), out_axes, leaf_out


# Every case over a stack from sr.vmap; a few over one from the class-form sr.scan.
@pytest.mark.parametrize(
  "case, build",
  [(c, vmapped) for c in CASES] + [(CASES[i], scanned) for i in (2, 5, 7)],
  ids=[c[0] for c in CASES] + [CASES[i][0] + "-scan-stack" for i in (2, 5, 7)],
)
def test_scan_equals_the_loop(case, build):
  in_axes, xs, leaf_in, body, out_axes, leaf_out = case_args(case)
  stack = build()
  f = sr.scan(body, variable_axes={sr.Param: 0}, in_axes=in_axes, out_axes=out_axes)
  c, ys = f(stack, C0, *xs)
  c0, ys0 = loop(stack, body, C0, xs, leaf_in, leaf_out)
  close(c, c0)
  close(ys, ys0)


@pytest.mark.parametrize("case", [CASES[3], CASES[5]], ids=lambda c: c[0])
def test_under_jit_and_grad(case):
  in_axes, xs, leaf_in, body, out_axes, leaf_out = case_args(case)
  stack = vmapped()
  f = sr.scan(body, variable_axes={sr.Param: 0}, in_axes=in_axes, out_axes=out_axes)
  c, ys = sr.jit(lambda s, c, xs: f(s, c, *xs))(stack, C0, xs)
  c0, ys0 = loop(stack, body, C0, xs, leaf_in, leaf_out)
  close(c, c0)
  close(ys, ys0)

  def loss(run):
    def fn(s, xs):
      c, ys = run(s, xs)
      # Weigh the ys positions differently, so a misplaced axis changes the gradient.
      return jnp.sum(c**2) + sum(mix(None, y) for y in jax.tree.leaves(ys))

    return fn

  g = sr.grad(loss(lambda s, xs: f(s, C0, *xs)))(stack, xs)
  g0 = sr.grad(loss(lambda s, xs: loop(s, body, C0, xs, leaf_in, leaf_out)))(stack, xs)
  assert g["w"].shape == (N, D, D)
  close(g["w"], g0["w"])


def test_class_form_with_prefix_trees():

  class Step(Layer):
    def __call__(self, c, x):
      c = jnp.tanh(c @ self.w.value + mix(c, x))
      return c, ys_of(c, "dict")

  Stack = sr.scan(
    Step,
    length=N,
    variable_axes={sr.Param: 0},
    split_rngs={"params": True},
    in_axes=({"a": 1, "b": broadcast},),
    out_axes={"h": -1, "o": 1},
  )
  stack = Stack(rngs=sr.Rngs(0))
  xs = data({"a": (2, N), "b": (D,)})
  c, ys = stack(C0, xs)
  c0, ys0 = loop(
    stack, lambda m, c, x: m(c, x), C0, (xs,), ({"a": 1, "b": None},), {"h": -1, "o": 1}
  )
  close(c, c0)
  close(ys, ys0)
  assert ys["h"].shape == (D, N) and ys["o"].shape == (D, N, D)


def test_namedtuple_argument_and_a_tuple_prefix():
  stack = vmapped()
  xs = Pair(*data(((N, 2), (2, N))))
  body = make_body("single")
  c, ys = sr.scan(body, variable_axes={sr.Param: 0}, in_axes=((0, 1),))(stack, C0, xs)
  c0, ys0 = loop(stack, body, C0, (xs,), (Pair(0, 1),), 0)
  close(c, c0)
  close(ys, ys0)


@st.composite
def arrays_and_axes(draw):
  n = draw(st.integers(1, 3))
  xs, axes = [], []
  for k in range(draw(st.integers(1, 3))):
    shape = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    rank = len(shape) + 1
    axis = draw(st.integers(-rank, rank - 1))
    shape.insert(axis % rank, n)
    xs.append(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + 100 * k)
    axes.append(axis)
  return n, tuple(xs), tuple(axes)


@settings(max_examples=15, deadline=None)
@given(arrays_and_axes())
def test_same_axes_in_and_out_round_trip(case):
  n, xs, axes = case
  model = Layer(rngs=sr.Rngs(0))
  identity = sr.scan(lambda m, c, *xs: (c, xs), in_axes=axes, out_axes=axes)
  c, ys = identity(model, jnp.zeros(()), *xs)
  assert len(ys) == len(xs)
  for x, y in zip(xs, ys):
    assert y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


# -- errors: what, where, the fix; nothing written back ------------------------------------


@pytest.mark.parametrize(
  "out_axes, where",
  [
    (None, r"out_axes=None, "),
    ((0, None), r"out_axes=\(0, None\) has None at `out_axes\[1\]`"),
    ({"h": 0, "o": broadcast}, r"has sr.broadcast at `out_axes\['o'\]`"),
  ],
)
def test_none_in_out_axes(out_axes, where):
  with pytest.raises(
    sr.TransformError, match=where + r".*ys differ per iteration.*Fix: give an int"
  ):
    sr.scan(make_body("pair"), variable_axes={sr.Param: 0}, out_axes=out_axes)
  with pytest.raises(sr.TransformError, match=r"sr.scan\(Layer\).*ys differ"):
    sr.scan(Layer, length=N, variable_axes={sr.Param: 0}, out_axes=out_axes)


def test_axes_that_are_not_axes():
  with pytest.raises(
    sr.TransformError,
    match=r"in_axes=\(0, 'x'\) has 'x' at `in_axes\[1\]`, which is not "
    r"an axis.*None or sr.broadcast",
  ):
    sr.scan(make_body("pair"), in_axes=(0, "x"))
  with pytest.raises(
    sr.TransformError,
    match=r"out_axes=\{'h': True\} has True at "
    r"`out_axes\['h'\]`, which is not an axis",
  ):
    sr.scan(make_body("pair"), out_axes={"h": True})
  with pytest.raises(sr.TransformError, match=r"out_axes=1.5 is not an axis"):
    sr.scan(make_body("pair"), out_axes=1.5)


def counted_and_before():
  stack = vmapped(Counted)
  return stack, values(stack)


def still_usable(stack, before):
  assert_unchanged(stack, before)
  f = sr.scan(make_body("pair"), variable_axes={sr.Param: 0, sr.BatchStat: 0})
  f(stack, C0, jnp.ones((N, D)))
  np.testing.assert_array_equal(np.asarray(stack.calls.value), np.ones(N))


def run_counted(stack, **axes):
  f = sr.scan(
    make_body(axes.pop("kind", "pair")), variable_axes={sr.Param: 0, sr.BatchStat: 0}, **axes
  )
  return f


def test_in_axes_prefix_that_does_not_fit():
  stack, before = counted_and_before()
  xs = {"a": (jnp.ones((N, D)),), "b": jnp.ones((N,))}
  with pytest.raises(
    sr.TransformError,
    match=r"in_axes entry \{'a': \(0, 0\), 'b': 0\} is not a prefix of xs "
    r"argument 0: at `xs\[0\]\['a'\]` it has a tuple of 2 where the "
    r"argument has a tuple of 1\. Fix: follow the argument's structure",
  ):
    run_counted(stack, in_axes=({"a": (0, 0), "b": 0},))(stack, C0, xs)
  with pytest.raises(
    sr.TransformError,
    match=r"at `xs\[1\]` it has a dict with keys \['a'\] where the "
    r"argument has an array of shape \(4,\)",
  ):
    run_counted(stack, in_axes=(0, {"a": 0}))(stack, C0, xs, jnp.ones(N))
  with pytest.raises(sr.TransformError, match=r"in_axes=\(0, 0\) does not fit 1 xs argument\(s\)"):
    run_counted(stack, in_axes=(0, 0))(stack, C0, xs)
  still_usable(stack, before)


def test_out_axes_prefix_that_does_not_fit():
  stack, before = counted_and_before()
  xs = jnp.ones((N, D))
  with pytest.raises(
    sr.TransformError,
    match=r"out_axes=\(0, 0, 0\) is not a prefix of the body's ys: at "
    r"`ys` it has a tuple of 3 where ys has a tuple of 2.*Fix: follow",
  ):
    run_counted(stack, out_axes=(0, 0, 0))(stack, C0, xs)
  with pytest.raises(
    sr.TransformError,
    match=r"at `ys` it has a dict with keys \['h', 'x'\] where ys has a "
    r"dict with keys \['h', 'o'\]",
  ):
    run_counted(stack, kind="dict", out_axes={"h": 0, "x": 0})(stack, C0, xs)
  with pytest.raises(
    sr.TransformError,
    match=r"at `ys\[1\]` it has a tuple of 2 where ys has an array of "
    r"shape \(4, 3, 3\)",
  ):
    run_counted(stack, out_axes=(0, (0, 1)))(stack, C0, xs)
  still_usable(stack, before)


def test_axis_out_of_range():
  stack, before = counted_and_before()
  xs = {"a": jnp.ones((N, D)), "b": jnp.ones((D,))}
  with pytest.raises(
    sr.TransformError,
    match=r"in_axes puts the scanned axis of xs leaf 0 at 2, but it has "
    r"shape \(4, 3\) \(rank 2\) at `xs\[0\]\['a'\]`\. Fix: choose an axis "
    r"in \[-2, 2\), or use None to broadcast it",
  ):
    run_counted(stack, in_axes=({"a": 2, "b": None},))(stack, C0, xs)
  with pytest.raises(
    sr.TransformError,
    match=r"scanned axis of xs leaf 1 at -2.*shape \(3,\) \(rank 1\) at "
    r"`xs\[0\]\['b'\]`",
  ):
    run_counted(stack, in_axes=({"a": 0, "b": -2},))(stack, C0, xs)
  with pytest.raises(
    sr.TransformError,
    match=r"out_axes puts the iteration axis of `ys\[1\]` at 3, but "
    r"stacked over the iterations it has shape \(4, 3, 3\) \(rank 3\)\. "
    r"Fix: choose an axis in \[-3, 3\)",
  ):
    run_counted(stack, out_axes=(0, 3))(stack, C0, xs["a"])
  with pytest.raises(
    sr.TransformError,
    match=r"iteration axis of `ys\['h'\]` at -3.*shape \(4, 3\) "
    r"\(rank 2\)",
  ):
    run_counted(stack, kind="dict", out_axes=-3)(stack, C0, xs["a"])
  still_usable(stack, before)


def test_errors_under_jit_leave_the_module_unchanged():
  stack, before = counted_and_before()
  f = run_counted(stack, out_axes=(0, 3))
  with pytest.raises(sr.TransformError, match=r"iteration axis of `ys\[1\]` at 3"):
    sr.jit(f)(stack, C0, jnp.ones((N, D)))
  still_usable(stack, before)
