# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 8. Porting a public flax.nnx Llama
#
# Most models arrive as somebody else's code. This tutorial takes a Llama written in
# flax.nnx by other people, builds it, and ports it to statefulremat: the same blocks,
# but the decoder layers become ONE {py:func}`sr.remat_scan <statefulremat.remat_scan>` stack (one
# compiled body, memory planned per call) instead of a Python list of layers. Its weights move over
# by name with {py:func}`sr.interop.from_nnx <statefulremat.interop.from_nnx>` and a two-line
# `rename`; then we check that the port computes the same logits and gradients, look at the remat
# plan, train it a little on bytes of the Python standard library, decode greedily with a key/value
# cache, and write the trained weights back into the nnx model.
#
# The model is jaxgarden's Llama (https://github.com/ml-gde/jaxgarden, file
# `jaxgarden/models/llama.py`, at commit `0ab3a32b1c03560a0c8e77762f0eace3b860707e`,
# 2025-06-09). The tutorial runs without a network, so the next cell carries its
# modules.

# %% [markdown]
# One setting first. Their code rounds some intermediate results to `bfloat16` (see
# below). Under `jit`, XLA by default may skip such a round trip (float32 to bfloat16
# and back: "excess precision"), and whether it does depends on how the program was
# cut into fused kernels: theirs is one `nnx.jit` per method, ours a scan over
# layers. To compare the two at float32 precision we ask XLA to round wherever the
# code says, for both, before JAX starts (in a notebook: run this cell first, as
# XLA reads its flags once).

# %%
import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
).strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import statefulremat as sr  # noqa: E402

QUICK = os.environ.get("SR_TUTORIAL_QUICK") == "1"
OUT = pathlib.Path(os.environ.get("SR_TUTORIAL_OUT", "tutorial_out"))
OUT.mkdir(parents=True, exist_ok=True)
SEQ, BATCH, STEPS, DECODE = (32, 4, 5, 8) if QUICK else (128, 16, 100, 48)
started = time.perf_counter()

# %% [markdown]
# ## 1. The model as published
#
# What follows is their code, kept as they wrote it (the numerics untouched, including
# the `bfloat16` casts) so that the port is checked against the real thing and not a
# tidied copy. Condensed: docstrings are gone; `LlamaConfig` lost its `BaseConfig`
# parent and `LlamaForCausalLM` its `BaseModel` / `GenerationMixin` parents (loading
# Hugging Face weights, sampling loops; the forward pass does not use them); the
# `print(input_ids.shape)` left in its `__call__` and the unused `multiple_of` field
# are dropped. One line had to change: flax 0.12 refuses a plain Python list of
# modules as an attribute (jaxgarden was written for flax 0.10), so `self.layers` is
# an `nnx.List` of the same blocks. Its state paths are the same either way:
# `layers.0.attention.q_proj.kernel`, ... The `# pyright: ignore` comments are ours:
# flax's type hints do not say that a method under `@nnx.jit()` binds `self`, and
# their `attention_mask` defaults to `None` although `jnp.where` needs one.


# %%
@dataclasses.dataclass
class LlamaConfig:
  dim: int = 2048
  n_layers: int = 16
  n_heads: int = 32
  n_kv_heads: int = 8
  head_dim: int = 64
  intermediate_size: int = 14336
  vocab_size: int = 128256
  norm_eps: float = 1e-05
  rope_theta: float = 500000.0


