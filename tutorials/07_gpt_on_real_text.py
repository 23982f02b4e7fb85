# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 7. A GPT on real text
#
# Everything from the earlier tutorials, end to end, on a model users care about: a
# byte-level GPT trained on the Python standard library's own source code (every Python
# ships it, so there is nothing to download). Token and position embeddings, pre-LN
# transformer blocks stacked with {py:func}`sr.remat_scan <statefulremat.remat_scan>`, AdamW through
# {py:class}`sr.Optimizer <statefulremat.Optimizer>`, a checkpoint taken and resumed mid-run, and
# sampling one byte at a time with a key/value cache per layer.

# %%
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from tqdm import tqdm

import statefulremat as sr

matplotlib.use("Agg")  # draw to a file; a notebook shows the saved figure below
import matplotlib.pyplot as plt  # noqa: E402

QUICK = os.environ.get("SR_TUTORIAL_QUICK") == "1"
LAYERS, DIM, HEADS, SEQ = (2, 32, 2, 32) if QUICK else (4, 128, 4, 128)
BATCH, STEPS, EVAL_EVERY = (8, 10, 5) if QUICK else (16, 300, 25)
TEXT_BYTES = 200_000 if QUICK else 3_000_000  # how much of the standard library to read
DROPOUT, LR = 0.1, 3e-3
OUT = pathlib.Path(os.environ.get("SR_TUTORIAL_OUT", "tutorial_out"))
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## Data: the standard library, as bytes
#
# The model reads bytes, so the vocabulary is the 256 byte values and no tokenizer is
# needed. The files are read in sorted order until `TEXT_BYTES`, so the data is the
# same on every run (for one Python version); the last 10% of it (the last files in
# that order) is held out for validation, so validation text is code the model never
# trained on.

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
print(
  f"{len(chunks)} files from {stdlib}: {len(train_data):,} bytes to train on, "
  f"{len(val_data):,} to validate on"
)


def batches(data, rng):
  """Endless random windows: inputs and the same bytes shifted by one (the targets)."""
  while True:
    starts = rng.integers(0, len(data) - SEQ - 1, BATCH)
    window = data[starts[:, None] + np.arange(SEQ + 1)].astype(np.int32)
    yield jnp.asarray(window[:, :-1]), jnp.asarray(window[:, 1:])


train_batches = batches(train_data, np.random.default_rng(0))
x, y = next(train_batches)
print("a training window:", repr(bytes(np.asarray(x[0], np.uint8)).decode("utf-8", "replace")))

# %% [markdown]
# ## The model: pre-LN blocks in a remat_scan stack
#
# A block is `x + attn(ln1(x))` then `x + mlp(ln2(x))`, with dropout on both
# branches. `sr.remat_scan(Block, "auto", length=LAYERS)` is a class: building it
# initialises `LAYERS` blocks at once (vmapped, each its own random draw), and calling
# it scans over them with rematerialisation, in nested scans whose `lengths` are
# planned at trace time from the activations' shapes. The GPT around it embeds bytes
# and positions and reads the logits off the token embedding
# ({py:meth}`Embed.attend <statefulremat.nn.Embed.attend>`, tied weights). `start` is the position
# of the first input: 0 in training, the current position when decoding one byte at a time.


# %%
class Block(sr.Module):
  def __init__(self, *, rngs):
    self.ln1 = sr.nn.LayerNorm(DIM, rngs=rngs)
    self.attn = sr.nn.MultiHeadAttention(HEADS, DIM, rngs=rngs)
    self.drop = sr.nn.Dropout(DROPOUT, rngs=rngs)
    self.ln2 = sr.nn.LayerNorm(DIM, rngs=rngs)
    self.mlp = sr.nn.MLP(DIM, 4 * DIM, dropout_rate=DROPOUT, rngs=rngs)

  def __call__(self, x):
    x = x + self.drop(self.attn(self.ln1(x), is_causal=True))
    return x + self.mlp(self.ln2(x))


Blocks = sr.remat_scan(Block, "auto", length=LAYERS)


class GPT(sr.Module):
  def __init__(self, *, rngs):
    self.tokens = sr.nn.Embed(256, DIM, rngs=rngs)
    self.positions = sr.nn.Embed(SEQ, DIM, rngs=rngs)
    self.drop = sr.nn.Dropout(DROPOUT, rngs=rngs)
    self.blocks = Blocks(rngs=rngs)
    self.ln = sr.nn.LayerNorm(DIM, rngs=rngs)

  def __call__(self, tokens, start=0):
    positions = start + jnp.arange(tokens.shape[-1])
    h = self.drop(self.tokens(tokens) + self.positions(positions))
    return self.tokens.attend(self.ln(self.blocks(h)))


model = GPT(rngs=sr.Rngs(params=0, dropout=1))
print(sr.summary(model, x))

# %% [markdown]
# ## Training: sr.Optimizer, a jitted step, a progress bar
#
# The step is the one from tutorial 1 with a cross-entropy loss.
# {py:func}`sr.jit <statefulremat.jit>` compiles it once; the dropout keys advance inside it (their
# counters are part of the model's state), so every step draws new masks. Validation runs in
# {py:meth}`eval() <statefulremat.Module.eval>` mode (no dropout) on a fixed set of held-out
# windows.


