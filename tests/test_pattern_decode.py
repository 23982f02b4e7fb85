"""Decoding token by token through a stack of a repeating pattern (issue 25, item 3).

A pattern stack of local (sliding-window) and global attention blocks, Gemma 3's
shape: every position of the pattern is an ordinary stack, so the caches are made per
position, ``stack.pattern[k].attn.init_cache((batch, max_length, dim))``, each with
that position's layer axis in front, and ``stack.set_attributes(decode=True)``
switches every attention to decoding. A local block passes a window mask to its
attention: over the whole sequence when training, against the cache (at the cache
index) when decoding; the cache is full-length (``MultiHeadAttention`` has no ring
buffer), the mask does the windowing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr
from tests._decoding import decode as _decode
from tests._decoding import forward as _forward

D, HEADS, KV_HEADS, W, T, B = 16, 4, 2, 3, 10, 2
HEAD_DIM = D // HEADS


class Block(sr.Module):
  """Pre-norm block with grouped-query RoPE attention; ``window`` makes it local."""

  def __init__(self, *, window=None, rope_base=10_000.0, rngs):
    self.window = window
    self.norm1 = sr.nn.RMSNorm(D, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(
      HEADS, D, num_kv_heads=KV_HEADS, rope_base=rope_base, use_bias=False, rngs=rngs
    )
    self.norm2 = sr.nn.RMSNorm(D, rngs=rngs)
    self.mlp = sr.nn.MLP(D, 2 * D, rngs=rngs)

  def window_mask(self, length):
    if self.window is None:
      return None
    if self.attn.decode and self.attn.cached_key is not None:
      t = self.attn.cache_index.value  # the position being decoded
      keys = jnp.arange(self.attn.cached_key.shape[-3])
      return (keys > t - self.window)[None, None, None, :]
    positions = jnp.arange(length)
    return (positions[:, None] - positions[None, :] < self.window)[None, None]

  def __call__(self, x):
    x = x + self.attn(self.norm1(x), mask=self.window_mask(x.shape[-2]), is_causal=True)
    return x + self.mlp(self.norm2(x))


class ScanBlock(Block):
  """The same block as a scan body: ``carry -> (carry, ys)``."""

  def __call__(self, x):
    return super().__call__(x), None


# The cache's room is checked on the host inside the traced loop: JAX raises the check's
# error as a ValueError from a compiled call and as a JaxRuntimeError (its message the
# check's) from an eager one, as it does for any failing jax.pure_callback.
HOST_CHECKED = (ValueError, jax.errors.JaxRuntimeError)


def _pattern(cls):
  """(Local, Local, Global): windowed RoPE-10k blocks, then a global RoPE-1M one."""
  local = functools.partial(cls, window=W)
  return (local, local, functools.partial(cls, rope_base=1_000_000.0))


def _scan(length, rules):
  return sr.scan(_pattern(ScanBlock), length=length, variable_axes=rules, split_rngs={True: True})


STACKS = {  # 7 layers: two full cycles and a short third one (positions 0 only)
  "scan": lambda: _scan(7, {True: 0}),
  "scan_param_cache": lambda: _scan(6, {sr.Param: 0, sr.Cache: 0}),
  "remat_scan": lambda: sr.remat_scan(_pattern(Block), length=7, lengths=(3,)),
  "remat_scan_whole_cycles": lambda: sr.remat_scan(_pattern(Block), length=6, lengths=(2,)),
  "remat_scan_nested": lambda: sr.remat_scan(_pattern(Block), length=12, lengths=(2, 2)),
  "remat_scan_ragged": lambda: sr.remat_scan(_pattern(Block), length=7, lengths=(2, 2)),
  "remat_scan_auto": lambda: sr.remat_scan(_pattern(Block), length=7, lengths="auto"),
}


def _tokens(seed=1):
  return jax.random.normal(jax.random.key(seed), (B, T, D))


def _init_caches(stack, max_length=T):
  for position in stack.pattern:
    position.attn.init_cache((B, max_length, D))


def _leaves(model):
  return [
    np.asarray(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)
    for v in jax.tree.leaves(sr.state(model))
  ]


def _unchanged(model, before):
  after = _leaves(model)
  return len(after) == len(before) and all(
    a.shape == b.shape and (a == b).all() for a, b in zip(after, before)
  )


@pytest.mark.parametrize("kind", sorted(STACKS))
def test_decoding_one_token_at_a_time_equals_the_causal_forward(kind):
  stack = STACKS[kind]()(rngs=sr.Rngs(0))
  n = len(stack)
  x = _tokens()
  full = _forward(stack, x)
  _init_caches(stack)
  stack.set_attributes(decode=True)
  decoded = _decode(stack, x)
  np.testing.assert_allclose(decoded, full, atol=2e-5, rtol=2e-5)
  for k, position in enumerate(stack.pattern):
    assert position.attn.cache_index.value.tolist() == [T] * len(range(k, n, 3))
  assert len(stack) == n


def test_the_window_mask_is_a_sliding_window():
  """The reference above is windowed: a local layer at position t sees exactly the
  last W inputs (RoPE is relative, so it equals the layer run on those W alone), and
  dropping the windows changes the stack's output."""
  stack = STACKS["remat_scan"]()(rngs=sr.Rngs(0))
  x = _tokens()
  layer = stack.layer(0)
  assert layer.window == W
  local = functools.partial(sr.jit(Block.__call__), layer)
  full = local(x)
  # The windows x[:, t - W + 1 : t + 1], t = W - 1 ... T - 1, as one batch.
  windows = jnp.stack([x[:, t - W + 1 : t + 1] for t in range(W - 1, T)])
  alone = local(windows.reshape(-1, W, D))[:, -1].reshape(T - W + 1, B, D)
  np.testing.assert_allclose(full[:, W - 1 :], alone.transpose(1, 0, 2), atol=2e-5, rtol=2e-5)
  windowed = _forward(stack, x)
  stack.set_attributes(window=None)
  assert [position.window for position in stack.pattern] == [None] * 3
  unwindowed = _forward(stack, x)
  assert np.abs(unwindowed - windowed).max() > 1e-2
  # Before position W every window holds the whole past: nothing to cut.
  np.testing.assert_allclose(unwindowed[:, :W], windowed[:, :W], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", ["scan", "remat_scan"])
def test_each_layer_decodes_with_its_own_cache_slice(kind):
  stack = STACKS[kind]()(rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  assert [layer.window for layer in layers] == [W, W, None] * 2 + [W]
  x = _tokens()[:, :6]
  _init_caches(stack)
  stack.set_attributes(decode=True)
  for layer in layers:
    layer.attn.init_cache((B, T, D))
    layer.set_attributes(decode=True)

  @sr.jit
  def loop(layers, h):  # the Python loop the stack replaces
    for layer in layers:
      h = Block.__call__(layer, h)
    return h

  looped = jnp.concatenate([loop(layers, x[:, t : t + 1]) for t in range(x.shape[1])], axis=1)
  np.testing.assert_allclose(_decode(stack, x), looped, atol=2e-5, rtol=2e-5)
  for i, layer in enumerate(layers):
    mine = stack.layer(i).attn
    assert mine.cached_key.shape == (B, T, KV_HEADS, HEAD_DIM)
    np.testing.assert_allclose(
      mine.cached_key.value, layer.attn.cached_key.value, atol=2e-5, rtol=2e-5
    )
    np.testing.assert_allclose(
      mine.cached_value.value, layer.attn.cached_value.value, atol=2e-5, rtol=2e-5
    )
    assert int(mine.cache_index.value) == 6


@pytest.mark.parametrize("kind", ["scan", "remat_scan"])
def test_caches_carry_each_positions_layer_axis(kind):
  stack = STACKS[kind]()(rngs=sr.Rngs(0))
  _init_caches(stack)
  for position, n_k in zip(stack.pattern, (3, 2, 2)):  # layers 0,3,6 / 1,4 / 2,5
    attn = position.attn
    assert attn.cached_key.shape == attn.cached_value.shape == (n_k, B, T, KV_HEADS, HEAD_DIM)
    assert attn.cache_index.shape == (n_k,)
    assert attn.cached_key.metadata["layer_axis"] == ((0, None),)
  caches = sr.state(stack, sr.Cache).flat_variables()
  assert sorted(caches) == [
    ("pattern", k, "attn", name)
    for k in range(3)
    for name in ("cache_index", "cached_key", "cached_value")
  ]
  again = sr.stack(sr.unstack(stack))
  assert type(again) is type(stack) and len(again) == 7
  for k in range(3):
    np.testing.assert_array_equal(
      again.pattern[k].attn.cached_key.value, stack.pattern[k].attn.cached_key.value
    )


def test_init_cache_again_starts_a_new_sequence():
  stack = STACKS["remat_scan_auto"]()(rngs=sr.Rngs(0))
  x = _tokens()[:, :5]
  _init_caches(stack)
  stack.set_attributes(decode=True)
  first = _decode(stack, x)
  _init_caches(stack)
  assert [p.attn.cache_index.value.tolist() for p in stack.pattern] == [[0] * 3, [0] * 2, [0] * 2]
  np.testing.assert_array_equal(_decode(stack, x), first)


def test_decoding_without_a_cache_on_some_position_raises_and_changes_nothing():
  stack = STACKS["remat_scan"]()(rngs=sr.Rngs(0))
  stack.set_attributes(decode=True)
  before = _leaves(stack)
  message = (
    r"MultiHeadAttention at `.*attn`: decode=True needs the key/value cache, "
    r"and it has none\. Fix: call `init_cache\(\(batch, max_length, 16\)\)`"
  )
  with pytest.raises(ValueError, match=message):
    stack(_tokens()[:, :1])
  assert _unchanged(stack, before)
  # Caches on positions 0 and 1 only: the global position still has none.
  stack.pattern[0].attn.init_cache((B, T, D))
  stack.pattern[1].attn.init_cache((B, T, D))
  before = _leaves(stack)
  with pytest.raises(ValueError, match=message):
    stack(_tokens()[:, :1])
  assert _unchanged(stack, before)
  assert stack.pattern[2].attn.cached_key is None


def test_decoding_past_the_cache_length_raises_and_changes_nothing():
  stack = STACKS["remat_scan"]()(rngs=sr.Rngs(0))
  _init_caches(stack, max_length=2)
  stack.set_attributes(decode=True)
  x = _tokens()
  _decode(stack, x[:, :2])
  before = _leaves(stack)
  with pytest.raises(
    HOST_CHECKED,
    match=r"`.*attn`: decoding past the end of the key/value "
    r"cache: it holds max_length=2 positions and all are used",
  ):
    stack(x[:, 2:3])
  assert _unchanged(stack, before)


def test_decoding_another_batch_than_the_caches_names_both_batches_and_init_cache():
  stack = STACKS["remat_scan"]()(rngs=sr.Rngs(0))
  _init_caches(stack)  # batch B = 2
  stack.set_attributes(decode=True)
  before = _leaves(stack)
  x = jax.random.normal(jax.random.key(1), (3, 1, D))
  with pytest.raises(
    ValueError,
    match=(
      r"MultiHeadAttention at `.*attn`: decoding a batch of 3 into a key/value cache made "
      r"for a batch of 2 \(`.*attn\.cached_key` has shape \(2, 10, 2, 4\).*Fix: make the "
      r"cache for this batch, `init_cache\(\(3, 10, 16\)\)`.*"
      r"`stack\.pattern\[k\]\.attn\.init_cache\(\(3, 10, 16\)\)`"
    ),
  ):
    stack(x)
  assert _unchanged(stack, before)
  for position in stack.pattern:  # the fix the message gives
    position.attn.init_cache((3, T, D))
  assert _forward(stack, x).shape == (3, 1, D)


def test_a_decode_step_of_several_positions_says_one_at_a_time():
  attn = sr.nn.MultiHeadAttention(HEADS, D, num_kv_heads=KV_HEADS, rngs=sr.Rngs(0))
  attn.init_cache((B, T, D))
  with pytest.raises(
    ValueError,
    match=(
      r"MultiHeadAttention: decode=True feeds one position at a time, but the input has "
      r"length 2 .*Fix: call it once per position, with inputs of shape \(batch\.\.\., 1, "
      r"16\)"
    ),
  ):
    attn(_tokens()[:, :2], decode=True)
  with pytest.raises(
    ValueError,
    match=r"decoding an input without a batch axis into a key/value cache made for a "
    r"batch of 2 \(`cached_key` has shape .*`init_cache\(\(10, 16\)\)`",
  ):
    attn(_tokens()[0, :1], decode=True)