class LlamaRMSNorm(nnx.Module):
  def __init__(self, dim: int, *, norm_eps: float = 1e-05, rngs: nnx.Rngs):
    super().__init__()
    self.norm_weights = nnx.Param(jnp.zeros((dim,), dtype=jnp.bfloat16))
    self.norm_eps = norm_eps

  @nnx.jit()
  def __call__(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.astype(jnp.float32)
    squared_mean = jnp.mean(jnp.square(hidden_states), axis=-1, keepdims=True)
    hidden_states = hidden_states * jnp.reciprocal(jnp.sqrt(squared_mean + self.norm_eps))
    return self.norm_weights * hidden_states.astype(input_dtype)


class LlamaRotaryEmbedding(nnx.Module):
  def __init__(self, dim: int, *, base: float = 10000.0, rngs: nnx.Rngs):
    super().__init__()
    self.dim = dim
    self.base = base

  @nnx.jit()
  def __call__(self, position_ids):
    inv_freq = 1.0 / (self.base ** (jnp.arange(0, self.dim, 2, dtype=jnp.float32) / self.dim))
    inv_freq_expanded = jnp.expand_dims(inv_freq, axis=(0, 1))
    position_ids_expanded = jnp.expand_dims(position_ids, axis=(0, 2)).astype(jnp.float32)
    freqs = jnp.einsum("bij,bjk->bijk", position_ids_expanded, inv_freq_expanded)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(emb).squeeze(2).astype(jnp.bfloat16)
    sin = jnp.sin(emb).squeeze(2).astype(jnp.bfloat16)
    return cos, sin


class LlamaAttention(nnx.Module):
  def __init__(self, layer_idx, dim, n_heads, n_kv_heads, head_dim, rope_theta, *, rngs):
    self.q_proj = nnx.Linear(
      dim, n_heads * head_dim, use_bias=False, rngs=rngs, param_dtype=jnp.bfloat16
    )
    self.k_proj = nnx.Linear(
      dim, n_kv_heads * head_dim, use_bias=False, rngs=rngs, param_dtype=jnp.bfloat16
    )
    self.v_proj = nnx.Linear(
      dim, n_kv_heads * head_dim, use_bias=False, rngs=rngs, param_dtype=jnp.bfloat16
    )
    self.o_proj = nnx.Linear(
      n_heads * head_dim, dim, use_bias=False, rngs=rngs, param_dtype=jnp.bfloat16
    )
    self.rotary_emb = LlamaRotaryEmbedding(head_dim, base=rope_theta, rngs=rngs)
    self.head_dim = head_dim
    self.n_heads = n_heads
    self.n_kv_heads = n_kv_heads

  def apply_rotary_pos_emb(self, q, k, cos, sin, unsqueeze_dim=1):
    cos = jnp.expand_dims(cos, axis=unsqueeze_dim)
    sin = jnp.expand_dims(sin, axis=unsqueeze_dim)
    q_embed = (q * cos) + (self.rotate_half(q) * sin)
    k_embed = (k * cos) + (self.rotate_half(k) * sin)
    return q_embed, k_embed

  @staticmethod
  def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return jnp.concatenate([-x2, x1], axis=-1)

  @staticmethod
  def repeat_kv(hidden_states, n_repeat):
    batch, n_kv_heads, seq_len, head_dim = hidden_states.shape
    if n_repeat == 1:
      return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].repeat(n_repeat, axis=2)
    return hidden_states.reshape(batch, n_kv_heads * n_repeat, seq_len, head_dim)

  @nnx.jit()
  def __call__(self, x, position_ids, attention_mask):
    batch_size, seq_len, _ = x.shape
    query = (
      self.q_proj(x)
      .reshape(batch_size, seq_len, self.n_heads, self.head_dim)
      .transpose((0, 2, 1, 3))
    )
    key = (
      self.k_proj(x)
      .reshape(batch_size, seq_len, self.n_kv_heads, self.head_dim)
      .transpose((0, 2, 1, 3))
    )
    value = (
      self.v_proj(x)
      .reshape(batch_size, seq_len, self.n_kv_heads, self.head_dim)
      .transpose((0, 2, 1, 3))
    )
    # Assuming batch_size=1
    cos, sin = self.rotary_emb(position_ids[0])  # pyright: ignore[reportCallIssue]  # nnx.jit method
    query, key = self.apply_rotary_pos_emb(query, key, cos, sin)
    key = self.repeat_kv(key, self.n_heads // self.n_kv_heads)
    value = self.repeat_kv(value, self.n_heads // self.n_kv_heads)
    attn_weights = jnp.matmul(query, jnp.transpose(key, (0, 1, 3, 2)))
    attn_weights = (attn_weights.astype(jnp.float32) / jnp.sqrt(self.head_dim)).astype(jnp.bfloat16)
    attn_weights = attn_weights + attention_mask
    attn_weights = jax.nn.softmax(attn_weights.astype(jnp.float32), axis=-1).astype(jnp.bfloat16)
    attn_output = (
      jnp.matmul(attn_weights, value).transpose((0, 2, 1, 3)).reshape(batch_size, seq_len, -1)
    )
    output = self.o_proj(attn_output)
    return output


class LlamaMLP(nnx.Module):
  def __init__(self, layer_idx, dim, intermediate_size, *, rngs):
    self.gate_proj = nnx.Linear(
      dim, intermediate_size, use_bias=False, rngs=rngs, param_dtype=jnp.bfloat16
    )
    self.up_proj = nnx.Linear(
      dim, intermediate_size, use_bias=False, rngs=rngs, param_dtype=jnp.bfloat16
    )
    self.down_proj = nnx.Linear(
      intermediate_size, dim, use_bias=False, rngs=rngs, param_dtype=jnp.bfloat16
    )

  @nnx.jit()
  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaTransformerBlock(nnx.Module):
  def __init__(
    self,
    layer_idx,
    dim,
    n_heads,
    n_kv_heads,
    head_dim,
    rope_theta,
    intermediate_size,
    *,
    norm_eps=1e-05,
    rngs,
  ):
    self.input_layernorm = LlamaRMSNorm(dim=dim, norm_eps=norm_eps, rngs=rngs)
    self.attention = LlamaAttention(
      layer_idx=layer_idx,
      dim=dim,
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      head_dim=head_dim,
      rope_theta=rope_theta,
      rngs=rngs,
    )
    self.post_attention_layernorm = LlamaRMSNorm(dim=dim, norm_eps=norm_eps, rngs=rngs)
    self.mlp = LlamaMLP(
      layer_idx=layer_idx, dim=dim, intermediate_size=intermediate_size, rngs=rngs
    )

  @nnx.jit()
  def __call__(self, x, position_ids, attention_mask):
    residual = x
    x = self.input_layernorm(x)  # pyright: ignore[reportCallIssue]  # nnx.jit method
    x = self.attention(x, position_ids, attention_mask)  # pyright: ignore[reportCallIssue]  # nnx.jit method
    x = residual + x
    residual = x
    x = self.post_attention_layernorm(x)  # pyright: ignore[reportCallIssue]  # nnx.jit method
    x = self.mlp(x)  # pyright: ignore[reportCallIssue]  # nnx.jit method
    x = residual + x
    return x


class LlamaForCausalLM(nnx.Module):
  def __init__(self, config, *, dtype=None, param_dtype=jnp.float32, precision=None, rngs):
    self.token_embed = nnx.Embed(
      num_embeddings=config.vocab_size, features=config.dim, param_dtype=param_dtype, rngs=rngs
    )
    self.layers = nnx.List(
      [  # jaxgarden: a plain list (flax 0.10)
        LlamaTransformerBlock(
          layer_idx=idx,
          dim=config.dim,
          n_heads=config.n_heads,
          n_kv_heads=config.n_kv_heads,
          head_dim=config.head_dim,
          rope_theta=config.rope_theta,
          intermediate_size=config.intermediate_size,
          norm_eps=config.norm_eps,
          rngs=rngs,
        )
        for idx in range(config.n_layers)
      ]
    )
    self.lm_head = nnx.Linear(
      config.dim, config.vocab_size, use_bias=False, rngs=rngs, param_dtype=param_dtype
    )
    self.norm = LlamaRMSNorm(dim=config.dim, rngs=rngs)

  @nnx.jit()
  def __call__(self, input_ids, attention_mask=None, deterministic=True):
    assert input_ids.shape[0] == 1, "Only batch size 1 is supported"
    position_ids = jnp.arange(input_ids.shape[-1])[None, :].astype(jnp.int32)
    attention_mask = jnp.where(attention_mask, 0.0, -jnp.inf)[None, None, ...]  # pyright: ignore[reportArgumentType]  # callers pass one
    x = self.token_embed(input_ids)
    for layer in self.layers:
      x = layer(x, position_ids, attention_mask)  # pyright: ignore[reportCallIssue]  # nnx.jit method
    x = self.norm(x)  # pyright: ignore[reportCallIssue]  # nnx.jit method
    logits = self.lm_head(x)
    return logits


# %% [markdown]
# A small configuration: bytes as tokens (a vocabulary of 256), grouped-query
# attention with two query heads per key/value head. Their RMSNorm weights start at
# zero (their weights are meant to come from a Hugging Face checkpoint, and a zero
# norm would make every logit 0), so we draw those near 1; with that the nnx model's
# state is our stand-in for a trained checkpoint.
#
# Their `__call__` takes a boolean `attention_mask` that it broadcasts to `(batch,
# heads, q_len, kv_len)`; a causal model needs the lower-triangular one (what their
# `create_causal_mask` builds), and it handles one sequence at a time.

# %%
config = (
  LlamaConfig(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64, vocab_size=256
  )
  if QUICK
  else LlamaConfig(
    dim=128, n_layers=6, n_heads=8, n_kv_heads=2, head_dim=16, intermediate_size=384, vocab_size=256
  )
)
theirs = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
norm_keys = iter(jax.random.split(jax.random.key(1), 2 * config.n_layers + 1))
for path, param in nnx.iter_graph(theirs):
  if isinstance(param, nnx.Param) and path[-1] == "norm_weights":
    noise = 0.1 * jax.random.normal(next(norm_keys), param.shape)
    param[...] = (1.0 + noise).astype(param.dtype)

text = (pathlib.Path(os.__file__).parent / "functools.py").read_bytes()
tokens = jnp.asarray(np.frombuffer(text[:SEQ], np.uint8).astype(np.int32))[None]
causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
their_logits = theirs(tokens, causal)  # pyright: ignore[reportCallIssue]  # nnx.jit method
print(config)
print("their logits:", their_logits.shape, their_logits.dtype)
for path, param in nnx.to_flat_state(nnx.state(theirs, nnx.Param)):
  if path[0] != "layers" or path[1] == 0:  # layers 1, 2, ... repeat layer 0's names
    print(f"  {'.'.join(map(str, path)):47s} {param.dtype}{list(param.shape)}")

# %% [markdown]
# ## 2. The port
#
# Layer by layer, the mapping is direct: `nnx.Linear(..., use_bias=False)` is
# {py:class}`sr.nn.Linear(..., use_bias=False) <statefulremat.nn.Linear>` (same `kernel`, same
# `(in, out)` shape) and `nnx.Embed` is {py:class}`sr.nn.Embed <statefulremat.nn.Embed>`
# (`embedding`). The attributes keep their names (`input_layernorm`, `attention`, `q_proj`, ...), so
# the rename later has little to do.
#
# Their RMSNorm is what {py:class}`sr.nn.RMSNorm(dim, epsilon=1e-5) <statefulremat.nn.RMSNorm>`
# computes, up to one float32 rounding: it multiplies by `1 / sqrt(mean + eps)` where ours uses
# `rsqrt`. Ordinarily that is nothing, but here the bfloat16 roundings downstream (next
# paragraph) now and then turn such a last-bit difference into a whole bfloat16 step
# of an attention score, about 1e-3 in the logits. So the port writes their two lines
# as a small module. Its weight is named `scale`, as `sr.nn.RMSNorm`'s, so the
# checkpoint we load also loads into `sr.nn.RMSNorm` should we switch later.
#
# Attention needs a decision. Their rotary embedding is the "rotate half"
# convention (`q * cos + rotate_half(q) * sin`, pairs `(x[i], x[i + d/2])`), the one
# {py:func}`sr.nn.rope <statefulremat.nn.rope>` implements, so the weights would work with it. But
# their code rounds `cos` and `sin`, the scaled scores and the softmax probabilities to `bfloat16`,
# and `sr.nn.rope` /
# {py:class}`sr.nn.MultiHeadAttention(rope_base=..., num_kv_heads=...) <statefulremat.nn.MultiHeadAttention>`
# compute in float32; the latter also keeps nnx's `MultiHeadAttention` kernel shapes
# `(dim, heads, head_dim)`, not their `(dim, heads * head_dim)`. To reproduce their numbers we keep
# their attention arithmetic, casts included, in our own module (the cell in section 4 measures what
# `sr.nn.rope` would change).
#
# Our attention also gets what theirs lacks: a key/value cache for decoding one token
# at a time (section 7). `init_cache` makes `cached_key` / `cached_value` /
# `cache_index` ({py:class}`sr.Cache <statefulremat.Cache>` variables). On the stack,
# `model.blocks.attention` is all layers' attention at once: its kernels carry the layer axis in
# front, and {py:func}`sr.per_layer(self, variable) <statefulremat.per_layer>` makes one layer's
# {py:class}`Variable <statefulremat.Variable>` per layer of the stack `self` belongs to (on a
# single layer it returns the Variable as it is), so each layer gets its own cache.


# %%
class RMSNorm(sr.Module):
  """Their LlamaRMSNorm's arithmetic, with the weight named as sr.nn.RMSNorm's."""

  def __init__(self, dim, *, epsilon, rngs):
    self.scale = sr.Param(jnp.ones((dim,)))
    self.epsilon = epsilon

  def __call__(self, x):
    h = x.astype(jnp.float32)
    h = h * jnp.reciprocal(jnp.sqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.epsilon))
    return self.scale.value * h.astype(x.dtype)


def rope_like_theirs(x, positions, base):
  """Their rotary embedding of ``x`` ``[batch, heads, length, head_dim]``: the
  "rotate half" convention, with cos and sin rounded to bfloat16."""
  dim = x.shape[-1]
  inv_freq = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  freqs = positions.astype(jnp.float32)[:, None] * inv_freq
  angles = jnp.concatenate([freqs, freqs], axis=-1)
  cos, sin = jnp.cos(angles).astype(jnp.bfloat16), jnp.sin(angles).astype(jnp.bfloat16)
  x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Attention(sr.Module):
  def __init__(self, config, *, rngs):
    c = config
    linear = functools.partial(sr.nn.Linear, use_bias=False, rngs=rngs)
    self.q_proj = linear(c.dim, c.n_heads * c.head_dim)
    self.k_proj = linear(c.dim, c.n_kv_heads * c.head_dim)
    self.v_proj = linear(c.dim, c.n_kv_heads * c.head_dim)
    self.o_proj = linear(c.n_heads * c.head_dim, c.dim)
    self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
    self.rope_theta = c.rope_theta
    self.decode = False
    self.cached_key = self.cached_value = self.cache_index = None

  def init_cache(self, batch: int, max_length: int):
    """Key/value cache for ``max_length`` positions; calling it again starts over."""
    shape = (batch, self.n_kv_heads, max_length, self.head_dim)  # one layer's
    self.cached_key = sr.per_layer(self, sr.Cache(jnp.zeros(shape)))
    self.cached_value = sr.per_layer(self, sr.Cache(jnp.zeros(shape)))
    self.cache_index = sr.per_layer(self, sr.Cache(jnp.zeros((), jnp.int32)))

  def __call__(self, x, positions, mask):
    b, t, _ = x.shape

    def heads(y, n):  # [b, t, n * head_dim] -> [b, n, t, head_dim]
      return y.reshape(b, t, n, self.head_dim).transpose((0, 2, 1, 3))

    query = heads(self.q_proj(x), self.n_heads)
    key = heads(self.k_proj(x), self.n_kv_heads)
    value = heads(self.v_proj(x), self.n_kv_heads)
    if self.decode:  # one position: the cache says which, and what it may see
      assert self.cached_key is not None and self.cache_index is not None, "init_cache first"
      index = self.cache_index.value
      positions = index[None]
      mask = jnp.where(jnp.arange(self.cached_key.shape[-2]) <= index, 0.0, -jnp.inf)
    query = rope_like_theirs(query, positions, self.rope_theta)
    key = rope_like_theirs(key, positions, self.rope_theta)
    if self.decode:
      assert self.cached_key is not None and self.cached_value is not None
      assert self.cache_index is not None
      at = (0, 0, index, 0)
      key = self.cached_key.value = jax.lax.dynamic_update_slice(self.cached_key.value, key, at)
      value = self.cached_value.value = jax.lax.dynamic_update_slice(
        self.cached_value.value, value, at
      )
      self.cache_index.value = index + 1
    group = self.n_heads // self.n_kv_heads  # query heads per key/value head
    key, value = jnp.repeat(key, group, axis=1), jnp.repeat(value, group, axis=1)
    scores = query @ key.transpose((0, 1, 3, 2))
    scores = (scores / jnp.sqrt(self.head_dim)).astype(jnp.bfloat16) + mask
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(jnp.bfloat16)
    out = (probs @ value).transpose((0, 2, 1, 3)).reshape(b, t, -1)
    return self.o_proj(out)


class MLP(sr.Module):
  def __init__(self, config, *, rngs):
    linear = functools.partial(sr.nn.Linear, use_bias=False, rngs=rngs)
    self.gate_proj = linear(config.dim, config.intermediate_size)
    self.up_proj = linear(config.dim, config.intermediate_size)
    self.down_proj = linear(config.intermediate_size, config.dim)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(sr.Module):
  def __init__(self, config, *, rngs):
    norm = functools.partial(RMSNorm, config.dim, epsilon=config.norm_eps, rngs=rngs)
    self.input_layernorm = norm()
    self.attention = Attention(config, rngs=rngs)
    self.post_attention_layernorm = norm()
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, positions, mask):
    x = x + self.attention(self.input_layernorm(x), positions, mask)
    return x + self.mlp(self.post_attention_layernorm(x))


