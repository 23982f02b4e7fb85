"""The dispatch benchmark's variants: the same tiny training step built by raw JAX,
flax.linen, flax.nnx, equinox, SpectraX and statefulremat, each with a hand-written SGD
update (``sgd``) and with ``optax.adam`` (``optax``). ``benchmarks/dispatch.py`` times
them.

A variant is ``build(cfg, kind, x) -> call``: ``call()`` runs one compiled step and
returns its loss; ``VARIANTS`` names them all, ``models(quick)`` gives the two model
configurations and ``n_variables`` counts a configuration's Variables. SpectraX
(``spectrax-lib``, not in any extra: ``pip install --no-deps spectrax-lib==0.1.4``, as
its own pins would downgrade protobuf and fsspec under orbax-checkpoint) is optional: ``unavailable()`` names the
variants whose library is not installed, and the benchmark skips them with that note.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import statefulremat as sr

LR = 0.1
SR_VARIANT = "sr.jit"


def _tx():
  return optax.adam(1e-3)


def _loss(out):
  return jnp.mean(out**2)


# -- the models: one construction per library, same computation ---------------------


def _raw_params(blocks: int, width: int, norm: bool):
  keys = iter(jax.random.split(jax.random.key(0), 2 * blocks))
  dense = lambda: {
    "kernel": jax.random.normal(next(keys), (width, width)) / width**0.5,
    "bias": jnp.zeros(width),
  }
  ln = lambda: {"scale": jnp.ones(width), "bias": jnp.zeros(width)}
  if not norm:
    return [dense() for _ in range(blocks)]
  return [{"l1": dense(), "n1": ln(), "l2": dense(), "n2": ln()} for _ in range(blocks)]


def _layer_norm(p, x):
  # The same operations as sr.nn.LayerNorm / nnx.LayerNorm (fast variance), so that
  # every variant runs the same computation.
  mean = x.mean(-1, keepdims=True)
  var = jnp.maximum(0.0, jnp.square(x).mean(-1, keepdims=True) - jnp.square(mean))
  return (x - mean) * (jax.lax.rsqrt(var + 1e-6) * p["scale"]) + p["bias"]


def _raw_apply(params, x, norm: bool):
  for p in params:
    if norm:
      h = _layer_norm(p["n1"], x @ p["l1"]["kernel"] + p["l1"]["bias"])
      x = x + _layer_norm(p["n2"], jnp.tanh(h) @ p["l2"]["kernel"] + p["l2"]["bias"])
    else:
      x = jnp.tanh(x @ p["kernel"] + p["bias"])
  return x


class _SrBlock(sr.Module):
  def __init__(self, width, *, rngs):
    self.l1 = sr.nn.Linear(width, width, rngs=rngs)
    self.n1 = sr.nn.LayerNorm(width, rngs=rngs)
    self.l2 = sr.nn.Linear(width, width, rngs=rngs)
    self.n2 = sr.nn.LayerNorm(width, rngs=rngs)

  def __call__(self, x):
    return x + self.n2(self.l2(jnp.tanh(self.n1(self.l1(x)))))


class _SrModel(sr.Module):
  def __init__(self, blocks, width, norm, *, rngs):
    self.layers = [
      _SrBlock(width, rngs=rngs) if norm else sr.nn.Linear(width, width, rngs=rngs)
      for _ in range(blocks)
    ]
    self.norm = norm

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x) if self.norm else jnp.tanh(layer(x))
    return x


def _nnx_model(blocks, width, norm):
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(width, width, rngs=rngs)
      self.n1 = nnx.LayerNorm(width, rngs=rngs)
      self.l2 = nnx.Linear(width, width, rngs=rngs)
      self.n2 = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x):
      return x + self.n2(self.l2(jnp.tanh(self.n1(self.l1(x)))))

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List(
        [Block(rngs) if norm else nnx.Linear(width, width, rngs=rngs) for _ in range(blocks)]
      )

    def __call__(self, x):
      for layer in self.layers:
        x = layer(x) if norm else jnp.tanh(layer(x))
      return x

  return Model(nnx.Rngs(0))


def _linen_model(blocks, width, norm):
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(blocks):
        if norm:
          h = nn.LayerNorm(epsilon=1e-6)(nn.Dense(width)(x))
          x = x + nn.LayerNorm(epsilon=1e-6)(nn.Dense(width)(jnp.tanh(h)))
        else:
          x = jnp.tanh(nn.Dense(width)(x))
      return x

  return Model()


def _eqx_model(blocks, width, norm):
  keys = iter(jax.random.split(jax.random.key(0), 2 * blocks))

  class Block(eqx.Module):
    l1: eqx.nn.Linear
    n1: eqx.nn.LayerNorm
    l2: eqx.nn.Linear
    n2: eqx.nn.LayerNorm

    def __call__(self, x):  # one example; the model vmaps over the batch
      return x + self.n2(self.l2(jnp.tanh(self.n1(self.l1(x)))))

  class Model(eqx.Module):
    layers: list

    def __call__(self, x):
      def one(x):
        for layer in self.layers:
          x = layer(x) if norm else jnp.tanh(layer(x))
        return x

      return jax.vmap(one)(x)

  def linear():
    return eqx.nn.Linear(width, width, key=next(keys))

  make = (
    (
      lambda: Block(
        linear(), eqx.nn.LayerNorm(width, eps=1e-6), linear(), eqx.nn.LayerNorm(width, eps=1e-6)
      )
    )
    if norm
    else linear
  )
  return Model([make() for _ in range(blocks)])


# -- the steps: each builder returns a zero-argument call that runs one step --------


def _sgd(params, grads):
  return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def _pytree_step(params, loss_fn, kind, x):
  """``call()`` of a ``jax.jit`` step on a params pytree: raw JAX's and linen's loop."""
  tx = _tx()

  @jax.jit
  def sgd_step(params, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    return _sgd(params, grads), loss

  @jax.jit
  def optax_step(params, opt_state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return _boxed_steps(kind, [params, tx.init(params)], sgd_step, optax_step, x)


def _boxed_steps(kind, box, sgd_step, optax_step, x):
  """A step closure for functional steps: ``box`` holds [params, optimizer state]."""

  def call():
    if kind == "sgd":
      box[0], loss = sgd_step(box[0], x)
    else:
      box[0], box[1], loss = optax_step(box[0], box[1], x)
    return loss

  return call


def raw_jit(cfg, kind, x):
  return _pytree_step(
    _raw_params(**cfg), lambda params, x: _loss(_raw_apply(params, x, cfg["norm"])), kind, x
  )


def linen_apply(cfg, kind, x):
  model = _linen_model(**cfg)
  params = model.init(jax.random.key(0), x)["params"]
  return _pytree_step(params, lambda params, x: _loss(model.apply({"params": params}, x)), kind, x)


def _nnx_steps(graph: bool | None):
  def sgd_step(model, x):
    loss, grads = nnx.value_and_grad(lambda m: _loss(m(x)), graph=graph)(model)
    if not isinstance(grads, nnx.State):  # tree mode: the gradient is a module
      grads = nnx.state(grads, nnx.Param)
    nnx.update(model, _sgd(nnx.state(model, nnx.Param), grads))
    return loss

  def optax_step(model, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: _loss(m(x)), graph=graph)(model)
    opt.update(model, grads)
    return loss

  return sgd_step, optax_step


def _nnx_setup(cfg, kind, graph=None):
  model = _nnx_model(**cfg)
  opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param, graph=graph)
  sgd_step, optax_step = _nnx_steps(graph)
  fn, bound = (sgd_step, (model,)) if kind == "sgd" else (optax_step, (model, opt))
  return fn, bound


def nnx_jit(cfg, kind, x):
  fn, bound = _nnx_setup(cfg, kind)
  step = nnx.jit(fn)
  return lambda: step(*bound, x)


def nnx_cached_partial(cfg, kind, x):
  fn, bound = _nnx_setup(cfg, kind)
  with nnx.set_graph_mode(True), nnx.set_graph_updates(True):
    step = nnx.cached_partial(nnx.jit(fn, graph=True, graph_updates=True), *bound)
  return lambda: step(x)


def nnx_jit_partial(cfg, kind, x):
  fn, bound = _nnx_setup(cfg, kind, graph=False)
  step = nnx.jit_partial(fn, *bound, graph=False)
  return lambda: step(x)


def eqx_filter_jit(cfg, kind, x):
  model = _eqx_model(**cfg)
  tx = _tx()
  loss_fn = lambda model, x: _loss(model(x))

  @eqx.filter_jit
  def sgd_step(model, x):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads)), loss

  @eqx.filter_jit
  def optax_step(model, opt_state, x):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss

  return _boxed_steps(
    kind, [model, tx.init(eqx.filter(model, eqx.is_array))], sgd_step, optax_step, x
  )


def spx_jit(cfg, kind, x):
  # Imported here: SpectraX is optional (not in the dev extra).
  from . import dispatch_spectrax

  return dispatch_spectrax.build(cfg, kind, x, loss=_loss, sgd=_sgd, tx=_tx)


def sr_jit(cfg, kind, x):
  model = _SrModel(**cfg, rngs=sr.Rngs(0))

  @sr.jit
  def sgd_step(model, x):
    loss, grads = sr.value_and_grad(lambda m: _loss(m(x)))(model)
    sr.update(model, _sgd(sr.state(model, sr.Param), grads))
    return loss

  @sr.jit
  def optax_step(model, opt, x):
    loss, grads = sr.value_and_grad(lambda m: _loss(m(x)))(model)
    opt.update(grads)
    return loss

  if kind == "sgd":
    return lambda: sgd_step(model, x)
  opt = sr.Optimizer(model, _tx())
  return lambda: optax_step(model, opt, x)


VARIANTS: dict[str, Callable] = {
  "raw jax.jit": raw_jit,
  "linen apply in jax.jit": linen_apply,
  "nnx.jit": nnx_jit,
  "nnx.cached_partial": nnx_cached_partial,
  "nnx.jit_partial(graph=False)": nnx_jit_partial,
  "eqx.filter_jit": eqx_filter_jit,
  "spx.jit (SpectraX)": spx_jit,
  SR_VARIANT: sr_jit,
}
KINDS = ("sgd", "optax")
# Variants whose library the dev extra does not install: (module, distribution).
OPTIONAL = {"spx.jit (SpectraX)": ("spectrax", "spectrax-lib")}


def unavailable() -> dict[str, str]:
  """The optional variants whose library is not installed, each with a note saying so."""
  return {
    name: f"skipped: {module} is not installed (pip install --no-deps {dist})"
    for name, (module, dist) in OPTIONAL.items()
    if importlib.util.find_spec(module) is None
  }


def models(quick: bool) -> dict[str, dict]:
  # Quick mode only checks that every variant runs: small graphs compile in seconds.
  return {
    "tiny": {"blocks": 2 if quick else 4, "width": 8, "norm": False},
    "wide": {"blocks": 1 if quick else 48, "width": 8, "norm": True},
  }


def n_variables(cfg) -> int:
  """How many Variables the model of configuration ``cfg`` has."""
  return len(sr.state(_SrModel(**cfg, rngs=sr.Rngs(0))).flat())
