"""Raw JAX: the hand-written reference for every construction.

Parameters are a pytree of arrays (a list of per-layer dicts for the unrolled loop, one
dict of stacked arrays for the scans, passed to ``lax.scan`` as xs); every checkpoint is
``jax.checkpoint(prevent_cse=False)``, as ``lax.scan`` bodies want.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .models import Case, host_init, inputs, jit_options, strategy_lengths


def abstract(n: int | None, width: int) -> dict:
  """Parameter shapes: ``kernel`` (n, W, W), ``bias`` (n, W); one layer's if n is None."""
  lead = () if n is None else (n,)
  return {
    "kernel": jax.ShapeDtypeStruct(lead + (width, width), jnp.float32),
    "bias": jax.ShapeDtypeStruct(lead + (width,), jnp.float32),
  }


def layer(h, p):
  # bias[None]: the tests run with jax_numpy_rank_promotion="raise"
  return jnp.tanh(h @ p["kernel"] + p["bias"][None])


def remat_scan(params, x, lengths):
  """Nested ``lax.scan``s, ``jax.checkpoint`` at every level, params as xs."""
  folded = jax.tree.map(lambda p: p.reshape(tuple(lengths) + p.shape[1:]), params)

  def level(d, h, ps):
    if d == len(lengths):
      return layer(h, ps), None
    step = jax.checkpoint(lambda h, p: level(d + 1, h, p), prevent_cse=False)
    return jax.lax.scan(step, h, ps)

  return level(0, x, folded)[0]


def forward(strategy: str, params, x, lengths=None):
  """The deep stack applied to ``x`` with the given construction."""
  if strategy == "unrolled":
    for p in params:
      x = layer(x, p)
    return x
  step = lambda h, p: (layer(h, p), None)
  if strategy == "scan":
    return jax.lax.scan(step, x, params)[0]
  if strategy == "scan_remat":
    return jax.lax.scan(jax.checkpoint(step, prevent_cse=False), x, params)[0]
  return remat_scan(params, x, lengths)


def build(strategy: str, n: int, width: int, batch: int) -> Case:
  if strategy == "unrolled":
    params = host_init([abstract(None, width) for _ in range(n)])
  else:
    params = host_init(abstract(n, width))
  lengths = strategy_lengths(strategy, n)
  x = inputs(batch, width)

  def new(compiler_options=None):
    def loss(params, x):
      return jnp.mean(forward(strategy, params, x, lengths) ** 2)

    return jax.jit(jax.grad(loss), **jit_options(compiler_options))

  return Case(new, (params, x))
