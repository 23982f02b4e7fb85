"""Grouped-query attention and rotary embeddings (issue 24): ``sr.nn.rope`` and
``sr.nn.MultiHeadAttention(..., num_kv_heads=, rope_base=)``.

References: rope against a numpy loop and the formulas of flax's Gemma example and of
Hugging Face's Llama; GQA against a hand-written attention that repeats the kv heads,
and, with as many kv heads as heads, against ``nnx.MultiHeadAttention`` with the same
weights; decoding token by token against the causal forward, one layer and a stack.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import statefulremat as sr

D, HEADS, KV, T, B = 16, 4, 2, 6, 2


def _x(*shape, seed=0, dtype=jnp.float32):
  return jnp.asarray(np.random.RandomState(seed).normal(size=shape), dtype)


def _close(a, b, atol=2e-5):
  np.testing.assert_allclose(
    np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol, rtol=atol
  )


def _leaves(model):
  return {
    p: np.asarray(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)
    for p, v in sr.state(model).flat().items()
  }


def _unchanged(model, before):
  after = _leaves(model)
  return after.keys() == before.keys() and all(
    after[p].shape == before[p].shape and (after[p] == before[p]).all() for p in before
  )


# -- sr.nn.rope ----------------------------------------------------------------------


def _rope_numpy(x, positions, base):
  """Rotate-half rope, one pair at a time: pair (i, i + d/2) turns by pos / base^(2i/d)."""
  x = np.asarray(x, np.float64)
  positions = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:-2])
  out = np.empty_like(x)
  d = x.shape[-1]
  for idx in np.ndindex(*x.shape[:-1]):
    p = positions[idx[:-1]]
    for i in range(d // 2):
      theta = p / base ** (2 * i / d)
      a, b = x[idx + (i,)], x[idx + (i + d // 2,)]
      out[idx + (i,)] = a * np.cos(theta) - b * np.sin(theta)
      out[idx + (i + d // 2,)] = b * np.cos(theta) + a * np.sin(theta)
  return out


def _rope_gemma(x, positions, base, scale_factor=1.0):
  """The formula of flax's examples/gemma/positional_embeddings.py ``apply_rope``."""
  d = x.shape[-1]
  timescale = base ** (2 * np.arange(d // 2) / d)
  angles = (positions[..., None] / timescale)[..., None, :]
  if scale_factor < 1.0:
    raise ValueError(f"scale_factor must be >= 1.0, got {scale_factor}")
  angles /= scale_factor
  first, second = np.split(x, 2, axis=-1)
  return np.concatenate(
    [
      first * np.cos(angles) - second * np.sin(angles),
      second * np.cos(angles) + first * np.sin(angles),
    ],
    axis=-1,
  )


def _rope_llama(x, positions, base):
  """Hugging Face Llama: ``x * cos + rotate_half(x) * sin``, inv_freq = 1/base^(2i/d)."""
  d = x.shape[-1]
  inv_freq = 1.0 / base ** (np.arange(0, d, 2) / d)
  freqs = positions[..., None] * inv_freq
  emb = np.concatenate([freqs, freqs], axis=-1)[..., None, :]  # one angle for all heads
  rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
  return x * np.cos(emb) + rotate_half * np.sin(emb)


@pytest.mark.parametrize("base", [10000.0, 500000.0, 7.0])
def test_rope_equals_a_numpy_loop_and_gemma_and_llama_formulas(base):
  x = _x(B, 5, 3, 8)
  positions = np.array([[0, 1, 2, 3, 4], [7, 3, 100, 2048, 1]])
  got = sr.nn.rope(x, positions, base=base)
  assert got.shape == x.shape and got.dtype == x.dtype
  _close(got, _rope_numpy(x, positions, base), atol=1e-4)
  _close(got, _rope_gemma(np.asarray(x), positions, base), atol=1e-4)
  _close(got, _rope_llama(np.asarray(x), positions, base), atol=1e-4)
  # One [length] vector of positions serves every batch row.
  _close(sr.nn.rope(x, jnp.arange(5), base=base), _rope_numpy(x, np.arange(5), base), atol=1e-4)


@pytest.mark.parametrize("scale_factor", [1.0, 8.0, 2.5])
def test_rope_scale_factor_equals_gemmas_apply_rope(scale_factor):
  x = _x(B, 5, 3, 8)
  positions = np.array([[0, 1, 2, 3, 4], [7, 3, 100, 2048, 1]])
  for base in (10000.0, 1000000.0):
    got = sr.nn.rope(x, positions, base=base, scale_factor=scale_factor)
    want = _rope_gemma(np.asarray(x, np.float64), positions, base, scale_factor)
    _close(got, want, atol=1e-4)
  # Position interpolation: position p * scale_factor turns as p did without it.
  _close(
    sr.nn.rope(x, jnp.arange(5) * scale_factor, scale_factor=scale_factor),
    sr.nn.rope(x, jnp.arange(5)),
    atol=1e-5,
  )


@pytest.mark.parametrize("bad", [0.5, 0.0, -2.0, float("nan"), True, "8"])
def test_rope_scale_factor_below_one_names_it_and_the_fix(bad):
  with pytest.raises(
    ValueError,
    match=r"sr\.nn\.rope: scale_factor=.* must be a number >= 1\.0.*Fix: scale_factor=1\.0",
  ):
    sr.nn.rope(_x(1, 3, 2, 4), jnp.arange(3), scale_factor=bad)


def test_rope_scores_depend_on_relative_positions_only():
  q, k = _x(1, 1, 1, 8), _x(1, 1, 1, 8, seed=1)

  def score(m, n):
    return float((sr.nn.rope(q, jnp.array([m])) * sr.nn.rope(k, jnp.array([n]))).sum())

  assert score(3, 1) == pytest.approx(score(12, 10), rel=1e-4)
  assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)


def test_rope_keeps_the_dtype_and_computes_the_angles_in_float32():
  x = _x(1, 4, 2, 8, dtype=jnp.bfloat16)
  y = sr.nn.rope(x, jnp.arange(1000, 1004))
  assert y.dtype == jnp.bfloat16
  _close(y, sr.nn.rope(x.astype(jnp.float32), jnp.arange(1000, 1004)), atol=1e-2)
  # Gradients flow through the rotation (it is orthogonal: it preserves norms).
  g = jax.jit(jax.grad(lambda x: (sr.nn.rope(x, jnp.arange(4)) ** 2).sum()))(_x(1, 4, 2, 8))
  _close(g, 2 * _x(1, 4, 2, 8), atol=1e-5)


def test_rope_bad_inputs_say_the_expected_shape_and_the_fix():
  with pytest.raises(ValueError, match=r"sr.nn.rope: .* head_dim=5 .* is odd\. Fix"):
    sr.nn.rope(_x(1, 3, 2, 5), jnp.arange(3))
  with pytest.raises(
    ValueError,
    match=r"positions has shape \(4,\) .* expected positions "
    r"of shape \(2, 3\) or \(3,\).*Fix",
  ):
    sr.nn.rope(_x(2, 3, 2, 4), jnp.arange(4))
  with pytest.raises(ValueError, match=r"positions has shape \(3, 3\) .*\(2, 3\)"):
    sr.nn.rope(_x(2, 3, 2, 4), jnp.zeros((3, 3), jnp.int32))
  with pytest.raises(
    ValueError,
    match=r"\[batch\.\.\., length, heads, head_dim\], got "
    r"shape \(3, 4\)\. Fix",
  ):
    sr.nn.rope(_x(3, 4), jnp.arange(3))
  with pytest.raises(ValueError, match=r"rotates float features, got dtype int32.*Fix"):
    sr.nn.rope(jnp.ones((1, 3, 2, 4), jnp.int32), jnp.arange(3))
  with pytest.raises(ValueError, match=r"positions must be integers .* got dtype bool"):
    sr.nn.rope(_x(1, 3, 2, 4), jnp.ones(3, bool))


# -- grouped-query attention ---------------------------------------------------------


def _params(attn):
  return {
    name: (getattr(attn, name).kernel.value, getattr(attn, name).bias.value)
    for name in ("query", "key", "value", "out")
  }


def _reference(params, x, *, num_heads, num_kv_heads, positions=None, base=None, causal=False):
  """Plain softmax attention: each kv head repeated for its query heads."""
  (wq, bq), (wk, bk), (wv, bv), (wo, bo) = (params[n] for n in ("query", "key", "value", "out"))

  def dense(spec, x, w, b):
    y = jnp.einsum(spec, x, w)
    return y + jnp.broadcast_to(b, y.shape)

  q = dense("...f,fhd->...hd", x, wq, bq)
  k = dense("...f,fhd->...hd", x, wk, bk)
  v = dense("...f,fhd->...hd", x, wv, bv)
  if base is not None:
    q, k = sr.nn.rope(q, positions, base=base), sr.nn.rope(k, positions, base=base)
  group = num_heads // num_kv_heads
  k, v = jnp.repeat(k, group, axis=-2), jnp.repeat(v, group, axis=-2)
  logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
  if causal:
    length = x.shape[-2]
    causal_mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), logits.shape)
    logits = jnp.where(causal_mask, logits, -1e30)
  out = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits, axis=-1), v)
  return dense("...hd,hdf->...f", out, wo, bo)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_equals_repeating_the_kv_heads(num_kv_heads, causal):
  attn = sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=num_kv_heads, rngs=sr.Rngs(0))
  assert attn.key.kernel.shape == attn.value.kernel.shape == (D, num_kv_heads, D // HEADS)
  assert attn.query.kernel.shape == (D, HEADS, D // HEADS)
  x = _x(B, T, D)
  # Each side compiled, one program instead of op by op.
  reference = jax.jit(
    lambda p, x: _reference(p, x, num_heads=HEADS, num_kv_heads=num_kv_heads, causal=causal)
  )
  want = reference(_params(attn), x)
  _close(sr.jit(lambda m, x: m(x, is_causal=causal))(attn, x), want)
  mask = sr.nn.make_causal_mask(x[..., 0]) if causal else None
  _close(sr.jit(lambda m, x, mask: m(x, mask=mask))(attn, x, mask), want)


@pytest.mark.parametrize("num_kv_heads", [None, HEADS, KV])
def test_equals_nnx_with_copied_weights_outputs_and_gradients(num_kv_heads):
  kwargs = {} if num_kv_heads is None else {"num_kv_heads": num_kv_heads}
  ours = sr.nn.MultiHeadAttention(HEADS, D, decode=False, rngs=sr.Rngs(5), **kwargs)
  theirs = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(0), **kwargs)
  sr.interop.from_nnx(ours, theirs)  # same names and shapes: no rename
  x = _x(B, T, D)
  # Compiled, one program each: eagerly every op of a gradient compiles on its own.
  call = lambda m, x: m(x, is_causal=True)  # noqa: E731
  _close(sr.jit(call)(ours, x), nnx.jit(call)(theirs, x))

  def loss(model, x):
    return jnp.sum(jnp.tanh(model(x, is_causal=True)))

  ours_grads, ours_dx = sr.jit(sr.grad(loss, argnums=(0, 1)))(ours, x)
  theirs_grads, theirs_dx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(theirs, x)
  theirs_flat = {p: v[...] for p, v in nnx.to_flat_state(theirs_grads)}
  assert sorted(ours_grads.flat()) == sorted(theirs_flat)
  for path, g in ours_grads.flat().items():
    _close(g, theirs_flat[path], atol=1e-4)
  _close(ours_dx, theirs_dx, atol=1e-4)


def test_gqa_rope_gradients_equal_the_reference_and_reach_every_parameter():
  attn = sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=KV, rope_base=100.0, rngs=sr.Rngs(0))
  x = _x(B, T, D)

  def loss(model, x):
    return jnp.sum(model(x, is_causal=True) ** 2)

  def reference_loss(p):
    return jnp.sum(
      _reference(
        p, x, num_heads=HEADS, num_kv_heads=KV, positions=jnp.arange(T), base=100.0, causal=True
      )
      ** 2
    )

  # Compiled, one program each: eagerly every op of a gradient compiles on its own.
  grads = sr.jit(sr.grad(loss))(attn, x)
  want = jax.jit(jax.grad(reference_loss))(_params(attn))
  for name, (gk, gb) in want.items():
    _close(grads[name]["kernel"], gk, atol=1e-4)
    _close(grads[name]["bias"], gb, atol=1e-4)
    assert float(jnp.abs(grads[name]["kernel"]).max()) > 0