# %% [markdown]
# The decoder layers are one stack: `sr.remat_scan(Block, "auto", length=N)` is a
# class whose instance holds all `N` blocks, each variable with a leading layer axis
# of `N`, and whose call scans over them under rematerialisation, with the nesting
# planned when it traces (section 5). The arguments after the carry (`positions`,
# `mask`) go to every layer whole. Unlike theirs, our forward takes a batch, and
# `start`, the position of the first token (for decoding).

# %%
Blocks = sr.remat_scan(Block, "auto", length=config.n_layers)


class Llama(sr.Module):
  def __init__(self, config, *, rngs):
    self.token_embed = sr.nn.Embed(config.vocab_size, config.dim, rngs=rngs)
    self.blocks = Blocks(config, rngs=rngs)
    self.lm_head = sr.nn.Linear(config.dim, config.vocab_size, use_bias=False, rngs=rngs)
    self.norm = RMSNorm(config.dim, epsilon=config.norm_eps, rngs=rngs)

  def __call__(self, tokens, start=0):
    length = tokens.shape[-1]
    positions = start + jnp.arange(length)
    mask = jnp.where(jnp.tril(jnp.ones((length, length), bool)), 0.0, -jnp.inf)
    x = self.blocks(self.token_embed(tokens), positions, mask)
    return self.lm_head(self.norm(x))


