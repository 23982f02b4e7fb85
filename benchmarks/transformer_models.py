"""The transformer family's model: a stack of pre-LN GPT blocks, in each library.

One block, the same computation in every library::

    x = x + dropout(attn(ln1(x), causal))                  # multi-head self-attention
    x = x + dropout(fc2(dropout(gelu(fc1(ln2(x))))))       # MLP, hidden 4 d

(``sr.nn.MLP``'s placement of its two dropouts; attention weights are not dropped.)
The loss is ``mean(stack(x) ** 2)``; every benchmark differentiates it with respect
to the parameters, with dropout on. Constructions:

* ``scan_remat``: one scan over the stacked layers, each under ``jax.checkpoint``;
* ``remat_scan``: two nested scans, checkpointed at every level (lengths as even as
  N allows: (4, 4) for 16, (8, 8) for 64);
* ``remat_scan_auto``: statefulremat's ``lengths="auto"``; raw JAX runs the plan it
  picks (lengths and innermost policy) by hand, the others have no planner.

``build(library, construction, cfg) -> Case`` as in ``benchmarks/models.py``:
``Case.new()`` makes a fresh jitted gradient function, ``Case.args`` its arguments.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import statefulremat as sr

from .models import Case, NotApplicable, lengths_for

CONSTRUCTIONS = ("scan_remat", "remat_scan", "remat_scan_auto")
LIBRARIES = ("raw", "linen", "nnx", "sr")


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of one benchmark point: N layers of width d, h heads, (batch, seq, d) in."""

  n: int
  d: int = 256
  heads: int = 4
  seq: int = 256
  batch: int = 8
  dropout: float = 0.1

  @property
  def lengths(self) -> tuple[int, ...]:
    return lengths_for(self.n, 2)


def fill(abstract, seed: int = 0, kernel_std: float = 0.02):
  """Host-drawn values for an abstract tree: kernels N(0, kernel_std^2), LayerNorm scales
  ones, RNG keys fresh, everything else zeros. Only shapes matter to memory and time;
  every library gets the same distribution."""
  rng = np.random.default_rng(seed)

  def one(path, s):
    name = jax.tree_util.keystr(path)
    if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
      return jax.random.split(jax.random.key(int(rng.integers(2**31))), s.shape)
    if "kernel" in name:
      value = (kernel_std * rng.standard_normal(s.shape)).astype(s.dtype)
    elif "scale" in name:
      value = np.ones(s.shape, s.dtype)
    else:
      value = np.zeros(s.shape, s.dtype)
    return jax.device_put(value)

  return jax.tree_util.tree_map_with_path(one, abstract)


def inputs(cfg: Config):
  return jax.device_put(
    np.random.default_rng(1).standard_normal((cfg.batch, cfg.seq, cfg.d)).astype(np.float32)
  )


def loss_of(y):
  return jnp.mean(y**2)


# --- raw JAX -------------------------------------------------------------------------


