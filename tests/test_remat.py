"""sr.remat: jax.checkpoint over modules — same results, gradients and mutations."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import ad_checkpoint

import statefulremat as sr


class Block(sr.Module):
  """Linear + sin, a running mean (BatchStat) and a dropout mask from a stored Rngs."""

  def __init__(self, d, *, rngs):
    self.linear = sr.nn.Linear(d, d, rngs=rngs)
    self.mean = sr.BatchStat(jnp.zeros(d))
    self.rngs = rngs

  def __call__(self, x):
    y = jnp.sin(self.linear(x))
    self.mean.value = 0.9 * self.mean.value + 0.1 * y.mean(0)
    keep = jax.random.bernoulli(self.rngs.dropout(), 0.5, y.shape)
    return jnp.where(keep, 2 * y, 0.0)

  def encode(self, x):
    return jnp.tanh(self.linear(x))


class Mlp(sr.Module):
  """Two named layers, read only: nothing to write back."""

  def __init__(self, d, *, rngs):
    self.a = sr.nn.Linear(d, d, rngs=rngs)
    self.b = sr.nn.Linear(d, d, rngs=rngs)

  def __call__(self, x):
    h = ad_checkpoint.checkpoint_name(jnp.sin(self.a(x)), "hidden")
    return jnp.sin(self.b(h))


def body(block, x):
  return block(x)


def loss(block, x):
  return jnp.sum(block(x) ** 2)


def remat_loss(block, x, **options):
  return jnp.sum(sr.remat(body, **options)(block, x) ** 2)


def values(module):
  return {
    p: np.asarray(
      jax.random.key_data(v) if jnp.issubdtype(jnp.result_type(v), jax.dtypes.prng_key) else v
    )
    for p, v in sr.state(module).flat().items()
  }


def assert_same_values(a, b):
  va, vb = values(a), values(b)
  assert va.keys() == vb.keys()
  for path in va:
    np.testing.assert_allclose(va[path], vb[path], rtol=1e-6, atol=1e-6, err_msg=str(path))


def assert_same_state(a, b):
  assert a.keys() == b.keys()
  for path in a:
    np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


def make(seed=0, d=4):
  return Block(d, rngs=sr.Rngs(seed))


X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def checkpoint_eqns(jaxpr):
  """The parameters of each ``jax.checkpoint`` in ``jaxpr``, as this jax writes them
  (under jax_remat3 they sit on the rule object that is the equation's one parameter)."""

  def params(eqn):
    (only, *rest) = eqn.params.values() if eqn.params else (None,)
    return (
      only.params if not rest and isinstance(getattr(only, "params", None), dict) else eqn.params
    )

  return [p for p in map(params, jaxpr.eqns) if {"jaxpr", "policy", "prevent_cse"} <= set(p)]


# -- the three forms ---------------------------------------------------------------


def test_function_form_equals_direct_call_and_writes_back():
  plain, rematted = make(), make()
  expected = body(plain, X)
  out = sr.remat(body)(rematted, X)
  np.testing.assert_allclose(out, expected, rtol=1e-6)
  assert_same_values(rematted, plain)
  assert int(rematted.rngs.default.count.value) == 3  # 2 init draws + 1 mask


def test_function_form_takes_modules_anywhere_in_the_arguments():
  a, b, c = make(0), make(1), make(2)
  a2, b2, c2 = make(0), make(1), make(2)

  def f(x, blocks, *, last):
    return blocks["first"](x) + blocks["rest"][0](x) + last(x)

  expected = f(X, {"first": a, "rest": [b]}, last=c)
  out = sr.remat(f)(X, {"first": a2, "rest": [b2]}, last=c2)
  np.testing.assert_allclose(out, expected, rtol=1e-6)
  for got, want in [(a2, a), (b2, b), (c2, c)]:
    assert_same_values(got, want)


def test_shared_module_passed_twice_is_updated_once_per_use():
  plain, rematted = make(), make()
  expected = plain(X) + plain(X)
  out = sr.remat(lambda m1, m2, x: m1(x) + m2(x))(rematted, rematted, X)
  np.testing.assert_allclose(out, expected, rtol=1e-6)
  assert_same_values(rematted, plain)


def test_method_decorator():

  class Decorated(Block):
    @sr.remat
    def __call__(self, x):
      return Block.__call__(self, x)

    @functools.partial(sr.remat, static_argnums=(2,))
    def scaled(self, x, times):
      for _ in range(times):
        x = self.encode(x)
      return x

  plain, decorated = make(), Decorated(4, rngs=sr.Rngs(0))
  np.testing.assert_allclose(decorated(X), plain(X), rtol=1e-6)
  assert_same_values(decorated, plain)
  np.testing.assert_allclose(decorated.scaled(X, 2), plain.encode(plain.encode(X)), rtol=1e-6)
  g = sr.grad(lambda m, x: jnp.sum(m(x) ** 2))(decorated, X)
  g0 = sr.grad(loss)(plain, X)
  np.testing.assert_allclose(g["linear"]["kernel"], g0["linear"]["kernel"], rtol=1e-5)


def test_class_form_is_a_subclass_whose_call_is_rematerialised():
  RematBlock = sr.remat(Block)
  assert issubclass(RematBlock, Block) and RematBlock is not Block
  assert RematBlock.__name__ == "RematBlock"
  plain, rematted = make(), RematBlock(4, rngs=sr.Rngs(0))
  assert isinstance(rematted, Block)
  np.testing.assert_allclose(rematted(X), plain(X), rtol=1e-6)
  assert_same_values(rematted, plain)
  jaxpr = jax.make_jaxpr(lambda x: rematted.encode(x))(X)
  assert not checkpoint_eqns(jaxpr.jaxpr)  # only __call__ is transformed


def test_class_form_methods():
  RematEncode = sr.remat(Block, methods=["encode"])
  model = RematEncode(4, rngs=sr.Rngs(0))
  plain = make()
  np.testing.assert_allclose(model.encode(X), plain.encode(X), rtol=1e-6)
  assert len(checkpoint_eqns(jax.make_jaxpr(model.encode)(X).jaxpr)) == 1
  g = sr.grad(lambda m, x: jnp.sum(m.encode(x)))(model, X)
  g0 = sr.grad(lambda m, x: jnp.sum(m.encode(x)))(plain, X)
  np.testing.assert_allclose(g["linear"]["kernel"], g0["linear"]["kernel"], rtol=1e-6)


def test_class_form_unknown_method():
  with pytest.raises(AttributeError, match=r"Block has no method 'decode'"):
    sr.remat(Block, methods=["decode"])


def test_methods_on_a_function_is_an_error():
  with pytest.raises(TypeError, match=r"applies to a Module class, not a function"):
    sr.remat(body, methods=["__call__"])


def test_returning_a_module_is_an_error():
  model = make()
  before = values(model)
  with pytest.raises(sr.GraphError, match=r"returned a module \(Block\).*output `\[1\]`"):
    sr.remat(lambda m, x: (m(x), m))(model, X)
  assert_same_state(values(model), before)


# -- equivalence: gradients and mutations --------------------------------------------


def test_remat_grads_equal_plain_grads_and_mutations_match():
  plain, rematted = make(), make()
  g0 = sr.grad(loss)(plain, X)
  g = sr.grad(remat_loss)(rematted, X)
  assert g.keys() == g0.keys()
  for path, value in g0.flat().items():
    np.testing.assert_allclose(g.flat()[path], value, rtol=1e-5, atol=1e-6)
  assert_same_values(rematted, plain)
  # The running mean and the RNG counter moved exactly as without remat.
  assert int(rematted.rngs.default.count.value) == 3
  assert not np.allclose(rematted.mean.value, 0.0)


def test_remat_value_and_grad_of_a_deeper_model_is_exact():
  plain, rematted = Mlp(4, rngs=sr.Rngs(1)), Mlp(4, rngs=sr.Rngs(1))
  v0, g0 = sr.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(plain, X)
  v, g = sr.value_and_grad(lambda m, x: jnp.sum(sr.remat(Mlp.__call__)(m, x) ** 2))(rematted, X)
  assert float(v) == float(v0)
  for path, value in g0.flat().items():
    np.testing.assert_allclose(g.flat()[path], value, rtol=1e-6, atol=1e-7)


def test_second_call_draws_new_keys():
  model = make()
  f = sr.remat(body)
  first = f(model, X)
  second = f(model, X)
  assert int(model.rngs.default.count.value) == 4
  assert not np.array_equal(first != 0, second != 0)


# -- options -------------------------------------------------------------------------

POLICIES = {
  "dots_saveable": jax.checkpoint_policies.dots_saveable,
  "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
  "everything_saveable": jax.checkpoint_policies.everything_saveable,
  "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "save_only_these_names": jax.checkpoint_policies.save_only_these_names("hidden"),
  "save_any_names_but_these": jax.checkpoint_policies.save_any_names_but_these("hidden"),
  "save_anything_except_these_names": jax.checkpoint_policies.save_anything_except_these_names(
    "hidden"
  ),
  "save_from_both_policies": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names("hidden")
  ),
  "checkpoint_dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
  "offload_dot_with_no_batch_dims": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
    "device", "pinned_host"
  ),
  "save_and_offload_only_these_names": jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["hidden"],
    offload_src="device",
    offload_dst="pinned_host",
  ),
}