model = Llama(config, rngs=sr.Rngs(0))
print(model.blocks.attention.q_proj.kernel.shape, "=", "(layers, dim, heads * head_dim)")

# %% [markdown]
# ## 3. Weights by name
#
# `from_nnx` pairs their variables with ours by dotted path, after `rename`. Theirs
# are `layers.3.attention.q_proj.kernel`, ...; ours are `blocks.attention.q_proj.kernel`
# with the layer axis in front, which also answers to `blocks.3.attention.q_proj.kernel`
# for its layer 3, so the list of layers fills the stack one slice each. Two rules do
# it: `layers.` becomes `blocks.`, and a trailing `norm_weights` becomes `scale`.
#
# The dtype needs one explicit step. Their blocks keep `bfloat16` parameters; ours are
# float32, which is what AdamW should update. `from_nnx` never casts silently (a
# dtype mismatch is an error), so we cast their state first. Every bfloat16 number is
# a float32 number, so the cast changes no value, and their forward already promotes
# each product to float32, so the cast model computes the same logits (checked
# below). `theirs32` is their model with that state: their code, float32 parameters,
# which we also need for comparing gradients.

# %%
RENAME = {r"^layers\.": "blocks.", r"\.norm_weights$": ".scale"}
checkpoint = nnx.state(theirs, nnx.Param)
checkpoint32 = jax.tree.map(lambda a: a.astype(jnp.float32), checkpoint)
theirs32 = nnx.merge(nnx.graphdef(theirs), checkpoint32)
sr.interop.from_nnx(model, checkpoint32, rename=RENAME)
print(
  "their layer 2 == our layer 2:",
  bool(
    jnp.array_equal(
      model.blocks.layer(2).mlp.up_proj.kernel.value,
      theirs.layers[2].mlp.up_proj.kernel[...].astype(jnp.float32),
    )
  ),
)