def raw_abstract(cfg: Config) -> dict:
  """One dict of stacked parameter shapes, leading axis N."""
  n, d, h = cfg.n, cfg.d, cfg.heads
  f = lambda *shape: jax.ShapeDtypeStruct((n,) + shape, jnp.float32)
  return {
    "ln1": {"scale": f(d), "bias": f(d)},
    "ln2": {"scale": f(d), "bias": f(d)},
    **{
      name: {"kernel": f(d, h, d // h), "bias": f(h, d // h)} for name in ("query", "key", "value")
    },
    "out": {"kernel": f(h, d // h, d), "bias": f(d)},
    "fc1": {"kernel": f(d, 4 * d), "bias": f(4 * d)},
    "fc2": {"kernel": f(4 * d, d), "bias": f(d)},
  }


def _b(v):
  """``v`` with two leading axes for (batch, seq): the tests raise on rank promotion."""
  return v[None, None]


def _layer_norm(x, p, eps=1e-6):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.maximum(jnp.mean(x * x, -1, keepdims=True) - mean * mean, 0.0)
  return (x - mean) * jax.lax.rsqrt(var + eps) * _b(p["scale"]) + _b(p["bias"])


def _dropout(x, key, rate):
  if rate == 0.0 or key is None:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


def _attention(x, p):
  q, k, v = (
    jnp.einsum("bsd,dhk->bshk", x, p[n]["kernel"]) + _b(p[n]["bias"])
    for n in ("query", "key", "value")
  )
  q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  w = jnp.einsum("bqhk,bshk->bhqs", q, k)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones(w.shape[-2:], w.dtype)), w.shape)
  w = jax.nn.softmax(jnp.where(causal.astype(bool), w, jnp.finfo(w.dtype).min))
  o = jnp.einsum("bhqs,bshk->bqhk", w, v)
  return jnp.einsum("bqhk,hkd->bqd", o, p["out"]["kernel"]) + _b(p["out"]["bias"])


def raw_block(x, p, key, rate):
  """One block; ``key`` None (or ``rate`` 0) runs it without dropout."""
  keys = (None,) * 3 if key is None else jax.random.split(key, 3)
  x = x + _dropout(_attention(_layer_norm(x, p["ln1"]), p), keys[0], rate)
  h = jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["fc1"]["kernel"] + _b(p["fc1"]["bias"]))
  h = _dropout(h, keys[1], rate)
  return x + _dropout(h @ p["fc2"]["kernel"] + _b(p["fc2"]["bias"]), keys[2], rate)


def raw_forward(construction, params, x, keys, rate, lengths=None, policy=None):
  """The stack: ``keys`` (N,) per-layer dropout keys, or None for no dropout."""
  xs = (params, keys)
  step = lambda h, pk: (raw_block(h, pk[0], pk[1], rate), None)
  if construction == "scan_remat":
    return jax.lax.scan(jax.checkpoint(step, prevent_cse=False), x, xs)[0]
  folded = jax.tree.map(lambda a: a.reshape(tuple(lengths) + a.shape[1:]), xs)

  def level(i, h, xs):
    if i == len(lengths):
      return step(h, xs)
    inner = lambda h, xs: level(i + 1, h, xs)
    pol = policy if i == len(lengths) - 1 else None
    return jax.lax.scan(jax.checkpoint(inner, prevent_cse=False, policy=pol), h, xs)

  return level(0, x, folded)[0]


def _build_raw(construction, cfg, plan):
  params = fill(raw_abstract(cfg))
  lengths, policy = (plan.lengths, plan.policy) if plan else (cfg.lengths, None)
  if plan is not None and int(np.prod(lengths)) != cfg.n:
    raise NotApplicable(f"the plan {lengths} is ragged for N={cfg.n}; not written by hand")
  args = (params, inputs(cfg), jax.random.key(2))

  def new():
    def loss(params, x, key):
      keys = jax.random.split(key, cfg.n)
      return loss_of(raw_forward(construction, params, x, keys, cfg.dropout, lengths, policy))

    return jax.jit(jax.grad(loss))

  return Case(new, args)


# --- flax.linen ----------------------------------------------------------------------


class LinenBlock(nn.Module):
  d: int
  heads: int
  rate: float

  @nn.compact
  def __call__(self, x):
    drop = nn.Dropout(self.rate, deterministic=False)
    mask = nn.make_causal_mask(x[..., 0])
    a = nn.MultiHeadDotProductAttention(self.heads, qkv_features=self.d)(
      nn.LayerNorm(epsilon=1e-6)(x), mask=mask
    )
    x = x + drop(a)
    h = drop(jax.nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm(epsilon=1e-6)(x))))
    return x + drop(nn.Dense(self.d)(h))


class LinenScanBlock(LinenBlock):
  def __call__(self, x, _):
    return super().__call__(x), None


class LinenStack(nn.Module):
  cfg: Config
  construction: str

  @nn.compact
  def __call__(self, x):
    c = self.cfg
    if self.construction == "scan_remat":
      body = nn.remat(LinenScanBlock, prevent_cse=False)
      stack = nn.scan(
        body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=c.n
      )
      return stack(c.d, c.heads, c.dropout, name="stack")(x, None)[0]
    stack = nn.remat_scan(LinenBlock, lengths=c.lengths)
    return stack(c.d, c.heads, c.dropout, name="stack")(x)


def _build_linen(construction, cfg, plan):
  if plan is not None:
    raise NotApplicable("flax.linen has no remat planner")
  model = LinenStack(cfg, construction)
  x = inputs(cfg)
  params = fill(
    jax.eval_shape(
      lambda: model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    )["params"]
  )

  def new():
    model = LinenStack(cfg, construction)

    def loss(params, x, key):
      return loss_of(model.apply({"params": params}, x, rngs={"dropout": key}))

    return jax.jit(jax.grad(loss))

  return Case(new, (params, x, jax.random.key(2)))


# --- flax.nnx ------------------------------------------------------------------------


class NnxBlock(nnx.Module):
  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    d = cfg.d
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(cfg.heads, d, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
    self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)
    self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

  def __call__(self, x):
    x = x + self.drop(self.attn(self.ln1(x), is_causal=True))
    h = self.drop(jax.nn.gelu(self.fc1(self.ln2(x))))
    return x + self.drop(self.fc2(h))


