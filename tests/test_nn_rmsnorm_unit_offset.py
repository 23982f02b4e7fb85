"""``sr.nn.RMSNorm(add_unit_offset=True)``: Gemma's RMSNorm, ``normed * (1 + scale)``
with ``scale`` starting at zeros.

References: the formula, and flax's Gemma example's ``RMSNorm`` (examples/gemma/
layers.py), written out here in nnx and in linen, its parameters loaded into ours by
name (``sr.interop``), and Hugging Face's ``GemmaRMSNorm`` ``weight`` from a state dict.
"""

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import statefulremat as sr

D = 8


class FlaxGemmaRMSNorm(nnx.Module):
  """flax's examples/gemma/layers.py ``RMSNorm``."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.scale = nnx.Param(nnx.initializers.zeros_init()(rngs.params(), dim))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed_inputs = jnp.asarray(x * jnp.reciprocal(jnp.sqrt(var + 1e-06)))
    scale = jnp.expand_dims(self.scale[...], axis=range(len(x.shape) - 1))
    return normed_inputs * (1 + scale)


class LinenGemmaRMSNorm(flax.linen.Module):
  """The linen version of flax's Gemma ``RMSNorm`` (its ``scale`` param, zeros)."""

  @flax.linen.compact
  def __call__(self, x):
    scale = self.param("scale", flax.linen.initializers.zeros_init(), (x.shape[-1],))
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed_inputs = jnp.asarray(x * jnp.reciprocal(jnp.sqrt(var + 1e-06)))
    return normed_inputs * (1 + jnp.expand_dims(scale, axis=range(x.ndim - 1)))


def _x(*shape, seed=0):
  return jnp.asarray(np.random.RandomState(seed).normal(size=shape), jnp.float32)


def _close(a, b, atol=1e-6):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=atol)


def test_unit_offset_equals_the_formula_and_starts_at_zeros():
  norm = sr.nn.RMSNorm(D, add_unit_offset=True, rngs=sr.Rngs(0))
  assert norm.scale is not None
  np.testing.assert_array_equal(norm.scale.value, np.zeros(D))
  norm.scale.value = _x(D, seed=1)
  x = _x(2, 3, D)
  scale = (1 + norm.scale.value).reshape(1, 1, D)
  want = x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * scale
  _close(norm(x), want)
  # The plain norm with scale = 1 + the offset one's is the same layer.
  plain = sr.nn.RMSNorm(D, rngs=sr.Rngs(0))
  assert plain.scale is not None
  plain.scale.value = 1 + norm.scale.value
  _close(norm(x), plain(x))
  # An explicit scale_init still wins.
  ones = sr.nn.RMSNorm(
    D, add_unit_offset=True, scale_init=jax.nn.initializers.ones, rngs=sr.Rngs(0)
  )
  assert ones.scale is not None and (ones.scale.value == 1).all()


def test_equals_flax_gemmas_rmsnorm_from_its_zeros_and_after_loading_its_scale():
  x = _x(2, 5, D)
  ours = sr.nn.RMSNorm(D, add_unit_offset=True, rngs=sr.Rngs(0))
  theirs = FlaxGemmaRMSNorm(D, rngs=nnx.Rngs(0))
  _close(ours(x), theirs(x))  # the same zero-initialised scale
  theirs.scale[...] = _x(D, seed=2)
  sr.interop.from_nnx(ours, theirs)
  _close(ours(x), theirs(x))
  assert ours.scale is not None
  np.testing.assert_array_equal(ours.scale.value, theirs.scale[...])


def test_loads_linen_gemma_params_and_a_hugging_face_gemma_weight():
  x = _x(3, D)
  linen = LinenGemmaRMSNorm()
  assert jax.tree.map(jnp.shape, linen.init(jax.random.key(0), x)) == {"params": {"scale": (D,)}}
  variables = {"params": {"scale": _x(D, seed=3)}}
  ours = sr.interop.from_linen(sr.nn.RMSNorm(D, add_unit_offset=True, rngs=sr.Rngs(0)), variables)
  _close(ours(x), linen.apply(variables, x))
  # Hugging Face's GemmaRMSNorm keeps the offset form too: weight is our scale as is.
  hf = {"weight": np.asarray(_x(D, seed=4))}
  ours = sr.interop.from_state_dict(
    sr.nn.RMSNorm(D, add_unit_offset=True, rngs=sr.Rngs(0)), hf, layout="torch"
  )
  assert ours.scale is not None
  np.testing.assert_array_equal(ours.scale.value, hf["weight"])


def test_unit_offset_without_scale_names_both_and_the_fix():
  with pytest.raises(
    ValueError, match=r"add_unit_offset=True, use_scale=False.*Fix: use_scale=True"
  ):
    sr.nn.RMSNorm(D, add_unit_offset=True, use_scale=False, rngs=sr.Rngs(0))
