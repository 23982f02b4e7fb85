"""What is saved is what was asked: remat policies checked, and sr.saved_residuals."""

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import statefulremat as sr

P = jax.checkpoint_policies
X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)
README = Path(__file__).resolve().parent.parent / "README.md"
# jax 0.10 and 0.11 make a names policy a frozen dataclass that publishes its names, so
# every name is checked; jax 0.12's are closures, judged by what they keep of the body's
# names (statefulremat/transforms/memory/_policy_check.py).
PUBLISHED = dataclasses.is_dataclass(P.save_only_these_names("h"))
PUBLISHED_OFFLOAD = dataclasses.is_dataclass(
  P.save_and_offload_only_these_names(
    names_which_can_be_saved=(),
    names_which_can_be_offloaded=(),
    offload_src="device",
    offload_dst="pinned_host",
  )
)


def refused(what, policy, name, suggestion):
  """The start of the message that refuses a policy whose name `name` (the body has
  `suggestion`) matches nothing, as the installed jax lets it be told."""
  if PUBLISHED:
    return re.escape(
      f"{what}: policy=jax.checkpoint_policies.{policy} refers to the name {name!r} "
      f"(did you mean {suggestion!r}?), which no `jax.ad_checkpoint.checkpoint_name` in "
      "the traced body gives"
    )
  factory = policy.split("(")[0]
  return re.escape(
    f"{what}: policy=jax.checkpoint_policies.{factory}(...) keeps none of the values the "
    "traced body names"
  )


class Block(sr.Module):
  """Two named values ('attn', 'mlp'), a running mean and a dropout mask: a call
  changes the module's state, so an error must leave that state as it was."""

  def __init__(self, d, *, rngs):
    self.a = sr.nn.Linear(d, d, rngs=rngs)
    self.b = sr.nn.Linear(d, d, rngs=rngs)
    self.mean = sr.BatchStat(jnp.zeros(d))
    self.rngs = rngs

  def __call__(self, x):
    h = checkpoint_name(jnp.sin(self.a(x)), "attn")
    y = checkpoint_name(jnp.sin(self.b(h)), "mlp")
    self.mean.value = 0.9 * self.mean.value + 0.1 * y.mean(0)
    keep = jax.random.bernoulli(self.rngs.dropout(), 0.9, y.shape)
    return jnp.where(keep, y, 0.0)


class Plain(sr.Module):
  """Read only, no randomness: gradients comparable with and without remat."""

  def __init__(self, d, *, rngs):
    self.a = sr.nn.Linear(d, d, rngs=rngs)
    self.b = sr.nn.Linear(d, d, rngs=rngs)

  def __call__(self, x):
    h = checkpoint_name(jnp.sin(self.a(x)), "h")
    return jnp.sin(self.b(h))


def values(module):
  return {
    p: np.asarray(
      jax.random.key_data(v) if jnp.issubdtype(jnp.result_type(v), jax.dtypes.prng_key) else v
    )
    for p, v in sr.state(module).flat().items()
  }


def assert_same(before, module):
  after = values(module)
  assert before.keys() == after.keys()
  for path, value in before.items():
    np.testing.assert_array_equal(after[path], value, err_msg=str(path))


def remat_loss(policy, method=Block.__call__):
  return lambda m, x: jnp.sum(sr.remat(method, policy=policy)(m, x) ** 2)


# -- names that match nothing ---------------------------------------------------------


@pytest.mark.parametrize("run", ["grad", "jit", "eager"])
def test_a_misspelt_name_raises_with_the_names_found_and_leaves_the_model(run):
  model = Block(4, rngs=sr.Rngs(0))
  before = values(model)
  f = sr.remat(Block.__call__, policy=P.save_only_these_names("atn"))
  call = {"grad": sr.grad(lambda m, x: jnp.sum(f(m, x))), "jit": sr.jit(f), "eager": f}[run]
  with pytest.raises(
    sr.TransformError,
    match=refused("sr.remat(Block.__call__)", "save_only_these_names('atn')", "atn", "attn"),
  ) as info:
    call(model, X)
  assert "The body names: 'attn', 'mlp'." in str(info.value)
  assert "Fix: spell the policy's names as the body does" in str(info.value)
  assert_same(before, model)


