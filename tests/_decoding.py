"""Decoding a stack token by token, shared by the decoding tests."""

import jax.numpy as jnp

import statefulremat as sr


def out(y):
  """The output of a stack call: a scan body returns ``(carry, ys)``."""
  return y[0] if isinstance(y, tuple) else y


# The same call compiled once: an eager stack call traces and compiles its loop anew,
# which for a whole sequence token by token was most of the decoding tests' time.
_step = sr.jit(lambda stack, x_t: stack(x_t))


def forward(stack, x):
  """The stack's output on ``x``, through the compiled call (one program per shape)."""
  return out(_step(stack, x))


def decode(stack, x):
  """Token by token: the first call eager, the others through one compiled step."""
  first = out(stack(x[:, :1]))
  rest = [forward(stack, x[:, t : t + 1]) for t in range(1, x.shape[1])]
  return jnp.concatenate([first, *rest], axis=1)