# %% [markdown]
# A rename that misses something does not half-load: `from_nnx` checks every
# variable first, and the error lists each one that found no partner, with the
# nearest names on the other side, and leaves the model as it was. Here the
# `norm_weights` rule is forgotten:

# %%
before = model.blocks.input_layernorm.scale.value
try:
  sr.interop.from_nnx(model, checkpoint32, rename={r"^layers\.": "blocks."})
except sr.StateMismatchError as err:
  print(err)
assert model.blocks.input_layernorm.scale.value is before  # unchanged

# %% [markdown]
# ## 4. Equality
#
# The same tokens through both: the decoder layers compute bit for bit what theirs
# do, and the logits agree to float32 rounding (the final norm and `lm_head` are
# compiled into different programs, which may sum in another order). Their bfloat16
# model gives the same logits as the float32-cast one, as promised above.

# %%
our_logits = model(tokens)
diff = float(jnp.abs(our_logits - their_logits).max())
print(f"max |ours - theirs| = {diff:.2e} (logits up to {float(jnp.abs(their_logits).max()):.1f})")
np.testing.assert_allclose(our_logits, their_logits, rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(theirs32(tokens, causal), their_logits, rtol=1e-6, atol=1e-6)

# %% [markdown]
# Gradients too: the next-token cross-entropy, differentiated by `nnx.grad` on their
# float32 model and by {py:func}`sr.grad <statefulremat.grad>` on ours, with respect to a few
# parameters (their layer list's entries are slices of our stacked gradients). Here float32
# precision is not on offer: the backward pass of `.astype(jnp.bfloat16)` hands back a bfloat16
# cotangent, so a float32 rounding difference anywhere in the backward pass can
# move a gradient entry by one bfloat16 step. They agree to within one bfloat16 step
# (`2 ** -8`) of the largest entry, where a wrong port (a transposed kernel, a
# swapped head order) is off by the gradient's own size.


# %%
def loss_theirs(m, tokens):
  logits = m(tokens, causal)[:, :-1]
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def loss_ours(m, tokens):
  logits = m(tokens)[:, :-1]
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


their_grads = nnx.grad(loss_theirs)(theirs32, tokens)
our_grads = sr.grad(loss_ours)(model, tokens)
last = config.n_layers - 1
pairs = {
  "token_embed.embedding": (
    their_grads["token_embed"]["embedding"],
    our_grads["token_embed"]["embedding"],
  ),
  "layers.0.attention.q_proj.kernel": (
    their_grads["layers"][0]["attention"]["q_proj"]["kernel"],
    our_grads["blocks"]["attention"]["q_proj"]["kernel"][0],
  ),
  f"layers.{last}.post_attention_layernorm.norm_weights": (
    their_grads["layers"][last]["post_attention_layernorm"]["norm_weights"],
    our_grads["blocks"]["post_attention_layernorm"]["scale"][last],
  ),
  "lm_head.kernel": (their_grads["lm_head"]["kernel"], our_grads["lm_head"]["kernel"]),
}
for name, (g_theirs, g_ours) in pairs.items():
  g_theirs, g_ours = np.asarray(g_theirs[...]), np.asarray(g_ours[...])
  scale = np.abs(g_theirs).max()
  print(
    f"{name:48s} max |ours - theirs| = {np.abs(g_ours - g_theirs).max():.1e} "
    f"(max |grad| {scale:.1e})"
  )
  np.testing.assert_allclose(g_ours, g_theirs, rtol=0, atol=2**-8 * scale)

# %% [markdown]
# What `sr.nn.rope` would have changed: it rotates in float32 (and takes its input as
# `[batch, length, heads, head_dim]`). On the same queries the two agree to about
# bfloat16's precision, not to float32's: fine for a model trained with it, not for
# reproducing this checkpoint's logits.

# %%
q = jax.random.normal(jax.random.key(2), (1, config.n_heads, SEQ, config.head_dim))
positions = jnp.arange(SEQ)
float32_rope = sr.nn.rope(q.transpose((0, 2, 1, 3)), positions, base=config.rope_theta).transpose(
  (0, 2, 1, 3)
)
print(
  "max |sr.nn.rope - theirs| on unit-normal queries:",
  f"{float(jnp.abs(float32_rope - rope_like_theirs(q, positions, config.rope_theta)).max()):.1e}",
)

# %% [markdown]
# ## 5. The plan and the summary
#
# With `lengths="auto"` the stack plans its nesting of scans the first time it traces
# a shape, choosing among all nestings and the innermost remat policy by a memory
# model. {py:func}`sr.plan_remat <statefulremat.plan_remat>` makes the same call for us to look at;
# with few layers there is little to choose, and with hundreds it is where the memory goes
# (tutorial 4).


# %%
def block_fn(layer, x):
  return layer(x, positions, jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), 0.0, -jnp.inf))


