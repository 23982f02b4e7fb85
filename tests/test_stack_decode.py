"""Decoding token by token on a stack of attention blocks (issue 16, part 2).

How to decode on a stack: the KV caches live with the stacked layers, one per layer
along the layer axis, made by ``init_cache`` on the stack's attention::

    Stack = sr.remat_scan(Block, lengths=(4,))            # or, for sr.scan, a block
    # returning (carry, None) and variable_axes={True: 0} / {sr.Param: 0, sr.Cache: 0}
    stack = Stack(rngs=sr.Rngs(0))
    y = stack(x)                                          # training: whole sequences
    stack.attn.init_cache((batch, max_length, dim))       # cached_key: (4, batch, ...)
    stack.set_attributes(decode=True)
    for t in range(max_length):
      y_t = stack(x[:, t:t + 1])                          # one position per call

Inside the stack each layer sees its own slice of ``cached_key`` / ``cached_value``
/ ``cache_index`` and writes it back. ``is_causal=True`` is ignored under decode (the
cache's mask is already causal), so one block trains and decodes. ``init_cache``
again starts a new sequence. The scan's rules must slice the ``cache`` collection
(``sr.remat_scan``'s default ``{True: 0}`` does); decoding past ``max_length`` or
without a cache raises, naming the attention's path and the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr
from tests._decoding import decode as _decode
from tests._decoding import forward as _forward

D, HEADS, N, T, B = 16, 4, 4, 20, 2


class Block(sr.Module):
  """Pre-LN causal transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

  def __init__(self, *, rngs):
    self.ln1 = sr.nn.LayerNorm(D, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(HEADS, D, rngs=rngs)
    self.ln2 = sr.nn.LayerNorm(D, rngs=rngs)
    self.mlp = sr.nn.MLP(D, 4 * D, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x), is_causal=True)
    return x + self.mlp(self.ln2(x))


class ScanBlock(Block):
  """The same block as a scan body: ``carry -> (carry, ys)``."""

  def __call__(self, x):
    return super().__call__(x), None


STACKS = {
  "scan": lambda: sr.scan(
    ScanBlock, length=N, variable_axes={sr.Param: 0, sr.Cache: 0}, split_rngs={True: True}
  ),
  "scan_all": lambda: sr.scan(
    ScanBlock, length=N, variable_axes={True: 0}, split_rngs={True: True}
  ),
  "remat_scan": lambda: sr.remat_scan(Block, lengths=(N,)),
  "remat_scan_nested": lambda: sr.remat_scan(Block, lengths=(2, 2)),
  "remat_scan_ragged": lambda: sr.remat_scan(Block, lengths=(2, 3), length=N + 1),
  "remat_scan_auto": lambda: sr.remat_scan(Block, "auto", length=N),  # planned per call
}


# The cache's room is checked on the host inside the traced loop: JAX raises the check's
# error as a ValueError from a compiled call and as a JaxRuntimeError (its message the
# check's) from an eager one, as it does for any failing jax.pure_callback.
HOST_CHECKED = (ValueError, jax.errors.JaxRuntimeError)


def _tokens(seed=1):
  return jax.random.normal(jax.random.key(seed), (B, T, D))


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
  stack.attn.init_cache((B, T, D))
  stack.set_attributes(decode=True)
  decoded = _decode(stack, x)
  np.testing.assert_allclose(decoded, full, atol=2e-5, rtol=2e-5)
  assert stack.attn.cache_index.value.tolist() == [T] * n
  assert len(stack) == n


def test_the_causal_forward_is_not_the_non_causal_one():
  """The reference of the test above is causal: attending to the future differs."""
  stack = STACKS["remat_scan"]()(rngs=sr.Rngs(0))
  x = _tokens()

  @sr.jit
  def non_causal(layers, h):
    for layer in layers:
      h = h + layer.attn(layer.ln1(h))  # no mask
      h = h + layer.mlp(layer.ln2(h))
    return h

  assert np.abs(_forward(stack, x) - non_causal(sr.unstack(stack), x)).max() > 1e-2


