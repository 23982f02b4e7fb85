"""The blocks the pattern-stack tests build their patterns from (test_pattern_stacks,
test_stack_compositions): each exercises other state — dropout keys, batch statistics,
parameters of another shape."""

import jax
import jax.numpy as jnp

import statefulremat as sr

D = 4


class Mix(sr.Module):
  """Linear, tanh and live dropout."""

  def __init__(self, *, rngs, scale=1.0):
    self.lin = sr.nn.Linear(D, D, rngs=rngs)
    self.drop = sr.nn.Dropout(0.3, rngs=rngs)
    self.scale = scale

  def __call__(self, x):
    return self.drop(jnp.tanh(self.lin(x))) * self.scale


class Norm(sr.Module):
  """A per-feature gain and a BatchNorm: other parameter shapes, batch statistics."""

  def __init__(self, *, rngs):
    self.gain = sr.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (D,)))
    self.bn = sr.nn.BatchNorm(D, rngs=rngs)

  def __call__(self, x):
    return self.bn(x * self.gain.value[None])


class Gate(sr.Module):
  """A gated residual: parameters only."""

  def __init__(self, *, rngs):
    self.w = sr.Param(jax.random.normal(rngs.params(), (D, D)) / D)

  def __call__(self, x):
    return x + jax.nn.sigmoid(x @ self.w.value)
