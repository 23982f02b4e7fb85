"""sr.policies: MaxText's presets on blocks built from sr.nn, whose layers name their
tensors as MaxText does; custom policies; what each keeps, shown by sr.saved_residuals."""

import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import statefulremat as sr
from statefulremat.policies._presets import PRESETS

OFFLOAD_WARNING = "nothing is offloaded"
X = jax.random.normal(jax.random.key(1), (2, 8, 16))
# What the GPT block's backward pass needs of its named values, read off a policy that
# saves every named value: mlpwo feeds only the residual sum, whose gradient needs
# nothing, so no policy keeps it here.
NEEDED = {"query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi"}


class GPTBlock(sr.Module):
  """Pre-LayerNorm GPT block of sr.nn layers."""

  def __init__(self, dim=16, heads=2, hidden=64, *, rngs):
    self.ln1 = sr.nn.LayerNorm(dim, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(heads, dim, rngs=rngs)
    self.ln2 = sr.nn.LayerNorm(dim, rngs=rngs)
    self.mlp = sr.nn.MLP(dim, hidden, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x), is_causal=True)
    return x + self.mlp(self.ln2(x))


class Plain(sr.Module):
  """A block that names nothing."""

  def __init__(self, *, rngs):
    self.linear = sr.nn.Linear(16, 16, rngs=rngs)

  def __call__(self, x):
    return jnp.sin(self.linear(x))


def loss(model, x):
  return jnp.sum(model(x) ** 2)


# Compiled as one program (eagerly, every op of a gradient compiles on its own); one
# function, so the reference every preset is checked against compiles once.
compiled_value_and_grad = sr.jit(sr.value_and_grad(loss))


def stack(policy):
  return sr.remat_scan(GPTBlock, lengths=(3,), policy=policy)(rngs=sr.Rngs(0))


def offloads(policy) -> bool:
  return isinstance(policy, sr.policies.Policy) and bool(policy.offloaded)


def named(residuals) -> dict[str, tuple]:
  return {r.name: (r.shape, r.offloaded) for r in residuals if r.name is not None}


def test_a_policy_saving_every_name_shows_what_the_block_needs():
  saved = named(sr.saved_residuals(loss, stack(sr.policies.save_any_names_but_these()), X))
  assert set(saved) == NEEDED
  assert saved["query_proj"] == ((3, 2, 8, 2, 8), False)  # per layer: (layer, b, t, h, d)
  assert saved["mlpwi"] == ((3, 2, 8, 64), False)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_keeps_exactly_its_names(name):
  policy = sr.policies.preset(name)
  model = stack(policy)
  if offloads(policy):
    with pytest.warns(UserWarning, match=OFFLOAD_WARNING):
      saved = named(sr.saved_residuals(loss, model, X))
  else:
    saved = named(sr.saved_residuals(loss, model, X))
  assert set(saved) == set(policy.names) & NEEDED
  for tensor, (_, offloaded) in saved.items():
    assert offloaded == (tensor in policy.offloaded), tensor


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_gives_the_gradients_without_remat(name):
  policy = sr.policies.preset(name)
  model = stack(policy)
  reference = stack(jax.checkpoint_policies.everything_saveable)
  sr.update(reference, sr.state(model))
  if offloads(policy):
    with pytest.warns(UserWarning, match=OFFLOAD_WARNING):
      value, grads = compiled_value_and_grad(model, X)
  else:
    value, grads = compiled_value_and_grad(model, X)
  expected_value, expected = compiled_value_and_grad(reference, X)
  np.testing.assert_allclose(value, expected_value, rtol=1e-6)
  for (path, g), (_, e) in zip(grads.flat().items(), expected.flat().items()):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=str(path))


class ScanBlock(GPTBlock):
  """The GPT block as sr.scan's body: (carry, ys)."""

  def __call__(self, x):
    return super().__call__(x), None


def test_a_preset_under_scan_of_remat_keeps_its_names():
  remat = sr.remat(ScanBlock, policy=sr.policies.save_qkv_proj)
  model = sr.scan(remat, length=3, variable_axes={True: 0})(rngs=sr.Rngs(0))
  saved = named(sr.saved_residuals(lambda m, x: jnp.sum(m(x)[0] ** 2), model, X))
  assert saved == {
    name: ((3, 2, 8, 2, 8), False) for name in ("query_proj", "key_proj", "value_proj")
  }