# -- rope inside ---------------------------------------------------------------------


def test_rope_inside_equals_rope_applied_by_hand_to_queries_and_keys():
  attn = sr.nn.MultiHeadAttention(
    HEADS, D, num_kv_heads=KV, rope_base=10000.0, normalize_qk=True, rngs=sr.Rngs(0)
  )
  x = _x(B, T, D)
  positions = jnp.array([[3, 4, 5, 6, 7, 8], [0, 1, 2, 10, 11, 12]])

  def by_hand(positions, **kwargs):
    q = sr.nn.rope(attn.query_ln(attn.query(x)), positions)
    k = sr.nn.rope(attn.key_ln(attn.key(x)), positions)
    return attn.out(sr.nn.dot_product_attention(q, k, attn.value(x), **kwargs))

  _close(attn(x), by_hand(jnp.arange(T)))
  _close(attn(x, positions=positions, is_causal=True), by_hand(positions, is_causal=True))
  _close(sr.jit(lambda m, x, p: m(x, positions=p))(attn, x, positions), by_hand(positions))
  # The rotation changes the result: positions are used, not ignored.
  plain = sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=KV, normalize_qk=True, rngs=sr.Rngs(0))
  assert float(jnp.abs(plain(x) - attn(x)).max()) > 1e-3
  assert sorted(sr.state(plain).flat()) == sorted(sr.state(attn).flat())  # no new params