def test_every_missing_name_is_listed_with_its_suggestion():
  model = Block(4, rngs=sr.Rngs(0))
  before = values(model)
  policy = P.save_any_names_but_these("atn", "mpl", "zzz")
  if not PUBLISHED:
    # This jax's excluding policy keeps its names to itself, and keeping every named
    # value is also what save_any_names_but_these() means: not judged. What it keeps
    # is there to see.
    kept = sr.saved_residuals(remat_loss(policy), model, X)
    assert "attn" in [r.name for r in kept]
    policy = P.save_only_these_names("atn", "mpl", "zzz")  # an allow-list is judged
    with pytest.raises(
      sr.TransformError, match=r"keeps none of .* The body names: 'attn', 'mlp'\."
    ):
      sr.grad(remat_loss(policy))(model, X)
    assert_same(before, model)
    return
  with pytest.raises(
    sr.TransformError,
    match=re.escape(
      "refers to the names 'atn' (did you mean 'attn'?), 'mpl' (did you mean 'mlp'?), "
      "'zzz', which no"
    ),
  ):
    sr.grad(remat_loss(policy))(model, X)
  assert_same(before, model)


def test_a_body_without_names_says_so():
  model = Plain(4, rngs=sr.Rngs(0))
  told = r"'h'.*" if PUBLISHED else r"save_only_these_names\(\.\.\.\) keeps none.*"
  fix = "`checkpoint_name(x, 'h')`" if PUBLISHED else "`checkpoint_name(x, name)`"
  with pytest.raises(
    sr.TransformError,
    match=told + r"The body names nothing: it has no "
    r"checkpoint_name at all\. Fix: .*" + re.escape(fix),
  ):
    sr.grad(remat_loss(P.save_only_these_names("h"), sr.nn.Linear.__call__))(model.a, X)


def test_names_inside_calls_in_the_body_are_found():
  """checkpoint_name under jit, scan, cond, custom_jvp / custom_vjp and a nested remat."""

  @jax.custom_jvp
  def smooth(x):
    return checkpoint_name(jnp.sin(x), "in_jvp")

  smooth.defjvp(lambda p, t: (smooth(p[0]), jnp.cos(p[0]) * t[0]))

  @jax.custom_vjp
  def rough(x):
    return checkpoint_name(jnp.cos(x), "in_vjp")

  rough.defvjp(lambda x: (rough(x), x), lambda x, g: (-jnp.sin(x) * g,))

  def body(m, x):
    x = jax.jit(lambda y: checkpoint_name(jnp.sin(y), "in_jit"))(m.a(x))
    x, _ = jax.lax.scan(lambda c, _: (checkpoint_name(jnp.tanh(c), "in_scan"), None), x, length=2)
    x = jax.lax.cond(x.sum() > 0, lambda x: checkpoint_name(x, "in_cond"), jnp.sin, x)
    x = jax.checkpoint(lambda x: checkpoint_name(jnp.sin(x), "in_remat"))(x)
    return rough(smooth(x))

  names = ("in_cond", "in_jit", "in_jvp", "in_remat", "in_scan", "in_vjp")
  model = Plain(4, rngs=sr.Rngs(0))
  g = sr.grad(remat_loss(P.save_only_these_names(*names), body))(model, X)
  g0 = sr.grad(lambda m, x: jnp.sum(body(m, x) ** 2))(model, X)
  np.testing.assert_allclose(g["a"]["kernel"], g0["a"]["kernel"], rtol=1e-5, atol=1e-6)
  # With its names published, a misspelt name beside a correct one is caught; without,
  # a policy that keeps none of the body's names.
  misspelt = ("in_jit", "in_sacn") if PUBLISHED else ("in_sacn",)
  with pytest.raises(
    sr.TransformError,
    match=(re.escape("'in_sacn' (did you mean 'in_scan'?)") if PUBLISHED else "keeps none")
    + ".*"
    + re.escape("The body names: " + ", ".join(map(repr, names)) + "."),
  ):
    sr.grad(remat_loss(P.save_only_these_names(*misspelt), body))(model, X)


