# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 2. Stacked layers and scan
#
# A deep network often repeats one block N times. Instead of N Python objects,
# statefulremat builds **one** block whose variables carry an extra leading *{term}`layer axis`*
# of size N, and runs it with `jax.lax.scan`: the block is traced once, whatever N is.
# This tutorial builds such stacks, shows what happens to each collection (parameters,
# batch statistics, RNG streams) and checks the scan against a Python loop.

# %%
import os

import jax.numpy as jnp
import numpy as np

import statefulremat as sr

QUICK = os.environ.get("SR_TUTORIAL_QUICK") == "1"
LAYERS = 4 if QUICK else 12  # N, the number of stacked layers
DIM = 8
STEPS = 5  # time steps of the recurrent example
np.set_printoptions(precision=3, suppress=True)
data = np.random.default_rng(0)  # NumPy draws: inputs need no compiled ops

# %% [markdown]
# ## One block, N initialisations: `sr.vmap`
#
# The class form {py:func}`sr.vmap(Block, axis_size=N) <statefulremat.vmap>` returns a subclass of
# `Block` whose constructor traces `Block.__init__` under `jax.vmap` (not N times in Python), with
# the `params` RNG stream split so that every layer gets its own initialisation. Calling it
# maps `__call__` over the layers; with `in_axes=None` every layer sees the same input:
# an ensemble of N blocks.


# %%
class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.BatchNorm(dim, momentum=0.5, rngs=rngs)

  def __call__(self, x):
    x = x + jnp.tanh(self.norm(self.linear(x)))
    return x, None  # (carry, per-layer output): what a scan body returns


ensemble = sr.vmap(Block, axis_size=LAYERS, in_axes=None)(DIM, rngs=sr.Rngs(0))
kernels = np.asarray(ensemble.linear.kernel.value)
print(
  type(ensemble).__name__,
  "is a Block:",
  isinstance(ensemble, Block),
  "| layers:",
  len(ensemble),
  "| kernel",
  kernels.shape,
)
print("layers 0 and 1 initialised differently:", not np.allclose(kernels[0], kernels[1]))
x = jnp.asarray(data.standard_normal((16, DIM)), jnp.float32)
y, _ = ensemble(x)
print("ensemble output:", y.shape)

# %% [markdown]
# ## The same stack, applied in sequence: `sr.scan`
#
# {py:func}`sr.scan(Block, length=N, ...) <statefulremat.scan>` builds the stack the same way (the
# same seed gives the same kernels) but calls the layers one after another, passing the carry along.
# linen's vocabulary says what happens to each collection: `variable_axes` are sliced along the
# layer axis (layer i sees slice i); `split_rngs` gives each layer its own key from a
# stream. Here parameters *and* batch statistics are per layer.

# %%
Stack = sr.scan(
  Block, length=LAYERS, variable_axes={sr.Param: 0, sr.BatchStat: 0}, split_rngs={"params": True}
)
stack = Stack(DIM, rngs=sr.Rngs(0))
print("same kernels as the vmap init:", np.array_equal(stack.linear.kernel.value, kernels))

layers = sr.unstack(stack)  # N ordinary Blocks (copies), taken before the call
y, _ = stack(x)
print("output:", y.shape, "| running means:", stack.norm.mean.shape)
print("running mean of feature 0, per layer:", np.asarray(stack.norm.mean.value[:, 0]))

# %% [markdown]
# Every layer updated its own row of statistics. The scan is equivalent to a Python
# loop over the unstacked layers: the outputs agree, and so do every layer's
# statistics. ({py:func}`sr.jit <statefulremat.jit>` compiles the loop as written, unrolled, and
# writes the statistics back into `layers`; it only saves compiling each operation on its own.)


# %%
@sr.jit
def python_loop(layers, h):
  for layer in layers:
    h, _ = layer(h)
  return h