# %%
def loss_fn(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@sr.jit
def train_step(model, opt, x, y):
  loss, grads = sr.value_and_grad(loss_fn)(model, x, y)
  opt.update(grads)
  return loss


val_set = [b for b, _ in zip(batches(val_data, np.random.default_rng(1)), range(4))]
val_loss_fn = sr.jit(loss_fn)


def validate(model):
  model.eval()
  loss = np.mean([float(val_loss_fn(model, vx, vy)) for vx, vy in val_set])
  model.train()
  return loss


def make_optimizer(model):
  schedule = optax.warmup_cosine_decay_schedule(0.0, LR, max(1, STEPS // 20), STEPS)
  return sr.Optimizer(model, optax.adamw(schedule, weight_decay=0.01))


opt = make_optimizer(model)
train_losses, val_losses = [], []


def train(model, opt, steps):
  start = time.perf_counter()
  bar = tqdm(range(len(train_losses), len(train_losses) + steps), desc="train")
  for step in bar:
    if step % EVAL_EVERY == 0:
      val_losses.append((step, validate(model)))
    train_losses.append(float(train_step(model, opt, *next(train_batches))))
    bar.set_postfix(loss=f"{train_losses[-1]:.3f}", val=f"{val_losses[-1][1]:.3f}")
  print(
    f"{steps} steps in {time.perf_counter() - start:.1f}s; "
    f"loss {train_losses[-1]:.3f}, validation {val_losses[-1][1]:.3f}"
  )


train(model, opt, STEPS // 2)

# %% [markdown]
# ## Save, restore, and the next step is the same
#
# {py:func}`sr.save(path, [model, opt]) <statefulremat.save>` writes every
# {py:class}`Variable <statefulremat.Variable>`: parameters, the optimizer's moments and step count,
# and the dropout streams' keys and counters. Restored into a freshly built model and optimizer
# (other seeds), the next training step computes exactly the same loss as the original's: the run
# resumes as if never interrupted.

# %%
ckpt = OUT / "07_checkpoint"
sr.save(ckpt, [model, opt])
fresh = GPT(rngs=sr.Rngs(params=10, dropout=11))
fresh_opt = make_optimizer(fresh)
sr.restore(ckpt, [fresh, fresh_opt])

x, y = next(train_batches)
loss_original = float(train_step(model, opt, x, y))
loss_restored = float(train_step(fresh, fresh_opt, x, y))
print(f"next loss: original {loss_original!r}, restored {loss_restored!r}")
assert loss_original == loss_restored

# %% [markdown]
# Training goes on with the restored model:

# %%
model, opt = fresh, fresh_opt
train_losses.append(loss_restored)
train(model, opt, STEPS - len(train_losses))
val_losses.append((STEPS, validate(model)))

plt.figure(figsize=(6, 3.5))
plt.plot(train_losses, label="train", alpha=0.7)
plt.plot(*zip(*val_losses), "o-", label="validation")
plt.axvline(STEPS // 2, color="gray", ls=":", label="save / restore")
plt.xlabel("step")
plt.ylabel("cross-entropy (nats per byte)")
plt.legend()
plt.tight_layout()
plt.savefig(OUT / "07_losses.png", dpi=100)
print("final validation loss", f"{val_losses[-1][1]:.3f};", "plot:", OUT / "07_losses.png")

# %% [markdown]
# ## Decoding with a key/value cache per layer
#
# To sample, each attention layer keeps the keys and values of the positions seen so
# far. On the stack,
# {py:meth}`model.blocks.attn.init_cache((batch, max_length, DIM)) <statefulremat.nn.MultiHeadAttention.init_cache>`
# makes one cache per layer, stacked along the layer axis like the parameters, and
# {py:meth}`set_attributes(decode=True) <statefulremat.Module.set_attributes>` switches every
# attention to decoding: each call then takes one position, attends to the cache, and appends to it.
# The same blocks that trained on whole sequences decode; the cached logits equal the full
# forward's.


# %%
@sr.jit
def decode_step(model, token, t):
  return model(token[:, None], start=t)[:, -1]


prompt = np.frombuffer(b"def main(", dtype=np.uint8).astype(np.int32)[None]
model.eval()
full = model(jnp.asarray(prompt))  # the whole prompt at once, no cache

model.blocks.attn.init_cache((1, SEQ, DIM))
model.set_attributes(decode=True)
cached = jnp.stack(
  [decode_step(model, jnp.asarray(prompt[:, t]), jnp.int32(t)) for t in range(prompt.shape[1])],
  axis=1,
)
print(
  "cache:",
  model.blocks.attn.cached_key.shape,  # pyright: ignore[reportOptionalMemberAccess]  (None until init_cache)
  "| max |cached - full| logits:",
  float(jnp.abs(cached - full).max()),
)
assert jnp.allclose(cached, full, atol=1e-4)

# %% [markdown]
# Sampling continues from the cache, one byte per call, drawing each from the softmax
# of the logits divided by a temperature (below 1: more conservative). A fixed key
# makes the sample reproducible. After the few minutes of CPU training above, expect
# indentation, line breaks and fragments of keywords rather than Python; more steps, a
# wider model or more layers (only `LAYERS` changes: the stack plans its own remat)
# take it further.

# %%
key, temperature = jax.random.key(0), 0.8
logits, out = cached[:, -1], list(prompt[0])
for t in range(prompt.shape[1], SEQ):
  token = jax.random.categorical(jax.random.fold_in(key, t), logits / temperature)
  out.append(int(token[0]))
  logits = decode_step(model, token, jnp.int32(t))
print(bytes(out).decode("utf-8", "replace"))
