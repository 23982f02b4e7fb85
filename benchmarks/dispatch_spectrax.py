"""The SpectraX variant of the dispatch benchmark (``spectrax-lib``, optional).

A module of its own because SpectraX finds a module's class again by its import path
(``bind`` resolves ``module.Qualname``), so the classes must live at a module's top
level, and ``benchmarks/dispatch_variants.py`` imports this file only when the variant
runs: SpectraX is not in the dev extra, and importing it patches ``jax.config.update``.
The step is the one of SpectraX's quickstart: ``spx.jit(mutable="parameters")``
writes the updated parameters back into the live module, and its optax wrapper
(``spectrax.contrib.Optimizer``) returns a new optimizer each step.
"""

from __future__ import annotations

import jax.numpy as jnp
import spectrax as spx
from spectrax import nn
from spectrax.contrib import Optimizer


class Block(spx.Module):
  def __init__(self, width, *, rngs):
    super().__init__()
    self.l1 = nn.Linear(width, width, rngs=rngs)
    self.n1 = nn.LayerNorm(width, eps=1e-6)
    self.l2 = nn.Linear(width, width, rngs=rngs)
    self.n2 = nn.LayerNorm(width, eps=1e-6)

  def forward(self, x):
    return x + self.n2(self.l2(jnp.tanh(self.n1(self.l1(x)))))


class Model(spx.Module):
  def __init__(self, blocks, width, norm, *, rngs):
    super().__init__()
    self.layers = nn.ModuleList(
      [
        Block(width, rngs=rngs) if norm else nn.Linear(width, width, rngs=rngs)
        for _ in range(blocks)
      ]
    )
    self.norm = norm

  def forward(self, x):
    for layer in self.layers:
      x = layer(x) if self.norm else jnp.tanh(layer(x))
    return x


def build(cfg, kind, x, *, loss, sgd, tx):
  """``call()`` of one SpectraX step on a fresh model of configuration ``cfg``.

  ``loss(out)``, ``sgd(params, grads)`` and ``tx()`` are the other variants' own, so
  every library runs the same computation.
  """
  model = Model(**cfg, rngs=spx.Rngs(0))
  params = spx.as_selector("parameters")

  @spx.jit(mutable="parameters")
  def sgd_step(model, x):
    value, grads = spx.value_and_grad(lambda m: loss(m(x)))(model)
    current, _ = params.partition_state(model, spx.tree_state(model))
    spx.update(model, sgd(current, grads))
    return value

  @spx.jit(mutable="parameters")
  def optax_step(model, opt, x):
    value, grads = spx.value_and_grad(lambda m: loss(m(x)))(model)
    return value, opt.apply_eager(model, grads)

  if kind == "sgd":
    return lambda: sgd_step(model, x)
  box = [Optimizer.create(model, tx())]

  def call():
    value, box[0] = optax_step(model, box[0], x)
    return value

  return call