def test_policies_cover_every_checkpoint_policies_entry():
  public = {n for n in dir(jax.checkpoint_policies) if not n.startswith("_")}
  assert public <= set(POLICIES)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_is_accepted_and_keeps_gradients(name):
  policy = POLICIES[name]
  plain, rematted = Mlp(4, rngs=sr.Rngs(0)), Mlp(4, rngs=sr.Rngs(0))
  f = lambda m, x: jnp.sum(m(x) ** 2)
  g0 = sr.grad(f)(plain, X)
  loss = lambda m, x: jnp.sum(sr.remat(Mlp.__call__, policy=policy)(m, x) ** 2)
  if name == "save_anything_except_these_names":  # JAX 0.10's saves what it excludes
    with pytest.raises(sr.TransformError, match="save_any_names_but_these"):
      sr.grad(loss)(rematted, X)
    return
  # On CPU an offload moves nothing, and sr.remat says so (tests/test_remat_policy.py).
  offload = "offload" in name and jax.default_backend() == "cpu"
  with (
    pytest.warns(UserWarning, match="nothing is offloaded")
    if offload
    else (contextlib.nullcontext())
  ):
    g = sr.grad(loss)(rematted, X)
    jaxpr = jax.make_jaxpr(lambda x: sr.remat(Mlp.__call__, policy=policy)(rematted, x))(X)
  for path, value in g0.flat().items():
    np.testing.assert_allclose(g.flat()[path], value, rtol=1e-6, atol=1e-7)
  (params,) = checkpoint_eqns(jaxpr.jaxpr)
  # jax_remat3 writes nothing_saveable as None (no policy): the same remat.
  nothing = policy is jax.checkpoint_policies.nothing_saveable and params["policy"] is None
  assert params["policy"] is policy or nothing


