"""``sr.nn.MultiHeadAttention(attention_fn=...)`` with the attention functions users
port: flax's (``flax.linen.dot_product_attention`` has no ``is_causal``) and
``jax.nn.dot_product_attention`` (no dropout, ``dtype`` or ``precision``).

Each must give our default attention's output with the same parameters, causal, with a
padding mask and both; an option the function cannot take is an error naming
``attention_fn``, never dropped.
"""

import functools

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import statefulremat as sr

FUNCTIONS = {
  "linen": flax.linen.dot_product_attention,
  "nnx": nnx.dot_product_attention,
  "jax.nn": jax.nn.dot_product_attention,
}
VALID = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
PAD = sr.nn.make_attention_mask(VALID, VALID)  # float 0/1, as flax builds it


def _x(seed=0):
  return jnp.asarray(np.random.RandomState(seed).normal(size=(3, 5, 8)), jnp.float32)


def _pair(fn, **kwargs):
  """Our default attention and one with ``fn``, the same parameters (the same seed)."""
  ours = sr.nn.MultiHeadAttention(2, 8, rngs=sr.Rngs(0), **kwargs)
  theirs = sr.nn.MultiHeadAttention(2, 8, attention_fn=fn, rngs=sr.Rngs(0), **kwargs)
  return ours, theirs


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize(
  "call",
  [dict(is_causal=True), dict(mask=PAD), dict(mask=PAD, is_causal=True)],
  ids=["causal", "padding", "both"],
)
def test_a_users_attention_fn_equals_the_default(name, call):
  fn = FUNCTIONS[name]
  calls = []

  @functools.wraps(fn)  # the signature the layer reads is fn's
  def counted(*args, **kwargs):
    calls.append(kwargs)
    return fn(*args, **kwargs)

  ours, theirs = _pair(counted)
  x = _x()
  np.testing.assert_allclose(theirs(x, **call), ours(x, **call), atol=1e-6, rtol=1e-6)
  assert calls, "the layer must call the given attention_fn"
  # The call is not trivially the unmasked one: causality and padding changed it.
  assert not np.allclose(theirs(x, **call), theirs(x), atol=1e-3)


def test_linen_gets_causality_as_a_mask_and_no_keyword_it_lacks():
  seen = {}

  def linen_like(query, key, value, bias=None, mask=None, deterministic=False, dtype=None):
    seen.update(mask=mask, deterministic=deterministic)
    return flax.linen.dot_product_attention(query, key, value, bias, mask, dtype=dtype)

  _, attn = _pair(linen_like)
  attn(_x(), is_causal=True)
  assert seen["mask"].shape == (1, 1, 5, 5)
  np.testing.assert_array_equal(np.asarray(seen["mask"])[0, 0], np.tril(np.ones((5, 5))))
  assert seen["deterministic"] is True


def test_flax_functions_with_dropout_draw_it():
  for name in ("linen", "nnx"):
    attn = sr.nn.MultiHeadAttention(
      2, 8, dropout_rate=0.5, attention_fn=FUNCTIONS[name], rngs=sr.Rngs(0)
    )
    attn.train()
    x = _x()
    assert not np.allclose(attn(x), attn(x))  # a fresh dropout mask per call
    attn.eval()
    ours, _ = _pair(FUNCTIONS[name])
    ours.eval()
    np.testing.assert_allclose(attn(x), ours(x), atol=1e-6, rtol=1e-6)


def test_an_option_the_function_cannot_take_is_an_error_naming_attention_fn():
  with pytest.raises(
    ValueError,
    match=r"dropout_rate=0\.1 but attention_fn=.*takes no dropout_rng.*Fix: dropout_rate=0\.0",
  ):
    sr.nn.MultiHeadAttention(
      2, 8, dropout_rate=0.1, attention_fn=jax.nn.dot_product_attention, rngs=sr.Rngs(0)
    )
  with pytest.raises(ValueError, match=r"precision=.*attention_fn=.*takes no precision.*Fix"):
    sr.nn.MultiHeadAttention(
      2,
      8,
      precision=jax.lax.Precision.HIGHEST,
      attention_fn=jax.nn.dot_product_attention,
      rngs=sr.Rngs(0),
    )
  with pytest.raises(TypeError, match=r"attention_fn='dot' is not a function"):
    sr.nn.MultiHeadAttention(2, 8, attention_fn="dot", rngs=sr.Rngs(0))  # type: ignore[arg-type]

  def no_mask(query, key, value):
    return nnx.dot_product_attention(query, key, value)

  _, attn = _pair(no_mask)
  attn(_x())  # nothing to mask: fine
  with pytest.raises(ValueError, match=r"attention_fn=.*no_mask takes no mask.*Fix"):
    attn(_x(), is_causal=True)


def test_grouped_query_attention_with_linen_says_what_to_pass():
  attn = sr.nn.MultiHeadAttention(
    4, 8, num_kv_heads=2, attention_fn=flax.linen.dot_product_attention, rngs=sr.Rngs(0)
  )
  with pytest.raises(ValueError, match=r"attention_fn=.*grouped-query.*Fix.*nnx"):
    attn(_x())
  for name in ("nnx", "jax.nn"):
    ours = sr.nn.MultiHeadAttention(4, 8, num_kv_heads=2, rngs=sr.Rngs(0))
    theirs = sr.nn.MultiHeadAttention(
      4, 8, num_kv_heads=2, attention_fn=FUNCTIONS[name], rngs=sr.Rngs(0)
    )
    np.testing.assert_allclose(
      theirs(_x(), is_causal=True), ours(_x(), is_causal=True), atol=1e-6, rtol=1e-6
    )