def test_save_from_both_policies_is_not_opened_and_saved_residuals_shows_it():
  """A combination keeps its parts to itself (a closure in every jax): it is not
  judged, and sr.saved_residuals shows that the misspelt part keeps no named value."""
  policy = P.save_from_both_policies(P.dots_saveable, P.save_only_these_names("atn"))
  model = Plain(4, rngs=sr.Rngs(0))
  loss = remat_loss(policy, Plain.__call__)
  g, g0 = sr.grad(loss)(model, X), sr.grad(lambda m, x: jnp.sum(m(x) ** 2))(model, X)
  np.testing.assert_allclose(g["a"]["kernel"], g0["a"]["kernel"], rtol=1e-6)
  kept = sr.saved_residuals(loss, model, X)
  assert not [r for r in kept if r.name]
  assert [r.op for r in kept if r.op].count("dot_general") == 2  # what dots_saveable keeps


def test_a_correct_names_policy_gives_the_gradients_of_no_remat_and_saves_its_name():
  model = Plain(4, rngs=sr.Rngs(0))
  policy = P.save_only_these_names("h")
  g0 = sr.grad(lambda m, x: jnp.sum(m(x) ** 2))(model, X)
  for step in (
    sr.grad(remat_loss(policy, Plain.__call__)),
    sr.jit(sr.grad(remat_loss(policy, Plain.__call__))),
  ):
    g = step(model, X)
    for path, value in g0.flat().items():
      np.testing.assert_allclose(g.flat()[path], value, rtol=1e-6, atol=1e-7)
  saved = sr.saved_residuals(remat_loss(policy, Plain.__call__), model, X)
  assert [(r.name, r.shape) for r in saved if r.name] == [("h", (2, 4))]


def test_the_check_traces_the_body_once_per_trace_and_not_per_call():
  traces = []

  def body(m, x):
    traces.append(1)
    return m(x)

  model = Plain(4, rngs=sr.Rngs(0))
  step = sr.jit(sr.grad(remat_loss(P.save_only_these_names("h"), body)))
  step(model, X)
  assert len(traces) == 1  # the check reads the trace jax.checkpoint makes anyway
  step(model, X)
  step(model, X)
  assert len(traces) == 1  # compiled calls run no check


def test_the_lowered_program_is_the_same_as_without_a_check():
  """The names check re-binds the traced checkpoint: XLA gets the same program as with
  a policy that needs no check and saves the same (everything named 'h' is all that
  is named here, so save_any_names_but_these() saves the same)."""
  model = Plain(4, rngs=sr.Rngs(0))

  def lowered(policy):
    return sr.jit(sr.grad(remat_loss(policy, Plain.__call__))).lower(model, X).as_text()

  checked, unchecked = lowered(P.save_only_these_names("h")), lowered(P.save_any_names_but_these())
  assert checked == unchecked.replace("SaveAnyNamesButThese", "SaveOnlyTheseNames")


# -- remat_scan and scan ---------------------------------------------------------------


def stacked_body(layer, h):
  return jnp.tanh(checkpoint_name(layer(h), "pre"))


@pytest.mark.parametrize("lengths, n", [((2, 3), 6), ((3, 3), 7), ((6,), 6)])
def test_remat_scan_checks_its_innermost_policy(lengths, n):
  stack = sr.vmap(sr.nn.Linear, axis_size=n)(4, 4, rngs=sr.Rngs(0))
  before = values(stack)
  run = sr.remat_scan(stacked_body, lengths, length=n, policy=P.save_only_these_names("pr"))
  with pytest.raises(
    sr.TransformError,
    match=refused("sr.remat_scan(stacked_body)", "save_only_these_names('pr')", "pr", "pre"),
  ):
    sr.grad(lambda s, x: jnp.sum(run(s, x)))(stack, X)
  assert_same(before, stack)
  good = sr.remat_scan(stacked_body, lengths, length=n, policy=P.save_only_these_names("pre"))
  g = sr.grad(lambda s, x: jnp.sum(good(s, x) ** 2))(stack, X)

  def loop(stack, x):
    for layer in sr.unstack(stack):
      x = stacked_body(layer, x)
    return jnp.sum(x**2)

  g0 = sr.grad(loop)(stack, X)
  np.testing.assert_allclose(g["kernel"], g0["kernel"], rtol=1e-5, atol=1e-6)