def _build_nnx(construction, cfg, plan):
  if plan is not None:
    raise NotApplicable("flax.nnx has no remat planner")
  from .model_nnx import remat_scan_forward, scan_forward

  def make():  # the docs' scan-over-layers: split_rngs + vmap
    @nnx.split_rngs(splits=cfg.n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return NnxBlock(cfg, rngs=rngs)

    return create(nnx.Rngs(params=0, dropout=1))

  graphdef, state = nnx.split(nnx.eval_shape(make))
  model = nnx.merge(graphdef, fill(state))

  def forward(model, x):
    if construction == "scan_remat":
      return scan_forward(model, x, remat=True)
    return remat_scan_forward(model, x, cfg.lengths)

  def new():
    def loss(model, x):
      return loss_of(forward(model, x))

    return nnx.jit(lambda model, x: nnx.grad(loss)(model, x))

  return Case(new, (model, inputs(cfg)))


# --- statefulremat -------------------------------------------------------------------


class SrBlock(sr.Module):
  def __init__(self, cfg: Config, *, rngs: sr.Rngs):
    d = cfg.d
    self.ln1 = sr.nn.LayerNorm(d, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(cfg.heads, d, rngs=rngs)
    self.drop = sr.nn.Dropout(cfg.dropout, rngs=rngs)
    self.ln2 = sr.nn.LayerNorm(d, rngs=rngs)
    self.mlp = sr.nn.MLP(d, 4 * d, dropout_rate=cfg.dropout, rngs=rngs)

  def __call__(self, x):
    x = x + self.drop(self.attn(self.ln1(x), is_causal=True))
    return x + self.mlp(self.ln2(x))


class SrScanBlock(SrBlock):
  def __call__(self, x):
    return super().__call__(x), None


def sr_stack_class(construction: str, cfg: Config, plan=None) -> type:
  """The stacked class (class forms: every variable stacked, every stream split)."""
  if construction == "scan_remat":
    return sr.scan(
      sr.remat(SrScanBlock, prevent_cse=False),
      length=cfg.n,
      variable_axes={True: 0},
      split_rngs={True: True},
    )
  if construction == "remat_scan":
    return sr.remat_scan(SrBlock, lengths=cfg.lengths)
  return sr.remat_scan(SrBlock, lengths="auto", length=cfg.n)


def sr_stack(construction: str, cfg: Config, kernel_std: float = 0.02):
  """The stack, built abstractly and filled on the host."""
  cls = sr_stack_class(construction, cfg)
  graphdefs = []

  def abstract():
    graphdef, state = sr.split(cls(cfg, rngs=sr.Rngs(params=0, dropout=1)))
    graphdefs.append(graphdef)
    return state

  state = jax.eval_shape(abstract)
  return sr.merge(graphdefs[0], fill(state, kernel_std=kernel_std))


def sr_params_as_raw(stack) -> dict:
  """A statefulremat stack's Params in raw JAX's layout (``raw_abstract``'s tree)."""
  params = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(sr.state(stack, sr.Param)):
    *names, last = jax.tree_util.keystr(path).strip(".").split(".")
    names = [n for n in names if n not in ("attn", "mlp")]
    params.setdefault(names[-1], {})[last] = leaf
  return params


def sr_plan(cfg: Config):
  """What ``lengths="auto"`` picks for this stack and carry (no budget)."""
  stack = sr.eval_shape(
    lambda: sr.vmap(SrBlock, axis_size=cfg.n)(cfg, rngs=sr.Rngs(params=0, dropout=1))
  )
  carry = jax.ShapeDtypeStruct((cfg.batch, cfg.seq, cfg.d), jnp.float32)
  return sr.plan_remat(stack, carry)


def _build_sr(construction, cfg, plan):
  model = sr_stack(construction, cfg)
  x = inputs(cfg)

  def new():
    def loss(model, x):
      y = model(x)
      return loss_of(y[0] if isinstance(y, tuple) else y)

    return sr.jit(lambda model, x: sr.grad(loss)(model, x))

  return Case(new, (model, x))


_BUILDERS = {"raw": _build_raw, "linen": _build_linen, "nnx": _build_nnx, "sr": _build_sr}


def build(library: str, construction: str, cfg: Config, plan=None) -> Case:
  """``plan`` (``sr_plan(cfg)``) is what the raw JAX ``remat_scan_auto`` runs."""
  if construction != "remat_scan_auto":
    plan = None
  elif plan is None:
    raise ValueError("remat_scan_auto needs the plan")
  return _BUILDERS[library](construction, cfg, plan)
