"""sr.nn against flax.nnx: same parameter names and shapes, same init, same numbers.

Each parity case builds our layer and nnx's with equal seeds, checks that the
Params (and BatchStats) map one to one by path, copies ours into nnx's, and compares
outputs in training and evaluation mode. The rest pins what nnx has no counterpart
for: Dropout's RNG bookkeeping, metadata, mode switching, transforms, errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx.nn import attention as nnx_attention

import statefulremat as sr

ATOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _fast_compiles():
  """Compiles with little XLA optimisation: on CPU this makes the many small programs
  of this file (random initialisers, dropout masks) compile several times faster."""
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


def _x(*shape, dtype=jnp.float32, seed=0):
  return jnp.asarray(np.random.RandomState(seed).normal(size=shape), dtype)


def _ids(*shape, high=10):
  return jnp.asarray(np.random.RandomState(1).randint(0, high, size=shape), jnp.int32)


def _flat(module, kind):
  """``{path: array}`` of our or nnx's variables of ``kind``."""
  if isinstance(module, sr.Module):
    return dict(sr.state(module, kind).flat())
  return {p: v[...] for p, v in nnx.to_flat_state(nnx.state(module, kind))}


def _copy_into_nnx(ours, theirs):
  """Writes every Param and BatchStat of ``ours`` into ``theirs`` by path."""
  for path, var in ours.iter_variables():
    if isinstance(var, (sr.Param, sr.BatchStat)):
      target = theirs
      for key in path:
        target = getattr(target, key) if isinstance(key, str) else target[key]
      assert target.shape == var.shape, path
      target.set_value(var.value)


def _assert_same_variables(ours, theirs):
  """Same Params and BatchStats: paths, shapes, dtypes and values."""
  for mine, nnx_kind in ((sr.Param, nnx.Param), (sr.BatchStat, nnx.BatchStat)):
    a, b = _flat(ours, mine), _flat(theirs, nnx_kind)
    assert sorted(a) == sorted(b)
    for path in a:
      assert a[path].shape == b[path].shape, path
      assert a[path].dtype == b[path].dtype, path
      np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


def _close(a, b, atol=ATOL):
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
  np.testing.assert_allclose(
    np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol, rtol=1e-5
  )