def test_remat_scan_class_form_checks_its_policy():
  Deep = sr.remat_scan(sr.nn.Linear, lengths=(2, 2), policy=P.save_only_these_names("h"))
  deep = Deep(4, 4, rngs=sr.Rngs(0))
  before = values(deep)
  with pytest.raises(
    sr.TransformError, match=r"('h', which no|keeps none of) .* The body names nothing"
  ):
    deep(X)
  assert_same(before, deep)


def test_a_scan_over_a_remat_block_checks_the_policy():
  class Cell(Plain):
    def __call__(self, x):
      return super().__call__(x), None

  Stack = sr.scan(
    sr.remat(Cell, policy=P.save_only_these_names("hh"), prevent_cse=False),
    length=3,
    variable_axes={sr.Param: 0},
    split_rngs={"params": True},
  )
  stack = Stack(4, rngs=sr.Rngs(0))
  before = values(stack)
  with pytest.raises(
    sr.TransformError,
    match=refused("sr.remat(Cell.__call__)", "save_only_these_names('hh')", "hh", "h"),
  ):
    sr.grad(lambda s, x: jnp.sum(s(x)[0]))(stack, X)
  assert_same(before, stack)


# -- policies that save what they claim to exclude --------------------------------------


def test_save_anything_except_these_names_raises_where_it_saves_everything(capsys):
  policy = P.save_anything_except_these_names("attn")
  model = Block(4, rngs=sr.Rngs(0))

  # The behaviour being refused, in raw JAX: it keeps the value it was told to exclude.
  def raw(x):
    return jnp.sum(jnp.sin(checkpoint_name(jnp.sin(x), "attn")))

  def kept(policy):
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(raw, policy=policy), X)
    return capsys.readouterr().out.splitlines()

  assert len(kept(policy)) > len(kept(P.save_any_names_but_these("attn"))) == 1
  before = values(model)
  message = (
    re.escape(
      "sr.remat(Block.__call__): policy=jax.checkpoint_policies."
      "save_anything_except_these_names(...) is meant to save every value except the "
      "names it was given, but it keeps every value the traced body names ('attn', 'mlp')"
    )
    + ".*"
    + re.escape("Fix: `jax.checkpoint_policies.save_any_names_but_these(*names)`")
  )
  with pytest.raises(sr.TransformError, match=message):
    sr.grad(remat_loss(policy))(model, X)
  assert_same(before, model)
  Checked = sr.remat(Block, policy=policy)  # the class form, when it is called
  checked = Checked(4, rngs=sr.Rngs(0))
  with pytest.raises(sr.TransformError, match="save_any_names_but_these"):
    checked(X)


def test_save_any_names_but_these_is_accepted_and_excludes():
  model = Plain(4, rngs=sr.Rngs(0))
  kept = sr.saved_residuals(remat_loss(P.save_any_names_but_these("h"), Plain.__call__), model, X)
  assert not [r for r in kept if r.name]


# -- offloading where nothing is offloaded ----------------------------------------------


@pytest.mark.parametrize(
  "policy",
  [
    P.offload_dot_with_no_batch_dims("device", "pinned_host"),
    P.save_and_offload_only_these_names(
      names_which_can_be_saved=[],
      names_which_can_be_offloaded=["h"],
      offload_src="device",
      offload_dst="pinned_host",
    ),
  ],
  ids=["offload_dot_with_no_batch_dims", "save_and_offload_only_these_names"],
)
def test_an_offload_policy_warns_on_cpu_and_keeps_gradients(policy):
  assert jax.default_backend() == "cpu"  # the suite runs on CPU, which offloads nothing
  model = Plain(4, rngs=sr.Rngs(0))
  with pytest.warns(
    UserWarning,
    match=re.escape(
      "offloads residuals to 'pinned_host' memory, but on this backend (cpu) nothing is offloaded"
    )
    + ".*Offloading needs a GPU or TPU backend",
  ):
    g = sr.grad(remat_loss(policy, Plain.__call__))(model, X)
  g0 = sr.grad(lambda m, x: jnp.sum(m(x) ** 2))(model, X)
  np.testing.assert_allclose(g["a"]["kernel"], g0["a"]["kernel"], rtol=1e-6)


