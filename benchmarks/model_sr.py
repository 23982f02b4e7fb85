"""statefulremat: ``sr.scan``, ``sr.remat`` and ``sr.remat_scan`` over object modules.

Scanned layers are one ``sr.vmap``-initialised stack; the unrolled loop runs over an
``sr.ModuleList`` of separate layers. The gradient is ``sr.jit`` of ``sr.grad``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import statefulremat as sr

from .models import Case, host_init, inputs, jit_options, strategy_lengths


class Block(sr.Module):
  """``tanh(Linear(x))``: one layer, ``x -> x``."""

  def __init__(self, width: int, *, rngs: sr.Rngs):
    self.linear = sr.nn.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


class Unrolled(sr.Module):
  def __init__(self, n: int, width: int, *, rngs: sr.Rngs):
    self.blocks = sr.ModuleList([Block(width, rngs=rngs) for _ in range(n)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def forward(strategy: str, model, x, lengths=None):
  """The deep stack applied to ``x`` with the given construction."""
  if strategy == "unrolled":
    return model(x)
  if strategy in ("scan", "scan_remat"):
    body = lambda m, h: (m(h), None)
    if strategy == "scan_remat":
      body = sr.remat(body, prevent_cse=False)
    return sr.scan(body, variable_axes={sr.Param: 0})(model, x)[0]
  return sr.remat_scan(lambda m, h: m(h), lengths)(model, x)


def _abstract_build(make):
  """``make()``'s module, built abstractly (in ``jax.eval_shape``), with host values."""
  graphdefs = []

  def abstract():
    graphdef, state = sr.split(make())
    graphdefs.append(graphdef)
    return state

  state = jax.eval_shape(abstract)
  return sr.merge(graphdefs[0], host_init(state))


def build(strategy: str, n: int, width: int, batch: int) -> Case:
  lengths = strategy_lengths(strategy, n)
  if strategy == "unrolled":
    make = lambda: Unrolled(n, width, rngs=sr.Rngs(0))
  else:
    make = lambda: sr.vmap(Block, axis_size=n)(width, rngs=sr.Rngs(0))
  model = _abstract_build(make)
  x = inputs(batch, width)

  def new(compiler_options=None):
    def loss(model, x):
      return jnp.mean(forward(strategy, model, x, lengths) ** 2)

    return sr.jit(lambda model, x: sr.grad(loss)(model, x), **jit_options(compiler_options))

  return Case(new, (model, x))