def test_a_preset_works_on_a_block_with_only_some_of_its_names():
  # An MLP gives two of minimal's nine names; its output (mlpwo) is the remat's output,
  # never a residual of it.
  mlp = sr.remat(sr.nn.MLP, policy=sr.policies.minimal)(16, 32, rngs=sr.Rngs(0))
  x = X.reshape(-1, 16)
  assert set(named(sr.saved_residuals(lambda m, x: jnp.sum(jnp.sin(m(x))), mlp, x))) == {"mlpwi"}


def test_a_preset_none_of_whose_names_the_block_gives_raises():
  block = sr.remat(Plain, policy=sr.policies.minimal)(rngs=sr.Rngs(0))
  with pytest.raises(sr.TransformError, match=r"policy=sr\.policies\.minimal keeps") as info:
    sr.grad(loss)(block, X)
  assert "The body names nothing" in str(info.value)
  assert "needs only one of its names" in str(info.value)


def test_full_saves_nothing_and_is_never_refused():
  block = sr.remat(Plain, policy=sr.policies.full)(rngs=sr.Rngs(0))
  assert named(sr.saved_residuals(loss, block, X)) == {}


def test_custom_with_offload_lowers_and_warns_on_cpu():
  policy = sr.policies.custom({"query_proj": "offload", "mlpwo": "device", "mlpwi": "remat"})
  assert (policy.saved, policy.offloaded, policy.recomputed) == (
    ("mlpwo",),
    ("query_proj",),
    ("mlpwi",),
  )
  model = stack(policy)
  graphdef, params, rest = sr.split(model, sr.Param, ...)

  def step(params, rest, x):
    return jax.grad(lambda p: loss(sr.merge(graphdef, p, rest), x))(params)

  with pytest.warns(UserWarning, match=OFFLOAD_WARNING) as record:
    lowered = jax.jit(step).lower(params, rest, X)
  assert "sr.policies.custom({'query_proj': 'offload'" in str(record[0].message)
  assert lowered.as_text()
  with pytest.warns(UserWarning, match=OFFLOAD_WARNING):
    saved = named(sr.saved_residuals(loss, model, X))
  assert saved == {"query_proj": ((3, 2, 8, 2, 8), True)}


def test_custom_takes_designs_attention_out_for_context():
  # DESIGN names attention's output before out_proj `attention_out`; the layer tags it
  # `context`, MaxText's name: custom takes either.
  policy = sr.policies.custom({"attention_out": "device"})
  assert policy.saved == ("context",)
  model = stack(policy)
  assert named(sr.saved_residuals(loss, model, X)) == {"context": ((3, 2, 8, 2, 8), False)}


@pytest.mark.parametrize(
  "tensors, error, match",
  [
    (["query_proj"], TypeError, "takes a dict from checkpoint names"),
    ({1: "device"}, TypeError, r"the entry 1: 'device' is keyed by a int.*Fix"),
    ({"mlpwo": "save"}, sr.TransformError, r"the entry 'mlpwo': 'save' is not a choice"),
    ({"mlpwo": "offloaded"}, sr.TransformError, re.escape("Fix: {'mlpwo': 'offload'}")),
  ],
)
def test_custom_misuse_says_which_entry_and_the_fix(tensors, error, match):
  with pytest.raises(error, match=match):
    sr.policies.custom(tensors)


def test_preset_by_name():
  assert sr.policies.preset("minimal_offloaded") is sr.policies.minimal_offloaded
  with pytest.raises(sr.TransformError, match="did you mean 'minimal'"):
    sr.policies.preset("minimul")
  with pytest.raises(TypeError, match="is a string"):
    sr.policies.preset(sr.policies.minimal)  # pyright: ignore[reportArgumentType]


def test_presets_are_maxtexts():
  qkv = {"query_proj", "key_proj", "value_proj", "qkv_proj"}
  minimal = qkv | {"out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo"}
  p = sr.policies
  assert p.full.names == ()
  assert set(p.minimal.saved) == minimal
  assert set(p.minimal_with_context.saved) == minimal | {"context"}
  assert set(p.save_dot_with_context_except_mlp.saved) == qkv | {"context", "out_proj"}
  assert set(p.save_dot_except_mlpwi.saved) == qkv | {"out_proj", "mlpwo"}
  assert set(p.save_dot_except_mlp.saved) == qkv | {"out_proj"}
  assert set(p.save_qkv_proj.saved) == qkv
  assert set(p.save_out_proj.saved) == {"out_proj"}
  assert set(p.qkv_proj_offloaded.offloaded) == qkv - {"qkv_proj"}
  assert (set(p.minimal_offloaded.offloaded), p.minimal_offloaded.saved) == (minimal, ())