def saved_residuals(policy, capsys):
  model = Mlp(4, rngs=sr.Rngs(0))
  capsys.readouterr()
  ad_checkpoint.print_saved_residuals(
    lambda x: jnp.sum(sr.remat(Mlp.__call__, policy=policy)(model, x)), X
  )
  return capsys.readouterr().out.strip().splitlines()


def test_policy_changes_what_is_saved(capsys):
  policies = jax.checkpoint_policies
  nothing = saved_residuals(policies.nothing_saveable, capsys)
  default = saved_residuals(None, capsys)
  everything = saved_residuals(policies.everything_saveable, capsys)
  dots = saved_residuals(policies.dots_saveable, capsys)
  named = saved_residuals(policies.save_only_these_names("hidden"), capsys)
  # Without a policy (or with nothing_saveable) only the inputs are kept.
  assert nothing == default
  assert all("from the argument" in r or "from a constant" in r for r in nothing)
  assert any("output of cos" in r for r in everything)
  assert not any("output of" in r for r in nothing)
  # The two matmuls' outputs; jax 0.12 names the jitted `_dense` they are computed in.
  matmul = ("output of dot_general", "output of jitted function '_dense'")
  assert sum(any(m in r for m in matmul) for r in dots) == 2
  assert sum("named 'hidden'" in r for r in named) == 1
  assert not any("named" in r for r in dots + nothing)


def test_prevent_cse_is_passed_on():
  model = Mlp(4, rngs=sr.Rngs(0))
  for prevent_cse in (True, False):
    f = sr.remat(Mlp.__call__, prevent_cse=prevent_cse)
    (params,) = checkpoint_eqns(jax.make_jaxpr(lambda x: f(model, x))(X).jaxpr)
    assert params["prevent_cse"] is prevent_cse
    np.testing.assert_allclose(f(model, X), model(X), rtol=1e-6)


