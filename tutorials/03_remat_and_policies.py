# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 3. Remat and policies
#
# To compute gradients, reverse-mode autodiff keeps intermediate values of the forward
# pass (the *residuals*) until the backward pass needs them. Rematerialisation
# (`jax.checkpoint`, "remat") keeps fewer of them and recomputes the rest during the
# backward pass: less memory, more compute. {py:func}`sr.remat <statefulremat.remat>` is
# `jax.checkpoint` for modules, and a **{term}`policy`** says which intermediates are still worth
# saving. This tutorial looks at what each choice saves, then at what XLA allocates for it.

# %%
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import statefulremat as sr

QUICK = os.environ.get("SR_TUTORIAL_QUICK") == "1"
BATCH, DIM = (256, 128) if QUICK else (1024, 256)  # for the memory figures
LAYERS = 4 if QUICK else 24
P = jax.checkpoint_policies

# %% [markdown]
# A residual MLP block. `checkpoint_name` tags the hidden pre-activation `"hidden"`, so
# a policy can refer to it by name. The block returns `(carry, output)` so that we can
# also scan it below.


# %%
class Block(sr.Module):
  def __init__(self, dim, *, rngs):
    self.up = sr.nn.Linear(dim, 4 * dim, rngs=rngs)
    self.down = sr.nn.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x):
    hidden = checkpoint_name(self.up(x), "hidden")
    return x + self.down(jnp.tanh(hidden)), None


# %% [markdown]
# ## What is saved
#
# `sr.remat(Block, policy=...)` returns a subclass of `Block` whose `__call__` runs
# under `jax.checkpoint`. `jax.ad_checkpoint.print_saved_residuals` takes a function of
# arrays, so we {py:func}`sr.split <statefulremat.split>` the model into its
# {py:class}`GraphDef <statefulremat.GraphDef>` and its arrays and
# {py:func}`sr.merge <statefulremat.merge>` it back inside the loss. Each printed line is one saved
# array and where it came from.


# %%
def loss_fn(graphdef):
  """The loss as a function of the model's arrays (these blocks hold only Params)."""

  def loss(params, x):
    out, _ = sr.merge(graphdef, params)(x)
    return jnp.mean(out**2)

  return loss


x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
variants = {
  "no remat": Block,
  "remat, policy=None (save nothing)": sr.remat(Block),
  "remat, save_only_these_names('hidden')": sr.remat(
    Block, policy=P.save_only_these_names("hidden")
  ),
  "remat, dots_with_no_batch_dims_saveable": sr.remat(
    Block, policy=P.dots_with_no_batch_dims_saveable
  ),
}
for name, cls in variants.items():
  graphdef, params = sr.split(cls(8, rngs=sr.Rngs(0)))
  print(f"--- {name}")
  print_saved_residuals(loss_fn(graphdef), params, x)

# %% [markdown]
# Without remat the backward pass keeps `tanh`'s output and its derivative (`sub`:
# `1 - tanh**2`). With `policy=None` only the block's inputs remain: the parameters and
# `x`. The two policies each keep one `[4, 32]` array of the hidden layer again: the
# named pre-activation, or the output of the matrix multiplication (before the bias),
# a dot with no batch dimensions. Whatever is saved, the gradients are the same:

# %%
graphdef, params = sr.split(Block(8, rngs=sr.Rngs(0)))
remat_graphdef, remat_params = sr.split(sr.remat(Block)(8, rngs=sr.Rngs(0)))
g0 = jax.jit(jax.grad(loss_fn(graphdef)))(params, x)
g1 = jax.jit(jax.grad(loss_fn(remat_graphdef)))(remat_params, x)
print("same gradients:", all(jax.tree.leaves(jax.tree.map(np.allclose, g0, g1))))

# %% [markdown]
# ## What XLA allocates
#
# The compiled program reports its memory: `jax.jit(f).lower(*args).compile()
# .memory_analysis().temp_size_in_bytes` is the scratch memory of the gradient
# computation, residuals included. Compiling needs only shapes, so we build each model
# under `jax.eval_shape`: its arrays come out as `jax.ShapeDtypeStruct`s and nothing is
# allocated or run. First `LAYERS` blocks called in a Python loop, with and without
# remat:


# %%
class Net(sr.Module):
  def __init__(self, block_cls, *, rngs):
    self.blocks = [block_cls(DIM, rngs=rngs) for _ in range(LAYERS)]

  def __call__(self, x):
    for block in self.blocks:
      x, _ = block(x)
    return x, None


def temp_mib(make_model):
  """Temp memory of the compiled gradient of the model make_model() builds."""
  box = {}

  def build():
    box["graphdef"], params = sr.split(make_model())
    return params

  params = jax.eval_shape(build)
  x = jax.ShapeDtypeStruct((BATCH, DIM), jnp.float32)
  compiled = jax.jit(jax.grad(loss_fn(box["graphdef"]))).lower(params, x).compile()
  memory = compiled.memory_analysis()
  assert memory is not None, f"{jax.default_backend()} reports no memory analysis"
  return memory.temp_size_in_bytes / 2**20


print(f"backend: {jax.default_backend()}, batch {BATCH}, width {DIM}, {LAYERS} blocks")
for name, cls in {"no remat": Block, "remat": sr.remat(Block)}.items():
  mib = temp_mib(lambda: Net(cls, rngs=sr.Rngs(0)))
  print(f"Python loop, {name:9} {mib:7.2f} MiB")

# %% [markdown]
# On the CPU backend the two agree. In a straight-line program XLA sees the forward
# computation and its recomputation side by side; it drops the optimisation barriers
# that `jax.checkpoint` put between them and merges the two, so the saving is undone.
# Remat pays off when the recomputation *cannot* be merged: inside a `scan`, whose
# backward loop recomputes one layer per iteration. {py:func}`sr.scan <statefulremat.scan>` over the
# remat'd block (`prevent_cse=False` is the recommended setting under a scan):


# %%
def scanned(block_cls):
  return sr.scan(
    block_cls, length=LAYERS, variable_axes={sr.Param: 0}, split_rngs={"params": True}
  )(DIM, rngs=sr.Rngs(0))


for name, cls in {
  "scan, no remat": Block,
  "scan(remat), policy=None": sr.remat(Block, prevent_cse=False),
  "scan(remat), save 'hidden'": sr.remat(
    Block, prevent_cse=False, policy=P.save_only_these_names("hidden")
  ),
}.items():
  print(f"{name:28} {temp_mib(lambda: scanned(cls)):7.2f} MiB")

# %% [markdown]
# Without remat the scan keeps, for every layer, the residuals listed at the top
# (`tanh`'s output and its derivative): more than XLA kept for the straight-line loop,
# where it optimises the whole program at once. With `policy=None` the scan keeps each
# layer's input (the carry) and recomputes the block in the backward loop. Saving `"hidden"` keeps
# the widest array of every layer and so lands in between: a policy trades memory for recomputation,
# one layer at a time. Tutorial 4 nests scans ({py:func}`sr.remat_scan <statefulremat.remat_scan>`)
# to go further: memory that grows like the square root of depth.