@pytest.mark.parametrize("kind", ["scan", "remat_scan"])
def test_each_layer_decodes_with_its_own_cache_slice(kind):
  stack = STACKS[kind]()(rngs=sr.Rngs(0))
  layers = sr.unstack(stack)
  x = _tokens()[:, :5]
  stack.attn.init_cache((B, T, D))
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
    np.testing.assert_allclose(
      mine.cached_key.value, layer.attn.cached_key.value, atol=2e-5, rtol=2e-5
    )
    np.testing.assert_allclose(
      mine.cached_value.value, layer.attn.cached_value.value, atol=2e-5, rtol=2e-5
    )
    assert int(mine.cache_index.value) == 5
  # Layers have their own parameters, so their caches differ.
  keys = stack.attn.cached_key.value
  assert not np.allclose(keys[0], keys[1])


@pytest.mark.parametrize("kind", ["scan", "remat_scan"])
def test_caches_carry_the_layer_axis(kind):
  stack = STACKS[kind]()(rngs=sr.Rngs(0))
  stack.attn.init_cache((B, T, D))
  attn = stack.attn
  head_dim = D // HEADS
  assert attn.cached_key.shape == attn.cached_value.shape == (N, B, T, HEADS, head_dim)
  assert attn.cache_index.shape == (N,)
  caches = sr.state(stack, sr.Cache).flat_variables()
  assert sorted(caches) == [
    ("attn", "cache_index"),
    ("attn", "cached_key"),
    ("attn", "cached_value"),
  ]
  for var in caches.values():
    assert var.metadata["layer_axis"] == ((0, None),)
  # The stack is still a stack of N layers; one layer is an ordinary block.
  assert len(stack) == N
  layer = stack.layer(2)
  assert type(layer) is (ScanBlock if kind == "scan" else Block)
  assert layer.attn.cached_key.shape == (B, T, HEADS, head_dim)
  assert layer.attn.cache_index.shape == ()
  assert "layer_axis" not in layer.attn.cached_key.metadata
  again = sr.stack(sr.unstack(stack))
  assert type(again) is type(stack)
  assert again.attn.cached_key.metadata["layer_axis"] == ((0, None),)
  np.testing.assert_array_equal(again.attn.cached_key.value, attn.cached_key.value)


def test_a_named_layer_axis_and_a_stack_of_stacks():
  Deep = sr.remat_scan(Block, lengths=(N,), metadata_params={"partition_name": "layers"})
  deep = Deep(rngs=sr.Rngs(0))
  deep.attn.init_cache((B, T, D))
  assert deep.attn.cached_key.metadata["layer_axis"] == ((0, "layers"),)
  # An ensemble of 2 stacks: two layer axes in front, as its parameters have.
  ensemble = sr.vmap(sr.remat_scan(Block, lengths=(N,)), axis_size=2)(rngs=sr.Rngs(0))
  ensemble.attn.init_cache((B, T, D))
  assert ensemble.attn.cached_key.shape[:2] == (2, N)
  assert (
    ensemble.attn.cached_key.metadata["layer_axis"]
    == (ensemble.attn.query.kernel.metadata["layer_axis"])
  )
  ensemble.set_attributes(decode=True)
  x = jnp.broadcast_to(_tokens()[None, :, :3], (2, B, 3, D))
  for t in range(3):
    _forward(ensemble, x[:, :, t : t + 1])
  assert ensemble.attn.cache_index.value.tolist() == [[3] * N, [3] * N]


def test_init_cache_again_starts_a_new_sequence():
  stack = STACKS["remat_scan"]()(rngs=sr.Rngs(0))
  x = _tokens()[:, :4]
  stack.attn.init_cache((B, T, D))
  stack.set_attributes(decode=True)
  first = _decode(stack, x)
  stack.attn.init_cache((B, T, D))
  assert stack.attn.cache_index.value.tolist() == [0] * N
  np.testing.assert_array_equal(_decode(stack, x), first)