def test_rope_default_positions_make_scores_shift_invariant():
  attn = sr.nn.MultiHeadAttention(HEADS, D, rope_base=10000.0, rngs=sr.Rngs(0))
  x = _x(B, T, D)
  _close(attn(x, positions=jnp.arange(T) + 1000), attn(x), atol=1e-4)


# -- decoding ------------------------------------------------------------------------


@pytest.mark.parametrize("rope_base", [None, 10000.0])
@pytest.mark.parametrize("jit", [False, True])
def test_decode_token_by_token_equals_the_causal_forward(rope_base, jit):
  attn = sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=KV, rope_base=rope_base, rngs=sr.Rngs(0))
  x = _x(B, T, D)
  full = attn(x, is_causal=True)
  attn.init_cache((B, T + 2, D))
  head_dim = D // HEADS
  # The cache holds num_kv_heads heads, not num_heads: GQA's memory saving.
  assert attn.cached_key.shape == attn.cached_value.shape == (B, T + 2, KV, head_dim)
  step = sr.jit(lambda m, x: m(x, decode=True)) if jit else (lambda m, x: m(x, decode=True))
  decoded = jnp.concatenate([step(attn, x[:, t : t + 1]) for t in range(T)], axis=1)
  _close(decoded, full)
  assert int(attn.cache_index.value) == T
  # The cache stores the keys rotated at their own positions.
  keys = attn.key(x)
  if rope_base is not None:
    keys = sr.nn.rope(keys, jnp.arange(T), base=rope_base)
  _close(attn.cached_key.value[:, :T], keys)
  _close(attn.cached_value.value[:, :T], attn.value(x))