def test_static_argnums_allows_python_control_flow():

  def repeat(block, x, times, square):
    for _ in range(times):
      x = block.encode(x)
    return x**2 if square else x

  model = make()
  with pytest.raises(jax.errors.TracerIntegerConversionError, match=r"__index__\(\)"):
    sr.remat(repeat)(model, X, 2, True)
  with pytest.raises(jax.errors.TracerBoolConversionError, match=r"boolean conversion"):
    sr.remat(repeat, static_argnums=2)(model, X, 2, True)
  f = sr.remat(repeat, static_argnums=(2, 3))
  np.testing.assert_allclose(f(model, X, 2, True), repeat(model, X, 2, True), rtol=1e-6)
  np.testing.assert_allclose(f(model, X, 3, False), repeat(model, X, 3, False), rtol=1e-6)
  g = sr.grad(lambda m, x: jnp.sum(f(m, x, 2, True)))(model, X)
  g0 = sr.grad(lambda m, x: jnp.sum(repeat(m, x, 2, True)))(model, X)
  np.testing.assert_allclose(g["linear"]["kernel"], g0["linear"]["kernel"], rtol=1e-5)


def test_static_argnums_counts_the_module_as_argument_0():
  model = make()
  before = values(model)
  with pytest.raises(
    sr.GraphError,
    match=r"static_argnums=0 marks argument 0, which holds a module.*"
    r"remove 0 from static_argnums",
  ):
    sr.remat(body, static_argnums=0)(model, X)
  assert_same_state(values(model), before)
  # Argument 1 is the first after the module.
  f = sr.remat(lambda m, scale, x: scale * m.encode(x), static_argnums=1)
  np.testing.assert_allclose(f(model, 3.0, X), 3.0 * model.encode(X), rtol=1e-6)


class Counter(sr.Module):
  """A Param and a Python-readable step counter in its own collection."""

  def __init__(self):
    self.w = sr.Param(jnp.full((4,), 2.0))
    self.step = sr.Variable(jnp.asarray(1))

  def __call__(self, x):
    n = int(self.step.value)  # needs a concrete value: the step is not traced
    self.step.value = self.step.value + 1
    return x * self.w.value**n


def test_variables_filter_closes_over_the_rest():
  model = Counter()
  x = jnp.arange(4.0)
  with pytest.raises(jax.errors.ConcretizationTypeError, match=r"concrete value"):
    sr.remat(Counter.__call__)(model, x)
  assert int(model.step.value) == 1
  f = sr.remat(Counter.__call__, variables=sr.Param)
  np.testing.assert_allclose(f(model, x), x * 2.0, rtol=1e-6)
  np.testing.assert_allclose(f(model, x), x * 4.0, rtol=1e-6)
  assert int(model.step.value) == 3  # mutations of closed-over variables are kept
  g = sr.grad(lambda m, x: jnp.sum(f(m, x)))(model, jnp.ones(4))
  np.testing.assert_allclose(g["w"], 3 * 2.0**2 * np.ones(4), rtol=1e-6)
  assert int(model.step.value) == 4


def test_variables_filter_keeps_gradients_of_a_mutating_block():
  plain, rematted = make(), make()
  g0 = sr.grad(loss)(plain, X)
  g = sr.grad(functools.partial(remat_loss, variables=sr.BatchStat))(rematted, X)
  for path, value in g0.flat().items():
    np.testing.assert_allclose(g.flat()[path], value, rtol=1e-5, atol=1e-6)
  assert_same_values(rematted, plain)


def rngs_block():
  return Block(4, rngs=sr.Rngs(params=0, dropout=1))


def test_rngs_filter_lifts_the_named_streams():
  plain, rematted = rngs_block(), rngs_block()
  out = sr.remat(body, rngs="dropout")(rematted, X)
  np.testing.assert_allclose(out, body(plain, X), rtol=1e-6)
  assert int(rematted.rngs.dropout.count.value) == 1
  assert_same_values(rematted, plain)


def test_drawing_from_a_stream_not_lifted_raises():
  model = rngs_block()
  before = values(model)
  with pytest.raises(
    sr.GraphError,
    match=r"drew from the RNG stream 'dropout' "
    r"\(`rngs\.dropout\.count`\), which is not lifted by "
    r"`rngs='params'`.*rngs=True.*'dropout'",
  ):
    sr.remat(body, rngs="params")(model, X)
  assert_same_state(values(model), before)
  with pytest.raises(sr.GraphError, match=r"RNG stream 'dropout'.*rngs=False"):
    sr.remat(body, rngs=False)(model, X)
  assert_same_state(values(model), before)


