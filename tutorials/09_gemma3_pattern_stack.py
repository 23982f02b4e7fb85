# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 9. A Gemma-3-like model as one pattern stack
#
# Gemma 3 does not repeat one block: it repeats a *pattern* of six, five layers of
# local (sliding-window) attention then one of global attention. The local layers see
# only the last `WINDOW` positions and rotate with RoPE base 10,000; the global layer
# sees the whole past and uses base 1,000,000. Every layer has grouped-query attention
# (fewer key/value heads than query heads), RMSNorm before and after the attention and
# the MLP, and a gated GELU MLP; the logits are read off the token embedding (tied
# weights).
#
# {py:func}`sr.remat_scan((Local,) * 5 + (Global,), length=LAYERS, lengths="auto") <statefulremat.remat_scan>`
# makes the whole stack one module: layer `i` is a `Local` or a `Global` block by `i % 6`, the
# length need not be a multiple of six, the scan runs over whole cycles (one traced
# body, whatever the depth) with rematerialisation planned at trace time. Below it is
# trained on the standard library's source (as in tutorial 7), saved and restored into
# a stack with other `lengths`, and sampled with a key/value cache per layer.

# %%
import functools
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import treescope

import statefulremat as sr

QUICK = os.environ.get("SR_TUTORIAL_QUICK") == "1"
# Gemma 3 1B has 26 layers: four full cycles of six and a short fifth one of two.
LAYERS, DIM, HEADS, KV_HEADS, SEQ, WINDOW = (
  (8, 32, 4, 2, 32, 8) if QUICK else (26, 64, 4, 1, 128, 32)
)
BATCH, STEPS, LR = (8, 10, 3e-3) if QUICK else (16, 300, 3e-3)
TEXT_BYTES = 200_000 if QUICK else 3_000_000
OUT = pathlib.Path(os.environ.get("SR_TUTORIAL_OUT", "tutorial_out"))
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## Data: the standard library, as bytes
#
# As in tutorial 7: the vocabulary is the 256 byte values, the text is the standard
# library's `*.py` files in sorted order, and the last 10% is held out.

# %%
stdlib = pathlib.Path(os.__file__).parent
chunks, size = [], 0
for path in sorted(stdlib.glob("*.py")):
  chunks.append(path.read_bytes())
  size += len(chunks[-1])
  if size >= TEXT_BYTES:
    break
data = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
split = int(0.9 * len(data))
train_data, val_data = data[:split], data[split:]
print(f"{len(chunks)} files: {len(train_data):,} bytes to train on, {len(val_data):,} held out")


def batches(data, rng):
  """Endless random windows: inputs and the same bytes shifted by one (the targets)."""
  while True:
    starts = rng.integers(0, len(data) - SEQ - 1, BATCH)
    window = data[starts[:, None] + np.arange(SEQ + 1)].astype(np.int32)
    yield jnp.asarray(window[:, :-1]), jnp.asarray(window[:, 1:])


train_batches = batches(train_data, np.random.default_rng(0))

# %% [markdown]
# ## One block, two kinds
#
# A single `Block` class serves both kinds; `functools.partial` fixes what differs,
# and a pattern takes partials as elements. `window=None` is global attention.
#
# The sliding window is a mask handed to the attention (`mask=`, False = do not
# attend); `is_causal=True` overlays the causal mask. Training sees whole sequences, so
# the mask is `query - key < WINDOW` over the sequence. Decoding feeds one position
# at a time and the attention's cache holds every key so far; its own mask lets the
# query see the positions written, and the window mask cuts that to the last `WINDOW`:
# key `j` is seen from position `t` (the cache index) when `j > t - WINDOW`.
#
# Gemma keeps only `WINDOW` keys in a local layer's cache (a ring buffer).
# {py:class}`sr.nn.MultiHeadAttention <statefulremat.nn.MultiHeadAttention>`'s cache is linear
# (position `t` is written at slot `t`, and decoding past `max_length` raises), so here the local
# layers keep a full-length cache and the mask does the windowing: the same numbers, at the cost of
# the local layers' cache memory (`max_length` keys, not `WINDOW`).
#
# Gemma 3 also normalises queries and keys with an RMSNorm (`normalize_qk` here uses a
# LayerNorm without bias, nnx's choice) and scales the embeddings by `sqrt(DIM)`; the
# first is left out, the second kept.