def test_decode_with_explicit_positions_rotates_by_them():
  attn = sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=KV, rope_base=10000.0, rngs=sr.Rngs(0))
  x = _x(B, T, D)
  positions = jnp.arange(T) + 40
  full = sr.jit(lambda m, x, p: m(x, positions=p, is_causal=True))(attn, x, positions)
  attn.init_cache((B, T, D))
  step = sr.jit(lambda m, x, p: m(x, decode=True, positions=p))  # compiled once for every step
  decoded = jnp.concatenate(
    [step(attn, x[:, t : t + 1], positions[t : t + 1]) for t in range(T)], axis=1
  )
  _close(decoded, full)


class Block(sr.Module):
  """Pre-LN causal block with GQA and rope: x + attn(ln1(x)), then x + mlp(ln2(x))."""

  def __init__(self, *, rngs):
    self.ln1 = sr.nn.LayerNorm(D, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=KV, rope_base=10000.0, rngs=rngs)
    self.ln2 = sr.nn.LayerNorm(D, rngs=rngs)
    self.mlp = sr.nn.MLP(D, 2 * D, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x), is_causal=True)
    return x + self.mlp(self.ln2(x))


class ScanBlock(Block):
  def __call__(self, x):
    return super().__call__(x), None


STACKS = {
  "remat_scan": lambda: sr.remat_scan(Block, lengths=(3,)),
  "scan": lambda: sr.scan(ScanBlock, length=3, variable_axes={True: 0}, split_rngs={True: True}),
}