def test_concrete_true_points_at_static_argnums():
  with pytest.raises(TypeError, match=r"concrete=True\) is gone.*static_argnums=\(i,\)"):
    sr.remat(body, concrete=True)
  with pytest.raises(TypeError, match=r"static_argnums"):
    sr.remat(Block, concrete=True)


def test_exception_inside_leaves_the_modules_unchanged():

  def failing(block, x):
    block(x)  # writes batch statistics, to be rolled back
    block.linear.kernel.value = block.linear.kernel.value * 0
    raise ValueError("boom")

  model = make()
  before = values(model)
  with pytest.raises(ValueError, match="boom"):
    sr.remat(failing)(model, X)
  assert_same_state(values(model), before)
  with pytest.raises(ValueError, match="boom"):
    sr.grad(lambda m, x: sr.remat(failing)(m, x))(model, X)
  assert_same_state(values(model), before)


def test_structure_change_inside_is_carried_out():

  def grow(block, x):
    block.extra = sr.Param(jnp.zeros(()))
    return block(x)

  model = make()
  sr.remat(grow)(model, X)
  assert model.extra.value.shape == () and model.extra.path_str() == "extra"


# -- compositions ------------------------------------------------------------------


def test_remat_inside_jit():
  plain, rematted = make(), make()
  step = sr.jit(lambda m, x: sr.remat(body)(m, x))
  for _ in range(2):
    np.testing.assert_allclose(step(rematted, X), body(plain, X), rtol=1e-5)
  assert_same_values(rematted, plain)
  assert int(rematted.rngs.default.count.value) == 4


def test_grad_of_jit_of_remat():
  plain, rematted = make(), make()
  g0 = sr.grad(loss)(plain, X)
  g = sr.grad(sr.jit(remat_loss))(rematted, X)
  for path, value in g0.flat().items():
    np.testing.assert_allclose(g.flat()[path], value, rtol=1e-5, atol=1e-6)
  assert_same_values(rematted, plain)


def test_jit_of_grad_of_remat_with_a_policy():
  plain, rematted = make(), make()
  policy = jax.checkpoint_policies.dots_saveable
  step = sr.jit(sr.grad(functools.partial(remat_loss, policy=policy)))
  for _ in range(2):
    g0 = sr.grad(loss)(plain, X)
    g = step(rematted, X)
    for path, value in g0.flat().items():
      np.testing.assert_allclose(g.flat()[path], value, rtol=1e-5, atol=1e-6)
  assert_same_values(rematted, plain)


def test_nested_remat():
  plain, rematted = make(), make()
  outer = sr.remat(lambda m, x: sr.remat(body)(m, x) + m.encode(x))
  g0 = sr.grad(lambda m, x: jnp.sum(m(x) + m.encode(x)))(plain, X)
  g = sr.grad(lambda m, x: jnp.sum(outer(m, x)))(rematted, X)
  for path, value in g0.flat().items():
    np.testing.assert_allclose(g.flat()[path], value, rtol=1e-5, atol=1e-6)
  assert_same_values(rematted, plain)


def test_rngs_filter_counts_a_default_stream_under_the_name_asked_for():
  plain, rematted = make(), make()
  out = sr.remat(body, rngs="dropout")(rematted, X)
  np.testing.assert_allclose(out, body(plain, X), rtol=1e-6)
  assert_same_values(rematted, plain)
  before = values(rematted)
  with pytest.raises(sr.GraphError, match=r"RNG stream 'default'"):
    sr.remat(body, rngs=False)(rematted, X)
  assert_same_state(values(rematted), before)


def test_variables_filter_sees_paths_within_each_module():
  seen = []

  def record(path, var):
    seen.append(path)
    return True

  a, b = sr.nn.Linear(2, 2, rngs=sr.Rngs(0)), sr.nn.Linear(2, 2, rngs=sr.Rngs(1))
  out = sr.remat(lambda a, b, x: b(a(x)), variables=record)(a, b, jnp.ones((1, 2)))
  assert out.shape == (1, 2)
  assert set(seen) == {("kernel",), ("bias",)}