def test_a_misspelt_offload_name_raises():
  policy = P.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["hh"],
    offload_src="device",
    offload_dst="pinned_host",
  )
  # It offloads nothing (its one name is not in the body), so there is no warning.
  message = r"'hh' \(did you mean 'h'\?\)" if PUBLISHED_OFFLOAD else "keeps none of the values"
  with pytest.raises(sr.TransformError, match=message):
    sr.grad(remat_loss(policy, Plain.__call__))(Plain(4, rngs=sr.Rngs(0)), X)


# -- sr.saved_residuals ------------------------------------------------------------------


INPUTS = [
  (None, (4,), "Param `model.a.bias`"),
  (None, (4, 4), "Param `model.a.kernel`"),
  (None, (4,), "Param `model.b.bias`"),
  (None, (4, 4), "Param `model.b.kernel`"),
  (None, (2, 4), "argument `x`"),
]


def residuals(policy):
  def loss(model, x):
    return jnp.sum(sr.remat(Plain.__call__, policy=policy)(model, x))

  return sr.saved_residuals(loss, Plain(4, rngs=sr.Rngs(0)), X)


def test_saved_residuals_of_nothing_saveable_are_the_inputs():
  saved = residuals(P.nothing_saveable)
  assert [(r.name, r.shape, r.source) for r in saved] == INPUTS
  assert all(r.dtype == jnp.float32 and r.op is None for r in saved)
  assert residuals(None) == saved


def test_saved_residuals_of_save_only_these_names_add_the_name():
  saved = residuals(P.save_only_these_names("h"))
  assert [(r.name, r.shape, r.source) for r in saved[:5]] == INPUTS
  (named,) = saved[5:]
  assert (named.name, named.shape, named.dtype) == ("h", (2, 4), jnp.float32)
  assert re.fullmatch(r".*test_remat_policy\.py:\d+:\d+ \(Plain\.__call__\)", named.source)
  assert str(named) == f"float32[2,4] named 'h' from {named.source}"


def test_saved_residuals_of_everything_saveable_equal_no_remat(capsys):
  def plain_loss(model, x):
    return jnp.sum(model(x))

  everything = residuals(P.everything_saveable)
  plain = sr.saved_residuals(plain_loss, Plain(4, rngs=sr.Rngs(0)), X)
  assert [(r.name, r.shape, r.op) for r in everything] == [(r.name, r.shape, r.op) for r in plain]
  assert [(r.name, r.op, r.shape) for r in everything if r.op or r.name] == [
    (None, "cos", (2, 4)),
    ("h", None, (2, 4)),
    (None, "cos", (2, 4)),
  ]
  # JAX's own listing of the same function of arrays agrees, line for line.
  graphdef, params = sr.split(Plain(4, rngs=sr.Rngs(0)))
  ours = sr.saved_residuals(lambda p, x: plain_loss(sr.merge(graphdef, p), x), params, X)
  capsys.readouterr()
  jax.ad_checkpoint.print_saved_residuals(
    lambda p, x: plain_loss(sr.merge(graphdef, p), x), params, X
  )
  theirs = capsys.readouterr().out.strip().splitlines()
  assert [r.shape for r in ours] == [
    tuple(int(d) for d in re.match(r"\w+\[([\d,]*)\]", line).group(1).split(",") if d)
    for line in theirs
  ]
  assert [r.name for r in ours] == [
    m.group(1) if (m := re.search(r"named '(\w+)'", line)) else None for line in theirs
  ]


def test_saved_residuals_see_through_a_scan_to_the_names_saved_per_layer():
  stack = sr.vmap(sr.nn.Linear, axis_size=6)(4, 4, rngs=sr.Rngs(0))
  run = sr.remat_scan(stacked_body, (6,), policy=P.save_only_these_names("pre"))
  saved = sr.saved_residuals(lambda s, x: jnp.sum(run(s, x)), stack, X)
  assert [(r.name, r.shape) for r in saved if r.name] == [("pre", (6, 2, 4))]
  nothing = sr.saved_residuals(
    lambda s, x: jnp.sum(sr.remat_scan(stacked_body, (6,))(s, x)), stack, X
  )
  assert not [r for r in nothing if r.name]