def test_policies_have_names_pickle_and_compare_by_value():
  assert repr(sr.policies.minimal) == "sr.policies.minimal"
  custom = sr.policies.custom({"mlpwo": "device"})
  for policy in (sr.policies.minimal, sr.policies.minimal_offloaded, custom):
    again = pickle.loads(pickle.dumps(policy))
    assert again == policy and hash(again) == hash(policy) and repr(again) == repr(policy)
  assert sr.policies.custom({"mlpwo": "device"}) == custom
  # One class per equal policy; a class form with a preset pickles as the call that made it.
  assert sr.remat(GPTBlock, policy=custom) is sr.remat(
    GPTBlock, policy=sr.policies.custom({"mlpwo": "device"})
  )
  Remat = sr.remat(GPTBlock, policy=sr.policies.minimal)
  assert pickle.loads(pickle.dumps(Remat)) is Remat


def test_jax_policies_are_reexported():
  for name in (
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "save_only_these_names",
    "save_any_names_but_these",
    "save_and_offload_only_these_names",
    "offload_dot_with_no_batch_dims",
  ):
    assert getattr(sr.policies, name) is getattr(jax.checkpoint_policies, name), name
  assert not hasattr(sr.policies, "save_anything_except_these_names")  # ignores its names


def keep_every_name(f):
  return sr.remat(f, policy=jax.checkpoint_policies.save_any_names_but_these())


@pytest.mark.parametrize(
  "layer, x, names",
  [
    (
      lambda r: sr.nn.MultiHeadAttention(2, 16, rngs=r),
      X,
      {"query_proj", "key_proj", "value_proj", "context", "out_proj"},
    ),
    (lambda r: sr.nn.MLP(16, 32, rngs=r), X, {"mlpwi", "mlpwo"}),
    (lambda r: sr.nn.Conv(16, 8, 3, rngs=r), X, {"conv_out"}),
    (lambda r: sr.nn.ConvTranspose(16, 8, 3, rngs=r), X, {"conv_out"}),
  ],
  ids=["MultiHeadAttention", "MLP", "Conv", "ConvTranspose"],
)
def test_layers_name_their_tensors(layer, x, names):
  model = layer(sr.Rngs(0))
  f = keep_every_name(lambda m, x: jnp.sum(jnp.sin(m(x))))
  assert set(named(sr.saved_residuals(f, model, x))) == names


def test_the_names_cost_nothing_without_a_policy_that_reads_them(monkeypatch):
  import statefulremat.nn._mlp as mlp_module
  import statefulremat.nn._multi_head_attention as mha_module

  model = stack(None)
  graphdef, params, rest = sr.split(model, sr.Param, ...)

  def lowered():
    def step(params, rest, x):
      return jax.grad(lambda p: loss(sr.merge(graphdef, p, rest), x))(params)

    return jax.jit(step).lower(params, rest, X)

  named_text, named_grads = lowered().as_text(), sr.jit(sr.grad(loss))(model, X)
  for module in (mlp_module, mha_module):
    monkeypatch.setattr(module, "checkpoint_name", lambda x, name: x)
  plain_text, plain_grads = lowered().as_text(), sr.jit(sr.grad(loss))(model, X)
  assert named_text == plain_text
  for a, b in zip(jax.tree.leaves(named_grads), jax.tree.leaves(plain_grads)):
    np.testing.assert_array_equal(a, b)


def test_offloaded_residuals_are_shown_as_such():
  def block(x):
    return jnp.sum(jnp.sin(checkpoint_name(jnp.sin(x), "h")))

  policy = sr.policies.custom({"h": "offload"})
  with pytest.warns(UserWarning, match=OFFLOAD_WARNING):
    (residual,) = [r for r in sr.saved_residuals(sr.remat(block, policy=policy), X) if r.name]
  assert residual.offloaded and "named 'h' (offloaded to host) from" in str(residual)