plan = sr.plan_remat(
  model.blocks, jax.ShapeDtypeStruct((BATCH, SEQ, config.dim), jnp.float32), fn=block_fn
)
print(plan)
print(sr.summary(model, tokens))

# %% [markdown]
# ## 6. Training
#
# A few steps of AdamW on bytes of the standard library (as in tutorial 7), batches of
# `BATCH` windows; {py:class}`sr.Optimizer <statefulremat.Optimizer>` keeps its moments as Variables
# next to the model, and {py:func}`sr.jit <statefulremat.jit>` compiles the step once.

# %%
stdlib = pathlib.Path(os.__file__).parent
data = np.frombuffer(b"\n".join(p.read_bytes() for p in sorted(stdlib.glob("[a-c]*.py"))), np.uint8)
rng = np.random.default_rng(0)
optimizer = sr.Optimizer(model, optax.adamw(3e-3, weight_decay=0.01))


@sr.jit
def train_step(model, optimizer, batch):
  loss, grads = sr.value_and_grad(loss_ours)(model, batch)
  optimizer.update(grads)
  return loss


losses = []
for step in range(STEPS):
  starts = rng.integers(0, len(data) - SEQ, BATCH)
  batch = jnp.asarray(data[starts[:, None] + np.arange(SEQ)].astype(np.int32))
  losses.append(float(train_step(model, optimizer, batch)))
  if step % max(1, STEPS // 10) == 0 or step == STEPS - 1:
    print(f"step {step:3d}: loss {losses[-1]:.3f}")
assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses

# %% [markdown]
# ## 7. Decoding with the key/value cache
#
# Greedy decoding, one token per call: `init_cache` on the stack's attention makes
# one cache per layer (shape `(layers, batch, kv_heads, max_length, head_dim)`),
# {py:meth}`set_attributes(decode=True) <statefulremat.Module.set_attributes>` switches every
# layer's attention to reading and appending to it, and each step feeds only the newest token. As a
# check, every step is also done the slow way: the whole sequence so far through the full causal
# forward, whose last logits must match and pick the same token.


# %%
@sr.jit
def decode_step(model, token, t):
  return model(token[:, None], start=t)[:, -1]


@sr.jit
def full_forward(model, tokens):
  return model(tokens)


prompt = jnp.asarray(np.frombuffer(b"def ", np.uint8).astype(np.int32))[None]
max_length = prompt.shape[1] + DECODE
model.blocks.attention.init_cache(batch=1, max_length=max_length)
model.set_attributes(decode=True)
print("cache:", model.blocks.attention.cached_key.shape)  # pyright: ignore[reportOptionalMemberAccess]  (None until init_cache)
for t in range(prompt.shape[1] - 1):  # the prompt fills the cache
  decode_step(model, prompt[:, t], jnp.int32(t))
sequence, worst = prompt, 0.0
for t in range(prompt.shape[1] - 1, max_length - 1):
  cached = decode_step(model, sequence[:, t], jnp.int32(t))
  model.set_attributes(decode=False)
  # Padded to one length (one compile); causal, so the padding after t is not seen.
  padded = jnp.pad(sequence, ((0, 0), (0, max_length - sequence.shape[1])))
  full = full_forward(model, padded)[:, t]
  model.set_attributes(decode=True)
  worst = max(worst, float(jnp.abs(cached - full).max()))
  assert int(cached.argmax(-1)[0]) == int(full.argmax(-1)[0])
  sequence = jnp.concatenate([sequence, cached.argmax(-1)[:, None]], axis=1)
model.set_attributes(decode=False)
print(f"{DECODE} tokens, cached == full forward; max |logit difference| {worst:.1e}")
np.testing.assert_allclose(worst, 0.0, atol=1e-4)
print(repr(bytes(np.asarray(sequence[0], np.uint8))))

# %% [markdown]
# ## 8. Back to nnx
#
# {py:func}`sr.interop.to_nnx <statefulremat.interop.to_nnx>` writes ours into their model with the
# same `rename` (their names are renamed and find ours), the stack going back into their list of
# layers. The float32 copy of their model then computes our trained logits. (To put them back
# into their bfloat16 model one casts first, and rounds the trained weights.) The
# decoding cache is ours alone, so only the parameters travel.

# %%
sr.interop.to_nnx(model, theirs32, collections=("params",), rename=RENAME)
np.testing.assert_allclose(theirs32(tokens, causal), model(tokens), rtol=1e-5, atol=1e-5)
print(
  "their model with our trained weights: same logits;",
  f"whole tutorial {time.perf_counter() - started:.0f}s",
)