def test_saved_residuals_compute_nothing_and_leave_the_modules():
  model = Block(4, rngs=sr.Rngs(0))
  before = values(model)
  saved = sr.saved_residuals(lambda m, x: jnp.sum(m(x)), model, X)
  assert "attn" in {r.name for r in saved}
  assert_same(before, model)  # neither the running mean nor the dropout count moved


def test_saved_residuals_take_a_module_as_the_function():
  saved = sr.saved_residuals(Plain(4, rngs=sr.Rngs(0)), X)
  assert [r.name for r in saved if r.name] == ["h"]
  assert "Param `self.a.kernel`" in [r.source for r in saved]


def test_the_readme_example_runs_and_prints_what_it_shows(capsys):
  text = README.read_text(encoding="utf-8")
  section = text.split("### What a policy saves", 1)[1].split("\n## ", 1)[0]
  code, shown = re.findall(r"```(?:python|text)\n(.*?)```", section, re.DOTALL)[:2]
  exec(compile(code, str(README), "exec"), {})
  where = re.compile(r" from \S+:\d+(:\d+)? \(")
  printed = [
    where.sub(" from <src> (", line) for line in capsys.readouterr().out.strip().splitlines()
  ]
  assert printed == [where.sub(" from <src> (", line) for line in shown.strip().splitlines()]


# -- what is not a policy ----------------------------------------------------------------


@pytest.mark.parametrize(
  "policy, match",
  [
    (
      "nothing_saveable",
      r"policy='nothing_saveable' is a string.*"
      + re.escape("Fix: `policy=jax.checkpoint_policies.nothing_saveable`."),
    ),
    (
      "save_only_these_names",
      r"policy='save_only_these_names' is a string.*"
      + re.escape("Fix: `policy=jax.checkpoint_policies.save_only_these_names("),
    ),
    ("nothing", r"policy='nothing' is a string.*Fix: a policy of `jax.checkpoint_policies`"),
    (0.5, r"policy=0.5 \(float\) is not a remat policy\. Fix: "),
    (
      P.save_only_these_names,
      r"policy=jax.checkpoint_policies.save_only_these_names is the factory that makes a "
      r"policy, not a policy.*Fix: call it",
    ),
    (
      P.offload_dot_with_no_batch_dims,
      r"policy=jax.checkpoint_policies.offload_dot_with_no_batch_dims is the factory.*"
      + re.escape("offload_dot_with_no_batch_dims('device', 'pinned_host')`."),
    ),
  ],
  ids=["constant-by-name", "factory-by-name", "unknown-name", "number", "factory", "offload"],
)
@pytest.mark.parametrize("form", ["function", "class", "remat_scan"])
def test_what_is_not_a_policy_is_refused_when_the_transform_is_made(policy, match, form):
  make = {
    "function": lambda: sr.remat(Plain.__call__, policy=policy),
    "class": lambda: sr.remat(Plain, policy=policy),
    "remat_scan": lambda: sr.remat_scan(stacked_body, (2,), policy=policy),
  }[form]
  with pytest.raises(TypeError, match=r"^sr\.remat(_scan)?\(.*\): " + match):
    make()


def test_sow_under_a_checked_named_policy_comes_out_as_arrays():
  """A named policy is checked on a jaxpr of the loop before it runs: the sown values
  and the written state come out of that run, never as its tracers."""

  class Named(sr.Module):
    def __init__(self, *, rngs):
      self.linear = sr.nn.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      h = checkpoint_name(self.linear(x), "proj")
      self.sow(sr.Intermediate, "features", h)
      return jnp.tanh(h)

  stack = sr.remat_scan(Named, lengths=(2, 2), policy=P.save_only_these_names("proj"))(
    rngs=sr.Rngs(0)
  )
  layers = sr.unstack(stack)
  h = X
  for layer in layers:
    h = layer(h)
  np.testing.assert_allclose(stack(X), h, rtol=1e-5, atol=1e-5)
  (sown,) = stack.features.value
  assert isinstance(sown, jax.Array) and not isinstance(sown, jax.core.Tracer)
  expected = jnp.stack([layer.features.value[0] for layer in layers])
  np.testing.assert_allclose(sown, expected, rtol=1e-5, atol=1e-5)