h = python_loop(layers, x)
print("output equals the loop:", bool(jnp.allclose(y, h, atol=1e-5)))
print(
  "statistics equal the loop's:",
  all(
    bool(jnp.allclose(stack.norm.mean.value[i], layer.norm.mean.value, atol=1e-5))
    for i, layer in enumerate(layers)
  ),
)
print(
  "stack.layer(2) is an ordinary",
  type(stack.layer(2)).__name__,
  "with kernel",
  stack.layer(2).linear.kernel.shape,
)

# %% [markdown]
# ## Carried state: one BatchNorm through every iteration
#
# Scanning over *time* instead of depth, a recurrent cell uses the same weights at every
# step (`variable_broadcast`: read-only) and one set of running statistics that each
# step updates and passes on (`variable_carry`). No `length`: it comes from `xs`.


# %%
class Cell(sr.Module):
  def __init__(self, dim, *, rngs):
    self.linear = sr.nn.Linear(dim, dim, rngs=rngs)
    self.norm = sr.nn.BatchNorm(dim, momentum=0.5, rngs=rngs)

  def __call__(self, h, x):
    h = jnp.tanh(self.linear(h) + self.norm(x))
    return h, h


# Step t's inputs have mean t, so the running mean has something to follow.
xs = data.standard_normal((STEPS, 16, DIM)) + np.arange(STEPS)[:, None, None]
xs = jnp.asarray(xs, jnp.float32)
Rnn = sr.scan(Cell, variable_broadcast=sr.Param, variable_carry=sr.BatchStat)
rnn = Rnn(DIM, rngs=sr.Rngs(0))
cell = Cell(DIM, rngs=sr.Rngs(1))  # a plain cell to step by hand...
sr.update(cell, sr.state(rnn))  # ...holding the same values (sr.update writes in place)
h, hs = rnn(jnp.zeros((16, DIM)), xs)
print("one kernel:", rnn.linear.kernel.shape, "| one running mean:", rnn.norm.mean.shape)


@sr.jit
def step_by_step(cell, h, xs):
  for t in range(STEPS):
    h, _ = cell(h, xs[t])
  return h


h_loop = step_by_step(cell, jnp.zeros((16, DIM)), xs)
print("running mean after", STEPS, "steps:", np.asarray(rnn.norm.mean.value[:3]), "...")
print(
  "h and running mean equal stepping by hand:",
  bool(jnp.allclose(h, h_loop, atol=1e-5)),
  bool(jnp.allclose(rnn.norm.mean.value, cell.norm.mean.value, atol=1e-5)),
)

# %% [markdown]
# A variable matched by no rule is read-only inside the scan. Writing to it raises an
# error that names the variable and the fix; the write is never silently dropped:

# %%
try:
  sr.scan(Cell, variable_broadcast=sr.Param)(DIM, rngs=sr.Rngs(0))(jnp.zeros((16, DIM)), xs)
except sr.TransformError as error:
  print(error)

# %% [markdown]
# ## Dropout: a key per layer, or one key for all
#
# With `split_rngs={"dropout": True}` each iteration gets its own dropout key, so every
# layer draws a different mask; with `False` every layer gets the same key, hence the
# same mask. Either way the stream advances once per call, so the next call draws new
# masks. Each row below is one layer's mask (1 = kept).


# %%
class Noise(sr.Module):
  def __init__(self, *, rngs):
    self.drop = sr.nn.Dropout(0.5, rngs=rngs)

  def __call__(self, carry):
    return carry, self.drop(jnp.ones(16)) > 0  # the mask is the per-layer output


for split in (True, False):
  Noisy = sr.scan(Noise, length=LAYERS, split_rngs={"dropout": split})
  noise = Noisy(rngs=sr.Rngs(dropout=3))
  _, masks = noise(None)
  _, next_masks = noise(None)
  print(f"split_rngs={{'dropout': {split}}}:")
  print(np.asarray(masks, dtype=int))
  print("next call draws new masks:", not np.array_equal(masks, next_masks))