def _out(y):
  return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("kind", sorted(STACKS))
def test_a_stack_decodes_token_by_token_as_its_causal_forward(kind):
  stack = STACKS[kind]()(rngs=sr.Rngs(0))
  x = _x(B, T, D)
  # Compiled once per structure (the stack, a layer, the decoding stack), not op by op.
  call = sr.jit(lambda m, x: _out(m(x)))
  full = call(stack, x)
  # The stack equals the Python loop over its layers (rope and GQA inside each).
  loop = x
  for layer in sr.unstack(stack):
    loop = call(layer, loop)
  _close(full, loop, atol=1e-4)
  stack.attn.init_cache((B, T, D))
  assert stack.attn.cached_key.shape == (3, B, T, KV, D // HEADS)
  stack.set_attributes(decode=True)
  decoded = jnp.concatenate([call(stack, x[:, t : t + 1]) for t in range(T)], axis=1)
  _close(decoded, full, atol=1e-4)
  assert stack.attn.cache_index.value.tolist() == [T] * 3


def test_grads_flow_through_a_gqa_rope_stack():
  stack = STACKS["remat_scan"]()(rngs=sr.Rngs(0))
  grads = sr.jit(sr.grad(lambda m, x: jnp.sum(m(x) ** 2)))(stack, _x(B, T, D))
  for name in ("query", "key", "value", "out"):
    g = grads["attn"][name]["kernel"]
    assert g.shape[0] == 3 and bool(jnp.isfinite(g).all())
    assert all(float(jnp.abs(g[i]).max()) > 0 for i in range(3))


# -- bad input -----------------------------------------------------------------------


class Net(sr.Module):
  def __init__(self, **kwargs):
    self.blocks = [sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=KV, rngs=sr.Rngs(0), **kwargs)]

  def __call__(self, x, **kwargs):
    return self.blocks[0](x, **kwargs)


def test_num_kv_heads_that_does_not_divide_num_heads_says_which_do():
  with pytest.raises(
    ValueError,
    match=r"MultiHeadAttention\(num_heads=4, num_kv_heads=3\)"
    r".*divisible by num_kv_heads.*Fix: pick "
    r"num_kv_heads from \[1, 2, 4\]",
  ):
    sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=3, rngs=sr.Rngs(0))
  with pytest.raises(ValueError, match=r"num_kv_heads=0\).*Fix"):
    sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=0, rngs=sr.Rngs(0))


def test_rope_on_an_odd_head_dim_says_how_to_make_it_even():
  with pytest.raises(
    ValueError,
    match=r"head_dim = qkv_features // num_heads = 3 is odd\. "
    r"Fix: .* qkv_features=24",
  ):
    sr.nn.MultiHeadAttention(HEADS, D, qkv_features=12, rope_base=10000.0, rngs=sr.Rngs(0))
  with pytest.raises(ValueError, match=r"rope_base=-1\.0 must be a positive number.*Fix"):
    sr.nn.MultiHeadAttention(HEADS, D, rope_base=-1.0, rngs=sr.Rngs(0))
  # Without rope an odd head_dim is fine, as in nnx.
  sr.nn.MultiHeadAttention(HEADS, D, qkv_features=12, rngs=sr.Rngs(0))


