"""Misuse is caught where it happens, with the path and the fix; failures change nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import statefulremat as sr


class Block(sr.Module):
  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(2, 2, rngs=rngs)
    self.mean = sr.BatchStat(jnp.zeros(2))
    self.deterministic = False

  def __call__(self, x):
    y = self.linear(x)
    self.mean.value = 0.9 * self.mean.value + 0.1 * y.mean(0)
    return y


class Outer(sr.Module):
  def __init__(self):
    self.rngs = sr.Rngs(0)
    self.block = Block(rngs=self.rngs)
    self.layers = [sr.nn.Linear(2, 2, rngs=self.rngs) for _ in range(2)]

  def __call__(self, x):
    y = self.block(x)
    for layer in self.layers:
      y = layer(y)
    keep = jax.random.bernoulli(self.rngs.dropout(), 0.5, y.shape)
    return jnp.where(keep, y, 0.0)


class Scale(sr.Module):
  def __init__(self):
    self.w = sr.Param(jnp.ones(2))
    self.flag = False


def snapshot(module):
  """Every Variable with the exact object it holds."""
  return [(path, var, var.value) for path, var in module.iter_variables()]


def assert_unchanged(module, snap):
  now = list(module.iter_variables())
  assert [p for p, _ in now] == [p for p, _, _ in snap]
  for (path, var), (_, old_var, old_value) in zip(now, snap):
    assert var is old_var, path
    assert var.value is old_value, path


X = jnp.ones((3, 2))


# -- (1) traced values leaking out of a plain JAX transform ---------------------------

CLOSURE = (
  r"sr\.jit\(f\) read `block\.linear\.kernel` \(Param\) of an Outer that it was "
  r"not given as an argument: a module reached by closure.*Fix: pass the module "
  r"as an argument"
)
LEAK = (
  r"a traced value was assigned to `block\.linear\.kernel` \(Param\) from inside "
  r"a JAX transform that does not own it.*the old value is kept\. Fix: pass the "
  r"module as an argument to `sr\.jit`"
)


def _closing_over(model, reached):

  def f(x):
    model.block.linear.kernel.value = model.block.linear.kernel.value * x
    reached.append(True)
    return x.sum()

  return f


@pytest.mark.parametrize("transform", [jax.jit, jax.grad, jax.vmap, jax.checkpoint])
def test_plain_jax_transform_closing_over_a_module_raises_at_the_assignment(transform):
  model = Outer()
  snap = snapshot(model)
  reached = []
  x = jnp.ones((4,)) if transform is jax.vmap else jnp.float32(2.0)
  with pytest.raises(sr.TraceContextError, match=LEAK):
    transform(_closing_over(model, reached))(x)
  assert reached == []  # raised at the assignment, not later
  assert_unchanged(model, snap)


def test_sr_jit_closing_over_a_module_it_was_not_given_raises():
  model, other = Outer(), Scale()
  snap = snapshot(model)

  @sr.jit
  def f(other, x):
    model.block.linear.kernel.value = model.block.linear.kernel.value * x
    return other.w.value

  # The read is refused first (its value would be a stale constant) ...
  with pytest.raises(sr.TraceContextError, match=CLOSURE):
    f(other, 2.0)
  assert_unchanged(model, snap)

  # ... and a write alone (no read) still cannot leak its tracer.
  @sr.jit
  def g(other, x):
    model.block.linear.kernel.value = x * jnp.ones((2, 2))
    return other.w.value

  with pytest.raises(sr.TraceContextError, match=LEAK):
    g(other, 2.0)
  assert_unchanged(model, snap)


def test_a_traced_value_leaking_through_a_plain_transform_inside_sr_jit_raises():
  model = Outer()
  snap = snapshot(model)

  @sr.jit
  def f(model, xs):

    def body(carry, x):
      model.block.mean.value = model.block.mean.value + x  # scan's trace, not jit's
      return carry, None

    jax.lax.scan(body, 0.0, xs)
    return 0.0

  with pytest.raises(sr.TraceContextError, match=r"`block\.mean` \(BatchStat\)"):
    f(model, jnp.ones((3, 2)))
  assert_unchanged(model, snap)


def test_concrete_assignments_inside_a_plain_transform_are_allowed():
  model = Scale()

  @jax.jit
  def f(x):
    model.w.value = np.zeros(2, np.float32)  # not traced: nothing leaks
    return x * 2

  assert float(f(1.0)) == 2.0
  np.testing.assert_array_equal(model.w.value, [0.0, 0.0])


def test_sr_transform_inside_a_plain_transform_cannot_write_tracers_back():
  model = Outer()
  snap = snapshot(model)
  step = sr.jit(lambda m, x: m(x).sum())

  with pytest.raises(
    sr.TraceContextError,
    match=r"sr\.jit\(<lambda>\) ran inside a JAX "
    r"transform .* that does not own `block\.mean` \(BatchStat\).*"
    r"nothing was written\. Fix: pass the module as an argument to the "
    r"outer transform",
  ):
    jax.vmap(lambda x: step(model, x))(jnp.ones((4, 3, 2)))
  assert_unchanged(model, snap)

  def loss(m, x):
    return m(x).sum()  # updates the running mean and draws a dropout key

  with pytest.raises(
    sr.TraceContextError,
    match=r"sr\.grad\(loss\) ran inside a JAX "
    r"transform.*`block\.mean` \(BatchStat\)",
  ):
    jax.jit(lambda x: sr.grad(loss)(model, x)["block"]["linear"]["kernel"])(X)
  assert_unchanged(model, snap)

  # reading a closed-over module inside a plain transform is fine
  out = jax.jit(lambda x: sr.grad(lambda m, x: (m.block.linear(x) ** 2).sum())(model, x))(X)
  assert out["block"]["linear"]["kernel"].shape == (2, 2)
  assert_unchanged(model, snap)


# -- (2) an exception inside a transform leaves every object as it was ---------------


def _mutate_then_raise(exc):

  def fn(model, x):
    y = model(x)  # updates the running mean and draws a dropout key
    model.block.linear.bias.value = model.block.linear.bias.value + 1.0
    model.layers[0].kernel.value = jnp.zeros((2, 2))
    raise exc
    return y.sum()  # pragma: no cover

  return fn


TRANSFORMS = {
  "jit": lambda fn: sr.jit(fn),
  "grad": lambda fn: sr.grad(fn),
  "value_and_grad": lambda fn: sr.value_and_grad(fn),
  "grad_under_jit": lambda fn: sr.jit(lambda m, x: sr.grad(fn)(m, x)),
  "jit_under_grad": lambda fn: sr.grad(sr.jit(fn)),
}


EXCEPTION_CASES = [(name, ValueError("boom in step")) for name in sorted(TRANSFORMS)] + [
  (name, KeyboardInterrupt("interrupted in step")) for name in ("jit", "grad", "value_and_grad")
]


@pytest.mark.parametrize(
  "name, exc", EXCEPTION_CASES, ids=[f"{n}-{type(e).__name__}" for n, e in EXCEPTION_CASES]
)
def test_an_exception_leaves_every_object_unchanged(name, exc):
  model = Outer()
  snap = snapshot(model)
  count = int(model.rngs.default.count.value)
  with pytest.raises(type(exc), match=f"^{exc.args[0]}"):
    TRANSFORMS[name](_mutate_then_raise(exc))(model, X)
  assert_unchanged(model, snap)
  assert int(model.rngs.default.count.value) == count
  assert model.block.deterministic is False

  # and the same objects still work afterwards
  ok = TRANSFORMS[name](lambda m, x: m(x).sum())
  ok(model, X)
  assert int(model.rngs.default.count.value) == count + 1


def test_an_exception_after_an_optimizer_step_inside_jit_changes_nothing():
  model = Outer()
  opt = sr.Optimizer(model, optax.adam(0.1))
  snap, opt_snap = snapshot(model), snapshot(opt)

  @sr.jit(static_argnums=2)
  def train_step(model, opt, fail):
    opt.update(sr.grad(lambda m: m(X).sum())(model))
    if fail:
      raise RuntimeError("after the update")
    return 0.0

  with pytest.raises(RuntimeError, match="after the update"):
    train_step(model, opt, True)
  assert_unchanged(model, snap)
  assert_unchanged(opt, opt_snap)
  train_step(model, opt, False)
  assert int(opt.step.value) == 1


# -- (3) structure changes inside a transform, and modules returned from one ---------

FIX = (
  r"Create sub-modules and Variables in `__init__`.*change static attributes "
  r"outside the transformed function \(`model\.eval\(\)` before calling it\)"
)


def _add_module(m, x):
  m.extra = Scale()


def _add_variable(m, x):
  m.h = sr.Intermediate(m.block(x))


def _flip_static(m, x):
  m.block.deterministic = True


def _add_static(m, x):
  m.note = "hello"


def _delete_module(m, x):
  del m.block


def _append_layer(m, x):
  m.layers.append(sr.nn.Linear(2, 2, rngs=m.rngs))


def _replace_kind(m, x):
  m.block.mean = sr.Param(m.block.mean.value)


def _raw_array(m, x):
  m.cache = x


STRUCTURE_CHANGES = [
  (_add_module, r"a new variable at `extra\.w`"),
  (_add_variable, r"a new variable at `h`"),
  (_flip_static, r"attribute `block\.deterministic` changed"),
  (_add_static, r"attribute `note` was added"),
  (_delete_module, r"the variable at `block\.linear\.bias` was removed"),
  (_append_layer, r"a new variable at `layers\[2\]\.bias`"),
  (_replace_kind, r"attribute `block\.mean` changed"),
]


# sr.jit, sr.grad, sr.remat, sr.scan and sr.vmap carry structure changes out, as nnx's
# transforms do (tests/test_nnx_guide.py); sr.accumulate, whose microbatches would each
# change it, refuses them.
IDS = [c.__name__.strip("_") for c, _ in STRUCTURE_CHANGES]


def _bump_then(change):
  def fn(m, x):
    m.block.linear.bias.value = m.block.linear.bias.value + 1.0
    loss = m.block.linear.bias.value.sum()
    change(m, x)
    return loss

  return fn


@pytest.mark.parametrize("change, where", STRUCTURE_CHANGES, ids=IDS)
def test_grad_carries_a_structure_change_out_as_jit_does(change, where):
  model, twin = Outer(), Outer()
  grads = sr.grad(_bump_then(change))(model, X)
  sr.jit(_bump_then(change))(twin, X)
  assert sr.graphdef(model) == sr.graphdef(twin)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6)  # two compilations
  jax.tree.map(close, _plain(sr.state(model)), _plain(sr.state(twin)))
  np.testing.assert_array_equal(grads["block"]["linear"]["bias"], np.ones(2))


def _plain(state):
  """``state`` with its RNG keys as their key data, to compare as arrays."""
  is_key = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, state)


@pytest.mark.parametrize("change, where", STRUCTURE_CHANGES, ids=IDS)
def test_changing_structure_inside_accumulate_is_an_error(change, where):
  model = Outer()
  snap = snapshot(model)
  attrs = dict(vars(model))
  step = sr.accumulate(sr.value_and_grad(_bump_then(change)), microbatches=3)
  with pytest.raises(
    sr.GraphError,
    match=r"sr\.accumulate.*: the function changed the structure "
    r"of its modules \(" + where + r"\)\..*" + FIX,
  ):
    step(model, X)
  assert_unchanged(model, snap)
  assert vars(model) == attrs and model.block.deterministic is False
  assert len(model.layers) == 2


def test_structure_change_names_which_module_argument():
  a, b = Scale(), Scale()

  def fn(modules, x):
    a, b = modules
    b.flag = True
    return (x @ a.w.value).sum()

  step = sr.accumulate(sr.value_and_grad(fn), microbatches=3)
  with pytest.raises(sr.GraphError, match=r"attribute `flag` of a Scale argument changed"):
    step((a, b), X)
  assert b.flag is False


def test_assigning_a_raw_array_inside_a_transform_is_an_error():
  model = Outer()
  with pytest.raises(
    sr.GraphError,
    match=r"attribute `cache` holds an array "
    r"\(float32\[3, 2\]\) that is not in a Variable.*Fix: wrap it",
  ):
    sr.jit(_raw_array)(model, X)
  assert not hasattr(model, "cache")


def test_returning_modules_sr_jit_returns_the_callers_objects_grad_refuses():
  model = Outer()
  snap = snapshot(model)

  def returns_module(m, x):
    m.block.mean.value = m.block.mean.value + 1
    return x.sum(), m.block

  # sr.jit may return modules (issue 14): those passed in come back as the caller's.
  before = np.asarray(model.block.mean.value)
  _, block = sr.jit(returns_module)(model, X)
  assert block is model.block
  assert sr.jit(lambda m, x: {"w": m.block.linear.kernel})(model, X)["w"] is (
    model.block.linear.kernel
  )
  np.testing.assert_array_equal(model.block.mean.value, before + 1)
  snap = snapshot(model)
  with pytest.raises(
    sr.GraphError,
    match=r"sr\.grad\(.*\): the function returned a "
    r"module \(Outer\) at output `\[0\]`",
  ):
    sr.grad(lambda m, x: (m(x).sum(), [m]), has_aux=True)(model, X)
  assert_unchanged(model, snap)


# -- (4) arrays hiding outside Variables -------------------------------------------


class Hidden(sr.Module):
  def __init__(self):
    self.w = jnp.ones((3,))
    self.b = sr.Param(jnp.zeros(3))


class HasHidden(sr.Module):
  def __init__(self):
    self.block = Hidden()


RAW = (
  r"attribute `block\.w` holds an array \(float32\[3\]\) that is not in a Variable, "
  r"so transforms would bake it in as a constant and never update it\. Fix: wrap it, "
  r"e\.g\. `self\.w = sr\.Param\(w\)`"
)


@pytest.mark.parametrize("transform", [sr.jit, sr.grad, sr.value_and_grad])
def test_a_raw_array_attribute_is_an_error(transform):
  model = HasHidden()
  with pytest.raises(sr.GraphError, match=RAW):
    transform(lambda m: (m.block.w * m.block.b.value).sum())(model)


def test_a_raw_numpy_array_or_unhashable_attribute_is_an_error():
  model = HasHidden()
  model.block.w = np.ones(3, np.float32)
  with pytest.raises(sr.GraphError, match=RAW):
    sr.jit(lambda m: m.block.b.value)(model)
  model.block.w = {1, 2}
  with pytest.raises(
    sr.GraphError,
    match=r"attribute `block\.w` holds a set, which is "
    r"not hashable.*Fix: use a tuple or a frozen dataclass",
  ):
    sr.jit(lambda m: m.block.b.value)(model)