def test_decoding_past_the_cache_length_raises_and_changes_nothing():
  stack = STACKS["remat_scan"]()(rngs=sr.Rngs(0))
  stack.attn.init_cache((B, 3, D))
  stack.set_attributes(decode=True)
  x = _tokens()
  _decode(stack, x[:, :3])
  before = _leaves(stack)
  with pytest.raises(
    HOST_CHECKED,
    match=r"MultiHeadAttention at `attn`: decoding past the "
    r"end of the key/value cache: it holds max_length=3 positions and "
    r"all are used \(cache_index=3\)\. Fix: .*init_cache\(\(batch, "
    r"max_length, 16\)\)` with max_length at least",
  ):
    stack(x[:, 3:4])
  assert _unchanged(stack, before)
  # The scan stack, and one eager layer (checked before anything is written).
  scan_stack = STACKS["scan"]()(rngs=sr.Rngs(0))
  scan_stack.attn.init_cache((B, 1, D))
  scan_stack.set_attributes(decode=True)
  scan_stack(x[:, :1])
  with pytest.raises(HOST_CHECKED, match=r"`attn`: decoding past the end"):
    scan_stack(x[:, 1:2])
  layer = stack.layer(0)
  layer.attn.init_cache((B, 1, D))
  layer(x[:, :1])
  before = _leaves(layer)
  with pytest.raises(ValueError, match=r"`attn`: decoding past the end.*max_length=1"):
    layer(x[:, 1:2])
  assert _unchanged(layer, before)


def test_decoding_without_a_cache_names_the_attention_and_the_fix():
  for kind in ("scan", "remat_scan"):
    stack = STACKS[kind]()(rngs=sr.Rngs(0))
    stack.set_attributes(decode=True)
    before = _leaves(stack)
    with pytest.raises(
      ValueError,
      match=r"MultiHeadAttention at `attn`: decode=True needs "
      r"the key/value cache, and it has none\. Fix: call `init_cache\(\("
      r"batch, max_length, 16\)\)` .*`stack\.attn\.init_cache\(\.\.\.\)` "
      r"makes one cache per layer",
    ):
      stack(_tokens()[:, :1])
    assert _unchanged(stack, before)
    assert stack.attn.cached_key is None


def test_a_scan_whose_rules_do_not_slice_the_cache_says_how_to_build_it():
  Stack = sr.scan(ScanBlock, length=N, variable_axes={sr.Param: 0}, split_rngs={True: True})
  stack = Stack(rngs=sr.Rngs(0))
  stack.attn.init_cache((B, T, D))
  stack.set_attributes(decode=True)
  before = _leaves(stack)
  with pytest.raises(
    sr.TransformError,
    match=r"`attn\.cache_index` \(Cache\) of the "
    r"stacked ScanScanBlock carries the layer axis \(axis 0, 4 layers\), "
    r"but this transform's rules treat it as read-only.*own rules.*add "
    r"`sr\.Cache: 0` to its variable_axes.*"
    r"sr\.stack\(sr\.unstack\(stack\), like=NewClass\)",
  ):
    stack(_tokens()[:, :1])
  assert _unchanged(stack, before)
  # The fix the message gives.
  Fixed = sr.scan(
    ScanBlock, length=N, variable_axes={sr.Param: 0, sr.Cache: 0}, split_rngs={True: True}
  )
  fixed = sr.stack(sr.unstack(stack), like=Fixed)
  x = _tokens()[:, :3]
  np.testing.assert_allclose(
    _decode(fixed, x), _forward(fixed.set_attributes(decode=False), x), atol=2e-5, rtol=2e-5
  )


def test_a_function_form_scan_over_a_vmapped_stack_decodes():
  """The path that used to fail: ``init_cache`` on a stack's attention, then a scan."""

  class Attn(sr.Module):
    def __init__(self, *, rngs):
      self.attn = sr.nn.MultiHeadAttention(2, 4, decode=True, rngs=rngs)

    def __call__(self, x):
      return self.attn(x)

  stack = sr.vmap(Attn, axis_size=2)(rngs=sr.Rngs(0))
  stack.attn.init_cache((1, 6, 4))
  assert stack.attn.cached_key.shape == (2, 1, 6, 2, 2)
  scan = sr.scan(lambda m, x: (m(x), None), variable_axes={True: 0})
  for _ in range(3):
    scan(stack, jnp.ones((1, 1, 4)))
  assert stack.attn.cache_index.value.tolist() == [3, 3]