@pytest.mark.parametrize("transform", [False, True])
def test_a_wrong_feature_size_names_the_path_and_the_expected_shape(transform):
  net = Net()
  before = _leaves(net)
  call = sr.jit(lambda m, x: m(x)) if transform else (lambda m, x: m(x))
  with pytest.raises(
    ValueError,
    match=r"MultiHeadAttention at `blocks\[0\]` was built "
    r"with in_features=16 but inputs_q has shape "
    r"\(2, 6, 8\): expected \[batch\.\.\., length, 16\]"
    r"\. Fix.*in_features=8",
  ):
    call(net, _x(B, T, 8))
  with pytest.raises(
    ValueError,
    match=r"`blocks\[0\]` takes inputs_q of shape "
    r"\[batch\.\.\., length, 16\], got shape \(16,\)",
  ):
    call(net, _x(D))
  assert _unchanged(net, before)


@pytest.mark.parametrize("decode", [False, True])
def test_positions_of_the_wrong_shape_name_the_path_and_change_nothing(decode):
  net = Net(rope_base=10000.0)
  x = _x(B, T, D)
  if decode:
    net.blocks[0].init_cache((B, T, D))
    x = x[:, :1]
  before = _leaves(net)
  length = x.shape[1]
  for call in (
    lambda m, x, p: m(x, positions=p, decode=decode),
    sr.jit(lambda m, x, p: m(x, positions=p, decode=decode)),
  ):
    with pytest.raises(
      ValueError,
      match=(
        rf"MultiHeadAttention at `blocks\[0\]`: positions has shape \({length + 1},\) "
        rf".*expected positions of shape \(2, {length}\) or \({length},\).*Fix"
      ),
    ):
      call(net, x, jnp.arange(length + 1))
    assert _unchanged(net, before)  # the cache index did not move


def test_positions_without_rope_and_rope_for_cross_attention_are_refused():
  net = Net()
  with pytest.raises(
    ValueError,
    match=r"`blocks\[0\]`: positions= was given but the layer "
    r"has no rotary embeddings.*Fix: .*rope_base=",
  ):
    net(_x(B, T, D), positions=jnp.arange(T))
  net = Net(rope_base=10000.0)
  with pytest.raises(
    ValueError,
    match=r"`blocks\[0\]`: rope_base is set.*inputs_k has "
    r"length 3 and inputs_q 6.*Fix",
  ):
    net.blocks[0](_x(B, T, D), _x(B, 3, D))


# -- explicit mesh axes ----------------------------------------------------------------


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_gqa_rope_sharded_over_heads_equals_one_device(axis_type):
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))
  rules = [("batch", "data"), ("heads", "model"), ("embed", None)]

  def build():
    return sr.nn.MultiHeadAttention(
      HEADS,
      D,
      num_kv_heads=KV,
      rope_base=10000.0,
      rngs=sr.Rngs(0),
      kernel_metadata={"sharding": ("embed", "heads", None)},
      bias_metadata={"sharding": ("heads", None)},
      out_kernel_metadata={"sharding": ("heads", None, "embed")},
      out_bias_metadata={"sharding": ("embed",)},
    )

  reference, layer = build(), build()
  x = _x(8, T, D)
  forward = sr.jit(lambda m, x: m(x, is_causal=True))
  step = sr.jit(lambda m, x: m(x, decode=True))
  expected = forward(reference, x)
  reference.init_cache((8, T, D))
  expected_steps = [step(reference, x[:, t : t + 1]) for t in range(2)]
  with jax.set_mesh(mesh):
    sr.shard(layer, mesh, rules)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = forward(layer, xs)
    layer.init_cache((8, T, D))
    got_steps = [step(layer, xs[:, t : t + 1]) for t in range(2)]
  _close(got, expected, atol=1e-5)
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), got.ndim)
  for y, want in zip(got_steps, expected_steps):
    _close(y, want, atol=1e-5)
  _close(layer.cached_key.value, reference.cached_key.value, atol=1e-5)