# Each case: (build(nn, Rngs), inputs, call kwargs(Rngs)); `nn` is sr.nn or nnx.
# Sizes are shared between cases on purpose: every new shape costs a compilation.
X = _x(2, 3, 4)
X8 = _x(2, 3, 8, seed=1)
CASES = {
  "linear": (lambda nn, R: nn.Linear(4, 4, rngs=R(0)), (X,), None),
  "linear_nobias_1d": (lambda nn, R: nn.Linear(4, 4, use_bias=False, rngs=R(0)), (X[0, 0],), None),
  "linear_bf16": (lambda nn, R: nn.Linear(4, 4, dtype=jnp.bfloat16, rngs=R(0)), (X,), None),
  "linear_bf16_params": (
    lambda nn, R: nn.Linear(4, 4, param_dtype=jnp.bfloat16, rngs=R(0)),
    (X,),
    None,
  ),
  "linear_int_input": (lambda nn, R: nn.Linear(4, 4, rngs=R(0)), (_ids(2, 3, 4),), None),
  "linear_precision": (
    lambda nn, R: nn.Linear(4, 4, precision=jax.lax.Precision.HIGHEST, rngs=R(0)),
    (X,),
    None,
  ),
  "linear_general": (
    lambda nn, R: nn.LinearGeneral((2, 2), (2, 2), axis=(1, -1), rngs=R(0)),
    (X.reshape(3, 2, 2, 2)[:, :, 0],),
    None,
  ),
  "linear_general_batch": (
    lambda nn, R: nn.LinearGeneral(2, 4, batch_axis={0: 2}, rngs=R(0)),
    (X.reshape(2, 6, 2),),
    None,
  ),
  "conv_same_2d": (lambda nn, R: nn.Conv(4, 4, (3, 3), rngs=R(0)), (_x(2, 5, 5, 4),), None),
  "conv_valid_strided": (
    lambda nn, R: nn.Conv(4, 4, (3, 3), strides=2, padding="VALID", rngs=R(0)),
    (_x(2, 5, 5, 4),),
    None,
  ),
  "conv_circular_dilated": (
    lambda nn, R: nn.Conv(4, 4, (3, 3), padding="CIRCULAR", kernel_dilation=(2, 1), rngs=R(0)),
    (_x(2, 5, 5, 4),),
    None,
  ),
  "conv_explicit_input_dilation": (
    lambda nn, R: nn.Conv(
      4, 4, (3, 3), padding=((1, 2), (0, 1)), input_dilation=2, use_bias=False, rngs=R(0)
    ),
    (_x(2, 5, 5, 4),),
    None,
  ),
  "conv_int_padding_1d": (lambda nn, R: nn.Conv(4, 4, 3, padding=1, rngs=R(0)), (X,), None),
  "conv_groups": (lambda nn, R: nn.Conv(8, 4, 3, feature_group_count=2, rngs=R(0)), (X8,), None),
  "conv_reflect": (lambda nn, R: nn.Conv(4, 4, 3, padding="REFLECT", rngs=R(0)), (X,), None),
  "conv_causal": (
    lambda nn, R: nn.Conv(4, 4, 3, padding="CAUSAL", kernel_dilation=2, rngs=R(0)),
    (X,),
    None,
  ),
  "conv_no_batch": (lambda nn, R: nn.Conv(4, 4, 3, rngs=R(0)), (X[0],), None),
  "conv_two_batch_axes": (lambda nn, R: nn.Conv(4, 4, 3, rngs=R(0)), (_x(2, 2, 3, 4),), None),
  "embed": (lambda nn, R: nn.Embed(10, 4, rngs=R(0)), (_ids(2, 3),), None),
  "embed_one": (lambda nn, R: nn.Embed(1, 4, rngs=R(0)), (_ids(2, 3, high=1),), None),
  "embed_bf16": (lambda nn, R: nn.Embed(10, 4, dtype=jnp.bfloat16, rngs=R(0)), (_ids(2, 3),), None),
  "layernorm": (lambda nn, R: nn.LayerNorm(4, rngs=R(0)), (X,), None),
  "layernorm_options": (
    lambda nn, R: nn.LayerNorm(
      4, epsilon=1e-3, use_bias=False, reduction_axes=(1, 2), use_fast_variance=False, rngs=R(0)
    ),
    (X,),
    None,
  ),
  "layernorm_bf16": (lambda nn, R: nn.LayerNorm(4, rngs=R(0)), (X.astype(jnp.bfloat16),), None),
  "rmsnorm": (lambda nn, R: nn.RMSNorm(4, rngs=R(0)), (X,), None),
  "rmsnorm_noscale": (
    lambda nn, R: nn.RMSNorm(4, use_scale=False, epsilon=1e-2, rngs=R(0)),
    (X,),
    None,
  ),
  "batchnorm": (lambda nn, R: nn.BatchNorm(4, rngs=R(0)), (X,), None),
  "batchnorm_axis1": (lambda nn, R: nn.BatchNorm(3, axis=1, momentum=0.5, rngs=R(0)), (X,), None),
  "batchnorm_bf16": (lambda nn, R: nn.BatchNorm(4, dtype=jnp.bfloat16, rngs=R(0)), (X,), None),
  "mha_self": (lambda nn, R: nn.MultiHeadAttention(2, 4, decode=False, rngs=R(0)), (X,), None),
  "mha_cross": (
    lambda nn, R: nn.MultiHeadAttention(
      2, 4, out_features=8, in_kv_features=8, decode=False, rngs=R(0)
    ),
    (X, X8, _x(2, 3, 8, seed=2)),
    None,
  ),
  "mha_gqa_normalize_qk": (
    lambda nn, R: nn.MultiHeadAttention(
      4, 4, qkv_features=8, num_kv_heads=2, normalize_qk=True, decode=False, rngs=R(0)
    ),
    (X,),
    None,
  ),
  "mha_mask_no_bias": (
    lambda nn, R: nn.MultiHeadAttention(2, 4, use_bias=False, decode=False, rngs=R(0)),
    (X,),
    lambda R: {"mask": nnx.make_causal_mask(jnp.ones((2, 3)))},
  ),
  "mha_many_batch_axes": (
    lambda nn, R: nn.MultiHeadAttention(2, 4, decode=False, rngs=R(0)),
    (X.reshape(2, 1, 3, 4),),
    lambda R: {"is_causal": True},
  ),
  "mha_dropout": (
    lambda nn, R: nn.MultiHeadAttention(2, 4, dropout_rate=0.3, decode=False, rngs=R(0)),
    (X,),
    lambda R: {"rngs": R(dropout=7)},
  ),
  "mha_dropout_gqa": (
    lambda nn, R: nn.MultiHeadAttention(
      4,
      4,
      qkv_features=8,
      num_kv_heads=2,
      dropout_rate=0.3,
      broadcast_dropout=False,
      normalize_qk=True,
      decode=False,
      rngs=R(0),
    ),
    (X,),
    lambda R: {"rngs": R(dropout=7)},
  ),
  "dropout": (lambda nn, R: nn.Dropout(0.4, rngs=R(0)), (X,), lambda R: {"rngs": R(dropout=3)}),
  "dropout_broadcast": (
    lambda nn, R: nn.Dropout(0.4, broadcast_dims=(0,), rngs=R(0)),
    (X,),
    lambda R: {"rngs": R(dropout=3)},
  ),
  "dropout_key": (lambda nn, R: nn.Dropout(0.4), (X,), lambda R: {"rngs": jax.random.key(5)}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_nnx(name):
  build, inputs, call_kwargs = CASES[name]
  ours, theirs = build(sr.nn, sr.Rngs), build(nnx, nnx.Rngs)
  # Same seed and same draw order: nnx's defaults and initialisers give equal values.
  _assert_same_variables(ours, theirs)
  _copy_into_nnx(ours, theirs)
  kwargs = call_kwargs or (lambda R: {})
  for mode in ("train", "eval"):
    getattr(ours, mode)(), getattr(theirs, mode)()
    _close(ours(*inputs, **kwargs(sr.Rngs)), theirs(*inputs, **kwargs(nnx.Rngs)))
    _assert_same_variables(ours, theirs)  # BatchNorm's updated statistics too
  hash(sr.graphdef(ours))  # configuration is hashable


@pytest.mark.parametrize("name", ["linear", "conv_groups", "embed", "layernorm", "batchnorm"])
def test_grad_matches_nnx(name):
  build, inputs, _ = CASES[name]
  ours, theirs = build(sr.nn, sr.Rngs), build(nnx, nnx.Rngs)

  def loss(model, *xs):
    return jnp.sum(model(*xs).astype(jnp.float32) ** 2)

  # Compiled, one program each: eagerly every op of a gradient compiles on its own.
  ours_grads = sr.jit(sr.grad(loss))(ours, *inputs)
  theirs_grads = nnx.jit(nnx.grad(loss))(theirs, *inputs)
  assert sorted(ours_grads.flat()) == sorted(sr.state(ours, sr.Param).flat())
  theirs_flat = {p: v[...] for p, v in nnx.to_flat_state(theirs_grads)}
  for path, g in ours_grads.flat().items():
    _close(g, theirs_flat[path], atol=1e-4)
  _assert_same_variables(ours, theirs)  # batch stats written back by sr.grad


@pytest.mark.parametrize(
  "momentum,axis,fast",
  [(0.99, -1, True), (0.9, 1, True), (0.0, 0, True), (0.5, -1, False), (0.9, 1, False)],
)
def test_batchnorm_statistics_match_nnx(momentum, axis, fast):
  shape = X.shape
  n = shape[axis]
  ours = sr.nn.BatchNorm(n, axis=axis, momentum=momentum, use_fast_variance=fast, rngs=sr.Rngs(0))
  theirs = nnx.BatchNorm(n, axis=axis, momentum=momentum, use_fast_variance=fast, rngs=nnx.Rngs(0))
  for step in range(2):
    x = _x(*shape, seed=step) * 3 + 1
    _close(ours(x), theirs(x))
    _close(ours.mean.value, theirs.mean[...])
    _close(ours.var.value, theirs.var[...])
  mean = ours.mean.value
  # The call argument overrides the mode and leaves the statistics alone.
  _close(ours(x, use_running_average=True), theirs(x, use_running_average=True))
  np.testing.assert_array_equal(ours.mean.value, mean)


def test_batchnorm_tuple_axis_keeps_flat_statistics():
  bn = sr.nn.BatchNorm(12, axis=(1, 2), rngs=sr.Rngs(0))
  y = bn(X)
  assert bn.mean.shape == (12,) and y.shape == X.shape
  np.testing.assert_allclose(bn.mean.value, 0.01 * X.mean(0).reshape(-1), atol=1e-6)


def test_batchnorm_stats_written_back_through_jit():
  bn = sr.nn.BatchNorm(4, momentum=0.5, rngs=sr.Rngs(0))
  eager = sr.clone(bn)
  step = sr.jit(lambda m, x: m(x))
  x = X
  for _ in range(2):
    _close(step(bn, x), eager(x))
  _close(bn.mean.value, eager.mean.value)
  _close(bn.var.value, eager.var.value)
  bn.eval()
  _close(step(bn, x), eager.eval()(x))  # a new mode is a new compilation


def test_batchnorm_mask_matches_nnx():
  x, mask = X, jnp.asarray(np.arange(24).reshape(2, 3, 4) % 3 != 0)
  ours, theirs = sr.nn.BatchNorm(4, rngs=sr.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  _close(ours(x, mask=mask), theirs(x, mask=mask))
  _close(ours.var.value, theirs.var[...])


# -- Dropout -------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.8])
def test_dropout_rate_and_scale(rate):
  drop = sr.nn.Dropout(rate, rngs=sr.Rngs(dropout=0))
  y = np.stack([drop(jnp.ones(X.shape)) for _ in range(50)])  # 1200 draws
  kept = y != 0
  assert abs((1 - kept.mean()) - rate) < 0.05
  np.testing.assert_allclose(y[kept], 1 / (1 - rate), rtol=1e-6)


def test_dropout_identity_cases():
  x = X
  rngs = sr.Rngs(dropout=0)
  drop = sr.nn.Dropout(0.5, rngs=rngs)
  assert drop(x, deterministic=True) is x
  assert drop.eval()(x) is x
  assert sr.nn.Dropout(0.0)(x) is x  # no RNG needed
  assert not np.asarray(sr.nn.Dropout(1.0)(x)).any()
  assert int(rngs.dropout.count.value) == 0  # nothing drawn


def test_dropout_broadcast_dims():
  y = sr.nn.Dropout(0.5, broadcast_dims=(0,), rngs=sr.Rngs(0))(jnp.ones(X.shape))
  mask = np.asarray(y) != 0
  assert (mask == mask[:1]).all()
  assert 0 < mask.mean() < 1


def test_dropout_masks_advance_and_repeat_by_seed():
  x = jnp.ones(X.shape)
  rngs = sr.Rngs(dropout=3)
  drop = sr.nn.Dropout(0.5, rngs=rngs)
  assert drop.rngs is rngs  # kept as given: shared with the model, not forked
  y1, y2 = drop(x), drop(x)
  assert int(rngs.dropout.count.value) == 2
  assert (np.asarray(y1) != np.asarray(y2)).any()
  again = sr.nn.Dropout(0.5, rngs=sr.Rngs(dropout=3))
  np.testing.assert_array_equal(again(x), y1)
  np.testing.assert_array_equal(again(x), y2)
  # An explicit key, stream or Rngs at call time overrides the stored one.
  key = jax.random.key(9)
  np.testing.assert_array_equal(drop(x, rngs=key), again(x, rngs=key))
  np.testing.assert_array_equal(drop(x, rngs=sr.Rngs(dropout=3)), y1)
  assert int(rngs.dropout.count.value) == 2


def test_dropout_masks_advance_through_jit():
  rngs = sr.Rngs(dropout=1)
  drop = sr.nn.Dropout(0.5, rngs=rngs)
  eager = sr.nn.Dropout(0.5, rngs=sr.Rngs(dropout=1))
  step = sr.jit(lambda m, x: m(x))
  x = jnp.ones(X.shape)
  y1, y2 = step(drop, x), step(drop, x)
  assert int(rngs.dropout.count.value) == 2
  assert (np.asarray(y1) != np.asarray(y2)).any()
  np.testing.assert_array_equal(y1, eager(x))
  np.testing.assert_array_equal(y2, eager(x))


def test_dropout_uses_named_stream_or_default():
  rngs = sr.Rngs(0, dropout=1)
  sr.nn.Dropout(0.5, rngs=rngs)(X)
  assert int(rngs.dropout.count.value) == 1 and int(rngs.default.count.value) == 0
  rngs = sr.Rngs(params=0, noise=2)
  drop = sr.nn.Dropout(0.5, rng_collection="noise", rngs=rngs)
  drop(X)
  assert int(rngs.noise.count.value) == 1


def test_dropout_errors():
  with pytest.raises(ValueError, match=r"rngs=sr.Rngs\(dropout="):
    sr.nn.Dropout(0.5)(jnp.ones(3))
  with pytest.raises(ValueError, match="deterministic is None"):
    sr.nn.Dropout(0.5, deterministic=None, rngs=sr.Rngs(0))(jnp.ones(3))
  with pytest.raises(ValueError, match=r"rate must be in \[0, 1\]"):
    sr.nn.Dropout(1.5)
  with pytest.raises(TypeError, match="rngs must be"):
    sr.nn.Dropout(0.5, rngs=0)
  with pytest.raises(AttributeError, match="no 'dropout' stream"):
    sr.nn.Dropout(0.5, rngs=sr.Rngs(params=0))(jnp.ones(3))


# -- attention helpers and decoding ----------------------------------------------


def test_mask_helpers_match_nnx():
  valid = jnp.asarray([[1, 1, 0, 1], [1, 0, 1, 1]])
  x = jnp.ones((2, 3, 4))
  for ours, theirs in [
    (sr.nn.make_attention_mask(valid, valid), nnx.make_attention_mask(valid, valid)),
    (
      sr.nn.make_attention_mask(
        valid, valid, jnp.greater_equal, extra_batch_dims=1, dtype=jnp.bool_
      ),
      nnx.make_attention_mask(valid, valid, jnp.greater_equal, extra_batch_dims=1, dtype=jnp.bool_),
    ),
    (sr.nn.make_causal_mask(x), nnx.make_causal_mask(x)),
    (
      sr.nn.combine_masks(
        sr.nn.make_causal_mask(valid), None, sr.nn.make_attention_mask(valid, valid)
      ),
      nnx.combine_masks(nnx.make_causal_mask(valid), None, nnx.make_attention_mask(valid, valid)),
    ),
  ]:
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours, theirs)
  assert sr.nn.combine_masks(None, None) is None


DROP = {"dropout_rate": 0.3, "dropout_rng": jax.random.key(0)}


# The MultiHeadAttention cases cover most paths; these add bias, no batch axes, and
# is_causal on the dropout path.
@pytest.mark.parametrize(
  "batch,kv_heads,kwargs",
  [
    ((2,), 2, {"mask": "causal", "bias": True}),
    ((), 1, {"is_causal": True}),
    ((2,), 4, {**DROP, "is_causal": True}),
  ],
)
def test_dot_product_attention_matches_nnx(batch, kv_heads, kwargs):
  q = _x(*batch, 3, 4, 2)
  k, v = _x(*batch, 3, kv_heads, 2, seed=1), _x(*batch, 3, kv_heads, 2, seed=2)
  kwargs = dict(kwargs)
  if kwargs.get("mask") == "causal":
    kwargs["mask"] = jnp.broadcast_to(jnp.tril(jnp.ones((3, 3))), (*batch, 1, 3, 3))
  if kwargs.get("bias"):
    kwargs["bias"] = _x(*batch, 4, 3, 3, seed=3)
  # Each compiled, one program instead of op by op.
  _close(
    jax.jit(lambda *a: sr.nn.dot_product_attention(*a, **kwargs))(q, k, v),
    jax.jit(lambda *a: nnx.dot_product_attention(*a, **kwargs))(q, k, v),
  )
  if "bias" not in kwargs:
    _close(
      jax.jit(lambda *a: sr.nn.dot_product_attention_weights(*a, **kwargs))(q, k),
      jax.jit(lambda *a: nnx_attention.dot_product_attention_weights(*a, **kwargs))(q, k),
    )


def test_mha_decode_matches_nnx_and_full_causal():
  ours = sr.nn.MultiHeadAttention(4, 8, num_kv_heads=2, decode=True, rngs=sr.Rngs(0))
  theirs = nnx.MultiHeadAttention(4, 8, num_kv_heads=2, decode=True, rngs=nnx.Rngs(0))
  x = _x(2, 3, 8)
  full = ours(x, decode=False, is_causal=True)
  ours.init_cache(x.shape)
  theirs.init_cache(x.shape)
  assert sorted(_flat(ours, sr.Cache)) == sorted(_flat(theirs, nnx.Cache))
  step = sr.jit(lambda m, token: m(token))
  nnx_step = nnx.jit(lambda m, token: m(token))
  for t in range(x.shape[1]):
    token = x[:, t : t + 1]
    y = step(ours, token)
    _close(y, nnx_step(theirs, token))
    _close(y, full[:, t : t + 1], atol=1e-5)
  assert int(ours.cache_index.value) == 3
  for path, value in _flat(ours, sr.Cache).items():
    _close(value, _flat(theirs, nnx.Cache)[path])


def test_mha_errors():
  with pytest.raises(ValueError, match="qkv_features .* divisible by num_heads"):
    sr.nn.MultiHeadAttention(3, 4, rngs=sr.Rngs(0))
  with pytest.raises(ValueError, match="divisible by num_kv_heads"):
    sr.nn.MultiHeadAttention(4, 4, num_kv_heads=3, rngs=sr.Rngs(0))
  attn = sr.nn.MultiHeadAttention(2, 4, rngs=sr.Rngs(0))
  with pytest.raises(ValueError, match="in_features=4 but inputs_q"):
    attn(jnp.ones((2, 3, 6)))
  with pytest.raises(ValueError, match="in_kv_features=4 but inputs_k"):
    attn(X, jnp.ones((2, 3, 6)))
  with pytest.raises(ValueError, match="inputs_k cannot be None"):
    attn(X, None, X)
  with pytest.raises(ValueError, match=r"init_cache"):
    attn(X, decode=True)
  attn = sr.nn.MultiHeadAttention(2, 4, dropout_rate=0.1, rngs=sr.Rngs(0))
  with pytest.raises(ValueError, match="deterministic is None"):
    attn(X)
  attn = sr.nn.MultiHeadAttention(
    2, 4, dropout_rate=0.1, keep_rngs=False, deterministic=False, rngs=sr.Rngs(0)
  )
  assert attn.rngs is None
  with pytest.raises(ValueError, match=r"rngs=sr.Rngs\(dropout="):
    attn(X)


# -- MLP -------------------------------------------------------------------------


def test_mlp_structure_and_eval_output():
  mlp = sr.nn.MLP(4, 8, dropout_rate=0.5, rngs=sr.Rngs(0))
  assert sorted(sr.state(mlp, sr.Param).flat()) == [
    ("fc1", "bias"),
    ("fc1", "kernel"),
    ("fc2", "bias"),
    ("fc2", "kernel"),
  ]
  assert mlp.fc2.kernel.shape == (8, 4) and mlp.out_features == 4
  expected = mlp.fc2(jax.nn.gelu(mlp.fc1(X)))
  _close(mlp.eval()(X), expected)
  assert sr.nn.MLP(8, 4, 4, rngs=sr.Rngs(0)).fc2.kernel.shape == (4, 4)


def test_mlp_dropout_draws_twice_and_matches_manual():
  rngs = sr.Rngs(0)
  mlp = sr.nn.MLP(4, 4, dropout_rate=0.5, activation=jax.nn.relu, rngs=rngs)
  count = int(rngs.default.count.value)
  x = X
  twin = sr.clone(mlp)
  y = mlp(x)
  assert int(rngs.default.count.value) == count + 2
  drop = twin.dropout
  expected = drop(twin.fc2(drop(jax.nn.relu(twin.fc1(x)))))
  _close(y, expected)
  # A key at call time is split, one half per dropout.
  k1, k2 = jax.random.split(jax.random.key(4))
  manual = mlp.dropout(mlp.fc2(mlp.dropout(jax.nn.relu(mlp.fc1(x)), rngs=k1)), rngs=k2)
  _close(mlp(x, rngs=jax.random.key(4)), manual)
  _close(mlp(x, deterministic=True), mlp.eval()(x))


# -- metadata, modes, transforms -------------------------------------------------


S = {"sharding": ("a", "b")}
S3 = {"sharding": ("a", "b", "c")}
T = {"sharding": ("c",)}
METADATA_CASES = [
  (
    lambda: sr.nn.Linear(4, 4, kernel_metadata=S, bias_metadata=T, rngs=sr.Rngs(0)),
    {("kernel",): S, ("bias",): T},
  ),
  (
    lambda: sr.nn.LinearGeneral(4, (2, 2), kernel_metadata=S3, bias_metadata=S, rngs=sr.Rngs(0)),
    {("kernel",): S3, ("bias",): S},
  ),
  (
    lambda: sr.nn.Conv(4, 4, 3, kernel_metadata=S3, bias_metadata=T, rngs=sr.Rngs(0)),
    {("kernel",): S3, ("bias",): T},
  ),
  (lambda: sr.nn.Embed(10, 4, embedding_metadata=S, rngs=sr.Rngs(0)), {("embedding",): S}),
  (
    lambda: sr.nn.LayerNorm(4, scale_metadata=T, bias_metadata={"tag": 1}, rngs=sr.Rngs(0)),
    {("scale",): T, ("bias",): {"tag": 1}},
  ),
  (lambda: sr.nn.RMSNorm(4, scale_metadata=T, rngs=sr.Rngs(0)), {("scale",): T}),
  (
    lambda: sr.nn.BatchNorm(
      4, scale_metadata=T, bias_metadata=T, mean_metadata=T, var_metadata=T, rngs=sr.Rngs(0)
    ),
    {("scale",): T, ("bias",): T, ("mean",): T, ("var",): T},
  ),
  (
    lambda: sr.nn.MultiHeadAttention(
      2,
      4,
      normalize_qk=True,
      kernel_metadata=S3,
      bias_metadata=S,
      out_kernel_metadata={"sharding": ("h", "d", "e")},
      query_ln_scale_metadata=T,
      rngs=sr.Rngs(0),
    ),
    {
      ("query", "kernel"): S3,
      ("key", "bias"): S,
      ("value", "kernel"): S3,
      ("out", "kernel"): {"sharding": ("h", "d", "e")},
      ("out", "bias"): S,
      ("query_ln", "scale"): T,
      ("key_ln", "scale"): {},
    },
  ),
  (
    lambda: sr.nn.MLP(
      4,
      8,
      kernel_metadata={"sharding": ("embed", "mlp")},
      out_kernel_metadata={"sharding": ("mlp", "embed")},
      rngs=sr.Rngs(0),
    ),
    {
      ("fc1", "kernel"): {"sharding": ("embed", "mlp")},
      ("fc2", "kernel"): {"sharding": ("mlp", "embed")},
      ("fc2", "bias"): {},
    },
  ),
]


@pytest.mark.parametrize("build,expected", METADATA_CASES)
def test_metadata_lands_on_variables(build, expected):
  layer = build()
  variables = dict(layer.iter_variables())
  for path, metadata in expected.items():
    assert variables[path].metadata == metadata, path
  # and survives a split / merge round trip
  variables = dict(sr.merge(*sr.split(layer)).iter_variables())
  for path, metadata in expected.items():
    assert variables[path].metadata == metadata, path


class Block(sr.Module):
  def __init__(self, rngs):
    self.linear = sr.nn.Linear(4, 4, rngs=rngs)
    self.norm = sr.nn.BatchNorm(4, rngs=rngs)
    # One dropout draw only: each compiles a threefry hash, slow on CPU.
    self.attn = sr.nn.MultiHeadAttention(2, 4, deterministic=False, rngs=rngs)
    self.mlp = sr.nn.MLP(4, 4, rngs=rngs)
    self.layers = [sr.nn.Dropout(0.2, rngs=rngs), sr.nn.LayerNorm(4, rngs=rngs)]
    self.conv = sr.nn.Conv(4, 4, 3, padding="CIRCULAR", rngs=rngs)
    self.rms = sr.nn.RMSNorm(4, rngs=rngs)
    self.heads = sr.nn.LinearGeneral((2, 2), 4, axis=(-2, -1), rngs=rngs)
    self.embed = sr.nn.Embed(10, 4, rngs=rngs)

  def __call__(self, x):
    x = self.conv(self.norm(self.linear(x)))
    x = self.layers[1](x + self.attn(x))
    x = self.rms(x + self.mlp(x))
    x = self.heads(x.reshape(x.shape[:-1] + (2, 2)))
    return self.layers[0](self.embed.attend(x))


def test_train_eval_flip_through_nested_model():
  model = Block(sr.Rngs(0))
  flags = lambda: {
    (path, name): getattr(module, name)
    for path, module in model.iter_modules()
    for name in ("deterministic", "use_running_average")
    if name in vars(module)
  }
  assert sorted(flags()) == sorted(
    [
      (("attn",), "deterministic"),
      (("layers", 0), "deterministic"),
      (("mlp", "dropout"), "deterministic"),
      (("norm",), "use_running_average"),
    ]
  )
  model.eval()
  assert set(flags().values()) == {True}
  model.train()
  assert set(flags().values()) == {False}


def test_every_layer_under_jit_and_grad():
  model = Block(sr.Rngs(0))
  x = X
  twin = sr.clone(model)

  @sr.jit
  def train_step(model, x):
    return sr.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

  loss, grads = train_step(model, x)
  assert sorted(grads.flat()) == sorted(sr.state(model, sr.Param).flat())
  assert all(np.isfinite(g).all() and np.abs(g).sum() > 0 for g in grads.flat().values())
  # The same training call eagerly: same loss, and the batch stats and every RNG draw
  # written back by the transforms are the eager ones.
  _close(loss, jnp.mean(twin(x) ** 2))
  ours = sr.state(model).flat()
  for path, value in sr.state(twin).flat().items():
    if path[-1] in ("mean", "var", "count"):
      _close(ours[path], value)
  model.eval()
  _close(sr.jit(lambda m, x: m(x))(model, x), twin.eval()(x))


# -- errors that are cheap to make clear -----------------------------------------


def test_bad_inputs_raise_clear_errors():
  rngs = sr.Rngs(0)
  with pytest.raises(ValueError, match=r"Linear was built with in_features=4 .* \(2, 5\)"):
    sr.nn.Linear(4, 4, rngs=rngs)(jnp.ones((2, 5)))
  with pytest.raises(ValueError, match="Conv was built with in_features=4"):
    sr.nn.Conv(4, 4, 3, rngs=rngs)(jnp.ones((2, 3, 5)))
  with pytest.raises(ValueError, match="needs inputs of shape"):
    sr.nn.Conv(4, 4, (3, 3), rngs=rngs)(X[0])
  with pytest.raises(ValueError, match="divisible by feature_group_count=2"):
    sr.nn.Conv(3, 4, 3, feature_group_count=2, rngs=rngs)
  with pytest.raises(ValueError, match="invalid Conv padding"):
    sr.nn.Conv(4, 4, (3, 3), padding=(1, 2, 3), rngs=rngs)
  with pytest.raises(ValueError, match="only implemented for 1-D"):
    sr.nn.Conv(4, 4, (3, 3), padding="CAUSAL", rngs=rngs)(jnp.ones((2, 5, 5, 4)))
  with pytest.raises(ValueError, match="integer ids"):
    sr.nn.Embed(10, 4, rngs=rngs)(X)
  with pytest.raises(ValueError, match="LayerNorm was built with num_features=4"):
    sr.nn.LayerNorm(4, rngs=rngs)(jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="RMSNorm was built with num_features=4"):
    sr.nn.RMSNorm(4, rngs=rngs)(jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="BatchNorm was built with num_features=4"):
    sr.nn.BatchNorm(4, rngs=rngs)(jnp.ones((2, 3)))
  with pytest.raises(ValueError, match=r"model.train\(\)"):
    sr.nn.BatchNorm(4, use_running_average=None, rngs=rngs)(X)
  with pytest.raises(ValueError, match="same length"):
    sr.nn.LinearGeneral((2, 3), 4, axis=-1, rngs=rngs)
  with pytest.raises(ValueError, match="consecutive leading"):
    sr.nn.LinearGeneral(2, 4, batch_axis={1: 2}, rngs=rngs)
  with pytest.raises(ValueError, match=r"in_features=\(2, 2\) on axis=\(1, -1\)"):
    sr.nn.LinearGeneral((2, 2), 4, axis=(1, -1), rngs=rngs)(X)
  with pytest.raises(AttributeError, match="no 'params' stream"):
    sr.nn.Linear(4, 4, rngs=sr.Rngs(dropout=0))


def test_linear_takes_precision_as_none_string_enum_or_tuple():
  x = jnp.ones((2, 3))
  outs = []
  for precision in (
    None,
    "highest",
    jax.lax.Precision.HIGHEST,
    (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST),
  ):
    layer = sr.nn.Linear(3, 4, precision=precision, rngs=sr.Rngs(0))
    outs.append(layer(x))
  for out in outs[1:]:
    np.testing.assert_allclose(out, outs[0], rtol=1e-6)