# %%
class Block(sr.Module):
  def __init__(self, *, window, rope_base, rngs):
    self.window = window
    self.attn_norm = sr.nn.RMSNorm(DIM, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(
      HEADS, DIM, num_kv_heads=KV_HEADS, rope_base=rope_base, use_bias=False, rngs=rngs
    )
    self.attn_out_norm = sr.nn.RMSNorm(DIM, rngs=rngs)
    self.mlp_norm = sr.nn.RMSNorm(DIM, rngs=rngs)
    self.gate = sr.nn.Linear(DIM, 4 * DIM, use_bias=False, rngs=rngs)
    self.up = sr.nn.Linear(DIM, 4 * DIM, use_bias=False, rngs=rngs)
    self.down = sr.nn.Linear(4 * DIM, DIM, use_bias=False, rngs=rngs)
    self.mlp_out_norm = sr.nn.RMSNorm(DIM, rngs=rngs)

  def window_mask(self, length):
    """``[batch=1, heads=1, q_len, kv_len]``; None (no window) for a global layer."""
    if self.window is None:
      return None
    if self.attn.decode and self.attn.cached_key is not None:
      # One query, at the cache index, against the whole cache. (Without a cache the
      # attention raises, saying how to make one.)
      assert self.attn.cache_index is not None  # init_cache makes it with cached_key
      t = self.attn.cache_index.value
      keys = jnp.arange(self.attn.cached_key.shape[-3])
      return (keys > t - self.window)[None, None, None, :]
    positions = jnp.arange(length)
    return (positions[:, None] - positions[None, :] < self.window)[None, None]

  def __call__(self, x):
    h = self.attn(self.attn_norm(x), mask=self.window_mask(x.shape[-2]), is_causal=True)
    x = x + self.attn_out_norm(h)
    h = self.mlp_norm(x)
    h = self.down(jax.nn.gelu(self.gate(h)) * self.up(h))
    return x + self.mlp_out_norm(h)


Local = functools.partial(Block, window=WINDOW, rope_base=10_000.0)
Global = functools.partial(Block, window=None, rope_base=1_000_000.0)
PATTERN = (Local,) * 5 + (Global,)
Blocks = sr.remat_scan(PATTERN, length=LAYERS, lengths="auto")


class GemmaLike(sr.Module):
  def __init__(self, blocks=Blocks, *, rngs):
    self.embed = sr.nn.Embed(256, DIM, rngs=rngs)
    self.blocks = blocks(rngs=rngs)
    self.norm = sr.nn.RMSNorm(DIM, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens) * jnp.sqrt(jnp.float32(DIM))
    return self.embed.attend(self.norm(self.blocks(h)))  # tied: logits = h @ table.T


model = GemmaLike(rngs=sr.Rngs(0))

# %% [markdown]
# ## What the stack holds
#
# `model.blocks.pattern[k]` is position `k` of the pattern: an ordinary stack of the
# layers `k, k + 6, k + 12, ...`, whose {py:class}`Variable <statefulremat.Variable>`s carry a layer
# axis of that many layers (positions before the short last cycle have one more).
# `model.blocks.layer(i)` is layer `i` as a plain `Block` (a copy), and `len` counts layers.

# %%
blocks = model.blocks
print(f"{len(blocks)} layers; pattern of {len(blocks.pattern)}:")
for k, position in enumerate(blocks.pattern):
  print(
    f"  pattern[{k}]: {len(position)} layers, window={position.window}, "
    f"query kernel {position.attn.query.kernel.shape}, "
    f"key kernel {position.attn.key.kernel.shape}"
  )
layer = blocks.layer(LAYERS - 1)
print(
  f"layer {LAYERS - 1}: {type(layer).__name__}, window={layer.window}, "
  f"rope_base={layer.attn.rope_base}, query kernel {layer.attn.query.kernel.shape}"
)
assert np.array_equal(
  layer.attn.query.kernel.value, blocks.pattern[(LAYERS - 1) % 6].attn.query.kernel.value[-1]
)

# %% [markdown]
# {py:func}`sr.summary <statefulremat.summary>` tables every module with its parameter count and
# output shapes (traced with `jax.eval_shape`, nothing computed); each position of the pattern is a
# row with its layer count. {py:func}`sr.display <statefulremat.display>` draws a module: in a
# notebook a foldable tree with the stacked arrays as figures, in a script its text. Here it draws
# the global position (the whole model as text runs to hundreds of lines), and
# `treescope.render_to_html` writes the whole model's interactive view to a file.

# %%
x, y = next(train_batches)
print(sr.summary(model, x))
sr.display(model.blocks.pattern[5])
with treescope.active_autovisualizer.set_scoped(treescope.ArrayAutovisualizer()):
  html = treescope.render_to_html(model)
(OUT / "09_model.html").write_text(html)
print(f"wrote {OUT / '09_model.html'} ({len(html) / 1024:.0f} KiB)")

# %% [markdown]
# ## The remat plan
#
# `lengths="auto"` plans the nesting of the scan when the stack is traced, from the
# shapes of the activations; for a pattern it plans *cycles* (here
# `ceil(LAYERS / 6)` of them). {py:func}`sr.plan_remat <statefulremat.plan_remat>` shows the choice
# before anything runs:

# %%
carry = jax.ShapeDtypeStruct((BATCH, SEQ, DIM), jnp.float32)
plan = sr.plan_remat(model.blocks, carry)
print(plan)

# %% [markdown]
# ## Training
#
# AdamW through {py:class}`sr.Optimizer <statefulremat.Optimizer>`, a jitted step, as in tutorial 7.


# %%
def loss_fn(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@sr.jit
def train_step(model, opt, x, y):
  loss, grads = sr.value_and_grad(loss_fn)(model, x, y)
  opt.update(grads)
  return loss


val_set = [b for b, _ in zip(batches(val_data, np.random.default_rng(1)), range(4))]
val_loss = sr.jit(loss_fn)
schedule = optax.warmup_cosine_decay_schedule(0.0, LR, max(1, STEPS // 20), STEPS)
opt = sr.Optimizer(model, optax.adamw(schedule, weight_decay=0.01))

before = np.mean([float(val_loss(model, vx, vy)) for vx, vy in val_set])
start, losses = time.perf_counter(), []
for step in range(STEPS):
  losses.append(float(train_step(model, opt, *next(train_batches))))
  if step % max(1, STEPS // 10) == 0 or step == STEPS - 1:
    print(f"step {step:4d}  loss {losses[-1]:.3f}")
after = np.mean([float(val_loss(model, vx, vy)) for vx, vy in val_set])
print(
  f"{STEPS} steps in {time.perf_counter() - start:.1f}s; held-out loss "
  f"{before:.3f} -> {after:.3f} nats per byte"
)
assert after < before and np.mean(losses[-3:]) < losses[0]

# %% [markdown]
# ## A checkpoint restores into another nesting
#
# A remat_scan stack keeps one flat layer axis per position whatever its `lengths`, so
# a checkpoint taken with one plan restores into a stack with another: here the
# trained model, planned automatically, is restored into one whose cycles run in two
# nested levels, the outer one of two steps (the last step short when the number of
# cycles is odd). The logits agree.

# %%
ckpt = OUT / "09_checkpoint"
sr.save(ckpt, model)
cycles = -(-LAYERS // len(PATTERN))
lengths = (2, -(-cycles // 2))
assert lengths != plan.lengths
other = GemmaLike(sr.remat_scan(PATTERN, length=LAYERS, lengths=lengths), rngs=sr.Rngs(1))
sr.restore(ckpt, other)
difference = float(jnp.abs(other(x) - model(x)).max())
print(f"restored into lengths={lengths}: max |logits difference| {difference:.2e}")
assert difference < 1e-4

# %% [markdown]
# ## Decoding with a key/value cache per layer
#
# Each position of the pattern is an ordinary stack, so its attention makes one cache
# per layer, stacked along its layer axis:
# {py:meth}`init_cache <statefulremat.nn.MultiHeadAttention.init_cache>` on each `pattern[k].attn`.
# {py:meth}`set_attributes(decode=True) <statefulremat.Module.set_attributes>` switches every
# attention to decoding (one position per call). With grouped-query attention the cache holds
# `KV_HEADS` heads, not `HEADS`. Decoding the prompt one byte at a time gives the logits of the full
# causal forward: the window masks agree with the training ones.


# %%
def init_caches(model, batch):
  for position in model.blocks.pattern:
    position.attn.init_cache((batch, SEQ, DIM))


@sr.jit
def decode_step(model, token):
  return model(token[:, None])[:, -1]


prompt = np.frombuffer(b"def main(", dtype=np.uint8).astype(np.int32)[None]
full = model(jnp.asarray(prompt))  # the whole prompt at once, no cache

init_caches(model, 1)
model.set_attributes(decode=True)
cached = jnp.stack(
  [decode_step(model, jnp.asarray(prompt[:, t])) for t in range(prompt.shape[1])], axis=1
)
print(
  "cache of pattern[0]:",
  model.blocks.pattern[0].attn.cached_key.shape,
  "(layers, batch, max_length, kv heads, head dim)",
)
print("max |cached - full| logits:", float(jnp.abs(cached - full).max()))
assert jnp.allclose(cached, full, atol=1e-4)

# %% [markdown]
# Sampling goes on from the cache, one byte per call, from the softmax of the logits
# over a temperature. Past `WINDOW` bytes the local layers no longer see the start;
# only the global layers do. The logits of every step are kept: the causal forward
# over the whole sample, without the cache, recomputes them, so the window masks are
# checked beyond the window as well.

# %%
key, temperature = jax.random.key(0), 0.8
steps, out = [cached], list(prompt[0])
for t in range(prompt.shape[1], SEQ):
  token = jax.random.categorical(jax.random.fold_in(key, t), steps[-1][:, -1] / temperature)
  out.append(int(token[0]))
  if t < SEQ - 1:
    steps.append(decode_step(model, token)[:, None])
print(bytes(out).decode("utf-8", "replace"))

model.set_attributes(decode=False)
recomputed = model(jnp.asarray(out[:-1])[None])
decoded = jnp.concatenate(steps, axis=1)
print(
  f"{decoded.shape[1]} positions, max |cached - recomputed| logits:",
  float(jnp.abs(decoded - recomputed).max()),
)
assert jnp.allclose(decoded, recomputed, atol=1e-3)
